"""Cross-process session leases in Redis, with fencing numbers.

A lease says which worker *incarnation* owns a session: its token is `<worker id>/<incarnation>`,
new at every process start, so a restarted worker never mistakes its dead predecessor's leases for
its own. It takes them over instead — at once, since its own restart proves the predecessor gone —
through the same path as any acquisition, which hands out a new, larger fencing number.

Acquire, renew and release are Lua compare-and-set scripts; the TTL is kept by the Redis server.
Every acquisition takes a fencing number that only grows (never below the server's clock in ms),
and the shared stores apply a session write only while the writer's lease carries the writer's
fence: a worker paused past its TTL can neither write nor — its local check failing first — speak.

Locally a lease counts as valid until `renewed + ttl - margin`, measured from when the renewal
was *sent*, on CLOCK_BOOTTIME (Linux), which keeps running while the host is suspended — as the
Redis TTL does. Renewals run in slices that yield to the event loop, so a worker holding 100,000
leases never blocks for long; concurrent acquisitions share one pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar, overload

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

from agent_cache.tasks import cancel_and_wait

log = logging.getLogger(__name__)

AnyRedis = Redis | RedisCluster  # a single Redis, or Redis Cluster: every script here is one slot

# KEYS: lease, fence counter[, listing][, sentinel].  ARGV: token, worker id, ttl ms, name, lost
# (1/0), the sentinel's value ('' for none: no sentinel key), listed (1/0: a listing key is given).
# Returns {-1} when the sentinel is not the value given (Redis lost its data since the caller
# joined: a holder it lost the lease of may still be at work, so nothing is taken),
# {1, fence, replaced token or '', kept (1/0)} when the lease is ours now (and the name is
# in the listing set, if one is given), {0, holder's worker id, pttl} when another worker holds
# it. Still ours (same token) and not `lost`: extended, same fence, kept = 1 — nobody held it in
# between. Still ours but `lost` (we reported it lost: its turns were stopped and left for a new
# owner): a new fence, as a takeover — the old fence's writes are refused, what was left open is
# recovered. Held by an earlier incarnation of this worker id (same id, other token): taken over.
# Otherwise free: a new fence.
_ACQUIRE = """
if ARGV[6] ~= '' and redis.call('GET', KEYS[#KEYS]) ~= ARGV[6] then
  return {-1}
end
local cur = redis.call('HMGET', KEYS[1], 'token', 'worker', 'fence')
if cur[1] and cur[1] ~= ARGV[1] and cur[2] ~= ARGV[2] then
  return {0, cur[2], redis.call('PTTL', KEYS[1])}
end
if ARGV[7] == '1' then
  redis.call('SADD', KEYS[3], ARGV[4])
end
if cur[1] == ARGV[1] and ARGV[5] ~= '1' then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, tonumber(cur[3]), '', 1}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local f = redis.call('INCR', KEYS[2])
if f < now_ms then
  f = now_ms
  redis.call('SET', KEYS[2], f)
end
-- The counter only has to outlive the lease: after it expires the next fence starts from the
-- server clock, which has moved on by more than the lease TTL since this one.
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'worker', ARGV[2], 'fence', f)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if cur[1] == ARGV[1] then
  return {1, f, '', 0}
end
return {1, f, cur[1] or '', 0}
"""

# KEYS: leases.  ARGV: token, ttl ms, the fence of each key in order, comma-separated.
# Returns a string with one character per key: '1' renewed, '0' lost. (One string instead of
# 100 arguments and 100 replies: at 100,000 leases a round is mostly client-side encoding.)
_RENEW = """
local out = {}
local i = 0
for fence in string.gmatch(ARGV[3], '[^,]+') do
  i = i + 1
  local cur = redis.call('HMGET', KEYS[i], 'token', 'fence')
  if cur[1] == ARGV[1] and cur[2] == fence then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    out[i] = '1'
  else
    out[i] = '0'
  end
end
return table.concat(out)
"""

# KEYS: lease.  ARGV: token, fence.  Returns 1 released, 0 not ours (any more).
_RELEASE = """
local cur = redis.call('HMGET', KEYS[1], 'token', 'fence')
if cur[1] == ARGV[1] and cur[2] == ARGV[2] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

PARTS = 256  # `Held` parts: a sweep copies one at a time (about 400 leases at 100,000 held)
RENEW_SLICE = 100  # leases per renewal call: small enough that encoding one never blocks for long
RENEW_WINDOW = 2  # renewal calls in flight at once: a round of 100,000 leases is 1,000 calls


def _clock() -> Callable[[], float]:
    """CLOCK_BOOTTIME where there is one: unlike CLOCK_MONOTONIC it runs on while the host sleeps."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is not None:
        try:
            time.clock_gettime(boottime)
            return lambda: time.clock_gettime(boottime)
        except OSError:
            pass
    return time.monotonic


now = _clock()


class Lease(NamedTuple):
    """A lease held. A tuple of plain values, so the garbage collector need not track 100,000 of them."""

    key: str  # the Redis key of the lease
    name: str  # session key or ingress name
    fence: int


_D = TypeVar("_D")


class Held(MutableMapping[str, Lease]):
    """The leases held, by name: a dict split in `PARTS` parts, so that a sweep over all of them
    (renewals, idle releases) copies one small part at a time instead of holding the event loop
    for a copy of 100,000 entries (about 4 ms on a busy core)."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[dict[str, Lease]] = [{} for _ in range(PARTS)]

    def parts(self) -> Iterator[list[Lease]]:
        """The leases, one part's snapshot at a time (a lease taken or dropped meanwhile may be missed)."""
        for part in self._parts:
            if part:
                yield list(part.values())

    def __getitem__(self, name: str) -> Lease:
        return self._parts[hash(name) % PARTS][name]

    @overload
    def get(self, name: str, default: None = None) -> Lease | None: ...
    @overload
    def get(self, name: str, default: Lease | _D) -> Lease | _D: ...
    def get(self, name: str, default: Lease | _D | None = None) -> Lease | _D | None:
        return self._parts[hash(name) % PARTS].get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._parts[hash(name) % PARTS]

    def __setitem__(self, name: str, lease: Lease) -> None:
        self._parts[hash(name) % PARTS][name] = lease

    def __delitem__(self, name: str) -> None:
        del self._parts[hash(name) % PARTS][name]

    @overload  # type: ignore[override]
    def pop(self, name: str, default: None = None) -> Lease | None: ...
    @overload
    def pop(self, name: str, default: Lease | _D) -> Lease | _D: ...
    def pop(self, name: str, default: Lease | _D | None = None) -> Lease | _D | None:
        """Like `dict.pop` with a default (None unless given): no KeyError."""
        return self._parts[hash(name) % PARTS].pop(name, default)

    def __iter__(self) -> Iterator[str]:
        for part in self._parts:
            yield from list(part)

    def __len__(self) -> int:
        return sum(map(len, self._parts))

    def clear(self) -> None:
        for part in self._parts:
            part.clear()


@dataclass(frozen=True, slots=True)
class Acquired:
    lease: Lease | None  # ours, or None if someone else holds it
    owner: str | None = None  # that someone (a worker id)
    ttl_ms: int = 0
    replaced: str | None = None  # the token of an earlier incarnation of ours it was taken from
    kept: bool = False  # it was ours all along (only our view of it had lapsed): nothing to recover


Queued = tuple[str, str, str, asyncio.Future[Acquired]]  # name, lease key, fence key, the caller's answer


class OnLost(Protocol):
    def __call__(self, name: str, lease: Lease, *, expired: bool) -> None:
        """`name` is no longer ours: `expired` by our own clock (so maybe still ours in Redis), or
        refused at renewal (someone else's now, or gone)."""


Call = tuple[list[str], list[Any]]  # the KEYS and ARGV of one EVALSHA
Send = Callable[[Any, str, list[Call]], Awaitable[list[Any]]]  # (client, sha, calls) -> a result per call


async def _send_pipelined(redis: Any, sha: str, calls: list[Call]) -> list[Any]:
    """One Redis: one call as it is (an error raised), several as one pipeline (errors in place)."""
    if len(calls) == 1:  # no pipeline to build
        keys, args = calls[0]
        return [await redis.evalsha(sha, len(keys), *keys, *args)]
    async with redis.pipeline(transaction=False) as pipe:
        for keys, args in calls:
            pipe.evalsha(sha, len(keys), *keys, *args)
        return list(await pipe.execute(raise_on_error=False))


async def _send_concurrently(redis: Any, sha: str, calls: list[Call]) -> list[Any]:
    """Redis Cluster: redis-py's cluster pipeline refuses scripts, so the calls go side by side
    (errors in place; if one was cancelled, the first failure is raised)."""
    results = list(await asyncio.gather(*(redis.evalsha(sha, len(keys), *keys, *args) for keys, args in calls),
                                        return_exceptions=True))
    if any(isinstance(r, BaseException) and not isinstance(r, Exception) for r in results):
        raise next(r for r in results if isinstance(r, BaseException))
    return results


class _Script:
    """A Lua script run by EVALSHA on one client: loaded at its first use, and loaded again once if
    Redis no longer knows it (restarted, or failed over to a replica that never saw it)."""

    def __init__(self, redis: AnyRedis, source: str, send: Send) -> None:
        self.redis = redis
        self.source = source
        self.send = send
        self.sha: str | None = None

    async def run(self, calls: list[Call]) -> list[Any]:
        """A result per call, in order (a failed call's exception in its place, for several calls)."""
        for attempt in range(2):
            if self.sha is None or attempt:
                self.sha = str(await self.redis.script_load(self.source))
            try:
                results = await self.send(self.redis, self.sha, calls)
            except NoScriptError:
                continue
            if not any(isinstance(r, NoScriptError) for r in results):
                return results
        raise RedisError("the Lua script could not be loaded")


def _renewed(results: list[Any]) -> list[int]:
    """The renew script's answers — a string of '1' (renewed) and '0' (lost) per call — as one flag
    per lease, in order. A failed call fails the whole slice."""
    flags: list[int] = []
    for r in results:
        if isinstance(r, BaseException):
            raise r
        flags += [int(x) for x in (r.decode() if isinstance(r, bytes) else r)]
    return flags


class DataLost(RedisError):
    """An acquisition refused because Redis no longer has the sentinel value the worker joined with
    (see `LeaseManager.guard`): it lost its data, and a lease lost with it may still be in use."""


def _won(result: Any) -> bool:
    """Did the acquire script make the lease ours? ({1, fence, replaced, kept} — else {0, holder, pttl})"""
    return not isinstance(result, Exception) and int(result[0]) == 1


def _ours(lease: Lease, result: Any) -> Acquired:
    return Acquired(lease, replaced=str(result[2]) or None, kept=int(result[3]) == 1)


def _theirs(result: Any) -> Acquired:
    return Acquired(None, str(result[1]), int(result[2]))


def _fail_all(batch: list[Queued], exc: BaseException) -> None:
    """Every acquisition of a batch that could not be sent fails with its error (a cancel: as a RedisError)."""
    for *_, fut in batch:
        if not fut.done():
            fut.set_exception(exc if isinstance(exc, Exception) else RedisError("cancelled"))


class LeaseManager:
    """Holds this incarnation's leases: acquires on demand (batched), renews all every TTL/3."""

    def __init__(self, redis: AnyRedis, worker_id: str, incarnation: str, *, ttl_s: float = 30.0,
                 on_lost: OnLost | None = None, listed_in: str | None = None) -> None:
        if "/" in worker_id:
            raise ValueError("a worker id must not contain '/'")
        self.redis = redis
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.token = f"{worker_id}/{incarnation}"
        self.ttl_s = ttl_s
        self.margin_s = min(2.0, ttl_s / 10)
        self.on_lost = on_lost
        self.listed_in = listed_in  # a set every acquired name is added to (by the acquisition itself)
        self.held = Held()
        self.renewed_at: dict[str, float] = {}  # name -> `now()` when its last renewal (or acquisition) was sent
        self._cluster = isinstance(redis, RedisCluster)
        send = _send_concurrently if self._cluster else _send_pipelined
        self._acquire_script = _Script(redis, _ACQUIRE, send)
        self._renew_script = _Script(redis, _RENEW, send)
        self._release_script = _Script(redis, _RELEASE, send)
        # One Redis: the acquire script lists what it acquires (one round trip). Redis Cluster: the
        # listing lives in another slot, so it follows, for the acquired names (`_list_acquired`).
        self._listing_keys = [listed_in] if listed_in is not None and not self._cluster else []
        # (sentinel key, the value joined with): every acquisition's script checks it, so none
        # succeeds in a Redis that lost its data before this worker has noticed (its caller then
        # holds off; see gateway.cluster.coordinator). One Redis only: in a Redis Cluster the
        # sentinel lives in another slot, and the caller checks it before acquiring instead.
        self.guard: tuple[str, str] | None = None
        self._queued: list[Queued] = []
        # Releases on the wire, per name: an acquisition of the same name waits for them, so a
        # release sent before it can never land after it and delete the lease it just extended.
        self._releasing: dict[str, asyncio.Task[None]] = {}
        self._confirming: dict[str, asyncio.Future[bool]] = {}  # one confirmation per lease at a time
        # Leases reported lost, with when (our clock): our next acquisition of one is a takeover,
        # never a continuation, even if Redis still has it under our token. Kept two TTLs: by then
        # Redis has let it go anyway. Read by `RedisLoss` too (what was lost just before a loss).
        self.lost_at: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._round: asyncio.Future[None] | None = None
        self.last_ok: float = now()  # when Redis last answered a call of ours
        self.failing = False  # the last call of ours failed (Redis unreachable): fail fast until one succeeds
        self.acquisitions = self.losses = 0

    @property
    def ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    def holds(self, name: str, fence: int | None = None) -> bool:
        """Do we still provably hold `name` (with this fencing number)? No I/O, no state change."""
        lease = self.held.get(name)
        if lease is None or (fence is not None and lease.fence != fence):
            return False
        return now() - self.renewed_at.get(name, -1e18) < self.ttl_s - self.margin_s

    def check_lease(self, name: str) -> bool:
        """State change: drop `name` (reporting it lost) if it can no longer be proven; True if held."""
        if self.holds(name):
            return True
        if name in self.held:
            self._lose(name, expired=True)  # e.g. we were paused past the TTL: stop acting on it now
        return False

    async def confirm(self, name: str, fence: int) -> bool:
        """Is `name` (with this fencing number) still ours? Without I/O while our clock proves it;
        else (e.g. right after a pause) renewed now, one call, shared by concurrent askers. False
        once it is not ours — dropped and reported lost — or cannot be proven (Redis down)."""
        if self.holds(name, fence):
            return True
        lease = self.held.get(name)
        if lease is None or lease.fence != fence:
            return False
        pending = self._confirming.get(name)
        if pending is None:
            pending = self._confirming[name] = asyncio.ensure_future(self._confirm(lease))
            pending.add_done_callback(lambda _f: self._confirming.pop(name, None))
        return await asyncio.shield(pending)

    async def _confirm(self, lease: Lease) -> bool:
        sent = now()
        try:
            ok = (await self._renew_slice([lease]))[0] == 1
        except (RedisError, OSError):
            self.failing = True
            return self.check_lease(lease.name)  # unproven and unreachable: past the TTL, it goes
        if self.held.get(lease.name) is not lease:
            return False
        if not ok:
            self._lose(lease.name, expired=False)
            return False
        self.renewed_at[lease.name] = sent
        return True

    # --- acquire --------------------------------------------------------------------------

    async def acquire(self, name: str, key: str, fence_key: str) -> Acquired:
        """Take `name` if it is free (or an earlier incarnation's). Acquisitions requested in the
        same event-loop turn go to Redis in a few short pipelines."""
        if (releasing := self._releasing.get(name)) is not None:
            await asyncio.wait({releasing})
        fut: asyncio.Future[Acquired] = asyncio.get_running_loop().create_future()
        self._queued.append((name, key, fence_key, fut))
        if len(self._queued) == 1:
            asyncio.get_running_loop().call_soon(self._flush_acquisitions)
        return await fut

    def _flush_acquisitions(self) -> None:
        batch, self._queued = self._queued, []
        loop = asyncio.get_running_loop()
        for start in range(0, len(batch), RENEW_SLICE):  # a burst goes as several short pipelines
            task = loop.create_task(self._acquire_batch(batch[start:start + RENEW_SLICE]))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _acquire_batch(self, batch: list[Queued]) -> None:
        sent = now()
        guard = self.guard if not self._cluster else None
        guard_keys, guard_value = ([guard[0]], guard[1]) if guard is not None else ([], "")
        listed = "1" if self._listing_keys else "0"
        try:
            results = await self._acquire_script.run([
                ([key, fence_key, *self._listing_keys, *guard_keys],
                 [self.token, self.worker_id, self.ttl_ms, name, "1" if name in self.lost_at else "0",
                  guard_value, listed])
                for name, key, fence_key, _ in batch])
        except BaseException as exc:
            self.failing = isinstance(exc, (RedisError, OSError)) or self.failing
            _fail_all(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.last_ok, self.failing = now(), False
        listing = await self._list_acquired(batch, results)
        for (name, key, _, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                self._settle(fut, name, key, result, sent, listing)

    async def _list_acquired(self, batch: list[Queued], results: list[Any]) -> Exception | None:
        """Redis Cluster: add the names just acquired to the listing set (one Redis: the script did).
        The error if that failed."""
        if self.listed_in is None or self._listing_keys:
            return None
        acquired = [name for (name, *_), result in zip(batch, results, strict=True) if _won(result)]
        if not acquired:
            return None
        try:
            await self.redis.sadd(self.listed_in, *acquired)
        except (RedisError, OSError) as exc:
            return exc
        return None

    def _settle(self, fut: asyncio.Future[Acquired], name: str, key: str, result: Any, sent: float,
                listing: Exception | None) -> None:
        """Answer one acquisition from the script's result: failed, someone else's, or ours — held
        from now on, even when its listing failed (then the caller is told, and may retry)."""
        if isinstance(result, Exception):
            fut.set_exception(result)
        elif int(result[0]) == -1:
            fut.set_exception(DataLost("Redis lost its data since this worker joined (the sentinel changed)"))
        elif not _won(result):
            fut.set_result(_theirs(result))
        else:
            lease = self._hold(name, key, int(result[1]), sent)
            if listing is not None:
                fut.set_exception(listing)
            else:
                fut.set_result(_ours(lease, result))

    def _hold(self, name: str, key: str, fence: int, sent: float) -> Lease:
        if (old := self.held.get(name)) is not None and old.fence != fence:
            # It lapsed in Redis while we still held it here (a slow renewal): the turns acting on
            # the old fence are zombies now; report it lost before it is reused.
            self._lose(name, expired=False)
        if name not in self.held:
            self.acquisitions += 1
        self.lost_at.pop(name, None)
        lease = self.held[name] = Lease(key, name, fence)
        self.renewed_at[name] = sent
        return lease

    # --- release --------------------------------------------------------------------------

    async def release(self, name: str) -> None:
        """Give `name` up (if Redis still has it under our token and fence)."""
        await self.release_many([name])

    async def release_many(self, names: list[str]) -> None:
        """Give several up in one round trip."""
        leases = [lease for name in names if (lease := self.held.pop(name, None)) is not None]
        for name in names:
            self.renewed_at.pop(name, None)
        if leases:
            await self._releasing_now(leases)

    async def release_lost(self, lease: Lease) -> None:
        """Release a lease already dropped locally, if Redis still has it under our token and fence."""
        await self._releasing_now([lease])

    async def _releasing_now(self, leases: list[Lease]) -> None:
        async def release() -> None:
            with contextlib.suppress(RedisError, OSError):
                await self._release_script.run([([lease.key], [self.token, lease.fence]) for lease in leases])

        task = asyncio.get_running_loop().create_task(release())
        for lease in leases:
            self._releasing[lease.name] = task

        def done(_task: object) -> None:
            for lease in leases:
                if self._releasing.get(lease.name) is task:
                    del self._releasing[lease.name]

        task.add_done_callback(done)
        await asyncio.shield(task)

    # --- renew ----------------------------------------------------------------------------

    async def renew_all(self) -> None:
        """Renew every held lease, a slice per call with a few calls in flight, paced over about a
        sixth of the TTL; report the ones that are gone. Encoding one slice (or copying one part of
        `held`) is the longest the event loop is held, however many leases there are. One round at
        a time: a call while a round runs waits for that round."""
        if self._round is None or self._round.done():
            self._round = asyncio.ensure_future(self._renew_round())
        await asyncio.shield(self._round)

    async def _renew_round(self) -> None:
        if self.lost_at:
            cutoff = now() - 2 * self.ttl_s
            self.lost_at = {name: at for name, at in self.lost_at.items() if at > cutoff}
        count = len(self.held)
        if not count:  # nothing to renew: still find out whether Redis answers (`failing` clears)
            try:
                await self.redis.ping()
            except (RedisError, OSError):
                self.failing = True
                return
            self.last_ok, self.failing = now(), False
            return
        slices = self._slices()
        failures: list[BaseException] = []
        # Spread the round over about a sixth of the TTL (half the time to the next round): the
        # event loop stays free for messages in between, and the deadline keeps a wide margin.
        calls_per_worker = -(-count // (RENEW_SLICE * RENEW_WINDOW))
        pace = min(0.01, self.ttl_s / 6 / max(1, calls_per_worker))

        async def renew() -> None:  # RENEW_WINDOW of these take the slices in turn
            for part in slices:
                sent = now()
                try:
                    results = await self._renew_slice(part)
                except (RedisError, OSError) as exc:
                    failures.append(exc)
                    self.failing = True
                    continue
                self.last_ok, self.failing = now(), False
                for lease, ok in zip(part, results, strict=True):
                    if ok == 1:
                        if self.held.get(lease.name) is lease:
                            self.renewed_at[lease.name] = sent
                    elif self.held.get(lease.name) is lease:
                        self._lose(lease.name, expired=False)
                await asyncio.sleep(pace)  # the next slice later: other work runs between

        await asyncio.gather(*(renew() for _ in range(RENEW_WINDOW)))
        if failures:
            log.warning("lease renewal failed (%s); %d lease(s) at risk", type(failures[0]).__name__, count)
            for part in self.held.parts():
                for lease in part:
                    self.check_lease(lease.name)  # drops those past their TTL by our clock
                await asyncio.sleep(0)

    def _slices(self) -> Iterator[list[Lease]]:
        """The held leases in slices of `RENEW_SLICE`, built from one part of `held` at a time."""
        batch: list[Lease] = []
        for part in self.held.parts():
            batch += part
            while len(batch) >= RENEW_SLICE:
                yield batch[:RENEW_SLICE]
                del batch[:RENEW_SLICE]
        if batch:
            yield batch

    async def _renew_slice(self, part: list[Lease]) -> list[int]:
        """Renew a slice: a flag per lease, 1 renewed, 0 lost."""
        if self._cluster:  # every key may live on another node: one call each
            return _renewed(await self._renew_script.run(
                [([lease.key], [self.token, self.ttl_ms, lease.fence]) for lease in part]))
        keys = [lease.key for lease in part]
        fences = ",".join([str(lease.fence) for lease in part])
        return _renewed(await self._renew_script.run([(keys, [self.token, self.ttl_ms, fences])]))

    def drop(self, names: list[str], why: str) -> None:
        """Report `names` lost now, whatever Redis says (it lost its data: the leases there are gone
        or not ours to trust); the next acquisition of each is a takeover."""
        for name in names:
            self._lose(name, expired=False, why=why)

    def _lose(self, name: str, *, expired: bool, why: str | None = None) -> None:
        lease = self.held.pop(name, None)
        self.renewed_at.pop(name, None)
        if lease is None:
            return
        self.losses += 1
        self.lost_at[name] = now()
        log.warning("lease lost: %s (%s)", name,
                    why or ("not renewed in time" if expired else "refused at renewal"))
        if self.on_lost is not None:
            self.on_lost(name, lease, expired=expired)

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            await self.renew_all()

    async def stop(self, *, release: bool = True) -> None:
        await cancel_and_wait([task for task in (self._task, self._round) if task is not None])
        if release:
            for name in list(self.held):
                await self.release(name)
