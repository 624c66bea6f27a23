"""The sessions with work open on this worker, listed in Redis (`keys.leased()`) with their lease
deadline, so that if this worker stops renewing, a live one finds the work and adopts it.

Invariant: a session is listed while it has work open here, and may stay listed a moment after
(unlisted in batches, `UNWATCH_AFTER_S` later: a chat's next message meanwhile costs no Redis call)
— never the other way round. A session whose lease was lost stays listed, for whoever adopts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from redis.exceptions import RedisError

from agent_cache import keys
from agent_cache.leases import AnyRedis, LeaseManager
from agent_cache.tasks import cancel_and_wait
from gateway.core.cluster import ClusterUnavailable

SLICE = 250  # sessions per Redis call in per-lease sweeps, so none holds the event loop for long
UNWATCH_AFTER_S = 0.25  # a session's next message within this keeps it listed: no ZREM, no ZADD


class Watchlist:
    def __init__(self, redis: AnyRedis, leases: LeaseManager, *, ttl_s: float) -> None:
        self.redis = redis
        self.leases = leases
        self.ttl_s = ttl_s
        self._watched: set[str] = set()  # sessions with work open, listed in keys.leased()
        self._watching: dict[str, asyncio.Future[None]] = {}
        self._unwatching: dict[str, asyncio.Task[None]] = {}
        self._unwatch_due: set[str] = set()  # work done, still listed: unlisted in the next batch
        self._unwatch_timer: asyncio.TimerHandle | None = None
        self._chores: set[asyncio.Task[None]] = set()

    def expiry_ms(self) -> int:
        return int((time.time() + self.ttl_s) * 1000)

    async def watch(self, session: str) -> None:
        """List `session` with its lease deadline. Callers for one session resume in the order
        they called (messages keep their order). Raises ClusterUnavailable."""
        pending = self._watching.get(session)
        if pending is not None:
            await asyncio.shield(pending)
            return
        if session in self._watched:
            self._unwatch_due.discard(session)  # its last turn just ended: it never left the list
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watching[session] = fut
        try:
            if (unlisting := self._unwatching.get(session)) is not None:
                await asyncio.wait({unlisting})  # its ZREM must not land after our ZADD
            await self.redis.zadd(keys.leased(), {session: self.expiry_ms()})
            self._watched.add(session)
            fut.set_result(None)
        except (RedisError, OSError) as exc:
            fut.set_exception(ClusterUnavailable(f"Redis failed: {type(exc).__name__}"))
            fut.exception()  # retrieved: no warning if nobody else waits
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        finally:
            self._watching.pop(session, None)

    def unwatch(self, session: str) -> None:
        """`session` has no work open any more: unlisted in the next batch, while still provably
        ours (a lost one stays listed, for whoever adopts it)."""
        if session not in self._watched or not self.leases.holds(session):
            return
        self._unwatch_due.add(session)
        if self._unwatch_timer is None:
            self._unwatch_timer = asyncio.get_running_loop().call_later(UNWATCH_AFTER_S, self._unlist_due)

    def forget(self, sessions: list[str]) -> None:
        """These are no longer ours to list or unlist (lost, handed on, or released and unlisted)."""
        self._watched.difference_update(sessions)
        self._unwatch_due.difference_update(sessions)

    def owned(self) -> list[str]:
        """Watched sessions whose lease this worker holds."""
        return [s for s in self._watched if s in self.leases.held]

    async def refresh(self) -> None:
        """Move the lapse deadline of every session with work open (few, next to the leases held)."""
        watched = self.owned()
        expiry = self.expiry_ms()
        for start in range(0, len(watched), SLICE):
            await self.redis.zadd(keys.leased(), dict.fromkeys(watched[start:start + SLICE], expiry), xx=True)

    async def stop(self) -> tuple[list[str], list[str]]:
        """No more batches. Returns (sessions with work still open, sessions whose work is done but
        still listed) among the leases held: the caller marks the first lapsed, unlists the second."""
        await cancel_and_wait(self._chores)
        if self._unwatch_timer is not None:
            self._unwatch_timer.cancel()
        held = self.leases.held
        open_work = [s for s in self._watched if s in held and s not in self._unwatch_due]
        done = [s for s in self._unwatch_due if s in self._watched and s in held]
        return open_work, done

    def _unlist_due(self) -> None:
        self._unwatch_timer = None
        due = [s for s in self._unwatch_due if s in self._watched and self.leases.holds(s)]
        self._unwatch_due.clear()
        if not due:
            return
        self._watched.difference_update(due)
        task = asyncio.get_running_loop().create_task(self._zrem(due))
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)
        for session in due:
            self._unwatching[session] = task
        task.add_done_callback(lambda t: [self._unwatching.pop(s) for s in due if self._unwatching.get(s) is t])

    async def _zrem(self, sessions: list[str]) -> None:
        with contextlib.suppress(RedisError, OSError):
            for start in range(0, len(sessions), SLICE):
                await self.redis.zrem(keys.leased(), *sessions[start:start + SLICE])
