"""Turns cut off by a restart are resumed once on the next start; stale or repeated ones are not."""

from __future__ import annotations

from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.tools import ToolRegistry
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.fencing import Fence
from gateway.core.ports import InboundStatus, Outcome
from gateway.core.router import Router
from gateway.core.transcript import ChatMessage
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider
from tests.support.routers import start_router

MARKER = "[interrupted by system: gateway restart]"


async def _router(store: SqliteStore, agent: OpenAIAgent, chat: MemoryChat, max_age: float = 600) -> Router:
    return await start_router(store, agent, chat, resume_max_age_s=max_age)


async def test_a_turn_cut_off_by_a_restart_is_resumed_once_with_the_system_marker(
        store: SqliteStore, chat: MemoryChat, provider: FakeProvider, tools: ToolRegistry) -> None:
    provider.delay_s, provider.words = 0.05, 30
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="m"), tools)
    router = await _router(store, agent, chat)
    await router.submit(chat.message("c1", "tell me everything"), chat)
    await chat.wait_for(lambda: any("reply to" in t for t in chat.texts("c1")))
    await router.shutdown(GATEWAY_RESTART)
    assert chat.texts("c1")[-1].endswith("⏹ interrupted: gateway restart")  # the chat is told, once

    router = await _router(store, agent, chat)
    await chat.wait_for(lambda: len(provider.connections) == 2)
    # Restart again while the resumed turn runs: it is not resumed a second time.
    await chat.wait_for(lambda: len(chat.texts("c1")) == 2)
    await router.shutdown(GATEWAY_RESTART)
    sent = provider.connections[1].body["messages"]
    assert sent[0] == {"role": "user", "content": "tell me everything"}
    assert sent[1]["role"] == "assistant" and sent[1]["content"].endswith(MARKER)
    assert sent[2]["role"] == "user" and sent[2]["content"].startswith(MARKER)

    provider.delay_s = 0
    router = await _router(store, agent, chat)
    run = (await router.submit(chat.message("c1", "ok?"), chat)).run
    assert run is not None
    await run.wait()
    await router.shutdown(GATEWAY_RESTART)
    await agent.close()
    assert len(provider.connections) == 3  # no third resume, just the new message
    assert await store.unfinished_inbound() == []


async def test_a_crash_mid_turn_is_closed_told_and_resumed(
        store: SqliteStore, chat: MemoryChat, provider: FakeProvider, tools: ToolRegistry) -> None:
    msg = chat.message("c1", "what was I saying")
    fence = Fence.local("memory:dm:c1")
    inbound = await store.accept_inbound(fence, msg)
    assert inbound is not None
    await store.append(fence, 1, [ChatMessage("user", msg.text)], inbound=(inbound, InboundStatus.RUNNING, None))
    provider.words = 2
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="m"), tools)
    router = await _router(store, agent, chat)
    await chat.wait_for(lambda: len(chat.texts("c1")) == 2 and chat.texts("c1")[1].endswith("w1 "))
    await router.shutdown(GATEWAY_RESTART)
    await agent.close()
    assert chat.texts("c1")[0] == "⏹ interrupted: gateway stopped before the turn finished"
    sent = provider.connections[0].body["messages"]
    assert sent[1]["content"] == "[interrupted by system: gateway stopped before the turn finished]"


async def test_stale_interruptions_are_not_resumed(store: SqliteStore, chat: MemoryChat, provider: FakeProvider,
                                                   tools: ToolRegistry) -> None:
    provider.delay_s = 0.05
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="m"), tools)
    router = await _router(store, agent, chat)
    await router.submit(chat.message("c1", "long story"), chat)
    await chat.wait_for(lambda: len(provider.connections) == 1)
    await router.shutdown(GATEWAY_RESTART)
    router = await _router(store, agent, chat, max_age=0)
    await router.shutdown(GATEWAY_RESTART)
    await agent.close()
    assert len(provider.connections) == 1
    assert await store.unfinished_inbound() == []


async def test_stop_still_works_while_running_turns_drain(store: SqliteStore, chat: MemoryChat,
                                                          provider: FakeProvider, tools: ToolRegistry) -> None:
    import asyncio

    provider.delay_s, provider.words = 0.05, 200
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="m"), tools)
    router = await _router(store, agent, chat)
    run = (await router.submit(chat.message("c1", "long"), chat)).run
    await chat.wait_for(lambda: len(provider.connections) == 1)
    draining = asyncio.create_task(router.shutdown(GATEWAY_RESTART, drain_s=30))
    await asyncio.sleep(0)  # the shutdown's first step closes intake
    refused = await router.submit(chat.message("c2", "new work"), chat)
    assert "restarting" in refused.detail
    # Not the message's fault: "not now, come back" (503 and Retry-After on the HTTP API), never a rejection.
    assert refused.outcome is Outcome.UNAVAILABLE and refused.retry_after_s
    assert (await router.submit(chat.message("c1", "/stop"), chat)).detail == "Stopped."
    await asyncio.wait_for(draining, 5)
    assert run is not None and run.reason is not None and run.reason.text == "stopped by user (/stop)"
    await agent.close()
