"""Session leases against a real redis-server: incarnations, fences that only grow, releases that
cannot undo a newer acquisition, renewals in slices, and a clock that survives suspend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from agent_cache import keys
from agent_cache.leases import RENEW_SLICE, DataLost, Lease, LeaseManager, now
from agent_cache.tasks import cancel_and_wait
from gateway.cluster.coordinator import Cluster
from gateway.core.metrics import Metrics
from tests.support.cluster_events import Working
from tests.support.redis_server import RedisServer, RedisServerMissing


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, decode_responses=True, client_name="lease-test")
    yield client
    await client.aclose()


async def take(m: LeaseManager, session: str) -> Lease | None:
    return (await m.acquire(session, keys.lease(session), keys.fence(session))).lease


async def test_a_new_incarnation_takes_over_its_predecessors_leases_with_a_larger_fence(redis: Redis) -> None:
    old = LeaseManager(redis, "w1", "a", ttl_s=30)
    other = LeaseManager(redis, "w2", "a", ttl_s=30)
    first = await take(old, "s")
    assert first is not None
    refused = await other.acquire("s", keys.lease("s"), keys.fence("s"))
    assert refused.lease is None and refused.owner == "w1" and refused.ttl_ms > 25_000

    new = LeaseManager(redis, "w1", "b", ttl_s=30)  # w1 restarted: the lease is not its own...
    got = await new.acquire("s", keys.lease("s"), keys.fence("s"))
    assert got.lease is not None and got.replaced == "w1/a"  # ...but it may take it over, at once
    assert got.lease.fence > first.fence
    assert await redis.hget(keys.lease("s"), "token") == "w1/b"
    await old.renew_all()  # the predecessor (were it still alive) finds it gone
    assert "s" not in old.held


async def test_a_lease_still_ours_keeps_its_fence_and_a_release_cannot_undo_a_reacquisition(redis: Redis) -> None:
    m = LeaseManager(redis, "w1", "a", ttl_s=30)
    first = await take(m, "s")
    assert first is not None
    m.held.pop("s")  # dropped locally (say, a pause) while Redis still has it, under our token
    again = await take(m, "s")
    assert again is not None and again.fence == first.fence  # nobody held it in between: continuity
    # A release and a re-acquisition racing: the release is on the wire first, so it lands first.
    releasing = asyncio.create_task(m.release("s"))
    await asyncio.sleep(0)
    third = await take(m, "s")
    await releasing
    assert third is not None and await redis.hget(keys.lease("s"), "fence") == str(third.fence)
    assert third.fence > first.fence  # it was free in between: a new fence


async def test_no_lease_is_taken_in_a_redis_that_lost_the_sentinel_the_worker_joined_with(redis: Redis) -> None:
    listed = LeaseManager(redis, "w1", "a", ttl_s=30, listed_in="listing")
    bare = LeaseManager(redis, "w2", "a", ttl_s=30)  # no listing set: the sentinel is its third key
    await redis.set(keys.sentinel(), "v1")
    listed.guard = bare.guard = (keys.sentinel(), "v1")
    assert await take(listed, "s") is not None and await take(bare, "b") is not None
    assert await redis.smembers("listing") == {"s"} and await redis.get(keys.sentinel()) == "v1"
    await redis.flushall()  # restarted empty: a holder that has not noticed may still be at work
    for m in (listed, bare):
        with pytest.raises(DataLost):
            await take(m, "t")
    await redis.set(keys.sentinel(), "v2")  # joined anew by a worker that noticed: still not ours
    with pytest.raises(DataLost):
        await take(listed, "t")
    assert not await redis.exists(keys.lease("t")) and not await redis.exists("listing")
    listed.guard = (keys.sentinel(), "v2")  # this worker noticed and joined again
    assert await take(listed, "t") is not None


async def test_concurrent_acquisitions_share_a_few_round_trips(redis: Redis, redis_server: RedisServer) -> None:
    m = LeaseManager(redis, "w1", "a", ttl_s=30)
    got = await asyncio.gather(*(take(m, f"s{i}") for i in range(200)))
    assert all(lease is not None for lease in got) and len(m.held) == 200
    # Two short pipelines; 200 separate calls would have opened a connection each.
    clients = [c for c in redis_server.client().client_list() if c.get("name") == "lease-test"]
    assert len(clients) <= 2
    assert redis_server.client().info("commandstats")["cmdstat_evalsha"]["calls"] == 200


async def test_renewals_go_in_slices_and_report_leases_taken_elsewhere(redis: Redis) -> None:
    m = LeaseManager(redis, "w1", "a", ttl_s=30)
    lost: list[tuple[str, bool]] = []
    m.on_lost = lambda name, lease, *, expired: lost.append((name, expired))
    n = RENEW_SLICE * 2 + 7
    await asyncio.gather(*(take(m, f"s{i}") for i in range(n)))
    await redis.delete(keys.lease("s3"))  # lapsed...
    thief = LeaseManager(redis, "w2", "a", ttl_s=30)
    assert await take(thief, "s3") is not None  # ...and taken by another worker
    before = dict(m.renewed_at)
    await m.renew_all()
    assert lost == [("s3", False)] and len(m.held) == n - 1
    assert all(m.renewed_at[name] > before[name] for name in m.held)
    assert 1_000 < await redis.pttl(keys.lease("s0")) <= 30_000


async def test_a_worker_lists_exactly_the_sessions_it_acquired(redis: Redis) -> None:
    other = LeaseManager(redis, "w2", "a", ttl_s=30, listed_in=keys.worker_sessions("w2"))
    assert await take(other, "theirs") is not None
    m = LeaseManager(redis, "w1", "a", ttl_s=30, listed_in=keys.worker_sessions("w1"))
    got = await asyncio.gather(*(take(m, name) for name in ("a", "b", "theirs")))
    assert [lease is not None for lease in got] == [True, True, False]
    assert await redis.smembers(keys.worker_sessions("w1")) == {"a", "b"}  # never another's session


async def test_a_round_runs_alone_and_survives_leases_taken_and_dropped_while_it_runs(redis: Redis) -> None:
    m = LeaseManager(redis, "w1", "a", ttl_s=30)
    n = RENEW_SLICE * 12
    await asyncio.gather(*(take(m, f"s{i}") for i in range(n)))
    before = dict(m.renewed_at)
    rounds = [asyncio.create_task(m.renew_all()) for _ in range(3)]  # callers while a round runs share it
    await asyncio.sleep(0)
    await asyncio.gather(*(take(m, f"new{i}") for i in range(50)))  # the held map changes meanwhile
    await m.release_many([f"s{i}" for i in range(0, n, 3)])
    await asyncio.gather(*rounds)
    assert m._round is not None and all(r.done() for r in rounds)
    kept = [f"s{i}" for i in range(n) if i % 3]
    assert all(m.renewed_at[name] > before[name] for name in kept) and len(m.held) == len(kept) + 50
    assert not any(f"s{i}" in m.held for i in range(0, n, 3))


async def test_a_lease_is_given_up_locally_before_redis_expires_it(redis: Redis) -> None:
    m = LeaseManager(redis, "w1", "a", ttl_s=3)
    lease = await take(m, "s")
    assert lease is not None and m.holds("s", lease.fence) and not m.holds("s", lease.fence + 1)
    m.renewed_at["s"] -= m.ttl_s - m.margin_s  # as if the process had been paused that long
    assert not m.holds("s") and "s" in m.held  # a question changes nothing
    lost: list[bool] = []
    m.on_lost = lambda name, lease, *, expired: lost.append(expired)
    assert not m.check_lease("s") and lost == [True] and "s" not in m.held
    assert await redis.pttl(keys.lease("s")) > 0  # Redis still has it: the local view errs early


async def test_a_lease_our_clock_cannot_prove_is_confirmed_by_asking_redis_once(redis: Redis) -> None:
    """Right after a pause, output that matters (a final text, a stop mark) asks Redis instead of
    being dropped: still ours, the lease is renewed; someone else's, it is dropped and reported."""
    m = LeaseManager(redis, "w1", "a", ttl_s=3)
    lease = await take(m, "s")
    assert lease is not None
    m.renewed_at["s"] -= m.ttl_s - m.margin_s  # as if the process had been paused that long
    assert not m.holds("s", lease.fence)
    renewals = 0
    renew = m._renew_slice

    async def counted(part: list[Lease]) -> list[int]:
        nonlocal renewals
        renewals += 1
        return await renew(part)

    m._renew_slice = counted  # type: ignore[method-assign]
    assert await asyncio.gather(*(m.confirm("s", lease.fence) for _ in range(5))) == [True] * 5
    assert renewals == 1 and m.holds("s", lease.fence)  # five askers, one call; proven again
    assert await m.confirm("s", lease.fence) and renewals == 1  # proven by our clock: no call at all
    assert not await m.confirm("s", lease.fence + 1)  # another fence is never ours

    m.renewed_at["s"] -= m.ttl_s  # paused past the TTL, and another worker took the session
    await redis.delete(keys.lease("s"))
    assert await take(LeaseManager(redis, "w2", "b", ttl_s=3), "s") is not None
    lost: list[bool] = []
    m.on_lost = lambda name, lease, *, expired: lost.append(expired)
    assert not await m.confirm("s", lease.fence) and lost == [False] and "s" not in m.held


async def test_a_lease_that_lapsed_unnoticed_is_reported_lost_before_it_is_taken_again(redis: Redis) -> None:
    """A renewal late enough for Redis to expire the lease, then a message for the session: the
    new acquisition has a new fence, so whatever acted on the old one is told it lost the lease
    first (its turns are zombies; recovery replays their records) - never two turns for one."""
    m = LeaseManager(redis, "w1", "a", ttl_s=3)
    first = await take(m, "s")
    assert first is not None
    lost: list[tuple[int, bool]] = []
    m.on_lost = lambda name, lease, *, expired: lost.append((lease.fence, expired))
    m.renewed_at["s"] -= m.ttl_s  # our clock lapsed, and nobody called check_lease yet
    await redis.delete(keys.lease("s"))  # Redis expired it meanwhile
    again = await take(m, "s")
    assert again is not None and again.fence > first.fence
    assert lost == [(first.fence, False)] and m.held["s"] is again

    m.renewed_at["s"] -= m.ttl_s  # lapsed by our clock only: Redis still has it, under our token
    kept = await take(m, "s")
    assert kept is not None and kept.fence == again.fence and len(lost) == 1  # continuity: nothing lost


def test_the_lease_clock_keeps_running_through_suspend() -> None:
    if not hasattr(time, "CLOCK_BOOTTIME"):
        pytest.skip("CLOCK_BOOTTIME is Linux-only; elsewhere the monotonic clock is used")
    boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert abs(now() - boot) < 1.0


async def test_the_fence_counter_expires_but_fences_still_grow(redis: Redis) -> None:
    m = LeaseManager(redis, "w1", "a", ttl_s=3)
    first = await take(m, "s")
    assert first is not None
    assert 0 < await redis.pttl(keys.fence("s")) <= 3_000  # nothing per session lives forever
    await m.release("s")
    await redis.delete(keys.fence("s"))  # as after the counter expired...
    await asyncio.sleep(0.005)  # ...which takes a lease TTL, while the server clock (ms) moves on
    second = await take(m, "s")
    assert second is not None and second.fence > first.fence  # from the server clock, which moved on


async def test_a_reacquisition_of_a_lease_still_ours_is_marked_kept(redis: Redis) -> None:
    """Only a real takeover (a free lease, or a predecessor's) recovers what an owner left open."""
    m = LeaseManager(redis, "w1", "a", ttl_s=30)
    first = await m.acquire("s", keys.lease("s"), keys.fence("s"))
    assert first.lease is not None and not first.kept
    m.held.pop("s")
    again = await m.acquire("s", keys.lease("s"), keys.fence("s"))
    assert again.kept and again.lease is not None and again.lease.fence == first.lease.fence
    successor = LeaseManager(redis, "w1", "b", ttl_s=30)
    taken = await successor.acquire("s", keys.lease("s"), keys.fence("s"))
    assert not taken.kept and taken.replaced == "w1/a"


async def test_a_lease_reported_lost_is_taken_again_as_a_takeover_even_if_redis_still_has_it(redis: Redis) -> None:
    """Our clock gave the lease up (its turns were stopped, their records left for a new owner) but
    the release never reached Redis: taking it again ourselves must not continue the old fence —
    the old turns' writes are refused and what they left open is recovered, as by any new owner."""
    m = LeaseManager(redis, "w1", "a", ttl_s=30)
    lost: list[int] = []
    m.on_lost = lambda name, lease, *, expired: lost.append(lease.fence)
    first = await m.acquire("s", keys.lease("s"), keys.fence("s"))
    assert first.lease is not None
    m.renewed_at["s"] -= m.ttl_s  # a pause: our clock can no longer prove it...
    assert not m.check_lease("s") and lost == [first.lease.fence]  # ...so it is reported lost
    assert await redis.hget(keys.lease("s"), "token") == m.token  # Redis still has it, under our token
    again = await m.acquire("s", keys.lease("s"), keys.fence("s"))
    assert again.lease is not None and again.lease.fence > first.lease.fence
    assert not again.kept and again.replaced is None  # a takeover (of our own lost lease), not a predecessor's
    kept = await m.acquire("s", keys.lease("s"), keys.fence("s"))  # held now: asking again continues it
    assert kept.kept and kept.lease is not None and kept.lease.fence == again.lease.fence


async def test_renewals_keep_each_lease_apart_whatever_its_name_holds(redis: Redis) -> None:
    """Renewals pack a slice's keys into one argument; a name with a newline (a client's session
    id may hold one) must neither shift the others' fences nor renew anything it should not."""
    m = LeaseManager(redis, "w1", "a", ttl_s=30)
    names = ["plain", "two\nlines", "sb:lease:plain", "last"]
    for name in names:
        assert await take(m, name) is not None
    thief = LeaseManager(redis, "w2", "b", ttl_s=30)
    await redis.delete(keys.lease("last"))
    assert await take(thief, "last") is not None
    lost: list[str] = []
    m.on_lost = lambda name, lease, *, expired: lost.append(name)
    await m.renew_all()
    assert lost == ["last"] and set(m.held) == set(names) - {"last"}
    del m.held["two\nlines"]  # and the packed form, with only plain names
    await m.renew_all()
    assert lost == ["last"] and set(m.held) == {"plain", "sb:lease:plain"}


async def test_a_turn_loses_its_lease_by_our_clock_before_redis_can_give_it_to_another_worker(
        redis_server: RedisServer) -> None:
    """Redis hangs (paused), so renewals neither succeed nor fail: the session with work open is
    still given up at its local deadline — while Redis keeps it for us — not whenever a renewal
    call finally errors (a tool would run on while another worker adopts the session)."""
    events = Working()
    cluster = Cluster(Redis.from_url(redis_server.url, decode_responses=True), "w1", ttl_s=6, metrics=Metrics())
    await cluster.start(events)
    try:
        assert (await cluster.route("busy")).fence is not None
        await cluster.watch("busy")
        redis_server.pause()
        try:
            await asyncio.sleep(0.1)  # a renewal already answered has landed by now; none lands after
            renewed = cluster.leases.renewed_at["busy"]
            deadline = time.monotonic() + 2 * cluster.ttl_s
            while "busy" not in events.lost and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            redis_server.resume()
        assert "busy" in events.lost, "the lease was never given up while Redis hung"
        given_up_after = events.lost["busy"] - renewed
        assert cluster.ttl_s - cluster.leases.margin_s <= given_up_after < cluster.ttl_s  # Redis still had it
    finally:
        await cluster.stop()


class SlowRecovery(Working):
    """A takeover's recovery that waits until told to finish."""

    def __init__(self) -> None:
        super().__init__()
        self.recovering = asyncio.Event()
        self.finish = asyncio.Event()
        self.recovered: list[str] = []

    async def adopted(self, session: str) -> bool:
        self.recovering.set()
        await self.finish.wait()
        self.recovered.append(session)
        return True


async def test_a_message_for_a_session_being_taken_over_waits_for_the_takeovers_recovery(
        redis_server: RedisServer) -> None:
    """The lease is ours as soon as it is acquired, but what the previous owner left open is closed
    (and resumed) by the recovery the acquisition runs: a message routed meanwhile must not start
    its turn first, or its rows land between the cut-off turn's and its closing row."""
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    old = Cluster(redis, "w1", ttl_s=6, metrics=Metrics())
    await old.start(Working())
    assert (await old.route("s")).fence is not None
    await old.leases.stop(release=False)  # dies holding the lease: the restart takes it over
    await cancel_and_wait(old._tasks)  # (its Redis loops can lose a single cancel on 3.11)
    await redis.aclose()
    events = SlowRecovery()
    new = Cluster(Redis.from_url(redis_server.url, decode_responses=True), "w1", ttl_s=6, metrics=Metrics())
    await new.start(events)
    try:
        takeover = asyncio.create_task(new.route("s"))
        await asyncio.wait_for(events.recovering.wait(), 5)
        message = asyncio.create_task(new.route("s"))  # a message for the session, mid-recovery
        await asyncio.sleep(0.2)
        assert not message.done(), "a message was routed into the session before its takeover's recovery ended"
        events.finish.set()
        assert (await takeover).fence is not None and (await message).fence is not None
        assert events.recovered == ["s"]
    finally:
        events.finish.set()
        await new.stop()


async def test_on_redis_cluster_scripts_go_side_by_side_and_the_listing_follows(tmp_path: Path) -> None:
    """Redis Cluster refuses scripts in a pipeline and a listing key in another slot: acquisitions
    and renewals go as concurrent calls, and the acquired names are listed by a second call."""
    server = RedisServer(tmp_path / "cluster", cluster=True)
    try:
        server.start()
    except RedisServerMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    client = RedisCluster.from_url(f"redis://127.0.0.1:{server.port}", decode_responses=True)
    try:
        m = LeaseManager(client, "w1", "a", ttl_s=30, listed_in=keys.worker_sessions("w1"))
        other = LeaseManager(client, "w2", "b", ttl_s=30)
        names = [f"s{i}" for i in range(5)]
        got = await asyncio.gather(*(m.acquire(n, keys.lease(n), keys.fence(n)) for n in names))
        assert all(g.lease is not None for g in got)
        assert await client.smembers(keys.worker_sessions("w1")) == set(names)
        refused = await other.acquire("s0", keys.lease("s0"), keys.fence("s0"))
        assert refused.lease is None and refused.owner == "w1"
        await client.delete(keys.lease("s3"))  # gone behind our back: the renewal says so
        lost: list[str] = []
        m.on_lost = lambda name, lease, *, expired: lost.append(name)
        await m.renew_all()
        assert lost == ["s3"] and sorted(m.held) == ["s0", "s1", "s2", "s4"]
        await m.release_many(["s0", "s1"])
        assert await client.exists(keys.lease("s0")) == 0 and await client.exists(keys.lease("s2")) == 1
        await client.script_flush()  # as after a restart: the scripts are loaded again
        assert (await other.acquire("s0", keys.lease("s0"), keys.fence("s0"))).lease is not None
    finally:
        await client.aclose()
        server.stop()
