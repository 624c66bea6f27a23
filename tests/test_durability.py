"""Acknowledged means stored; shown whole means recorded — with the store failing under a turn.

The faults are real: SQLite's own "database or disk is full" (the store's connection limited to
the pages it has), a store that refuses a write during adoption.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable

import pytest

from gateway.core import turns
from gateway.core.cancellation import NOT_RECORDED
from gateway.core.ports import InboundStatus
from gateway.store.sqlite import SqliteStore
from tests.conftest import RouterFactory
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script


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
