"""Telegram through python-telegram-bot's `Bot`: long polling (or a webhook) in, throttled edits out.

The adapter wires four owners together:

- `TelegramTransport` (`platforms/telegram_transport.py`): the polling loop or the webhook; each
  update is handed to `Router.submit` (which records the message durably and de-duplicates it)
  before Telegram is told it arrived;
- `TelegramIntake` (`platforms/telegram_intake.py`): which updates are for us, as `InboundMessage`s;
- `TelegramOutbound` (`platforms/telegram_outbound.py`): the Bot API calls out, failures mapped;
- `DraftChats` and `DraftStreamReply` (`platforms/telegram_draft.py`): private chats' drafts.

Submitting never waits on a chat's sends: notices and replies queue on the adapter's per-chat
outbox (`platforms/outbox.py`), so one slow or rate-limited chat delays no other chat's intake,
`/stop` included.

Parts are measured by what Telegram counts: the visible text after our Markdown is rendered as
HTML (UTF-16 units). A part Telegram refuses as HTML is resent as plain text; `MessageGone` and
`Refused` tell the streaming engine to continue in a new message or to split smaller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from aiohttp import web
from telegram import Bot, CallbackQuery, Message, Update
from telegram.request import HTTPXRequest

from gateway.core.attachments import Attachment
from gateway.core.cancellation import Run, ToolReason
from gateway.core.messages import Capabilities, ChatRef, InboundMessage
from gateway.core.ports import Gateway, Health, NoticeKind, Outcome, Reply, Submitted
from platforms import stop_button
from platforms.base import Adapter
from platforms.config import TelegramConfig
from platforms.ingress import IngressLeader
from platforms.splitting import utf16_len
from platforms.stop_button import PressOutcome, StopButton, StopButtons
from platforms.streaming import EditStreamReply
from platforms.telegram_draft import DraftChats, DraftStreamReply
from platforms.telegram_format import to_html, visible_text
from platforms.telegram_intake import PLATFORM, BotIdentity, TelegramIntake, chat_of
from platforms.telegram_outbound import TelegramOutbound, token_scrubber
from platforms.telegram_transport import TelegramTransport

log = logging.getLogger(__name__)

CLOSE_FLUSH_S = 5.0  # on close, how long queued replies and notices may still take


class TelegramAdapter(Adapter):
    name = PLATFORM
    pushes_anywhere = True  # the Bot API reaches any chat from any process

    def __init__(self, config: TelegramConfig, *, leader: IngressLeader | None = None) -> None:
        if config.token is None:
            raise ValueError("telegram.token is required")
        self.config = config
        self.capabilities = Capabilities(max_message_len=4096, can_edit=True, can_stream=True,
                                         edit_interval_s=config.edit_interval_s, length_unit="utf16")
        token = config.token.reveal()
        self._scrub = token_scrubber(token)
        # Long polls get their own connection so sends never queue behind one.
        self._requests = (HTTPXRequest(connection_pool_size=64, read_timeout=15, write_timeout=15,
                                       connect_timeout=10, pool_timeout=5),
                          HTTPXRequest(connection_pool_size=1, read_timeout=10, connect_timeout=10))
        self.bot = Bot(token, base_url=config.base_url, base_file_url=config.base_file_url,
                       request=self._requests[0], get_updates_request=self._requests[1])
        self._me = BotIdentity()
        self._intake = TelegramIntake(self._me, config.groups)
        self._out = TelegramOutbound(self.bot, self._scrub)
        # Cluster mode: only the worker holding the leader's lease polls; the offset lives in Redis.
        self._transport = TelegramTransport(self.bot, config, self._me, self._handle, leader=leader,
                                            scrub=self._scrub)
        self.ready = self._transport.ready  # set once connected (polling, or the webhook registered)
        self.stop_buttons = StopButtons(PLATFORM)
        self._drafts = DraftChats(interval_s=config.draft_interval_s, refresh_s=config.draft_refresh_s)
        self._closed = False
        self._background: set[asyncio.Task[Any]] = set()

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def bot_username(self) -> str | None:
        return self._me.username or None

    async def start(self, gateway: Gateway) -> None:
        await super().start(gateway)
        self._transport.start()

    def routes(self) -> list[web.RouteDef]:
        return self._transport.routes()

    async def stop(self) -> None:
        """Stop intake. An update being submitted is finished first; the client stays open
        for replies still in flight (it is closed with the daemon's HTTP app)."""
        await self._transport.stop()

    async def close(self) -> None:
        """Release the HTTP clients (idempotent). The daemon calls this after the core has shut
        down, so replies being marked interrupted still have a client."""
        if self._closed:
            return
        self._closed = True
        await self.outbox.close(CLOSE_FLUSH_S)  # stop marks and last notices still go out
        self._transport.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*(r.shutdown() for r in self._requests), return_exceptions=True)

    def health(self) -> Health:
        return self._transport.health()

    # --- intake ---------------------------------------------------------------------------

    async def _handle(self, update: Update, album: Sequence[Update] = ()) -> bool:
        """Turn one update (with the rest of its `album`, if any) into a router submission; never
        raises (a bad update is skipped). Returns once the router has stored the message: it never
        waits on outbound calls. False when it could not be taken now (storage down) and must be
        delivered again."""
        try:
            if update.callback_query is not None:
                # A task of its own: a press never holds up intake, and intake never holds it up.
                self._spawn(self._on_press(update.callback_query))
                return True
            msg = self._intake.inbound(update, album)
            if msg is not None:
                return (await self._submit(msg)).outcome is not Outcome.UNAVAILABLE
        except Exception:
            log.exception("telegram: could not process update %d", update.update_id)
        return True

    async def _submit(self, msg: InboundMessage, key: str | None = None) -> Submitted:
        return await self.gateway.submit(msg, self, key=key)

    async def _on_press(self, query: CallbackQuery) -> None:
        """A button press: a Stop button's is `/stop` for its answer; the query is always answered."""
        text: str | None = None
        alert = False
        try:
            if (query.data or "").startswith(stop_button.PREFIX):
                user = query.from_user
                message = query.message if isinstance(query.message, Message) else None
                chat = chat_of(message) if message is not None else None

                async def is_admin() -> bool:
                    return chat is not None and await self._out.is_admin(int(chat.chat_id), user.id)

                press = await self.stop_buttons.press(self._submit, chat, query.data, user_id=str(user.id),
                                                      user_name=user.full_name, press_id=f"tg{query.id}",
                                                      is_admin=is_admin)
                text, alert = press.text, press.outcome is PressOutcome.REFUSED
        except Exception:
            log.exception("telegram: could not handle a button press")
            text = "Something went wrong; please try /stop."
        await self._out.answer_press(query.id, text, alert=alert)

    async def attachment_url(self, att: Attachment) -> str:
        """getFile, asked in the turn: its download URL (which carries the token: never logged)."""
        return await self._out.file_url(att)

    # --- outbound -------------------------------------------------------------------------

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        return await self._out.send(chat, text, reply_to=reply_to)

    async def send_part(self, chat: ChatRef, text: str, *, reply_to: str | None, stop: str | None) -> str:
        return await self._out.send(chat, text, reply_to=reply_to, stop=stop)

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        await self._out.edit(chat, message_id, text, stop=None)  # without a keyboard: a button goes

    async def edit_part(self, chat: ChatRef, message_id: str, text: str, *, stop: str | None) -> None:
        await self._out.edit(chat, message_id, text, stop=stop)

    async def typing(self, chat: ChatRef) -> None:
        await self._out.typing(chat)

    def measure(self, text: str) -> int:
        """What Telegram counts: the visible text of our HTML rendering, in UTF-16 units."""
        return utf16_len(visible_text(to_html(text)))

    def measure_bound(self) -> Callable[[str], int]:
        return utf16_len  # the rendering only ever drops characters (markup) from the source

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        """Queue the notice on the chat's outbox and return: intake never waits on a chat's sends.
        A notice about a Stop button press is its answer instead (see `platforms/stop_button.py`);
        a typed /stop's "Stopped." right after an empty draft ended as "⏹ stopped" is not sent again."""
        if self.stop_buttons.absorb(reply_to, text):
            return
        if kind is NoticeKind.STOPPED and self._drafts.take_drafts(chat) and not self._drafts.say_stop(chat, "notice"):
            return  # an empty draft's "⏹ stopped" said it just now (one stop, one message)
        self.queue_notice(chat, text, reply_to=reply_to, kind=kind)

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        streaming = self.config.streaming
        button = self.stop_buttons.open(msg, run) if self.config.stop_button and streaming != "off" else None
        if streaming == "draft" and self._drafts.take_drafts(msg.chat):
            return DraftStreamReply(self, self._out, self._drafts, msg.chat, run, reply_to=msg.reply_target,
                                    stop=button)
        return _TelegramReply(self, msg, run, button, stream=streaming != "off")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _TelegramReply(EditStreamReply):
    """Edit streaming (groups, topics, chats without drafts) with the Stop button on its messages."""

    def __init__(self, adapter: TelegramAdapter, msg: InboundMessage, run: Run, button: StopButton | None, *,
                 stream: bool = True) -> None:
        super().__init__(adapter, msg.chat, run, reply_to=msg.reply_target, stop=button)
        if not stream:  # streaming = "off": typing, then the final text only
            self._caps = dataclasses.replace(self._caps, can_stream=False)
