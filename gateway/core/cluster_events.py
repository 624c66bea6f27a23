"""What the cluster coordinator tells the core: built from the parts it touches, never the router."""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent_cache import AgentCache
from gateway.core.background import BackgroundJobs
from gateway.core.cancellation import LEASE_LOST, ToolReason
from gateway.core.cluster import ClusterEvents
from gateway.core.intake.intake import Intake
from gateway.core.messages import InboundMessage
from gateway.core.ports import Outlet, Outlets, SessionStatus, Submitted
from gateway.core.recovery import Recovery
from gateway.core.sessions.lanes import Lanes, Scope
from gateway.core.turns import LiveConversation

log = logging.getLogger(__name__)


class SessionEvents(ClusterEvents):
    def __init__(self, *, lanes: Lanes, intake: Intake, recovery: Recovery, cache: AgentCache[LiveConversation],
                 outlets: Outlets, jobs: BackgroundJobs | None = None) -> None:
        self._lanes = lanes
        self._intake = intake
        self._recovery = recovery
        self._cache = cache
        self._outlets = outlets
        self._jobs = jobs

    def lease_lost(self, session: str) -> None:
        """Another worker owns `session` now: stop its turns and drop everything local, silently.
        Queued messages stay open in the shared store; the new owner replays them."""
        self._lanes.cancel(session, LEASE_LOST, Scope.SESSION)
        if self._jobs is not None:
            self._jobs.kill_session(session, LEASE_LOST)
        self._cache.discard(session)

    def in_use(self, session: str) -> bool:
        return session in self._cache or self._lanes.busy(session)

    def running(self, session: str) -> bool:
        return self._lanes.running(session)

    async def deliver(self, msg: InboundMessage, session: str, hops: int, *,
                      via: Callable[[Outlet], Outlet] | None = None) -> Submitted | None:
        outlet = self._outlets.get(msg.platform)
        if outlet is None:
            log.error("forwarded message for platform %s, which this worker does not run", msg.platform)
            return None
        return await self._intake.submit(msg, via(outlet) if via is not None else outlet, key=session, hops=hops)

    def cancel_run(self, session: str, token: str, reason: ToolReason) -> bool:
        return self._lanes.cancel_run(session, token, reason)

    def snapshot(self) -> list[SessionStatus]:
        return [self._lanes.status(key, "") for key in self._lanes.session_keys()]

    def stop_next(self, session: str, reason: ToolReason) -> bool:
        return bool(self._lanes.cancel(session, reason, Scope.NEXT))

    async def adopted(self, session: str) -> bool:
        return await self._recovery.recover_taken_over(session)
