"""What every platform adapter implements, and the streaming reply built on it.

An adapter turns platform events into `InboundMessage`s for the router and offers three
outbound operations — send, edit, typing. `EditStreamReply` turns a run's token stream into
throttled edits of one message (split into parts when it grows past the platform's limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Literal

from gateway.core.cancellation import Run, ToolReason
from gateway.core.messages import Capabilities, ChatRef, InboundMessage
from platforms.splitting import split_text, utf16_len

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.core.router import Router

log = logging.getLogger(__name__)


MEDIA_ONLY = "I can only read text for now."

# What a notice is about, for platforms that show kinds differently (the web chat styles them).
NoticeKind = Literal["info", "error", "queued", "stopped", "restart", "interrupted"]


class RateLimited(Exception):
    """The platform asked us to wait `retry_after` seconds before the next call."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"rate limited for {retry_after:g} s")
        self.retry_after = retry_after


class OutboundError(Exception):
    """A send or edit failed for a reason retrying will not fix."""


def stop_notice(reason: ToolReason) -> str:
    if reason.kind == "user" and reason.text.startswith("stopped by user"):
        return "⏹ stopped"
    return f"⏹ interrupted: {reason.text}"


class Reply(ABC):
    """The outbound side of one turn. Implementations drop output once the run is cancelled."""

    @abstractmethod
    async def delta(self, text: str) -> None:
        """More assistant text arrived."""

    @abstractmethod
    async def finish(self, text: str) -> None:
        """The turn ended normally; `text` is the whole final answer."""

    @abstractmethod
    async def interrupted(self, reason: ToolReason) -> None:
        """The turn was stopped: show that, once, and send nothing more."""

    @abstractmethod
    async def failed(self, text: str) -> None:
        """The agent failed; tell the user in words."""

    async def settled(self) -> None:
        """The turn is over and its outcome recorded; nothing more will be said for it."""


class Adapter(ABC):
    """A platform. Subclasses set `name` and `capabilities` and implement the outbound trio."""

    name: str
    capabilities: Capabilities
    router: Router
    # Can any worker reach this platform's chats (a REST API), or only the one holding the
    # user's connection (web chat, HTTP API)? Decides whether messages may be forwarded.
    pushes_anywhere: bool = False

    async def start(self, router: Router) -> None:
        self.router = router

    async def stop(self) -> None:
        """Stop intake; replies already in flight may still be delivered."""

    def routes(self, app: web.Application) -> None:
        """Add HTTP routes to the daemon's listener (web chat, API, webhooks)."""

    def healthy(self) -> tuple[bool, str]:
        return True, "ok"

    @abstractmethod
    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        """Send a message; returns its platform message id."""

    @abstractmethod
    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        """Replace the text of a message this adapter sent."""

    async def typing(self, chat: ChatRef) -> None:
        """Show a typing indicator, if the platform has one."""

    def count(self, kind: str) -> None:
        """Metrics: one outbound `send`/`edit`/`notice`, or a `429` from the platform."""
        router = getattr(self, "router", None)
        if router is None:
            return
        if kind == "429":
            router.metrics.platform_429s.labels(self.name).inc()
        else:
            router.metrics.messages_out.labels(self.name, kind).inc()

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = "info") -> None:
        """Send a short notice (command replies, acks, rejections); never raises."""
        try:
            await self.send(chat, text, reply_to=reply_to)
            self.count("notice")
        except Exception as exc:
            log.warning("%s: could not deliver a notice: %s", self.name, exc)

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        return EditStreamReply(self, msg.chat, run, reply_to=msg.message_id)

    async def media_only(self, msg: InboundMessage) -> None:
        """A message with nothing we can read (a photo, a sticker): say so rather than stay silent
        — but only to users the access policy lets in; a stranger gets the pairing code instead."""
        access = self.router.access
        if access is not None:
            allowed, notice = await access.check(msg)
            if not allowed:
                if notice:
                    await self.notify(msg.chat, notice, reply_to=msg.message_id)
                return
        await self.notify(msg.chat, MEDIA_ONLY, reply_to=msg.message_id, kind="error")


class EditStreamReply(Reply):
    """Streams by editing one message at most every `edit_interval_s`; splits long answers.

    A background pump coalesces deltas, so a slow platform skips intermediate states rather
    than slowing the agent; unchanged text is never re-sent; the final text is always sent.
    """

    TYPING_AFTER_S = 0.2
    TYPING_EVERY_S = 4.0
    FINAL_RETRIES = 5

    def __init__(self, adapter: Adapter, chat: ChatRef, run: Run, *, reply_to: str | None) -> None:
        self._adapter = adapter
        self._chat = chat
        self._run = run
        self._reply_to = reply_to
        self._caps = adapter.capabilities
        self._text = ""
        self._shown: list[tuple[str, str]] = []  # (message id, text) per part
        self._dirty = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        # Typing starts after a moment, so a quick answer costs no extra call.
        self._typing: asyncio.Task[None] | None = None
        self._typing_timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            self.TYPING_AFTER_S, self._start_typing)
        self._ended = False
        self._notice_shown = False
        self._pump_scheduled = False
        self._pump_rendering = False  # the pump is inside _render (a send may be in flight)

    async def delta(self, text: str) -> None:
        if self._ended or not self._run.may_send():
            return
        self._text += text
        if self._caps.can_edit and self._caps.can_stream:
            self._dirty.set()
            if not self._pump_scheduled:  # a pump only if the answer outlives this loop iteration
                self._pump_scheduled = True
                asyncio.get_running_loop().call_soon(self._start_pump)

    async def finish(self, text: str) -> None:
        if self._ended or not self._run.may_send():
            return
        await self._end()
        self._text = text
        await self._render(text or "(no answer)", final=True)

    async def interrupted(self, reason: ToolReason) -> None:
        if self._notice_shown:
            return
        self._notice_shown = True
        await self._end()
        if self._run.guard is not None and not self._run.guard():
            return  # the session belongs to another worker now: it speaks for it
        notice = stop_notice(reason)
        if self._shown and self._caps.can_edit:
            mid, shown = self._shown[-1]
            try:
                await self._adapter.edit(self._chat, mid, _with_notice(shown, notice, self._caps))
            except Exception as exc:
                log.warning("%s: could not mark a reply stopped: %s", self._adapter.name, exc)
        elif reason.kind == "system":
            # Nothing visible yet, and the user did not ask for this: say so.
            await self._adapter.notify(self._chat, notice, reply_to=self._reply_to, kind="interrupted")


    async def failed(self, text: str) -> None:
        if self._ended or not self._run.may_send():
            return
        await self._end()
        body = f"{self._text}\n\n⚠️ {text}" if self._text else f"⚠️ {text}"
        await self._render(body, final=True)

    def _start_pump(self) -> None:
        if not self._ended:
            self._pump = asyncio.get_running_loop().create_task(self._pump_edits())

    def _start_typing(self) -> None:
        self._typing_timer = None
        if not self._ended and not self._shown:
            self._typing = asyncio.get_running_loop().create_task(self._keep_typing())

    async def _end(self) -> None:
        self._ended = True
        if self._typing_timer is not None:
            self._typing_timer.cancel()
        if self._pump is not None and self._pump_rendering:
            # Let an in-flight send land and be recorded: cancelled, its message would exist
            # without our knowing its id, and the final text would go out as a second message.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._pump)
        for task in (self._pump, self._typing):
            if task is not None and not task.done():
                task.cancel()
                # asyncio.wait, not `await task` under suppress(CancelledError): that would also
                # swallow a cancel aimed at *this* task (a /stop landing right now).
                await asyncio.wait({task})

    async def _keep_typing(self) -> None:
        while not self._shown:
            with contextlib.suppress(Exception):
                await self._adapter.typing(self._chat)
            await asyncio.sleep(self.TYPING_EVERY_S)

    async def _pump_edits(self) -> None:
        last = 0.0
        while not self._ended:
            await self._dirty.wait()
            wait = last + self._caps.edit_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._dirty.clear()
            last = time.monotonic()
            self._pump_rendering = True
            try:
                await self._render(self._text, final=False)
            except RateLimited as exc:  # skip intermediate states until the platform is ready
                last = time.monotonic() + exc.retry_after
                self._dirty.set()
            finally:
                self._pump_rendering = False

    async def _render(self, text: str, *, final: bool) -> None:
        measure = utf16_len if self._caps.length_unit == "utf16" else len
        for i, part in enumerate(split_text(text, self._caps.max_message_len, measure)):
            await self._put(i, part, final=final)

    async def _put(self, index: int, text: str, *, final: bool) -> None:
        for attempt in range(self.FINAL_RETRIES if final else 1):
            if not self._run.may_send():
                return
            try:
                if index < len(self._shown):
                    mid, shown = self._shown[index]
                    if shown != text and self._caps.can_edit:
                        await self._adapter.edit(self._chat, mid, text)
                        self._shown[index] = (mid, text)
                        self._adapter.count("edit")
                else:
                    mid = await self._adapter.send(self._chat, text,
                                                   reply_to=self._reply_to if index == 0 else None)
                    self._shown.append((mid, text))
                    self._adapter.count("send")
                return
            except RateLimited as exc:
                self._adapter.count("429")
                if not final or attempt == self.FINAL_RETRIES - 1:
                    raise
                await asyncio.sleep(exc.retry_after)
            except OutboundError as exc:
                log.warning("%s: %s failed: %s", self._adapter.name,
                            "edit" if index < len(self._shown) else "send", exc)
                return


def _with_notice(text: str, notice: str, caps: Capabilities) -> str:
    measure = utf16_len if caps.length_unit == "utf16" else len
    joined = f"{text}\n\n{notice}"
    if measure(joined) <= caps.max_message_len:
        return joined
    room = caps.max_message_len - measure(notice) - 3
    while measure(text) > room:  # trim from the end until the notice fits (UTF-16 aware)
        text = text[: max(0, len(text) - max(1, measure(text) - room))]
    return text + "…\n\n" + notice
