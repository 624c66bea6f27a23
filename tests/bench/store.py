"""Store benchmarks: transcript write throughput per worker, and what 100,000 stored messages cost.

(1) Throughput: one worker (this process, one event loop) drives N sessions at once, each M turns;
a turn is what the lane worker writes for a plain answer: the inbound record (accept), then the
user and assistant rows together with the inbound status (append). Every write is fenced: lease
fences for Redis and for PostgreSQL + Redis (cluster mode with PostgreSQL), growing numbers for
PostgreSQL alone, local fences for SQLite. The same workload on each backend.

(2) Memory: 100,000 transcript messages (1,000 sessions x 100, ~300 characters each, as chat
messages go) written into an empty Redis and an empty PostgreSQL database; Redis is measured by
`INFO memory` (used_memory, RAM), PostgreSQL by pg_total_relation_size of its tables (disk,
indexes included; only what is hot needs RAM).

Servers are started here (never the machine's): PostgreSQL with its defaults for durability (fsync
on, synchronous_commit on: a commit is on disk when acknowledged), Redis with an append-only file
fsynced every second (what the cluster section of the README asks for), SQLite in WAL mode with
synchronous=NORMAL (the store's own settings).

    python -m tests.bench.store [--sessions 200 --turns 10]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

from agent_cache import keys
from agent_cache.leases import LeaseManager
from gateway.core.fencing import Fence
from gateway.core.messages import ChatType, InboundMessage
from gateway.core.ports import InboundStatus, Store
from gateway.core.transcript import ChatMessage
from gateway.store.composite import PostgresClusterStore
from gateway.store.postgres import PostgresStore
from gateway.store.redis import RedisStore
from gateway.store.sqlite import SqliteStore
from tests.support.pg_server import PgServer
from tests.support.redis_server import RedisServer

SENTENCE = ("the quick brown fox jumps over a lazy dog while the model explains what it found in the logs "
            "and which of the three options fits the question best given the constraints")
WORDS = SENTENCE.split()
Owner = Callable[[str], Awaitable[Fence]]


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


async def throughput(store: Store, owner: Owner, sessions: int, turns: int, prefix: str = "bench") -> float:
    """Turns per second."""
    fences = {f"{prefix}:dm:{i}": await owner(f"{prefix}:dm:{i}") for i in range(sessions)}
    rng = random.Random(1)
    answer = text(rng, 600)

    async def session(key: str) -> None:
        fence = fences[key]
        for t in range(turns):
            msg = InboundMessage(platform="bench", chat_id=key, chat_type=ChatType.DM, user_id=key, user_name="b",
                                 message_id=str(t), text=f"question {t} " + answer[:80])
            inbound = await store.accept_inbound(fence, msg)
            assert inbound is not None
            await store.append(fence, 1, [ChatMessage("user", msg.text), ChatMessage("assistant", answer)],
                               inbound=(inbound, InboundStatus.DONE, None))

    started = time.perf_counter()
    await asyncio.gather(*(session(k) for k in fences))
    return sessions * turns / (time.perf_counter() - started)


def lease_owner(redis: RedisStore) -> Owner:
    manager = LeaseManager(redis._r, "bench", "bench", ttl_s=600)

    async def own(session: str) -> Fence:
        got = await manager.acquire(session, keys.lease(session), keys.fence(session))
        assert got.lease is not None
        return Fence(session, got.lease.fence)

    return own


def counter_owner() -> Owner:
    numbers = itertools.count(int(time.time() * 1000))

    async def own(session: str) -> Fence:
        return Fence(session, next(numbers))

    return own


async def local_owner(session: str) -> Fence:
    return Fence.local(session)


async def fill(store: Store, owner: Owner, messages: int, per_session: int = 100) -> None:
    rng = random.Random(2)
    rows = [ChatMessage("user" if i % 2 == 0 else "assistant", text(rng, 300)) for i in range(per_session)]
    for s in range(messages // per_session):
        fence = await owner(f"mem:dm:{s}")
        await store.append(fence, 1, rows)


async def pg_size(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("VACUUM ANALYZE")
        return int(await conn.fetchval(
            "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'public' AND c.relkind = 'r'"))
    finally:
        await conn.close()


async def main(sessions: int, turns: int, messages: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="sb-bench-store-"))
    pg = PgServer(durable=True)
    redis_server = RedisServer(tmp / "redis")
    results: list[tuple[str, float]] = []
    try:
        pg.start()
        redis_server.start()
        rc = redis_server.client()
        rc.config_set("appendonly", "yes")
        rc.config_set("appendfsync", "everysec")
        # (1) throughput
        sqlite = SqliteStore(tmp / "bench.db")
        redis = RedisStore(redis_server.url)
        postgres = PostgresStore(pg.create_database("bench_pg"), require_fence=True)
        both = PostgresClusterStore(PostgresStore(pg.create_database("bench_both"), require_fence=True),
                                    RedisStore(redis_server.url))
        # A URL's unknown query parameters are server settings for the connection: what Redis's
        # "everysec" is to "always", synchronous_commit=off is to PostgreSQL's default.
        relaxed = PostgresStore(pg.create_database("bench_relaxed") + "?synchronous_commit=off", require_fence=True)
        cases: list[tuple[str, Store, Owner]] = [
            ("SQLite (one process)", sqlite, local_owner), ("Redis", redis, lease_owner(redis)),
            ("PostgreSQL", postgres, counter_owner()),
            ("PostgreSQL, synchronous_commit=off", relaxed, counter_owner()),
            ("PostgreSQL + Redis (cluster)", both, lease_owner(both.coordination))]
        for n, (name, store, owner) in enumerate(cases):
            await store.open()
            try:
                await throughput(store, owner, 20, 2, f"warm{n}")  # warm up: connections, scripts, statements
                results.append((name, await throughput(store, owner, sessions, turns, f"bench{n}")))
            finally:
                await store.close()
        print(f"\nTranscript writes, one worker: {sessions} sessions at once x {turns} turns "
              "(a turn = accept the inbound record + append user and assistant rows with its status)\n")
        print(f"| {'store':<34} | {'turns/s':>8} | {'writes/s':>8} |")
        print(f"|{'-' * 36}|{'-' * 9}:|{'-' * 9}:|")
        for name, rate in results:
            print(f"| {name:<34} | {rate:>8,.0f} | {2 * rate:>8,.0f} |")

        # (2) memory for `messages` stored messages
        rc.flushall()
        before = int(rc.info("memory")["used_memory"])
        redis = RedisStore(redis_server.url)
        await redis.open()
        await fill(redis, lease_owner(redis), messages)
        await redis.close()
        redis_bytes = int(rc.info("memory")["used_memory"]) - before
        url = pg.create_database("bench_mem")
        store = PostgresStore(url, require_fence=True)
        await store.open()
        empty = await pg_size(url)
        await fill(store, counter_owner(), messages)
        await store.close()
        pg_bytes = await pg_size(url) - empty
        print(f"\n{messages:,} stored messages (~300 characters each)\n")
        print(f"| {'store':<34} | {'total':>9} | {'per message':>11} |")
        print(f"|{'-' * 36}|{'-' * 10}:|{'-' * 12}:|")
        print(f"| {'Redis (used_memory, RAM)':<34} | {redis_bytes / 2**20:>6.1f} MB | "
              f"{redis_bytes / messages:>9.0f} B |")
        print(f"| {'PostgreSQL (tables + indexes)':<34} | {pg_bytes / 2**20:>6.1f} MB | "
              f"{pg_bytes / messages:>9.0f} B |")
    finally:
        redis_server.stop()
        pg.destroy()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--messages", type=int, default=100_000)
    args = p.parse_args()
    asyncio.run(main(args.sessions, args.turns, args.messages))
