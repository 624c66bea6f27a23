"""OpenAI-compatible HTTP API: `POST /v1/chat/completions` (stream and not) and `GET /v1/models`.

With a session (the `user` field or an `X-Session-Id` header) the daemon keeps the history and
the request's last user message is the new input; commands such as `/stop` work the same way.
Without one, the request is stateless, as in OpenAI's API. Sessions belong to the tenant whose key
opened them (see `platforms/tenants.py`): the session key is `api:dm:<tenant>/<session id>`, so
the same session id under another key is another conversation. A client that goes away while its
turn runs has the run hard_cancelled with the system reason "client disconnected" at once,
streaming or silent (a tool running): the daemon's HTTP server runs with aiohttp's
`handler_cancellation`, so the connection's loss cancels the request's handler, and the handler
cancels the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.core import jsonfast
from gateway.core.attachments import MB, Attachment
from gateway.core.cancellation import CLIENT_DISCONNECTED, Run, ToolReason
from gateway.core.ids import unique_id
from gateway.core.messages import Capabilities, ChatRef, ChatType, InboundMessage
from gateway.core.ports import Outcome, Reply, Submitted
from gateway.core.transcript import ChatMessage
from platforms.base import Adapter
from platforms.content_parts import BadContent, parse_content
from platforms.http_input import read_json
from platforms.tenants import ApiKeys

log = logging.getLogger(__name__)

PLATFORM = "api"
KEEPALIVE_S = 10.0
MAX_SESSION_ID = 256


def _json_response(payload: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    # Text as text in every body: no \\uXXXX escapes for the languages people write in.
    return web.Response(body=jsonfast.dumps(payload), status=status, headers=headers,
                        content_type="application/json", charset="utf-8")


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    return _json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                          status=status, headers=headers)


class _ApiReply(Reply):
    """Feeds one HTTP request: the answer's text, how it ended, and — once the turn is recorded (or
    could not be) — `settled`, when the response is complete. A streaming request also gets each
    delta as it comes; a whole answer wakes its handler once, at the end."""

    def __init__(self, streaming: bool = False) -> None:
        self.text = ""
        self._end: dict[str, Any] = {"finish_reason": "error", "error": "the turn ended without an answer"}
        self._settled: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._deltas: asyncio.Queue[str] | None = asyncio.Queue() if streaming else None

    async def delta(self, text: str) -> None:
        self.text += text
        if self._deltas is not None:
            self._deltas.put_nowait(text)

    async def finish(self, text: str) -> None:
        self.text = text
        self._end = {"finish_reason": "stop"}

    async def interrupted(self, reason: ToolReason) -> None:
        self._end = {"finish_reason": "stop", "interrupted_by": reason.kind, "reason": reason.text}

    async def failed(self, text: str, *, retry_after_s: float | None = None) -> None:
        end = {"finish_reason": "error", "error": text}
        self._end = end if retry_after_s is None else {**end, "retry_after_s": retry_after_s}

    async def settled(self, problem: str | None = None) -> None:
        if not self._settled.done():  # (cancelled if the client has gone)
            self._settled.set_result(problem)
        if self._deltas is not None:
            self._deltas.put_nowait("")  # wakes the streaming handler: the end is known

    async def outcome(self, stream: Callable[[str], Awaitable[None]] | None = None) -> dict[str, Any]:
        """The end payload once the turn has settled, with any problem saving it; deltas go to
        `stream` meanwhile."""
        if self._deltas is not None:
            while not self._settled.done() or not self._deltas.empty():
                text = await self._deltas.get()
                if text and stream is not None:
                    await stream(text)
        problem = await self._settled
        return {**self._end, "unsaved": problem} if problem else self._end


class ApiAdapter(Adapter):
    name = PLATFORM
    capabilities = Capabilities(max_message_len=1 << 20, can_edit=False, can_stream=True)
    can_steer = False  # each request waits for an answer of its own
    answers_later = False  # ...on its own connection: a replay elsewhere or later reaches nobody

    def __init__(self, *, keys: list[str], tenants: dict[str, str] | None = None,
                 model_name: str = "switchboard", max_attachment_bytes: int = 10 * MB,
                 max_body_bytes: int = 4 * MB) -> None:
        self._keys = ApiKeys(keys, tenants)
        self.max_attachment_bytes = max_attachment_bytes  # a bigger data: URL is refused before it is decoded
        self.max_body_bytes = max_body_bytes  # a bigger body is refused (413) before it is read
        self.model_name = model_name
        self._replies: dict[str, _ApiReply] = {}

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/chat/completions", self._completions), web.get("/v1/models", self._models)]

    # Outbound: there is no push channel; a reply exists only while its request is open.
    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        return ""

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        return None

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        return self._replies.get(msg.message_id) or _ApiReply()

    def _tenant(self, request: web.Request) -> str | None:
        """The caller's tenant ("" without keys), or None: not authorised."""
        return self._keys.tenant(request.headers.get("Authorization", ""))

    async def _models(self, request: web.Request) -> web.Response:
        if self._tenant(request) is None:
            return _error(401, "Invalid API key.", "invalid_api_key")
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "switchboard"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        if tenant is None:
            return _error(401, "Invalid API key.", "invalid_api_key")
        ask = await self._read(request, tenant)
        if isinstance(ask, web.Response):
            return ask
        mid = ask.msg.message_id
        reply = self._replies[mid] = _ApiReply(ask.stream)
        try:
            submitted = await self._submit(ask)
            if submitted.outcome is Outcome.COMMAND:
                return await self._respond_text(request, ask.stream, submitted.detail)
            refusal = _refusal(submitted)
            if refusal is not None:
                return refusal
            if submitted.run is None:
                return _error(409, "Duplicate request.")
            return await self._answer(request, ask.stream, submitted.run, reply)
        finally:
            self._replies.pop(mid, None)

    async def _read(self, request: web.Request, tenant: str) -> _Ask | web.Response:
        """The request as a message for the router, or the error response saying what is wrong."""
        body = await read_json(request, lambda status, problem: _error(status, problem), max_bytes=self.max_body_bytes)
        if isinstance(body, web.Response):
            return body
        parsed = _parse(body, self.max_attachment_bytes)
        if isinstance(parsed, web.Response):
            return parsed
        history, text, attachments, stream = parsed
        session = request.headers.get("X-Session-Id") or (body.get("user") if isinstance(body.get("user"), str)
                                                          else None)
        if session is not None and len(session) > MAX_SESSION_ID:
            return _error(400, f"The session id is longer than {MAX_SESSION_ID} characters.", param="user")
        mid = unique_id()
        chat_id = _chat_id(tenant, session, mid)
        msg = InboundMessage(platform=PLATFORM, chat_id=chat_id, chat_type=ChatType.DM, user_id=chat_id,
                             user_name=chat_id, message_id=mid, text=text, tenant=tenant or None,
                             attachments=attachments)
        return _Ask(msg, None if session else history, stream)

    async def _submit(self, ask: _Ask) -> Submitted:
        # The submission is not cancelled with the request (a half-routed message would never
        # be settled); if the client leaves meanwhile, its run is cancelled once it exists.
        submit = asyncio.ensure_future(self.gateway.submit(ask.msg, self) if ask.history is None else
                                        self.gateway.submit_stateless(ask.msg, self, ask.history))
        try:
            return await asyncio.shield(submit)
        except asyncio.CancelledError:
            submit.add_done_callback(_client_gone)
            raise

    async def _answer(self, request: web.Request, stream: bool, run: Run, reply: _ApiReply) -> web.StreamResponse:
        try:
            if stream:
                return await self._stream(request, run, reply)
            return await self._complete(run, reply)
        except asyncio.CancelledError:  # the connection is gone (handler_cancellation)
            run.cancel(CLIENT_DISCONNECTED)
            raise

    async def _complete(self, run: Run, reply: _ApiReply) -> web.StreamResponse:
        end = await reply.outcome()
        if end.get("error"):
            if (retry := end.get("retry_after_s")) is not None:  # our side is down for now: not the provider
                return _error(503, end["error"], "service_unavailable", headers={"Retry-After": f"{retry:.0f}"})
            return _error(502, end["error"], "provider_error")
        return _json_response(self._completion(reply.text, end))

    async def _stream(self, request: web.Request, run: Run, reply: _ApiReply) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        cid, created = f"chatcmpl-{unique_id()}", int(time.time())

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            payload = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            return b"data: " + jsonfast.dumps(payload) + b"\n\n"

        async def keepalive() -> None:
            while True:
                await asyncio.sleep(KEEPALIVE_S)
                await resp.write(b": keepalive\n\n")

        async def delta(text: str) -> None:
            await resp.write(chunk({"content": text}))

        pinger = asyncio.get_running_loop().create_task(keepalive())
        try:
            await resp.write(chunk({"role": "assistant", "content": ""}))
            value = await reply.outcome(delta)
            pinger.cancel()
            extra = {"switchboard": {k: v for k, v in value.items() if k != "finish_reason"}} \
                if len(value) > 1 else {}
            await resp.write(chunk({}, value["finish_reason"], **extra))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionError, RuntimeError):
            run.cancel(CLIENT_DISCONNECTED)
        finally:
            pinger.cancel()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp

    async def _respond_text(self, request: web.Request, stream: bool, text: str) -> web.StreamResponse:
        if not stream:
            return _json_response(self._completion(text, {"finish_reason": "stop"}))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        payload = self._completion(text, {"finish_reason": "stop"})
        payload["object"] = "chat.completion.chunk"
        payload["choices"][0]["delta"] = payload["choices"][0].pop("message")
        await resp.write(b"data: " + jsonfast.dumps(payload) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _completion(self, text: str, end: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": f"chatcmpl-{unique_id()}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": end["finish_reason"]}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }
        if "interrupted_by" in end:
            out["switchboard"] = {"interrupted_by": end["interrupted_by"], "reason": end["reason"]}
        return out


@dataclass(frozen=True, slots=True)
class _Ask:
    msg: InboundMessage
    history: list[ChatMessage] | None  # the earlier messages, when the request has no session (stateless)
    stream: bool


def _chat_id(tenant: str, session: str | None, mid: str) -> str:
    """The request's conversation, in the tenant's namespace (another key's "alice" is another
    conversation); without a session, one of its own."""
    conversation = session or f"ephemeral-{mid}"
    return f"{tenant}/{conversation}" if tenant else conversation


def _refusal(submitted: Submitted) -> web.Response | None:
    """The response to a message the router did not take (storage down, or refused), else None."""
    if submitted.outcome is Outcome.UNAVAILABLE:
        return _error(503, submitted.detail, "service_unavailable",
                      headers={"Retry-After": f"{submitted.retry_after_s or 5:.0f}"})
    if submitted.outcome is Outcome.LIMITED:  # the tenant's rate limit or a quota: try again later
        return _error(429, submitted.detail, "rate_limit_exceeded",
                      headers={"Retry-After": f"{math.ceil(submitted.retry_after_s or 1):.0f}"})
    if submitted.outcome is Outcome.REJECTED:
        return _error(400, submitted.detail)
    return None


def _client_gone(submit: asyncio.Future[Submitted]) -> None:
    """The client left while its message was being routed: stop the run it got, if any."""
    run = submit.result().run if not submit.cancelled() and submit.exception() is None else None
    if run is not None:
        run.cancel(CLIENT_DISCONNECTED)


def _parse(body: Any, max_bytes: int) -> tuple[list[ChatMessage], str, tuple[Attachment, ...], bool] | web.Response:
    """Validate a chat completion request: (earlier messages, new user text, its attachments, stream)."""
    if not isinstance(body, dict):
        return _error(400, "The request body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _error(400, "'messages' must be a non-empty array.", param="messages")
    history: list[ChatMessage] = []
    attachments: tuple[Attachment, ...] = ()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            return _error(400, f"messages[{i}]: role must be system, user or assistant.", param="messages")
        latest = i == len(messages) - 1
        try:  # only the new message's images and files are decoded; earlier ones leave a placeholder
            content = parse_content(m.get("content"), latest=latest and m["role"] == "user", max_bytes=max_bytes)
        except BadContent as exc:
            return _error(400, f"messages[{i}].content {exc}.", param="messages")
        if content.attachments and not latest:  # pragma: no cover - parse_content decodes only the last
            return _error(400, f"messages[{i}]: only the last message may carry images or files.")
        attachments = content.attachments if latest else attachments
        history.append(ChatMessage(m["role"], content.text))
    last = history.pop()
    if last.role != "user":
        return _error(400, "The last message must have role 'user'.", param="messages")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return _error(400, "'stream' must be a boolean.", param="stream")
    return history, last.content, attachments, stream
