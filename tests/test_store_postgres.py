"""What only the PostgreSQL store does: fencing in the database, schema migrations, copying a SQLite or
Redis store into it, retention, export, retries that apply a write once, and outages (errors, then
recovery by itself after the server restarts). The shared behaviour is in test_store_contract.py.

Every test runs against a PostgreSQL server of the test run's own (tests/support/pg_server.py): a fresh
database on the shared one (`pg_url`), or a server of its own when it stops or kills it."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from agent_cache import keys
from agent_cache.leases import LeaseManager
from gateway.core.fencing import Fence
from gateway.core.messages import ChatType, InboundMessage
from gateway.core.ports import FencedOut, InboundStatus, StoreError
from gateway.core.transcript import ChatMessage, ToolCall
from gateway.ops import cli
from gateway.store import postgres
from gateway.store.postgres import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Migration,
    PostgresSettings,
    PostgresStore,
    SchemaTooNew,
)
from gateway.store.redis import RedisStore
from gateway.store.sqlite import SqliteStore
from gateway.store.transfer import TransferError, copy
from tests.conftest import RedisFactory
from tests.support.pg_server import PgServer, pg_server_of_our_own
from tests.support.redis_server import RedisServer

S1, S2 = "webchat:dm:alice", "telegram:group:-100:7"
_fences = itertools.count(int(time.time() * 1000))


def fence(session: str = S1) -> Fence:
    return Fence(session, next(_fences))


def msg(message_id: str, chat_id: str = "alice", platform: str = "webchat", text: str = "hi") -> InboundMessage:
    return InboundMessage(platform=platform, chat_id=chat_id, chat_type=ChatType.DM, user_id="u1",
                          user_name="Alice", message_id=message_id, text=text, thread_id=None, reply_to=None,
                          timestamp=1712345678.123456789, user_handle="alice")


ROWS = [
    ChatMessage("user", "what's in /tmp?", created_at=1712345678.000001),
    ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "shell", '{"cmd": "ls /tmp"}'),), created_at=1712345679.5),
    ChatMessage("tool", "a\nb", tool_call_id="c1", created_at=1712345680.25),
    ChatMessage("assistant", "There are two fi", interrupted_by="user", reason="/stop", created_at=1712345681.75),
]


@pytest.fixture
async def pg(pg_url: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(pg_url, require_fence=True)
    await store.open()
    yield store
    await store.close()


async def rows(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(sql, *args)]
    finally:
        await conn.close()


async def execute(url: str, sql: str, *args: Any) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql, *args)
    finally:
        await conn.close()


# --- fencing in the database ------------------------------------------------------------------

async def test_a_zombies_writes_are_refused_by_the_database(pg_url: str) -> None:
    """Two workers on one database: once the new owner has written, every write carrying the old
    fence is refused by PostgreSQL, and changes nothing."""
    old_worker, new_worker = (PostgresStore(pg_url, require_fence=True) for _ in range(2))
    await old_worker.open()
    await new_worker.open()
    try:
        with pytest.raises(StoreError, match="without a lease"):
            await old_worker.accept_inbound(Fence.local(S1), msg("m0"))
        old = fence()
        inbound = await old_worker.accept_inbound(old, msg("m1"))
        assert inbound is not None
        await old_worker.append(old, 1, ROWS[:1])
        new = fence()
        await new_worker.append(new, 1, ROWS[1:2])
        before = await rows(pg_url, "SELECT * FROM messages ORDER BY id") + await rows(
            pg_url, "SELECT key, conversation, updated_at FROM sessions") + await rows(pg_url, "SELECT * FROM inbound")

        for write in (old_worker.append(old, 1, ROWS[2:], inbound=(inbound, InboundStatus.DONE, None)),
                      old_worker.finish_inbound(old, inbound, InboundStatus.DONE), old_worker.reset(old),
                      old_worker.accept_inbound(old, msg("m2")),
                      old_worker.accept_inbound(old, msg("m3"), started=(1, ROWS[0])), old_worker.claim(old)):
            with pytest.raises(FencedOut, match="refused"):
                await write
        after = await rows(pg_url, "SELECT * FROM messages ORDER BY id") + await rows(
            pg_url, "SELECT key, conversation, updated_at FROM sessions") + await rows(pg_url, "SELECT * FROM inbound")
        assert after == before
        assert await rows(pg_url, "SELECT fence FROM fences WHERE session_key = $1", S1) == [(new.number,)]
        # The refused accept left the message free for the new owner.
        assert await new_worker.accept_inbound(new, msg("m2")) is not None
        await new_worker.append(new, 1, ROWS[2:], inbound=(inbound, InboundStatus.DONE, None))
        assert await new_worker.conversation(S1) == (1, ROWS)
        # Other sessions are not affected by S1's fence.
        await old_worker.append(Fence(S2, old.number), 1, ROWS[:1])
    finally:
        await old_worker.close()
        await new_worker.close()


async def test_a_claim_at_takeover_refuses_the_old_owner_before_the_new_one_writes(pg: PostgresStore) -> None:
    old, new = fence(), fence()
    await pg.append(old, 1, ROWS[:1])
    await pg.claim(new)
    with pytest.raises(FencedOut):
        await pg.append(old, 1, ROWS[1:])
    await pg.claim(new)  # the same fence again is fine
    await pg.append(new, 1, ROWS[1:])
    assert await pg.conversation(S1) == (1, ROWS)


async def test_no_write_of_the_old_fence_lands_after_the_new_owners_first(pg: PostgresStore) -> None:
    """The check and the write are one statement: racing writes of two owners are ordered, and
    nothing of the old owner's comes after the new owner's first write."""
    old, new = fence(), fence()

    async def old_writes(i: int) -> bool:
        try:
            await pg.append(old, 1, [ChatMessage("assistant", f"old {i}", created_at=float(i))])
            return True
        except FencedOut:
            return False

    tasks = [asyncio.create_task(old_writes(i)) for i in range(40)]
    await asyncio.sleep(0.005)
    await pg.append(new, 1, [ChatMessage("assistant", "new", created_at=1.0)])
    landed = await asyncio.gather(*tasks)
    contents = [m.content for m in (await pg.conversation(S1))[1]]
    first_new = contents.index("new")
    assert all(c.startswith("old") for c in contents[:first_new]) and contents[first_new + 1:] == []
    assert sum(landed) == first_new


async def test_one_process_writes_with_local_fences_and_recovers_every_session(pg_url: str) -> None:
    store = PostgresStore(pg_url, require_fence=False)
    await store.open()
    try:
        a = await store.accept_inbound(Fence.local(S1), msg("a"))
        b = await store.accept_inbound(Fence.local(S2), msg("b", chat_id="-100"))
        await store.append(Fence.local(S1), 1, ROWS)
        # One process owns every session: the store can list what is open everywhere.
        assert [r.id for r in await store.unfinished_inbound()] == [a, b]
        # A local write neither checks nor lowers a fence left by a cluster that used this database.
        await store.append(fence(S2), 1, ROWS[:1])
        await store.append(Fence.local(S2), 1, ROWS[1:2])
        assert (await store.conversation(S2))[1] == ROWS[:2]
        assert await rows(pg_url, "SELECT count(*) FROM fences") == [(1,)]
    finally:
        await store.close()


async def test_nul_characters_are_stored_as_replacement_characters(pg: PostgresStore) -> None:
    f = fence()
    await pg.append(f, 1, [ChatMessage("tool", "a\x00b", tool_call_id="c\x00", created_at=1.0)])
    assert (await pg.conversation(S1))[1] == [ChatMessage("tool", "a\ufffdb", tool_call_id="c\ufffd", created_at=1.0)]
    inbound = await pg.accept_inbound(f, msg("m\x00", text="x\x00y"))
    assert inbound is not None
    assert (await pg.unfinished_inbound(S1))[0].message.text == "x\x00y"  # JSON escapes it


async def test_an_inbound_message_is_stored_as_text_not_as_escapes(pg: PostgresStore, pg_url: str) -> None:
    assert await pg.accept_inbound(fence(), msg("m1", text="Привет, мир")) is not None
    [(payload,)] = await rows(pg_url, "SELECT payload FROM inbound")
    assert "Привет, мир" in payload and "\\u" not in payload
    assert (await pg.unfinished_inbound(S1))[0].message.text == "Привет, мир"


async def test_in_a_cluster_a_takeover_refuses_the_previous_owner_from_its_first_read(
        redis_server: RedisServer, pg_url: str) -> None:
    """The new owner's first look at the session (what was left open) raises PostgreSQL's fence to
    its lease's: the old owner's write still on its way is refused before the new owner writes."""
    from gateway.store.composite import PostgresClusterStore

    store = PostgresClusterStore(PostgresStore(pg_url, require_fence=True), RedisStore(redis_server.url))
    await store.open()
    try:
        old_leases = LeaseManager(store.coordination._r, "w1", "a", ttl_s=60)
        got = await old_leases.acquire(S1, keys.lease(S1), keys.fence(S1))
        assert got.lease is not None
        old = Fence(S1, got.lease.fence)
        inbound = await store.accept_inbound(old, msg("m1"))
        assert inbound is not None
        redis_server.client().delete(keys.lease(S1))  # w1's lease lapsed; w2 takes the session
        new_leases = LeaseManager(store.coordination._r, "w2", "a", ttl_s=60)
        got = await new_leases.acquire(S1, keys.lease(S1), keys.fence(S1))
        assert got.lease is not None and got.lease.fence > old.number
        assert [r.id for r in await store.unfinished_inbound(S1)] == [inbound]
        with pytest.raises(FencedOut):
            await store.append(old, 1, ROWS, inbound=(inbound, InboundStatus.DONE, None))
        assert await store.conversation(S1) == (1, [])
        # A stale lease can never lower it again.
        await store.unfinished_inbound(S1)
        await store.append(Fence(S1, got.lease.fence), 1, ROWS, inbound=(inbound, InboundStatus.DONE, None))
        assert await store.unfinished_inbound(S1) == []
    finally:
        await store.close()


# --- retries: a write whose reply was lost is applied once ---------------------------------------

def lose_next_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next statement runs and commits, but its reply never arrives (the connection drops)."""
    original = asyncpg.connection.Connection.fetchrow
    lost: list[Any] = []

    async def fetchrow(self: Any, *args: Any, **kwargs: Any) -> Any:
        reply = await original(self, *args, **kwargs)
        if not lost:
            lost.append(reply)
            raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation (test)")
        return reply

    monkeypatch.setattr(asyncpg.connection.Connection, "fetchrow", fetchrow)


async def test_a_write_retried_after_a_lost_reply_is_applied_once(pg: PostgresStore,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    f = fence()
    lose_next_reply(monkeypatch)
    inbound = await pg.accept_inbound(f, msg("m1"))  # the retry finds its own record, not a duplicate
    assert inbound is not None
    assert [r.id for r in await pg.unfinished_inbound(S1)] == [inbound]
    assert await pg.accept_inbound(f, msg("m1")) is None

    lose_next_reply(monkeypatch)
    await pg.append(f, 1, ROWS[:2], inbound=(inbound, InboundStatus.RUNNING, None))
    assert await pg.conversation(S1) == (1, ROWS[:2])

    lose_next_reply(monkeypatch)
    assert await pg.reset(f) == 2
    assert await pg.reset(f) == 3


async def test_a_write_the_caller_retries_after_an_error_is_applied_once(pg: PostgresStore) -> None:
    """The turn's own retry (after the store raised, its write maybe applied): stored once."""
    f = fence()
    inbound = await pg.accept_inbound(f, msg("m1"))
    assert inbound is not None
    for _ in range(2):
        await pg.append(f, 1, ROWS[:1], inbound=(inbound, InboundStatus.RUNNING, None))
    assert await pg.conversation(S1) == (1, ROWS[:1])
    await pg.append(f, 1, ROWS[1:2], inbound=(inbound, InboundStatus.DONE, None))
    assert await pg.conversation(S1) == (1, ROWS[:2])


# --- schema migrations ------------------------------------------------------------------------

async def test_migrations_fresh_rerun_concurrent_and_a_later_step(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stores = [PostgresStore(pg_url, require_fence=True) for _ in range(4)]  # workers starting together
    await asyncio.gather(*(s.open() for s in stores))
    try:
        assert sorted(len(s.applied) for s in stores) == [0, 0, 0, len(MIGRATIONS)]
        assert await stores[0].schema_version() == SCHEMA_VERSION
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    again = PostgresStore(pg_url, require_fence=True)
    await again.open()
    assert again.applied == []
    await again.close()

    step = Migration(SCHEMA_VERSION + 1, "a later step", "ALTER TABLE sessions ADD COLUMN note text")
    monkeypatch.setattr(postgres, "MIGRATIONS", (*MIGRATIONS, step))
    monkeypatch.setattr(postgres, "SCHEMA_VERSION", step.version)
    not_yet = PostgresStore(pg_url, require_fence=True, settings=PostgresSettings(migrate=False))
    with pytest.raises(StoreError, match=r"run `switchboard store migrate`"):
        await not_yet.open()
    later = PostgresStore(pg_url, require_fence=True)
    await later.open()
    try:
        assert later.applied == [step]
        assert await later.schema_version() == step.version
        assert [r[0] for r in await rows(pg_url, "SELECT version FROM schema_version ORDER BY version")] == [
            *(m.version for m in MIGRATIONS), step.version]
    finally:
        await later.close()


async def test_a_schema_newer_than_the_code_is_refused_in_one_line(pg_url: str) -> None:
    store = PostgresStore(pg_url, require_fence=True)
    await store.open()
    await store.close()
    await execute(pg_url, "INSERT INTO schema_version (version, description) VALUES ($1, 'from the future')",
                  SCHEMA_VERSION + 1)
    newer = PostgresStore(pg_url, require_fence=True)
    with pytest.raises(SchemaTooNew) as refused:
        await newer.open()
    text = str(refused.value)
    assert "\n" not in text and f"version {SCHEMA_VERSION + 1}, newer than this switchboard" in text
    assert newer.db.pool is None  # closed again


def test_cli_store_migrate(pg_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SWITCHBOARD_STORE__URL", pg_url)
    assert cli.main(["store", "migrate"]) == 0
    assert f"applied  1  {MIGRATIONS[0].description}" in capsys.readouterr().out
    assert cli.main(["store", "migrate"]) == 0
    assert "(already up to date)" in capsys.readouterr().out
    monkeypatch.delenv("SWITCHBOARD_STORE__URL")
    assert cli.main(["store", "migrate"]) == 2
    assert "[store] url is not set" in capsys.readouterr().err


# --- copy: SQLite and Redis into PostgreSQL ------------------------------------------------------

async def fill(store: SqliteStore | RedisStore | PostgresStore, owner: Any) -> dict[str, Any]:
    """Two sessions with archived and current conversations, open and finished inbound records, a
    pairing; what a reader of the store should find afterwards."""
    f1, f2 = await owner(S1), await owner(S2)
    done = await store.accept_inbound(f1, msg("m1"))
    running = await store.accept_inbound(f1, msg("m2"))
    waiting = await store.accept_inbound(f2, msg("m3", chat_id="-100", text="nul \x00 inside"))
    assert done is not None and running is not None and waiting is not None
    await store.append(f1, 1, ROWS, inbound=(done, InboundStatus.DONE, "ok"))
    await store.reset(f1)
    await store.append(f1, 2, [ChatMessage("user", "again", created_at=1712345700.0)],
                       inbound=(running, InboundStatus.RUNNING, None))
    await store.append(f2, 1, [ChatMessage("assistant", "zero \x00 byte", created_at=1712345701.0)])
    assert await store.pairing_code("telegram", "u9", "Nine", code="AAAA2222", ttl_s=3600, max_pending=3)
    assert await store.approve_pairing("AAAA2222", ttl_s=3600) == ("telegram", "u9", "Nine")
    return {S1: await store.conversation(S1), S2: await store.conversation(S2)}


def clean(conversation: tuple[int, list[ChatMessage]]) -> tuple[int, list[ChatMessage]]:
    n, messages = conversation
    return n, [ChatMessage(m.role, m.content.replace("\x00", "\ufffd"), m.tool_calls, m.tool_call_id,
                           m.interrupted_by, m.reason, m.created_at) for m in messages]


async def check_copied(pg_url: str, expected: dict[str, Any], open_ids: int) -> None:
    target = PostgresStore(pg_url, require_fence=False)
    await target.open()
    try:
        for session, conversation in expected.items():
            assert await target.conversation(session) == clean(conversation)
        unfinished = await target.unfinished_inbound()
        assert [(r.session_key, r.message.message_id, r.status) for r in unfinished][-open_ids:] == [
            (S1, "m2", "running"), (S2, "m3", "accepted")]
        assert unfinished[-1].message.text == "nul \x00 inside"
        assert await target.is_paired("telegram", "u9")
        assert await rows(pg_url, "SELECT session_key, conversation FROM archives") == [(S1, 1)]
    finally:
        await target.close()


async def test_copy_sqlite_into_postgres_verified_and_rerun(tmp_path: Path, pg_url: str,
                                                            pg_server: PgServer) -> None:
    sqlite = SqliteStore(tmp_path / "switchboard.db")
    await sqlite.open()

    async def local(session: str) -> Fence:
        return Fence.local(session)

    expected = await fill(sqlite, local)
    await sqlite.close()

    said: list[str] = []
    report = await copy(f"sqlite:///{tmp_path}/switchboard.db", pg_url, progress=said.append)
    assert report.ok and not report.already
    assert {t: report.target.counts[t] for t in ("sessions", "messages", "inbound", "paired_users")} == {
        "sessions": 2, "messages": 6, "inbound": 3, "paired_users": 1}
    assert report.source.cleaned == 1  # the NUL in a message (the inbound one is escaped in its JSON)
    assert any("U+FFFD" in line for line in report.lines())
    await check_copied(pg_url, expected, 2)

    # Again: the target holds exactly this copy, so it is verified and left alone.
    again = await copy(str(tmp_path / "switchboard.db"), pg_url)
    assert again.ok and again.already
    # A target holding anything else is refused, and left as it was.
    await execute(pg_url, "UPDATE messages SET content = 'tampered' WHERE content = 'again'")
    with pytest.raises(TransferError, match="not this source's: copy into an empty database"):
        await copy(str(tmp_path / "switchboard.db"), pg_url)
    assert await rows(pg_url, "SELECT count(*) FROM messages") == [(6,)]


@pytest.fixture(params=["redis", "redis-cluster"])
def any_redis(request: pytest.FixtureRequest, start_redis: RedisFactory) -> RedisServer:
    if request.param == "redis":
        return start_redis("redis")
    return start_redis("redis-cluster", cluster=True)


async def test_copy_redis_into_postgres_keeps_fences(any_redis: RedisServer, pg_url: str) -> None:
    redis_server = any_redis
    redis = RedisStore(redis_server.url)
    await redis.open()

    async def leased(session: str) -> Fence:
        leases = LeaseManager(redis._r, "w1", "test", ttl_s=60)
        got = await leases.acquire(session, keys.lease(session), keys.fence(session))
        assert got.lease is not None
        return Fence(session, got.lease.fence)

    expected = await fill(redis, leased)
    fences = {s: int(redis_server.client().get(keys.fence(s)) or 0) for s in (S1, S2)}
    await redis.close()

    report = await copy(redis_server.url, pg_url)
    assert report.ok, report.lines()
    # Redis keeps only open inbound records (finished ones are deleted there).
    assert {t: report.target.counts[t] for t in ("sessions", "messages", "inbound", "paired_users")} == {
        "sessions": 2, "messages": 6, "inbound": 2, "paired_users": 1}
    assert report.fences == 2
    await check_copied(pg_url, expected, 2)
    assert dict(await rows(pg_url, "SELECT session_key, fence FROM fences")) == fences
    # A worker still holding a fence from before the copy cannot write into the new store.
    target = PostgresStore(pg_url, require_fence=True)
    await target.open()
    try:
        with pytest.raises(FencedOut):
            await target.append(Fence(S1, fences[S1] - 1), 2, ROWS)
    finally:
        await target.close()


def test_cli_store_copy(tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    async def make() -> None:
        sqlite = SqliteStore(tmp_path / "switchboard.db")
        await sqlite.open()
        await sqlite.append(Fence.local(S1), 1, ROWS)
        await sqlite.close()

    asyncio.run(make())
    assert cli.main(["store", "copy", "--from", f"sqlite:///{tmp_path}/switchboard.db", "--to", pg_url]) == 0
    out = capsys.readouterr().out
    assert "verified: every table has the same row count and checksum" in out
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("messages")] == [["messages", "4", "4"]]
    assert cli.main(["store", "copy", "--from", str(tmp_path / "nothing.db"), "--to", pg_url]) == 1
    assert "no SQLite database at" in capsys.readouterr().err
    assert cli.main(["store", "copy", "--from", str(tmp_path / "switchboard.db"), "--to", "mysql://x"]) == 1
    assert "must be a PostgreSQL URL" in capsys.readouterr().err


# --- retention --------------------------------------------------------------------------------

async def test_retention_deletes_old_archived_conversations_and_finished_records_in_batches(
        pg_url: str) -> None:
    store = PostgresStore(pg_url, require_fence=True, keep_days=30,
                          settings=PostgresSettings(retention_batch=3, retention_pause_s=0, retention_interval_s=3600))
    await store.open()
    try:
        f1, f2 = fence(S1), fence(S2)
        old_rows = [ChatMessage("user", f"old {i}", created_at=float(i)) for i in range(7)]
        await store.append(f1, 1, old_rows)
        await store.reset(f1)
        await store.append(f1, 2, ROWS[:1])  # the current conversation: kept, however old
        await store.append(f2, 1, ROWS[:2])
        await store.reset(f2)  # archived "recently" (moved below)
        await store.append(f2, 2, ROWS[2:])
        done = await store.accept_inbound(f1, msg("done"))
        open_ = await store.accept_inbound(f1, msg("open"))
        assert done is not None and open_ is not None
        await store.finish_inbound(f1, done, InboundStatus.DONE)

        later = time.time() + 40 * 86400  # "now" for the pass: everything above is 40 days old ...
        await execute(pg_url, "UPDATE archives SET archived_at = $1 WHERE session_key = $2", later - 10 * 86400, S2)
        deleted = await store.prune(now=later)  # ... but S2's archive only 10
        assert deleted == {"messages": 7, "conversations": 1, "inbound": 1, "statements": 4}  # 3 + 1 batches
        assert await rows(pg_url, "SELECT session_key, conversation, count(*) FROM messages GROUP BY 1, 2"
                          " ORDER BY 1, 2") == [(S2, 1, 2), (S2, 2, 2), (S1, 2, 1)]
        assert await rows(pg_url, "SELECT session_key, conversation FROM archives") == [(S2, 1)]
        assert [r.id for r in await store.unfinished_inbound(S1)] == [open_]
        assert await store.conversation(S1) == (2, ROWS[:1])
        assert await store.prune(now=later) == {"messages": 0, "conversations": 0, "inbound": 0, "statements": 1}
        # A current conversation is never deleted, whatever the archives table says.
        await execute(pg_url, "INSERT INTO archives VALUES ($1, 2, 0)", S1)
        assert (await store.prune(now=later))["messages"] == 0
        assert await store.conversation(S1) == (2, ROWS[:1])
    finally:
        await store.close()


async def test_retention_runs_by_itself_in_the_background(pg_url: str) -> None:
    store = PostgresStore(pg_url, require_fence=True, keep_days=1,
                          settings=PostgresSettings(retention_interval_s=0.1, retention_pause_s=0))
    await store.open()
    try:
        f = fence()
        await store.append(f, 1, ROWS)
        await store.reset(f)
        await execute(pg_url, "UPDATE archives SET archived_at = $1", time.time() - 2 * 86400)
        deadline = time.monotonic() + 10
        while await rows(pg_url, "SELECT count(*) FROM messages") != [(0,)]:
            assert time.monotonic() < deadline, "retention never ran"
            await asyncio.sleep(0.05)
        assert await store.conversation(S1) == (2, [])
    finally:
        await store.close()
    assert store.retention.task is None


# --- export -----------------------------------------------------------------------------------

def test_cli_export_of_one_session_as_json_lines(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    async def make() -> None:
        store = PostgresStore(pg_url, require_fence=True)
        await store.open()
        f = fence()
        inbound = await store.accept_inbound(f, msg("m1", text="hello"))
        await store.append(f, 1, ROWS, inbound=(inbound or 0, InboundStatus.DONE, None))
        await store.reset(f)
        await store.append(f, 2, [ChatMessage("user", "second", created_at=5.0)])
        await store.append(fence(S2), 1, ROWS[:1])
        await store.close()

    asyncio.run(make())
    monkeypatch.setenv("SWITCHBOARD_STORE__URL", pg_url)
    assert cli.main(["export", "--session", S1]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["type"], x.get("conversation")) for x in lines] == [
        ("session", 2), *[("message", 1)] * 4, ("message", 2), ("inbound", None)]
    assert lines[0]["session"] == S1 and lines[2]["tool_calls"][0]["function"]["name"] == "shell"
    assert lines[-1]["message"]["text"] == "hello" and lines[-1]["status"] == "done"
    assert cli.main(["export", "--session", "nobody:dm:0"]) == 1
    assert "nothing stored for session" in capsys.readouterr().err

    # The same from a SQLite store.
    monkeypatch.delenv("SWITCHBOARD_STORE__URL")
    monkeypatch.setenv("SWITCHBOARD_STORE__DATA_DIR", str(tmp_path))

    async def make_sqlite() -> None:
        sqlite = SqliteStore(tmp_path / "switchboard.db")
        await sqlite.open()
        await sqlite.append(Fence.local(S1), 1, ROWS[:2])
        await sqlite.close()

    asyncio.run(make_sqlite())
    assert cli.main(["export", "--session", S1]) == 0
    assert [json.loads(line)["type"] for line in capsys.readouterr().out.splitlines()] == [
        "session", "message", "message"]


# --- outages ----------------------------------------------------------------------------------

@pytest.fixture
def own_server() -> Iterator[PgServer]:
    """A server of this test's own, to stop, kill and restart."""
    with pg_server_of_our_own() as server:
        yield server


async def test_errors_are_store_errors_and_it_recovers_after_a_restart(own_server: PgServer) -> None:
    url = own_server.create_database("outage")
    store = PostgresStore(url, require_fence=True, settings=PostgresSettings(timeout_s=2))
    await store.open()
    try:
        f = fence()
        inbound = await store.accept_inbound(f, msg("m1"))
        assert inbound is not None
        await store.append(f, 1, ROWS[:2], inbound=(inbound, InboundStatus.RUNNING, None))
        await asyncio.gather(*(store.conversation(f"other-{i}") for i in range(20)))  # a pool of connections
        for stop in (own_server.kill, own_server.stop):
            stop()
            assert not await store.ping()
            for call in (store.accept_inbound(f, msg("m2")), store.finish_inbound(f, inbound, InboundStatus.DONE),
                         store.unfinished_inbound(S1), store.conversation(S1), store.append(f, 1, ROWS[2:]),
                         store.reset(f), store.sessions(), store.is_paired("telegram", "u1"),
                         store.pairing_code("telegram", "u1", "Ann", code="AAAA2222", ttl_s=60, max_pending=3),
                         store.approve_pairing("AAAA2222", ttl_s=60), store.pairing_state()):
                with pytest.raises(StoreError, match=r"^postgres \w+ failed: "):
                    await call

            own_server.start()
            # Every pooled connection died with the server; the first use of each must not fail.
            await asyncio.gather(*(store.conversation(f"other-{i}") for i in range(20)))
            assert await store.ping()
            assert await store.conversation(S1) == (1, ROWS[:2])
            assert [(r.id, r.status) for r in await store.unfinished_inbound(S1)] == [(inbound, "running")]
            assert await store.accept_inbound(f, msg("m1")) is None  # nothing acknowledged was lost
        await store.append(f, 1, ROWS[2:], inbound=(inbound, InboundStatus.DONE, None))
        assert await store.conversation(S1) == (1, ROWS)
        assert await store.unfinished_inbound(S1) == []

        # A database that cannot take writes (a replica after a failover, read-only) is not ready.
        own_server.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        own_server.execute("SELECT pg_reload_conf()")
        await asyncio.sleep(0.2)
        assert not await store.ping()
        with pytest.raises(StoreError, match="ReadOnlySQLTransactionError"):
            await store.append(f, 1, ROWS[:1])
        own_server.execute("ALTER SYSTEM RESET default_transaction_read_only")
        own_server.execute("SELECT pg_reload_conf()")
        await asyncio.sleep(0.2)
        assert await store.ping()
    finally:
        await store.close()


async def test_errors_never_show_the_password(own_server: PgServer) -> None:
    url = f"postgresql://postgres:s3cr%40t-pw@127.0.0.1:{own_server.port}/no_such_db"
    store = PostgresStore(url, require_fence=True)
    assert "s3cr" not in repr(store)
    with pytest.raises(StoreError, match="InvalidCatalogNameError") as missing:
        await store.open()
    own_server.stop()
    with pytest.raises(StoreError) as refused:
        await PostgresStore(url, require_fence=True).open()
    for exc in (missing.value, refused.value):
        assert "s3cr" not in str(exc) and exc.__cause__ is None and exc.__suppress_context__
    with pytest.raises(StoreError, match="invalid postgres url"):
        PostgresStore("postgresql://:s3cr3t@example.com:port/", require_fence=True)
    with pytest.raises(StoreError, match="must start with postgresql://"):
        PostgresStore("mysql://:s3cr3t@example.com/", require_fence=True)


def test_pg_server_helper_restarts_on_the_same_port_with_its_data(own_server: PgServer) -> None:
    url = own_server.create_database("kept")
    own_server.execute("CREATE TABLE t (x int); INSERT INTO t VALUES (42)", "kept")
    port = own_server.port
    own_server.kill()
    assert not own_server.running()
    own_server.start()
    assert own_server.port == port
    assert asyncio.run(rows(url, "SELECT x FROM t")) == [(42,)]
    assert own_server.user is None or own_server.user.pw_uid != 0  # never as root
