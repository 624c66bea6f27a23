"""Adoption: taking over sessions whose owner is gone — this worker's previous incarnation at start
(its restart proves it gone), and anyone's session whose lease lapsed with work open (listed by its
owner's `Watchlist`, found by a scan every `scan_interval_s`).

Adopting is routing: the acquisition's recovery (`ClusterEvents.adopted`) closes and resumes what
was left open, and a session that had nothing left is later released as idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Container
from typing import cast

from redis.exceptions import RedisError

from agent_cache import keys
from agent_cache.leases import AnyRedis, LeaseManager
from gateway.core.cluster import ClusterUnavailable, Route

log = logging.getLogger(__name__)

SCAN_BATCH = 200  # lapsed leases looked at per scan


class Adopter:
    def __init__(self, redis: AnyRedis, leases: LeaseManager, *, route: Callable[[str], Awaitable[Route]],
                 acquiring: Container[str], ttl_s: float) -> None:
        self.redis = redis
        self.leases = leases
        self.route = route  # ours (acquired, recovered) or whose
        self.acquiring = acquiring  # sessions being acquired now: their acquirer adopts them
        self.ttl_s = ttl_s
        self.adoptions = 0

    @property
    def scan_interval_s(self) -> float:
        return min(1.0, self.ttl_s / 6)

    async def adopt_predecessor(self) -> None:
        """What this worker's previous incarnation held: ours now, or (someone else's by now) no
        longer listed as ours."""
        listing = keys.worker_sessions(self.leases.worker_id)
        owned = cast("set[str]", await self.redis.smembers(listing))
        if owned:
            log.info("taking over %d session(s) of the previous incarnation", len(owned))
        for session in owned:
            if session in self.leases.held:
                continue
            route = await self.route(session)
            if route.fence is None:  # someone else's by now: not ours to list
                await self.redis.srem(listing, session)

    async def watch_lapsed(self) -> None:
        """Scan for lapsed leases, for as long as the worker runs."""
        while True:
            await asyncio.sleep(self.scan_interval_s)
            try:
                await self.scan_lapsed()
            except (RedisError, OSError, ClusterUnavailable) as exc:
                log.debug("lapsed-lease scan failed: %s", exc)
            except Exception:
                log.exception("lapsed-lease scan crashed; retrying")

    async def scan_lapsed(self) -> int:
        """Adopt sessions whose lease ran out while they had work open. Returns adoptions.

        An entry is only ever listed while its session has work open, so a lapsed one is always
        taken; what was left open is then read from the store (whichever holds the history) by the
        recovery the acquisition runs, and a session that had nothing left is released as idle."""
        now_ms = int(time.time() * 1000)
        due = cast("list[str]", await self.redis.zrangebyscore(keys.leased(), "-inf", now_ms, start=0,
                                                                num=SCAN_BATCH))
        if not due:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for session in due:
                pipe.exists(keys.lease(session))
            held = await pipe.execute()
        adopted = 0
        for session, leased in zip(due, held, strict=True):
            if leased or session in self.acquiring or session in self.leases.held:
                continue  # renewed or taken meanwhile; its owner refreshes the entry
            route = await self.route(session)
            if route.fence is not None:
                adopted += 1
                self.adoptions += 1
                log.info("adopted %s: its lease lapsed with work open", session, extra={"session": session})
        return adopted
