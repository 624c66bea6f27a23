"""`ClusterEvents` for driving a coordinator without a router: every session counts as busy."""

from __future__ import annotations

from collections.abc import Callable

from agent_cache.leases import now
from gateway.core.cancellation import ToolReason
from gateway.core.cluster import ClusterEvents
from gateway.core.messages import InboundMessage
from gateway.core.ports import Outlet, SessionStatus, Submitted


class Working(ClusterEvents):
    """Every held session is in use (nothing is released as idle); a lost lease is noted with the
    time it was reported (on the lease clock)."""

    def __init__(self) -> None:
        self.lost: dict[str, float] = {}

    def lease_lost(self, session: str) -> None:
        self.lost.setdefault(session, now())

    def in_use(self, session: str) -> bool:
        return True

    def running(self, session: str) -> bool:
        return True

    async def deliver(self, msg: InboundMessage, session: str, hops: int, *,
                      via: Callable[[Outlet], Outlet] | None = None) -> Submitted | None:
        return None

    def cancel_run(self, session: str, token: str, reason: ToolReason) -> bool:
        return False

    def snapshot(self) -> list[SessionStatus]:
        return []

    def stop_next(self, session: str, reason: ToolReason) -> bool:
        return False

    async def adopted(self, session: str) -> bool:
        return True
