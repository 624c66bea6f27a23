"""Turns cut off by a restart are resumed once on the next start; stale or repeated ones are not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.agents.echo import EchoAgent
from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.tools import ToolRegistry
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.fencing import Fence
from gateway.core.ports import Agent, InboundStatus, Outcome
from gateway.core.router import Router
from gateway.core.transcript import AgentEvent, ChatMessage, TextDelta, ToolResult, without_prompt
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider
from tests.support.routers import start_router

MARKER = "[interrupted by system: gateway restart]"


async def _router(store: SqliteStore, agent: Agent, chat: MemoryChat, max_age: float = 600) -> Router:
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


async def test_the_echo_agent_continues_after_a_restart_without_repeating_the_resume_prompt(
        store: SqliteStore, chat: MemoryChat, tools: ToolRegistry) -> None:
    agent = EchoAgent(tools, delay_s=0.05)
    words = " ".join(f"word{i}" for i in range(30))
    router = await _router(store, agent, chat)
    await router.submit(chat.message("c1", words), chat)
    await chat.wait_for(lambda: any("word3" in t for t in chat.texts("c1")))
    await router.shutdown(GATEWAY_RESTART)
    cut = chat.texts("c1")[-1].removesuffix("\n\n⏹ interrupted: gateway restart")
    router = await _router(store, agent, chat)
    await chat.wait_for(lambda: any("word29" in t for t in chat.texts("c1")), timeout=10)
    await router.shutdown(GATEWAY_RESTART)
    resumed = chat.texts("c1")[-1]
    assert "restart" not in resumed and "[" not in resumed  # the internal prompt never reaches the user
    assert f"{cut.rstrip()} {resumed.strip()}".split() == words.split()  # it went on where it stopped


async def test_no_agent_shows_the_internal_prompt_it_is_given(
        store: SqliteStore, chat: MemoryChat, provider: FakeProvider, tools: ToolRegistry) -> None:
    """The fake provider answers "reply to: <the last user text>": after a restart that is the
    resume prompt, which the user is never shown; the transcript keeps what the chat showed."""
    provider.delay_s, provider.words = 0.05, 30
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="m"), tools)
    router = await _router(store, agent, chat)
    await router.submit(chat.message("c1", "tell me everything"), chat)
    await chat.wait_for(lambda: any("w3" in t for t in chat.texts("c1")))
    await router.shutdown(GATEWAY_RESTART)
    provider.delay_s, provider.words = 0.0, 3
    router = await _router(store, agent, chat)
    await chat.wait_for(lambda: len(provider.connections) == 2 and any(t.endswith("w2 ") for t in chat.texts("c1")))
    await router.shutdown(GATEWAY_RESTART)
    await agent.close()
    resumed = chat.texts("c1")[-1]
    assert resumed.startswith("reply to:") and "restart" not in resumed and "Continue" not in resumed
    _, history = await store.conversation("memory:dm:c1")
    assert history[-1].content == resumed


async def test_without_prompt_holds_what_may_be_the_prompt_and_drops_whole_copies() -> None:
    async def events(*texts: str) -> AsyncIterator[AgentEvent]:
        for text in texts:
            yield TextDelta(text) if text != "|" else ToolResult("c", "x")

    async def shown(*texts: str) -> list[str]:
        return [e.text if isinstance(e, TextDelta) else "|" async for e in without_prompt(events(*texts), "[ask]")]

    assert await shown("[a", "sk] ok") == [" ok"]
    assert await shown("a [", "b") == ["a ", "[b"]  # held while it could be the prompt, then shown
    assert await shown("x [as", "|", "y") == ["x ", "[as", "|", "y"]  # a boundary releases what was held
    assert "".join(await shown("[", "a", "s", "k", "]", "!")) == "!"
