"""PostgreSQL's disk full (SQLSTATE 53100) is a state, as SQLite's is: readiness says so, new
messages are refused (retryable), the record of a turn already running is retried until it lands,
and the store takes messages again by itself once there is room. The disk is real: the test's own
PostgreSQL server keeps the database in a tablespace on a small tmpfs, which the test fills."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.tools import ToolRegistry
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.ports import DiskFull, Outcome
from gateway.store.postgres import PostgresSettings, PostgresStore
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.disk import fill, small_tmpfs
from tests.support.pg_server import PgServer, pg_server_of_our_own
from tests.support.procs import until
from tests.support.routers import start_router

FULL = "the database's disk is full"  # what readiness shows


@pytest.fixture
def full_disk_db() -> Iterator[tuple[PgServer, Path, str]]:
    """A server of the test's own, and a database whose tablespace is an 8 MB tmpfs: (server, the
    tmpfs, the database's URL)."""
    with pg_server_of_our_own() as server:
        owner = (server.user.pw_uid, server.user.pw_gid) if server.user is not None else None
        with small_tmpfs(server.dir / "small", owner=owner) as mount:
            (mount / "pg").mkdir()
            if owner is not None:
                os.chown(mount / "pg", *owner)
            server.execute(f"CREATE TABLESPACE small LOCATION '{mount / 'pg'}'")
            server.execute("CREATE DATABASE small_disk TABLESPACE small")
            try:
                yield server, mount, server.url("small_disk")
            finally:
                server.drop_database("small_disk")
                server.execute("DROP TABLESPACE IF EXISTS small")


def _incompressible(size: int, word: int = 2000) -> str:
    """Text PostgreSQL must store on fresh pages (random hex does not shrink enough to stay inline),
    in words of `word` characters."""
    return " ".join(secrets.token_hex(word // 2) for _ in range(size // (word + 1)))


async def test_a_full_database_disk_is_a_state_and_the_store_recovers_by_itself(
        full_disk_db: tuple[PgServer, Path, str], provider: FakeProvider, chat: MemoryChat) -> None:
    _server, disk, url = full_disk_db
    store = PostgresStore(url, require_fence=False, settings=PostgresSettings(timeout_s=5))
    await store.open()
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="fake", retries=0), ToolRegistry())
    router = await start_router(store, agent, chat)
    filler: Path | None = None
    try:
        # A 256 KB answer over about 6 s: its record needs pages of its own, which the full disk has not.
        answer = _incompressible(256 * 1024)
        provider.by_text["long"] = Script(text=answer, delay_s=0.05)
        running = await router.submit(chat.message("c1", "long"), chat)
        assert running.run is not None
        await until(lambda: bool(provider.connections) and provider.connections[-1].words >= 1, 30, "no words")
        filler = fill(disk)
        assert provider.connections[-1].ended_at is None, "the answer ended before the disk was full"
        # The record fails for want of room: the store names the state, and readiness is not ready.
        await until(lambda: store.problem() is not None, 20, "the full disk was never noticed")
        assert store.problem() == FULL
        assert await store.ping() is False
        # New messages are refused, retryably (the platform or the client sends them again).
        refused = await router.submit(chat.message("c2", "hello"), chat)
        assert refused.outcome is Outcome.UNAVAILABLE and refused.retry_after_s
        # Room again: the running turn's record, retried meanwhile, lands whole.
        filler.unlink()
        filler = None
        await asyncio.wait_for(running.run.wait(), 60)
        _, rows = await store.conversation(running.run.session_key)
        assert [r.role for r in rows] == ["user", "assistant"] and rows[-1].interrupted_by is None
        assert rows[-1].content.split() == answer.split()  # whole (the fake streams a space after each word)
        assert store.problem() is None and await store.ping() is True
        taken = await router.submit(chat.message("c2", "hello again"), chat)
        assert taken.outcome is Outcome.ACCEPTED and taken.run is not None
        await asyncio.wait_for(taken.run.wait(), 30)
        assert not await store.unfinished_inbound(taken.run.session_key)
    finally:
        if filler is not None:
            filler.unlink()
        await router.shutdown(GATEWAY_RESTART, grace_s=2)
        await agent.close()
        await store.close()


async def test_readiness_probes_the_disk_and_clears_the_state_once_a_write_lands(
        full_disk_db: tuple[PgServer, Path, str]) -> None:
    """A real DiskFullError from PostgreSQL (53100) is a DiskFull and sets the state; with nothing
    else writing, readiness's own probe (a write needing fresh pages, rolled back) is what notices
    the room that came back."""
    _server, disk, url = full_disk_db
    store = PostgresStore(url, require_fence=False, settings=PostgresSettings(timeout_s=5))
    await store.open()
    try:
        filler = fill(disk)
        try:
            assert await store.ping() is True and store.problem() is None  # not known full until a write says so
            with pytest.raises(DiskFull, match="disk is full"):
                await store.db.run("probe", lambda c: c.execute(
                    "INSERT INTO messages (session_key, conversation, role, content, created_at)"
                    " VALUES ('s', 1, 'user', $1, 0)", _incompressible(128 * 1024)))
            assert await store.ping() is False and store.problem() == FULL
        finally:
            filler.unlink()
        assert await store.ping() is True and store.problem() is None
        assert await store.conversation("s") == (1, [])  # the probe left nothing behind
    finally:
        await store.close()
