"""The built-in web chat: one page and a websocket, one session per browser (cookie).

Frames (JSON) from the browser: `{"type": "message", "id": <client id>, "text": ..., "parts": [...]}`
(`parts`, optional: images and files pasted or dropped on the page, as OpenAI `file` or `image_url`
content parts with `data:` URLs), `{"type": "command", "name": "stop" | "new"}`. To the browser:

- `hello` {history, tools, running, queued, agent, max_chars}: the whole current conversation; the
  page replaces its view with it on every (re)connect. History rows: {role, text, at, interrupted_by,
  reason, interruption (kind, below), tools (names called), calls (the tool calls it made, as `tool`
  frames show them), resume (true on the gateway's own "continue" message after a restart), job (on
  the gateway's own message that a background job ended: its first line)}. Tool rows are not sent
  as rows: each is the `calls` entry of the assistant row that made it, and a stop that cut a tool
  call short is carried onto that row too. `tools`: the running turn's tool calls so far (not in the
  history until the turn is recorded). `max_chars` is the longest message the gateway takes (the
  page keeps a longer draft in the composer instead of sending it).
- `tool` {id, name, summary, state, elapsed_s, result, interrupted}: a tool or MCP call of the running
  turn, when it starts (`running`) and when it ends (`done` with the start of its `result`, or
  `interrupted` with the interruption); `summary` is the gist of its arguments. Sent after the text
  streamed before it, so the page places it where a reload does.
- `message`/`edit` {id, text}: a bot message by id. An edit that marks a stopped turn also has
  `body` (the text without the appended notice: exactly what the transcript stores) and
  `interrupted` {by, reason, kind}.
- `notice` {text, kind, reply_to}: kind is stopped | restart | interrupted | queued | error | info;
  interruption notices also carry `interrupted`.
- `state` {running}, `typing`.
- `ack` {id, outcome}: the router took the client message (accepted, queued, duplicate, command or
  rejected — also over a rate limit or quota). Until then the page keeps it and resends it, same
  id, after a reconnect; client ids make such a resend a no-op (router de-duplication). No ack
  while the gateway restarts.
- `user` {id, text}: a message sent from another tab of the same session.

The browser's cookie is only a credential: sessions are named by a keyed hash of it
(`platforms/webchat_sessions.py`), `webchat:dm:<id>`.

Interruption kinds: `stopped` (by the user or the operator), `restart` (the gateway restarted or
died mid-turn), `interrupted` (anything else).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import WSMsgType, web

from gateway.core.attachments import MB, Attachment, with_placeholders
from gateway.core.cancellation import (
    GATEWAY_RESTART,
    PROCESS_DIED,
    STOPPED_BY_OPERATOR,
    STOPPED_BY_USER,
    Run,
    ToolReason,
    still_ours,
    stop_notice,
)
from gateway.core.messages import Capabilities, ChatRef, ChatType, InboundMessage
from gateway.core.ports import Gateway, NoticeKind, Outcome, Reply
from gateway.core.transcript import ChatMessage, ToolCall
from platforms.assets import static_response
from platforms.base import Adapter
from platforms.content_parts import BadContent, parse_content
from platforms.http_input import BadJson, served_over_https, too_many_values
from platforms.streaming import EditStreamReply
from platforms.tool_progress import preview, summary
from platforms.webchat_sessions import session_id

log = logging.getLogger(__name__)

# Named anew when sessions stopped being named by it: a value logged by an older version (whose
# session keys were the cookie) opens nothing now; such a browser is simply given a new cookie.
COOKIE = "switchboard_chat"
_dumps = functools.partial(json.dumps, ensure_ascii=False)  # text as text in every frame
PLATFORM = "webchat"
RESTARTING = "The gateway is restarting; your message will be sent again when it is back."


def _cookie(request: web.Request) -> str | None:
    value = request.cookies.get(COOKIE, "")
    return value if len(value) == 32 and value.isascii() and value.isalnum() else None


class WebchatAdapter(Adapter):
    name = PLATFORM
    capabilities = Capabilities(max_message_len=64_000, can_edit=True, can_stream=True, edit_interval_s=0.05)

    def __init__(self, *, secret: Callable[[], Awaitable[bytes]] | None = None, max_attachment_bytes: int = 10 * MB,
                 max_frame_bytes: int = 4 * MB) -> None:
        self._load_secret = secret
        self._secret: bytes | None = None
        self.max_attachment_bytes = max_attachment_bytes  # a bigger data: URL is refused before it is decoded
        self.max_frame_bytes = max_frame_bytes  # a message frame with its attachments (base64)
        self._sockets: dict[str, set[web.WebSocketResponse]] = {}
        self._ids = itertools.count(1)
        # Bot message ids stay unique across restarts, so a page never confuses two daemons' ids.
        self._boot = secrets.token_hex(3)
        self._closing = False
        # Frames for a socket whose hello is not out yet: sent right after it, never lost or reordered.
        self._held: dict[web.WebSocketResponse, list[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._live_tools: dict[str, dict[str, dict[str, Any]]] = {}  # session -> its running turn's tool rows

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/", self._page), web.get("/static/{name}", self._static), web.get("/ws", self._websocket)]

    async def start(self, gateway: Gateway) -> None:
        # Without a configured source (tests, embedding) the secret lives as long as the process.
        self._secret = await self._load_secret() if self._load_secret is not None else secrets.token_bytes(32)
        await super().start(gateway)

    def session_id(self, cookie: str) -> str:
        """The session a cookie opens (its keyed hash; the cookie itself is never an identifier)."""
        if self._secret is None:
            raise RuntimeError("the webchat adapter has not been started")
        return session_id(self._secret, cookie)

    def _session_id(self, request: web.Request) -> str | None:
        cookie = _cookie(request)
        return self.session_id(cookie) if cookie is not None else None

    async def stop(self) -> None:
        """Refuse new input; close idle pages' sockets now and busy ones once their turn ends, so a
        page still sees its answer (or its "interrupted by a restart" mark) before it reconnects."""
        self._closing = True
        for sid in list(self._sockets):
            if self._gateway is None or not self._gateway.status(_key(sid)).running:
                await self._close_session(sid)

    async def _close_session(self, sid: str) -> None:
        async def close(ws: web.WebSocketResponse) -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(code=1012, message=b"restarting"), 2)  # 1012: service restart

        await asyncio.gather(*(close(ws) for ws in list(self._sockets.get(sid, ()))))

    # --- outbound -------------------------------------------------------------------------

    async def _push(self, chat_id: str, frame: dict[str, Any]) -> None:
        data = json.dumps(frame, ensure_ascii=False)
        for ws in list(self._sockets.get(chat_id, ())):
            held = self._held.get(ws)
            if held is not None:
                held.append(data)
            else:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await ws.send_str(data)

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        mid = f"b{self._boot}-{next(self._ids)}"
        await self._push(chat.chat_id, {"type": "message", "id": mid, "text": text, "reply_to": reply_to})
        return mid

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        await self._push(chat.chat_id, {"type": "edit", "id": message_id, "text": text})

    async def edit_marked(self, chat: ChatRef, message_id: str, text: str, body: str, reason: ToolReason) -> None:
        """The edit that marks a stopped turn: `body` is exactly what the transcript stores."""
        await self._push(chat.chat_id, {"type": "edit", "id": message_id, "text": text, "body": body,
                                        "interrupted": interruption(reason.kind, reason.text)})

    async def typing(self, chat: ChatRef) -> None:
        await self._push(chat.chat_id, {"type": "typing"})

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        frame: dict[str, Any] = {"type": "notice", "kind": kind.value, "text": text, "reply_to": reply_to}
        if reason is not None:
            frame["interrupted"] = interruption(reason.kind, reason.text)
            frame["kind"] = frame["interrupted"]["kind"]
        await self._push(chat.chat_id, frame)

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        return _WebReply(self, msg, run)

    # --- HTTP -----------------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.StreamResponse:
        resp = static_response(request, "webchat.html", page=True)
        if _cookie(request) is None:
            resp.set_cookie(COOKIE, secrets.token_hex(16), httponly=True, samesite="Strict",
                            secure=served_over_https(request), max_age=365 * 86400)
        return resp

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if not name.startswith("webchat"):
            raise web.HTTPNotFound()
        return static_response(request, name)

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)  # the Host and Origin checks ran before (gateway/ops/hosts.py)
        if sid is None:
            return web.json_response({"error": "no session cookie; load / first"}, status=400)
        if self._closing:  # the page retries; its next try reaches the restarted daemon
            return web.json_response({"error": "restarting"}, status=503)
        ws = web.WebSocketResponse(heartbeat=20, max_msg_size=self.max_frame_bytes)
        await ws.prepare(request)
        held: list[str] = []
        self._held[ws] = held
        self._sockets.setdefault(sid, set()).add(ws)
        try:
            await self._hello(ws, sid)
            while held:
                await ws.send_str(held.pop(0))
            del self._held[ws]
            async for frame in ws:
                if frame.type is WSMsgType.TEXT:
                    await self._on_frame(ws, sid, frame.data)
                elif frame.type is WSMsgType.ERROR:
                    break
        finally:
            self._held.pop(ws, None)
            sockets = self._sockets.get(sid)
            if sockets is not None:
                sockets.discard(ws)
                if not sockets:
                    del self._sockets[sid]
        return ws

    def live_tools(self, sid: str) -> dict[str, dict[str, Any]]:
        """The tool rows of the turn running in session `sid`, as sent so far (a hello shows them)."""
        return self._live_tools.setdefault(sid, {})

    def forget_tools(self, sid: str, calls: dict[str, Any]) -> None:
        rows = self._live_tools.get(sid, {})
        for call_id in calls:
            rows.pop(call_id, None)
        if not rows:
            self._live_tools.pop(sid, None)

    async def _hello(self, ws: web.WebSocketResponse, sid: str) -> None:
        key = _key(sid)
        history = await self.gateway.history(key)
        status = self.gateway.status(key)
        recorded = {c.id for m in history for c in m.tool_calls}
        live = [tool_frame(row) for row in self._live_tools.get(sid, {}).values() if row["id"] not in recorded]
        await ws.send_json({"type": "hello", "history": _rows(history), "tools": live,
                            "running": status.running or status.queued > 0, "queued": status.queued,
                            "agent": status.agent, "max_chars": self.gateway.max_message_chars()}, dumps=_dumps)

    async def _on_frame(self, ws: web.WebSocketResponse, sid: str, data: str) -> None:
        try:
            await too_many_values(data)  # no frame holds the loop: refused unparsed past the bounds
            frame = json.loads(data)
            kind = frame["type"]
            attachments: tuple[Attachment, ...] = ()
            if kind == "command":
                body = "/" + str(frame["name"])
            elif kind == "message":
                body = str(frame["text"])
            else:
                raise ValueError(kind)
            # A frame without an id (the page's commands) gets one that no restart can repeat:
            # a repeated id would be dropped as a duplicate by the router.
            client_id = str(frame.get("id") or f"srv-{secrets.token_hex(8)}")[:64]
            client_id.encode()  # an id that is not text (a lone surrogate) could not even be acked
            if kind == "message" and frame.get("parts"):
                try:
                    attachments = parse_content(frame["parts"], latest=True,
                                                max_bytes=self.max_attachment_bytes).attachments
                except BadContent as exc:  # refused for good (acknowledged as such): resending would not help
                    await ws.send_json({"type": "notice", "kind": "error", "text": f"That attachment {exc}.",
                                        "reply_to": client_id}, dumps=_dumps)
                    await ws.send_json({"type": "ack", "id": client_id, "outcome": Outcome.REJECTED.value},
                                       dumps=_dumps)
                    return
        except (ValueError, KeyError, TypeError, RecursionError, BadJson):  # RecursionError: nested too deeply
            await ws.send_json({"type": "notice", "kind": "error", "text": "The page sent something I could not read."},
                               dumps=_dumps)
            return
        if self._closing:  # no ack: the page keeps a message and resends it after reconnecting
            text = RESTARTING if kind == "message" else "The gateway is restarting; try again in a moment."
            await ws.send_json({"type": "notice", "kind": "restart", "text": text}, dumps=_dumps)
            return
        msg = InboundMessage(platform=PLATFORM, chat_id=sid, chat_type=ChatType.DM, user_id=sid,
                             user_name="web user", message_id=client_id, text=body, attachments=attachments)
        # Don't hold the socket's read loop: /stop must be read while a turn streams.
        task = asyncio.get_running_loop().create_task(self._submit(ws, msg, is_command=kind == "command"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _submit(self, ws: web.WebSocketResponse, msg: InboundMessage, *, is_command: bool) -> None:
        result = await self.gateway.submit(msg, self)
        if result.outcome in (Outcome.REJECTED, Outcome.UNAVAILABLE) and self._closing:
            return  # rejected because we are going down: unacked, so the page sends it again
        # Over a rate limit or quota the page was told why (a notice): to it, that is a refusal.
        outcome = Outcome.REJECTED if result.outcome is Outcome.LIMITED else result.outcome
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_json({"type": "ack", "id": msg.message_id, "outcome": outcome.value}, dumps=_dumps)
        if not is_command and result.outcome in (Outcome.ACCEPTED, Outcome.QUEUED):
            # Other tabs of this session show it too (a tab still connecting sees it in its history later).
            shown = with_placeholders(msg.text, msg.attachments)
            data = json.dumps({"type": "user", "id": msg.message_id, "text": shown}, ensure_ascii=False)
            for other in list(self._sockets.get(msg.chat_id, ())):
                if other is not ws and other not in self._held:
                    with contextlib.suppress(ConnectionError, RuntimeError):
                        await other.send_str(data)


class _WebReply(EditStreamReply):
    """Adds running/idle state frames so the page can enable Stop only while a turn runs (idle is
    sent once the turn is recorded), and a row per tool call (`tool` frames) instead of a status
    line: sent from the pump, after the text before them, so the page places them as a reload does."""

    def __init__(self, adapter: WebchatAdapter, msg: InboundMessage, run: Run) -> None:
        super().__init__(adapter, msg.chat, run, reply_to=msg.reply_target)
        self._web = adapter
        self._chat_id = msg.chat_id
        self._calls: dict[str, dict[str, Any]] = {}  # this turn's tool rows, by call id
        self._unsent: list[dict[str, Any]] = []  # rows changed since the last render
        asyncio.get_running_loop().create_task(adapter._push(msg.chat_id, {"type": "state", "running": True}))

    STATUS_LINE = False  # the page shows each call as a row of its own

    async def tool_started(self, call: ToolCall) -> None:
        if self._ended or not self._run.may_send():
            return
        row = {"id": call.id, "name": call.name, "summary": summary(call.arguments), "state": "running",
               "started": time.monotonic()}
        self._calls[call.id] = row
        self._changed(row)

    async def tool_ended(self, call_id: str, result: str) -> None:
        row = self._calls.get(call_id)
        if row is None or self._ended:
            return
        row.update(state="done", result=preview(result), elapsed_s=round(time.monotonic() - row["started"], 1))
        self._changed(row)

    def _changed(self, row: dict[str, Any]) -> None:
        if row not in self._unsent:
            self._unsent.append(row)
        self._pacer.wake(self._render_intermediate, self.pace)

    async def _render(self, *, final: bool) -> None:
        await super()._render(final=final)
        await self._send_rows()

    async def _send_rows(self) -> None:
        rows, self._unsent = self._unsent, []
        for row in rows:
            self._web.live_tools(self._chat_id)[row["id"]] = row  # a page (re)loading now shows it too
            await self._web._push(self._chat_id, {"type": "tool", **tool_frame(row)})

    async def interrupted(self, reason: ToolReason) -> None:
        cut = [row for row in self._calls.values() if row["state"] == "running"]
        shown_before = self._parts.last() is not None
        await super().interrupted(reason)
        if not cut or not await still_ours(self._run.guard):
            return
        mark = interruption(reason.kind, reason.text)
        for row in cut:
            row.update(state="interrupted", interrupted=mark, elapsed_s=round(time.monotonic() - row["started"], 1))
            self._changed(row)
        await self._send_rows()
        if not shown_before:  # the rows were all it showed: the mark goes below them, as after a reload
            await self._web._push(self._chat_id, {"type": "notice", "kind": mark["kind"], "text": stop_notice(reason),
                                                  "interrupted": mark})

    async def _idle(self) -> None:
        await self._web._push(self._chat_id, {"type": "state", "running": False})
        if self._web._closing:
            await self._web._close_session(self._chat_id)

    async def _edit_marked(self, message_id: str, text: str, body: str, reason: ToolReason) -> None:
        await self._web.edit_marked(self._chat, message_id, text, body, reason)

    async def settled(self, problem: str | None = None) -> None:
        await super().settled(problem)
        await self.delivered(5.0)  # the final state first, then idle
        self._web.forget_tools(self._chat_id, self._calls)  # recorded: the history has them now
        await self._idle()  # idle only once recorded: a reload right now shows the whole turn


def interruption(by: str, reason: str) -> dict[str, str]:
    """An interruption as the page shows it: who, why, and which of the notice kinds it is."""
    if reason in (STOPPED_BY_USER.text, STOPPED_BY_OPERATOR.text):
        kind = "stopped"
    elif reason in (GATEWAY_RESTART.text, PROCESS_DIED.text):
        kind = "restart"
    else:
        kind = "interrupted"
    return {"by": by, "reason": reason, "kind": kind}


def tool_frame(row: dict[str, Any]) -> dict[str, Any]:
    """A tool call as the page shows it: live (`tool` frames, `hello`'s `tools`) and in the history
    (`calls` on the assistant row that made it) alike."""
    frame: dict[str, Any] = {k: row[k] for k in ("id", "name", "summary", "state") if k in row}
    if row["state"] == "running":
        frame["elapsed_s"] = round(time.monotonic() - row["started"], 1)
    else:
        frame["elapsed_s"] = row.get("elapsed_s")
    for key in ("result", "interrupted"):
        if row.get(key) is not None:
            frame[key] = row[key]
    return frame


def _key(sid: str) -> str:
    return f"{PLATFORM}:{ChatType.DM.value}:{sid}"


def _rows(history: list[ChatMessage]) -> list[dict[str, Any]]:
    """History as the page shows it: tool results are not rows of their own but the `calls` of the
    assistant row that made them (as the page showed them live); a stop that cut a tool call short
    also marks that row (it would otherwise be lost on reload)."""
    results = {m.tool_call_id: m for m in history if m.role == "tool" and m.tool_call_id}
    rows: list[dict[str, Any]] = []
    for m in history:
        if m.role != "tool":
            rows.append(_row(m))
            if m.tool_calls:
                rows[-1]["calls"] = [_call(c, m, results.get(c.id)) for c in m.tool_calls]
        elif m.interrupted_by and rows and rows[-1]["role"] == "assistant" and not rows[-1]["interruption"]:
            rows[-1].update(interrupted_by=m.interrupted_by, reason=m.reason,
                            interruption=interruption(m.interrupted_by, m.reason or ""))
    return rows


def _call(call: ToolCall, asked: ChatMessage, result: ChatMessage | None) -> dict[str, Any]:
    """A tool call of the history, as `tool_frame` shows a live one: how long it ran is the time
    between the model's asking and its result's row."""
    row: dict[str, Any] = {"id": call.id, "name": call.name, "summary": summary(call.arguments), "state": "done"}
    if result is None:  # not recorded (a turn that failed first)
        return {**row, "state": "interrupted", "elapsed_s": None}
    row["elapsed_s"] = round(max(0.0, result.created_at - asked.created_at), 1)
    if result.interrupted_by:
        row["state"] = "interrupted"
        row["interrupted"] = interruption(result.interrupted_by, result.reason or "")
    else:
        row["result"] = preview(result.content)
    return row


def _row(m: ChatMessage) -> dict[str, Any]:
    row = {"role": m.role, "text": m.content, "interrupted_by": m.interrupted_by, "reason": m.reason,
           "interruption": interruption(m.interrupted_by, m.reason or "") if m.interrupted_by else None,
           "tools": [c.name for c in m.tool_calls], "at": m.created_at}
    if m.kind == "resume":
        row["resume"] = True  # the gateway's own "continue" after a restart, not something the user said
    elif m.kind == "job":
        row["job"] = m.content.split("\n", 1)[0]  # the gateway's own word that a background job ended
    return row
