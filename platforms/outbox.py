"""Per-chat outbound queues: every call to one chat goes through that chat's worker.

A chat's calls run one at a time, most urgent first (FIFO within a priority), so a stop's notice
and a reply's final state overtake the streaming edits queued before them. A 429 holds back that
chat's calls of the same kind (send, edit, typing) until it expires; other chats never wait on it,
and nothing that submits a job (an adapter's intake, a turn) waits unless it chooses to.

A worker exists only while its chat has work; idle chats cost a few bytes, and the least recently
used are forgotten past `max_chats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from enum import IntEnum
from typing import Any, Generic, NoReturn, TypeVar

from platforms.errors import OutboundError, RateLimited

log = logging.getLogger(__name__)
T = TypeVar("T")
_EVICTION_LOOKS = 32  # chats a new one looks at to make room (busy ones are skipped over)


class Priority(IntEnum):
    """Lower runs first."""

    URGENT = 0  # a stop's notice, a reply's final state (answer, failure, stop mark)
    NOTICE = 1  # other notices and command answers
    STREAM = 2  # intermediate streaming states: withdrawn when their reply ends
    TYPING = 3  # cosmetic


class Withdrawn(Exception):
    """The job was taken back before it ran."""


class Job(Generic[T]):
    """One call queued for a chat. Its outcome is kept until someone asks (`wait`), or dropped."""

    __slots__ = ("_done", "_error", "_value", "attempts", "call", "kind", "owner", "priority", "seq", "started",
                 "withdrawn")

    def __init__(self, call: Callable[[], Awaitable[T]], priority: Priority, kind: str, attempts: int,
                 owner: object, seq: int) -> None:
        self.call = call
        self.priority = priority
        self.kind = kind
        self.attempts = attempts
        self.owner = owner
        self.seq = seq
        self.started = False  # the call is on the wire (or has been)
        self.withdrawn = False
        self._done = asyncio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        """It ran (successfully or not) or was withdrawn: it will not run (again)."""
        return self._done.is_set()

    @property
    def running(self) -> bool:
        return self.started and not self.done

    def withdraw(self) -> bool:
        """Take it back if it has not started; True if it will now never run."""
        if self.started or self.done:
            return False
        self.withdrawn = True
        self._finish(None, None)
        return True

    async def wait(self) -> T:
        """Its result, once it has run: raises what the call raised (`Withdrawn` if withdrawn).
        Being cancelled while waiting leaves the job queued."""
        await self._done.wait()
        if self.withdrawn:
            raise Withdrawn()  # a new one each time: one kept here would hold its raiser's frames
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    async def landed(self) -> None:
        """Wait until it ran or was withdrawn; never raises what the call raised."""
        await self._done.wait()

    def _finish(self, value: T | None, error: BaseException | None) -> None:
        self._value, self._error = value, error
        # The call (often a closure) and the owner usually hold whoever holds this job: let go of
        # them, so that no reference cycle outlives the job and every reply is freed without the GC.
        self.call, self.owner = _spent, None
        self._done.set()


async def _spent() -> NoReturn:
    raise RuntimeError("this job has already run")


class _Chat:
    __slots__ = ("inline", "jobs", "not_before", "wake", "worker")

    def __init__(self) -> None:
        self.jobs: list[Job[Any]] = []  # sorted by (priority, seq)
        self.not_before: dict[str, float] = {}  # kind -> monotonic deadline of its 429
        self.wake = asyncio.Event()
        self.worker: asyncio.Task[None] | None = None
        self.inline: Job[Any] | None = None  # a call `Outbox.run` is making in its caller's task

    def busy(self) -> bool:
        return self.worker is not None or self.inline is not None or bool(self.jobs)

    def held(self, now: float) -> bool:
        """Busy, or a 429 of any kind still in force: what forgetting the chat would lose."""
        return self.busy() or any(t > now for t in self.not_before.values())


class Outbox:
    """The per-chat queues of one adapter. Chats are keyed by whatever the platform rate-limits on."""

    def __init__(self, name: str, *, max_chats: int = 10_000,
                 on_rate_limited: Callable[[], None] | None = None) -> None:
        self.name = name
        self.max_chats = max_chats
        self._on_rate_limited = on_rate_limited
        self._chats: OrderedDict[str, _Chat] = OrderedDict()
        self._seq = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def put(self, chat: str, call: Callable[[], Awaitable[T]], *, priority: Priority = Priority.NOTICE,
            kind: str = "send", attempts: int = 1, owner: object = None) -> Job[T]:
        """Queue `call` for `chat`; returns at once. A 429 (`RateLimited`) is retried after the
        wait it names while `attempts` last; any other outcome is the job's result. `owner`
        tags the job for `withdraw`."""
        job: Job[T] = Job(call, priority, kind, max(1, attempts), owner, next(self._seq))
        if self._closed:
            job._finish(None, OutboundError(f"the {self.name} outbox is closed"))
            return job
        state = self._chat(chat)
        state.jobs.append(job)
        state.jobs.sort(key=lambda j: (j.priority, j.seq))
        state.wake.set()
        if state.worker is None:
            state.worker = asyncio.get_running_loop().create_task(self._work(chat, state),
                                                                  name=f"{self.name}-outbox")
        return job

    async def run(self, chat: str, call: Callable[[], Awaitable[T]], *, priority: Priority = Priority.NOTICE,
                  kind: str = "send", attempts: int = 1) -> T:
        """Make `call` for `chat` and return its result: at once, in the caller's task, if the chat
        is idle (nothing queued or running, no 429 for `kind`), else queued as by `put` and waited
        for. Either way it is the chat's only call while it runs."""
        state = self._chat(chat)
        if self._closed or state.busy() or state.not_before.get(kind, 0.0) > time.monotonic():
            return await self.put(chat, call, priority=priority, kind=kind, attempts=attempts).wait()
        job: Job[T] = Job(call, priority, kind, attempts, None, next(self._seq))
        job.started = True
        state.inline = job
        try:
            value = await call()
        except RateLimited as exc:
            state.not_before[kind] = time.monotonic() + exc.retry_after
            if self._on_rate_limited is not None:
                self._on_rate_limited()
            if attempts <= 1:
                raise
            retry = self.put(chat, call, priority=priority, kind=kind, attempts=attempts - 1)
        else:
            return value
        finally:
            state.inline = None
            job._finish(None, None)
        return await retry.wait()

    def withdraw(self, chat: str, owner: object) -> int:
        """Withdraw every queued (not started) job of `owner` in `chat`; how many were."""
        state = self._chats.get(chat)
        if state is None:
            return 0
        dropped = [j for j in state.jobs if j.owner is owner and j.withdraw()]
        state.jobs = [j for j in state.jobs if not j.done]
        return len(dropped)

    def busy(self, chat: str) -> bool:
        """Is anything queued or running for `chat`, or a 429 of any kind still in force?"""
        state = self._chats.get(chat)
        return state is not None and state.held(time.monotonic())

    def adopt(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `coro` as a task that `flush` and `close` wait for (a reply's final delivery)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def flush(self, within_s: float) -> bool:
        """Wait until every queued job and adopted task is done, up to `within_s`; True if they are."""
        deadline = time.monotonic() + within_s
        while True:
            waiting: set[asyncio.Task[Any]] = {s.worker for s in self._chats.values() if s.worker is not None}
            waiting |= self._tasks
            if not waiting:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.wait(waiting, timeout=left)

    async def close(self, within_s: float = 5.0) -> None:
        """Deliver what is queued (up to `within_s`), then cancel the rest; later jobs fail at once."""
        if not await self.flush(within_s):
            left = sum(len(s.jobs) + (s.worker is not None) for s in self._chats.values())
            log.warning("%s: %d outbound call(s) still pending at shutdown; dropped", self.name, left)
        self._closed = True
        tasks = [s.worker for s in self._chats.values() if s.worker is not None] + list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # --- internals ------------------------------------------------------------------------

    def _chat(self, key: str) -> _Chat:
        state = self._chats.get(key)
        if state is None:
            if len(self._chats) >= self.max_chats:
                self._make_room()
            state = self._chats[key] = _Chat()
        else:
            self._chats.move_to_end(key)
        return state

    def _make_room(self) -> None:
        """Forget the least recently used idle chats to make room for one more, looking at a few at
        most: one that is busy or under a 429 goes to the back instead (a new chat never scans them all)."""
        now = time.monotonic()
        for _ in range(min(len(self._chats), _EVICTION_LOOKS)):
            if len(self._chats) < self.max_chats:
                return
            key, state = next(iter(self._chats.items()))
            if state.held(now):
                self._chats.move_to_end(key)
            else:
                del self._chats[key]

    def _next(self, state: _Chat) -> Job[Any] | float | None:
        """The most urgent job whose kind is not held back by a 429; else seconds until one is."""
        state.jobs = [j for j in state.jobs if not j.done]
        if not state.jobs:
            return None
        now = time.monotonic()
        soonest = float("inf")
        for job in state.jobs:
            until = state.not_before.get(job.kind, 0.0)
            if until <= now:
                return job
            soonest = min(soonest, until - now)
        return soonest

    async def _work(self, key: str, state: _Chat) -> None:
        try:
            while True:
                if state.inline is not None:  # `run` is making a call in its caller's task
                    await state.inline.landed()
                    continue
                picked = self._next(state)
                if picked is None:
                    return
                if isinstance(picked, float):
                    state.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(state.wake.wait(), picked)
                    continue
                job = picked
                state.jobs.remove(job)
                job.started = True
                try:
                    value = await job.call()
                except RateLimited as exc:
                    state.not_before[job.kind] = time.monotonic() + exc.retry_after
                    if self._on_rate_limited is not None:
                        self._on_rate_limited()
                    job.attempts -= 1
                    if job.attempts > 0:
                        job.started = False  # back in line, ahead of later jobs of its priority
                        state.jobs.append(job)
                        state.jobs.sort(key=lambda j: (j.priority, j.seq))
                        continue
                    if job.priority < Priority.STREAM:
                        log.warning("%s: gave up on a %s to chat %s: still rate limited", self.name, job.kind, key)
                    job._finish(None, exc)
                except asyncio.CancelledError as exc:
                    job._finish(None, exc)
                    raise
                except Exception as exc:
                    job._finish(None, exc)
                else:
                    job._finish(value, None)
        finally:
            state.worker = None
            for job in state.jobs if self._closed else ():
                job._finish(None, OutboundError(f"the {self.name} outbox is closed"))
