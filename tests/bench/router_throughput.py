"""Router throughput (echo agent, zero delay, 10,000 sessions) and memory per idle cached agent.

Every message goes the whole way: durable inbound record in SQLite, lane, turn task, transcript
rows, reply through an in-memory adapter.

    python -m tests.bench.router_throughput
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
import tracemalloc
from pathlib import Path

from agent_cache import AgentCache
from gateway.agents.echo import EchoAgent
from gateway.agents.processes import ProcessReaper
from gateway.agents.tools import ProcessToolSettings, builtin_registry
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.turns import LiveConversation
from gateway.ops.daemon import tune_gc
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.routers import start_router


class GcClock:
    """CPU time spent in garbage collections (this thread's), from `gc.callbacks`."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._started = 0.0, [0, 0, 0], 0.0

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._tick)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._started
            self.collections[info["generation"]] += 1


async def throughput(sessions: int, per_session: int, data: Path) -> tuple[int, float, float, GcClock]:
    store = SqliteStore(data / "bench.db")
    await store.open()
    chat = MemoryChat()
    agent = EchoAgent(builtin_registry(ProcessToolSettings(reaper=ProcessReaper()), shell=False), delay_s=0)
    router = await start_router(store, agent, chat, max_agents=sessions)
    tune_gc()  # as the daemon does after start-up
    try:
        runs = []
        started, cpu = time.perf_counter(), time.process_time()
        with GcClock() as gc_clock:
            for round_ in range(per_session):
                batch = await asyncio.gather(*(router.submit(chat.message(f"s{i}", f"hello number {round_}"), chat)
                                               for i in range(sessions)))
                runs += [b.run for b in batch if b.run is not None]
                await asyncio.gather(*(r.wait() for r in runs[-sessions:]))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        answered = sum(1 for b in chat.bubbles if b.text.startswith("hello number"))
        assert answered == sessions * per_session, answered
        return answered, elapsed, cpu, gc_clock
    finally:
        await router.shutdown(GATEWAY_RESTART)
        await store.close()


def memory_per_idle_agent(count: int) -> float:
    """Bytes per idle cached agent: cache entry + per-session agent, history list empty."""
    cache: AgentCache[LiveConversation] = AgentCache(max_agents=count)
    keys = [f"telegram:dm:{1_000_000_000 + i}" for i in range(count)]  # keys exist either way
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for key in keys:
        cache.put(key, LiveConversation(key, 1, []))
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    total = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return total / count


async def main(sessions: int, per_session: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        answered, elapsed, cpu, gc_clock = await throughput(sessions, per_session, Path(tmp))
    per_agent = memory_per_idle_agent(sessions)
    print("| measure                               | result            | target        |")
    print("|---------------------------------------|-------------------|---------------|")
    print(f"| router throughput ({sessions:,} sessions, echo) | {answered / elapsed:>8,.0f} msg/s    "
          f"| ≥ 10,000 msg/s |")
    print(f"| messages answered                     | {answered:>8,} in {elapsed:.2f} s | all           |")
    print(f"| CPU per message (process)             | {1000 * cpu / answered:>8.3f} ms       |               |")
    young, middle, full = gc_clock.collections
    print(f"| of it in garbage collection           | {1000 * gc_clock.seconds / answered:>8.3f} ms "
          f"({young} young, {middle} middle, {full} full collections) |               |")
    print(f"| memory per idle cached agent          | {per_agent:>8,.0f} bytes    | ≤ 20 KB       |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--per-session", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.sessions, args.per_session))
