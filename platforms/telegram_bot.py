"""Telegram through python-telegram-bot's `Bot`: long polling (or a webhook) in, throttled edits out.

Polling is our own loop over getUpdates rather than PTB's Updater: each update is handed to
`Router.submit` (which records the message durably and de-duplicates it) *before* the next
getUpdates confirms it through its offset, so a crash neither loses nor double-processes a
message. Submitting never waits on a chat's sends: notices and replies queue on the adapter's
per-chat outbox (`platforms/outbox.py`), so one slow or rate-limited chat delays no other chat's
intake, `/stop` included.

Parts are measured by what Telegram counts: the visible text after our Markdown is rendered as
HTML (UTF-16 units). A part Telegram refuses as HTML is resent as plain text; `MessageGone` and
`Refused` tell the streaming engine to continue in a new message or to split smaller.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import hmac
import logging
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal, TypeVar

from aiohttp import web
from telegram import (
    Bot,
    BotCommand,
    CallbackQuery,
    InlineKeyboardButton,
    InlineKeyboardMarkup,
    Message,
    MessageEntity,
    ReplyParameters,
    Update,
)
from telegram.constants import ChatAction, ChatMemberStatus, ParseMode
from telegram.constants import ChatType as TgChatType
from telegram.error import (
    BadRequest,
    Conflict,
    EndPointNotFound,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
)
from telegram.request import HTTPXRequest

from gateway.core import commands
from gateway.core.attachments import Attachment, mime_of
from gateway.core.backoff import Backoff
from gateway.core.bounded import BoundedMap
from gateway.core.cancellation import Run, ToolReason
from gateway.core.messages import Capabilities, ChatRef, ChatType, InboundMessage
from gateway.core.outage import OutageLog
from gateway.core.ports import Gateway, Health, NoticeKind, Outcome, Reply
from platforms import stop_button
from platforms.base import Adapter, MessageGone, OutboundError, RateLimited, Refused
from platforms.config import TelegramConfig
from platforms.ingress import IngressLeader
from platforms.splitting import utf16_len
from platforms.stop_button import PressOutcome, StopButton, StopButtons
from platforms.streaming import EditStreamReply
from platforms.telegram_draft import DraftsRefused, DraftStreamReply, draft_chat
from platforms.telegram_format import to_html, visible_text

log = logging.getLogger(__name__)
T = TypeVar("T")

PLATFORM = "telegram"
ALLOWED_UPDATES = ("message", "callback_query")  # channel posts, edits, reactions... are not asked for
SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
UNAVAILABLE_RETRY_S = 2.0
CLOSE_FLUSH_S = 5.0  # on close, how long queued replies and notices may still take
ALBUM_WAIT_S = 0.5  # how long the rest of an album may take to arrive after its first part
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 60.0  # the intake loop's backoff after a failure (±10 % jitter)
NO_DRAFTS_MAX = 100_000  # chats remembered as refusing drafts (a forgotten one tries a draft again)
# Bad Requests about the message rather than its text: retrying with other text will not help.
_GONE = ("message to edit not found", "message_id_invalid", "message can't be edited")
_CHAT = ("chat not found", "not enough rights", "have no rights", "chat_write_forbidden", "bot is not a member",
         "topic_closed", "topic_deleted", "message thread not found", "peer_id_invalid", "group chat was upgraded")


class TelegramAdapter(Adapter):
    name = PLATFORM
    pushes_anywhere = True  # the Bot API reaches any chat from any process

    def __init__(self, config: TelegramConfig, *, leader: IngressLeader | None = None) -> None:
        if config.token is None:
            raise ValueError("telegram.token is required")
        self.config = config
        self.capabilities = Capabilities(max_message_len=4096, can_edit=True, can_stream=True,
                                         edit_interval_s=config.edit_interval_s, length_unit="utf16")
        self._token = config.token.reveal()
        # Long polls get their own connection so sends never queue behind one.
        self._requests = (HTTPXRequest(connection_pool_size=64, read_timeout=15, write_timeout=15,
                                       connect_timeout=10, pool_timeout=5),
                          HTTPXRequest(connection_pool_size=1, read_timeout=10, connect_timeout=10))
        self.bot = Bot(self._token, base_url=config.base_url, base_file_url=config.base_file_url,
                       request=self._requests[0], get_updates_request=self._requests[1])
        self.ready = asyncio.Event()  # set once connected (polling, or the webhook registered)
        self._health = Health(False, "connecting to Telegram")
        self._outage = OutageLog(log, PLATFORM)
        self._bot_id = 0
        self._username = ""
        self._offset: int | None = None
        self._confirmed: int | None = None  # the offset Telegram has been sent
        self._task: asyncio.Task[None] | None = None
        self._interruptible = False  # the loop is waiting (long poll, backoff), not submitting
        self._closing = False
        self._closed = False
        self._webhook_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        # Cluster mode: only the worker holding this lease polls; the offset lives in Redis.
        self.leader = leader
        self.stop_buttons = StopButtons(PLATFORM)
        self._no_drafts: BoundedMap[str, None] = BoundedMap(NO_DRAFTS_MAX)  # refused a draft: stream by edits
        self._drafts_refusal_logged = False
        self._drafts_off = False  # the Bot API server has no sendMessageDraft

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def bot_username(self) -> str | None:
        return self._username or None

    async def start(self, gateway: Gateway) -> None:
        await super().start(gateway)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="telegram")

    def routes(self) -> list[web.RouteDef]:
        return [web.post(self.config.webhook_path, self._webhook)] if self.config.mode == "webhook" else []

    async def stop(self) -> None:
        """Stop intake. An update being submitted is finished first; the client stays open
        for replies still in flight (it is closed with the daemon's HTTP app)."""
        self._closing = True
        task = self._task
        if task is not None and not task.done():
            if self._interruptible:
                task.cancel()
            _done, late = await asyncio.wait({task}, timeout=5.0)
            for t in late:
                t.cancel()
                await asyncio.wait({t})
        await self._confirm_offset()

    async def close(self) -> None:
        """Release the HTTP clients (idempotent). The daemon calls this after the core has shut
        down, so replies being marked interrupted still have a client."""
        if self._closed:
            return
        self._closed = True
        await self.outbox.close(CLOSE_FLUSH_S)  # stop marks and last notices still go out
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*(r.shutdown() for r in self._requests), return_exceptions=True)

    def health(self) -> Health:
        return self._health

    # --- intake: polling ------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff(RETRY_FIRST_S, RETRY_MAX_S, jitter=0.1)
        connected = False
        while not self._closing:
            try:
                if not connected:
                    await self._waiting(self._connect())
                    connected = True
                    backoff.reset()
                    if self.config.mode == "webhook":
                        return
                if self.leader is not None and not self.leader.held():
                    self._health = Health(True, "standing by: another worker polls Telegram")
                    await self._waiting(self.leader.wait())
                    stored = await self.leader.load("offset")
                    self._offset = int(stored) if stored else self._offset
                await self._poll_once()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = _retry_after_s(exc) if isinstance(exc, RetryAfter) else backoff.step()
                self._failed(exc, delay)
                await self._waiting(asyncio.sleep(delay))

    async def _waiting(self, aw: Coroutine[Any, Any, T]) -> T:
        """Await something `stop` may simply cancel (nothing half-submitted can be lost)."""
        self._interruptible = True
        try:
            return await aw
        finally:
            self._interruptible = False

    async def _connect(self) -> None:
        await self.bot.initialize()  # getMe: checks the token, learns our id and username
        self._bot_id, self._username = self.bot.id, self.bot.username
        if self.config.mode == "webhook":
            assert self.config.webhook_url and self.config.secret_token  # enforced by the config
            await self.bot.set_webhook(self.config.webhook_url, allowed_updates=list(ALLOWED_UPDATES),
                                       secret_token=self.config.secret_token.reveal(), drop_pending_updates=False)
        else:
            await self.bot.delete_webhook(drop_pending_updates=False)  # keep what arrived while we were down
        try:
            await self.bot.set_my_commands([BotCommand(c, d) for c, d in commands.menu()])
        except TelegramError as exc:  # cosmetic: commands still work when typed
            log.warning("telegram: could not register commands: %s", self._scrub(str(exc)))
        self._recovered("webhook registered" if self.config.mode == "webhook" else "polling")
        self.ready.set()
        log.info("telegram: connected as @%s (%s)", self._username, self.config.mode)

    async def _poll_once(self) -> None:
        offset = self._offset
        updates = await self._waiting(self.bot.get_updates(
            offset=offset, timeout=self.config.poll_timeout_s, allowed_updates=list(ALLOWED_UPDATES)))
        self._confirmed = offset
        self._recovered("polling")
        if updates and _album_of(updates[-1]) is not None:
            # An album arrives as one message per photo, often split across polls: wait a moment
            # and ask again from the same offset (nothing is confirmed yet) to have all of it.
            await self._waiting(asyncio.sleep(ALBUM_WAIT_S))
            updates = await self._waiting(self.bot.get_updates(
                offset=offset, timeout=0, allowed_updates=list(ALLOWED_UPDATES))) or updates
        for group in _albums(updates):
            if self._closing:
                return  # the rest stays unconfirmed and is fetched again by the next process
            if not await self._handle(group[0], group[1:]):
                # Not stored (storage or Redis down): leave it unconfirmed, fetch it again later.
                await self._waiting(asyncio.sleep(UNAVAILABLE_RETRY_S))
                return
            update = group[-1]
            self._offset = update.update_id + 1
            if self.leader is not None:
                await self.leader.save("offset", str(self._offset))

    async def _confirm_offset(self) -> None:
        """On the way out, confirm what was submitted so the next start does not refetch it."""
        if self._offset is None or self._offset == self._confirmed or self._closed:
            return
        try:
            await asyncio.wait_for(self.bot.get_updates(offset=self._offset, timeout=0, limit=1,
                                                        allowed_updates=list(ALLOWED_UPDATES)), 3.0)
            self._confirmed = self._offset
        except (TelegramError, TimeoutError) as exc:  # harmless: refetched updates are duplicates
            log.info("telegram: could not confirm the last updates on stop: %s", self._scrub(str(exc)))

    def _failed(self, exc: Exception, delay: float) -> None:
        """Degrade health and log the cause — once per outage and kind, not once per retry."""
        kind, level, text = failure(exc, self._scrub)
        self._health = Health(False, text)
        self._outage.failed(kind, f"{text}; retrying in {delay:.1f} s (backing off up to {RETRY_MAX_S:.0f} s)",
                            level=level, exc_info=exc if kind == "bug" else None)

    def _recovered(self, state: str) -> None:
        self._outage.recovered(f"connection restored ({state})")
        self._health = Health(True, state)

    # --- intake: webhook ------------------------------------------------------------------

    async def _webhook(self, request: web.Request) -> web.Response:
        expected = self.config.secret_token.reveal().encode() if self.config.secret_token else b""
        given = request.headers.get(SECRET_HEADER, "").encode("utf-8", "surrogatepass")  # non-UTF-8: wrong, not 500
        if not expected or not hmac.compare_digest(given, expected):
            return web.Response(status=401, text="wrong secret token")
        if self._closing or not self.ready.is_set():
            return web.Response(status=503, text="not ready")  # Telegram delivers it again later
        try:
            update = Update.de_json(await request.json(), self.bot)
        except Exception:
            return web.Response(status=400, text="not a Telegram update")
        # A task of its own: if Telegram hangs up (the request is cancelled), the submission
        # still completes, and the update is simply delivered again (a duplicate, dropped).
        task = asyncio.get_running_loop().create_task(self._handle_in_order(update))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if not await asyncio.shield(task):  # Telegram delivers it again later; the redelivery is de-duplicated
            return web.Response(status=503, text="not stored; try again later", headers={"Retry-After": "5"})
        return web.Response(text="ok")  # only now: the message is recorded

    async def _handle_in_order(self, update: Update) -> bool:
        async with self._webhook_lock:  # one at a time, in arrival order
            return await self._handle(update)

    # --- intake: updates to messages ------------------------------------------------------

    async def _handle(self, update: Update, album: Sequence[Update] = ()) -> bool:
        """Turn one update (with the rest of its `album`, if any) into a router submission; never
        raises (a bad update is skipped). Returns once the router has stored the message: it never
        waits on outbound calls. False when it could not be taken now (storage down) and must be
        delivered again."""
        try:
            if update.callback_query is not None:
                # A task of its own: a press never holds up intake, and intake never holds it up.
                self._spawn(self._on_callback(update.callback_query))
                return True
            m = update.message
            if m is None:
                return True
            msg = self._inbound(m)
            if msg is not None and album:  # one message: the first part's id, every part's files
                parts = [u.message for u in album if u.message is not None]
                caption = msg.text or next((p.caption for p in parts if p.caption), "")
                msg = dataclasses.replace(msg, text=caption, attachments=msg.attachments + tuple(
                    a for p in parts for a in _attachments(p)))
            if msg is not None:
                return (await self.gateway.submit(msg, self)).outcome is not Outcome.UNAVAILABLE
        except Exception:
            log.exception("telegram: could not process update %d", update.update_id)
        return True

    def _inbound(self, m: Message) -> InboundMessage | None:
        """The normalized message, or None when it is not for us (bots, other bots' commands,
        group chatter that does not address us). Media without a caption gets empty text."""
        user = m.from_user
        if user is None or user.is_bot:  # includes our own messages
            return None
        chat = self._chat_of(m)
        if chat is None:
            return None
        chat_type = chat.chat_type
        text = m.text if m.text is not None else m.caption
        entities = m.parse_entities() if m.text is not None else m.parse_caption_entities()
        if text is None and m.effective_attachment is None:
            return None  # service messages: members joining, pins, topic changes...
        addressed = False
        if text and text.lstrip().startswith("/"):
            ours = commands.parse_command(text, self._username)
            if ours is None and commands.parse_command(text) is not None:
                return None  # /stop@OtherBot
            explicit = "@" in text.split(maxsplit=1)[0]
            if ours is not None and not ours.known and not explicit and chat_type is ChatType.GROUP:
                return None  # an unknown bare /cmd in a group is probably another bot's
            addressed = ours is not None
        mentions = self._mentions(entities)
        in_mention_mode = chat_type is ChatType.GROUP and self.config.groups == "mention"
        if in_mention_mode and not (addressed or mentions or self._replies_to_us(m)):
            return None
        if text and mentions:
            text = _strip_spans(text, mentions)
        reply = m.reply_to_message
        files = _attachments(m)
        return InboundMessage(
            platform=PLATFORM, chat_id=chat.chat_id, chat_type=chat_type,
            user_id=str(user.id), user_name=user.full_name, user_handle=user.username,
            message_id=str(m.message_id), text=text or "",
            thread_id=chat.thread_id,
            reply_to=str(reply.message_id) if reply is not None else None,
            timestamp=m.date.timestamp(), attachments=files,
            media=m.effective_attachment is not None and not files)  # a sticker, a poll...

    async def attachment_url(self, att: Attachment) -> str:
        """getFile, asked in the turn: its download URL (which carries the token: never logged)."""
        try:
            file = await self.bot.get_file(att.ref)
        except TelegramError as exc:
            raise LookupError(f"Telegram would not hand it out ({self._scrub(str(exc))})") from None
        if not file.file_path:
            raise LookupError("Telegram gave no download path for it")
        return file.file_path

    def _mentions(self, entities: dict[MessageEntity, str]) -> list[tuple[int, int]]:
        """(offset, length) in UTF-16 units of every @mention of this bot."""
        found = []
        for ent, value in entities.items():
            if (ent.type == MessageEntity.MENTION and value[1:].lower() == self._username.lower()) or (
                    ent.type == MessageEntity.TEXT_MENTION and ent.user and ent.user.id == self._bot_id):
                found.append((ent.offset, ent.length))
        return found

    def _replies_to_us(self, m: Message) -> bool:
        reply = m.reply_to_message
        # In forum topics every message "replies" to the topic's creation message: not to us.
        return (reply is not None and reply.forum_topic_created is None and reply.from_user is not None
                and reply.from_user.id == self._bot_id)

    # --- outbound -------------------------------------------------------------------------

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        return await self._send(chat, text, reply_to=reply_to)

    async def send_part(self, chat: ChatRef, text: str, *, reply_to: str | None, stop: str | None) -> str:
        return await self._send(chat, text, reply_to=reply_to, markup=_stop_markup(stop))

    async def send_status(self, chat: ChatRef, text: str, *, stop: str) -> str:
        """A silent message carrying the Stop button (beside a draft, which has no buttons)."""
        return await self._send(chat, text, reply_to=None, markup=_stop_markup(stop), silent=True)

    async def _send(self, chat: ChatRef, text: str, *, reply_to: str | None,
                    markup: InlineKeyboardMarkup | None = None, silent: bool = False) -> str:
        # Quoting the question helps in a busy group; in a private chat it is noise.
        quote = (ReplyParameters(message_id=int(reply_to), allow_sending_without_reply=True)
                 if reply_to and reply_to.isdigit() and chat.chat_type is not ChatType.DM else None)

        async def call(body: str, mode: str | None) -> Message:
            return await self.bot.send_message(int(chat.chat_id), body, parse_mode=mode,
                                               message_thread_id=_thread(chat), reply_parameters=quote,
                                               reply_markup=markup, disable_notification=silent or None)

        sent = await self._deliver(text, call)
        return str(sent.message_id)

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        await self.edit_part(chat, message_id, text, stop=None)  # without a keyboard: a button goes

    async def edit_part(self, chat: ChatRef, message_id: str, text: str, *, stop: str | None) -> None:
        markup = _stop_markup(stop)

        async def call(body: str, mode: str | None) -> None:
            try:
                await self.bot.edit_message_text(body, chat_id=int(chat.chat_id), message_id=int(message_id),
                                                 parse_mode=mode, reply_markup=markup)
            except BadRequest as exc:
                if "not modified" not in str(exc).lower():  # same text again: already shown
                    raise

        await self._deliver(text, call)

    async def send_draft(self, chat: ChatRef, draft_id: int, text: str) -> None:
        """Show `text` as the chat's draft `draft_id` (empty: "Thinking…"). Raises `DraftsRefused`
        if the chat takes no drafts, else as `send` does."""
        async def call(body: str, mode: str | None) -> None:
            try:
                await self.bot.send_message_draft(int(chat.chat_id), draft_id, body, parse_mode=mode,
                                                  message_thread_id=_thread(chat))
            except (EndPointNotFound, InvalidToken) as exc:
                # PTB reports a 404 (an unknown method: a Bot API server from before 9.3) as InvalidToken.
                if isinstance(exc, InvalidToken) and "not found" not in str(exc).lower():
                    raise
                raise DraftsRefused("sendMessageDraft is not known to this Bot API server", everywhere=True) from None
            except BadRequest as exc:
                if _kind(exc) != "refused" or "draft" in str(exc).lower() or "peer" in str(exc).lower():
                    raise DraftsRefused(self._scrub(str(exc))) from None
                raise

        await self._deliver(text, call)

    async def delete_status(self, chat: ChatRef, message_id: str) -> None:
        """Remove a status message; where it cannot be deleted, at least its button."""
        try:
            await self.bot.delete_message(int(chat.chat_id), int(message_id))
        except RetryAfter as exc:
            raise RateLimited(_retry_after_s(exc)) from None
        except TelegramError as exc:
            log.info("telegram: could not delete a status message (%s); removing its button",
                     self._scrub(str(exc)))
            with contextlib.suppress(TelegramError):
                await self.bot.edit_message_reply_markup(int(chat.chat_id), int(message_id), reply_markup=None)

    def drafts_refused(self, chat: ChatRef, why: str, *, everywhere: bool = False) -> None:
        """Remember that `chat` (or, `everywhere`, every chat) takes no drafts; logged once per bot,
        then per chat at debug level."""
        self._drafts_off = self._drafts_off or everywhere
        self._no_drafts[chat.chat_id] = None
        level = logging.DEBUG if self._drafts_refusal_logged else logging.WARNING
        self._drafts_refusal_logged = True
        log.log(level, "telegram: chat %s refused a draft (%s); its answers stream by editing a message",
                chat.chat_id, why)

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        streaming = self.config.streaming
        button = self.stop_buttons.open(msg, run) if self.config.stop_button and streaming != "off" else None
        reply: EditStreamReply
        drafts = streaming == "draft" and not self._drafts_off and msg.chat_id not in self._no_drafts
        if drafts and draft_chat(msg.chat):
            reply = _TelegramDraftReply(self, msg, run, button)
        else:
            reply = _TelegramReply(self, msg, run, button, stream=streaming != "off")
        return reply

    # --- Stop buttons ---------------------------------------------------------------------

    async def _on_callback(self, query: CallbackQuery) -> None:
        """A button press: a Stop button's is `/stop` for its answer; the query is always answered."""
        text: str | None = None
        alert = False
        try:
            if (query.data or "").startswith(stop_button.PREFIX):
                user = query.from_user
                message = query.message if isinstance(query.message, Message) else None
                chat = self._chat_of(message) if message is not None else None

                async def is_admin() -> bool:
                    return chat is not None and await self._is_admin(int(chat.chat_id), user.id)

                press = await self.stop_buttons.press(self.gateway, self, chat, query.data, user_id=str(user.id),
                                                      user_name=user.full_name, press_id=f"tg{query.id}",
                                                      is_admin=is_admin)
                text, alert = press.text, press.outcome is PressOutcome.REFUSED
        except Exception:
            log.exception("telegram: could not handle a button press")
            text = "Something went wrong; please try /stop."
        try:
            await self.bot.answer_callback_query(query.id, text=(text or "")[:200] or None, show_alert=alert)
        except TelegramError as exc:  # too old, or answered already: the stop itself stands
            log.info("telegram: could not answer a button press: %s", self._scrub(str(exc)))

    @staticmethod
    def _chat_of(m: Message) -> ChatRef | None:
        """Where a message is: its chat (private or group) and forum topic."""
        if m.chat.type == TgChatType.PRIVATE:
            chat_type = ChatType.DM
        elif m.chat.type in (TgChatType.GROUP, TgChatType.SUPERGROUP):
            chat_type = ChatType.GROUP
        else:
            return None
        thread = str(m.message_thread_id) if m.is_topic_message and m.message_thread_id else None
        return ChatRef(PLATFORM, str(m.chat.id), chat_type, thread)

    async def _is_admin(self, chat_id: int, user_id: int) -> bool:
        try:
            member = await self.bot.get_chat_member(chat_id, user_id)
        except TelegramError as exc:
            log.info("telegram: could not check a member's status: %s", self._scrub(str(exc)))
            return False
        return member.status in (ChatMemberStatus.ADMINISTRATOR, ChatMemberStatus.OWNER)

    async def typing(self, chat: ChatRef) -> None:
        with contextlib.suppress(TelegramError):  # cosmetic
            await self.bot.send_chat_action(int(chat.chat_id), ChatAction.TYPING, message_thread_id=_thread(chat))

    def measure(self, text: str) -> int:
        """What Telegram counts: the visible text of our HTML rendering, in UTF-16 units."""
        return utf16_len(visible_text(to_html(text)))

    def measure_bound(self) -> Callable[[str], int]:
        return utf16_len  # the rendering only ever drops characters (markup) from the source

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        """Queue the notice on the chat's outbox and return: intake never waits on a chat's sends.
        A notice about a Stop button press is its answer instead (see `platforms/stop_button.py`)."""
        if self.stop_buttons.absorb(reply_to, text):
            return
        self.queue_notice(chat, text, reply_to=reply_to, kind=kind)

    async def _deliver(self, text: str, call: Callable[[str, str | None], Awaitable[T]]) -> T:
        """A send or edit: HTML first, plain text if Telegram refuses the HTML part. Raises
        RateLimited (a 429, or a transient network failure: try again later), MessageGone,
        Refused (this text, even plain) or OutboundError (this chat)."""
        try:
            rendered = to_html(text)
            if visible_text(rendered).strip():
                try:
                    return await call(rendered, ParseMode.HTML)
                except BadRequest as exc:
                    if _kind(exc) != "refused":
                        raise
                    log.info("telegram: HTML refused (%s); sending plain text", self._scrub(str(exc)))
            return await call(text, None)
        except RetryAfter as exc:
            raise RateLimited(_retry_after_s(exc)) from None
        except BadRequest as exc:  # a NetworkError subclass in PTB: must come first
            detail = self._scrub(str(exc))
            kind = _kind(exc)
            raise (MessageGone(detail) if kind == "gone" else Refused(detail) if kind == "refused"
                   else OutboundError(detail)) from None
        except Forbidden as exc:
            raise OutboundError(self._scrub(str(exc))) from None
        except NetworkError as exc:
            raise RateLimited(1.0) from exc
        except TelegramError as exc:
            raise OutboundError(self._scrub(str(exc))) from None

    # --- helpers --------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _scrub(self, text: str) -> str:
        """Belt and braces next to the log redactor: PTB puts the token in some messages."""
        return text.replace(self._token, "***")


def _conflict(exc: TelegramError, _scrub: Callable[[str], str]) -> str:
    if "webhook" in str(exc).lower():
        return ("409 Conflict: a webhook is set for this bot token, so getUpdates is refused "
                "(another instance running in webhook mode?)")
    return "409 Conflict: another process is polling Telegram with this bot token; only one instance may run per token"


# What a failure of the intake loop is, first match wins: (class, kind, log level, what to say).
# BadRequest is a NetworkError in PTB, but about the request: it goes before NetworkError.
_FAILURES: tuple[tuple[type[TelegramError], str, int, Callable[[TelegramError, Callable[[str], str]], str]], ...] = (
    (Conflict, "conflict", logging.ERROR, _conflict),
    (InvalidToken, "token", logging.ERROR, lambda _e, _s: "Telegram rejected the bot token (check telegram.token)"),
    (RetryAfter, "flood", logging.WARNING, lambda _e, _s: "Telegram asked us to slow down (429)"),
    (BadRequest, "api", logging.WARNING, lambda e, scrub: f"Telegram error: {scrub(str(e))}"),
    (NetworkError, "network", logging.WARNING,
     lambda e, scrub: f"cannot reach Telegram: {scrub(str(e)) or type(e).__name__}"),
    (TelegramError, "api", logging.WARNING, lambda e, scrub: f"Telegram error: {scrub(str(e))}"),
)


def failure(exc: Exception, scrub: Callable[[str], str]) -> tuple[str, int, str]:
    """(kind, log level, text) of a failure of the intake loop: the same kind logs once per outage."""
    for cls, kind, level, say in _FAILURES:
        if isinstance(exc, cls):
            return kind, level, say(exc, scrub)
    return "bug", logging.ERROR, f"unexpected {type(exc).__name__} in the Telegram loop"


def _album_of(update: Update) -> tuple[int, str] | None:
    m = update.message
    return (m.chat.id, m.media_group_id) if m is not None and m.media_group_id else None


def _albums(updates: Sequence[Update]) -> list[list[Update]]:
    """Updates in order, the consecutive parts of one album (same chat, same media group) together."""
    groups: list[list[Update]] = []
    for update in updates:
        album = _album_of(update)
        if groups and album is not None and _album_of(groups[-1][0]) == album:
            groups[-1].append(update)
        else:
            groups.append([update])
    return groups


def _attachments(m: Message) -> tuple[Attachment, ...]:
    """A photo (its largest size) or a file (a document, voice note, audio or video) as attachments;
    the router decides which are read. Stickers, polls, locations... are not files."""
    if m.photo:
        best = m.photo[-1]
        return (Attachment("image", f"photo_{m.message_id}.jpg", "image/jpeg", best.file_size, best.file_id),)
    if m.document is not None:
        d = m.document
        name = d.file_name or f"file_{m.message_id}"
        mime = mime_of(d.mime_type, name)
        kind: Literal["image", "file"] = "image" if mime.startswith("image/") else "file"
        return (Attachment(kind, name, mime, d.file_size, d.file_id),)
    for media, name, default in ((m.voice, "voice", "audio/ogg"), (m.audio, "audio", "audio/mpeg"),
                                 (m.video, "video", "video/mp4"), (m.video_note, "video_note", "video/mp4"),
                                 (m.animation, "animation", "video/mp4")):
        if media is not None:  # offered to the router, which says why it is not read
            fname = getattr(media, "file_name", None) or f"{name}_{m.message_id}"
            mime = mime_of(getattr(media, "mime_type", None) or default, fname)
            return (Attachment("file", fname, mime, media.file_size, media.file_id),)
    return ()


def _strip_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """Remove (offset, length) UTF-16 spans (our @mentions) and tidy the seams."""
    data = text.encode("utf-16-le")
    pieces, pos = [], 0
    for offset, length in sorted(spans):
        pieces.append(data[pos * 2:offset * 2].decode("utf-16-le"))
        pos = offset + length
    pieces.append(data[pos * 2:].decode("utf-16-le"))
    out = pieces[0]
    for piece in pieces[1:]:
        out += piece[1:] if out.endswith((" ", "\n")) and piece.startswith(" ") else piece
    return out.strip().lstrip(",:").strip()


def _kind(exc: BadRequest) -> str:
    """A Bad Request about the message to edit ("gone"), the chat ("chat"), or the text ("refused")."""
    text = str(exc).lower()
    if any(k in text for k in _GONE):
        return "gone"
    if any(k in text for k in _CHAT):
        return "chat"
    return "refused"


class _TelegramReply(EditStreamReply):
    """Edit streaming (groups, topics, chats without drafts) with the Stop button on its messages."""

    def __init__(self, adapter: TelegramAdapter, msg: InboundMessage, run: Run, button: StopButton | None, *,
                 stream: bool = True) -> None:
        super().__init__(adapter, msg.chat, run, reply_to=msg.message_id, stop=button)
        if not stream:  # streaming = "off": typing, then the final text only
            self._caps = dataclasses.replace(self._caps, can_stream=False)


class _TelegramDraftReply(DraftStreamReply):
    def __init__(self, adapter: TelegramAdapter, msg: InboundMessage, run: Run, button: StopButton | None) -> None:
        super().__init__(adapter, msg.chat, run, reply_to=msg.message_id, stop=button,
                         interval_s=adapter.config.draft_interval_s, refresh_s=adapter.config.draft_refresh_s)


def _stop_markup(data: str | None) -> InlineKeyboardMarkup | None:
    if data is None:
        return None
    return InlineKeyboardMarkup([[InlineKeyboardButton(stop_button.LABEL, callback_data=data)]])


def _thread(chat: ChatRef) -> int | None:
    return int(chat.thread_id) if chat.thread_id else None


def _retry_after_s(exc: RetryAfter) -> float:
    with warnings.catch_warnings():  # PTB 22 deprecates the int form; accept either
        warnings.simplefilter("ignore")
        value: int | dt.timedelta = exc.retry_after
    return value.total_seconds() if isinstance(value, dt.timedelta) else float(value)
