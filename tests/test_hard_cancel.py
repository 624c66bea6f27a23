"""hard_cancel: per session, per run, with a reason, reaching the provider connection."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from gateway.agents.processes import ProcessReaper
from gateway.core.cancellation import EVICTED, NEW_MESSAGE, STOPPED_BY_USER, ToolReason
from gateway.core.ports import Outcome
from gateway.store.sqlite import SqliteStore
from tests.conftest import RouterFactory
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import until


async def test_stopping_50_of_200_sessions_cancels_exactly_those(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, store: SqliteStore) -> None:
    provider.delay_s, provider.words = 0.03, 40  # each answer streams for over a second
    stopped = set(random.Random(7).sample(range(200), 50))
    for i in stopped:  # these stream for 20 s: still streaming when their /stop comes, however loaded the machine
        provider.by_text[f"hello {i}"] = Script(delay_s=0.5)
    router = await make_router()
    runs = {}
    for i in range(200):
        runs[i] = (await router.submit(chat.message(f"c{i}", f"hello {i}"), chat)).run
    await chat.wait_for(lambda: all(chat.texts(f"c{i}") for i in stopped), timeout=30)  # all streaming
    for i in stopped:
        result = await router.submit(chat.message(f"c{i}", "/stop"), chat)
        assert result.detail == "Stopped."
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in runs.values() if r)), 60)

    by_text = {c.last_user: c for c in provider.connections}
    for i in range(200):
        run, conn = runs[i], by_text[f"hello {i}"]
        assert run is not None
        if i in stopped:
            assert run.reason == STOPPED_BY_USER
            assert not conn.completed
            await provider.wait_closed(conn)  # the provider saw its stream closed
            assert chat.texts(f"c{i}")[-1] == "Stopped."
            assert any(t.endswith("⏹ stopped") for t in chat.texts(f"c{i}"))
        else:
            assert run.reason is None
            assert conn.completed
            assert chat.texts(f"c{i}") == [f"reply to: hello {i} " + " ".join(f"w{n}" for n in range(40)) + " "]
    _, history = await store.conversation("memory:dm:c0")
    assert history[-1].role == "assistant"
    for i in stopped:
        _, history = await store.conversation(f"memory:dm:c{i}")
        assert (history[-1].interrupted_by, history[-1].reason) == ("user", "stopped by user (/stop)")


async def test_stop_with_nothing_running_does_not_swallow_the_next_message(
        make_router: RouterFactory, chat: MemoryChat) -> None:
    router = await make_router()
    assert (await router.submit(chat.message("c1", "/stop"), chat)).detail == "Nothing is running."
    assert router.hard_cancel("memory:dm:c1", STOPPED_BY_USER) is None
    run = (await router.submit(chat.message("c1", "still there?"), chat)).run
    assert run is not None
    await run.wait()
    assert run.reason is None
    assert chat.texts("c1")[-1].startswith("reply to: still there? w0")


async def test_a_cancel_that_lands_before_the_turn_starts_wins(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, store: SqliteStore) -> None:
    router = await make_router()
    # The message is registered synchronously; /stop arrives while it is still being stored.
    message, stop = await asyncio.gather(router.submit(chat.message("c1", "hello"), chat),
                                         router.submit(chat.message("c1", "/stop"), chat))
    assert stop.detail == "Stopped."
    assert message.run is not None
    await message.run.wait()
    assert message.run.reason == STOPPED_BY_USER
    assert message.run.started_at is None  # it never ran
    assert provider.connections == []
    _, history = await store.conversation("memory:dm:c1")
    assert [(m.role, m.content, m.interrupted_by) for m in history] == [
        ("user", "hello", None), ("assistant", "", "user")]


async def test_stop_reaches_a_turn_while_its_lane_is_held(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider) -> None:
    provider.delay_s = 0.5
    router = await make_router(busy="queue")
    first = (await router.submit(chat.message("c1", "one"), chat)).run
    queued = await router.submit(chat.message("c1", "two"), chat)
    assert queued.outcome is Outcome.QUEUED
    assert chat.texts("c1")[-1].startswith("Queued — 1 ahead")
    await chat.wait_for(lambda: len(provider.connections) == 1)
    # The lane's worker is inside turn one and turn two waits behind it; /stop does not wait.
    stop = await asyncio.wait_for(router.submit(chat.message("c1", "/stop"), chat), 0.5)
    assert stop.detail == "Stopped."
    assert first is not None and queued.run is not None
    await asyncio.wait_for(asyncio.gather(first.wait(), queued.run.wait()), 2)
    assert first.reason == queued.run.reason == STOPPED_BY_USER
    assert len(provider.connections) == 1  # the queued turn was dropped, never sent


async def test_a_follow_up_interrupts_and_the_model_sees_the_interrupted_turn(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider) -> None:
    provider.delay_s = 0.05
    router = await make_router()
    first = (await router.submit(chat.message("c1", "tell me a story"), chat)).run
    await chat.wait_for(lambda: any("reply to" in t for t in chat.texts("c1")))
    second = (await router.submit(chat.message("c1", "actually, a poem"), chat)).run
    assert first is not None and second is not None
    await first.wait()
    assert first.reason == NEW_MESSAGE
    await second.wait()
    assert second.reason is None
    sent = provider.requests_for("actually, a poem")[0].body["messages"]
    assert sent[0] == {"role": "user", "content": "tell me a story"}
    assert sent[1]["role"] == "assistant"
    assert sent[1]["content"].startswith("reply to:")
    assert sent[1]["content"].endswith("\n\n[interrupted by user: user sent a new message]")
    assert sent[2] == {"role": "user", "content": "actually, a poem"}


@pytest.mark.parametrize("when_full", ["evict_oldest", "reject"])
async def test_a_full_agent_cache(make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider,
                                  store: SqliteStore, when_full: str) -> None:
    provider.delay_s = 0.05
    router = await make_router(max_agents=2, when_full=when_full)
    a = (await router.submit(chat.message("a", "first"), chat)).run
    await chat.wait_for(lambda: len(provider.connections) == 1)
    b = (await router.submit(chat.message("b", "second"), chat)).run
    await chat.wait_for(lambda: len(provider.connections) == 2)
    c = (await router.submit(chat.message("c", "third"), chat)).run
    assert a is not None and b is not None and c is not None
    await asyncio.wait_for(asyncio.gather(a.wait(), b.wait(), c.wait()), 10)
    assert b.reason is None and chat.texts("b")[-1].startswith("reply to: second")
    if when_full == "evict_oldest":
        assert a.reason == EVICTED
        assert c.reason is None
        assert any(t.endswith("⏹ interrupted: evicted from agent cache") for t in chat.texts("a"))
        # The evicted session lost nothing: its next turn is rebuilt from the store.
        again = (await router.submit(chat.message("a", "and now?"), chat)).run
        assert again is not None
        await again.wait()
        sent = provider.requests_for("and now?")[0].body["messages"]
        assert sent[1]["content"].endswith("[interrupted by system: evicted from agent cache]")
    else:
        assert a.reason is None
        assert "at capacity" in chat.texts("c")[-1]
        assert len(provider.requests_for("third")) == 0


async def test_the_next_request_carries_the_exact_marker_for_an_interrupted_tool_call(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, reaper: ProcessReaper) -> None:
    router = await make_router(turn_timeout_s=0.5)
    provider.then(Script(tool_calls=[("sleep", {"seconds": 30})]))
    run = (await router.submit(chat.message("c1", "wait a bit"), chat)).run
    assert run is not None
    await asyncio.wait_for(run.wait(), 5)
    assert run.reason == ToolReason.system("turn timed out after 0.5 s")
    provider.then(Script(tool_calls=[("sleep", {"seconds": 30})]))
    run = (await router.submit(chat.message("c1", "again"), chat)).run
    await chat.wait_for(lambda: len(provider.connections) == 2)
    await until(lambda: bool(reaper.live_groups), 10, "the sleep tool never started")
    await router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await run.wait()
    await (await router.submit(chat.message("c1", "what happened?"), chat)).run.wait()  # type: ignore[union-attr]
    sent = provider.requests_for("what happened?")[0].body["messages"]
    tools = [m for m in sent if m["role"] == "tool"]
    assert [t["content"] for t in tools] == ["[interrupted by system: turn timed out after 0.5 s]",
                                              "[interrupted by user: stopped by user (/stop)]"]
    calls = [m for m in sent if m.get("tool_calls")]
    assert [c["tool_calls"][0]["id"] for c in calls] == [t["tool_call_id"] for t in tools]


async def test_hard_cancel_demands_a_reason(make_router: RouterFactory) -> None:
    router = await make_router()
    with pytest.raises(TypeError):
        router.hard_cancel("memory:dm:c1")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        router.hard_cancel("memory:dm:c1", None)  # type: ignore[arg-type]


async def test_an_answer_is_shown_whole_only_once_recorded_and_a_stop_meanwhile_finds_nothing_to_stop(
        make_router: RouterFactory, provider: FakeProvider, store: SqliteStore) -> None:
    """The agent's stream has ended while the disk stalls: the chat sees the answer's end only once
    the turn is stored, and a /stop in between says nothing is running — not "Stopped." for an
    answer that is then shown whole and recorded as answered."""
    chat = MemoryChat()
    provider.then(Script(text="one two three four", delay_s=0.3))
    router = await make_router()
    run = (await router.submit(chat.message("c1", "hi"), chat)).run
    assert run is not None
    await chat.wait_for(lambda: len(provider.connections) == 1)  # the user's row is stored by now
    gate = threading.Event()
    stalled = asyncio.ensure_future(store._call(lambda _c: gate.wait(10)))  # the writer thread stalls
    await chat.wait_for(lambda: provider.connections[0].completed)
    await asyncio.sleep(0.1)  # the stream has ended; its record waits for the disk
    assert [t.strip() for t in chat.texts("c1")] == ["one two three"]  # the last words are held back
    assert (await router.submit(chat.message("c1", "/stop"), chat)).detail == "Nothing is running."
    gate.set()
    await stalled
    await run.wait()
    assert run.reason is None
    _, history = await store.conversation("memory:dm:c1")
    assert (history[-1].content.strip(), history[-1].interrupted_by) == ("one two three four", None)
    await chat.wait_for(lambda: "one two three four" in [t.strip() for t in chat.texts("c1")])
