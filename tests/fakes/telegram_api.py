"""Loopback fake of the Telegram Bot API (aiohttp on 127.0.0.1, random port) for tests."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import ClientSession, web

from .file_serving import FileServing
from .telegram_html import HtmlParseError, parse_html, utf16_len

JSONDict = dict[str, Any]
Handler = Callable[[JSONDict], Any]  # returns the `result` (or an awaitable of it)

MAX_TEXT_UTF16 = 4096
CONFLICT_POLLING = (
    "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running"
)
CONFLICT_WEBHOOK = (
    "Conflict: can't use getUpdates method while webhook is active; "
    "use deleteWebhook to delete the webhook first"
)
NOT_MODIFIED = (
    "Bad Request: message is not modified: specified new message content and reply markup "
    "are exactly the same as a current content and reply markup of the message"
)
CHAT_ACTIONS = frozenset({
    "typing", "upload_photo", "record_video", "upload_video", "record_voice", "upload_voice",
    "upload_document", "choose_sticker", "find_location", "record_video_note", "upload_video_note",
})  # fmt: skip
# Form values are JSON-encoded by PTB *except* plain strings, which are sent raw. These
# parameters are string-typed in the Bot API and must never be JSON-decoded ("123" stays str).
STRING_PARAMS = frozenset({
    "text", "caption", "parse_mode", "action", "url", "secret_token", "ip_address",
    "callback_query_id", "inline_message_id", "language_code", "description", "short_description",
    "name", "title", "username", "first_name", "last_name", "file_id", "emoji", "data", "query",
    "business_connection_id", "message_effect_id", "custom_emoji_id", "sticker", "photo", "document",
    "audio", "video", "voice", "animation", "thumbnail", "explanation", "question",
})  # fmt: skip
QUERY_INVALID = "query is too old and response timeout expired or query ID is invalid"
# Observed answers of the real Bot API (not in its docs): sendMessageDraft to a group/supergroup
# (and, before Bot API 9.5, to any chat of a bot without forum topic mode), a zero draft_id, and
# editMessageText past 4096 (sendMessage says "message is too long" instead).
DRAFT_PEER_INVALID = "Bad Request: TEXTDRAFT_PEER_INVALID"
DRAFT_ID_INVALID = "Bad Request: RANDOM_ID_INVALID"
EDIT_TOO_LONG = "Bad Request: MESSAGE_TOO_LONG"
SEND_TOO_LONG = "Bad Request: message is too long"
BUTTON_DATA_INVALID = "Bad Request: BUTTON_DATA_INVALID"  # callback_data outside 1-64 bytes
_COMMAND_RE = re.compile(r"/[A-Za-z0-9_]+(?:@[A-Za-z0-9_]+)?")
# The path prefix of the request being handled (`/<via>/bot<token>/<method>`), for the records.
_VIA: contextvars.ContextVar[str | None] = contextvars.ContextVar("fake_telegram_via", default=None)


class ApiError(Exception):
    """An error answer: HTTP status + Telegram description (+ optional parameters)."""

    def __init__(self, status: int, description: str, parameters: JSONDict | None = None) -> None:
        super().__init__(description)
        self.status, self.description, self.parameters = status, description, parameters


@dataclass
class SentRecord:
    """A successful sendMessage/sendMessageDraft/editMessageText/editMessageReplyMarkup/
    sendChatAction/deleteMessage call."""

    method: str
    chat_id: int | str | None
    message_thread_id: int | None
    text: str | None  # raw text as sent (before HTML parsing); action name for sendChatAction
    parse_mode: str | None
    message_id: int | None
    time: float  # fake.clock() (time.monotonic() unless a test swaps it)
    params: JSONDict = field(default_factory=dict)
    via: str | None = None  # the client's path prefix, if it used one (see `base_url_via`)


@dataclass
class CallRecord:
    """Any API call that reached a known method (including failed ones)."""

    method: str
    params: JSONDict
    status: int
    time: float
    via: str | None = None


@dataclass
class DraftRecord:
    """One accepted sendMessageDraft call; empty/blank `text` is the "Thinking…" placeholder."""

    chat_id: int
    draft_id: int
    text: str  # visible text after entity parsing
    entities: list[JSONDict]
    message_thread_id: int | None
    time: float  # fake.clock()
    params: JSONDict = field(default_factory=dict)


@dataclass
class Draft:
    """One draft bubble in a chat: its updates, and how it ended (`ended` None while live)."""

    chat_id: int
    draft_id: int
    updates: list[DraftRecord]
    ended: str | None = None  # "replaced" (other draft_id) | "message" (bot sent one) | "expired"
    ended_at: float | None = None

    @property
    def text(self) -> str:
        return self.updates[-1].text


@dataclass
class CallbackAnswer:
    """An accepted answerCallbackQuery; `latency` = seconds from the update's delivery to it."""

    query_id: str
    data: str
    chat_id: int
    message_id: int
    text: str | None
    show_alert: bool
    url: str | None
    time: float
    pushed_at: float  # the user's tap (push_callback)
    delivered_at: float | None  # first returned by getUpdates / POSTed by post_webhook

    @property
    def latency(self) -> float | None:
        return None if self.delivered_at is None else self.time - self.delivered_at


@dataclass
class _Callback:
    data: str
    chat_id: int
    message_id: int
    pushed_at: float
    delivered_at: float | None = None
    answered: bool = False


@dataclass
class PollRecord:
    """One getUpdates call."""

    offset: int | None
    limit: int
    timeout: float
    allowed_updates: Any
    time: float
    returned: list[int] = field(default_factory=list)
    status: int = 200  # 409 = terminated by a newer poll; 499 = client disconnected


def decode_param(name: str, value: str) -> Any:
    """Decode one form/multipart value the way PTB encoded it."""
    if name in STRING_PARAMS:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _opt_int(value: Any) -> int | None:
    return None if value is None or value == "" else int(value)


def _chat_key(chat_id: Any) -> int | str | None:
    """Normalise a chat_id parameter ("42" and 42 are the same chat)."""
    if isinstance(chat_id, str) and chat_id.lstrip("-").isdigit():
        return int(chat_id)
    return chat_id if isinstance(chat_id, int | str) else None


def _error(status: int, description: str, parameters: JSONDict | None = None) -> web.Response:
    body: JSONDict = {"ok": False, "error_code": status, "description": description}
    if parameters:
        body["parameters"] = parameters
    return web.json_response(body, status=status)


class FakeTelegramAPI:
    """In-process Telegram Bot API server; point PTB at `base_url` / `base_file_url`."""

    def __init__(
        self,
        token: str = "123456:TEST-TOKEN",
        *,
        bot_id: int | None = None,
        username: str = "switchboard_bot",
        first_name: str = "Switchboard",
    ) -> None:
        self.token = token
        head = token.split(":", 1)[0]
        self.bot_user: JSONDict = {
            "id": bot_id if bot_id is not None else (int(head) if head.isdigit() else 123456),
            "is_bot": True, "first_name": first_name, "username": username,
            "can_join_groups": True, "can_read_all_group_messages": False,
            "supports_inline_queries": False,
        }  # fmt: skip
        self.sent: list[SentRecord] = []
        self.calls: list[CallRecord] = []
        self.polls: list[PollRecord] = []
        self.webhook: JSONDict = {"url": ""}
        self.my_commands: dict[tuple[str, str], list[JSONDict]] = {}
        self._updates: list[JSONDict] = []
        self._update_ids = itertools.count(10_000)
        self._chats: dict[int | str, JSONDict] = {}
        self._msgs: dict[int | str, dict[int, JSONDict]] = {}
        self._last_msg_id: dict[int | str, int] = {}
        self._files: dict[str, bytes] = {}
        self.file_serving = FileServing()  # how fast files download, and every download so far
        self._callbacks: dict[str, _Callback] = {}
        self._faults: dict[str, list[tuple[ApiError, int | str | None]]] = {}
        self._latency: dict[int | str, float] = {}
        self._group_limit: tuple[int, float] | None = None
        self._group_sends: dict[int | str, list[float]] = {}
        self._draft_history: dict[int, list[Draft]] = {}
        self.drafts: list[DraftRecord] = []  # every accepted sendMessageDraft, in order
        self.callback_answers: list[CallbackAnswer] = []  # every accepted answerCallbackQuery
        self.clock: Callable[[], float] = time.monotonic  # all record times; tests may swap it
        self.drafts_enabled = True  # False: sendMessageDraft answers TEXTDRAFT_PEER_INVALID
        self.draft_ttl_s = 30.0  # a draft not refreshed for this long is gone (clients: ~30 s)
        self.callback_ttl_s: float | None = 15.0  # unanswered query older than this: invalid
        self.chat_admins: dict[int, set[int]] = {}  # group id -> its administrators (getChatMember)
        self.count_raw_html = False  # True: 4096 limit on the raw text (markup included)
        self._conflict = False
        self._closing = False
        self._poll_gen = 0
        self._changed = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0
        handlers: dict[str, Handler] = {
            "getMe": lambda p: self.bot_user, "getUpdates": self._get_updates,
            "setWebhook": self._set_webhook, "deleteWebhook": self._delete_webhook,
            "getWebhookInfo": self._get_webhook_info, "setMyCommands": self._set_my_commands,
            "getMyCommands": lambda p: self.my_commands.get(self._commands_key(p), []),
            "deleteMyCommands": self._delete_my_commands,
            "sendMessage": self._send_message, "editMessageText": self._edit_message_text,
            "sendChatAction": self._send_chat_action, "deleteMessage": self._delete_message,
            "sendMessageDraft": self._send_message_draft,
            "editMessageReplyMarkup": self._edit_message_reply_markup,
            "answerCallbackQuery": self._answer_callback_query, "getChat": self._get_chat,
            "getChatMember": self._get_chat_member,
            "getFile": self._get_file, "close": lambda p: True, "logOut": lambda p: True,
        }  # fmt: skip
        self._handlers: dict[str, tuple[str, Handler]] = {}
        for name, fn in handlers.items():
            self.set_handler(name, fn)

    async def start(self) -> None:
        """Bind 127.0.0.1 on a free port and start serving."""
        self._closing = False
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/bot{token}/{method}", self._dispatch)
        # The same API under a per-client prefix, so records say which client made each call.
        app.router.add_route("*", "/{via}/bot{token}/{method}", self._dispatch)
        app.router.add_get("/file/bot{token}/{path:.+}", self._serve_file)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        """Release pending long polls and shut the server down."""
        self._closing = True
        self._wake()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeTelegramAPI:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/bot"

    def base_url_via(self, via: str) -> str:
        """A base URL whose calls are recorded with `via` (one per client, e.g. per worker process)."""
        return f"http://127.0.0.1:{self.port}/{via}/bot"

    @property
    def base_file_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/file/bot"

    def set_handler(self, method: str, handler: Handler) -> None:
        """Add or replace an API method (handler gets decoded params, returns `result`)."""
        self._handlers[method.lower()] = (method, handler)

    def drop_method(self, method: str) -> None:
        """Answer `method` 404 Not Found, as a Bot API server older than the method does."""
        self._handlers.pop(method.lower(), None)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _read_params(self, request: web.Request) -> JSONDict:
        params: JSONDict = {k: decode_param(k, v) for k, v in request.query.items()}
        if not request.body_exists:
            return params
        ctype = request.content_type
        if ctype in ("application/x-www-form-urlencoded", "multipart/form-data"):
            for key, value in (await request.post()).items():
                if isinstance(value, web.FileField):
                    params[key] = value.file.read()
                else:
                    raw = value if isinstance(value, str) else bytes(value).decode()
                    params[key] = decode_param(key, raw)
            return params
        raw_body = await request.text()
        try:
            body = json.loads(raw_body)
        except ValueError:
            body = {k: decode_param(k, v) for k, v in parse_qsl(raw_body)}
        if isinstance(body, dict):
            params.update(body)
        return params

    async def _dispatch(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return _error(401, "Unauthorized")
        entry = self._handlers.get(request.match_info["method"].lower())
        if entry is None:
            return _error(404, "Not Found")
        method, handler = entry
        _VIA.set(request.match_info.get("via"))
        params = await self._read_params(request)
        delay = self._latency.get(_chat_key(params.get("chat_id")) or "")
        if delay:
            await asyncio.sleep(delay)  # simulated slow chat (set_latency)
        try:
            self._raise_fault(method, params)
            result = handler(params)
            if inspect.isawaitable(result):
                result = await result
        except ApiError as err:
            self._record_call(method, params, err.status)
            return _error(err.status, err.description, err.parameters)
        except (ValueError, TypeError, KeyError) as exc:  # malformed parameters
            self._record_call(method, params, 400)
            return _error(400, f"Bad Request: {exc}")
        self._record_call(method, params, 200)
        return web.json_response({"ok": True, "result": result})

    async def _serve_file(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        data = self._files.get(path.removeprefix("files/"))
        if request.match_info["token"] != self.token or data is None:
            return _error(404, "Not Found")
        return await self.file_serving.serve(request, data)

    def _raise_fault(self, method: str, params: JSONDict) -> None:
        faults = self._faults.get(method.lower(), [])
        chat = _chat_key(params.get("chat_id"))
        for i, (err, only_chat) in enumerate(faults):
            if only_chat is None or _chat_key(only_chat) == chat:
                del faults[i]
                raise err

    def _record_call(self, method: str, params: JSONDict, status: int) -> None:
        self.calls.append(CallRecord(method, params, status, self.clock(), _VIA.get()))
        self._wake()

    def _record(self, method: str, p: JSONDict, chat_id: Any, text: Any, msg_id: Any) -> None:
        rec = SentRecord(
            method, chat_id, _opt_int(p.get("message_thread_id")), text, p.get("parse_mode"),
            msg_id, self.clock(), p, _VIA.get(),
        )  # fmt: skip
        self.sent.append(rec)

    def _chat(self, chat_id: Any) -> JSONDict:
        if chat_id is None or chat_id == "":
            raise ApiError(400, "Bad Request: chat_id is empty")
        if isinstance(chat_id, str) and not chat_id.lstrip("-").isdigit():
            for chat in self._chats.values():
                if chat_id.startswith("@") and chat.get("username") == chat_id[1:]:
                    return chat
            raise ApiError(400, "Bad Request: chat not found")
        cid = int(chat_id)
        if cid not in self._chats:
            if cid > 0:
                self._chats[cid] = {"id": cid, "type": "private", "first_name": f"User{cid}"}
            else:
                kind = "supergroup" if cid < -1_000_000_000_000 else "group"
                self._chats[cid] = {"id": cid, "type": kind, "title": f"Chat {cid}"}
        return self._chats[cid]

    def _new_message(self, chat: JSONDict, sender: JSONDict, **content: Any) -> JSONDict:
        cid = chat["id"]
        mid = self._last_msg_id.get(cid, 0) + 1
        self._last_msg_id[cid] = mid
        msg: JSONDict = {"message_id": mid, "from": sender, "chat": chat, "date": int(time.time())}
        msg.update({k: v for k, v in content.items() if v is not None})
        self._msgs.setdefault(cid, {})[mid] = msg
        return msg

    @staticmethod
    def _parse(p: JSONDict) -> tuple[str, list[JSONDict]]:
        raw = p.get("text")
        text = "" if raw is None else str(raw)
        entities: list[JSONDict] = list(p.get("entities") or [])
        if str(p.get("parse_mode") or "").lower() == "html":
            try:
                text, entities = parse_html(text)
            except HtmlParseError as err:
                raise ApiError(400, f"Bad Request: can't parse entities: {err}") from None
        return text, entities

    def _check_length(self, p: JSONDict, text: str, too_long: str) -> None:
        """Telegram counts the visible text (after entity parsing) in UTF-16 code units."""
        counted = str(p.get("text") or "") if self.count_raw_html else text
        if utf16_len(counted) > MAX_TEXT_UTF16:
            raise ApiError(400, too_long)

    def _render(self, p: JSONDict, too_long: str = SEND_TOO_LONG) -> tuple[str, list[JSONDict]]:
        text, entities = self._parse(p)
        if not text.strip():
            raise ApiError(400, "Bad Request: message text is empty")
        self._check_length(p, text, too_long)
        return text, entities

    @staticmethod
    def _inline_markup(p: JSONDict) -> JSONDict | None:
        """The inline keyboard a message will carry (None: none, as for an empty keyboard)."""
        markup = p.get("reply_markup")
        if not isinstance(markup, dict) or not any(markup.get("inline_keyboard") or []):
            return None
        for row in markup["inline_keyboard"]:
            for button in row:
                data = button.get("callback_data")
                if data is not None and not 1 <= len(str(data).encode()) <= 64:
                    raise ApiError(400, BUTTON_DATA_INVALID)
        return markup

    def _reply_target(self, chat_id: int | str, p: JSONDict) -> JSONDict | None:
        rp = p.get("reply_parameters")
        if isinstance(rp, dict):
            mid, allow = rp.get("message_id"), rp.get("allow_sending_without_reply")
            chat_id = self._chat(rp["chat_id"])["id"] if rp.get("chat_id") else chat_id
        else:
            mid, allow = p.get("reply_to_message_id"), p.get("allow_sending_without_reply")
        if mid is None:
            return None
        target = self._msgs.get(chat_id, {}).get(int(mid))
        if target is None:
            if allow:
                return None
            raise ApiError(400, "Bad Request: message to be replied not found")
        return {k: v for k, v in target.items() if k != "reply_to_message"}

    async def _get_updates(self, p: JSONDict) -> list[JSONDict]:
        offset = _opt_int(p.get("offset"))
        limit = max(1, min(100, _opt_int(p.get("limit")) or 100))
        timeout = float(p.get("timeout") or 0)
        rec = PollRecord(offset, limit, timeout, p.get("allowed_updates"), self.clock())
        self.polls.append(rec)
        self._poll_gen += 1
        gen = self._poll_gen
        self._wake()  # terminates any older long poll with 409, like Telegram
        try:
            if self._conflict:
                raise ApiError(409, CONFLICT_POLLING)
            if self.webhook["url"]:
                raise ApiError(409, CONFLICT_WEBHOOK)
            if offset is not None and offset < 0:
                self._updates = self._updates[offset:]
            elif offset is not None:
                self._updates = [u for u in self._updates if u["update_id"] >= offset]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while not (self._updates or self._closing or self._conflict or gen != self._poll_gen):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    break
            if self._conflict or gen != self._poll_gen:
                raise ApiError(409, CONFLICT_POLLING)
            result = self._updates[:limit]
            rec.returned = [u["update_id"] for u in result]
            self._mark_delivered(result)
            return result
        except ApiError as err:
            rec.status = err.status
            raise
        except asyncio.CancelledError:  # client hung up (handler_cancellation): not a 409
            rec.status = 499
            raise

    def _set_webhook(self, p: JSONDict) -> bool:
        if p.get("drop_pending_updates"):
            self._updates.clear()
        self.webhook = {k: v for k, v in p.items() if k != "certificate"}
        self.webhook.setdefault("url", "")
        self._wake()
        return True

    def _delete_webhook(self, p: JSONDict) -> bool:
        if p.get("drop_pending_updates"):
            self._updates.clear()
        self.webhook = {"url": ""}
        return True

    def _get_webhook_info(self, p: JSONDict) -> JSONDict:
        info: JSONDict = {
            "url": self.webhook.get("url", ""),
            "has_custom_certificate": False,
            "pending_update_count": len(self._updates),
        }
        for key in ("max_connections", "allowed_updates", "ip_address"):
            if key in self.webhook:
                info[key] = self.webhook[key]
        return info

    @staticmethod
    def _commands_key(p: JSONDict) -> tuple[str, str]:
        scope = p.get("scope") or {"type": "default"}
        return json.dumps(scope, sort_keys=True), str(p.get("language_code") or "")

    def _set_my_commands(self, p: JSONDict) -> bool:
        self.my_commands[self._commands_key(p)] = list(p.get("commands") or [])
        return True

    def _delete_my_commands(self, p: JSONDict) -> bool:
        self.my_commands.pop(self._commands_key(p), None)
        return True

    def _check_group_limit(self, chat: JSONDict) -> None:
        if self._group_limit is None or chat["type"] not in ("group", "supergroup"):
            return
        limit, window = self._group_limit
        now = self.clock()
        recent = [t for t in self._group_sends.get(chat["id"], []) if now - t < window]
        self._group_sends[chat["id"]] = recent
        if len(recent) >= limit:
            retry = max(1, math.ceil(recent[0] + window - now))
            raise ApiError(429, f"Too Many Requests: retry after {retry}", {"retry_after": retry})

    def _send_message(self, p: JSONDict) -> JSONDict:
        chat = self._chat(p.get("chat_id"))
        self._check_group_limit(chat)
        text, entities = self._render(p)
        thread = _opt_int(p.get("message_thread_id"))
        reply = self._reply_target(chat["id"], p)
        msg = self._new_message(
            chat, self.bot_user, text=text, entities=entities or None,
            message_thread_id=thread, is_topic_message=True if thread is not None else None,
            reply_to_message=reply, reply_markup=self._inline_markup(p),
        )  # fmt: skip
        self._group_sends.setdefault(chat["id"], []).append(self.clock())
        self._end_draft(chat["id"], "message")  # the app replaces the draft by the message
        self._record("sendMessage", p, chat["id"], p.get("text"), msg["message_id"])
        return msg

    def _message_to_edit(self, p: JSONDict) -> JSONDict:
        chat = self._chat(p.get("chat_id"))
        mid = _opt_int(p.get("message_id"))
        msg = self._msgs.get(chat["id"], {}).get(mid) if mid is not None else None
        if msg is None:
            raise ApiError(400, "Bad Request: message to edit not found")
        if msg["from"]["id"] != self.bot_user["id"]:
            raise ApiError(400, "Bad Request: message can't be edited")
        return msg

    def _edit_message_text(self, p: JSONDict) -> JSONDict | bool:
        if p.get("inline_message_id"):
            self._render(p, EDIT_TOO_LONG)
            self._record("editMessageText", p, None, p.get("text"), None)
            return True
        msg = self._message_to_edit(p)
        text, entities = self._render(p, EDIT_TOO_LONG)
        markup = self._inline_markup(p)  # an edit without reply_markup removes the keyboard
        if (text, entities, markup) == (msg.get("text"), msg.get("entities", []), msg.get("reply_markup")):
            raise ApiError(400, NOT_MODIFIED)
        msg.update(text=text, edit_date=int(time.time()))
        for key, val in (("entities", entities), ("reply_markup", markup)):
            if val:
                msg[key] = val
            else:
                msg.pop(key, None)
        self._record("editMessageText", p, msg["chat"]["id"], p.get("text"), msg["message_id"])
        return msg

    def _edit_message_reply_markup(self, p: JSONDict) -> JSONDict | bool:
        markup = self._inline_markup(p)
        if p.get("inline_message_id"):
            self._record("editMessageReplyMarkup", p, None, None, None)
            return True
        msg = self._message_to_edit(p)
        if markup == msg.get("reply_markup"):
            raise ApiError(400, NOT_MODIFIED)
        if markup is None:
            msg.pop("reply_markup", None)
        else:
            msg["reply_markup"] = markup
        self._record("editMessageReplyMarkup", p, msg["chat"]["id"], None, msg["message_id"])
        return msg

    def _live_draft(self, chat_id: int) -> Draft | None:
        """The chat's shown draft, first ending it as expired if not refreshed within the TTL."""
        history = self._draft_history.get(chat_id)
        draft = history[-1] if history else None
        if draft is None or draft.ended is not None:
            return None
        last = draft.updates[-1].time
        if self.clock() - last > self.draft_ttl_s:
            draft.ended, draft.ended_at = "expired", last + self.draft_ttl_s
            return None
        return draft

    def _end_draft(self, chat_id: int, reason: str) -> None:
        draft = self._live_draft(chat_id)
        if draft is not None:
            draft.ended, draft.ended_at = reason, self.clock()

    def _send_message_draft(self, p: JSONDict) -> bool:
        text, entities = self._parse(p)  # entities are read before the chat, as Telegram does
        chat = self._chat(p.get("chat_id"))
        if chat["type"] != "private" or not self.drafts_enabled:
            raise ApiError(400, DRAFT_PEER_INVALID)
        draft_id = _opt_int(p.get("draft_id"))
        if not draft_id:
            raise ApiError(400, DRAFT_ID_INVALID)
        self._check_length(p, text, SEND_TOO_LONG)  # 0-4096: empty = "Thinking…" placeholder
        thread = _opt_int(p.get("message_thread_id"))
        rec = DraftRecord(chat["id"], draft_id, text, entities, thread, self.clock(), p)
        self.drafts.append(rec)
        live = self._live_draft(chat["id"])
        if live is not None and live.draft_id == draft_id:
            live.updates.append(rec)  # same draft_id: the change is animated
        else:
            if live is not None:
                live.ended, live.ended_at = "replaced", rec.time
            self._draft_history.setdefault(chat["id"], []).append(Draft(chat["id"], draft_id, [rec]))
        self._record("sendMessageDraft", p, chat["id"], p.get("text"), None)
        return True

    def _send_chat_action(self, p: JSONDict) -> bool:
        chat = self._chat(p.get("chat_id"))
        if p.get("action") not in CHAT_ACTIONS:
            raise ApiError(400, "Bad Request: wrong parameter action in request")
        self._record("sendChatAction", p, chat["id"], p.get("action"), None)
        return True

    def _delete_message(self, p: JSONDict) -> bool:
        chat = self._chat(p.get("chat_id"))
        mid = _opt_int(p.get("message_id"))
        if mid is None or self._msgs.get(chat["id"], {}).pop(mid, None) is None:
            raise ApiError(400, "Bad Request: message to delete not found")
        self._record("deleteMessage", p, chat["id"], None, mid)
        return True

    def _mark_delivered(self, updates: list[JSONDict]) -> None:
        for update in updates:
            cb = self._callbacks.get(str(update.get("callback_query", {}).get("id")))
            if cb is not None and cb.delivered_at is None:
                cb.delivered_at = self.clock()

    def _answer_callback_query(self, p: JSONDict) -> bool:
        qid = str(p.get("callback_query_id"))
        cb, now = self._callbacks.get(qid), self.clock()
        ttl = self.callback_ttl_s
        if cb is None or cb.answered or (ttl is not None and now - cb.pushed_at > ttl):
            raise ApiError(400, f"Bad Request: {QUERY_INVALID}")  # unknown, too old, or answered
        text = p.get("text")
        if text is not None and utf16_len(str(text)) > 200:
            raise ApiError(400, EDIT_TOO_LONG)
        cb.answered = True
        self.callback_answers.append(CallbackAnswer(
            qid, cb.data, cb.chat_id, cb.message_id, text, bool(p.get("show_alert")), p.get("url"),
            now, cb.pushed_at, cb.delivered_at,
        ))  # fmt: skip
        return True

    def _get_chat(self, p: JSONDict) -> JSONDict:
        kinds = (
            "unlimited_gifts",
            "limited_gifts",
            "unique_gifts",
            "premium_subscription",
            "gifts_from_channels",
        )
        gifts = dict.fromkeys(kinds, False)  # PTB 22 requires accepted_gift_types in ChatFullInfo
        extra = {"accent_color_id": 0, "max_reaction_count": 11, "accepted_gift_types": gifts}
        return {**self._chat(p.get("chat_id")), **extra}

    def _get_chat_member(self, p: JSONDict) -> JSONDict:
        chat = self._chat(p.get("chat_id"))
        user_id = _opt_int(p.get("user_id"))
        if user_id is None:
            raise ApiError(400, "Bad Request: user_id is empty")
        user: JSONDict = {"id": user_id, "is_bot": False, "first_name": f"User{user_id}"}
        if chat["type"] == "private":
            return {"status": "member" if user_id != chat["id"] else "creator", "user": user, "is_anonymous": False}
        if user_id not in self.chat_admins.get(chat["id"], set()):
            return {"status": "member", "user": user}
        rights = ("can_be_edited", "is_anonymous", "can_manage_chat", "can_delete_messages",
                  "can_manage_video_chats", "can_restrict_members", "can_promote_members", "can_change_info",
                  "can_invite_users", "can_post_stories", "can_edit_stories", "can_delete_stories")
        return {"status": "administrator", "user": user, **dict.fromkeys(rights, False), "can_manage_chat": True}

    def _get_file(self, p: JSONDict) -> JSONDict:
        file_id = str(p.get("file_id"))
        if file_id not in self._files:
            raise ApiError(400, "Bad Request: invalid file_id")
        return {
            "file_id": file_id, "file_unique_id": f"u-{file_id}",
            "file_size": len(self._files[file_id]), "file_path": f"files/{file_id}",
        }  # fmt: skip

    def push_update(self, update: JSONDict) -> int:
        """Queue a raw Update (update_id assigned if missing); returns the update_id."""
        update.setdefault("update_id", next(self._update_ids))
        msg = update.get("message")
        if isinstance(msg, dict) and isinstance(msg.get("chat"), dict):
            self._chats.setdefault(msg["chat"]["id"], msg["chat"])
            self._msgs.setdefault(msg["chat"]["id"], {})[msg["message_id"]] = msg
            last = self._last_msg_id.get(msg["chat"]["id"], 0)
            self._last_msg_id[msg["chat"]["id"]] = max(last, int(msg["message_id"]))
        self._updates.append(update)
        self._wake()
        return int(update["update_id"])

    def user_message(
        self,
        chat_id: int,
        *,
        user_id: int,
        username: str | None = None,
        first_name: str = "Test",
        chat_type: str | None = None,
        chat_title: str | None = None,
        message_thread_id: int | None = None,
        is_topic_message: bool | None = None,
        reply_to: JSONDict | None = None,
        **content: Any,
    ) -> JSONDict:
        """Build (and store) a realistic incoming Message; chat_type inferred from id sign."""
        user: JSONDict = {"id": user_id, "is_bot": False, "first_name": first_name}
        if username:
            user["username"] = username
        kind = chat_type or ("private" if chat_id > 0 else "supergroup" if chat_id < -(10**12) else "group")
        if kind == "private":
            chat: JSONDict = {"id": chat_id, "type": kind, "first_name": first_name}
            if username:
                chat["username"] = username
        else:
            chat = {"id": chat_id, "type": kind, "title": chat_title or f"Chat {chat_id}"}
            if kind == "supergroup" and message_thread_id is not None:
                chat["is_forum"] = True
        self._chats[chat_id] = {**self._chats.get(chat_id, {}), **chat}
        if is_topic_message is None and message_thread_id is not None:
            is_topic_message = kind == "supergroup"
        return self._new_message(
            self._chats[chat_id], user, message_thread_id=message_thread_id,
            is_topic_message=is_topic_message or None, reply_to_message=reply_to, **content,
        )  # fmt: skip

    def push_text(
        self, chat_id: int, text: str, *, user_id: int, entities: list[JSONDict] | None = None,
        **kw: Any,
    ) -> int:  # fmt: skip
        """Queue a text message update (bot_command entity auto-added); returns update_id."""
        cmd = _COMMAND_RE.match(text)
        if entities is None and cmd:
            entities = [{"type": "bot_command", "offset": 0, "length": utf16_len(cmd.group(0))}]
        msg = self.user_message(chat_id, user_id=user_id, text=text, entities=entities, **kw)
        return self.push_update({"message": msg})

    def push_photo(
        self, chat_id: int, *, user_id: int, caption: str | None = None, data: bytes = b"\xff\xd8fake-jpeg",
        **kw: Any,
    ) -> int:  # fmt: skip
        """Queue a photo message (no text; downloadable via getFile); returns update_id."""
        n = next(self._update_ids)
        sizes = []
        for suffix, side in (("s", 90), ("m", 800)):
            file_id = f"photo{n}{suffix}"
            self._files[file_id] = data
            sizes.append({"file_id": file_id, "file_unique_id": f"u-{file_id}",
                          "width": side, "height": side, "file_size": len(data)})  # fmt: skip
        msg = self.user_message(chat_id, user_id=user_id, photo=sizes, caption=caption, **kw)
        return self.push_update({"message": msg})

    def push_document(
        self, chat_id: int, data: bytes, *, user_id: int, file_name: str | None = "notes.txt",
        mime_type: str | None = "text/plain", caption: str | None = None, declared_size: int | None = -1,
        **kw: Any,
    ) -> int:  # fmt: skip
        """Queue a document message (downloadable via getFile); `declared_size` is the file_size the
        message claims (-1: the true size, None: none). Returns update_id."""
        file_id = f"doc{next(self._update_ids)}"
        self._files[file_id] = data
        doc: JSONDict = {"file_id": file_id, "file_unique_id": f"u-{file_id}", "file_name": file_name,
                         "mime_type": mime_type,
                         "file_size": len(data) if declared_size == -1 else declared_size}  # fmt: skip
        doc = {k: v for k, v in doc.items() if v is not None}
        msg = self.user_message(chat_id, user_id=user_id, document=doc, caption=caption, **kw)
        return self.push_update({"message": msg})

    def push_callback(
        self, chat_id: int, message_id: int, data: str, *, user_id: int, username: str | None = None,
        check_button: bool = True,
    ) -> int:  # fmt: skip
        """Queue a user's tap on an inline button (its callback query id is str(update_id));
        with check_button, the message must show a button with this callback_data."""
        msg = self._msgs.get(chat_id, {}).get(message_id)
        buttons = [b for row in (msg or {}).get("reply_markup", {}).get("inline_keyboard", []) for b in row]
        if check_button and not any(b.get("callback_data") == data for b in buttons):
            raise ValueError(f"message {chat_id}/{message_id} shows no button with callback_data {data!r}")
        update_id = next(self._update_ids)
        user: JSONDict = {"id": user_id, "is_bot": False, "first_name": "Test"}
        if username:
            user["username"] = username
        query: JSONDict = {"id": str(update_id), "from": user, "chat_instance": str(chat_id), "data": data}
        if msg is not None:
            query["message"] = msg
        self._callbacks[str(update_id)] = _Callback(data, chat_id, message_id, self.clock())
        return self.push_update({"update_id": update_id, "callback_query": query})

    def callback_answer(self, query_id: str | int) -> CallbackAnswer | None:
        """The accepted answer to a callback query (query id = push_callback's update_id)."""
        return next((a for a in self.callback_answers if a.query_id == str(query_id)), None)

    def draft_state(self, chat_id: int) -> str | None:
        """Text of the draft the user sees in the chat now ("" = "Thinking…"), or None."""
        draft = self._live_draft(chat_id)
        return None if draft is None else draft.text

    def draft_history(self, chat_id: int) -> list[Draft]:
        """Every draft bubble of the chat, oldest first (the last may still be live)."""
        self._live_draft(chat_id)  # settle expiry
        return list(self._draft_history.get(chat_id, []))

    def delete_message(self, chat_id: int | str, message_id: int) -> bool:
        """Delete a message as a user/admin would (later edits: "message to edit not found")."""
        return self._msgs.get(chat_id, {}).pop(message_id, None) is not None

    def set_latency(self, chat_id: int | str, seconds: float) -> None:
        """Delay every API call addressed to `chat_id` by `seconds` (0 removes the delay)."""
        self._latency[_chat_key(chat_id) or ""] = seconds

    def set_group_limit(self, per_window: int | None = 20, window_s: float = 60.0) -> None:
        """Opt in to Telegram's group limit: > `per_window` sendMessage per group per `window_s`
        → 429 with retry_after (None turns it off)."""
        self._group_limit = None if per_window is None else (per_window, window_s)
        self._group_sends.clear()

    def add_file(self, file_id: str, data: bytes) -> None:
        """Make `file_id` available via getFile and the file download URL."""
        self._files[file_id] = data

    @property
    def pending_updates(self) -> list[JSONDict]:
        """Updates not yet confirmed via offset."""
        return list(self._updates)

    def messages(self, chat_id: int | str) -> dict[int, str]:
        """Current bot messages in a chat: message_id -> rendered text (after edits)."""
        bot_id = self.bot_user["id"]
        return {
            mid: str(m.get("text", ""))
            for mid, m in self._msgs.get(chat_id, {}).items()
            if m["from"]["id"] == bot_id
        }

    def message(self, chat_id: int | str, message_id: int) -> JSONDict | None:
        """Full stored Message dict (user or bot), or None."""
        return self._msgs.get(chat_id, {}).get(message_id)

    def commands(self, scope: JSONDict | None = None, language_code: str = "") -> list[JSONDict]:
        """Commands registered via setMyCommands for a scope/language."""
        return self.my_commands.get(self._commands_key({"scope": scope, "language_code": language_code}), [])

    @property
    def poll_count(self) -> int:
        return len(self.polls)

    @property
    def poll_offsets(self) -> list[int | None]:
        return [p.offset for p in self.polls]

    def fail_next(
        self,
        method: str,
        status: int = 429,
        *,
        retry_after: int | None = None,
        description: str | None = None,
        times: int = 1,
        chat_id: int | str | None = None,
    ) -> None:
        """Make the next `times` calls of `method` (to `chat_id` only, if given) fail."""
        params: JSONDict | None = None
        if status == 429:
            retry_after = 1 if retry_after is None else retry_after
            description = description or f"Too Many Requests: retry after {retry_after}"
        if retry_after is not None:
            params = {"retry_after": retry_after}
        default = {400: "Bad Request", 403: "Forbidden: bot was blocked by the user",
                   409: CONFLICT_POLLING}.get(status, "Internal Server Error")  # fmt: skip
        err = ApiError(status, description or default, params)
        self._faults.setdefault(method.lower(), []).extend([(err, chat_id)] * times)

    def conflict_polling(self, enabled: bool = True) -> None:
        """While enabled, getUpdates answers 409 Conflict (another instance polling)."""
        self._conflict = enabled
        self._wake()

    async def wait_until(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until `condition()` holds (re-checked after every API call / push)."""
        async with asyncio.timeout(timeout):
            while not condition():
                await self._changed.wait()

    async def wait_for(self, predicate: Callable[[SentRecord], bool], timeout: float = 5.0) -> SentRecord:
        """Return the first `sent` record matching `predicate`, waiting up to `timeout`."""
        try:
            await self.wait_until(lambda: any(predicate(r) for r in self.sent), timeout)
        except TimeoutError:
            raise TimeoutError(f"no matching sent record within {timeout}s; sent={self.sent!r}") from None
        return next(r for r in self.sent if predicate(r))

    async def post_webhook(self, url: str, update: JSONDict, secret_token: str | None = None) -> int:
        """POST an Update to a webhook URL as Telegram would; returns the HTTP status."""
        update.setdefault("update_id", next(self._update_ids))
        self._mark_delivered([update])
        headers = {"X-Telegram-Bot-Api-Secret-Token": secret_token} if secret_token else {}
        async with ClientSession() as session, session.post(url, json=update, headers=headers) as resp:
            return resp.status
