"""A fleet soak: thousands of HTTP API sessions on several cluster workers, Redis and PostgreSQL.

Real processes, each on a free loopback port: a private `redis-server`, a private PostgreSQL (fsync
on), the fake OpenAI provider in a process of its own, and N workers (`python -m gateway run`,
cluster mode, history in PostgreSQL, lease TTL 30 s). The load generator is this process: every
session (`X-Session-Id: fleet-<i>`) sends `--messages` streamed messages over the run, each at a
time of its own (message k of session i at (k + u_i) / M of the run, u_i uniform in [0, 1)), so
every session has sent its first message, and holds a lease and a live agent, by the end of the
first M-th of the run. Each request goes to a worker chosen at random (as a round-robin balancer
without stickiness would send it: most land on a worker that relays the owner's turn), or
`--route sticky` (by session) or `--route balancer` (through tests/support/balancer.py in this
process).

Measured:
- first-token overhead: the client's time to its first content chunk minus the provider's own time
  to its first word (the provider records when the request arrived and when its first word was
  written; perf_counter is one clock for every process on the machine);
- stop latency: `--stops` sessions get one long answer instead of a short one; a moment after its
  first token the client sends `/stop` to a random worker, and the provider records when the
  streaming connection closed;
- CPU seconds per message of the workers (summed), Redis and PostgreSQL (the postmaster, its
  backends and the children it reaped), from /proc over the load; the provider and this process
  beside them; then `--idle` seconds with every lease held and no messages (the renewal rounds);
- memory: each worker's RSS, Redis's used_memory, the database's size and WAL written.

    python -m tests.bench.fleet                                    # 10,000 sessions, 3 workers, 8 min
    python -m tests.bench.fleet --sessions 500 --minutes 1         # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from tests.fakes.openai_provider import Connection, FakeProvider, Script
from tests.support.balancer import round_robin
from tests.support.pg_server import PgServer
from tests.support.ports import free_port
from tests.support.procs import children
from tests.support.redis_server import RedisServer
from tests.support.spawn import Group, wait_ready
from tests.support.workers import Worker, end_all, start_all

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
TTL_S = 30.0  # the default lease TTL
RELAY_STREAM_MAXLEN = 100_000  # gateway/cluster/relay.py: entries a relay stream keeps
REQUEST_DEADLINE_S = 120.0  # one request, from sending it to the end of its answer


# --- the provider, in its own process ---------------------------------------------------------

class FleetProvider(FakeProvider):
    """The fake provider with a long answer for messages starting with "long ", and a compact
    record of every request: (message, opened, [first and second word written], closed, completed)."""

    def __init__(self, delay_s: float, words: int, long_words: int) -> None:
        super().__init__(delay_s=delay_s, words=words)
        self.count_body = True
        long = Script(text=" ".join(["word"] * long_words))
        self.script_for = lambda conn: long if conn.last_user.startswith("long ") else None

    def _words(self, script: Script, conn: Connection) -> Iterator[str]:
        conn.tag = conn.last_user  # type: ignore[attr-defined]
        words = super()._words(script, conn)
        conn.body = {}  # 30,000 request bodies would be this process's biggest cost

        def timed() -> Iterator[str]:
            written: list[float] = []  # resumed after each word's write: the moments of the first two
            for word in words:
                yield word
                if len(written) < 2:
                    written.append(time.perf_counter())
                    conn.written = written  # type: ignore[attr-defined]
        return timed()

    async def _stats(self, _request: Any) -> Any:
        from aiohttp import web
        return web.json_response([[getattr(c, "tag", c.last_user), c.opened_at, getattr(c, "written", []),
                                   c.closed_at, c.completed_at] for c in self.connections])


async def _serve_provider(port: int, delay_s: float, words: int, long_words: int) -> None:
    provider = FleetProvider(delay_s, words, long_words)
    await provider.start_on(port)
    print(f"fake provider on {provider.base_url}", flush=True)
    await asyncio.Event().wait()


# --- processes' CPU and memory ----------------------------------------------------------------

def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_s(pid: int, tree: bool = False) -> float:
    """User + system CPU seconds of `pid`; with `tree`, also its live children's and those it reaped."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    total = int(fields[11]) + int(fields[12])
    if tree:
        total += int(fields[13]) + int(fields[14])
        for child in children(pid):
            if (f := _stat_fields(child.pid)) is not None:
                total += int(f[11]) + int(f[12])
    return total / TICKS


def rss_mb(pid: int) -> float:
    fields = Path(f"/proc/{pid}/statm").read_text().split()
    return int(fields[1]) * PAGE / 2**20


# --- the load ---------------------------------------------------------------------------------

@dataclass
class Sent:
    session: int
    text: str
    worker: int
    sent: float
    first: float | None = None
    ended: float | None = None
    error: str | None = None
    stop_sent: float | None = None  # a long answer: when its /stop left
    stop_answered: float | None = None
    stop_reply: str | None = None


@dataclass
class Load:
    urls: list[str]
    route: str
    rng: random.Random
    http: aiohttp.ClientSession
    sent: list[Sent] = field(default_factory=list)
    late: list[float] = field(default_factory=list)  # how late each message left (the client's lag)

    def url(self, session: int) -> tuple[int, str]:
        w = session % len(self.urls) if self.route == "sticky" else self.rng.randrange(len(self.urls))
        return w, self.urls[w]

    async def message(self, session: int, text: str, stop_after: float | None) -> None:
        w, url = self.url(session)
        rec = Sent(session, text, w, time.perf_counter())
        self.sent.append(rec)
        body = {"messages": [{"role": "user", "content": text}], "stream": True}
        stopper: asyncio.Task[None] | None = None
        try:
            async with asyncio.timeout(REQUEST_DEADLINE_S):
                async with self.http.post(url + "/v1/chat/completions", json=body,
                                          headers={"X-Session-Id": f"fleet-{session}"}) as resp:
                    if resp.status != 200:
                        rec.error = f"HTTP {resp.status} {(await resp.text())[:160]}"
                        return
                    async for line in resp.content:
                        if rec.first is None and line.startswith(b"data: {") and b'"content"' in line \
                                and b'"content":""' not in line:
                            rec.first = time.perf_counter()
                            if stop_after is not None:
                                stopper = asyncio.create_task(self.stop(session, rec, stop_after))
                        elif line.startswith(b'data: {"error"'):
                            rec.error = line.decode(errors="replace")[:200]
                    rec.ended = time.perf_counter()
                    if stopper is not None:
                        await stopper
                    if rec.first is None and rec.error is None:
                        rec.error = "no content"
        except (aiohttp.ClientError, TimeoutError) as exc:
            rec.error = type(exc).__name__
        finally:
            if stopper is not None and not stopper.done():  # interrupted: its /stop is not sent
                stopper.cancel()

    async def stop(self, session: int, rec: Sent, after: float) -> None:
        await asyncio.sleep(after)
        _, url = self.url(session)
        body = {"messages": [{"role": "user", "content": "/stop"}]}
        rec.stop_sent = time.perf_counter()
        try:
            async with asyncio.timeout(30):
                async with self.http.post(url + "/v1/chat/completions", json=body,
                                          headers={"X-Session-Id": f"fleet-{session}"}) as resp:
                    answer = await resp.json()
            rec.stop_answered = time.perf_counter()
            rec.stop_reply = answer["choices"][0]["message"]["content"] if "choices" in answer else str(answer)
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            rec.stop_reply = f"failed: {type(exc).__name__}"


async def run_sessions(load: Load, sessions: int, messages: int, seconds: float, stops: int,
                       rng: random.Random) -> None:
    offsets = [rng.random() for _ in range(sessions)]
    stopped = {s: rng.randrange(messages) for s in rng.sample(range(sessions), min(stops, sessions))}
    start = time.perf_counter()

    async def session(s: int) -> None:
        for k in range(messages):
            at = start + seconds * (k + offsets[s]) / messages
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            load.late.append(time.perf_counter() - at)
            if stopped.get(s) == k:
                await load.message(s, f"long {s} {k}", stop_after=rng.uniform(0.1, 0.5))
            else:
                await load.message(s, f"m {s} {k}", stop_after=None)

    await asyncio.gather(*(session(s) for s in range(sessions)))


# --- reading the results ----------------------------------------------------------------------

def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def ms(values: list[float]) -> str:
    return f"{1000 * pct(values, 50):.1f} / {1000 * pct(values, 99):.1f}" if values else "-"


@dataclass
class Snapshot:
    at: float
    workers: float
    redis: float
    pg: float
    provider: float
    client: float

    @staticmethod
    def take(workers: list[int], redis: int, pg: int, provider: int) -> Snapshot:
        return Snapshot(time.perf_counter(), sum(cpu_s(p, tree=True) for p in workers), cpu_s(redis),
                        cpu_s(pg, tree=True), cpu_s(provider), cpu_s(os.getpid()))

    def minus(self, other: Snapshot) -> Snapshot:
        return Snapshot(self.at - other.at, self.workers - other.workers, self.redis - other.redis,
                        self.pg - other.pg, self.provider - other.provider, self.client - other.client)


async def pg_figures(url: str) -> tuple[int, int]:
    """The database's size in bytes and the WAL position (bytes since the cluster began)."""
    conn = await asyncio.wait_for(asyncpg.connect(url), 30)
    try:
        size = await conn.fetchval("SELECT pg_database_size(current_database())")
        wal = await conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
        return int(size), int(wal)
    finally:
        await conn.close()


def redis_figures(redis: RedisServer, workers: list[str]) -> tuple[int, int, int]:
    """(used_memory, leases held by the workers, lease keys)."""
    with redis.client() as c:
        used = int(c.info("memory")["used_memory"])
        held = sum(int(c.scard(f"sb:owned:{{{w}}}")) for w in workers)
        keys = sum(1 for _ in c.scan_iter(match="sb:{s:*}:lease", count=5000))
    return used, held, keys


def redis_breakdown(redis: RedisServer, sample: int = 300) -> list[tuple[str, int, int, int]]:
    """Redis's keys by kind (a session's tag and numbers masked): (kind, keys, bytes, stream
    entries), the bytes from MEMORY USAGE of up to `sample` keys of each kind, scaled to all."""
    kinds: dict[str, list[str]] = {}
    with redis.client() as c:
        for key in c.scan_iter(count=5000):
            kind = re.sub(r"\d+", "#", re.sub(r"\{s:[^}]*\}|[0-9a-f]{12,}", "…", key))
            kinds.setdefault(kind, []).append(key)
        out = []
        for kind, keys in kinds.items():
            picked = keys[:sample]
            exact = 0 if len(keys) <= 10 else None  # a few big keys (the relay streams): every element counted
            used = sum(int(c.memory_usage(k, samples=exact) or 0) for k in picked)
            entries = sum(int(c.xlen(k)) for k in picked) if c.type(picked[0]) == "stream" else 0
            out.append((kind, len(keys), round(used * len(keys) / max(1, len(picked))), entries))
    return sorted(out, key=lambda row: -row[2])


async def live_agents(http: aiohttp.ClientSession, admins: list[str]) -> int:
    """Sessions held in memory (the agent caches) over every worker, from their admin listeners."""
    total = 0
    for admin in admins:
        async with asyncio.timeout(30), http.get(admin + "/admin/api/stats") as resp:
            total += int((await resp.json())["agent_cache"]["size"])
    return total


async def sample_load(into: list[float], every: float = 5.0) -> None:
    while True:
        into.append(os.getloadavg()[0])
        await asyncio.sleep(every)


# --- the run ----------------------------------------------------------------------------------

async def fleet(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    seconds = args.minutes * 60
    procs: list[Group] = []
    workers: list[Worker] = []
    redis: RedisServer | None = None
    pg: PgServer | None = None
    with tempfile.TemporaryDirectory(prefix="sb-fleet-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
                  f"{os.cpu_count()} cores", flush=True)
            redis = await asyncio.to_thread(RedisServer(tmp / "redis", persistence=args.aof).start)
            pg = PgServer(durable=True)
            await asyncio.to_thread(pg.start)
            pg_url = await asyncio.to_thread(pg.create_database, "fleet")
            port = free_port()
            provider = Group([sys.executable, "-m", "tests.bench.fleet", "--serve-provider", str(port),
                              "--delay", str(args.delay), "--words", str(args.words),
                              "--long-words", str(args.long_words)], log=tmp / "provider.log")
            procs.append(provider)
            await wait_ready(f"http://127.0.0.1:{port}/_connections", provider, "the provider", tmp / "provider.log")
            env = {"SWITCHBOARD_STORE__URL": pg_url, "SWITCHBOARD_AGENT_CACHE__MAX_AGENTS": "1000000",
                   "SWITCHBOARD_QUOTAS__MESSAGES_PER_MINUTE": "0", "SWITCHBOARD_QUOTAS__RUNNING_TURNS": "0",
                   "SWITCHBOARD_QUOTAS__LIVE_SESSIONS": "0", "SWITCHBOARD_AGENT__MODEL": "fleet"}
            workers = [Worker(f"f{i + 1}", redis.url, f"http://127.0.0.1:{port}/v1", tmp, ttl_s=TTL_S, **env)
                       for i in range(args.workers)]
            await start_all(*workers)
            pids = [w.proc.pid for w in workers if w.proc is not None]
            assert redis.proc is not None and pg.pid() is not None
            redis_pid, pg_pid = redis.proc.pid, pg.pid() or 0
            print(f"{args.workers} workers, Redis, PostgreSQL and the provider ready; "
                  f"{args.sessions:,} sessions x {args.messages} messages over {args.minutes:g} min", flush=True)
            await report(await soak(args, seconds, rng, [w.url for w in workers], pids, redis, redis_pid,
                                    pg_url, pg_pid, provider.pid, [w.worker_id for w in workers], port,
                                    [f"http://127.0.0.1:{w.admin_port}" for w in workers]),
                         args)
        finally:
            end_all(*workers)
            if args.logs:  # the workers' and the provider's logs, kept
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                for log in tmp.glob("*.log"):
                    shutil.copy(log, Path(args.logs) / log.name)
            for proc in procs:
                proc.end()
            if redis is not None:
                await asyncio.to_thread(redis.stop)
            if pg is not None:
                await asyncio.to_thread(pg.destroy)


async def soak(args: argparse.Namespace, seconds: float, rng: random.Random, urls: list[str], pids: list[int],
               redis: RedisServer, redis_pid: int, pg_url: str, pg_pid: int, provider_pid: int,
               worker_ids: list[str], port: int, admins: list[str]) -> dict[str, Any]:
    loads: list[float] = []
    sampler = asyncio.create_task(sample_load(loads))
    used0, _, _ = redis_figures(redis, worker_ids)
    size0, wal0 = await pg_figures(pg_url)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http, \
                contextlib.AsyncExitStack() as stack:
            if args.route == "balancer":
                urls = [await stack.enter_async_context(round_robin(urls))]
            load = Load(urls, args.route, rng, http)
            quiet = Snapshot.take(pids, redis_pid, pg_pid, provider_pid)
            await asyncio.sleep(args.idle)  # no lease held, nothing sent: what the workers cost anyway
            before = Snapshot.take(pids, redis_pid, pg_pid, provider_pid)
            empty = before.minus(quiet)
            leases: list[tuple[int, int]] = []
            agents: list[int] = []

            async def count_leases() -> None:  # once every session has sent its first message
                await asyncio.sleep(seconds / args.messages + 10)
                leases.append(redis_figures(redis, worker_ids)[1:])
                agents.append(await live_agents(http, admins))

            counter = asyncio.create_task(count_leases())
            try:
                await asyncio.wait_for(run_sessions(load, args.sessions, args.messages, seconds, args.stops, rng),
                                       seconds + 2 * REQUEST_DEADLINE_S)
            finally:
                counter.cancel()
            after = Snapshot.take(pids, redis_pid, pg_pid, provider_pid)
            used1, held1, keys1 = redis_figures(redis, worker_ids)
            rss = [rss_mb(p) for p in pids]
            breakdown = redis_breakdown(redis)
            size1, wal1 = await pg_figures(pg_url)
            await asyncio.sleep(args.idle)  # every lease held, nothing sent: the renewal rounds alone
            idle = Snapshot.take(pids, redis_pid, pg_pid, provider_pid).minus(after)
            async with http.get(f"http://127.0.0.1:{port}/_connections") as resp:
                provider_rows = await resp.json()
    finally:
        sampler.cancel()
    return {"load": load, "cpu": after.minus(before), "idle": idle, "empty": empty, "rss": rss,
            "redis_used": (used0, used1),
            "leases": (leases[0] if leases else None, (held1, keys1)), "pg": (size1 - size0, wal1 - wal0),
            "provider": provider_rows, "loadavg": loads, "agents": agents[0] if agents else None,
            "breakdown": breakdown}


async def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    load: Load = r["load"]
    cpu: Snapshot = r["cpu"]
    idle: Snapshot = r["idle"]
    empty: Snapshot = r["empty"]
    by_text = {row[0]: row for row in r["provider"]}
    samples: dict[str, list[float]] = {k: [] for k in (
        "overhead", "ttft", "provider_ttfb", "first_overhead", "later_overhead", "stop_ms", "stop_answer", "way_in",
        "way_out", "held", "own")}
    overhead, ttft, provider_ttfb, first_overhead, later_overhead, stop_ms, stop_answer, way_in, way_out, held, own = (
        samples.values())
    errors: dict[str, int] = {}
    bad_stops: dict[str, int] = {}
    firsts: dict[int, Sent] = {}
    for rec in sorted(load.sent, key=lambda x: x.sent):
        firsts.setdefault(rec.session, rec)
    for rec in load.sent:
        if rec.error is not None:
            kind = re.sub(r"chatcmpl-\w+|\d{3,}", "#", rec.error)[:140]
            errors[kind] = errors.get(kind, 0) + 1
            continue
        row = by_text.get(rec.text)
        if row is None or rec.first is None or len(row[2]) < 2:
            errors["not seen by the provider"] = errors.get("not seen by the provider", 0) + 1
            continue
        _, opened, (first, second), closed, _completed = row
        ttft.append(rec.first - rec.sent)
        provider_ttfb.append(first - opened)
        extra = (rec.first - rec.sent) - (first - opened)
        overhead.append(extra)
        way_in.append(opened - rec.sent)
        held.append(second - first)
        way_out.append(rec.first - second)
        own.append(opened - rec.sent + rec.first - second)
        (first_overhead if firsts[rec.session] is rec else later_overhead).append(extra)
        if rec.stop_sent is not None:
            if rec.stop_reply != "Stopped." or closed is None:
                bad_stops[str(rec.stop_reply)[:60]] = bad_stops.get(str(rec.stop_reply)[:60], 0) + 1
            else:
                stop_ms.append(closed - rec.stop_sent)
                if rec.stop_answered is not None:
                    stop_answer.append(rec.stop_answered - rec.stop_sent)
    n = len(load.sent)
    done = n - sum(errors.values())
    rate = n / cpu.at
    used0, used1 = r["redis_used"]
    mid, end = r["leases"]
    size, wal = r["pg"]
    loads = r["loadavg"]
    print(f"\nload average during the run: mean {statistics.mean(loads):.2f}, max {max(loads):.2f} "
          f"(1-min, sampled every 5 s); now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"client lag behind schedule: p50 {1000 * pct(load.late, 50):.1f} ms, "
          f"p99 {1000 * pct(load.late, 99):.1f} ms, max {1000 * max(load.late):.1f} ms")
    for kind, count in sorted(errors.items(), key=lambda e: -e[1]):
        print(f"error: {count} x {kind}")
    if bad_stops:
        print(f"stops that did not stop a running answer: {bad_stops}")
    print("\n| sessions | workers | route | messages | msg/s | first-token overhead p50 / p99 ms | "
          "first message of a session p50 / p99 | later ones p50 / p99 | stops "
          "| /stop -> provider closed p50 / p99 ms | /stop answered p50 / p99 ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.sessions:,} | {args.workers} | {args.route} | {n:,} ({done:,} ok) | {rate:,.1f} | {ms(overhead)} | "
          f"{ms(first_overhead)} | {ms(later_overhead)} | {len(stop_ms)} | {ms(stop_ms)} | {ms(stop_answer)} |")
    print(f"\ntime to first token {ms(ttft)} ms (p50 / p99), of which the provider's own {ms(provider_ttfb)} ms "
          f"(its --delay {1000 * args.delay:g} ms before each word). The overhead is: the request's way in "
          f"(client sent -> provider got it) {ms(way_in)} ms; the first word held back until the second "
          f"arrives (by design: SettlingReply) {ms(held)} ms; the way out (provider's second word written -> "
          f"client has the first) {ms(way_out)} ms; in and out together, the gateway's own: {ms(own)} ms")
    per = 1000 / n
    print("\n| CPU per message (ms) | workers (sum) | Redis | PostgreSQL | provider | load generator |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| over the load ({cpu.at:.0f} s, {n:,} messages) | {cpu.workers * per:.2f} | {cpu.redis * per:.3f} | "
          f"{cpu.pg * per:.3f} | {cpu.provider * per:.2f} | {cpu.client * per:.2f} |")
    print(f"| cores busy over the load | {cpu.workers / cpu.at:.2f} | {cpu.redis / cpu.at:.3f} | "
          f"{cpu.pg / cpu.at:.3f} | {cpu.provider / cpu.at:.2f} | {cpu.client / cpu.at:.2f} |")
    print(f"| idle before the load, no lease ({empty.at:.0f} s), cores busy | {empty.workers / empty.at:.3f} | "
          f"{empty.redis / empty.at:.4f} | {empty.pg / empty.at:.4f} | - | - |")
    print(f"| idle after it, every lease held ({idle.at:.0f} s), cores busy | {idle.workers / idle.at:.3f} | "
          f"{idle.redis / idle.at:.4f} | {idle.pg / idle.at:.4f} | - | - |")
    print("\n| memory | value |")
    print("|---|---:|")
    print(f"| worker RSS (MB) | {', '.join(f'{x:.0f}' for x in r['rss'])} |")
    print(f"| Redis used_memory | {used0 / 2**20:.1f} -> {used1 / 2**20:.1f} MB "
          f"({(used1 - used0) / max(1, args.sessions):,.0f} B per session) |")
    print(f"| leases held (owned sets / lease keys) | after the first messages {mid[0]:,} / {mid[1]:,}; "
          f"at the end {end[0]:,} / {end[1]:,} |" if mid else f"| leases held at the end | {end[0]:,} / {end[1]:,} |")
    if r["agents"] is not None:
        print(f"| live agents (the workers' agent caches) after the first messages | {r['agents']:,} |")
    print(f"| PostgreSQL database growth | {size / 2**20:.1f} MB ({size / n:,.0f} B per message) |")
    print(f"| PostgreSQL WAL written | {wal / 2**20:.1f} MB ({wal / n:,.0f} B per message) |")
    print("\n| Redis keys at the end, by kind | keys | bytes (MEMORY USAGE) |")
    print("|---|---:|---:|")
    for kind, keys, used, entries in r["breakdown"][:12]:
        print(f"| `{kind}` | {keys:,} | {used:,}{f' ({entries:,} entries)' if entries else ''} |")
    figures = {
        "sessions": args.sessions, "workers": args.workers, "messages": n, "ok": done, "rate": rate,
        "overhead_ms": [1000 * pct(overhead, 50), 1000 * pct(overhead, 99)],
        "own_ms": [1000 * pct(own, 50), 1000 * pct(own, 99)],
        "stop_ms": [1000 * pct(stop_ms, 50), 1000 * pct(stop_ms, 99)], "stops": len(stop_ms),
        "cpu_ms_per_message": {"workers": cpu.workers * per, "redis": cpu.redis * per, "pg": cpu.pg * per},
        "idle_cores": {"workers": idle.workers / idle.at, "redis": idle.redis / idle.at, "pg": idle.pg / idle.at},
    "empty_cores": {"workers": empty.workers / empty.at, "redis": empty.redis / empty.at,
                    "pg": empty.pg / empty.at},
        "rss_mb": r["rss"], "redis_used": [used0, used1], "pg_bytes": size, "wal_bytes": wal,
        "leases": end[0], "breakdown": r["breakdown"], "loadavg": loads, "errors": errors}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    sizing(figures, args)


def sizing(f: dict[str, Any], args: argparse.Namespace) -> None:
    """Cores, Redis and PostgreSQL for `--chats` daily chats, from a soak's figures (its --json)."""
    daily = args.chats * args.chat_messages
    peak = daily / 86_400 * args.peak
    held = args.chats * args.held
    soak_leases = max(1, f["leases"])
    cpu, breakdown = f["cpu_ms_per_message"], f["breakdown"]
    # Idle: a fixed cost per worker process (measured before the load) and one per lease held (what
    # idling with every lease held added to it).
    fixed = {k: v / f["workers"] for k, v in f["empty_cores"].items()}
    lease = {k: max(0.0, f["idle_cores"][k] - f["empty_cores"][k]) / soak_leases for k in fixed}
    workers_busy = peak * cpu["workers"] / 1000 + held * lease["workers"]
    processes = max(1, int(-(-(workers_busy / args.utilisation) // 1)))  # one event loop a core
    workers_busy += processes * fixed["workers"]
    worker_cores = workers_busy / args.utilisation
    processes = max(processes, int(-(-worker_cores // 1)))

    def cores(part: str) -> float:
        return float((peak * cpu[part] / 1000 + held * lease[part] + processes * fixed[part]) / args.utilisation)

    redis_cores, pg_cores = cores("redis"), cores("pg")
    per_session = sum(b for kind, _, b, _ in breakdown if kind.startswith(("sb:…:", "sb:owned:", "sb:leased")))
    per_session /= soak_leases
    relay_bytes = sum(b for kind, _, b, _ in breakdown if kind.startswith("sb:relay:"))
    relay_entries = sum(e for kind, _, _, e in breakdown if kind.startswith("sb:relay:"))
    relay_cap = processes * RELAY_STREAM_MAXLEN * relay_bytes / max(1, relay_entries)
    redis_mb = (held * per_session + relay_cap) / 2**20
    per_message = f["pg_bytes"] / f["messages"]
    wal = f["wal_bytes"] / f["messages"]
    print(f"\nSizing for {args.chats:,.0f} chats a day, {args.chat_messages:g} messages each ({daily:,.0f} a day, "
          f"{daily / 86_400:,.0f}/s on average), a peak hour of {args.peak:g} x that ({peak:,.0f} msg/s), "
          f"{args.held:.0%} of the chats leased at once, {args.utilisation:.0%} CPU at the peak:")
    if f["leases"] < 5000:
        print("(a soak of fewer than 5,000 sessions: the cost per lease is mostly noise here)")
    print("\n| part | at the peak | per 1 M daily chats | from the soak |")
    print("|---|---:|---:|---|")
    print(f"| worker cores | {workers_busy:.1f} busy | **{worker_cores:.1f} cores** ({processes} worker processes) | "
          f"{cpu['workers']:.2f} ms CPU per message; {lease['workers'] * 1e5:.2f} cores per 100,000 leases held; "
          f"{fixed['workers']:.3f} cores per idle worker |")
    print(f"| Redis | {redis_cores * args.utilisation:.2f} cores busy | **{redis_cores:.2f} cores, "
          f"{redis_mb:,.0f} MB** | {cpu['redis']:.3f} ms per message; {per_session:,.0f} B per leased session; "
          f"relay streams {relay_cap / 2**20:,.0f} MB at their cap ({RELAY_STREAM_MAXLEN:,} entries a worker) |")
    print(f"| PostgreSQL | {pg_cores * args.utilisation:.2f} cores busy | **{pg_cores:.2f} cores, "
          f"{daily * per_message / 2**30:,.1f} GB of history a day** | {cpu['pg']:.3f} ms per message; "
          f"{per_message:,.0f} B stored and {wal:,.0f} B of WAL per message ({daily * wal / 2**30:,.1f} GB "
          f"WAL a day) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=8.0, help="how long the messages are spread over")
    parser.add_argument("--messages", type=int, default=3, help="streamed messages per session")
    parser.add_argument("--stops", type=int, default=300, help="sessions that stop one long answer")
    parser.add_argument("--delay", type=float, default=0.02, help="the provider's pause before each word (s)")
    parser.add_argument("--words", type=int, default=20, help="words in a short answer (after 'reply to: ...')")
    parser.add_argument("--long-words", type=int, default=20_000, help="words in a long answer (to be stopped)")
    parser.add_argument("--route", choices=["random", "sticky", "balancer"], default="random")
    parser.add_argument("--idle", type=float, default=25.0, help="seconds measured after the load, leases held")
    parser.add_argument("--aof", action="store_true", help="Redis with an fsync-always append-only file")
    parser.add_argument("--seed", type=int, default=33)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--logs", help="keep the workers' and the provider's logs in this directory")
    parser.add_argument("--serve-provider", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--sizing", metavar="JSON", help="only print the sizing table from a run's --json")
    parser.add_argument("--chats", type=float, default=1e6, help="sizing: chats a day")
    parser.add_argument("--chat-messages", type=float, default=10, help="sizing: messages a chat sends a day")
    parser.add_argument("--peak", type=float, default=3.0, help="sizing: the peak hour's rate over the average")
    parser.add_argument("--held", type=float, default=0.25, help="sizing: share of the chats leased at once "
                        "(a session keeps its lease while cached: agent_cache.idle_ttl_s, 1 h)")
    parser.add_argument("--utilisation", type=float, default=0.5, help="sizing: CPU utilisation at the peak")
    args = parser.parse_args()
    if args.sizing:
        sizing(json.loads(Path(args.sizing).read_text()), args)
        return
    if args.serve_provider:
        asyncio.run(_serve_provider(args.serve_provider, args.delay, args.words, args.long_words))
        return

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        await fleet(args)

    try:
        asyncio.run(run())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: every process this run started has been ended", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
