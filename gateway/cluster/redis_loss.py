"""Redis losing its data under a running cluster (restarted without persistence, flushed, failed
over to an empty replica): noticed by a sentinel value, and survived without two owners at once.

Every worker joins with the sentinel's value (`keys.sentinel`: set by the first, read by the
others). A worker holding sessions looks at it every `SENTINEL_EVERY_S`, an acquisition looks at
it when that look is older than that, and in a single Redis every acquisition's script checks it
too (`LeaseManager.guard`), so no lease is ever taken from a Redis that lost its data by a worker
that has not noticed. On noticing, a worker drops the sessions it held (their turns stop and
write nothing more) and takes no session for one lease TTL: a worker that has not noticed yet
may still be running a turn under a lease Redis forgot, and its own clock stops it within a TTL of
its last renewal, which was before the loss. A session another worker took since is forwarded
to it as usual. Then what was created once at start is made again (the sentinel, the inbox
group) and the sessions dropped are listed as lapsed, due when the quarantine ends: each is
taken again through the normal fenced acquisition (fences follow Redis's clock, so they keep
growing) and what was left open is closed and resumed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import cast

from redis.exceptions import RedisError

from agent_cache import keys
from agent_cache.leases import AnyRedis, LeaseManager
from agent_cache.leases import now as lease_clock
from gateway.cluster.forwarding import Inbox

log = logging.getLogger(__name__)

# How stale the sentinel look may be when a session is acquired, and how often a worker holding
# sessions looks: Redis losing its data is noticed within about this.
SENTINEL_EVERY_S = 0.05


class RedisLoss:
    def __init__(self, redis: AnyRedis, leases: LeaseManager, *, ingress: dict[str, str], ingress_names: set[str],
                 ttl_s: float) -> None:
        self.redis = redis
        self.leases = leases
        self.ingress = ingress  # ingress leases held (not sessions: not listed for adoption)
        self.ingress_names = ingress_names  # every ingress lease this worker stands for, held or not
        self.ttl_s = ttl_s
        self.inbox: Inbox | None = None  # made again after a loss (set once the worker has one)
        self.value: str | None = None  # the sentinel's value when we joined
        self.losses = 0  # losses noticed: an acquisition that spans one is not trusted
        self._seen = float("-inf")  # when (lease clock) the sentinel was last asked for and matched
        self._check: asyncio.Future[None] | None = None  # one look at a time, shared
        self._handling: asyncio.Future[None] | None = None
        self._quarantine_until = float("-inf")  # lease clock
        self._recovering = False  # noticed, not yet re-established: acquisitions stay refused
        self._relist: set[str] = set()  # sessions held at the loss, to list as lapsed once Redis takes it

    async def join(self) -> None:
        """Take the sentinel's value, set now (a value never used before) unless another worker set
        it first; every acquisition checks it from now on. Raises RedisError."""
        await self.redis.set(keys.sentinel(), secrets.token_hex(8), nx=True)
        self.value = cast("str | None", await self.redis.get(keys.sentinel()))
        self.leases.guard = (keys.sentinel(), self.value) if self.value is not None else None
        self._seen = lease_clock()

    def matches(self, value: str | None) -> bool:
        """Is `value` (read from Redis) the sentinel we joined with (or have we not joined)?"""
        return self.value is None or value == self.value

    def quarantined(self) -> bool:
        return self._recovering or lease_clock() < self._quarantine_until

    def refusal(self) -> str:
        left = max(0.0, self._quarantine_until - lease_clock())
        return (f"Redis lost its data; sessions are taken again once any turn still running under a "
                f"lost lease has stopped (in {left:.1f} s)")

    async def fresh(self) -> None:
        """Make sure Redis still has our sentinel, as seen `SENTINEL_EVERY_S` ago at most (one GET,
        shared by concurrent callers); if not, handle the loss. Raises RedisError."""
        if self.value is None or lease_clock() - self._seen < SENTINEL_EVERY_S:
            return
        if self._check is None or self._check.done():
            self._check = asyncio.ensure_future(self._look())
        await asyncio.shield(self._check)

    async def _look(self) -> None:
        asked = lease_clock()
        if self.matches(cast("str | None", await self.redis.get(keys.sentinel()))):
            self._seen = asked
        else:
            await self.lost()

    async def watch(self) -> None:
        """While this worker holds sessions, look every `SENTINEL_EVERY_S`: the turns running here
        stop within that of Redis coming back empty, not at the next renewal round (up to TTL/3
        later, meanwhile overlapping a turn another worker may have started for the session)."""
        while True:
            await asyncio.sleep(SENTINEL_EVERY_S)
            if not self._recovering and not self.leases.held:
                continue  # nothing at stake; the heartbeat looks every TTL/3
            try:
                await self.fresh()
            except (RedisError, OSError):
                continue  # unreachable: renewals report that, and leases lapse by our clock
            except Exception:  # never let the watch die quietly
                log.exception("cluster: the sentinel watch crashed; retrying")

    async def lost(self) -> None:
        """Redis lost its data; concurrent callers share one handling (which never raises)."""
        if self._handling is None or self._handling.done():
            self._handling = asyncio.ensure_future(self._handle())
        await asyncio.shield(self._handling)

    async def _handle(self) -> None:
        """At once (no I/O): drop the sessions held, refuse acquisitions for a TTL. Then make again
        what was made once at start. If Redis fails meanwhile, the next look finishes the job."""
        if not self._recovering:
            self._recovering = True
            self.losses += 1
            self._quarantine_until = lease_clock() + self.ttl_s
            held = [name for name in self.leases.held if name not in self.ingress]
            ingress = [name for name in self.leases.held if name in self.ingress]
            self._relist.update(held)
            # Also what a renewal round found gone an instant before this look noticed why: the
            # loss took its listing too, and its turn was cut off with work open. (An ingress
            # lease lost is never listed: its standby takes it by itself.) Listing one another
            # worker took meanwhile is harmless: the scan finds it held.
            recently = lease_clock() - self.ttl_s
            self._relist.update(name for name, at in self.leases.lost_at.items()
                                if at >= recently and name not in self.ingress_names)
            log.error("cluster: Redis lost its data (restarted without persistence?): %d session(s) and %d "
                      "ingress lease(s) held here were dropped and are taken again after %.1f s (one lease "
                      "TTL: a worker that has not noticed yet may still be running a turn, polling Telegram "
                      "or holding a Discord shard); inboxes are re-established", len(held), len(ingress), self.ttl_s)
            # Ingress leases too: their pollers and shards stop at once, and nobody takes them over
            # before the quarantine ends (two pollers of one bot, or two connections of one shard).
            self.leases.drop([*held, *ingress], "Redis lost its data")
        try:
            if self.inbox is not None:
                await self.inbox.create()
            if self._relist:
                due_ms = int((time.time() + max(0.0, self._quarantine_until - lease_clock())) * 1000)
                await self.redis.zadd(keys.leased(), dict.fromkeys(self._relist, due_ms))
                self._relist.clear()
            await self.join()
        except (RedisError, OSError) as exc:
            log.warning("cluster: re-establishing after Redis lost its data failed (%s); retrying",
                        type(exc).__name__)
            return
        self._recovering = False
