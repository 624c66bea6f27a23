"""The built-in web chat: one page and a websocket, one session per browser (cookie).

Frames (JSON) from the browser: `{"type": "message", "id": <client id>, "text": ...}`,
`{"type": "command", "name": "stop" | "new"}`. To the browser: `hello` (history and state),
`message`/`edit` (a bot message by id), `notice`, `state` (running or idle), `typing`.
Client ids make a resend after a reconnect a no-op (router de-duplication).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
from importlib import resources
from typing import Any

from aiohttp import WSMsgType, web

from gateway.cancellation import Run, ToolReason
from gateway.events import Capabilities, ChatRef, ChatType, InboundMessage
from gateway.transcript import ChatMessage
from platforms.base import Adapter, EditStreamReply, Reply

log = logging.getLogger(__name__)

COOKIE = "switchboard_session"
PLATFORM = "webchat"


def _session_id(request: web.Request) -> str | None:
    value = request.cookies.get(COOKIE, "")
    return value if len(value) == 32 and value.isalnum() else None


class WebchatAdapter(Adapter):
    name = PLATFORM
    capabilities = Capabilities(max_message_len=64_000, can_edit=True, can_stream=True, edit_interval_s=0.05)

    def __init__(self) -> None:
        self._sockets: dict[str, set[web.WebSocketResponse]] = {}
        self._ids = itertools.count(1)
        self._closing = False

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/", self._page)
        app.router.add_get("/ws", self._websocket)

    async def stop(self) -> None:
        self._closing = True
        for sockets in list(self._sockets.values()):
            for ws in list(sockets):
                with contextlib.suppress(Exception):
                    await ws.close(code=1012, message=b"restarting")  # 1012: service restart

    # --- outbound -------------------------------------------------------------------------

    async def _push(self, chat_id: str, frame: dict[str, Any]) -> None:
        data = json.dumps(frame)
        for ws in list(self._sockets.get(chat_id, ())):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_str(data)

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        mid = f"b{next(self._ids)}"
        await self._push(chat.chat_id, {"type": "message", "id": mid, "text": text, "reply_to": reply_to})
        return mid

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        await self._push(chat.chat_id, {"type": "edit", "id": message_id, "text": text})

    async def typing(self, chat: ChatRef) -> None:
        await self._push(chat.chat_id, {"type": "typing"})

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> None:
        await self._push(chat.chat_id, {"type": "notice", "text": text, "reply_to": reply_to})

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        return _WebReply(self, msg, run)

    # --- HTTP -----------------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.Response:
        html = resources.files("platforms").joinpath("static/webchat.html").read_text("utf-8")
        resp = web.Response(text=html, content_type="text/html",
                            headers={"Content-Security-Policy": "default-src 'self'; style-src 'self' "
                                     "'unsafe-inline'; script-src 'self' 'unsafe-inline'; connect-src 'self'",
                                     "Cache-Control": "no-store"})
        if _session_id(request) is None:
            resp.set_cookie(COOKIE, secrets.token_hex(16), httponly=True, samesite="Strict",
                            max_age=365 * 86400)
        return resp

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        sid = _session_id(request)
        origin = request.headers.get("Origin")
        if sid is None:
            return web.json_response({"error": "no session cookie; load / first"}, status=400)
        if origin and origin.split("://", 1)[-1] != request.host:
            return web.json_response({"error": "cross-origin websocket refused"}, status=403)
        ws = web.WebSocketResponse(heartbeat=20)
        await ws.prepare(request)
        self._sockets.setdefault(sid, set()).add(ws)
        try:
            await self._hello(ws, sid)
            async for frame in ws:
                if frame.type is WSMsgType.TEXT:
                    await self._on_frame(ws, sid, frame.data)
                elif frame.type is WSMsgType.ERROR:
                    break
        finally:
            sockets = self._sockets.get(sid)
            if sockets is not None:
                sockets.discard(ws)
                if not sockets:
                    del self._sockets[sid]
        return ws

    async def _hello(self, ws: web.WebSocketResponse, sid: str) -> None:
        key = f"{PLATFORM}:{ChatType.DM.value}:{sid}"
        _conv, history = await self.router.store.conversation(key)
        status = self.router.status(key)
        await ws.send_json({"type": "hello", "history": [_row(m) for m in history if m.role != "tool"],
                            "running": status.running or status.queued > 0, "agent": status.agent})

    async def _on_frame(self, ws: web.WebSocketResponse, sid: str, data: str) -> None:
        try:
            frame = json.loads(data)
            kind = frame["type"]
            if kind == "command":
                text = "/" + str(frame["name"])
            elif kind == "message":
                text = str(frame["text"])
            else:
                raise ValueError(kind)
            client_id = str(frame.get("id") or f"c{next(self._ids)}")[:64]
        except (ValueError, KeyError, TypeError):
            await ws.send_json({"type": "notice", "text": "The page sent something I could not read."})
            return
        if self._closing:
            await ws.send_json({"type": "notice", "text": "The gateway is restarting; please resend shortly."})
            return
        msg = InboundMessage(platform=PLATFORM, chat_id=sid, chat_type=ChatType.DM, user_id=sid,
                             user_name="web user", message_id=client_id, text=text)
        # Don't hold the socket's read loop: /stop must be read while a turn streams.
        asyncio.get_running_loop().create_task(self.router.submit(msg, self))


class _WebReply(EditStreamReply):
    """Adds running/idle state frames so the page can enable Stop only while a turn runs."""

    def __init__(self, adapter: WebchatAdapter, msg: InboundMessage, run: Run) -> None:
        super().__init__(adapter, msg.chat, run, reply_to=msg.message_id)
        self._web = adapter
        self._chat_id = msg.chat_id
        asyncio.get_running_loop().create_task(adapter._push(msg.chat_id, {"type": "state", "running": True}))

    async def _idle(self) -> None:
        await self._web._push(self._chat_id, {"type": "state", "running": False})

    async def finish(self, text: str) -> None:
        await super().finish(text)
        await self._idle()

    async def interrupted(self, reason: ToolReason) -> None:
        await super().interrupted(reason)
        await self._idle()

    async def failed(self, text: str) -> None:
        await super().failed(text)
        await self._idle()


def _row(m: ChatMessage) -> dict[str, Any]:
    return {"role": m.role, "text": m.content,
            "interrupted_by": m.interrupted_by, "reason": m.reason, "at": m.created_at}
