"""Session lanes: the sole owner of per-session runtime state. One turn at a time per session, in
the order messages were admitted; every cancel of a session's turns goes through `cancel`.

Invariants:
- A lane exists while its session has a turn running or queued, and is dropped when it has none.
- A turn is in its lane from the moment it is admitted (before any await), so a /stop finds it
  whether it is queued, starting or streaming.
- Only the lane's worker runs turns (through `execute`) and clears `current`; nothing else does.
- A session is busy while it has a lane or a message of it is being admitted (`admitting`): the
  cluster lets a session's lease go only once it is idle, and a message stored before it is
  queued must not find its session let go under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum

from gateway.core.cancellation import Run, ToolReason
from gateway.core.ports import SessionStatus
from gateway.core.turns import Turn

log = logging.getLogger(__name__)


class Scope(Enum):
    """What a cancel of one session reaches."""

    NEXT = "next"  # the turn running, or else the next one queued (hard_cancel, eviction)
    SESSION = "session"  # the turn running, the messages steered into it and every queued one


@dataclass(slots=True)
class Lane:
    key: str
    pending: deque[Turn] = field(default_factory=deque)
    current: Turn | None = None
    worker: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.pending)

    def newest(self) -> Turn | None:
        return self.pending[-1] if self.pending else self.current

    def turns(self) -> list[Turn]:
        """Every turn of the session: the running one, those steered into it, the queued ones."""
        current = [self.current, *self.current.steered] if self.current else []
        return current + list(self.pending)


class Lanes:
    """Per-session queues of turns and the workers that run them.

    `execute` runs one turn to its recorded end; `idle` is told when a session has nothing left
    (cluster mode stops watching it). Once `closing` is set no new turn starts."""

    def __init__(self, execute: Callable[[Turn], Awaitable[None]], idle: Callable[[str], None],
                 closing: asyncio.Event) -> None:
        self._execute = execute
        self._idle = idle
        self._lanes: dict[str, Lane] = {}
        self._admitting: dict[str, int] = {}  # sessions with messages on their way into a lane
        self._closing = closing

    def __iter__(self) -> Iterator[Lane]:
        return iter(list(self._lanes.values()))

    def get(self, key: str) -> Lane | None:
        return self._lanes.get(key)

    def session_keys(self) -> list[str]:
        return list(self._lanes)

    def enqueue(self, turn: Turn) -> int:
        """Put a turn at the back of its lane; returns how many turns are ahead of it."""
        lane = self._lanes.get(turn.key)
        if lane is None:
            lane = self._lanes[turn.key] = Lane(turn.key)
        ahead = len(lane.pending) + (lane.current is not None)
        lane.pending.append(turn)
        if lane.worker is None:
            lane.worker = asyncio.get_running_loop().create_task(self._drain(lane))
        return ahead

    def steer(self, turn: Turn) -> bool:
        """Hand `turn` to the session's running turn at its next boundary; False if none runs."""
        lane = self._lanes.get(turn.key)
        if lane is None or lane.current is None:
            return False
        lane.current.steered.append(turn)
        return True

    # --- cancellation: the one entry point per session -----------------------------------

    def cancel(self, key: str, reason: ToolReason, scope: Scope) -> list[Run]:
        """Cancel `key`'s turns in `scope` for `reason`; the runs this cancel stopped (none if
        nothing was running: a cancel never swallows the next message)."""
        if not isinstance(reason, ToolReason):
            raise TypeError("a cancel needs a ToolReason; there is no default reason")
        lane = self._lanes.get(key)
        if lane is None:
            return []
        if scope is Scope.NEXT:
            turn = lane.current or (lane.pending[0] if lane.pending else None)
            turns = [turn] if turn is not None else []
        else:
            turns = lane.turns()
        runs = [t.run for t in turns if t.run.cancel(reason)]
        if runs:
            log.info("cancelled %d turn(s): %s", len(runs), reason.marker,
                     extra={"session": key, "run": runs[0].run_id})
        return runs

    def cancel_run(self, key: str, token: str, reason: ToolReason) -> bool:
        """Cancel the one turn of `key` whose run is `token` (running, steered in or queued)."""
        lane = self._lanes.get(key)
        turn = next((t for t in lane.turns() if t.run.token == token), None) if lane is not None else None
        if turn is None or not turn.run.cancel(reason):
            return False
        log.info("cancelled a turn: %s", reason.marker, extra={"session": key, "run": turn.run.run_id})
        return True

    def cancel_running(self, reason: ToolReason) -> None:
        """Stop every running turn now (a forced exit); queued ones stay for the next start."""
        for lane in self:
            if lane.current is not None:
                lane.current.run.cancel(reason)

    # --- what the session is doing ---------------------------------------------------------

    def status(self, key: str, agent: str) -> SessionStatus:
        lane = self._lanes.get(key)
        current = lane.current if lane else None
        since = current.run.started_at if current is not None else None
        return SessionStatus(key, since is not None, since, len(lane.pending) if lane else 0, agent)

    def busy(self, key: str) -> bool:
        lane = self._lanes.get(key)
        return key in self._admitting or (lane is not None and lane.busy)

    @contextlib.contextmanager
    def admitting(self, key: str) -> Iterator[None]:
        """A message of `key` is on its way in (stored, say, before it is queued): the session is
        busy meanwhile, and idle again afterwards only if it has no lane by then."""
        self._admitting[key] = self._admitting.get(key, 0) + 1
        try:
            yield
        finally:
            if left := self._admitting[key] - 1:
                self._admitting[key] = left
            else:
                del self._admitting[key]
                if key not in self._lanes and not self._closing.is_set():
                    self._idle(key)

    def running(self, key: str) -> bool:
        """Is a turn of `key` running (not yet ended, or not yet started)? Not while it is recorded."""
        lane = self._lanes.get(key)
        return lane is not None and lane.current is not None and not lane.current.run.finished

    def live_run(self, key: str) -> Run | None:
        """The run of the turn running now, unless it was already stopped."""
        lane = self._lanes.get(key)
        current = lane.current if lane is not None else None
        return current.run if current is not None and not current.run.is_cancelled() else None

    # --- shutdown ----------------------------------------------------------------------------

    def workers(self, *, running_only: bool = False) -> list[asyncio.Task[None]]:
        return [lane.worker for lane in self if lane.worker and (lane.current or not running_only)]

    def close(self, reason: ToolReason) -> list[Turn]:
        """No new turn starts (`closing` is set); running ones are cancelled for `reason`. Returns the turns that were
        waiting (queued, or steered into a turn and not handed over yet), taken out of their lanes:
        they stay accepted in the store and are replayed on the next start."""
        self._closing.set()
        waiting: list[Turn] = []
        for lane in self:
            if lane.current is not None:
                lane.current.run.cancel(reason)
                waiting += lane.current.steered
                lane.current.steered = []
            waiting += lane.pending
            lane.pending.clear()
        return waiting

    # --- the worker ------------------------------------------------------------------------

    async def _drain(self, lane: Lane) -> None:
        try:
            while lane.pending and not self._closing.is_set():
                turn = lane.current = lane.pending.popleft()
                try:
                    await self._run(turn, lane)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("turn failed outside the agent", extra={"session": lane.key})
                finally:
                    lane.current = None
        finally:
            lane.worker = None
            if not lane.pending and self._lanes.get(lane.key) is lane:
                del self._lanes[lane.key]
                if not self._closing.is_set() and lane.key not in self._admitting:  # stopping: left for adoption
                    self._idle(lane.key)

    async def _run(self, turn: Turn, lane: Lane) -> None:
        try:
            await self._execute(turn)
        finally:
            turn.run.end()
            for joined in turn.absorbed:
                joined.run.end()
            # Messages sent too late to join the turn start the next one, in order.
            lane.pending.extendleft(reversed(turn.steered))
            turn.steered = []
