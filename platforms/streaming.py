"""The streaming engine: a run's token stream becomes throttled edits of one message, split into
parts when it grows past the platform's limit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from gateway.core.cancellation import Run, ToolReason, stop_notice
from gateway.core.messages import Capabilities, ChatRef
from gateway.core.ports import NoticeKind, Reply
from platforms.errors import OutboundError, RateLimited
from platforms.splitting import split_text, utf16_len

if TYPE_CHECKING:
    from platforms.base import Adapter

log = logging.getLogger(__name__)


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
            await self._adapter.notify(self._chat, notice, reply_to=self._reply_to, kind=NoticeKind.INTERRUPTED,
                                       reason=reason)


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
        while not self._shown and self._run.may_send():  # a chat action is output too: guarded
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
