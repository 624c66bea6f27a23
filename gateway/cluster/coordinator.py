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
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

from redis.exceptions import RedisError

from agent_cache import keys
from agent_cache.leases import AnyRedis, DataLost, Lease, LeaseManager
from agent_cache.leases import now as lease_clock
from agent_cache.tasks import cancel_and_wait, where
from gateway.cluster.adoption import Adopter
from gateway.cluster.forwarding import Forwarder, Inbox
from gateway.cluster.operators import ClusterConsole
from gateway.cluster.redis_loss import RedisLoss
from gateway.cluster.relay import RelayPublisher, RelayReader
from gateway.cluster.watchlist import SLICE, Watchlist
from gateway.core.cancellation import Run
from gateway.core.cluster import ClusterEvents, ClusterUnavailable, Route
from gateway.core.fencing import Fence
from gateway.core.messages import InboundMessage
from gateway.core.metrics import Metrics
from gateway.core.outage import OutageLog
from gateway.core.ports import UNAVAILABLE_RETRY_S, Health, Outcome, Outlet, Submitted

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0  # a stop's wait for its background tasks, each cancel re-delivered meanwhile


async def let_go_unrecovered(redis: AnyRedis, leases: LeaseManager, session: str, *, retry_s: float) -> None:
    """Give up a session just acquired whose recovery failed: listed as lapsed first (due after
    `retry_s`, so a scan adopts it again), then released. If Redis fails here, the listing may be
    missing but the lease lapses by itself and its previous owner's listing, if any, remains."""
    with contextlib.suppress(RedisError, OSError):
        due_ms = int((time.time() + retry_s) * 1000)
        await redis.zadd(keys.leased(), {session: due_ms})
    await leases.release(session)


async def periodically(period_s: float, chore: Callable[[], Awaitable[None]], outage: OutageLog) -> None:
    """`chore` every `period_s`, for as long as the worker runs; Redis failing is logged once per
    outage, anything else each time (never let housekeeping die quietly)."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await chore()
        except (RedisError, OSError, ClusterUnavailable) as exc:
            outage.failed(type(exc).__name__, f"failed: {exc or type(exc).__name__}")
            continue
        except Exception:
            log.exception("cluster chore %s crashed; retrying", getattr(chore, "__qualname__", chore))
            continue
        outage.recovered("working again")


def new_incarnation() -> str:
    """A fresh identity for this process: its start time and some randomness."""
    return f"{int(time.time()):x}-{secrets.token_hex(3)}"


class Cluster:
    """`Ownership` over Redis (see gateway.core.cluster): membership (heartbeat, housekeeping) and
    session ownership (leases, acquisitions, losses) here; the parts it is made of:
    `Watchlist` (sessions with work open, listed for adoption), `Forwarder` and `Inbox` (messages
    between workers), `Adopter` (taking over what others left), `RedisLoss` (Redis losing its
    data: noticed, and no session taken for a lease TTL after)."""

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
        self._acquiring: dict[str, asyncio.Future[Route]] = {}
        self.watchlist = Watchlist(redis, self.leases, ttl_s=ttl_s)
        self.forwarder = Forwarder(redis, worker_id)
        self.relays = RelayPublisher(redis)
        self.relayed = RelayReader(redis, worker_id, ttl_s=ttl_s, send_cancel=self.forwarder.cancel)
        self.console = ClusterConsole(redis, worker_id, self.forwarder)  # what operators see of the others
        self.adopter = Adopter(redis, self.leases, route=self.route, acquiring=self._acquiring, ttl_s=ttl_s)
        self._events: ClusterEvents | None = None  # the core's, from `start` (which makes the Inbox with them)
        self._tasks: list[asyncio.Task[None]] = []
        self._chores: set[asyncio.Task[None]] = set()
        self._housekeeping = OutageLog(log, "cluster housekeeping")
        self._claiming = OutageLog(log, "claiming inbox entries")
        self.ingress_names: set[str] = set()  # every ingress lease a leader here stands for
        self.loss = RedisLoss(redis, self.leases, ingress=self.ingress, ingress_names=self.ingress_names,
                              ttl_s=ttl_s)  # and its quarantine

    @property
    def worker_id(self) -> str:
        return self._worker_id

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, events: ClusterEvents) -> None:
        """Join: heartbeat, renewals, the inbox. Adoption starts with `adopt()`, once the rest of
        the daemon can take what it adopts."""
        self._events = events
        self.loss.inbox = inbox = Inbox(self.redis, self.worker_id, ttl_s=self.ttl_s, events=events,
                                    forwarder=self.forwarder, relays=self.relays)
        try:
            await inbox.create()
            await self._heartbeat()
            await self.loss.join()
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"cannot reach Redis ({type(exc).__name__})") from None
        self.leases.start()
        self.relays.start()
        loop = asyncio.get_running_loop()
        # Invariant: nothing delays the heartbeat but Redis itself (a worker late with it looks
        # dead, and the relays watching it are given up): entries nobody handled are claimed in a
        # loop of their own, since handling one may wait on the store for seconds.
        period = self.ttl_s / 3
        self._tasks = [loop.create_task(inbox.consume()),
                       loop.create_task(periodically(period, self._housekeep, self._housekeeping)),
                       loop.create_task(periodically(period, inbox.claim_unhandled, self._claiming)),
                       loop.create_task(self._expire_own(events)), loop.create_task(self.loss.watch()),
                       *await self.relayed.start()]
        log.info("cluster: worker %s, incarnation %s", self.worker_id, self.incarnation)

    async def adopt(self) -> None:
        """Take over what this worker's previous incarnation held (its restart proves it gone), then
        keep watching for lapsed leases anywhere."""
        try:
            await self.adopter.adopt_predecessor()
        except (RedisError, OSError, ClusterUnavailable) as exc:
            log.warning("could not take over the previous incarnation's sessions yet: %s", exc)
        self._tasks.append(asyncio.get_running_loop().create_task(self.adopter.watch_lapsed()))

    async def stop(self) -> None:
        """Leave: release every lease; sessions with work still open (turns this stop cut off) are
        marked lapsed, so the others adopt and resume them at once. Waits for other workers'
        answers end first (within a wait's slice)."""
        self.forwarder.close()
        if late := await cancel_and_wait([*self._tasks, *self._chores], give_up_s=STOP_WAIT_S):
            log.error("cluster: %d task(s) did not end when cancelled: %s", len(late), where(late))
        if self.loss.inbox is not None:
            await self.loss.inbox.close()
        self.relayed.close()
        await self.relays.stop()
        open_work, done = await self.watchlist.stop()
        held = list(self.leases.held)
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
        await self.forwarder.aclose()
        await self.redis.aclose()

    def health(self) -> Health:
        age = lease_clock() - self.leases.last_ok
        if age < self.ttl_s and self.loss.quarantined():
            return Health(True, f"worker {self.worker_id} ({self.incarnation}): {self.loss.refusal()}")
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
        # Invariant: no await between the look at `_acquiring` above and this entry, so that
        # concurrent callers share one acquisition (two would each recover the session: its
        # cut-off turn closed twice, resumed twice).
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
            await self.loss.fresh()
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        if self.loss.quarantined():
            return await self._owner_in_quarantine(session)
        losses = self.loss.losses
        try:
            got = await self.leases.acquire(session, keys.lease(session), keys.fence(session))
            if got.lease is None:
                return Route(owner=got.owner)
            self.metrics.lease_events.labels("acquired").inc()
        except DataLost:  # the acquisition's own check: Redis lost its data and we had not noticed
            await self.loss.lost()
            raise ClusterUnavailable(self.loss.refusal()) from None
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        if self.loss.losses != losses:  # taken from the Redis that was lost, or while noticing: not trusted
            self.leases.drop([session], "Redis lost its data while it was acquired")
            raise ClusterUnavailable(self.loss.refusal())
        if got.replaced:
            log.info("took %s over from %s (an earlier incarnation of this worker)", session, got.replaced,
                     extra={"session": session})
        fence = Fence(session, got.lease.fence)
        assert self._events is not None
        # A real takeover: close and resume what a previous owner left open. If the store cannot
        # say or take that now, the session is let go and listed as lapsed: holding it
        # unrecovered would leave its open messages open until it is released as idle, unlisted,
        # and never adopted again.
        if not got.kept and not await self._events.adopted(session):
            await let_go_unrecovered(self.redis, self.leases, session, retry_s=self.adopter.scan_interval_s)
            raise ClusterUnavailable("what this conversation's previous worker left open cannot be "
                                     "recovered right now (the store failed)")
        return Route(fence=fence)

    async def _owner_in_quarantine(self, session: str) -> Route:
        """No acquisition now; but a session another worker took since (after its own quarantine)
        is its, and a message for it is forwarded there as usual."""
        try:
            owner = cast("str | None", await self.redis.hget(keys.lease(session), "worker"))
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        if owner is not None and owner != self.worker_id:
            return Route(owner=owner)
        raise ClusterUnavailable(self.loss.refusal())

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
        that if this worker stops renewing, a live one adopts the turn (see `Watchlist`)."""
        await self.watchlist.watch(session)

    def unwatch(self, session: str) -> None:
        """`session` has no work open any more (see `Watchlist.unwatch`)."""
        self.watchlist.unwatch(session)

    async def forward(self, owner: str, msg: InboundMessage, session: str, *, hops: int,
                      want_reply: bool) -> Submitted | None:
        """Hand a message to its owner's inbox; with `want_reply`, wait for the command's result."""
        answer = await self.forwarder.forward(owner, msg, session, hops=hops, want_reply=want_reply)
        return answer.result if answer is not None else None

    async def relay(self, owner: str, msg: InboundMessage, session: str, *, hops: int, outlet: Outlet) -> Submitted:
        """The owner runs the turn; its events come back on this worker's relay stream and are
        played into `outlet`'s reply here. The local run stands for the owner's: a cancel of it
        (the client went away) is sent to the owner."""
        run = Run(session, tenant=msg.tenant)
        link = self.relayed.open(uuid.uuid4().hex, owner, msg, outlet, run)
        try:
            answer = await self.forwarder.forward(owner, msg, session, hops=hops, want_reply=True,
                                                  relay=link.relay_id)
        except BaseException:
            self.relayed.drop(link)
            raise
        if answer is None:
            self.relayed.drop(link)
            return Submitted(Outcome.UNAVAILABLE, "the worker running this conversation did not answer in time",
                             retry_after_s=UNAVAILABLE_RETRY_S)
        if answer.token is None:  # not a turn (refused, a duplicate, a command): nothing to play
            self.relayed.drop(link)
            return answer.result
        # The run is where the message was taken: its owner, or the worker that claimed it from a
        # dead owner's inbox. That worker's liveness is what the relay watches, and its inbox is
        # where a cancel from here goes.
        self.relayed.accepted(link, answer.token, by=answer.by or owner)
        return dataclasses.replace(answer.result, run=run)

    def _lost(self, name: str, lease: Lease, *, expired: bool) -> None:
        session = name
        self.metrics.lease_events.labels("lost").inc()
        if self.ingress.pop(session, None) is not None:  # ingress leases stop nothing
            return
        # Left listed (if it is) for whoever takes it; if we take it again, `watch` lists it anew.
        self.watchlist.forget([session])
        if self._events is not None:
            self._events.lease_lost(session)
        if expired:  # we gave it up by our clock: hand it on now rather than when Redis expires it
            self._chore(self._hand_on(session, lease))

    async def _hand_on(self, session: str, lease: Lease) -> None:
        """A lease we can no longer prove: release it (our fence only) and mark it lapsed, so a live
        worker — maybe this one — adopts the turn it was running right away."""
        self.watchlist.forget([session])
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

    # --- heartbeat, idle leases, dead workers ---------------------------------------------

    async def _housekeep(self) -> None:
        if not await self._heartbeat():
            await self.loss.lost()
        await self.watchlist.refresh()
        await self._release_idle()

    async def _expire_own(self, events: ClusterEvents) -> None:
        """Drop the lease of a session with a turn running the moment our clock can no longer prove
        it, not at the next renewal round (TTL/3 later, or later still while Redis hangs): its turn
        and its tools stop while the lease is still ours in Redis, before another worker can adopt
        it. A turn that has ended and is being recorded keeps its lease: its record is fenced, and
        showing its last words asks Redis first (a lease dropped here could not be asked for)."""
        while True:
            await asyncio.sleep(self.leases.margin_s / 3)
            for session in [s for s in self.watchlist.owned() if events.running(s)]:
                self.leases.check_lease(session)

    async def _heartbeat(self) -> bool:
        """Say we are alive; False if Redis has lost its data since we joined: the sentinel is not
        the one we joined with (gone, or set anew by a worker that noticed first)."""
        beat = {"seen_at": time.time(), "incarnation": self.incarnation, "sessions": len(self.leases.held),
                "ingress": self.ingress, **self.info}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(keys.worker_alive(self.worker_id), self.incarnation, px=int(self.ttl_s * 1000))
            pipe.hset(keys.workers(), self.worker_id, json.dumps(beat))
            pipe.get(keys.sentinel())
            *_, sentinel = await pipe.execute()
        return self.loss.matches(sentinel)

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
                    self.watchlist.forget(idle)
            await asyncio.sleep(0)
