"""A full data disk is a state: promised records still land, new messages are refused (retryable),
readiness says so, and the daemon takes messages again by itself once there is room. The disk is
real: a small tmpfs mounted for the test."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.tools import ToolRegistry
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.ports import InboundStatus, Outcome
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.disk import fill, small_tmpfs
from tests.support.procs import until
from tests.support.routers import start_router


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk") as mount:
        yield mount


async def test_a_full_disk_refuses_new_messages_keeps_promised_records_and_recovers_by_itself(
        small_disk: Path, provider: FakeProvider, chat: MemoryChat) -> None:
    store = SqliteStore(small_disk / "switchboard.db", reserve_bytes=1 << 20)
    await store.open()
    assert store.reserve.exists()
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="fake", retries=0), ToolRegistry())
    router = await start_router(store, agent, chat)
    try:
        # Big enough to need pages of its own (~24 KB), in few deltas: quick on a loaded machine too.
        provider.by_text["long"] = Script(text=" ".join(["x" * 200] * 120), delay_s=0.01)
        running = await router.submit(chat.message("c1", "long"), chat)
        assert running.run is not None
        await until(lambda: bool(provider.connections) and provider.connections[-1].words >= 5, 10, "no words")
        filler = fill(small_disk)
        # The turn already running was promised its record: it lands (in the room the reserve gave up).
        await asyncio.wait_for(running.run.wait(), 90)
        _, rows = await store.conversation(running.run.session_key)
        assert [r.role for r in rows] == ["user", "assistant"] and rows[-1].interrupted_by is None
        assert not store.reserve.exists()
        # New messages are refused, retryably, and readiness says why.
        refused = await router.submit(chat.message("c2", "hello"), chat)
        assert refused.outcome is Outcome.UNAVAILABLE and refused.retry_after_s
        assert await store.ping() is False and "full" in (store.problem() or "")
        # Room again: ready, the reserve is back, and messages are taken.
        filler.unlink()
        assert await store.ping() is True and store.problem() is None
        assert store.reserve.exists()
        taken = await router.submit(chat.message("c2", "hello again"), chat)
        assert taken.outcome is Outcome.ACCEPTED and taken.run is not None
        await asyncio.wait_for(taken.run.wait(), 10)
        assert not await store.unfinished_inbound()
        assert all(r.status is not InboundStatus.RUNNING for r in await store.unfinished_inbound())
    finally:
        await router.shutdown(GATEWAY_RESTART, grace_s=2)
        await agent.close()
        await store.close()


def test_the_filler_really_fills(small_disk: Path) -> None:
    filler = fill(small_disk)
    with pytest.raises(OSError) as full:
        (small_disk / "more").write_bytes(b"\0" * 65536)
    assert full.value.errno == errno.ENOSPC
    filler.unlink()
