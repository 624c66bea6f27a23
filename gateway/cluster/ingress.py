"""Ingress singletons in cluster mode: one worker polls Telegram (or holds the Discord gateway)
per bot token; the others stand by and take over when its lease expires."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.exceptions import RedisError

from agent_cache import keys
from gateway.cluster.coordinator import Cluster

log = logging.getLogger(__name__)


class IngressLeader:
    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster = cluster
        self.name = name

    def held(self) -> bool:
        return self.cluster.leases.holds(self.name)

    async def wait(self) -> None:
        """Return once this worker holds the ingress lease (standing by meanwhile)."""
        announced = False
        while True:
            try:
                got = await self.cluster.leases.acquire(self.name, keys.ingress(self.name),
                                                        keys.ingress_state(self.name, "fence"))
                if got.lease is not None:
                    self.cluster.ingress[self.name] = "leader"
                    log.info("ingress %s: this worker is the leader now", self.name)
                    return
                if not announced:
                    log.info("ingress %s: standing by (leader: %s)", self.name, got.owner)
                    announced = True
            except (RedisError, OSError) as exc:
                log.warning("ingress %s: cannot reach Redis (%s)", self.name, type(exc).__name__)
            await asyncio.sleep(self.cluster.ttl_s / 3)

    async def load(self, field: str) -> str | None:
        with contextlib.suppress(RedisError, OSError):
            value = await self.cluster.redis.get(keys.ingress_state(self.name, field))
            return str(value) if value is not None else None
        return None

    async def save(self, field: str, value: str) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.cluster.redis.set(keys.ingress_state(self.name, field), value)
