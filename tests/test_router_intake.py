"""Every message ends processed, queued (with an ack) or rejected with a reason; bad input hurts nobody."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.tools import ToolRegistry
from gateway.core import access
from gateway.core.access import AccessControl, AccessPolicy
from gateway.core.attachments import Attachment
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.messages import ChatType
from gateway.core.ports import Outcome
from gateway.store.sqlite import SqliteStore
from tests.conftest import RouterFactory, free_port
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.routers import start_router


@pytest.mark.parametrize(("text", "needle"), [
    ("", "empty"), ("   \n", "empty"), ("x" * 16_001, "too long (16001 characters; the limit is 16000)"),
    ("bin\x00ary", "binary"), ("/frobnicate", "Unknown command /frobnicate"),
])
async def test_bad_input_is_rejected_with_a_reason_and_others_keep_going(
        make_router: RouterFactory, chat: MemoryChat, text: str, needle: str) -> None:
    router = await make_router()
    other = (await router.submit(chat.message("other", "keep going"), chat)).run
    result = await router.submit(chat.message("c1", text), chat)
    assert result.outcome is Outcome.REJECTED and needle in result.detail
    assert needle in chat.texts("c1")[-1]
    assert other is not None
    await other.wait()
    assert other.reason is None and chat.texts("other")[-1].startswith("reply to: keep going")


async def test_a_redelivered_message_is_answered_once(make_router: RouterFactory, chat: MemoryChat,
                                                     provider: FakeProvider) -> None:
    router = await make_router()
    msg = chat.message("c1", "once please", mid="tg-42")
    first, again = await router.submit(msg, chat), await router.submit(msg, chat)
    assert (first.outcome, again.outcome) == (Outcome.ACCEPTED, Outcome.DUPLICATE)
    assert first.run is not None
    await first.run.wait()
    assert len(provider.requests_for("once please")) == 1


async def test_dedup_survives_a_restart_through_the_store(store: SqliteStore, chat: MemoryChat,
                                                          provider: FakeProvider, tools: ToolRegistry) -> None:
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="m"), tools)
    msg = chat.message("c1", "hello", mid="tg-7")
    for expected in (Outcome.ACCEPTED, Outcome.DUPLICATE):  # two router lifetimes, one store
        router = await start_router(store, agent, chat)
        result = await router.submit(msg, chat)
        assert result.outcome is expected
        if result.run:
            await result.run.wait()
        await router.shutdown(GATEWAY_RESTART)
    await agent.close()
    assert len(provider.requests_for("hello")) == 1


async def test_messages_accepted_but_never_run_are_replayed_after_a_restart(
        store: SqliteStore, chat: MemoryChat, provider: FakeProvider, tools: ToolRegistry) -> None:
    provider.delay_s = 0.2
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="m"), tools)
    router = await start_router(store, agent, chat, busy="queue")
    await router.submit(chat.message("c1", "first"), chat)
    queued = await router.submit(chat.message("c1", "second"), chat)
    assert queued.outcome is Outcome.QUEUED
    await chat.wait_for(lambda: bool(provider.connections))  # "first" runs
    await router.shutdown(GATEWAY_RESTART)  # "first" is cut off (resumed); "second" never ran
    provider.delay_s = 0.0
    router = await start_router(store, agent, chat)
    await chat.wait_for(lambda: any(t.startswith("reply to: second") and t.endswith("w19 ") for t in chat.texts("c1")))
    deadline = time.monotonic() + 10
    while await store.unfinished_inbound():
        assert time.monotonic() < deadline, "the replayed message was never closed"
        await asyncio.sleep(0.01)
    await router.shutdown(GATEWAY_RESTART)
    await agent.close()
    _, history = await store.conversation("memory:dm:c1")
    assert [(m.role, m.content[:15], m.reason) for m in history] == [
        ("user", "first", None), ("assistant", "", "gateway restart"),
        ("user", "[interrupted by", None), ("assistant", "reply to:  w0 w", None),  # "first", resumed
        ("user", "second", None), ("assistant", "reply to: secon", None)]
    assert await store.unfinished_inbound() == []


async def test_queue_policy_acks_and_answers_in_order(make_router: RouterFactory, chat: MemoryChat,
                                                      provider: FakeProvider) -> None:
    provider.words = 2
    router = await make_router(busy="queue")
    runs = [(await router.submit(chat.message("c1", f"q{i}"), chat)) for i in range(3)]
    assert [r.outcome for r in runs] == [Outcome.ACCEPTED, Outcome.QUEUED, Outcome.QUEUED]
    await asyncio.gather(*(r.run.wait() for r in runs if r.run))
    texts = chat.texts("c1")
    assert texts[0].startswith("Queued — 1 ahead") and texts[1].startswith("Queued — 2 ahead")
    assert [t[:12] for t in texts[2:]] == ["reply to: q0", "reply to: q1", "reply to: q2"]


async def test_a_message_that_arrives_late_does_not_cut_off_the_answer_to_a_newer_one(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider) -> None:
    """Under `interrupt`, an older message held up on its way (a forward to a paused worker) waits
    behind the newer one instead of stopping it: both are answered, in arrival order."""
    provider.delay_s, provider.words = 0.02, 10
    router = await make_router()
    newer = chat.message("c1", "second", mid="12")
    older = chat.message("c1", "first", mid="11")
    object.__setattr__(older, "timestamp", newer.timestamp - 1)
    first = await router.submit(newer, chat)
    late = await router.submit(older, chat)
    assert (first.outcome, late.outcome) == (Outcome.ACCEPTED, Outcome.QUEUED)
    assert first.run is not None and late.run is not None
    await asyncio.gather(first.run.wait(), late.run.wait())
    assert first.run.reason is None and late.run.reason is None
    replies = [t for t in chat.texts("c1") if t.startswith("reply to:")]
    assert [t[:16] for t in replies] == ["reply to: second", "reply to: first "]
    # A follow-up the user sends now interrupts as usual.
    third = await router.submit(chat.message("c1", "third", mid="13"), chat)
    assert third.outcome is Outcome.ACCEPTED


async def test_status_and_new_keep_the_old_conversation_archived(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, store: SqliteStore) -> None:
    provider.delay_s = 0.05
    router = await make_router()
    idle = (await router.submit(chat.message("c1", "/status"), chat)).detail
    assert idle == "Idle · queued: 0 · busy: interrupt · agent: openai:fake"
    run = (await router.submit(chat.message("c1", "remember me"), chat)).run
    await chat.wait_for(lambda: len(provider.connections) == 1)
    status = (await router.submit(chat.message("c1", "/status"), chat)).detail
    assert status.startswith("Running since ") and status.endswith("queued: 0 · busy: interrupt · agent: openai:fake")
    assert (await router.submit(chat.message("c1", "/new"), chat)).detail.startswith("Started a new conversation")
    assert run is not None
    await run.wait()
    assert run.reason is not None and run.reason.text == "session reset (/new)"
    done = (await router.submit(chat.message("c1", "who am I?"), chat)).run
    assert done is not None
    await done.wait()
    assert provider.requests_for("who am I?")[0].body["messages"] == [{"role": "user", "content": "who am I?"}]
    conversation, history = await store.conversation("memory:dm:c1")
    assert conversation == 2 and history[0].content == "who am I?"
    assert (await router.submit(chat.message("c1", "/help"), chat)).detail.startswith("Commands:")


async def test_group_sessions_split_by_thread_and_optionally_by_user(make_router: RouterFactory,
                                                                     chat: MemoryChat) -> None:
    shared = await make_router(agent="echo")
    split = await make_router(agent="echo", per_user_in_groups=True)
    for router, key in ((shared, "memory:group:g1:t3"), (split, "memory:group:g1:t3:u7")):
        msg = chat.message("g1", "hi", user="u7", chat_type=ChatType.GROUP, thread_id="t3")
        result = await router.submit(msg, chat)
        assert result.run is not None and result.run.session_key == key
        await result.run.wait()


@pytest.mark.parametrize(("script", "needle"), [
    (Script(status=500), "HTTP 500"),
    (Script(garbage=True), "malformed"),
    (Script(status=400), "HTTP 400"),
])
async def test_provider_failures_reach_the_user_in_words(make_router: RouterFactory, chat: MemoryChat,
                                                         provider: FakeProvider, script: Script, needle: str) -> None:
    router = await make_router()
    for _ in range(3):  # retries included
        provider.then(script)
    run = (await router.submit(chat.message("c1", "hello"), chat)).run
    assert run is not None
    await run.wait()
    assert needle in chat.texts("c1")[-1] and chat.texts("c1")[-1].startswith("⚠️ The agent failed")
    provider.scripts.clear()
    ok = (await router.submit(chat.message("c1", "again"), chat)).run
    assert ok is not None
    await ok.wait()
    assert chat.texts("c1")[-1].startswith("reply to: again")


async def test_a_provider_that_is_down_is_reported_and_retried(store: SqliteStore, chat: MemoryChat,
                                                               tools: ToolRegistry) -> None:
    agent = OpenAIAgent(OpenAISettings(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", retries=2,
                                       backoff_s=0.01), tools)
    router = await start_router(store, agent, chat)
    run = (await router.submit(chat.message("c1", "anyone?"), chat)).run
    assert run is not None
    await run.wait()
    assert "unreachable" in chat.texts("c1")[-1]
    await router.shutdown(GATEWAY_RESTART)
    await agent.close()


async def test_a_non_streaming_provider_answer_is_accepted(make_router: RouterFactory, chat: MemoryChat,
                                                           provider: FakeProvider) -> None:
    router = await make_router()
    provider.then(Script(text="plain json", json_only=True))
    run = (await router.submit(chat.message("c1", "hi"), chat)).run
    assert run is not None
    await run.wait()
    assert chat.texts("c1") == ["plain json"]


async def test_a_flooding_user_gets_one_notice_then_silence_but_commands_still_work(
        make_router: RouterFactory, chat: MemoryChat) -> None:
    router = await make_router(agent="echo", messages_per_minute=2)
    submitted = [await router.submit(chat.message("c1", f"m{i}", user="flood"), chat) for i in range(4)]
    assert [s.outcome for s in submitted] == [Outcome.ACCEPTED, Outcome.ACCEPTED, Outcome.LIMITED, Outcome.LIMITED]
    # A refusal says when the same message would be taken (the HTTP API's 429 and Retry-After).
    assert [s.retry_after_s is not None and 55 < s.retry_after_s <= 60 for s in submitted] == [False, False, True, True]
    notices = [t for t in chat.texts("c1") if "faster than I can take them" in t]
    assert len(notices) == 1
    assert (await router.submit(chat.message("c1", "/status", user="flood"), chat)).outcome is Outcome.COMMAND
    other = await router.submit(chat.message("c2", "hello", user="calm"), chat)
    assert other.outcome is Outcome.ACCEPTED


async def test_refused_strangers_are_remembered_only_as_long_as_their_notice_is_throttled(
        store: SqliteStore, chat: MemoryChat, monkeypatch: pytest.MonkeyPatch) -> None:
    """One notice per stranger per interval; past it they are forgotten, so a stream of new
    strangers costs memory for the last interval's only."""
    monkeypatch.setattr(access, "NOTICE_EVERY_S", 0.2)
    control = AccessControl(store, {"memory": AccessPolicy("allowlist", frozenset({"friend"}))})
    for i in range(100):
        assert (await control.check(chat.message("c", "hi", user=f"stranger{i}")))[1] is not None
    assert await control.check(chat.message("c", "again", user="stranger0")) == (False, None)  # throttled
    assert await control.check(chat.message("c", "hi", user="friend")) == (True, None)
    await asyncio.sleep(0.25)
    assert (await control.check(chat.message("c", "hi", user="late")))[1] is not None
    assert list(control._last_notice) == [("memory", "late")]
    assert (await control.check(chat.message("c", "again", user="stranger0")))[1] is not None  # told again


async def test_a_strangers_flood_costs_one_pairing_write_per_notice_and_approval_still_acts_at_once(
        tmp_path: Path, chat: MemoryChat) -> None:
    class CountingStore(SqliteStore):  # the real store; only its pairing writes are counted
        codes = 0

        async def pairing_code(self, *args: Any, **kwargs: Any) -> str | None:
            self.codes += 1
            return await super().pairing_code(*args, **kwargs)

    store = CountingStore(tmp_path / "count.db")
    await store.open()
    try:
        control = AccessControl(store, {"memory": AccessPolicy("pairing")})
        allowed, notice = await control.check(chat.message("c", "hi", user="zoe"))
        assert not allowed and notice is not None and "pairing code" in notice
        for i in range(50):
            assert await control.check(chat.message("c", f"flood {i}", user="zoe")) == (False, None)
        assert store.codes == 1
        assert await store.approve_pairing(notice.rsplit(" ", 1)[1], ttl_s=access.CODE_TTL_S) is not None
        assert await control.check(chat.message("c", "hello again", user="zoe")) == (True, None)
    finally:
        await store.close()


async def test_what_a_session_last_heard_keeps_no_attachment_bytes(make_router: RouterFactory,
                                                                    chat: MemoryChat) -> None:
    """The router remembers each session's last chat (where a background job's end is told), not
    the message itself: 20 sessions that sent 200 KB inline files leave none of those bytes behind."""
    router = await make_router(agent="echo")

    async def send(i: int) -> None:
        upload = Attachment("file", "notes.txt", "text/plain", 200_000, f"sha256:{i}", data=bytes(200_000))
        msg = dataclasses.replace(chat.message(f"f{i}", "read this"), attachments=(upload,))
        sub = await router.submit(msg, chat)
        assert sub.run is not None
        await asyncio.wait_for(sub.run.wait(), 10)

    await send(-1)  # warm up: first-use allocations are not what is measured
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20):
            await send(i)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1_000_000, kept  # 4 MB were sent
