"""What an operator's console on one worker sees of the others: every live worker's sessions, who
holds a session's lease, and a stop carried to a session's owner — asked through the workers'
inboxes, answered in milliseconds (a worker that does not answer in time is left out)."""

from __future__ import annotations

import asyncio
from typing import cast

from redis.exceptions import RedisError

from agent_cache import keys
from agent_cache.leases import AnyRedis
from gateway.cluster.forwarding import Forwarder
from gateway.core.cancellation import ToolReason
from gateway.core.cluster import ClusterUnavailable
from gateway.core.ports import SessionStatus


class ClusterConsole:
    """`gateway.core.cluster.ClusterView` over Redis."""

    def __init__(self, redis: AnyRedis, worker_id: str, forwarder: Forwarder) -> None:
        self._redis = redis
        self._worker_id = worker_id
        self._forwarder = forwarder

    async def sessions_elsewhere(self) -> list[tuple[str, list[SessionStatus]]]:
        others = [w for w in await self._live_workers() if w != self._worker_id]
        answers = await asyncio.gather(*(self._forwarder.ask(w, {"ask": "sessions"}) for w in others))
        return [(w, [SessionStatus(**row) for row in rows]) for w, rows in zip(others, answers, strict=True)
                if rows is not None]

    async def owners(self, sessions: list[str]) -> dict[str, str | None]:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for session in sessions:
                    pipe.hget(keys.lease(session), "worker")
                found = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        return dict(zip(sessions, cast("list[str | None]", found), strict=True))

    async def stop_elsewhere(self, session: str, reason: ToolReason) -> tuple[str | None, bool]:
        owner = (await self.owners([session]))[session]
        if owner is None or owner == self._worker_id:
            return owner, False
        stopped = await self._forwarder.ask(owner, {"ask": "stop", "session": session, "kind": reason.kind,
                                                   "text": reason.text})
        return owner, bool(stopped)

    async def _live_workers(self) -> list[str]:
        try:
            workers = cast("list[str]", await self._redis.hkeys(keys.workers()))
            async with self._redis.pipeline(transaction=False) as pipe:
                for w in workers:
                    pipe.exists(keys.worker_alive(w))
                alive = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        return [w for w, up in zip(workers, alive, strict=True) if up]

