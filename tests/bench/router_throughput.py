"""Router throughput (echo agent, zero delay, 10,000 sessions) and memory per idle cached agent.

Every message goes the whole way: durable inbound record in SQLite, lane, turn task, transcript
rows, reply through an in-memory adapter.

    python -m tests.bench.router_throughput [--event-loop auto|uvloop|asyncio]

It runs on the event loop the daemon would (`daemon.event_loop`, "auto": uvloop where installed).
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
from gateway.core.fencing import Fence
from gateway.core.ports import InboundStatus
from gateway.core.transcript import ChatMessage
from gateway.core.turns import UNCONFIRMED, LiveConversation
from gateway.ops.daemon import tune_gc
from gateway.ops.loop import loop_factory, loop_name
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.support.routers import start_router


class GcClock:
    """CPU time spent in garbage collections (this thread's), from `gc.callbacks`."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._started = 0.0, [0, 0, 0], 0.0
        self.longest = [0.0, 0.0, 0.0]  # the longest pause, by generation

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._tick)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            pause, generation = time.thread_time() - self._started, info["generation"]
            self.seconds += pause
            self.collections[generation] += 1
            self.longest[generation] = max(self.longest[generation], pause)


async def throughput(sessions: int, per_session: int, data: Path) -> tuple[int, float, float, GcClock]:
    store = SqliteStore(data / "bench.db")
    await store.open()
    chat = MemoryChat()
    agent = EchoAgent(builtin_registry(ProcessToolSettings(reaper=ProcessReaper()), shell=False), delay_s=0)
    router = await start_router(store, agent, chat, max_agents=sessions)
    tune_gc()  # as the daemon does after start-up
    try:
        started, cpu = time.perf_counter(), time.process_time()
        with GcClock() as gc_clock:
            for round_ in range(per_session):
                batch = await asyncio.gather(*(router.submit(chat.message(f"s{i}", f"hello number {round_}"), chat)
                                               for i in range(sessions)))
                await asyncio.gather(*(b.run.wait() for b in batch if b.run is not None))
                del batch
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        answered = sum(1 for b in chat.bubbles if b.text.startswith("hello number"))
        assert answered == sessions * per_session, answered
        return answered, elapsed, cpu, gc_clock
    finally:
        await router.shutdown(GATEWAY_RESTART)
        await store.close()


async def store_floor(sessions: int, per_session: int, data: Path) -> float:
    """Messages per second through the store's writes alone, the same the router makes and as
    concurrent: the inbound record with the turn's start (the user's row), the outcome (a chat's
    answer is recorded, then marked done once its end is shown) — one task per message, no routing,
    no agent, no reply, no read (the router reads a session's history once). No router can be
    faster than this."""
    store = SqliteStore(data / "floor.db")
    await store.open()
    chat = MemoryChat()

    async def turn(round_: int, i: int) -> None:
        msg = chat.message(f"s{i}", f"hello number {round_}")
        fence = Fence.local(f"memory:dm:s{i}")
        inbound = await store.accept_inbound(fence, msg, started=(1, ChatMessage("user", msg.text)))
        assert inbound is not None
        await store.append(fence, 1, [ChatMessage("assistant", msg.text)],
                           inbound=(inbound, InboundStatus.RUNNING, UNCONFIRMED))
        await store.finish_inbound(fence, inbound, InboundStatus.DONE)

    try:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        for round_ in range(per_session):
            await asyncio.gather(*(loop.create_task(turn(round_, i)) for i in range(sessions)))
        return sessions * per_session / (time.perf_counter() - started)
    finally:
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
    print(f"event loop: {loop_name(asyncio.get_running_loop())}")
    with tempfile.TemporaryDirectory() as tmp:
        answered, elapsed, cpu, gc_clock = await throughput(sessions, per_session, Path(tmp))
        floor = await store_floor(sessions, per_session, Path(tmp))
    per_agent = memory_per_idle_agent(sessions)
    print("| measure                               | result            | target        |")
    print("|---------------------------------------|-------------------|---------------|")
    print(f"| router throughput ({sessions:,} sessions, echo) | {answered / elapsed:>8,.0f} msg/s    "
          f"| ≥ 10,000 msg/s |")
    print(f"| the store's writes alone (floor)      | {floor:>8,.0f} msg/s    |               |")
    print(f"| messages answered                     | {answered:>8,} in {elapsed:.2f} s | all           |")
    print(f"| CPU per message (process)             | {1000 * cpu / answered:>8.3f} ms       |               |")
    young, middle, full = gc_clock.collections
    print(f"| of it in garbage collection           | {1000 * gc_clock.seconds / answered:>8.3f} ms "
          f"({young} young, {middle} middle, {full} full collections) |               |")
    print(f"| longest pause (young/middle/full)     | {' / '.join(f'{1000 * s:.0f}' for s in gc_clock.longest)} ms"
          f" |               |")
    print(f"| memory per idle cached agent          | {per_agent:>8,.0f} bytes    | ≤ 20 KB       |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--per-session", type=int, default=3)
    parser.add_argument("--event-loop", choices=["auto", "uvloop", "asyncio"], default="auto")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        runner.run(main(args.sessions, args.per_session))
