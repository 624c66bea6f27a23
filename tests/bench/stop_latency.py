"""Stop latency with N concurrent streaming sessions.

From the moment /stop is handed to the router to (a) the turn task done, (b) the provider (a
separate process) seeing its connection closed, (c) the tool's process group gone. Half the
sessions are stopped, 2 ms apart, while all N stream.

(b) is when the provider's kernel reports the hangup (a thread of the fake provider watches its
sockets); (b') when the fake provider's own event loop gets to it, behind the thousand streams it
is writing — that wait is the fake's, not the gateway's, and is printed for comparison.

    python -m tests.bench.stop_latency            # N = 100 and 1000
    python -m tests.bench.stop_latency --n 100
    python -m tests.bench.stop_latency --event-loop asyncio   # default: uvloop where installed, as the daemon
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from gateway.agents.echo import EchoAgent
from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.processes import ProcessReaper
from gateway.agents.tools import ProcessToolSettings, builtin_registry
from gateway.core.cancellation import GATEWAY_RESTART, Run
from gateway.core.router import Router
from gateway.ops.daemon import tune_gc
from gateway.ops.loop import loop_factory
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.support.ports import free_port
from tests.support.routers import start_router

SLEEP_S = 500  # each tool sleeps SLEEP_S + its session's index / 1000 seconds (at most the tool's 600)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def row(name: str, n: int, ms: list[float]) -> str:
    return (f"| {name:<28} | {n:>5} | {len(ms):>5} | {statistics.median(ms):>8.2f} | {pct(ms, 99):>8.2f} "
            f"| {max(ms):>8.2f} |")


async def _stop_some(router: Router, chat: MemoryChat, runs: dict[int, Run], n: int) -> dict[int, float]:
    """Send /stop to half the sessions, 2 ms apart; returns session -> perf_counter at hand-over."""
    chosen = random.Random(1).sample(range(n), n // 2)
    # Every chosen session is streaming when its /stop goes: a stop of a turn that has already
    # ended measures nothing (its streams are long enough for any start-up: see `streaming`).
    idle = [i for i in chosen if runs[i].started_at is None or runs[i].finished]
    assert not idle, f"{len(idle)} chosen sessions were not running when the stops began"
    sent: dict[int, float] = {}
    for i in chosen:
        sent[i] = time.perf_counter()
        result = await router.submit(chat.message(f"s{i}", "/stop"), chat)
        assert result.detail == "Stopped.", result
        await asyncio.sleep(0.002)
    await asyncio.gather(*(runs[i].wait() for i in chosen))
    return sent


async def streaming(n: int, data: Path, notes: list[str]) -> list[str]:
    port = free_port()
    # 20,000 words at 50 ms: 1,000 s a stream, far longer than starting N of them takes on any machine.
    provider = subprocess.Popen([sys.executable, "-m", "tests.fakes.openai_provider", "--port", str(port),
                                 "--delay", "0.05", "--words", "20000", "--watch-hangups"], stdout=subprocess.PIPE)
    assert provider.stdout is not None
    provider.stdout.readline()
    store = SqliteStore(data / f"stream{n}.db")
    await store.open()
    reaper = ProcessReaper()
    agent = OpenAIAgent(OpenAISettings(base_url=f"http://127.0.0.1:{port}/v1", model="fake"),
                        builtin_registry(ProcessToolSettings(reaper=reaper), shell=False))
    chat = MemoryChat(edit_interval_s=0.25)
    router = await start_router(store, agent, chat, max_agents=n)
    tune_gc()  # as the daemon does after start-up
    try:
        runs: dict[int, Run] = {}
        for i in range(n):
            run = (await router.submit(chat.message(f"s{i}", f"hello {i}"), chat)).run
            assert run is not None
            runs[i] = run
        # Every session has shown text before any stop: up to 5 minutes for a slow machine to start
        # them, well within the streams' 1,000 s.
        await chat.wait_for(lambda: all(chat.texts(f"s{i}") for i in range(n)), timeout=300)
        notes.append(f"N = {n}: " + await _streaming_cpu(f"http://127.0.0.1:{port}/_connections"))
        sent = await _stop_some(router, chat, runs, n)
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/_connections") as resp:
            seen = {c["last_user"]: c for c in await resp.json()}
        cancel_ms = [((runs[i].cancelled_at or 0) - t) * 1000 for i, t in sent.items()]
        task_ms = [(runs[i].done_at or 0) * 1000 - t * 1000 for i, t in sent.items()]
        hangup_ms = [(seen[f"hello {i}"]["hangup_at"] - t) * 1000 for i, t in sent.items()]
        loop_ms = [(seen[f"hello {i}"]["closed_at"] - t) * 1000 for i, t in sent.items()]
        first = sum(h < c for h, c in zip(hangup_ms, loop_ms, strict=True))
        notes.append(f"N = {n}: the kernel's hangup was seen before the provider's loop saw the close in "
                     f"{first} of {len(sent)} stops (the rest: (b) is the loop's time)")
        return [row("(a0) run cancelled", n, cancel_ms), row("(a) turn task done", n, task_ms),
                row("(b) provider sees close", n, hangup_ms), row("(b') provider's loop sees it", n, loop_ms)]
    finally:
        await router.shutdown(GATEWAY_RESTART)
        await agent.close()
        await store.close()
        provider.terminate()
        provider.wait()


async def _streaming_cpu(stats_url: str, seconds: float = 2.0) -> str:
    """This process's CPU while every session streams (before any stop): per provider delta, and
    as a share of one core — the event loop's load, which a stop waits behind."""

    async def words() -> int:
        async with aiohttp.ClientSession() as http, http.get(stats_url) as resp:
            return sum(c["words"] for c in await resp.json())

    before, cpu, wall = await words(), time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    deltas = await words() - before
    return (f"streaming {deltas / wall:,.0f} deltas/s, CPU {cpu / wall * 100:.0f} % of a core, "
            f"{cpu / max(1, deltas) * 1e6:.1f} µs per delta")


async def tools(n: int, data: Path) -> list[str]:
    store = SqliteStore(data / f"tools{n}.db")
    await store.open()
    reaper = ProcessReaper(grace_s=2.0)
    chat = MemoryChat()
    router = await start_router(store, EchoAgent(builtin_registry(ProcessToolSettings(reaper=reaper), shell=False),
                                                 delay_s=0), chat, max_agents=n)
    tune_gc()  # as the daemon does after start-up
    loop = asyncio.get_running_loop()
    gone_at: dict[int, float] = {}
    try:
        runs: dict[int, Run] = {}
        for i in range(n):
            # 500 s: far longer than starting N tool processes takes (up to 5 minutes, `_sleep_pids`).
            run = (await router.submit(chat.message(f"s{i}", f"!sleep {SLEEP_S + i / 1000:g}"), chat)).run
            assert run is not None
            runs[i] = run
        pids = await _sleep_pids(n)
        fds: dict[int, int] = {}

        def ended(i: int) -> None:
            gone_at.setdefault(i, time.perf_counter())

        for i, pid in pids.items():  # a pidfd turns readable the moment its process ends
            fds[i] = fd = os.pidfd_open(pid)
            loop.add_reader(fd, ended, i)
        sent = await _stop_some(router, chat, runs, n)
        deadline = time.monotonic() + 10
        while any(i not in gone_at for i in sent) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for fd in fds.values():
            loop.remove_reader(fd)
            os.close(fd)
        return [row("(c) tool group gone", n, [(gone_at[i] - t) * 1000 for i, t in sent.items()])]
    finally:
        await router.shutdown(GATEWAY_RESTART)
        await reaper.drain()
        await store.close()


async def _sleep_pids(n: int) -> dict[int, int]:
    """Session index -> pid of its `sleep 500.i` tool process (children of this process)."""
    me = str(os.getpid())
    for _ in range(3000):
        found: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if stat[1] == me and argv[0] == b"sleep" and len(argv) > 1:
                found[round((float(argv[1]) - SLEEP_S) * 1000)] = int(entry.name)
        if len(found) == n:
            return found
        await asyncio.sleep(0.1)
    raise RuntimeError(f"only {len(found)} of {n} tool processes started")


async def main(sizes: list[int]) -> None:
    lines = ["| measure                      |     N | stops |  p50 ms |  p99 ms |  max ms |",
             "|------------------------------|------:|------:|--------:|--------:|--------:|"]
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            lines += await streaming(n, Path(tmp), notes)
            lines += await tools(n, Path(tmp))
    print("\n".join(["\n".join(lines), "", *notes]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, action="append", help="concurrent sessions (repeatable)")
    parser.add_argument("--event-loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                        help="the loop to run on; auto, as the daemon: uvloop where installed")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        runner.run(main(args.n or [100, 1000]))
