"""Cluster mode: several workers share one Redis; each session has exactly one owner.

A worker that receives a message for a session either owns it (holds its lease, taking it if
free — and then recovering what a previous owner left open), or forwards the message to the
owner's inbox stream. Every live worker watches for leases that lapsed (`keys.leased`) and adopts
the sessions behind them, so a turn cut off by a crash, a pause or a partition is closed, told and
resumed about a TTL after its owner's last renewal, with no user message needed. Entries a dead
worker never acknowledged are claimed by the living; a restarted worker takes over what its
previous incarnation held at once, and re-reads what that incarnation read but never acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable
from typing import Any, cast

from redis.exceptions import RedisError, ResponseError

from agent_cache import keys
from agent_cache.leases import AnyRedis, Lease, LeaseManager
from agent_cache.leases import now as lease_clock
from gateway.core.cluster import ClusterEvents, ClusterUnavailable, Route
from gateway.core.fencing import Fence
from gateway.core.messages import InboundMessage
from gateway.core.metrics import Metrics
from gateway.core.ports import Health, Outcome, Submitted

log = logging.getLogger(__name__)

REPLY_WAIT_S = 10.0
SCAN_BATCH = 200  # lapsed leases looked at per scan
SLICE = 250  # sessions per Redis call in per-lease sweeps, so none holds the event loop for long
UNWATCH_AFTER_S = 0.25  # a session's next message within this keeps it listed: no ZREM, no ZADD


def new_incarnation() -> str:
    """A fresh identity for this process: its start time and some randomness."""
    return f"{int(time.time()):x}-{secrets.token_hex(3)}"


class Cluster:
    """`Ownership` over Redis (see gateway.core.cluster): leases, forwarding, adoption."""

    def __init__(self, redis: AnyRedis, worker_id: str, *, ttl_s: float, metrics: Metrics,
                 info: dict[str, Any] | None = None, incarnation: str | None = None) -> None:
        self.redis = redis
        self._worker_id = worker_id
        self.incarnation = incarnation or new_incarnation()
        self.ttl_s = ttl_s
        self.metrics = metrics
        self.info = info or {}
        self.leases = LeaseManager(redis, worker_id, self.incarnation, ttl_s=ttl_s, on_lost=self._lost,
                                   listed_in=keys.worker_sessions(worker_id))
        self.ingress: dict[str, str] = {}  # ingress leases held: name -> description
        self._events: ClusterEvents | None = None
        self._acquiring: dict[str, asyncio.Future[Route]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._chores: set[asyncio.Task[None]] = set()
        self._watched: set[str] = set()  # sessions with work open, listed in keys.leased()
        self._watching: dict[str, asyncio.Future[None]] = {}
        self._unwatching: dict[str, asyncio.Task[None]] = {}
        self._unwatch_due: set[str] = set()  # work done, still listed: unlisted in the next batch
        self._unwatch_timer: asyncio.TimerHandle | None = None
        self._inbox = keys.worker_inbox(worker_id)
        self.adoptions = 0

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @property
    def scan_interval_s(self) -> float:
        return min(1.0, self.ttl_s / 6)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, events: ClusterEvents) -> None:
        """Join: heartbeat, renewals, the inbox. Adoption starts with `adopt()`, once the rest of
        the daemon can take what it adopts."""
        self._events = events
        try:
            with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists already
                await self.redis.xgroup_create(self._inbox, keys.GROUP, id="0", mkstream=True)
            await self._heartbeat()
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"cannot reach Redis ({type(exc).__name__})") from None
        self.leases.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._consume()), loop.create_task(self._background()),
                       loop.create_task(self._expire_own())]
        log.info("cluster: worker %s, incarnation %s", self.worker_id, self.incarnation)

    async def adopt(self) -> None:
        """Take over what this worker's previous incarnation held (its restart proves it gone), then
        keep watching for lapsed leases anywhere."""
        try:
            await self._adopt_predecessor()
        except (RedisError, OSError, ClusterUnavailable) as exc:
            log.warning("could not take over the previous incarnation's sessions yet: %s", exc)
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch_lapsed()))

    async def stop(self) -> None:
        """Leave: release every lease; sessions with work still open (turns this stop cut off) are
        marked lapsed, so the others adopt and resume them at once."""
        for task in [*self._tasks, *self._chores]:
            task.cancel()
        if self._tasks or self._chores:
            await asyncio.wait([*self._tasks, *self._chores])
        if self._unwatch_timer is not None:
            self._unwatch_timer.cancel()
        held = list(self.leases.held)
        open_work = [s for s in self._watched if s in self.leases.held and s not in self._unwatch_due]
        done = [s for s in self._unwatch_due if s in self._watched and s in self.leases.held]
        await self.leases.stop(release=True)
        with contextlib.suppress(RedisError, OSError):
            async with self.redis.pipeline(transaction=False) as pipe:
                if open_work:
                    pipe.zadd(keys.leased(), dict.fromkeys(open_work, 0))
                if done:
                    pipe.zrem(keys.leased(), *done)
                if held:
                    pipe.srem(keys.worker_sessions(self.worker_id), *held)
                # Gone: the others claim our inbox at once.
                pipe.delete(keys.worker_alive(self.worker_id))
                await pipe.execute()
        await self.redis.aclose()

    def health(self) -> Health:
        age = lease_clock() - self.leases.last_ok
        if age < self.ttl_s:
            return Health(True, f"worker {self.worker_id} ({self.incarnation}), {len(self.leases.held)} lease(s)")
        return Health(False, f"Redis unreachable for {age:.0f} s; leases cannot be proven")

    # --- ownership ------------------------------------------------------------------------

    async def route(self, session: str) -> Route:
        """Ours (with the fence) or someone else's. Concurrent callers for one session share one
        acquisition, so messages and commands keep their order. The lease is held before the
        acquisition's recovery has closed what a previous owner left open: until it has, callers
        wait for it (a turn started meanwhile would land between the cut-off turn and its close)."""
        pending = self._acquiring.get(session)
        if pending is not None:
            return await asyncio.shield(pending)
        if (fence := self.fence_of(session)) is not None:
            return Route(fence=fence)
        if self.leases.failing:  # Redis answered nothing lately: say so now, not after a timeout
            raise ClusterUnavailable("Redis is unreachable; ownership cannot be proven")
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
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        if got.replaced:
            log.info("took %s over from %s (an earlier incarnation of this worker)", session, got.replaced,
                     extra={"session": session})
        fence = Fence(session, got.lease.fence)
        assert self._events is not None
        if not got.kept:  # a real takeover: close and resume what a previous owner left open
            await self._events.adopted(session)
        return Route(fence=fence)

    def fence_of(self, session: str) -> Fence | None:
        lease = self.leases.held.get(session)
        if lease is None or not self.leases.holds(session):
            return None
        return Fence(session, lease.fence)

    def holds(self, fence: Fence) -> bool:
        return self.leases.holds(fence.session_key, fence.number)

    async def confirm(self, fence: Fence) -> bool:
        return await self.leases.confirm(fence.session_key, fence.number)

    def check_lease(self, session: str) -> None:
        self.leases.check_lease(session)

    async def watch(self, session: str) -> None:
        """`session` has work open (a turn queued or running): list it with its lease deadline, so
        that if this worker stops renewing, a live one adopts the turn. Callers for one session
        resume in the order they called (messages keep their order)."""
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
            await self.redis.zadd(keys.leased(), {session: self._expiry_ms()})
            self._watched.add(session)
            fut.set_result(None)
        except (RedisError, OSError) as exc:
            fut.set_exception(ClusterUnavailable(f"Redis failed: {type(exc).__name__}"))
            fut.exception()  # retrieved: no warning if nobody else waits
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        finally:
            self._watching.pop(session, None)

    def unwatch(self, session: str) -> None:
        """`session` has no work open any more. Only while it is still provably ours: a session
        whose lease was lost stays listed, for whoever adopts it. Unlisted in batches, a moment
        later: a chat's next message meanwhile costs no Redis call at all (listed for nothing, a
        session is at worst acquired by an adopter that finds nothing to do)."""
        if session not in self._watched or self.fence_of(session) is None:
            return
        self._unwatch_due.add(session)
        if self._unwatch_timer is None:
            self._unwatch_timer = asyncio.get_running_loop().call_later(UNWATCH_AFTER_S, self._unlist_due)

    def _unlist_due(self) -> None:
        self._unwatch_timer = None
        due = [s for s in self._unwatch_due if s in self._watched and self.fence_of(s) is not None]
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

    def _expiry_ms(self) -> int:
        return int((time.time() + self.ttl_s) * 1000)

    def _lost(self, name: str, lease: Lease, *, expired: bool) -> None:
        session = name
        self.metrics.lease_events.labels("lost").inc()
        if self.ingress.pop(session, None) is not None:  # ingress leases stop nothing
            return
        # Left listed (if it is) for whoever takes it; if we take it again, `watch` lists it anew.
        self._watched.discard(session)
        self._unwatch_due.discard(session)
        if self._events is not None:
            self._events.lease_lost(session)
        if expired:  # we gave it up by our clock: hand it on now rather than when Redis expires it
            self._chore(self._hand_on(session, lease))

    async def _hand_on(self, session: str, lease: Lease) -> None:
        """A lease we can no longer prove: release it (our fence only) and mark it lapsed, so a live
        worker — maybe this one — adopts the turn it was running right away."""
        self._watched.discard(session)
        self._unwatch_due.discard(session)
        with contextlib.suppress(RedisError, OSError):
            await self.leases.release_lost(lease)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zadd(keys.leased(), {session: 0})
                pipe.srem(keys.worker_sessions(self.worker_id), session)
                await pipe.execute()

    def _chore(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    # --- adoption -------------------------------------------------------------------------

    async def _adopt_predecessor(self) -> None:
        owned = cast("set[str]", await self.redis.smembers(keys.worker_sessions(self.worker_id)))
        if owned:
            log.info("taking over %d session(s) of the previous incarnation", len(owned))
        for session in owned:
            if session in self.leases.held:
                continue
            route = await self.route(session)
            if route.fence is None:  # someone else's by now: not ours to list
                await self.redis.srem(keys.worker_sessions(self.worker_id), session)

    async def _watch_lapsed(self) -> None:
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
            if leased or session in self._acquiring or session in self.leases.held:
                continue  # renewed or taken meanwhile; its owner refreshes the entry
            route = await self.route(session)
            if route.fence is not None:
                adopted += 1
                self.adoptions += 1
                log.info("adopted %s: its lease lapsed with work open", session, extra={"session": session})
        return adopted

    # --- forwarding -----------------------------------------------------------------------

    async def forward(self, owner: str, msg: InboundMessage, session: str, *, hops: int,
                      want_reply: bool) -> Submitted | None:
        """Hand a message to its owner's inbox; with `want_reply`, wait for the command's result."""
        request = uuid.uuid4().hex if want_reply else ""
        entry = {"msg": msg.to_dict(), "session": session, "hops": hops + 1, "reply": request,
                 "from": self.worker_id}
        try:
            await self.redis.xadd(keys.worker_inbox(owner), {"data": json.dumps(entry, ensure_ascii=False)})
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
        backlog = True  # first what an earlier incarnation read and never acknowledged
        while True:
            try:
                batch = await self.redis.xreadgroup(keys.GROUP, self.worker_id, {self._inbox: "0" if backlog else ">"},
                                                    count=100, block=None if backlog else 1000)
            except (RedisError, OSError) as exc:
                log.warning("reading the inbox failed: %s", type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            streams = cast("list[tuple[str, list[tuple[str, dict[str, str]]]]]", batch or [])
            entries = [e for _stream, part in streams for e in part]
            if backlog and not entries:
                backlog = False
                continue
            for entry_id, fields in entries:
                await self._handle(self._inbox, entry_id, fields)

    async def _handle(self, stream: str, entry_id: str, fields: dict[str, str], *, again: bool = False) -> None:
        """`again`: handled before, a TTL ago or more (ownership has settled since): its hop
        count starts over, so a message that bounced during a takeover is not refused for it."""
        if fields:  # an entry deleted meanwhile comes back empty: just acknowledge it
            try:
                entry = json.loads(fields["data"])
                msg = InboundMessage.from_dict(entry["msg"])
                assert self._events is not None
                hops = 1 if again else int(entry["hops"])  # (1: still a forwarded message, the store de-duplicates)
                result = await self._events.deliver(msg, entry["session"], hops)
                if result is not None and result.outcome is Outcome.UNAVAILABLE and not entry.get("reply"):
                    # Acknowledged by the worker that forwarded it, so it must not be lost here:
                    # it stays pending and is handled again once idle for a TTL.
                    log.warning("a forwarded message could not be taken now; it stays in the inbox")
                    return
                if result is not None and entry.get("reply"):
                    await self._reply(entry["reply"], result)
            except (ValueError, KeyError, TypeError):
                log.exception("dropping a malformed inbox entry %s", entry_id)
            except (RedisError, OSError) as exc:
                log.warning("handling a forwarded message failed (%s); it stays pending", type(exc).__name__)
                return
        with contextlib.suppress(RedisError, OSError):
            # Deleted too: a stream keeps acknowledged entries, and the inbox would grow forever.
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(stream, keys.GROUP, entry_id)
                pipe.xdel(stream, entry_id)
                await pipe.execute()

    async def _reply(self, request: str, result: Submitted) -> None:
        key = keys.forward_reply(request)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lpush(key, json.dumps({"outcome": result.outcome.value, "detail": result.detail}, ensure_ascii=False))
            pipe.expire(key, 60)
            await pipe.execute()

    # --- heartbeat, idle leases, dead workers ---------------------------------------------

    async def _background(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self._heartbeat()
                await self._refresh_leased()
                await self._release_idle()
                await self._reclaim_own()
                await self._claim_from_the_dead()
            except (RedisError, OSError, ClusterUnavailable) as exc:
                log.warning("cluster housekeeping failed: %s", exc or type(exc).__name__)
            except Exception:  # never let housekeeping die quietly
                log.exception("cluster housekeeping crashed; retrying")

    async def _expire_own(self) -> None:
        """Drop the lease of a session with a turn running the moment our clock can no longer prove
        it, not at the next renewal round (TTL/3 later, or later still while Redis hangs): its turn
        and its tools stop while the lease is still ours in Redis, before another worker can adopt
        it. A turn that has ended and is being recorded keeps its lease: its record is fenced, and
        showing its last words asks Redis first (a lease dropped here could not be asked for)."""
        events = self._events
        assert events is not None
        while True:
            await asyncio.sleep(self.leases.margin_s / 3)
            for session in [s for s in self._watched if s in self.leases.held and events.running(s)]:
                self.leases.check_lease(session)

    async def _heartbeat(self) -> None:
        beat = {"seen_at": time.time(), "incarnation": self.incarnation, "sessions": len(self.leases.held),
                "ingress": self.ingress, **self.info}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(keys.worker_alive(self.worker_id), self.incarnation, px=int(self.ttl_s * 1000))
            pipe.hset(keys.workers(), self.worker_id, json.dumps(beat))
            await pipe.execute()

    async def _refresh_leased(self) -> None:
        """Move the lapse deadline of every session with work open (few, next to the leases held)."""
        watched = [s for s in self._watched if s in self.leases.held]
        expiry = self._expiry_ms()
        for start in range(0, len(watched), SLICE):
            await self.redis.zadd(keys.leased(), dict.fromkeys(watched[start:start + SLICE], expiry), xx=True)

    async def _release_idle(self) -> None:
        """A lease is kept only while the session has a cached agent or work in its lane."""
        events = self._events
        assert events is not None

        def is_idle(s: str) -> bool:
            return s not in self._acquiring and s not in self.ingress and not events.in_use(s)

        for part in self.leases.held.parts():  # a part at a time: a worker may hold many
            names = [lease.name for lease in part]
            for start in range(0, len(names), SLICE):
                if idle := [s for s in names[start:start + SLICE] if is_idle(s)]:
                    await self.leases.release_many(idle)
                    async with self.redis.pipeline(transaction=False) as pipe:
                        pipe.zrem(keys.leased(), *idle)
                        pipe.srem(keys.worker_sessions(self.worker_id), *idle)
                        await pipe.execute()
                    self._watched.difference_update(idle)
                    self._unwatch_due.difference_update(idle)
            await asyncio.sleep(0)

    async def _reclaim_own(self) -> None:
        """Entries delivered to this worker but never handled — a blocking read answered while the
        process was paused and then lost with its connection — are handled now, once idle a TTL."""
        _next, claimed, *_ = await self.redis.xautoclaim(self._inbox, keys.GROUP, self.worker_id,
                                                         min_idle_time=int(self.ttl_s * 1000), count=100)
        for entry_id, fields in claimed:
            log.info("handling an inbox entry delivered earlier but never handled")
            await self._handle(self._inbox, entry_id, fields, again=True)

    async def _claim_from_the_dead(self) -> None:
        """Take over what dead workers left in their inboxes: entries they read but never
        acknowledged (XAUTOCLAIM, once idle for a TTL) and entries they never got to read.
        Their sessions are adopted through their lapsed leases (`scan_lapsed`)."""
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
                log.info("re-routing a message forwarded to dead worker %s", worker)
                await self._handle(inbox, entry_id, fields, again=True)
            if entries or (await self.redis.xpending(inbox, keys.GROUP)).get("pending"):
                continue  # the rest once they have been idle for a TTL
            async with self.redis.pipeline(transaction=False) as pipe:  # gone, and nothing left behind
                pipe.delete(keys.worker_sessions(worker))
                pipe.hdel(keys.workers(), worker)
                await pipe.execute()
