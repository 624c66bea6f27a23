"""The background work of a streaming reply: when its intermediate states go out, and what shows
that an answer is coming before its first message (typing, or a draft)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from gateway.core.cancellation import Run
from gateway.core.messages import ChatRef
from platforms.errors import RateLimited
from platforms.outbox import Outbox, Priority

log = logging.getLogger(__name__)

TYPING_EVERY_S = 4.0


class TypingPlatform(Protocol):
    """What the pacer needs of a platform: its outbox and its typing indicator."""

    @property
    def name(self) -> str: ...

    @property
    def outbox(self) -> Outbox: ...

    def outbox_key(self, chat: ChatRef) -> str: ...

    async def typing(self, chat: ChatRef) -> None: ...


class ReplyPacer:
    """A pump that shows the latest state at most every `interval()` — coalescing what arrived
    meanwhile, so a slow platform skips intermediate states rather than slowing the agent — and an
    indicator started after a moment, so a quick answer costs no extra call.

    Invariant: it keeps no reference to its reply except in its tasks and its timer, which `stop`
    ends and lets go of; a reply is freed by reference counting, with no cycle left for the GC.
    """

    def __init__(self, platform: TypingPlatform, chat: ChatRef, run: Run) -> None:
        self._platform = platform
        self._chat = chat
        self._run = run
        self._outbox = platform.outbox
        self._key = platform.outbox_key(chat)
        self._dirty = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._pump_scheduled = False
        self._indicator: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.stopped = False

    def after(self, delay_s: float, start: Callable[[], None]) -> None:
        """Call `start` after `delay_s` (to start the indicator), unless stopped first."""
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._fire, start)

    def _fire(self, start: Callable[[], None]) -> None:
        self._timer = None
        start()

    def indicate(self, work: Coroutine[Any, Any, None]) -> None:
        """Run the indicator (`keep_typing`, a draft kept alive) until it ends or the pacer stops."""
        self._indicator = asyncio.get_running_loop().create_task(work)

    def wake(self, render: Callable[[], Awaitable[None]], interval: Callable[[], float], *,
             now: bool = False) -> None:
        """There is something new to show: `render` shows it when due. The first wake starts the
        pump on the next loop iteration — an answer complete within this one costs no
        intermediate state — or `now`."""
        self._dirty.set()
        if self._pump_scheduled:
            return
        self._pump_scheduled = True
        if now:
            self._start_pump(render, interval)
        else:
            asyncio.get_running_loop().call_soon(self._start_pump, render, interval)

    def _start_pump(self, render: Callable[[], Awaitable[None]], interval: Callable[[], float]) -> None:
        if not self.stopped:
            self._pump = asyncio.get_running_loop().create_task(self._pump_states(render, interval))

    async def _pump_states(self, render: Callable[[], Awaitable[None]], interval: Callable[[], float]) -> None:
        last = 0.0
        while not self.stopped:
            await self._dirty.wait()
            wait = last + interval() - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._dirty.clear()
            last = time.monotonic()
            try:
                await render()
            except RateLimited as exc:  # skip intermediate states until the platform is ready
                last = time.monotonic() + exc.retry_after
                self._dirty.set()
            except Exception:
                log.exception("%s: streaming a reply failed", self._platform.name)
                return

    async def keep_typing(self, sent: Callable[[], bool]) -> None:
        """Show typing until the reply has `sent` a message (or the pacer stops, or the run may no
        longer send)."""
        while not sent() and not self.stopped and self._run.may_send():
            if not self._outbox.busy(self._key):  # cosmetic: never queued behind output or into a 429
                self._outbox.put(self._key, self._type, priority=Priority.TYPING, kind="typing", owner=self)
            await asyncio.sleep(TYPING_EVERY_S)

    async def _type(self) -> None:
        if not self._run.may_send():  # a chat action is output too: guarded when it runs, not when queued
            return
        with contextlib.suppress(Exception):
            await self._platform.typing(self._chat)

    async def stop(self) -> None:
        """Stop for good: the timer, the pump and the indicator end (waited for), queued typing is
        withdrawn."""
        self.stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        tasks = [t for t in (self._pump, self._indicator) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            # asyncio.wait, not `await task` under suppress(CancelledError): that would also
            # swallow a cancel aimed at *this* task (a /stop landing right now).
            await asyncio.wait(tasks)
        # A cancelled task keeps its CancelledError, whose traceback holds the task's frame and so
        # the reply: let go of the tasks, or every reply ends as a reference cycle for the GC.
        self._pump = self._indicator = None
        self._outbox.withdraw(self._key, self)
