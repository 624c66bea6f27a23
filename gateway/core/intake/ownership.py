"""Who speaks for a session: this process alone (one node), or the worker holding its lease
(cluster mode). Two classes with one interface, so intake and turns never ask which mode they
are in."""

from __future__ import annotations

import logging
from typing import Protocol

from gateway.core.cluster import ClusterUnavailable, FenceGuard, Ownership
from gateway.core.commands import STOPPED
from gateway.core.fencing import Fence
from gateway.core.intake.answers import Answers
from gateway.core.intake.dedupe import RecentMessages
from gateway.core.intake.gates import Arrival
from gateway.core.ports import UNAVAILABLE_RETRY_S, NoticeKind, Outcome, Outlet, Submitted
from gateway.core.turns import Speaker

log = logging.getLogger(__name__)

MAX_HOPS = 3  # forwards between cluster workers before a message is refused
UNAVAILABLE = "I can't take messages right now (shared storage is unavailable). Please try again shortly."
NOT_PASSED_ON = "I could not pass that on (shared storage is unavailable). Please try again shortly."
OWNERSHIP_MOVING = "This conversation is moving between workers right now; please try again in a moment."
NO_ANSWER = "The worker running this conversation did not answer in time; please try again."


class Owners(Protocol):
    @property
    def worker_id(self) -> str | None: ...

    def fence(self, key: str) -> Fence | None:
        """This worker's proof of ownership of `key` now; None: not ours (any more)."""

    def speaker(self, outlet: Outlet, fence: Fence) -> Speaker:
        """The outlet, guarded by `fence`: nothing is said once the session is not ours."""

    async def place(self, arrival: Arrival) -> Fence | Submitted:
        """Ours (the fence to write with), or what became of the message (forwarded, refused)."""

    async def watch(self, key: str) -> None:
        """`key` has work open (raises ClusterUnavailable)."""

    def unwatch(self, key: str) -> None: ...

    def check_lease(self, key: str) -> None:
        """Drop the lease of `key` if it can no longer be proven."""


class SingleNode:
    """One process: it owns every session."""

    worker_id = None

    def fence(self, key: str) -> Fence:
        return Fence.local(key)

    def speaker(self, outlet: Outlet, fence: Fence) -> Speaker:
        return Speaker(outlet)

    async def place(self, arrival: Arrival) -> Fence:
        return Fence.local(arrival.key)

    async def watch(self, key: str) -> None:
        pass

    def unwatch(self, key: str) -> None:
        pass

    def check_lease(self, key: str) -> None:
        pass


class ClusterNode:
    """Cluster mode: a session is ours while we hold its lease; anyone else's is forwarded to its owner."""

    def __init__(self, ownership: Ownership, answers: Answers, recent: RecentMessages) -> None:
        self._ownership = ownership
        self._answers = answers
        self._recent = recent

    @property
    def worker_id(self) -> str:
        return self._ownership.worker_id

    def fence(self, key: str) -> Fence | None:
        return self._ownership.fence_of(key)

    def speaker(self, outlet: Outlet, fence: Fence) -> Speaker:
        return Speaker(outlet) if fence.is_local else Speaker(outlet, FenceGuard(self._ownership, fence))

    async def watch(self, key: str) -> None:
        await self._ownership.watch(key)

    def unwatch(self, key: str) -> None:
        self._ownership.unwatch(key)

    def check_lease(self, key: str) -> None:
        self._ownership.check_lease(key)

    async def place(self, arrival: Arrival) -> Fence | Submitted:
        return await self._place(arrival, moves=0)

    async def _place(self, a: Arrival, *, moves: int) -> Fence | Submitted:
        """`moves`: how often the worker a relay went to answered that the session had moved on."""
        try:
            route = await self._ownership.route(a.key)
        except ClusterUnavailable as exc:
            log.warning("cannot route %s: %s", a.key, exc)
            return await self._answers.unavailable(a.outlet, a.msg, a.key, UNAVAILABLE)
        if route.fence is not None:
            return route.fence
        if self._recent.seen(a.msg, a.hops):
            return Submitted(Outcome.DUPLICATE)
        assert route.owner is not None
        return await self._forward(route.owner, a, moves=moves)

    async def _forward(self, owner: str, a: Arrival, *, moves: int) -> Fence | Submitted:
        if a.hops >= MAX_HOPS and a.cmd is None and a.outlet.pushes_anywhere:
            # Ownership is moving (a takeover under way): the platform was already answered, so
            # the message stays in this worker's inbox and is handled again once idle for a TTL.
            log.info("ownership moving; the message waits in the inbox", extra={"session": a.key})
            return Submitted(Outcome.UNAVAILABLE, "ownership moving", retry_after_s=UNAVAILABLE_RETRY_S)
        if a.hops >= MAX_HOPS:
            return await self._answers.unavailable(a.outlet, a.msg, a.key, OWNERSHIP_MOVING)
        if a.cmd is None and not a.outlet.pushes_anywhere and a.hops:
            # Relayed here, but the session moved on: its client's worker relays it to the owner
            # itself. Invariant: a relay never chains. Its client's worker watches the worker
            # that runs the turn and sends its cancels there; through a chain it would watch
            # this one, and tell its client to retry if this one stopped while the turn ran on.
            return Submitted(Outcome.MOVED, owner)
        if a.cmd is None and not a.outlet.pushes_anywhere:
            # A web chat or API client waits on this worker's connection: the owner runs the turn
            # and its events are relayed here, to the reply the client waits on.
            return await self._relay(owner, a, moves=moves)
        log.debug("forwarding to %s (hop %d)", owner, a.hops + 1, extra={"session": a.key})
        # Acknowledged means stored: the platform hears "taken" only once the owner has taken the
        # message (stored it, or answered a command). A forward the owner never confirms — Redis
        # lost it, restarting empty; the owner died — is not acknowledged, so the platform
        # delivers it again (the store's inbound record de-duplicates a second arrival).
        try:
            result = await self._ownership.forward(owner, a.msg, a.key, hops=a.hops, want_reply=True)
        except ClusterUnavailable as exc:
            log.warning("forwarding to %s failed: %s", owner, exc, extra={"session": a.key})
            return await self._answers.unavailable(a.outlet, a.msg, a.key, NOT_PASSED_ON)
        return await self._confirmed(a, owner, result)

    async def _relay(self, owner: str, a: Arrival, *, moves: int) -> Fence | Submitted:
        log.debug("relaying from %s (hop %d)", owner, a.hops + 1, extra={"session": a.key})
        try:
            result = await self._ownership.relay(owner, a.msg, a.key, hops=a.hops, outlet=a.outlet)
        except ClusterUnavailable as exc:
            log.warning("relaying from %s failed: %s", owner, exc, extra={"session": a.key})
            return await self._answers.unavailable(a.outlet, a.msg, a.key, NOT_PASSED_ON)
        if result.outcome is not Outcome.MOVED:
            return result
        # Routed again from here: ours now, or relayed straight to the owner.
        self._recent.forget(a.msg)  # taken nowhere yet: if it is ours now, it is new here
        if moves + 1 >= MAX_HOPS:
            return await self._answers.unavailable(a.outlet, a.msg, a.key, OWNERSHIP_MOVING)
        log.info("%s no longer owns the session; routing it again", owner, extra={"session": a.key})
        return await self._place(a, moves=moves + 1)

    async def _confirmed(self, a: Arrival, owner: str, result: Submitted | None) -> Submitted:
        """What the owner said of a forwarded message (None: nothing, in time)."""
        answered_here = a.cmd is not None and not a.outlet.pushes_anywhere  # the owner cannot reach this client
        if result is None:
            if answered_here:
                self._recent.forget(a.msg)  # (unavailable answers are forgotten by the intake)
                return await self._answers.reject(a.outlet, a.msg, a.key, NO_ANSWER)
            log.warning("%s did not confirm a forwarded message in time", owner, extra={"session": a.key})
            return Submitted(Outcome.UNAVAILABLE, "the owner did not confirm it", retry_after_s=UNAVAILABLE_RETRY_S)
        if not answered_here:  # the owner answered the chat itself
            return result if result.outcome is Outcome.UNAVAILABLE else Submitted(Outcome.FORWARDED, owner)
        kind = (NoticeKind.STOPPED if result.detail == STOPPED else
                NoticeKind.ERROR if result.outcome is Outcome.REJECTED else NoticeKind.INFO)
        await a.outlet.notify(a.msg.chat, result.detail, reply_to=a.msg.message_id, kind=kind)  # the owner can't
        return result
