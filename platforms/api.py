"""OpenAI-compatible HTTP API: `POST /v1/chat/completions` (stream and not) and `GET /v1/models`.

With a session (the `user` field or an `X-Session-Id` header) the daemon keeps the history and
the request's last user message is the new input; commands such as `/stop` work the same way.
Without one, the request is stateless, as in OpenAI's API. A client that goes away while its
turn runs (noticed within about 0.25 s by watching the transport) has the run hard_cancelled
with the system reason "client disconnected".
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from gateway.core.cancellation import CLIENT_DISCONNECTED, Run, ToolReason
from gateway.core.messages import Capabilities, ChatRef, ChatType, InboundMessage
from gateway.core.ports import NoticeKind, Outcome, Reply
from gateway.core.transcript import ChatMessage
from platforms.base import Adapter

log = logging.getLogger(__name__)

PLATFORM = "api"
WATCH_INTERVAL_S = 0.25
KEEPALIVE_S = 10.0


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


class _ApiReply(Reply):
    """Feeds one HTTP request: a queue of ("delta"|"end", payload) items the handler drains."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.text = ""
        self.notice: str | None = None  # an error notice about this request's turn, if one was sent

    async def next(self, run: Run, ended: asyncio.Future[None]) -> tuple[str, Any]:
        """The next item. Once the run is over (`ended`) with nothing left queued, the end its
        record implies: a turn that never ran (stopped while queued, refused at its start) never
        opened this reply, and the request must not wait for it forever."""
        if self.queue.empty() and not ended.done():
            get = asyncio.ensure_future(self.queue.get())
            waiting: set[asyncio.Future[Any]] = {get, ended}
            try:
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not get.done():
                    get.cancel()  # an item it had not taken stays in the queue
            if get.done() and not get.cancelled():
                return get.result()
        if not self.queue.empty():
            return self.queue.get_nowait()
        if run.reason is not None:
            return "end", {"finish_reason": "stop", "interrupted_by": run.reason.kind, "reason": run.reason.text}
        return "end", {"finish_reason": "error", "status": 503, "type": "unavailable",
                       "error": self.notice or "The turn ended without an answer; please try again."}

    async def delta(self, text: str) -> None:
        self.text += text
        self.queue.put_nowait(("delta", text))

    async def finish(self, text: str) -> None:
        self.text = text
        self.queue.put_nowait(("end", {"finish_reason": "stop"}))

    async def interrupted(self, reason: ToolReason) -> None:
        self.queue.put_nowait(("end", {"finish_reason": "stop", "interrupted_by": reason.kind,
                                       "reason": reason.text}))

    async def failed(self, text: str) -> None:
        self.queue.put_nowait(("end", {"finish_reason": "error", "error": text}))


class ApiAdapter(Adapter):
    name = PLATFORM
    capabilities = Capabilities(max_message_len=1 << 20, can_edit=False, can_stream=True)

    def __init__(self, *, keys: list[str], model_name: str = "switchboard") -> None:
        self._keys = [k.encode() for k in keys]
        self.model_name = model_name
        self._replies: dict[str, _ApiReply] = {}

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/chat/completions", self._completions), web.get("/v1/models", self._models)]

    # Outbound: there is no push channel; a reply exists only while its request is open.
    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        return ""

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        return None

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        reply = self._replies.get(reply_to) if reply_to else None
        if reply is not None and kind is NoticeKind.ERROR:
            reply.notice = text  # the answer to a request whose turn was refused says why
        await super().notify(chat, text, reply_to=reply_to, kind=kind, reason=reason)

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        return self._replies.get(msg.message_id) or _ApiReply()

    def _authorized(self, request: web.Request) -> bool:
        if not self._keys:
            return True
        header = request.headers.get("Authorization", "")
        token = header[7:].encode() if header.startswith("Bearer ") else b""
        return any(hmac.compare_digest(token, k) for k in self._keys)

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "Invalid API key.", "invalid_api_key")
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "switchboard"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _error(401, "Invalid API key.", "invalid_api_key")
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "The request body must be JSON.")
        parsed = _parse(body)
        if isinstance(parsed, web.Response):
            return parsed
        history, text, stream = parsed
        session = request.headers.get("X-Session-Id") or (body.get("user") if isinstance(body.get("user"), str)
                                                          else None)
        mid = uuid.uuid4().hex
        chat_id = session or f"ephemeral-{mid}"
        msg = InboundMessage(platform=PLATFORM, chat_id=chat_id, chat_type=ChatType.DM, user_id=chat_id,
                             user_name=chat_id, message_id=mid, text=text)
        reply = self._replies[mid] = _ApiReply()
        try:
            submitted = await self.gateway.submit(msg, self, ephemeral=None if session else history)
            if submitted.outcome is Outcome.COMMAND:
                return await self._respond_text(request, stream, submitted.detail)
            if submitted.outcome is Outcome.REJECTED:
                return _error(400, submitted.detail)
            if submitted.run is None:
                return _error(409, "Duplicate request.")
            if stream:
                return await self._stream(request, submitted.run, reply)
            return await self._complete(request, submitted.run, reply)
        finally:
            self._replies.pop(mid, None)

    async def _watch(self, request: web.Request, run: Run) -> None:
        """Cancel `run` as soon as the client's connection is gone, even if nothing is being sent."""
        while True:
            transport = request.transport
            if transport is None or transport.is_closing():
                run.cancel(CLIENT_DISCONNECTED)
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _complete(self, request: web.Request, run: Run, reply: _ApiReply) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        watcher, ended = loop.create_task(self._watch(request, run)), loop.create_task(run.wait())
        try:
            kind, end = await reply.next(run, ended)
            while kind != "end":
                kind, end = await reply.next(run, ended)
        finally:
            watcher.cancel()
            ended.cancel()
        if end.get("error"):
            return _error(end.get("status", 502), end["error"], end.get("type", "provider_error"))
        return web.json_response(self._completion(reply.text, end))

    async def _stream(self, request: web.Request, run: Run, reply: _ApiReply) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        loop = asyncio.get_running_loop()
        watcher, ended = loop.create_task(self._watch(request, run)), loop.create_task(run.wait())

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            payload = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            return f"data: {json.dumps(payload)}\n\n".encode()

        try:
            await resp.write(chunk({"role": "assistant", "content": ""}))
            while True:
                try:
                    kind, value = await asyncio.wait_for(reply.next(run, ended), KEEPALIVE_S)
                except TimeoutError:
                    await resp.write(b": keepalive\n\n")
                    continue
                if kind == "delta":
                    await resp.write(chunk({"content": value}))
                    continue
                extra = {"switchboard": {k: v for k, v in value.items() if k not in ("finish_reason", "status")}} \
                    if len(value) > 1 else {}
                await resp.write(chunk({}, value["finish_reason"], **extra))
                await resp.write(b"data: [DONE]\n\n")
                break
        except (ConnectionError, RuntimeError):
            run.cancel(CLIENT_DISCONNECTED)
        finally:
            watcher.cancel()
            ended.cancel()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp

    async def _respond_text(self, request: web.Request, stream: bool, text: str) -> web.StreamResponse:
        if not stream:
            return web.json_response(self._completion(text, {"finish_reason": "stop"}))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        payload = self._completion(text, {"finish_reason": "stop"})
        payload["object"] = "chat.completion.chunk"
        payload["choices"][0]["delta"] = payload["choices"][0].pop("message")
        await resp.write(f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    def _completion(self, text: str, end: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": end["finish_reason"]}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }
        if "interrupted_by" in end:
            out["switchboard"] = {"interrupted_by": end["interrupted_by"], "reason": end["reason"]}
        return out


def _parse(body: Any) -> tuple[list[ChatMessage], str, bool] | web.Response:
    """Validate a chat completion request: (earlier messages, new user text, stream)."""
    if not isinstance(body, dict):
        return _error(400, "The request body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _error(400, "'messages' must be a non-empty array.", param="messages")
    history: list[ChatMessage] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            return _error(400, f"messages[{i}]: role must be system, user or assistant.", param="messages")
        content = _text(m.get("content"))
        if content is None:
            return _error(400, f"messages[{i}].content must be a string or text parts.", param="messages")
        history.append(ChatMessage(m["role"], content))
    last = history.pop()
    if last.role != "user":
        return _error(400, "The last message must have role 'user'.", param="messages")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return _error(400, "'stream' must be a boolean.", param="stream")
    return history, last.content, stream


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(p, str) for p in parts) and parts:
            return "".join(p for p in parts if isinstance(p, str))
    return None
