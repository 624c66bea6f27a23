"""The core's port to cluster coordination: who owns a session, and what the core hears back.

`gateway.cluster` implements `Ownership` over Redis; a single process has none, and owns every
session itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.core.cancellation import ToolReason
from gateway.core.fencing import Fence
from gateway.core.messages import InboundMessage
from gateway.core.ports import Health, Outlet, SessionStatus, Submitted


class ClusterUnavailable(Exception):
    """Ownership cannot be decided or proven now (Redis unreachable); the text says why."""


@dataclass(frozen=True, slots=True)
class Route:
    fence: Fence | None = None  # set: ours, with this fence
    owner: str | None = None  # set: forward to this worker


class ClusterEvents(ABC):
    """What the coordinator tells the core; handed to `Ownership.start`."""

    @abstractmethod
    def lease_lost(self, session: str) -> None:
        """Another worker may own `session` now: stop acting on it."""

    @abstractmethod
    def in_use(self, session: str) -> bool:
        """Does this worker still need `session` (idle leases are released)?"""

    @abstractmethod
    def running(self, session: str) -> bool:
        """Is a turn of `session` running here (starting, or its agent or tools at work)? Not once
        it is only being recorded: its writes are fenced and its last words wait for the record."""

    @abstractmethod
    async def deliver(self, msg: InboundMessage, session: str, hops: int, *,
                      via: Callable[[Outlet], Outlet] | None = None) -> Submitted | None:
        """A message or command forwarded to us by another worker. `via` wraps the platform's
        outlet when the client waits on the sender's connection (a relayed turn)."""

    @abstractmethod
    def cancel_run(self, session: str, token: str, reason: ToolReason) -> bool:
        """Cancel the run `token` of `session` (a relayed turn whose client went away); False if
        it is not running or queued here."""

    @abstractmethod
    def snapshot(self) -> list[SessionStatus]:
        """The sessions with a turn running or queued here (for a console on another worker)."""

    @abstractmethod
    def stop_next(self, session: str, reason: ToolReason) -> bool:
        """An operator's stop from another worker: the turn running (or next) in `session`."""

    @abstractmethod
    async def adopted(self, session: str) -> bool:
        """We just took `session` over: finish what its previous owner left open. False if that
        could not be done now (the store failed): the session must not stay ours unrecovered."""


class Ownership(Protocol):
    @property
    def worker_id(self) -> str: ...

    def health(self) -> Health: ...

    async def start(self, events: ClusterEvents) -> None: ...

    async def stop(self) -> None: ...

    async def route(self, session: str) -> Route:
        """Ours (taking the lease if it is free) or whose. Raises ClusterUnavailable."""

    async def forward(self, owner: str, msg: InboundMessage, session: str, *, hops: int,
                      want_reply: bool) -> Submitted | None:
        """Hand a message to its owner; with `want_reply`, the owner's result (None: no answer in
        time). Raises ClusterUnavailable."""

    async def relay(self, owner: str, msg: InboundMessage, session: str, *, hops: int, outlet: Outlet) -> Submitted:
        """Have `owner` run `msg` as a turn whose reply and notices come back to `outlet` here
        (its client is connected to this worker). The result carries a local run: cancelling it
        cancels the owner's. Raises ClusterUnavailable."""

    def fence_of(self, session: str) -> Fence | None:
        """The fence of a lease this worker provably holds now; no I/O, no state change."""

    def holds(self, fence: Fence) -> bool:
        """Is `fence` still provably ours? A pure check, safe before every send."""

    async def confirm(self, fence: Fence) -> bool:
        """Is `fence` still ours? Asks Redis (renewing the lease) when `holds` can no longer tell;
        drops the lease, as `check_lease` does, if it is not."""

    def check_lease(self, session: str) -> None:
        """State change: if the lease can no longer be proven, drop it (and say so via
        `ClusterEvents.lease_lost`)."""

    async def watch(self, session: str) -> None:
        """`session` has work open: if this worker stops renewing its lease, another adopts the work.
        Raises ClusterUnavailable."""

    def unwatch(self, session: str) -> None:
        """`session` has no work open any more."""


class ClusterView(Protocol):
    """What an operator's console asks of the other workers (see `gateway.cluster.operators`)."""

    async def sessions_elsewhere(self) -> list[tuple[str, list[SessionStatus]]]:
        """(worker, the sessions it has work in) for every other live worker; one that does not
        answer in time is left out. Raises ClusterUnavailable."""

    async def owners(self, sessions: list[str]) -> dict[str, str | None]:
        """The worker holding each session's lease (None: nobody). Raises ClusterUnavailable."""

    async def stop_elsewhere(self, session: str, reason: ToolReason) -> tuple[str | None, bool]:
        """Ask the session's owner, if another worker, to stop its turn: (owner, stopped)."""


class FenceGuard:
    """The `Guard` of runs and notices for one session in cluster mode: its fence, checked against
    this worker's leases."""

    __slots__ = ("_fence", "_ownership")

    def __init__(self, ownership: Ownership, fence: Fence) -> None:
        self._ownership = ownership
        self._fence = fence

    def __call__(self) -> bool:
        return self._ownership.holds(self._fence)

    async def confirm(self) -> bool:
        return await self._ownership.confirm(self._fence)
