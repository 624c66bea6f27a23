"""What every platform adapter implements: the core's `Outlet` (replies and notices) built on
three outbound operations — send, edit, typing — plus intake started with the core's `Gateway`.

Outbound calls go through the adapter's `Outbox` (one queue and worker per chat, see
`platforms/outbox.py`); `send`, `edit` and `typing` are the raw calls its jobs make."""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.core.attachments import Attachment
from gateway.core.cancellation import Run, ToolReason
from gateway.core.messages import Capabilities, ChatRef, InboundMessage
from gateway.core.ports import Gateway, Health, NoticeKind, Reply
from platforms.errors import MessageGone, OutboundError, RateLimited, Refused, explain
from platforms.outbox import Job, Outbox, Priority
from platforms.splitting import utf16_len
from platforms.streaming import EditStreamReply

__all__ = ["Adapter", "MessageGone", "OutboundError", "RateLimited", "Refused"]

log = logging.getLogger(__name__)

NOTICE_ATTEMPTS = 5  # a notice is retried through this many 429s before it is given up (and logged)
URGENT_NOTICES = frozenset({NoticeKind.STOPPED, NoticeKind.INTERRUPTED, NoticeKind.RESTART})


class Adapter(ABC):
    """A platform. Subclasses set `name` and `capabilities` and implement the outbound trio."""

    name: str
    capabilities: Capabilities
    pushes_anywhere: bool = False  # see `Outlet.pushes_anywhere`
    can_steer: bool = True  # see `Outlet.can_steer`
    answers_later: bool = True  # see `Outlet.answers_later`
    _gateway: Gateway | None = None
    _outbox: Outbox | None = None

    @property
    def gateway(self) -> Gateway:
        if self._gateway is None:
            raise RuntimeError(f"the {self.name} adapter has not been started")
        return self._gateway

    @property
    def outbox(self) -> Outbox:
        """This adapter's per-chat outbound queues (made on first use)."""
        if self._outbox is None:
            self._outbox = Outbox(self.name, on_rate_limited=lambda: self.count("429"))
        return self._outbox

    @property
    def bot_username(self) -> str | None:
        return None

    async def start(self, gateway: Gateway) -> None:
        """Begin intake: every inbound message goes to `gateway`."""
        self._gateway = gateway

    async def stop(self) -> None:
        """Stop intake; replies already in flight may still be delivered."""

    async def close(self) -> None:
        """Release clients and connections (after the core has shut down); idempotent."""

    def routes(self) -> list[web.RouteDef]:
        """HTTP routes for the daemon's listener (web chat, API, webhooks)."""
        return []

    def middlewares(self) -> list[Middleware]:
        """Middlewares for that listener, inside its Host and Origin checks (the API's error shape)."""
        return []

    def health(self) -> Health:
        return Health(True, "ok")

    @abstractmethod
    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        """Send a message; returns its platform message id. Raises `RateLimited`, `Refused`
        (this content), or `OutboundError` (this chat)."""

    @abstractmethod
    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        """Replace the text of a message this adapter sent. Raises as `send` does, and
        `MessageGone` if the message no longer exists."""

    async def send_part(self, chat: ChatRef, text: str, *, reply_to: str | None, stop: str | None) -> str:
        """`send` for a part of a streaming reply; `stop`: show a Stop button for that token, where
        the platform has buttons (see `platforms/stop_button.py`)."""
        return await self.send(chat, text, reply_to=reply_to)

    async def edit_part(self, chat: ChatRef, message_id: str, text: str, *, stop: str | None) -> None:
        """`edit` for a part of a streaming reply; without `stop` a Stop button it showed is removed."""
        await self.edit(chat, message_id, text)

    async def typing(self, chat: ChatRef) -> None:
        """Show a typing indicator, if the platform has one."""

    async def attachment_url(self, att: Attachment) -> str:
        """Where to download an attachment this platform reported (asked in the turn, not at
        intake). Raises `LookupError` with a reason safe to show if it cannot be fetched."""
        raise LookupError("this platform does not serve files")

    def measure(self, text: str) -> int:
        """How long the platform counts `text` to be (its limit is `capabilities.max_message_len`)."""
        return utf16_len(text) if self.capabilities.length_unit == "utf16" else len(text)

    def measure_bound(self) -> Callable[[str], int] | None:
        """If `measure` is costly: a cheap function never below it (used to measure less)."""
        return None

    def outbox_key(self, chat: ChatRef) -> str:
        """The outbox queue `chat` belongs to: whatever the platform rate-limits on."""
        return chat.chat_id

    def count(self, kind: str) -> None:
        """Metrics: one outbound `send`/`edit`/`draft`/`notice`, or a `429` from the platform."""
        if self._gateway is not None:
            self._gateway.count_outbound(self.name, kind)

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        """Send a short notice (command replies, acks, rejections); never raises. It goes through
        the chat's outbox (a stop's notice ahead of streaming edits) and is awaited."""
        with contextlib.suppress(Exception):
            await self.outbox.run(self.outbox_key(chat), self._notice_call(chat, text, reply_to),
                                  priority=_priority(kind), attempts=NOTICE_ATTEMPTS)

    def queue_notice(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO) -> Job[None]:
        """Queue a notice without waiting for it (what an adapter whose intake must never wait on
        outbound calls uses for `notify`). Failures are logged."""
        return self.outbox.put(self.outbox_key(chat), self._notice_call(chat, text, reply_to),
                               priority=_priority(kind), attempts=NOTICE_ATTEMPTS)

    def _notice_call(self, chat: ChatRef, text: str, reply_to: str | None) -> Callable[[], Awaitable[None]]:
        async def deliver() -> None:
            try:
                await self.send(chat, text, reply_to=reply_to)
            except RateLimited:
                raise  # the outbox waits it out and tries again
            except Exception as exc:
                log.warning("%s: could not deliver a notice to chat %s: %s", self.name, chat.chat_id, explain(exc))
                return
            self.count("notice")

        return deliver

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        return EditStreamReply(self, msg.chat, run, reply_to=msg.reply_target)


def _priority(kind: NoticeKind) -> Priority:
    return Priority.URGENT if kind in URGENT_NOTICES else Priority.NOTICE
