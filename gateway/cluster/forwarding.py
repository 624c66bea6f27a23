"""Messages between workers: a message for a session another worker owns goes to that owner's
inbox stream (and, for a command, its result comes back on a reply list); each worker consumes its
own inbox, and claims what dead workers left in theirs.

Invariant: an inbox entry is acknowledged (and deleted) only once it was handed to the core, or
found malformed — one that could not be taken now stays pending and is handled again once it has
been idle for a TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.exceptions import RedisError, ResponseError

from agent_cache import keys
from agent_cache.leases import AnyRedis
from agent_cache.tasks import cancel_and_wait
from gateway.cluster.relay import RelayOutlet, RelayPublisher
from gateway.core.cancellation import ToolReason
from gateway.core.cluster import ClusterEvents, ClusterUnavailable
from gateway.core.messages import InboundMessage
from gateway.core.outage import OutageLog
from gateway.core.ports import Outcome, Outlet, Submitted

log = logging.getLogger(__name__)

REPLY_WAIT_S = 10.0
READ_COUNT = 100  # inbox entries read or claimed per call
# Inbox entries handed over and not yet handled, at most: each holds a Redis connection from the
# pool (128) now and then, and a store write; the rest wait in Redis, where a takeover finds them.
IN_FLIGHT = 64
CLOSE_WAIT_S = 5.0  # a stop's wait for the deliveries it cancelled
OWNER_GONE = "The worker that had this conversation is gone; it is being taken over. Please try again."
REPLY_TTL_S = 60  # a reply nobody picked up (the forwarder gave up waiting) goes
ASK_WAIT_S = 2.0  # a console's question to another worker: answered in milliseconds, or left out
# The longest a single blocking call waits for an answer. Far below any socket timeout a client
# may set (5 s is usual), so an idle wait never looks like a dead connection; and a stop, or a
# Redis that went away and came back, is noticed within it.
WAIT_SLICE_S = 1.0
MIN_BLOCK_S = 0.01  # BLPOP's timeout 0 means "forever": the last slice is never shorter than this
RETRY_PAUSE_S = 0.1  # between attempts while Redis is unreachable during a wait


# KEYS: the owner's alive key, its inbox (one hash tag).  ARGV: the entry, "1" if only a live owner
# may have it.  Returns the entry's id, or nil (the owner is not alive, and only a live one would do).
_PUT = """
if ARGV[2] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('XADD', KEYS[2], '*', 'data', ARGV[1])
"""


@dataclass(frozen=True, slots=True)
class Answer:
    """What the owner made of a forwarded message, and the run it started (if it did)."""

    result: Submitted
    token: str | None = None
    by: str | None = None  # the worker that took it: the owner, or one that claimed a dead owner's inbox


def pool_of_its_own(redis: AnyRedis) -> AnyRedis:
    """A client like `redis` with a connection pool of its own (a Redis Cluster client: `redis`
    itself). For the waits for an owner's answer: each holds a connection for seconds, and
    hundreds at once (an owner falling behind) would take every connection of a shared pool, and
    the lease renewals and heartbeats queued behind them would fail: leases lost under load."""
    pool = redis.connection_pool if isinstance(redis, Redis) else None
    if not isinstance(pool, ConnectionPool):
        return redis
    kind, size = pool.connection_class, pool.max_connections
    clone = (BlockingConnectionPool(connection_class=kind, max_connections=size, timeout=pool.timeout,
                                    **pool.connection_kwargs)
             if isinstance(pool, BlockingConnectionPool)
             else ConnectionPool(connection_class=kind, max_connections=size, **pool.connection_kwargs))
    return Redis.from_pool(clone)


class Forwarder:
    """The sending side: an entry in the owner's inbox; with a reply wanted, the wait for it.
    Invariant: the waits (BLPOP) run on a pool of their own, never on the one leases use."""

    def __init__(self, redis: AnyRedis, worker_id: str) -> None:
        self.redis = redis
        self.waits = pool_of_its_own(redis)
        self.worker_id = worker_id
        self._closing = False
        self._put = redis.register_script(_PUT)

    async def forward(self, owner: str, msg: InboundMessage, session: str, *, hops: int,
                      want_reply: bool, relay: str | None = None) -> Answer | None:
        """Hand a message to its owner's inbox; with `want_reply`, wait for what the owner made of it
        (None: no answer in time). `relay`: the owner relays the turn's events to this worker
        under that id. Raises ClusterUnavailable."""
        request = uuid.uuid4().hex if want_reply else ""
        entry = {"msg": msg.to_dict(), "session": session, "hops": hops + 1, "reply": request,
                 "from": self.worker_id, "relay": relay,
                 # A relayed message whose client was told to retry must not run later as well.
                 "until": time.time() + REPLY_WAIT_S if relay else None}
        inbox = keys.worker_inbox(owner)
        try:
            # A relayed message goes only to a live owner, checked in the same step: put in a dead
            # one's inbox and taken out again, it could be claimed in between and run while its
            # client is told to retry. (Others are claimed from a dead inbox and answered.)
            entry_id = await self._put(keys=[keys.worker_alive(owner), inbox],
                                       args=[json.dumps(entry, ensure_ascii=False), "1" if relay else "0"])
            if entry_id is None:  # its owner is gone: taken over within a TTL; no waiting on it
                return Answer(Submitted(Outcome.UNAVAILABLE, OWNER_GONE, retry_after_s=1.0))
            if not want_reply:
                return None
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        sent = [entry_id]

        async def resend() -> None:
            """After Redis failed mid-wait: the entry again if Redis lost it unanswered (it came
            back empty). Not for a relayed message: its client is told to retry instead, since a
            second copy the owner had taken already would answer it as a duplicate, not a turn."""
            if relay is None and await self._lost(inbox, sent[0], request):
                log.warning("Redis lost a message forwarded to %s before it was answered; forwarding it again",
                            owner)
                sent[0] = await self.redis.xadd(inbox, {"data": json.dumps(entry, ensure_ascii=False)})

        result = await self._wait(request, REPLY_WAIT_S, resend)
        if result is None:
            return None
        return Answer(Submitted(Outcome(result["outcome"]), result["detail"],
                                retry_after_s=result.get("retry_after_s")), result.get("token"), result.get("by"))

    def close(self) -> None:
        """Stopping: every wait ends (with no answer) within a slice, and no new one waits."""
        self._closing = True

    async def aclose(self) -> None:
        """After the waits have ended: the waits' own connections closed."""
        if self.waits is not self.redis:
            await self.waits.aclose()

    async def _lost(self, inbox: str, entry_id: str, request: str) -> bool:
        """Is the entry gone from the inbox with no answer left for it? The owner answers before it
        deletes the entry, so an entry found gone first and no answer found after means that
        Redis lost both (or the owner had nothing to say, and then hearing it twice is harmless)."""
        kept = await self.redis.xrange(inbox, min=entry_id, max=entry_id)
        return not kept and not await self.redis.exists(keys.forward_reply(request))

    async def _wait(self, request: str, wait_s: float,
                    after_failure: Callable[[], Awaitable[None]] | None = None) -> Any:
        """The answer pushed for `request`, or None if none came within `wait_s` (or this worker is
        stopping). Blocks a slice at a time (`WAIT_SLICE_S`); a Redis that fails meanwhile (it
        restarts) is tried again until the wait is over, then `after_failure` runs once it answers.
        Raises ClusterUnavailable only if Redis never answered again within the wait."""
        key = keys.forward_reply(request)
        deadline = time.monotonic() + wait_s
        failed: BaseException | None = None
        while not self._closing and (left := deadline - time.monotonic()) > 0:
            try:
                if failed is not None and after_failure is not None:
                    await after_failure()
                failed = None
                got = await self.waits.blpop([key], timeout=max(MIN_BLOCK_S, min(WAIT_SLICE_S, left)))
            except (RedisError, OSError) as exc:
                failed = exc
                await asyncio.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))
                continue
            if got:
                return json.loads(got[1])
        if failed is not None and not self._closing:
            raise ClusterUnavailable(f"Redis failed: {type(failed).__name__}")
        # One last look: an answer pushed while this process could not wait (it was paused past
        # its last slice) is there, and a turn it started must not be told "no answer".
        with contextlib.suppress(RedisError, OSError):
            if not self._closing and (late := await self.redis.lpop(key)) is not None:
                return json.loads(cast("str", late))
        return None

    async def cancel(self, owner: str, session: str, token: str, reason: ToolReason) -> None:
        """Ask `owner` to cancel its run `token` of `session` for `reason` (a relayed turn whose
        client went away). Best effort: an owner that is gone has nothing left to cancel."""
        entry = {"cancel": token, "session": session, "kind": reason.kind, "text": reason.text}
        with contextlib.suppress(RedisError, OSError):
            await self.redis.xadd(keys.worker_inbox(owner), {"data": json.dumps(entry, ensure_ascii=False)})

    async def ask(self, worker: str, question: dict[str, Any], *, wait_s: float = ASK_WAIT_S) -> Any:
        """A question for another worker's core (its sessions, a stop); its answer, or None if it
        gave none in time. Raises ClusterUnavailable."""
        request = uuid.uuid4().hex
        try:
            await self.redis.xadd(keys.worker_inbox(worker),
                                  {"data": json.dumps({**question, "reply": request}, ensure_ascii=False)})
        except (RedisError, OSError) as exc:
            raise ClusterUnavailable(f"Redis failed: {type(exc).__name__}") from None
        return await self._wait(request, wait_s)

    async def answer(self, request: str, value: Any) -> None:
        key = keys.forward_reply(request)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lpush(key, json.dumps(value, ensure_ascii=False))
            pipe.expire(key, REPLY_TTL_S)
            await pipe.execute()

    async def reply(self, request: str, result: Submitted) -> None:
        """What the owner made of a forwarded message, for the worker waiting in `forward`."""
        key = keys.forward_reply(request)
        token = result.run.token if result.run is not None else None
        answer = {"outcome": result.outcome.value, "detail": result.detail, "token": token,
                  "retry_after_s": result.retry_after_s, "by": self.worker_id}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lpush(key, json.dumps(answer, ensure_ascii=False))
            pipe.expire(key, REPLY_TTL_S)
            await pipe.execute()


def _parse(entry_id: str, fields: dict[str, str]) -> dict[str, Any] | None:
    """An inbox entry's content; None if it was deleted meanwhile (it comes back empty) or is malformed."""
    if not fields:
        return None
    try:
        entry = json.loads(fields["data"])
    except (ValueError, KeyError, TypeError):
        entry = None
    if not isinstance(entry, dict):
        log.error("dropping a malformed inbox entry %s", entry_id)
        return None
    return entry


def _lane(entry: dict[str, Any] | None) -> str | None:
    """What an entry is ordered behind: its session's earlier entries (a message, a relayed
    turn's cancel). A console's question is answered at once, behind nothing."""
    if entry is None or "ask" in entry:
        return None
    session = entry.get("session")
    return session if isinstance(session, str) else None


class SessionOrder:
    """Work run concurrently across lanes (sessions), one piece at a time and in the order started
    within a lane. At most `limit` pieces are started and not finished: the caller waits for
    `room()` before it takes more.

    Invariant: `_last[lane]` is the lane's latest unfinished piece; each piece starts only once the
    piece before it in its lane has finished, however it finished."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._tasks: set[asyncio.Task[None]] = set()
        self._last: dict[Hashable, asyncio.Task[None]] = {}
        self._freed = asyncio.Event()

    async def room(self) -> None:
        while len(self._tasks) >= self._limit:
            self._freed.clear()
            await self._freed.wait()

    def free(self, most: int) -> int:
        """How many pieces may be taken now, at most `most` (at least one: call after `room()`)."""
        return max(1, min(most, self._limit - len(self._tasks)))

    def start(self, lane: Hashable | None, work: Callable[[], Awaitable[None]]) -> None:
        before = self._last.get(lane) if lane is not None else None
        task = asyncio.get_running_loop().create_task(self._after(before, work))
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        if lane is not None:
            self._last[lane] = task
            task.add_done_callback(functools.partial(self._forget, lane))

    async def close(self) -> None:
        """Cancel what is under way and wait, at most CLOSE_WAIT_S, for it to end: a stop never
        hangs on a delivery that does not end when cancelled (its entry stays pending)."""
        if late := await cancel_and_wait(self._tasks, give_up_s=CLOSE_WAIT_S):
            log.warning("%d inbox deliveries did not end when cancelled; their entries stay pending", len(late))

    @staticmethod
    async def _after(before: asyncio.Task[None] | None, work: Callable[[], Awaitable[None]]) -> None:
        if before is not None:
            await asyncio.wait({before})
        try:
            await work()
        except Exception:
            log.exception("handling an inbox entry failed; it stays pending")

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._freed.set()

    def _forget(self, lane: Hashable, task: asyncio.Task[None]) -> None:
        if self._last.get(lane) is task:
            del self._last[lane]


class Inbox:
    """The receiving side: this worker's inbox, consumed (what an earlier incarnation read and never
    acknowledged first), and the entries nobody handled — ours or a dead worker's — claimed."""

    def __init__(self, redis: AnyRedis, worker_id: str, *, ttl_s: float, events: ClusterEvents,
                 forwarder: Forwarder, relays: RelayPublisher) -> None:
        self.redis = redis
        self.worker_id = worker_id
        self.ttl_s = ttl_s
        self.events = events
        self.forwarder = forwarder
        self.relays = relays
        self.stream = keys.worker_inbox(worker_id)
        self._outage = OutageLog(log, "inbox")
        self._order = SessionOrder(IN_FLIGHT)

    async def create(self) -> None:
        """The stream and its consumer group, unless they exist."""
        with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists already
            await self.redis.xgroup_create(self.stream, keys.GROUP, id="0", mkstream=True)

    async def _recreate(self) -> None:
        try:
            await self.create()
        except (RedisError, OSError) as exc:
            self._outage.failed(type(exc).__name__, f"cannot re-create the inbox: {type(exc).__name__}")
            await asyncio.sleep(1.0)
            return
        log.error("inbox: Redis had lost this worker's inbox group (restarted empty?); made it again")

    async def consume(self) -> None:
        """Read the inbox and hand its entries over: concurrently across sessions, so that one
        session's slow acceptance (a store far away, a starved process) holds up no other; one at a
        time and in the order read within a session, so its messages are accepted in the order they
        were sent. What is not handed over yet stays in Redis: at most `IN_FLIGHT` entries are read
        and not yet handled. Runs until cancelled; then `close()` ends the deliveries under way."""
        await self._read(self._order)

    async def close(self) -> None:
        """Once reading has stopped: the deliveries under way are cancelled, and their entries stay
        pending, to be handled again. (Not in `consume`'s `finally`: a stop that re-delivers its
        cancel would cut that wait short.)"""
        await self._order.close()

    async def _read(self, order: SessionOrder) -> None:
        # First what an earlier incarnation read and never acknowledged (the pending list, read on
        # from the last entry seen: one handed over and not yet acknowledged is never read twice),
        # then new entries (">").
        cursor: str | None = "0"
        while True:
            await order.room()
            try:
                batch = await self.redis.xreadgroup(keys.GROUP, self.worker_id, {self.stream: cursor or ">"},
                                                    count=order.free(READ_COUNT), block=None if cursor else 1000)
            except ResponseError as exc:
                if "NOGROUP" in str(exc):  # Redis lost it (restarted empty): made again, not assumed
                    await self._recreate()
                    continue
                self._outage.failed(type(exc).__name__, f"reading failed: {exc}")
                await asyncio.sleep(1.0)
                continue
            except (RedisError, OSError) as exc:
                self._outage.failed(type(exc).__name__, f"reading failed: {type(exc).__name__}")
                await asyncio.sleep(1.0)
                continue
            self._outage.recovered("reading again")
            streams = cast("list[tuple[str, list[tuple[str, dict[str, str]]]]]", batch or [])
            entries = [e for _stream, part in streams for e in part]
            if cursor is not None:
                cursor = entries[-1][0] if entries else None
            for entry_id, fields in entries:
                entry = _parse(entry_id, fields)
                order.start(_lane(entry), functools.partial(self._handle, self.stream, entry_id, entry))

    async def claim_unhandled(self) -> None:
        """Entries nobody handled: this worker's own, then dead workers'."""
        await self.reclaim_own()
        await self.claim_from_the_dead()

    async def reclaim_own(self) -> None:
        """Entries delivered to this worker but never handled — a blocking read answered while the
        process was paused and then lost with its connection — are handled now, once idle a TTL."""
        _next, claimed, *_ = await self.redis.xautoclaim(self.stream, keys.GROUP, self.worker_id,
                                                         min_idle_time=int(self.ttl_s * 1000), count=READ_COUNT)
        for entry_id, fields in claimed:
            log.info("handling an inbox entry delivered earlier but never handled")
            await self._handle(self.stream, entry_id, _parse(entry_id, fields), again=True)

    async def claim_from_the_dead(self) -> None:
        """Take over what dead workers left in their inboxes: entries they read but never
        acknowledged (XAUTOCLAIM, once idle for a TTL) and entries they never got to read.
        Their sessions are adopted through their lapsed leases (see `gateway.cluster.adoption`)."""
        workers = cast("list[str]", await self.redis.hkeys(keys.workers()))  # decode_responses=True
        for worker in workers:
            if worker != self.worker_id and not await self.redis.exists(keys.worker_alive(worker)):
                await self._claim_inbox_of(worker)

    async def _claim_inbox_of(self, worker: str) -> None:
        inbox = keys.worker_inbox(worker)
        try:
            _next, claimed, *_ = await self.redis.xautoclaim(
                inbox, keys.GROUP, self.worker_id, min_idle_time=int(self.ttl_s * 1000), count=READ_COUNT)
            unread = await self.redis.xreadgroup(keys.GROUP, self.worker_id, {inbox: ">"}, count=READ_COUNT)
        except ResponseError:  # no such stream or group: it never got anything
            await self.redis.hdel(keys.workers(), worker)
            return
        entries = list(claimed) + [e for _s, batch in cast("list[Any]", unread or []) for e in batch]
        for entry_id, fields in entries:
            log.info("re-routing a message forwarded to dead worker %s", worker)
            await self._handle(inbox, entry_id, _parse(entry_id, fields), again=True)
        if entries or (await self.redis.xpending(inbox, keys.GROUP)).get("pending"):
            return  # the rest once they have been idle for a TTL
        async with self.redis.pipeline(transaction=False) as pipe:  # gone, and nothing left behind
            pipe.delete(keys.worker_sessions(worker))
            pipe.hdel(keys.workers(), worker)
            await pipe.execute()

    async def _handle(self, stream: str, entry_id: str, entry: dict[str, Any] | None, *, again: bool = False) -> None:
        """Hand an entry to the core, then acknowledge it — unless it must stay pending. `again`:
        handled before, a TTL ago or more (ownership has settled since): its hop count starts
        over, so a message that bounced during a takeover is not refused for it. None: deleted
        meanwhile (it comes back empty) or malformed: just acknowledged."""
        if entry is not None and not await self._deliver(entry_id, entry, again=again):
            return
        with contextlib.suppress(RedisError, OSError):
            # Deleted too: a stream keeps acknowledged entries, and the inbox would grow forever.
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(stream, keys.GROUP, entry_id)
                pipe.xdel(stream, entry_id)
                await pipe.execute()

    def _answer(self, entry: dict[str, Any]) -> Any:
        if entry["ask"] == "sessions":
            return [dataclasses.asdict(s) for s in self.events.snapshot()]
        if entry["ask"] == "stop":
            return self.events.stop_next(entry["session"], ToolReason(entry["kind"], entry["text"]))
        return None

    def _via(self, entry: dict[str, Any]) -> Callable[[Outlet], Outlet] | None:
        """For a relayed message: its outlet, publishing to the worker its client is connected to."""
        relay, sender = entry.get("relay"), entry.get("from")
        if not relay or not sender:
            return None
        return lambda outlet: RelayOutlet(outlet, self.relays, sender, relay)

    async def _deliver(self, entry_id: str, entry: dict[str, Any], *, again: bool) -> bool:
        """Deliver one entry (and its reply, if one is wanted); False if it stays pending."""
        try:
            if "cancel" in entry:  # a relayed turn's client went away: stop that run, nothing else
                self.events.cancel_run(entry["session"], entry["cancel"], ToolReason(entry["kind"], entry["text"]))
                return True
            if "ask" in entry:  # a console on another worker
                await self.forwarder.answer(entry["reply"], self._answer(entry))
                return True
            if entry.get("until") is not None and time.time() > entry["until"]:
                log.info("dropping a relayed message whose client was already told to retry")
                return True
            msg = InboundMessage.from_dict(entry["msg"])
            hops = 1 if again else int(entry["hops"])  # (1: still a forwarded message, the store de-duplicates)
            result = await self.events.deliver(msg, entry["session"], hops, via=self._via(entry))
            if result is not None and result.outcome is Outcome.UNAVAILABLE and not entry.get("reply"):
                # Acknowledged by the worker that forwarded it, so it must not be lost here:
                # it stays pending and is handled again once idle for a TTL.
                log.warning("a forwarded message could not be taken now; it stays in the inbox")
                return False
            if result is not None and entry.get("reply"):
                await self.forwarder.reply(entry["reply"], result)
        except (ValueError, KeyError, TypeError):
            log.exception("dropping a malformed inbox entry %s", entry_id)
        except (RedisError, OSError) as exc:
            log.warning("handling a forwarded message failed (%s); it stays pending", type(exc).__name__)
            return False
        return True
