"""Ingress singletons in cluster mode: one worker polls Telegram (or holds the Discord gateway)
per bot token; the others stand by and take over when its lease expires."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.exceptions import RedisError

from agent_cache import keys
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
    """`platforms.ingress.IngressLeader` over a Redis lease (one leader per bot token)."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self._save = cluster.redis.register_script(_SAVE)
        self._outage = OutageLog(log, f"ingress {name}")  # Redis unreachable while standing by

    def held(self) -> bool:
        return self.cluster.leases.holds(self.name)

    async def wait(self) -> None:
        """Return once this worker holds the ingress lease (standing by meanwhile)."""
        announced = False
        while True:
            try:
                got = await self.cluster.leases.acquire(self.name, keys.ingress(self.name),
                                                        keys.ingress_state(self.name, "fence"))
                self._outage.recovered("Redis answers again")
                if got.lease is not None:
                    self.cluster.ingress[self.name] = "leader"
                    log.info("ingress %s: this worker is the leader now", self.name)
                    return
                if not announced:
                    log.info("ingress %s: standing by (leader: %s)", self.name, got.owner)
                    announced = True
            except (RedisError, OSError) as exc:
                self._outage.failed("unreachable", f"cannot reach Redis ({type(exc).__name__})")
            await asyncio.sleep(self.cluster.ttl_s / 3)

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
