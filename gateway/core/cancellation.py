"""Per-run cancellation: one `Run` per turn, bound through a context variable.

Nothing here is process-global. A run owns its task, the I/O it registered (provider
connections, tool process groups) and the reason it was stopped. Code in worker threads finds
its run through `current_run`, which `asyncio.to_thread` copies and `run_in_executor` (below)
copies explicitly.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, Protocol, TypeVar

# Background tasks (not runs) are stopped with this: defined at the bottom layer, for the leases.
from agent_cache.tasks import cancel_and_wait as cancel_and_wait

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

ReasonKind = Literal["user", "system"]


@dataclass(frozen=True, slots=True)
class ToolReason:
    """Who stopped a run (`user` or `system`) and why, in a few words. There is no default."""

    kind: ReasonKind
    text: str

    def __post_init__(self) -> None:
        if self.kind not in ("user", "system"):
            raise ValueError(f"tool_reason kind must be 'user' or 'system', got {self.kind!r}")
        if not self.text.strip():
            raise ValueError("tool_reason text must not be empty")

    @classmethod
    def user(cls, text: str) -> ToolReason:
        return cls("user", text)

    @classmethod
    def system(cls, text: str) -> ToolReason:
        return cls("system", text)

    @property
    def marker(self) -> str:
        """What the model sees in place of an interrupted tool result."""
        return f"[interrupted by {self.kind}: {self.text}]"


# The reasons the gateway itself uses, named once.
STOPPED_BY_USER = ToolReason.user("stopped by user (/stop)")
NEW_MESSAGE = ToolReason.user("user sent a new message")
SESSION_RESET = ToolReason.user("session reset (/new)")
EVICTED = ToolReason.system("evicted from agent cache")
GATEWAY_RESTART = ToolReason.system("gateway restart")
CLIENT_DISCONNECTED = ToolReason.system("client disconnected")
REPLY_FAILED = ToolReason.system("the reply to the client failed")  # a fault in the reply path, not the run
STOPPED_BY_OPERATOR = ToolReason.system("stopped by operator")
LEASE_LOST = ToolReason.system("session lease lost")
PROCESS_DIED = ToolReason.system("gateway stopped before the turn finished")
TAKEN_OVER = ToolReason.system("worker stopped responding; session taken over")
NOT_RECORDED = ToolReason.system("the answer could not be stored")  # shown whole means recorded


def timed_out(seconds: float) -> ToolReason:
    return ToolReason.system(f"turn timed out after {seconds:g} s")


def stop_notice(reason: ToolReason) -> str:
    """How a stopped turn is marked in the chat: the user's own stop briefly, anything else by name."""
    if reason.kind == "user" and reason.text.startswith("stopped by user"):
        return "⏹ stopped"
    return f"⏹ interrupted: {reason.text}"


class Guard(Protocol):
    """Ownership of a session, as a run checks it before output (cluster mode)."""

    def __call__(self) -> bool:
        """Provably ours by our own clock: no I/O, no state change."""

    async def confirm(self) -> bool:
        """Ask the lease store once (renewing the lease if it is still ours); False: it is not ours."""


async def still_ours(guard: Guard | None) -> bool:
    """The one "is this session still ours?" check before output that matters: our own clock
    first (no I/O), the lease store only when the clock can no longer tell. No guard: one process,
    always ours."""
    return guard is None or guard() or await guard.confirm()


class RunCancelled(Exception):
    """Raised inside thread-based tools by `Run.raise_if_cancelled`."""

    def __init__(self, reason: ToolReason) -> None:
        super().__init__(reason.marker)
        self.reason = reason


_run_ids = itertools.count(1)
_closer_ids = itertools.count(1)


# A cancel is re-delivered until the run's task has ended: first after REDELIVER_FIRST_S, then at
# doubling intervals up to REDELIVER_MAX_S. A task that swallows one CancelledError gets the next
# at its next await (anyio's level-triggered cancellation, in asyncio's terms).
REDELIVER_FIRST_S = 0.001
REDELIVER_MAX_S = 0.1


class Run:
    """The cancellation scope of one turn of one session.

    Created when a message is accepted (before it is queued), so a cancel that lands while the
    turn is still queued or starting finds it and wins. `cancel` is synchronous and returns at
    once: it records the reason, closes every registered I/O handle and cancels the task — and
    keeps cancelling it until it has ended, so a task that swallows `CancelledError` (a
    third-party tool, a library) is cancelled again at its next await. The owner waits for the
    task with `join(grace_s)`, which gives up `grace_s` after the cancel: the turn is recorded
    and its lane freed even if a misbehaving task never ends (its output stays held back, since
    `may_send` is false once cancelled, and its late end is logged).
    """

    __slots__ = ("__weakref__", "_abandoned", "_closers", "_ended", "_on_cancelled", "_reason", "_redeliver",
                 "_task", "_task_ended", "_thread_event", "_token", "_waiters", "cancelled_at", "done_at", "guard",
                 "redeliveries", "run_id", "session_key", "started_at", "tenant")

    def __init__(self, session_key: str, *, guard: Guard | None = None, tenant: str | None = None) -> None:
        self.run_id = f"r{next(_run_ids)}"
        self._token: str | None = None
        self.session_key = session_key
        self.tenant = tenant  # whose turn this is, where the platform knows (tools may be limited by it)
        # In cluster mode: "do we still provably own the session?" — a pure check made before
        # anything is sent.
        self.guard = guard
        self.started_at: float | None = None
        self.cancelled_at: float | None = None  # perf_counter() at cancel
        self.done_at: float | None = None  # perf_counter() when the run's task ended
        self._reason: ToolReason | None = None
        self._task: asyncio.Task[Any] | None = None  # until it ends: its context holds this run (a cycle)
        self._task_ended = False
        self._closers: dict[int, Callable[[], object]] = {}
        self._ended = False
        self._waiters: list[asyncio.Future[None]] = []
        self._thread_event: threading.Event | None = None  # made on first use: most runs never need it
        self._on_cancelled: asyncio.Future[None] | None = None  # resolved by cancel() or the end, for join()
        self._redeliver: asyncio.TimerHandle | None = None
        self._abandoned = False  # join() gave up on the task: it outlived the grace after its cancel
        self.redeliveries = 0  # cancels delivered to the task after the first

    @property
    def thread_event(self) -> threading.Event:
        """Set when the run is cancelled: thread-based tools can block on it instead of polling."""
        event = self._thread_event
        if event is None:
            event = self._thread_event = threading.Event()
            if self._reason is not None:  # re-check after publishing: cancel() may have just run
                event.set()
        return event

    @property
    def token(self) -> str:
        """Names this run across workers and restarts (run ids restart with the process): what a
        Stop button carries, so a press stops this turn and no later one. Drawn on first use."""
        if self._token is None:
            self._token = secrets.token_urlsafe(9)
        return self._token

    @property
    def reason(self) -> ToolReason | None:
        return self._reason

    def is_cancelled(self) -> bool:
        return self._reason is not None

    def may_send(self) -> bool:
        """May output of this run still reach the chat? Not once cancelled, nor once its session's
        lease can no longer be proven. A question only: it changes nothing."""
        return self._reason is None and (self.guard is None or self.guard())

    async def may_send_now(self) -> bool:
        """`may_send`, but where our own clock can no longer prove the lease (a pause just ended)
        the lease store is asked before the answer is no: output that matters (a final text, a
        stop mark) is then neither dropped while the session is still ours nor sent once it is not."""
        if self._reason is not None:
            return False
        return await still_ours(self.guard)

    def raise_if_cancelled(self) -> None:
        if self._reason is not None:
            raise RunCancelled(self._reason)

    def cancel(self, reason: ToolReason) -> bool:
        """Stop this run for `reason`; False if it was already stopped or finished.

        Synchronous: the reason is recorded, every closer has run and the task is cancelled when
        this returns; the cancel is then re-delivered until the task has ended."""
        if not isinstance(reason, ToolReason):
            raise TypeError("cancel() needs a ToolReason; there is no default reason")
        if self._reason is not None or self.finished:
            return False
        self._reason = reason
        self.cancelled_at = time.perf_counter()
        if (event := self._thread_event) is not None:
            event.set()
        closers, self._closers = list(self._closers.values()), {}
        for close in closers:
            try:
                close()
            except Exception:  # one bad closer must not keep the others from running
                log.exception("closer failed while cancelling %s", self.run_id)
        if (waiter := self._on_cancelled) is not None and not waiter.done():
            waiter.set_result(None)
        self._deliver(0.0)
        return True

    def _deliver(self, interval: float) -> None:
        """Cancel the task, and again after a while (doubling the interval) until it has ended."""
        task, reason = self._task, self._reason
        self._redeliver = None
        if task is None or reason is None or task.done():
            return
        if interval:
            self.redeliveries += 1
        task.cancel(reason.marker)
        interval = min(max(2 * interval, REDELIVER_FIRST_S), REDELIVER_MAX_S)
        self._redeliver = task.get_loop().call_later(interval, self._deliver, interval)

    @contextmanager
    def on_cancel(self, close: Callable[[], object]) -> Iterator[None]:
        """Call `close` (synchronously, from `cancel`) if the run is stopped inside this block.

        If the run is already cancelled, `close` runs at once and the block is still entered;
        the caller's next await will be cancelled anyway.
        """
        if self._reason is not None:
            close()
            yield
            return
        key = next(_closer_ids)
        self._closers[key] = close
        try:
            yield
        finally:
            self._closers.pop(key, None)

    def attach(self, task: asyncio.Task[T]) -> None:
        """Bind the task that executes this run; a cancel that came first cancels it now."""
        self._task = task
        self.started_at = time.time()
        task.add_done_callback(self._on_done)
        self._deliver(0.0)  # a no-op unless a cancel came first

    async def join(self, grace_s: float) -> bool:
        """Wait for the task bound by `attach` to end — once the run is cancelled, for at most
        `grace_s` after the cancel. True if it ended; False if it is still running then (it keeps
        swallowing the cancel, which goes on being re-delivered): the caller records the turn and
        moves on, the task's output stays held back and its eventual end is logged.

        A cancel of the caller itself propagates at once (the run's own cancel stops the task).
        """
        task = self._task
        if task is None:
            if self._task_ended:
                return True
            raise RuntimeError("join() before attach()")
        if not task.done() and self._reason is None:
            waiter = self._on_cancelled = asyncio.get_running_loop().create_future()  # cancel() or the end
            try:
                await waiter
            finally:
                self._on_cancelled = None
                waiter.cancel()
        if not task.done() and self.cancelled_at is not None:
            left = self.cancelled_at + grace_s - time.perf_counter()
            if left > 0:
                await asyncio.wait((task,), timeout=left)
        if task.done():
            return True
        self._abandoned = True
        log.warning("run %s did not end within %.1f s of its cancel (%d re-deliveries); its turn is recorded as "
                    "interrupted, its output held back", self.run_id, grace_s, self.redeliveries)
        return False

    @property
    def finished(self) -> bool:
        return self._ended or self._task_ended or (self._task is not None and self._task.done())

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self.done_at = time.perf_counter()
        self._task, self._task_ended = None, True
        if (waiter := self._on_cancelled) is not None and not waiter.done():
            waiter.set_result(None)
        self._closers.clear()
        if self._redeliver is not None:
            self._redeliver.cancel()
            self._redeliver = None
        if self._abandoned:  # nobody awaits it any more: say how it ended
            exc = None if task.cancelled() else task.exception()
            late = self.done_at - self.cancelled_at if self.cancelled_at is not None else 0.0
            log.warning("run %s ended %.1f s after its cancel, after its turn was recorded (%s)", self.run_id,
                        late, "cancelled" if task.cancelled() else repr(exc) if exc else "returned")

    def end(self) -> None:
        """Called by the owner once the turn is over and recorded (ran, was cancelled, or never ran)."""
        self._closers.clear()
        self._ended = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def on_end(self, callback: Callable[[], object]) -> None:
        """Call `callback` (soon, from the loop) once the turn is over — at once if it already is."""
        if self._ended:
            callback()
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(lambda _f: callback())
        self._waiters.append(waiter)

    async def wait(self) -> None:
        """Wait until the turn is over and its outcome recorded."""
        if not self._ended:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def __repr__(self) -> str:
        state = "cancelled" if self._reason else ("done" if self.finished else "live")
        return f"<Run {self.run_id} {self.session_key} {state}>"


current_run: contextvars.ContextVar[Run | None] = contextvars.ContextVar("current_run", default=None)


def get_run() -> Run | None:
    return current_run.get()


def is_cancelled() -> bool:
    """For thread-based tools: has *this* run been stopped? (False outside any run.)"""
    run = current_run.get()
    return run is not None and run.is_cancelled()


def checkpoint() -> None:
    """Before a new step of a run — a provider request, a tool start: a cancelled run takes none.

    A cancel reaches the run's task as `CancelledError` at its next await, and is re-delivered
    until the task ends; but a step that begins between a swallowed delivery and the next one
    would still open new I/O. This closes that gap where it matters: raised here, synchronously,
    whenever the current run has been cancelled."""
    run = current_run.get()
    if run is not None and run.is_cancelled():
        raise asyncio.CancelledError(run.reason.marker if run.reason else "cancelled")


async def run_in_executor(
    executor: Executor | None, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """`loop.run_in_executor`, but carrying the caller's context (and so its run) into the thread."""
    ctx = contextvars.copy_context()
    call = functools.partial(ctx.run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(executor, call)
