"""Background jobs: how fast a long command moves out of the way when the user writes, and how fast
the end of a job reaches the model.

    python -m tests.bench.jobs
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from gateway.agents.jobs import JobRegistry, JobSettings
from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.processes import ProcessReaper
from gateway.agents.tools import ProcessToolSettings, builtin_registry
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.routers import build_router


async def measure(busy: str, trials: int, data: Path) -> list[str]:
    store = SqliteStore(data / f"{busy}.db")
    await store.open()
    reaper = ProcessReaper(grace_s=0.5)
    jobs = JobRegistry(reaper, JobSettings(yield_after_s=0.1, max_per_session=trials, max_total=trials))
    async with FakeProvider(delay_s=0.0, words=2) as provider:
        agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="fake", retries=0),
                            builtin_registry(ProcessToolSettings(reaper=reaper), shell=True, jobs=jobs))
        chat = MemoryChat()
        router = build_router(store, agent, chat, busy=busy, jobs=jobs)
        await chat.start(router)
        await router.start()
        moved, told = [], []
        try:
            for i in range(trials):
                gate = data / f"{busy}-gate-{i}"
                provider.by_text[f"run {i}"] = Script(tool_calls=[("shell", {
                    "command": f"while [ ! -e {gate} ]; do sleep 0.005; done; echo done"})])
                await router.submit(chat.message(f"c{i}", f"run {i}"), chat)
                while not any(True for _ in jobs._foreground.get(f"memory:dm:c{i}", ())):
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.15)  # older than yield_after_s
                sent = time.perf_counter()
                await router.submit(chat.message(f"c{i}", f"then {i}"), chat)
                while not provider.requests_for(f"then {i}"):
                    await asyncio.sleep(0.0005)
                moved.append((provider.requests_for(f"then {i}")[0].opened_at - sent) * 1000)
                while router.status(f"memory:dm:c{i}").running or router.status(f"memory:dm:c{i}").queued:
                    await asyncio.sleep(0.001)
                ended = time.perf_counter()
                gate.touch()
                while not any(c.last_user.startswith("[background job") and c.opened_at > ended
                              for c in provider.connections):
                    await asyncio.sleep(0.0005)
                notice = next(c for c in provider.connections
                              if c.last_user.startswith("[background job") and c.opened_at > ended)
                told.append((notice.opened_at - ended) * 1000)
                while router.status(f"memory:dm:c{i}").running or router.status(f"memory:dm:c{i}").queued:
                    await asyncio.sleep(0.001)
        finally:
            await router.shutdown(GATEWAY_RESTART)
            await jobs.close()
            await agent.close()
            await reaper.drain()
            await store.close()
    return [f"| busy={busy}: message → model's next request (command moved) | {trials} "
            f"| {statistics.median(moved):.1f} ms | {max(moved):.1f} ms |",
            f"| busy={busy}: job's end (gate file) → model's request for the notice | {trials} "
            f"| {statistics.median(told):.1f} ms | {max(told):.1f} ms |"]


async def main() -> None:
    print("| what | n | p50 | max |\n| --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for busy in ("steer", "interrupt"):
            for line in await measure(busy, 20, Path(tmp)):
                print(line, flush=True)


if __name__ == "__main__":
    asyncio.run(main())
