"""HTTP API throughput of one daemon process against the bare-client limit, CPU per message, and
where the daemon's time goes.

The fake OpenAI-compatible provider runs in its own process (0 delay, 5-word answers); the daemon
runs as `python -m gateway run` with a temporary config (SQLite store, API platform with a key).
C clients, each with its own aiohttp session and its own chat session, send non-streaming
requests back to back. The limit is a bare aiohttp client asking the provider directly, measured
in the same run. Fresh sessions start a new chat every 20 messages; long sessions have 1,000 prior
turns, seeded through the SQLite store before the daemon starts. The daemon's CPU time comes from
/proc/<pid>/stat over the measured window. The floor — `tests.bench.relay`, aiohttp in, one
provider call, aiohttp out — is measured in the same runs and printed beside every row.

    python -m tests.bench.api_throughput [--clients 10,50,200] [--seconds 5] [--runs 3]
    python -m tests.bench.api_throughput --profile /tmp/prof   # py-spy on the daemon, raw stacks
    python -m tests.bench.api_throughput --kinds fresh --no-relay   # without tests.bench.relay (aiohttp alone)
    python -m tests.bench.api_throughput --workers 1,2,3 --kinds fresh   # cluster mode, one Redis

With `--workers`, N daemons in cluster mode share a private redis-server (history in Redis);
client i talks to worker i mod N. Worker CPU per message sums every worker's; Redis's CPU per
message (its used_cpu_user + used_cpu_sys from INFO, over the same window) is printed beside it,
and one daemon without Redis (SQLite) is measured in the same run, so the table says what cluster
mode costs against a single node (`x single`: worker CPU per message over the single node's).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gateway.core.fencing import Fence
from gateway.core.transcript import ChatMessage
from gateway.store.sqlite import SqliteStore
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer

KEY = "bench-key"
ANSWER = "one two three four five"
PRIOR_TURNS = 1_000
FRESH_EVERY = 20  # messages per chat session in the fresh-session runs
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Point:
    rate: float  # msg/s
    p50_ms: float
    p99_ms: float
    cpu_ms: float | None  # daemon CPU per message
    errors: int
    threads_ms: dict[str, float] | None = None  # daemon CPU per message, by thread name
    redis_cpu_ms: float | None = None  # redis-server CPU per message (cluster mode)




def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (and its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def redis_cpu_s(redis: RedisServer) -> float:
    """User + system CPU seconds redis-server has used (every thread of it), from INFO cpu."""
    with redis.client() as c:
        info = c.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def thread_cpu_s(pids: list[int]) -> dict[str, float]:
    """User + system CPU seconds by thread name (the event loop's is the process's own name)."""
    out: dict[str, float] = collections.defaultdict(float)
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                stat = (task / "stat").read_text()
                name, rest = stat.split(" (", 1)[1].rsplit(")", 1)
                fields = rest.split()
                out["event loop" if task.name == str(pid) else name] += (int(fields[11]) + int(fields[12])) / TICKS
    return out


async def load(urls: list[str], clients: int, seconds: float,
               body_for: collections.abc.Callable[[int, int], dict[str, Any] | bytes],
               headers_for: collections.abc.Callable[[int, int], dict[str, str]], pids: list[int],
               profile: Path | None = None, redis: RedisServer | None = None) -> Point:
    """`clients` loops, each in its own aiohttp session, asking back to back (client i asks
    `urls[i % len(urls)]`). Warm-up lasts until every client has had an answer; then `seconds`
    are measured. CPU per message sums the processes in `pids`; `redis`'s is reported apart."""
    answered = [0] * clients
    warm = asyncio.Event()
    stop = asyncio.Event()
    latencies: list[float] = []
    errors = [0]
    measuring = [False]
    sent = [0] * clients

    async def client(i: int) -> None:
        url = urls[i % len(urls)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            while not stop.is_set():
                n = sent[i]
                sent[i] += 1
                t0 = time.perf_counter()
                body = body_for(i, n)
                try:
                    async with (http.post(url, data=body, headers={**headers_for(i, n), **JSON}) if isinstance(
                            body, bytes) else http.post(url, json=body, headers=headers_for(i, n))) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if not ok:
                    errors[0] += measuring[0]
                    await asyncio.sleep(0.01)
                    continue
                if measuring[0]:
                    latencies.append(time.perf_counter() - t0)
                answered[i] += 1
                if answered[i] == 1 and all(answered):
                    warm.set()

    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    spy = None
    try:
        await asyncio.wait_for(warm.wait(), 120)
        await asyncio.sleep(0.5)
        if profile is not None and pids:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(pids[0]), "--format", "raw", "--rate", "250",
                                    "--duration", str(int(seconds)), "--output", str(profile), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cpu0 = sum(cpu_s(pid) for pid in pids)
        threads0 = thread_cpu_s(pids)
        redis0 = redis_cpu_s(redis) if redis is not None else 0.0
        measuring[0] = True
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        measuring[0] = False
        elapsed = time.perf_counter() - t0
        cpu1 = sum(cpu_s(pid) for pid in pids)
        threads1 = thread_cpu_s(pids)
        redis1 = redis_cpu_s(redis) if redis is not None else 0.0
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if spy is not None:
            await asyncio.to_thread(spy.wait, 30)
    done = len(latencies)
    lat = sorted(latencies)
    return Point(done / elapsed, 1000 * lat[len(lat) // 2] if lat else 0.0,
                 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0,
                 1000 * (cpu1 - cpu0) / done if pids and done else None, errors[0],
                 {k: 1000 * (threads1[k] - threads0.get(k, 0.0)) / done for k in threads1} if pids and done else None,
                 1000 * (redis1 - redis0) / done if redis is not None and done else None)


def bare_body(i: int, n: int) -> dict[str, Any]:
    # What the daemon sends for a first message: one user message, streamed, with usage.
    return {"model": "bench", "messages": [{"role": "user", "content": f"hello number {n}"}], "stream": True,
            "stream_options": {"include_usage": True}}


LONG_HISTORY = [m for t in range(PRIOR_TURNS) for m in (
    {"role": "user", "content": f"hello number {t}"}, {"role": "assistant", "content": ANSWER + " "})]


_LONG_HEAD = json.dumps({"model": "bench", "stream": True, "stream_options": {"include_usage": True},
                         "messages": LONG_HISTORY}).encode()[:-2]  # open after the history
JSON = {"Content-Type": "application/json"}


def bare_body_long(i: int, n: int) -> bytes:
    # What the daemon sends in a session with 1,000 prior turns (all of it fits the budget), encoded
    # once, so that the client's own JSON encoding does not set the limit.
    return _LONG_HEAD + f', {{"role": "user", "content": "hello number {n}"}}]}}'.encode()


async def seed(db: Path, sessions: list[str]) -> None:
    """1,000 prior turns per session, written through the store as the daemon would have."""
    store = SqliteStore(db)
    await store.open()
    try:
        for key in sessions:
            rows = []
            for t in range(PRIOR_TURNS):
                rows += [ChatMessage("user", f"hello number {t}"), ChatMessage("assistant", ANSWER + " ")]
            await store.append(Fence.local(key), 1, rows)
    finally:
        await store.close()


class Daemon:
    def __init__(self, tmp: Path, provider_url: str, event_loop: str | None, code: Path | None = None,
                 redis_url: str | None = None, worker_id: str | None = None) -> None:
        self.tmp = tmp
        self.code = code  # another checkout's gateway (PYTHONPATH), for a side-by-side comparison
        self.port = free_port()
        tmp.mkdir(parents=True, exist_ok=True)
        self.config = tmp / "switchboard.toml"
        loop = f'event_loop = "{event_loop}"\n' if event_loop else ""
        cluster = f'[redis]\nurl = "{redis_url}"\n\n[cluster]\nworker_id = "{worker_id}"\n' if redis_url else ""
        # The bench is one tenant sending as fast as it can: its quotas would refuse most of it.
        # (A checkout from before quotas existed refuses the section as unknown.)
        has_quotas = ((code or Path(__file__).resolve().parents[2]) / "gateway" / "core" / "quotas.py").exists()
        quotas = ("\n[quotas]\nmessages_per_minute = 0\nrunning_turns = 0\nlive_sessions = 0\n"
                  if has_quotas else "")
        self.config.write_text(f"""
[daemon]
{loop}
[http]
host = "127.0.0.1"
port = {self.port}

[admin]
enabled = false

[webchat]
enabled = false

[api]
enabled = true
keys = ["{KEY}"]

[agent]
kind = "openai"
base_url = "{provider_url}"
model = "bench"
retries = 0

[router]
messages_per_minute = 0

[agent_cache]
max_agents = 100000
{quotas}
[store]
data_dir = "{tmp / 'data'}"

{cluster}""")
        self.log = tmp / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def db(self) -> Path:
        return self.tmp / "data" / "switchboard.db"

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
        code = self.code or Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = str(code)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "run", "--config", str(self.config)],
                                         env=env, stdout=log, stderr=log, cwd=code)
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited:\n{self.log.read_text()[-3000:]}")
                try:
                    async with http.get(f"http://127.0.0.1:{self.port}/readyz") as resp:
                        if resp.status == 200:
                            return
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the daemon never became ready:\n{self.log.read_text()[-3000:]}")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:  # reported, and the run goes on
                print(f"the daemon {self.proc.pid} did not exit within 30 s of SIGTERM: killed", flush=True)
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, 30)


async def relay_points(clients: list[int], seconds: float, provider_url: str) -> dict[int, Point]:
    """The same load on `tests.bench.relay`: aiohttp in, one provider call, aiohttp out, nothing else."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.bench.relay", "--port", str(port),
                             "--provider", provider_url], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/readyz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the relay did not start") from None
                    await asyncio.sleep(0.1)
        return {c: await load([f"http://127.0.0.1:{port}/v1/chat/completions"], c, seconds,
                              lambda i, n: {"model": "switchboard", "messages": [
                                  {"role": "user", "content": f"hello number {n}"}]},
                              lambda i, n: {"Authorization": f"Bearer {KEY}"}, [proc.pid])
                for c in clients}
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)


async def daemon_points(kind: str, clients: list[int], seconds: float, provider_url: str, event_loop: str | None,
                        profile: Path | None, code: Path | None = None, workers: int = 0) -> dict[int, Point]:
    """One daemon (SQLite), or with `workers` that many in cluster mode on a private redis-server."""
    with tempfile.TemporaryDirectory(prefix="sb-bench-") as tmp:
        redis = RedisServer(Path(tmp) / "redis").start() if workers else None
        daemons = [Daemon(Path(tmp) / f"w{n}", provider_url, event_loop, code,
                          redis.url if redis else None, f"w{n}") for n in range(max(1, workers))]
        offsets = {c: sum(clients[:k]) for k, c in enumerate(clients)}  # each level its own sessions
        if kind == "long":
            if redis is not None:
                raise SystemExit("--kinds long is seeded through SQLite: not with --workers")
            await seed(daemons[0].db, [f"api:dm:long-{i}" for i in range(sum(clients))])
        try:
            await asyncio.gather(*(d.start() for d in daemons))
            pids = [d.proc.pid for d in daemons if d.proc is not None]
            urls = [f"http://127.0.0.1:{d.port}/v1/chat/completions" for d in daemons]
            points = {}
            for c in clients:
                base = offsets[c]

                def headers(i: int, n: int, base: int = base) -> dict[str, str]:
                    session = f"long-{base + i}" if kind == "long" else f"fresh-{base + i}-{n // FRESH_EVERY}"
                    return {"Authorization": f"Bearer {KEY}", "X-Session-Id": session}

                def body(i: int, n: int) -> dict[str, Any]:
                    return {"model": "switchboard", "messages": [{"role": "user", "content": f"hello number {n}"}]}

                points[c] = await load(urls, c, seconds, body, headers, pids,
                                       profile / f"{kind}-w{workers}-c{c}.txt" if profile else None, redis)
        finally:
            await asyncio.gather(*(d.stop() for d in daemons))
            if redis is not None:
                redis.stop()
        return points


def top_functions(raw: Path, n: int = 15) -> list[str]:
    """From py-spy's raw (collapsed) stacks: the functions with the most samples on the stack
    (inclusive) and at the top of it (self), as a share of all samples."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  if " (" in f else f for f in stack.split(";")]
        total += k
        for f in set(frames):
            inclusive[f] += k
        own[frames[-1]] += k
    if not total:
        return ["(no samples)"]
    out = [f"{total} samples; self % | inclusive % | function"]
    for f, k in own.most_common(n):
        out.append(f"{100 * k / total:6.1f} | {100 * inclusive[f] / total:6.1f} | {f}")
    out.append("inclusive, ours:")
    ours = [(f, k) for f, k in inclusive.most_common() if any(p in f for p in (
        "context.py", "openai.py", "sqlite.py", "turns.py", "router.py", "api.py", "transcript.py"))]
    for f, k in ours[:n]:
        out.append(f"{100 * k / total:6.1f} | {f}")
    return out


def _row(kind: str, workers: int) -> str:
    return f"{kind}, {workers} worker{'s' if workers > 1 else ''} (Redis)" if workers else kind


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    """The median, and the range when there is more than one run."""
    if len(values) < 2:
        return f"{med(values):.2f}" if values else "-"
    return f"{med(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _beside(relay: list[Point], rate: float, cpu: float) -> str:
    """The relay's figures at the same C, and this row's against them (empty cells without --relay)."""
    if not relay:
        return " | | | |"
    relay_rate, relay_cpu = med([p.rate for p in relay]), med([p.cpu_ms or 0.0 for p in relay])
    return (f" {relay_rate:,.0f} | {relay_cpu:.2f} | {rate / relay_rate:.2f} | "
            f"{cpu / relay_cpu if relay_cpu else 0.0:.2f} |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="10,50,200")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=1, help="repeat and report medians")
    parser.add_argument("--kinds", default="fresh,long")
    parser.add_argument("--event-loop", choices=["auto", "uvloop", "asyncio"], default=None,
                        help="daemon.event_loop for the daemon (default: its config default)")
    parser.add_argument("--profile", type=Path, help="run py-spy on the daemon, raw stacks into this directory")
    parser.add_argument("--baseline", type=Path, help="another checkout (e.g. a `git worktree` of main): its daemon "
                        "is measured in the same runs, alternating with this one's")
    parser.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure tests.bench.relay (aiohttp in, one provider call, aiohttp out), the "
                        "floor under any gateway built on aiohttp, printed beside every row (default: on)")
    parser.add_argument("--workers", default="", help="cluster mode with these numbers of workers, e.g. 1,2,3 "
                        "(default: one daemon without Redis)")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    worker_counts = [int(w) for w in args.workers.split(",") if w] or [0]
    if 0 not in worker_counts:  # cluster mode is compared with a single node in the same run
        worker_counts.insert(0, 0)
    kinds = args.kinds.split(",")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    port = free_port()
    provider = subprocess.Popen([sys.executable, "-m", "tests.fakes.openai_provider", "--port", str(port),
                                 "--delay", "0", "--words", "5", "--text", ANSWER, "--no-record"],
                                stdout=subprocess.DEVNULL)
    provider_url = f"http://127.0.0.1:{port}/v1"
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; {args.runs} run(s), "
          f"{args.seconds:g} s per point", flush=True)
    bare: dict[tuple[str, int], list[Point]] = collections.defaultdict(list)
    ours: dict[tuple[str, int], list[Point]] = collections.defaultdict(list)
    base: dict[tuple[str, int], list[Point]] = collections.defaultdict(list)
    relay: dict[int, list[Point]] = collections.defaultdict(list)
    try:
        await asyncio.sleep(1.0)
        for run in range(args.runs):
            for kind in kinds:
                for c in clients:
                    bare[kind, c].append(await load([provider_url + "/chat/completions"], c, args.seconds,
                                                    bare_body_long if kind == "long" else bare_body,
                                                    lambda i, n: {}, []))
            if args.relay:
                for c, p in (await relay_points(clients, args.seconds, provider_url)).items():
                    relay[c].append(p)
            for kind in kinds:
                profile = args.profile if args.profile and run == 0 else None
                sides = [(ours, None), (base, args.baseline)] if args.baseline else [(ours, None)]
                for table, code in sides if run % 2 == 0 else sides[::-1]:
                    for workers in worker_counts:
                        for c, p in (await daemon_points(kind, clients, args.seconds, provider_url,
                                                         args.event_loop, profile if code is None else None, code,
                                                         workers)).items():
                            table[_row(kind, workers), c].append(p)
            print(f"run {run + 1} done (load average {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        provider.terminate()
        provider.wait(10)
    tables = [("this checkout", ours), (f"baseline {args.baseline}", base)] if args.baseline else [("", ours)]
    for title, table in tables:
        print(f"\n{title}" if title else "")
        cluster = any(worker_counts)
        print("| sessions | clients | Switchboard msg/s | p50 ms | p99 ms | CPU ms/msg | bare client msg/s | ratio "
              "| relay (floor) msg/s | relay CPU ms/msg | of the relay's msg/s | CPU × the relay's |"
              + (" Redis CPU ms/msg | x single |" if cluster else ""))
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if cluster else ""))
        for kind, workers, c in ((k, w, c) for k in kinds for w in worker_counts for c in clients):
            ps = table[_row(kind, workers), c]
            rate = med([p.rate for p in ps])
            limit = med([p.rate for p in bare[kind, c]])
            cpus = [p.cpu_ms for p in ps if p.cpu_ms is not None]
            cpu = med(cpus)
            errs = sum(p.errors for p in ps)
            extra = ""
            if cluster:
                single = med([p.cpu_ms for p in table[_row(kind, 0), c] if p.cpu_ms is not None])
                rcpu = [p.redis_cpu_ms for p in ps if p.redis_cpu_ms is not None]
                extra = f" {spread(rcpu)} |" + (f" {cpu / single:.2f} |" if workers else " |")
            print(f"| {_row(kind, workers)} | {c} | {rate:,.0f} | {med([p.p50_ms for p in ps]):.1f} | "
                  f"{med([p.p99_ms for p in ps]):.1f} | {spread(cpus)} | {limit:,.0f} | {rate / limit:.2f} |"
                  + _beside(relay.get(c, []), rate, cpu) + extra + (f" {errs} errors" if errs else ""))
        for c in clients if relay else ():
            ps, limit = relay[c], med([p.rate for p in bare["fresh", c]])
            rate = med([p.rate for p in ps])
            print(f"| relay only (floor) | {c} | {rate:,.0f} | {med([p.p50_ms for p in ps]):.1f} | "
                  f"{med([p.p99_ms for p in ps]):.1f} | {med([p.cpu_ms or 0.0 for p in ps]):.2f} | {limit:,.0f} | "
                  f"{rate / limit:.2f} | | | | |")
        print("\nCPU ms/msg by daemon thread: " + "; ".join(
            f"{_row(kind, workers)} C={c}: " + ", ".join(
                f"{name} {med([(p.threads_ms or {}).get(name, 0.0) for p in table[_row(kind, workers), c]]):.2f}"
                for name in sorted({n for p in table[_row(kind, workers), c] for n in p.threads_ms or {}})
                if med([(p.threads_ms or {}).get(name, 0.0) for p in table[_row(kind, workers), c]]) >= 0.01)
            for kind, workers, c in ((k, w, c) for k in kinds for w in worker_counts for c in clients)))
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    if args.profile:
        for raw in sorted(args.profile.glob("*.txt")):
            print(f"\n## profile {raw.stem}")
            print("\n".join(top_functions(raw)))


if __name__ == "__main__":
    asyncio.run(main())
