"""Cluster mode: several workers share one Redis; each session has exactly one owner.

A worker that receives a message for a session either owns it (holds its lease, taking it if
free — and then recovering what a dead owner left open), or forwards the message to the owner's
inbox stream. Entries a dead worker never acknowledged are claimed by the living, so nothing
forwarded is lost. Commands forwarded from another worker have their result relayed back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any, cast

from redis.exceptions import RedisError, ResponseError

from agent_cache import keys
from agent_cache.leases import AnyRedis, LeaseManager
from gateway.core.cluster import ClusterEvents, ClusterUnavailable, Route
from gateway.core.fencing import Fence
from gateway.core.messages import InboundMessage
from gateway.core.metrics import Metrics
from gateway.core.ports import Health, Outcome, Submitted

log = logging.getLogger(__name__)

REPLY_WAIT_S = 10.0


class Cluster:
    """`Ownership` over Redis (see gateway.core.cluster): leases, forwarding, dead workers."""

    def __init__(self, redis: AnyRedis, worker_id: str, *, ttl_s: float, metrics: Metrics,
                 info: dict[str, Any] | None = None) -> None:
        self.redis = redis
        self._worker_id = worker_id
        self.ttl_s = ttl_s
        self.metrics = metrics
        self.info = info or {}
        self.leases = LeaseManager(redis, worker_id, ttl_s=ttl_s, on_lost=self._lost)
        self.ingress: dict[str, str] = {}  # ingress leases held: name -> description
        self._events: ClusterEvents | None = None
        self._acquiring: dict[str, asyncio.Future[Route]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._inbox = keys.worker_inbox(worker_id)

    @property
    def worker_id(self) -> str:
        return self._worker_id

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, events: ClusterEvents) -> None:
        self._events = events
        with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists already
            await self.redis.xgroup_create(self._inbox, keys.GROUP, id="0", mkstream=True)
        await self._heartbeat()
        self.leases.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._consume()), loop.create_task(self._background())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        await self.leases.stop(release=True)
        with contextlib.suppress(RedisError, OSError):
            # Gone, but still listed: the others adopt our sessions at once (turns cut off by
            # this restart are resumed there) and then forget us.
            await self.redis.delete(keys.worker_alive(self.worker_id))
        await self.redis.aclose()

    def health(self) -> Health:
        age = time.monotonic() - self.leases.last_ok
        if age < self.ttl_s:
            return Health(True, f"worker {self.worker_id}, {len(self.leases.held)} lease(s)")
        return Health(False, f"Redis unreachable for {age:.0f} s; leases cannot be proven")

    # --- ownership ------------------------------------------------------------------------

    async def route(self, session: str) -> Route:
        """Ours (with the fence) or someone else's. Concurrent callers for one session share one
        acquisition, so messages and commands keep their order."""
        if (fence := self.fence_of(session)) is not None:
            return Route(fence=fence)
        if not self.health().ok:
            raise ClusterUnavailable("Redis is unreachable; ownership cannot be proven")
        pending = self._acquiring.get(session)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Route] = asyncio.get_running_loop().create_future()
        self._acquiring[session] = fut
        try:
            route = await self._acquire(session)
            fut.set_result(route)
            return route
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: no "never retrieved" warning if nobody else waits
            raise
        finally:
            self._acquiring.pop(session, None)

    async def _acquire(self, session: str) -> Route:
        try:
            got = await self.leases.acquire(session, keys.lease(session), keys.fence(session))
            if got.lease is None:
                return Route(owner=got.owner)
            self.metrics.lease_events.labels("acquired").inc()
            await self.redis.sadd(keys.worker_sessions(self.worker_id), session)
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        fence = Fence(session, got.lease.fence)
        await self._recover(session)
        return Route(fence=fence)

    def fence_of(self, session: str) -> Fence | None:
        lease = self.leases.held.get(session)
        if lease is None or not self.leases.holds(session):
            return None
        return Fence(session, lease.fence)

    def holds(self, fence: Fence) -> bool:
        return self.leases.holds(fence.session_key, fence.number)

    def check_lease(self, session: str) -> None:
        self.leases.check_lease(session)

    async def _recover(self, session: str) -> None:
        """We just took the session: finish what its previous owner left open."""
        assert self._events is not None
        await self._events.adopted(session)

    def _lost(self, session: str) -> None:
        self.metrics.lease_events.labels("lost").inc()
        if self.ingress.pop(session, None) is None and self._events is not None:  # ingress leases stop nothing
            self._events.lease_lost(session)

    # --- forwarding -----------------------------------------------------------------------

    async def forward(self, owner: str, msg: InboundMessage, session: str, *, hops: int,
                      want_reply: bool) -> Submitted | None:
        """Hand a message to its owner's inbox; with `want_reply`, wait for the command's result."""
        request = uuid.uuid4().hex if want_reply else ""
        entry = {"msg": msg.to_dict(), "session": session, "hops": hops + 1, "reply": request,
                 "from": self.worker_id}
        try:
            await self.redis.xadd(keys.worker_inbox(owner), {"data": json.dumps(entry)})
            if not want_reply:
                return None
            got = await self.redis.blpop([keys.forward_reply(request)], timeout=REPLY_WAIT_S)
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        if not got:
            return None
        result = json.loads(got[1])
        return Submitted(Outcome(result["outcome"]), result["detail"])

    async def _consume(self) -> None:
        while True:
            try:
                batch = await self.redis.xreadgroup(keys.GROUP, self.worker_id, {self._inbox: ">"},
                                                    count=100, block=1000)
            except (RedisError, OSError) as exc:
                log.warning("reading the inbox failed: %s", type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            streams = cast("list[tuple[str, list[tuple[str, dict[str, str]]]]]", batch or [])
            for _stream, entries in streams:
                for entry_id, fields in entries:
                    await self._handle(self._inbox, entry_id, fields)

    async def _handle(self, stream: str, entry_id: str, fields: dict[str, str]) -> None:
        try:
            entry = json.loads(fields["data"])
            msg = InboundMessage.from_dict(entry["msg"])
            assert self._events is not None
            result = await self._events.deliver(msg, entry["session"], int(entry["hops"]))
            if result is not None and entry.get("reply"):
                await self._reply(entry["reply"], result)
        except (ValueError, KeyError, TypeError):
            log.exception("dropping a malformed inbox entry %s", entry_id)
        except (RedisError, OSError) as exc:
            log.warning("handling a forwarded message failed (%s); it stays pending", type(exc).__name__)
            return
        with contextlib.suppress(RedisError, OSError):
            await self.redis.xack(stream, keys.GROUP, entry_id)

    async def _reply(self, request: str, result: Submitted) -> None:
        key = keys.forward_reply(request)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lpush(key, json.dumps({"outcome": result.outcome.value, "detail": result.detail}))
            pipe.expire(key, 60)
            await pipe.execute()

    # --- heartbeat, idle leases, dead workers ---------------------------------------------

    async def _background(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self._heartbeat()
                await self._release_idle()
                await self._claim_from_the_dead()
            except (RedisError, OSError, ClusterUnavailable) as exc:
                log.warning("cluster housekeeping failed: %s", exc or type(exc).__name__)
            except Exception:  # never let housekeeping die quietly
                log.exception("cluster housekeeping crashed; retrying")

    async def _heartbeat(self) -> None:
        beat = {"seen_at": time.time(), "sessions": sorted(self.leases.held), "ingress": self.ingress,
                **self.info}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(keys.worker_alive(self.worker_id), 1, px=int(self.ttl_s * 2000))
            pipe.hset(keys.workers(), self.worker_id, json.dumps(beat))
            await pipe.execute()

    async def _release_idle(self) -> None:
        """A lease is kept only while the session has a cached agent or work in its lane."""
        for session in list(self.leases.held):
            assert self._events is not None
            if not self._events.in_use(session) \
                    and session not in self._acquiring and session not in self.ingress:
                await self.leases.release(session)
                await self.redis.srem(keys.worker_sessions(self.worker_id), session)

    async def _claim_from_the_dead(self) -> None:
        """Take over what dead workers left in their inboxes: entries they read but never
        acknowledged (XAUTOCLAIM, once idle for a TTL) and entries they never got to read."""
        workers = cast("list[str]", await self.redis.hkeys(keys.workers()))  # decode_responses=True
        for worker in workers:
            if worker == self.worker_id or await self.redis.exists(keys.worker_alive(worker)):
                continue
            inbox = keys.worker_inbox(worker)
            try:
                _next, claimed, *_ = await self.redis.xautoclaim(
                    inbox, keys.GROUP, self.worker_id, min_idle_time=int(self.ttl_s * 1000), count=100)
                unread = await self.redis.xreadgroup(keys.GROUP, self.worker_id, {inbox: ">"}, count=100)
            except ResponseError:  # no such stream or group: it never got anything
                await self.redis.hdel(keys.workers(), worker)
                continue
            entries = list(claimed) + [e for _s, batch in cast("list[Any]", unread or []) for e in batch]
            for entry_id, fields in entries:
                if fields:
                    log.info("re-routing a message forwarded to dead worker %s", worker)
                    await self._handle(inbox, entry_id, fields)
            if entries or (await self.redis.xpending(inbox, keys.GROUP)).get("pending"):
                continue  # the rest once they have been idle for a TTL
            await self._adopt_sessions(worker)
            await self.redis.hdel(keys.workers(), worker)  # gone, and nothing left behind

    async def _adopt_sessions(self, worker: str) -> None:
        """A dead worker's sessions may hold turns it was running: take each one whose lease has
        lapsed, which finishes what it left open (a resume, a replay), instead of waiting for the
        user's next message."""
        owned = keys.worker_sessions(worker)
        for session in cast("set[str]", await self.redis.smembers(owned)):
            if await self.redis.exists(keys.lease(session)):
                continue  # someone holds it (or the dead worker's lease has not lapsed yet)
            route = await self.route(session)
            if route.fence is not None:
                log.info("adopted %s from dead worker %s", session, worker, extra={"session": session})
        await self.redis.delete(owned)
