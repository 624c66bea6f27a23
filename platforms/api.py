"""OpenAI-compatible HTTP API: `POST /v1/chat/completions` (stream and not), `GET /v1/models` and
`GET /v1/models/{id}`; errors in OpenAI's shape on every path of the listener (`api_errors`).

A request is stateless, as in OpenAI's API — its messages are the whole conversation, passed to the
model as they came — unless it asks for a server-kept session (the `X-Session-Id` header or
`metadata.session_id`): then the daemon keeps the history, the request's last user message is the
new input and commands such as `/stop` work. Sessions belong to the tenant whose key opened them
(see `platforms/tenants.py`): the session key is `api:dm:<tenant>/<session id>`, so the same
session id under another key is another conversation. A client that goes away while its turn
runs has the run cancelled with the system reason "client disconnected" at once, streaming or
silent (a tool running): the daemon's HTTP server runs with aiohttp's `handler_cancellation`, so
the connection's loss cancels the request's handler, and the handler cancels the run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.core.attachments import MB
from gateway.core.cancellation import CLIENT_DISCONNECTED, REPLY_FAILED, Run
from gateway.core.ids import unique_id
from gateway.core.messages import Capabilities, ChatRef, ChatType, InboundMessage
from gateway.core.ports import UNAVAILABLE_RETRY_S, Outcome, Reply, StoreError, Submitted
from gateway.core.turn_options import TurnReport, options_of
from platforms.api_reply import ApiReply, ChatShape, Shape, error_response, json_response
from platforms.api_request import BadRequest, ChatRequest, read_request
from platforms.api_responses import ResponsesShape, read_responses
from platforms.base import Adapter
from platforms.http_input import read_json
from platforms.tenants import ApiKeys

log = logging.getLogger(__name__)

PLATFORM = "api"
CUT_OFF = "The worker that took this request stopped before it answered; send it again."

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _unauthorized() -> web.Response:
    return error_response(401, "Incorrect API key provided.", code="invalid_api_key")


class ApiAdapter(Adapter):
    name = PLATFORM
    capabilities = Capabilities(max_message_len=1 << 20, can_edit=False, can_stream=True)
    can_steer = False  # each request waits for an answer of its own
    answers_later = False  # ...on its own connection: a replay elsewhere or later reaches nobody

    def __init__(self, *, keys: list[str], tenants: dict[str, str] | None = None,
                 model_name: str = "switchboard", more_models: tuple[str, ...] = (),
                 max_attachment_bytes: int = 10 * MB, max_body_bytes: int = 4 * MB) -> None:
        self._keys = ApiKeys(keys, tenants)
        self.max_attachment_bytes = max_attachment_bytes  # a bigger data: URL is refused before it is decoded
        self.max_body_bytes = max_body_bytes  # a bigger body is refused (413) before it is read
        self.model_name = model_name
        self.models = (model_name, *more_models)  # what clients may name, the default first
        self._replies: dict[str, ApiReply] = {}

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/chat/completions", self._completions), web.post("/v1/responses", self._responses),
                web.get("/v1/models", self._models), web.get("/v1/models/{model}", self._model)]

    def middlewares(self) -> list[Middleware]:
        return [api_errors]

    # Outbound: there is no push channel; a reply exists only while its request is open.
    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        return ""

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        return None

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        options = options_of(msg)
        return self._replies.get(msg.message_id) or ApiReply(options.report if options else TurnReport())

    def _tenant(self, request: web.Request) -> str | None:
        """The caller's tenant ("" without keys), or None: not authorised."""
        return self._keys.tenant(request.headers.get("Authorization", ""))

    def _model_entry(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "switchboard"}

    async def _models(self, request: web.Request) -> web.Response:
        if self._tenant(request) is None:
            return _unauthorized()
        return json_response({"object": "list", "data": [self._model_entry(name) for name in self.models]})

    async def _model(self, request: web.Request) -> web.Response:
        if self._tenant(request) is None:
            return _unauthorized()
        name = request.match_info["model"]
        if name not in self.models:
            return error_response(404, f"The model `{name}` does not exist or you do not have access to it.",
                          code="model_not_found", param="model")
        return json_response(self._model_entry(name))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        if tenant is None:
            return _unauthorized()
        body = await read_json(request, lambda status, problem: error_response(status, problem),
                               max_bytes=self.max_body_bytes)
        if isinstance(body, web.Response):
            return body
        try:
            req = read_request(body, session_header=request.headers.get("X-Session-Id"), models=self.models,
                               max_bytes=self.max_attachment_bytes)
        except BadRequest as exc:
            return error_response(exc.status, exc.message, param=exc.param, code=exc.code)
        shape = ChatShape(req.model, streamed=req.stream, include_usage=req.include_usage)
        return await self._handle(request, self._ask(req, tenant), shape)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        if tenant is None:
            return _unauthorized()
        body = await read_json(request, lambda status, problem: error_response(status, problem),
                               max_bytes=self.max_body_bytes)
        if isinstance(body, web.Response):
            return body
        try:
            asked = read_responses(body)
            req = read_request(asked.chat, session_header=None, models=self.models, max_bytes=self.max_attachment_bytes)
        except BadRequest as exc:
            return error_response(exc.status, exc.message, param=exc.param, code=exc.code)
        if asked.previous is not None and req.session is not None:
            try:  # a chain this tenant never started (or another tenant's) has nothing stored here
                known = bool(await self.gateway.history(f"{PLATFORM}:dm:{_scoped(tenant, req.session)}"))
            except StoreError as exc:
                return error_response(503, f"The conversation could not be read ({exc}).", "service_unavailable",
                                      headers={"Retry-After": f"{UNAVAILABLE_RETRY_S:.0f}"})
            if not known:
                return error_response(404, f"Previous response with id '{asked.previous}' not found.",
                                      param="previous_response_id", code="previous_response_not_found")
        return await self._handle(request, self._ask(req, tenant), ResponsesShape(asked, req))

    async def _handle(self, request: web.Request, ask: _Ask, shape: Shape) -> web.StreamResponse:
        """Route the request's message and answer it in the shape of its API."""
        mid = ask.msg.message_id
        reply = self._replies[mid] = ApiReply(ask.request.options.report, ask.request.stream)
        try:
            submitted = await self._submit(ask)
            if submitted.outcome is Outcome.COMMAND:
                return await shape.command(request, submitted.detail)
            refusal = _refusal(submitted)
            if refusal is not None:
                return refusal
            if submitted.run is None:
                # Each request's message id is minted here, so "duplicate" can only be its inbox
                # entry delivered twice in cluster mode, first to a worker that stopped before it
                # answered (the turn it began is closed as interrupted). Cut off by a failure: the
                # client may send it again.
                return error_response(503, CUT_OFF, "service_unavailable",
                                      headers={"Retry-After": f"{UNAVAILABLE_RETRY_S:.0f}"})
            return await self._answer(request, ask.request, submitted.run, reply, shape)
        finally:
            self._replies.pop(mid, None)

    def _ask(self, req: ChatRequest, tenant: str) -> _Ask:
        """The request as a message for the router, carrying its options."""
        mid = unique_id()
        chat_id = _scoped(tenant, req.session or f"ephemeral-{mid}")
        # The end user names whose messages these are (the rate limit counts per end user); a
        # request that names none is its conversation's.
        user_id = _scoped(tenant, f"user:{req.end_user}") if req.end_user else chat_id
        msg = req.options.on(InboundMessage(
            platform=PLATFORM, chat_id=chat_id, chat_type=ChatType.DM, user_id=user_id,
            user_name=req.end_user or chat_id, message_id=mid, text=req.text, tenant=tenant or None,
            attachments=req.attachments))
        return _Ask(msg, req)

    async def _submit(self, ask: _Ask) -> Submitted:
        # The submission is not cancelled with the request (a half-routed message would never
        # be settled); if the client leaves meanwhile, its run is cancelled once it exists.
        req = ask.request
        submit = asyncio.ensure_future(self.gateway.submit(ask.msg, self) if req.session is not None else
                                       self.gateway.submit_stateless(ask.msg, self, list(req.history)))
        try:
            return await asyncio.shield(submit)
        except asyncio.CancelledError:
            submit.add_done_callback(_client_gone)
            raise

    async def _answer(self, request: web.Request, req: ChatRequest, run: Run, reply: ApiReply,
                      shape: Shape) -> web.StreamResponse:
        # Invariant: a run outlives its handler only by being cancelled. A client gone before the
        # stream's first write (its headers) fails the handler before the stream hooks its cancel.
        try:
            if req.stream:
                return await shape.stream(request, reply, functools.partial(run.cancel, CLIENT_DISCONNECTED))
            return await shape.whole(reply)
        except (asyncio.CancelledError, ConnectionError, RuntimeError):  # the connection is gone
            run.cancel(CLIENT_DISCONNECTED)
            raise
        except Exception:
            run.cancel(REPLY_FAILED)
            raise


@dataclass(frozen=True, slots=True)
class _Ask:
    msg: InboundMessage  # carrying the request's options
    request: ChatRequest


def _scoped(tenant: str, name: str) -> str:
    """`name` in the tenant's namespace (another key's "alice" is another conversation)."""
    return f"{tenant}/{name}" if tenant else name


def _refusal(submitted: Submitted) -> web.Response | None:
    """The response to a message the router did not take (storage down, or refused), else None."""
    if submitted.outcome is Outcome.UNAVAILABLE:
        return error_response(503, submitted.detail, "service_unavailable",
                      headers={"Retry-After": f"{submitted.retry_after_s or 5:.0f}"})
    if submitted.outcome is Outcome.LIMITED:  # the tenant's rate limit or a quota: try again later
        return error_response(429, submitted.detail, "rate_limit_exceeded", code="rate_limit_exceeded",
                              headers={"Retry-After": f"{math.ceil(submitted.retry_after_s or 1):.0f}"})
    if submitted.outcome is Outcome.REJECTED:
        return error_response(400, submitted.detail)
    return None


def _client_gone(submit: asyncio.Future[Submitted]) -> None:
    """The client left while its message was being routed: stop the run it got, if any."""
    run = submit.result().run if not submit.cancelled() and submit.exception() is None else None
    if run is not None:
        run.cancel(CLIENT_DISCONNECTED)


# --- errors on every path of the listener ---------------------------------------------------------

_STATUS_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_exceeded"}


@web.middleware
async def api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An error aiohttp raises (an unknown path, a method a path does not take, a body over the
    limit) or a handler's crash, as an OpenAI error body — what every OpenAI client reads its
    message from — instead of aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        what = f"{request.method} {request.path}"
        message = {404: f"Unknown request URL: {what}.", 405: f"Method not allowed: {what}."}.get(exc.status,
                                                                                                 exc.reason)
        return error_response(exc.status, message, _STATUS_TYPES.get(exc.status, "server_error" if exc.status >= 500
                                                             else "invalid_request_error"), headers=headers)
    except Exception:
        if request.writer is not None and request.writer.output_size > 0:
            raise  # the answer has begun: too late for an error body
        log.exception("request failed: %s %s", request.method, request.path)
        return error_response(500, "The server had an error while processing your request.", "server_error")

