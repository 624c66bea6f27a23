"""Cross-process session leases in Redis, with fencing numbers.

A lease says which worker owns a session. Acquire, renew and release are Lua compare-and-set
scripts on the session's own slot; the TTL is kept by the Redis server, so worker clocks do not
matter. Each acquisition takes a new fencing number that only grows (it never falls below the
server's clock in ms, so even a Redis that lost its data hands out larger numbers), and every
write a turn makes carries it: a worker that was paused past its TTL cannot write after waking.

Locally a lease counts as valid only until `renewed + ttl - margin` by our monotonic clock,
measured from when the renewal was *sent*, so we give up a lease before Redis does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

log = logging.getLogger(__name__)

AnyRedis = Redis | RedisCluster  # a single Redis, or Redis Cluster: every script here is one slot

_ACQUIRE = """
local cur = redis.call('HGET', KEYS[1], 'token')
if cur and cur ~= ARGV[1] then
  return {0, redis.call('HGET', KEYS[1], 'worker'), redis.call('PTTL', KEYS[1])}
end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, tonumber(redis.call('HGET', KEYS[1], 'fence'))}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local f = redis.call('INCR', KEYS[2])
if f < now_ms then
  f = now_ms
  redis.call('SET', KEYS[2], f)
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'worker', ARGV[2], 'fence', f)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, f}
"""

# KEYS: lease. ARGV: token, fence, ttl_ms -> 1 renewed, 0 lost
_RENEW = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] and redis.call('HGET', KEYS[1], 'fence') == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: token, fence -> 1 released, 0 not ours
_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] and redis.call('HGET', KEYS[1], 'fence') == ARGV[2] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


@dataclass(slots=True)
class Lease:
    key: str  # the Redis key of the lease
    name: str  # session key or ingress name
    fence: int
    renewed_at: float  # monotonic time the last successful renewal was sent


@dataclass(frozen=True, slots=True)
class Acquired:
    lease: Lease | None  # ours, or None if someone else holds it
    owner: str | None = None  # that someone
    ttl_ms: int = 0


class LeaseManager:
    """Holds this worker's leases: acquires on demand, renews all in one batch every TTL/3."""

    def __init__(self, redis: AnyRedis, worker_id: str, *, ttl_s: float = 30.0,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.redis = redis
        self.worker_id = worker_id
        self.ttl_s = ttl_s
        self.margin_s = min(2.0, ttl_s / 10)
        self.token = f"{worker_id}:{uuid.uuid4().hex}"
        self.on_lost = on_lost
        self.held: dict[str, Lease] = {}
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew_sha: str | None = None
        self._release = redis.register_script(_RELEASE)
        self._task: asyncio.Task[None] | None = None
        self.last_ok: float = time.monotonic()  # last time Redis answered a renewal batch
        self.acquisitions = self.losses = 0

    @property
    def ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    def holds(self, name: str, fence: int | None = None) -> bool:
        """Do we still provably hold `name` (with this fencing number)? No I/O, no state change."""
        lease = self.held.get(name)
        if lease is None or (fence is not None and lease.fence != fence):
            return False
        return time.monotonic() - lease.renewed_at < self.ttl_s - self.margin_s

    def check_lease(self, name: str) -> bool:
        """State change: drop `name` (reporting it lost) if it can no longer be proven; True if held."""
        if self.holds(name):
            return True
        if name in self.held:
            self._lose(name)  # e.g. we were paused past the TTL: stop acting on it now
        return False

    async def acquire(self, name: str, key: str, fence_key: str) -> Acquired:
        sent = time.monotonic()
        result = await self._acquire(keys=[key, fence_key], args=[self.token, self.worker_id, self.ttl_ms])
        if int(result[0]) == 1:
            fresh = name not in self.held
            lease = self.held[name] = Lease(key, name, int(result[1]), sent)
            if fresh:
                self.acquisitions += 1
            return Acquired(lease)
        return Acquired(None, str(result[1]), int(result[2]))

    async def release(self, name: str) -> None:
        lease = self.held.pop(name, None)
        if lease is None:
            return
        with contextlib.suppress(RedisError, OSError):
            await self._release(keys=[lease.key], args=[self.token, lease.fence])

    async def renew_all(self) -> None:
        """Renew every held lease in one pipeline; report the ones that are gone."""
        if not self.held:
            self.last_ok = time.monotonic()
            return
        leases = list(self.held.values())
        sent = time.monotonic()
        try:
            try:
                results = await self._renew_batch(leases)
            except NoScriptError:  # Redis restarted without our script: load it and go again
                results = await self._renew_batch(leases, load=True)
        except (RedisError, OSError) as exc:
            log.warning("lease renewal failed (%s); %d lease(s) at risk", type(exc).__name__, len(leases))
            for lease in leases:
                self.check_lease(lease.name)  # drops those past their TTL by our clock
            return
        self.last_ok = time.monotonic()
        for lease, ok in zip(leases, results, strict=True):
            if int(ok) == 1:
                lease.renewed_at = sent
            elif self.held.get(lease.name) is lease:
                self._lose(lease.name)

    async def _renew_batch(self, leases: list[Lease], *, load: bool = False) -> list[Any]:
        """One pipeline of EVALSHAs (split per node by a cluster client)."""
        if load or self._renew_sha is None:
            self._renew_sha = str(await self.redis.script_load(_RENEW))
        async with self.redis.pipeline(transaction=False) as pipe:
            for lease in leases:
                pipe.evalsha(self._renew_sha, 1, lease.key, self.token, lease.fence, self.ttl_ms)
            return list(await pipe.execute())

    def _lose(self, name: str) -> None:
        if self.held.pop(name, None) is None:
            return
        self.losses += 1
        log.warning("lease lost: %s", name)
        if self.on_lost is not None:
            self.on_lost(name)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            await self.renew_all()

    async def stop(self, *, release: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
        if release:
            for name in list(self.held):
                await self.release(name)
