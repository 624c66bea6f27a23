"""Acknowledged means stored; shown whole means recorded — with the store failing under a turn.

The faults are real: SQLite's own "database or disk is full" (the store's connection limited to
the pages it has), a store that refuses a write during adoption.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from gateway.agents.echo import EchoAgent
from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.tools import Tool, ToolRegistry
from gateway.core import turns
from gateway.core.cancellation import GATEWAY_RESTART, NOT_RECORDED
from gateway.core.fencing import Fence
from gateway.core.messages import InboundMessage, session_key
from gateway.core.ports import FencedOut, InboundStatus, Outcome, StoreError
from gateway.core.transcript import ChatMessage
from gateway.store.sqlite import SqliteStore
from tests.conftest import RouterFactory
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.routers import build_router


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _fill(store: SqliteStore) -> None:
    """From now on the database is full: its connection may use no page beyond those it has."""

    def limit(conn: sqlite3.Connection) -> None:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")
        # Big rows need new pages: the next transcript write hits "database or disk is full".

    store._ops.put((limit, store._loop.create_future()))  # type: ignore[union-attr]


async def test_an_answer_whose_record_never_lands_is_cut_with_the_reason_not_shown_whole(
        make_router: RouterFactory, store: SqliteStore, provider: FakeProvider, chat: MemoryChat,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns, "WRITE_RETRY_S", 0.3)
    answer = " ".join(["word"] * 2000)  # a row that needs new pages
    provider.by_text["fill"] = Script(text=answer, delay_s=0.001)
    router = await make_router()
    msg = chat.message("c1", "fill")
    submitted = await router.submit(msg, chat)
    assert submitted.run is not None
    await _until(lambda: bool(provider.connections) and provider.connections[-1].words >= 5)  # the user's row is in
    _fill(store)
    await submitted.run.wait()
    shown = " ".join(chat.texts("c1"))
    assert "could not be stored" in shown, shown
    assert answer not in shown  # the held-back end never reached the chat: the answer is not shown whole
    # The store says the same: no answer row, and the message is not marked answered.
    _, history = await store.conversation(submitted.run.session_key)
    assert [m.role for m in history] == ["user"]
    records = await store.unfinished_inbound(submitted.run.session_key)
    assert [r.status for r in records] == [InboundStatus.RUNNING]  # open: a restart closes and resumes it
    assert router.status(submitted.run.session_key).running is False
    assert NOT_RECORDED.text in shown


class _RefusingStore(SqliteStore):
    """The store as another worker's newer fence makes it: every write for the session refused."""

    async def finish_inbound(self, *args: object, **kwargs: object) -> None:
        raise FencedOut("a newer fence holds this session")

    async def append(self, *args: object, **kwargs: object) -> None:
        raise FencedOut("a newer fence holds this session")


async def test_a_write_refused_during_adoption_never_escapes_to_whoever_routed_the_message(
        tmp_path: Path, chat: MemoryChat) -> None:
    seed = SqliteStore(tmp_path / "s.db")
    await seed.open()
    msg = chat.message("c1", "left open by a dead worker")
    key = session_key(msg)
    inbound_id = await seed.accept_inbound(Fence.local(key), msg)
    assert inbound_id is not None
    await seed.finish_inbound(Fence.local(key), inbound_id, InboundStatus.RUNNING, None)
    await seed.close()
    store = _RefusingStore(tmp_path / "s.db")
    await store.open()
    router = build_router(store, EchoAgent(ToolRegistry()), chat)
    await chat.start(router)
    try:
        await router.cluster_events().adopted(key)  # raised FencedOut before
        assert [r.status for r in await store.unfinished_inbound(key)] == [InboundStatus.RUNNING]
    finally:
        await router.shutdown(GATEWAY_RESTART, grace_s=1)
        await store.close()


async def test_a_stopped_run_opens_no_new_provider_request_even_when_a_tool_swallows_its_cancel(
        make_router: RouterFactory, tools: ToolRegistry, provider: FakeProvider, chat: MemoryChat) -> None:
    entered = asyncio.Event()

    async def stubborn(_args: dict[str, object]) -> str:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:  # a third-party tool that swallows its cancel and returns
            return "done anyway"
        return "done"

    tools.register(Tool("stubborn", "waits", {"type": "object", "properties": {}}, stubborn))
    provider.by_text["go"] = Script(tool_calls=[("stubborn", {})])
    router = await make_router(cancel_grace_s=5.0)
    submitted = await router.submit(chat.message("c1", "go"), chat)
    assert submitted.run is not None
    await asyncio.wait_for(entered.wait(), 10)
    await router.submit(chat.message("c1", "/stop"), chat)
    await asyncio.wait_for(submitted.run.wait(), 10)
    await asyncio.sleep(0.2)  # time for a request that should not come
    assert len(provider.connections) == 1, [c.body.get("messages", [])[-1] for c in provider.connections]


class _AnswerLostOnce(SqliteStore):
    """The store as a connection lost after COMMIT makes it: the first record lands, its answer is lost."""

    lost = 0

    async def accept_inbound(self, fence: Fence, msg: InboundMessage, *,
                             started: tuple[int, ChatMessage] | None = None) -> int | None:
        inbound_id = await super().accept_inbound(fence, msg, started=started)
        if not self.lost:
            self.lost += 1
            raise StoreError("connection lost after COMMIT")
        return inbound_id


async def test_a_message_stored_although_the_store_said_otherwise_is_answered_once_not_sent_again(
        tmp_path: Path, chat: MemoryChat) -> None:
    store = _AnswerLostOnce(tmp_path / "s.db")
    await store.open()
    router = build_router(store, EchoAgent(ToolRegistry(), delay_s=0.0), chat)
    await chat.start(router)
    await router.start()
    try:
        submitted = await router.submit(chat.message("c1", "hello"), chat)
        assert submitted.outcome is Outcome.ACCEPTED and submitted.run is not None  # not "send it again"
        await asyncio.wait_for(submitted.run.wait(), 10)
        assert not any("send it again" in t for t in chat.texts("c1")), chat.texts("c1")
        _, rows = await store.conversation(submitted.run.session_key)
        assert [r.role for r in rows] == ["user", "assistant"]
        assert await store.unfinished_inbound() == []
    finally:
        await router.shutdown(GATEWAY_RESTART, grace_s=1)
        await store.close()


async def test_an_acceptance_and_start_stored_although_the_store_said_otherwise_is_answered_once(
        tmp_path: Path, chat: MemoryChat) -> None:
    """The same for a session's second message: the lost write held the turn's start (running,
    the user's row) too. The retry joins it, and the row is not written twice."""
    store = _AnswerLostOnce(tmp_path / "s.db")
    store.lost = 1  # the first message goes through
    await store.open()
    router = build_router(store, EchoAgent(ToolRegistry(), delay_s=0.0), chat)
    await chat.start(router)
    await router.start()
    try:
        for n, lost in enumerate((1, 0)):
            store.lost = lost
            submitted = await router.submit(chat.message("c1", f"hello {n}"), chat)
            assert submitted.outcome is Outcome.ACCEPTED and submitted.run is not None
            await asyncio.wait_for(submitted.run.wait(), 10)
        assert store.lost == 1  # the second's answer was lost
        assert not any("send it again" in t for t in chat.texts("c1")), chat.texts("c1")
        _, rows = await store.conversation("memory:dm:c1")
        assert [(r.role, r.content) for r in rows] == [
            ("user", "hello 0"), ("assistant", "hello 0"), ("user", "hello 1"), ("assistant", "hello 1")]
    finally:
        await router.shutdown(GATEWAY_RESTART, grace_s=1)
        await store.close()


class _WaitingClient(MemoryChat):
    """An outlet whose clients wait on their own connection, as the HTTP API's do."""

    name = "waiting"
    answers_later = False


async def test_a_message_whose_client_was_answered_by_a_process_now_gone_is_recorded_cut_off_not_answered(
        tmp_path: Path, provider: FakeProvider) -> None:
    client = _WaitingClient()
    store = SqliteStore(tmp_path / "s.db")
    await store.open()
    msg = client.message("c1", "taken, then the process went away")
    key = session_key(msg)
    assert await store.accept_inbound(Fence.local(key), msg) is not None  # accepted, never started
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="fake", retries=0), ToolRegistry())
    router = build_router(store, agent, client)
    await client.start(router)
    await router.start()  # recovery
    try:
        _, rows = await store.conversation(key)
        assert [(r.role, r.interrupted_by) for r in rows] == [("user", None), ("assistant", "system")]
        assert await store.unfinished_inbound() == []
        await asyncio.sleep(0.1)
        assert provider.connections == []  # nobody could hear an answer: none was asked for
    finally:
        await router.shutdown(GATEWAY_RESTART, grace_s=1)
        await agent.close()
        await store.close()


async def test_a_forwarded_repeat_of_a_running_message_never_cuts_off_its_own_turn(
        make_router: RouterFactory, provider: FakeProvider, chat: MemoryChat) -> None:
    provider.delay_s, provider.words = 0.05, 100
    router = await make_router()  # busy policy: interrupt
    msg = chat.message("c1", "hello")
    first = await router.submit(msg, chat)
    assert first.run is not None
    await _until(lambda: bool(provider.connections))
    # The same message again, forwarded by another worker (a platform's redelivery landing there).
    again = await router.cluster_events().deliver(msg, first.run.session_key, 1)
    assert again is not None and again.outcome is Outcome.DUPLICATE
    assert not first.run.is_cancelled()  # it was not interrupted by its own repeat
    await asyncio.wait_for(first.run.wait(), 30)
    assert first.run.reason is None


class _CountingStore(SqliteStore):
    """Each write the router asks for, by name (`accept+start`: an acceptance with its turn's start)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.writes: list[str] = []

    async def accept_inbound(self, fence: Fence, msg: InboundMessage, *,
                             started: tuple[int, ChatMessage] | None = None) -> int | None:
        self.writes.append("accept+start" if started is not None else "accept")
        return await super().accept_inbound(fence, msg, started=started)

    async def append(self, fence: Fence, conversation: int, rows: Sequence[ChatMessage], *,
                     inbound: tuple[int, InboundStatus, str | None] | None = None) -> None:
        self.writes.append("append")
        await super().append(fence, conversation, rows, inbound=inbound)

    async def finish_inbound(self, fence: Fence, inbound_id: int, status: InboundStatus,
                             detail: str | None = None) -> None:
        self.writes.append("finish")
        await super().finish_inbound(fence, inbound_id, status, detail)


@pytest.mark.parametrize("outlet", [MemoryChat, _WaitingClient])
async def test_a_message_whose_turn_starts_at_once_is_accepted_and_started_in_one_write(
        tmp_path: Path, outlet: type[MemoryChat]) -> None:
    """The inbound record and the user's row are one transaction; then the outcome with the
    record's status (a chat's record is done once its end is shown: one write more). A crash right
    after the acknowledgement leaves the record running with the user's row: recovered as a turn
    cut off (tests/test_restart_resume.py)."""
    chat = outlet()
    store = _CountingStore(tmp_path / "s.db")
    await store.open()
    router = build_router(store, EchoAgent(ToolRegistry(), delay_s=0.0), chat)
    await chat.start(router)
    await router.start()
    try:
        for n in range(3):
            store.writes.clear()
            submitted = await router.submit(chat.message("c1", f"hello {n}"), chat)
            assert submitted.outcome is Outcome.ACCEPTED and submitted.run is not None
            assert store.writes == ["accept+start"]  # acknowledged: stored, and its turn started
            await asyncio.wait_for(submitted.run.wait(), 10)
            await _until(lambda: not store.writes or store.writes[-1] != "append" or not chat.answers_later)
            await asyncio.sleep(0.05)
            end = ["append", "finish"] if chat.answers_later else ["append"]
            assert store.writes == ["accept+start", *end], store.writes
        _, rows = await store.conversation(session_key(chat.message("c1", "")))
        assert [(r.role, r.content) for r in rows] == [
            (role, f"hello {n}") for n in range(3) for role in ("user", "assistant")]
        assert await store.unfinished_inbound() == []
    finally:
        await router.shutdown(GATEWAY_RESTART, grace_s=1)
        await store.close()
