"""Cluster mode at scale: one worker's coordinator holding 10,000 to 100,000 leases on a private
redis-server — renewal rounds, event-loop blocks, first-message routing while renewing, Redis
memory per lease and per stored message.

    python -m tests.bench.scale [--sizes 10000,50000,100000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from redis.asyncio import Redis

from gateway.cluster.coordinator import Cluster
from gateway.core.fencing import Fence
from gateway.core.metrics import Metrics
from gateway.core.transcript import ChatMessage
from gateway.ops.daemon import tune_gc
from gateway.store.redis import RedisStore, blocking_pool
from tests.support.cluster_events import Working
from tests.support.redis_server import RedisServer

TTL = 30.0
ENGLISH = ("The quick brown fox jumps over the lazy dog while the gateway keeps every session "
           "renewed and every answer streamed. ") * 6
CYRILLIC = ("Съешь же ещё этих мягких французских булок, да выпей чаю — шлюз продлевает каждую "
            "сессию и передаёт каждый ответ. ") * 6


class LoopLag:
    """The longest time the event loop was kept from running a 1 ms timer: wall clock (which includes
    time the OS gave the CPU to other processes) and this thread's own CPU time (the loop's own work)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_cpu = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            before, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - before - 0.001)
            self.worst_cpu = max(self.worst_cpu, time.thread_time() - cpu)

    def __enter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


class GcPauses:
    """The longest garbage collection seen (it holds the loop like any other code)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._began = 0.0

    def __call__(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.worst = max(self.worst, time.perf_counter() - self._began)


async def used_memory(r: Redis) -> int:
    return int((await r.info("memory"))["used_memory"])


async def leases_at(n: int, url: str, r: Redis) -> str:
    await r.flushall()
    base = await used_memory(r)
    cluster = Cluster(Redis.from_pool(blocking_pool(url, decode_responses=True)), "scale", ttl_s=TTL,
                      metrics=Metrics())
    await cluster.start(Working())
    try:
        started = time.perf_counter()
        for chunk in range(0, n, 2000):  # bursts of new sessions, as after a restart
            await asyncio.gather(*(cluster.route(f"telegram:dm:{i}") for i in range(chunk, min(n, chunk + 2000))))
        acquire_rate = n / (time.perf_counter() - started)
        per_lease = (await used_memory(r) - base) / n
        rounds: list[float] = []
        cpus: list[float] = []
        blocks: list[float] = []
        cpu_blocks: list[float] = []
        routes: list[float] = []
        for rnd in range(3):
            with LoopLag() as lag:
                stop = asyncio.Event()

                async def first_messages(tag: str, stop: asyncio.Event) -> None:
                    i = 0
                    while not stop.is_set():  # a new session every 5 ms while the round runs
                        t = time.perf_counter()
                        await cluster.route(f"new:{tag}:{i}")
                        routes.append(time.perf_counter() - t)
                        i += 1
                        await asyncio.sleep(0.005)

                newcomers = asyncio.get_running_loop().create_task(first_messages(f"{n}-{rnd}", stop))
                await asyncio.sleep(0.05)
                t, cpu = time.perf_counter(), time.process_time()
                await cluster.leases.renew_all()
                await cluster.watchlist.refresh()
                rounds.append(time.perf_counter() - t)
                cpus.append(time.process_time() - cpu)
                stop.set()
                await newcomers
            blocks.append(lag.worst)
            cpu_blocks.append(lag.worst_cpu)
        routes.sort()
        p99 = routes[int(len(routes) * 0.99)] * 1000
        return (f"| {n:,} | {statistics.median(rounds):.2f} s | {statistics.median(cpus):.2f} s | "
                f"{max(cpu_blocks) * 1000:.1f} ms ({max(blocks) * 1000:.1f} ms wall) | {p99:.1f} ms | "
                f"{per_lease:.0f} B | {acquire_rate:,.0f}/s |")
    finally:
        cluster.leases.held.clear()  # no release storm: the server is flushed next
        await cluster.stop()


async def bytes_per_message(url: str, r: Redis, text: str, n: int = 2000) -> float:
    await r.flushall()
    store = RedisStore(url)
    await store.open()
    cluster = Cluster(Redis.from_pool(blocking_pool(url, decode_responses=True)), "mem", ttl_s=TTL,
                      metrics=Metrics())
    await cluster.start(Working())
    try:
        route = await cluster.route("telegram:dm:1")
        assert route.fence is not None
        fence: Fence = route.fence
        base = await used_memory(r)
        for i in range(0, n, 100):
            await store.append(fence, 1, [ChatMessage("user" if j % 2 else "assistant", text, created_at=1.7e9 + j)
                                          for j in range(i, i + 100)])
        return (await used_memory(r) - base) / n
    finally:
        await cluster.stop()
        await store.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,50000,100000")
    sizes = [int(x) for x in parser.parse_args().sizes.split(",")]
    tune_gc()  # as the daemon does after start-up
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        r = Redis.from_url(server.url, decode_responses=True)
        try:
            print(f"lease TTL {TTL:g} s (renewed every {TTL / 3:g} s); medians of 3 rounds; load average "
                  f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
            print("| leases held | renewal round (wall) | worker CPU per round | longest loop block "
                  "| p99 first-message routing while renewing | Redis bytes per lease | acquisitions |")
            print("|---|---|---|---|---|---|---|")
            for n in sizes:
                print(await leases_at(n, server.url, r))
            english = await bytes_per_message(server.url, r, ENGLISH)
            cyrillic = await bytes_per_message(server.url, r, CYRILLIC)
            print(f"\nRedis bytes per stored message ({len(ENGLISH)} characters): English {english:,.0f}, "
                  f"Cyrillic {cyrillic:,.0f} (UTF-8 text: {len(ENGLISH.encode())} and {len(CYRILLIC.encode())} bytes)")
        finally:
            await r.aclose()
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
