"""The agent loop's own costs: how fast a steered message reaches the model, and what fitting a long
conversation into the context budget costs.

    python -m tests.bench.agent_loop
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.processes import ProcessReaper
from gateway.agents.tools import ProcessToolSettings, builtin_registry
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.context import fit
from gateway.core.transcript import ChatMessage, ToolCall
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider
from tests.support.routers import start_router


async def steer_latency(trials: int, data: Path) -> str:
    """A message sent while a 10-word answer streams (20 ms a word): from the message to the model's
    next request, and from the end of the answer's stream (the boundary) to that request."""
    store = SqliteStore(data / "steer.db")
    await store.open()
    async with FakeProvider(delay_s=0.02, words=10) as provider:
        agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="fake", retries=0),
                            builtin_registry(ProcessToolSettings(reaper=ProcessReaper()), shell=False))
        chat = MemoryChat()
        router = await start_router(store, agent, chat, busy="steer")
        from_message, from_boundary = [], []
        try:
            for i in range(trials):
                first = await router.submit(chat.message(f"s{i}", f"first {i}"), chat)
                while not provider.requests_for(f"first {i}") or not chat.texts(f"s{i}"):
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.05 + (i % 5) * 0.02)
                sent = time.perf_counter()
                added = await router.submit(chat.message(f"s{i}", f"then {i}"), chat)
                assert added.outcome.value == "steered", added
                while len([c for c in provider.connections if c.last_user == f"then {i}"]) == 0:
                    await asyncio.sleep(0.0005)
                nxt = next(c for c in provider.connections if c.last_user == f"then {i}")
                boundary = provider.requests_for(f"first {i}")[0].completed_at or nxt.opened_at
                from_message.append((nxt.opened_at - sent) * 1000)
                from_boundary.append((nxt.opened_at - boundary) * 1000)
                assert first.run is not None
                await first.run.wait()
        finally:
            await router.shutdown(GATEWAY_RESTART)
            await agent.close()
            await store.close()
    return (f"| steered message → model's next request | {trials} | {statistics.median(from_message):.1f} ms "
            f"| {max(from_message):.1f} ms |\n"
            f"| end of the answer's stream → that request | {trials} | {statistics.median(from_boundary):.2f} ms "
            f"| {max(from_boundary):.2f} ms |")


def budget_cost(messages: int, repeat: int = 200) -> str:
    rows: list[ChatMessage] = []
    for i in range(messages // 4):
        call = ToolCall(f"c{i}", "shell", '{"command": "ls -l"}')
        rows += [ChatMessage("user", f"question {i} about the project"),
                 ChatMessage("assistant", "", tool_calls=(call,)),
                 ChatMessage("tool", "file\n" * 60, tool_call_id=call.id),
                 ChatMessage("assistant", f"answer {i}: " + "words " * 40)]
    new = ChatMessage("user", "and now?")
    started = time.perf_counter()
    for _ in range(repeat):
        fitted = fit(rows, new, budget_tokens=28_000, system_prompt="You are helpful.")
    per_call = (time.perf_counter() - started) / repeat * 1_000_000
    return (f"| {len(rows):,} messages | {per_call:,.0f} µs | {len(fitted.messages)} sent, "
            f"~{fitted.estimated_tokens:,} tokens, {fitted.left_out:,} left out |")


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print("| steering | trials | median | max |")
        print("|---|---|---|---|")
        print(await steer_latency(40, Path(tmp)))
    print()
    print("| history | fitting into a 28,000-token budget, per request | what is sent |")
    print("|---|---|---|")
    for n in (100, 1_000, 10_000):
        print(budget_cost(n))


if __name__ == "__main__":
    asyncio.run(main())
