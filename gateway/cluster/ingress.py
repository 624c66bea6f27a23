"""Ingress singletons in cluster mode: one worker polls Telegram per bot token, and one holds each
Discord shard; the others stand by and take over when its lease lapses (asking again when it
would, at least every min(1 s, TTL/6): a lapsed lease is taken within that of its expiry)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import cast

from redis.exceptions import RedisError

from agent_cache import keys
from agent_cache.leases import DataLost
from gateway.cluster.coordinator import Cluster
from gateway.core.outage import OutageLog

log = logging.getLogger(__name__)


# KEYS: ingress lease, state key.  ARGV: token, fence, value.  Returns 1 written, 0 not the leader.
_SAVE = """
local cur = redis.call('HMGET', KEYS[1], 'token', 'fence')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[2], ARGV[3])
return 1
"""


class IngressLeader:
    """`platforms.ingress.IngressLeader` over a Redis lease (one leader per bot token, or per
    Discord shard: `name` says which)."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        cluster.ingress_names.add(name)
        self._save = cluster.redis.register_script(_SAVE)
        self._outage = OutageLog(log, f"ingress {name}")  # Redis unreachable while standing by
        self._announced = False  # "standing by" logged (once per stretch of standing by)
        self._retry_s = min(1.0, cluster.ttl_s / 6)  # as often as lapsed session leases are looked for

    def held(self) -> bool:
        return self.cluster.leases.holds(self.name)

    async def wait(self) -> None:
        """Return once this worker holds the ingress lease (standing by meanwhile)."""
        while True:
            again_in = await self.attempt()
            if again_in is None:
                return
            await asyncio.sleep(again_in)

    async def attempt(self) -> float | None:
        """One try: None once this worker holds the lease, else the seconds to wait before the next
        (until the holder's lease would lapse, and never more than `_retry_s`)."""
        loss = self.cluster.loss
        try:
            await loss.fresh()
            if loss.quarantined():  # a holder that has not noticed Redis's loss may still be polling
                self._outage.failed("quarantined", loss.refusal(), level=logging.INFO)
                return self._retry_s
            losses = loss.losses
            got = await self.cluster.leases.acquire(self.name, keys.ingress(self.name),
                                                    keys.ingress_state(self.name, "fence"))
        except DataLost:
            await loss.lost()
            return self._retry_s
        except (RedisError, OSError) as exc:
            self._outage.failed("unreachable", f"cannot reach Redis ({type(exc).__name__})")
            return self._retry_s
        self._outage.recovered("Redis answers again")
        if got.lease is not None and loss.losses != losses:  # taken across a loss: not trusted
            self.cluster.leases.drop([self.name], "Redis lost its data while it was acquired")
            return self._retry_s
        if got.lease is not None:
            self.cluster.ingress[self.name] = "leader"
            self._announced = False
            log.info("ingress %s: this worker is the leader now", self.name)
            return None
        if not self._announced:
            log.info("ingress %s: standing by (leader: %s)", self.name, got.owner)
            self._announced = True
        return min(self._retry_s, max(got.ttl_ms / 1000, 0.01))

    async def release(self) -> None:
        """Give the lease up now (a clean stop), so a standby takes over at once, not a TTL later."""
        self.cluster.ingress.pop(self.name, None)
        if self.name not in self.cluster.leases.held:
            return
        with contextlib.suppress(RedisError, OSError):
            await self.cluster.leases.release(self.name)
            await self.cluster.redis.srem(keys.worker_sessions(self.cluster.worker_id), self.name)
        log.info("ingress %s: handed on", self.name)

    async def live_workers(self) -> int:
        """How many workers are alive now (0 if Redis cannot say)."""
        try:
            workers = cast("list[str]", await self.cluster.redis.hkeys(keys.workers()))
            async with self.cluster.redis.pipeline(transaction=False) as pipe:
                for worker in workers:
                    pipe.exists(keys.worker_alive(worker))
                alive = await pipe.execute()
        except (RedisError, OSError):
            return 0
        return sum(1 for up in alive if up)

    async def load(self, field: str) -> str | None:
        with contextlib.suppress(RedisError, OSError):
            value = await self.cluster.redis.get(keys.ingress_state(self.name, field))
            return str(value) if value is not None else None
        return None

    async def save(self, field: str, value: str) -> None:
        """Fenced: written only while this worker's lease is the current one, so a leader that was
        paused and replaced cannot move the state back."""
        lease = self.cluster.leases.held.get(self.name)
        if lease is None:
            return
        try:
            written = await self._save(keys=[lease.key, keys.ingress_state(self.name, field)],
                                       args=[self.cluster.leases.token, lease.fence, value])
        except (RedisError, OSError) as exc:
            log.warning("ingress %s: could not save %s (%s)", self.name, field, type(exc).__name__)
            return
        if not written:
            log.warning("ingress %s: not saving %s: another worker leads now", self.name, field)
            self.cluster.leases.check_lease(self.name)
