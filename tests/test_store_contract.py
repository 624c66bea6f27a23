"""One behaviour, four backends: SQLite, Redis, a one-node Redis Cluster (which refuses a command or
script whose declared keys span slots) and PostgreSQL. Then what only the Redis store does: fencing,
one hash slot per session, retries that apply a write once, errors and recovery when Redis dies.
What only the PostgreSQL store does is in test_store_postgres.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio.connection import Connection
from redis.crc import key_slot

from agent_cache import keys
from agent_cache.leases import LeaseManager
from gateway.core.fencing import Fence
from gateway.core.messages import ChatType, InboundMessage
from gateway.core.ports import FencedOut, InboundStatus, Store, StoreError
from gateway.core.transcript import ChatMessage, ToolCall
from gateway.store.composite import PostgresClusterStore
from gateway.store.postgres import PostgresStore
from gateway.store.redis import RedisStore
from gateway.store.sqlite import SqliteStore
from tests.conftest import RedisFactory
from tests.support.redis_server import RedisServer, RedisServerMissing

S1, S2 = "webchat:dm:alice", "telegram:group:-100:7"


def msg(message_id: str, chat_id: str = "alice", platform: str = "webchat", text: str = "hi") -> InboundMessage:
    return InboundMessage(platform=platform, chat_id=chat_id, chat_type=ChatType.DM, user_id="u1",
                          user_name="Alice", message_id=message_id, text=text, thread_id=None, reply_to="m0",
                          timestamp=1712345678.123456789, user_handle="alice")


ROWS = [
    ChatMessage("user", "what's in /tmp?", created_at=1712345678.000001),
    ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "shell", '{"cmd": "ls /tmp"}'),), created_at=1712345679.5),
    ChatMessage("tool", "a\nb", tool_call_id="c1", created_at=1712345680.25),
    ChatMessage("assistant", "There are two fi", interrupted_by="user", reason="/stop", created_at=1712345681.75),
]


def _started(server: RedisServer) -> RedisServer:
    try:
        return server.start()
    except RedisServerMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def cluster_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """Shared by the module: a new cluster node only reports itself ready after two seconds."""
    server = RedisServer(tmp_path_factory.mktemp("redis-cluster"), cluster=True)
    try:
        yield _started(server)
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "redis", "redis-cluster", "postgres", "postgres+redis"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    store: SqliteStore | RedisStore | PostgresStore | PostgresClusterStore
    if request.param == "sqlite":
        store = SqliteStore(tmp_path / "contract.db")
    elif request.param == "postgres":
        store = PostgresStore(request.getfixturevalue("pg_url"), require_fence=True)
    elif request.param == "postgres+redis":  # cluster mode with PostgreSQL
        store = PostgresClusterStore(PostgresStore(request.getfixturevalue("pg_url"), require_fence=True),
                                     RedisStore(request.getfixturevalue("redis_server").url))
    elif request.param == "redis":
        store = RedisStore(request.getfixturevalue("redis_server").url)
    else:
        server: RedisServer = request.getfixturevalue("cluster_server")
        server.client().flushall()
        store = RedisStore(server.url)
    await store.open()
    yield store
    await store.close()


@pytest.fixture
async def redis_store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    store = RedisStore(redis_server.url)
    await store.open()
    yield store
    await store.close()


# PostgreSQL checks fences itself ("not older than the newest seen"), so any growing number will do
# where no Redis lease is involved; leases start theirs at Redis's clock in ms, and so does this.
_fences = itertools.count(int(time.time() * 1000))


async def own(store: Store, session: str, worker: str = "contract-test") -> Fence:
    """A fence for writes to `session`: a shared store only accepts one minted from a live lease."""
    if isinstance(store, SqliteStore):
        return Fence.local(session)
    if isinstance(store, PostgresStore):
        return Fence(session, next(_fences))
    if isinstance(store, PostgresClusterStore):  # a real lease's fence, as a cluster's would be
        store = store.coordination
    assert isinstance(store, RedisStore)
    leases = LeaseManager(store._r, worker, "test", ttl_s=60)
    got = await leases.acquire(session, keys.lease(session), keys.fence(session))
    assert got.lease is not None, f"{session} is leased to {got.owner}"
    return Fence(session, got.lease.fence)


async def archived(store: Store, session: str, conversation: int) -> list[str]:
    """Contents of a conversation that is no longer current (the protocol has no read for it)."""
    if isinstance(store, SqliteStore):
        with sqlite3.connect(store.path) as c:
            return [r[0] for r in c.execute("SELECT content FROM messages WHERE session_key = ? AND conversation = ?"
                                            " ORDER BY id", (session, conversation))]
    if isinstance(store, PostgresClusterStore):
        store = store.history
    if isinstance(store, PostgresStore):
        rows = await store.db.run("test", lambda c: c.fetch(
            "SELECT content FROM messages WHERE session_key = $1 AND conversation = $2 ORDER BY id",
            session, conversation))
        return [r[0] for r in rows]
    assert isinstance(store, RedisStore)
    return [json.loads(r)["content"] for r in await store._r.lrange(keys.messages(session, conversation), 0, -1)]


# --- inbound ------------------------------------------------------------------------------

async def test_accept_dedup_finish(any_store: Store) -> None:
    F1, F2 = await own(any_store, S1), await own(any_store, S2)
    first = await any_store.accept_inbound(F1, msg("m1"))
    assert first is not None
    assert await any_store.accept_inbound(F1, msg("m1")) is None
    second = await any_store.accept_inbound(F1, msg("m2"))
    assert second is not None and second > first
    # The same message id elsewhere is a different message.
    assert await any_store.accept_inbound(F2, msg("m1", chat_id="-100")) is not None
    assert await any_store.accept_inbound(F2, msg("m1", platform="telegram")) is not None

    open_ = await any_store.unfinished_inbound(S1)
    assert [(r.id, r.session_key, r.message, r.status) for r in open_] == [
        (first, S1, msg("m1"), "accepted"), (second, S1, msg("m2"), "accepted")]
    assert open_[0].received_at == pytest.approx(time.time(), abs=60)

    # Open statuses keep the record (and the message intact, even with a detail that looks like JSON).
    await any_store.finish_inbound(F1, first, InboundStatus.RUNNING, 'cut ,"received_at": 0, "quote"}')
    open_ = await any_store.unfinished_inbound(S1)
    assert [(r.id, r.status, r.message) for r in open_] == [(first, "running", msg("m1")),
                                                            (second, "accepted", msg("m2"))]
    await any_store.finish_inbound(F1, first, InboundStatus.RESTART)
    assert (await any_store.unfinished_inbound(S1))[0].status == "restart"

    for status in (InboundStatus.DONE, InboundStatus.CANCELLED):
        await any_store.finish_inbound(F1, first if status is InboundStatus.DONE else second, status, "detail")
    assert await any_store.unfinished_inbound(S1) == []
    # A finished message stays de-duplicated.
    assert await any_store.accept_inbound(F1, msg("m1")) is None


async def test_unfinished_per_session(any_store: Store) -> None:
    F1, F2 = await own(any_store, S1), await own(any_store, S2)
    a = await any_store.accept_inbound(F1, msg("a"))
    b = await any_store.accept_inbound(F2, msg("b", chat_id="-100"))
    assert [r.id for r in await any_store.unfinished_inbound(S1)] == [a]
    assert [r.id for r in await any_store.unfinished_inbound(S2)] == [b]
    everywhere = await any_store.unfinished_inbound()
    if isinstance(any_store, SqliteStore):  # (and PostgreSQL for one process: test_store_postgres.py)
        assert [r.id for r in everywhere] == [a, b]
    else:  # a shared store recovers per session, when a worker takes the session's lease
        assert everywhere == []
    for status in (InboundStatus.REJECTED, InboundStatus.FAILED, InboundStatus.RESUMED):
        c = await any_store.accept_inbound(F1, msg(f"c-{status}"))
        assert c is not None
        await any_store.finish_inbound(F1, c, status)
    assert [r.id for r in await any_store.unfinished_inbound(S1)] == [a]


# --- transcripts --------------------------------------------------------------------------

async def test_conversation_append_reset(any_store: Store) -> None:
    F1, F2 = await own(any_store, S1), await own(any_store, S2)
    assert await any_store.conversation(S1) == (1, [])
    await any_store.append(F1, 1, ROWS[:2])
    await any_store.append(F1, 1, ROWS[2:])
    await any_store.append(F1, 1, [])
    assert await any_store.conversation(S1) == (1, ROWS)
    assert await any_store.conversation(S2) == (1, [])

    assert await any_store.reset(F1) == 2
    assert await any_store.conversation(S1) == (2, [])
    # A turn that started before /new still writes into its own (now archived) conversation.
    late = ChatMessage("assistant", "late", created_at=1712345690.0)
    await any_store.append(F1, 1, [late])
    await any_store.append(F1, 2, [ROWS[0]])
    assert await any_store.conversation(S1) == (2, [ROWS[0]])
    assert await archived(any_store, S1, 1) == [m.content for m in [*ROWS, late]]

    assert await any_store.reset(F1) == 3
    assert await any_store.reset(F2) == 2  # a session never written to starts from 1


async def test_inbound_status_set_by_append(any_store: Store) -> None:
    F1 = await own(any_store, S1)
    done = await any_store.accept_inbound(F1, msg("m1"))
    running = await any_store.accept_inbound(F1, msg("m2"))
    assert done is not None and running is not None
    await any_store.append(F1, 1, ROWS[:1], inbound=(running, InboundStatus.RUNNING, None))
    await any_store.append(F1, 1, ROWS[1:], inbound=(done, InboundStatus.DONE, None))
    assert [(r.id, r.status, r.message) for r in await any_store.unfinished_inbound(S1)] == [
        (running, "running", msg("m2"))]
    assert (await any_store.conversation(S1))[1] == ROWS


async def test_an_acceptance_with_its_turns_start_is_one_write_of_both(any_store: Store) -> None:
    """`started`: the record, running, and the user's row land together; a duplicate writes neither."""
    F1 = await own(any_store, S1)
    first = await any_store.accept_inbound(F1, msg("m1"), started=(1, ROWS[0]))
    assert first is not None
    assert [(r.id, r.status, r.message) for r in await any_store.unfinished_inbound(S1)] == [
        (first, "running", msg("m1"))]
    assert await any_store.conversation(S1) == (1, ROWS[:1])
    assert await any_store.accept_inbound(F1, msg("m1"), started=(1, ROWS[3])) is None
    assert await any_store.conversation(S1) == (1, ROWS[:1])
    await any_store.append(F1, 1, ROWS[1:], inbound=(first, InboundStatus.DONE, None))
    assert await any_store.unfinished_inbound(S1) == []
    assert await any_store.conversation(S1) == (1, ROWS)


async def test_sessions_listing(any_store: Store) -> None:
    F1, F2 = await own(any_store, S1), await own(any_store, S2)
    await any_store.append(F1, 1, ROWS)
    await asyncio.sleep(0.01)
    await any_store.append(F2, 1, ROWS[:1])
    await asyncio.sleep(0.01)
    await any_store.reset(F1)
    await any_store.append(F1, 2, ROWS[:2])
    listed = await any_store.sessions()
    assert [(s.key, s.conversation, s.messages) for s in listed] == [(S1, 2, 2), (S2, 1, 1)]
    assert listed[0].updated_at >= listed[1].updated_at > 1e9
    assert [s.key for s in await any_store.sessions(limit=1)] == [S1]


# --- pairing ------------------------------------------------------------------------------

async def test_pairing_issue_reuse_cap_approve(any_store: Store) -> None:
    issue = any_store.pairing_code
    assert await issue("telegram", "u1", "Ann", code="AAAA2222", ttl_s=3600, max_pending=2) == "AAAA2222"
    assert await issue("telegram", "u1", "Ann", code="BBBB3333", ttl_s=3600, max_pending=2) == "AAAA2222"
    assert await issue("telegram", "u2", "Bob", code="CCCC4444", ttl_s=3600, max_pending=2) == "CCCC4444"
    assert await issue("telegram", "u3", "Cy", code="DDDD5555", ttl_s=3600, max_pending=2) is None
    assert await issue("discord", "u3", "Cy", code="EEEE6666", ttl_s=3600, max_pending=2) == "EEEE6666"

    pending, paired = await any_store.pairing_state()
    assert sorted(p[:4] for p in pending) == [("AAAA2222", "telegram", "u1", "Ann"),
                                               ("CCCC4444", "telegram", "u2", "Bob"),
                                               ("EEEE6666", "discord", "u3", "Cy")]
    assert paired == []
    assert not await any_store.is_paired("telegram", "u1")

    assert await any_store.approve_pairing("AAAA2222", ttl_s=3600) == ("telegram", "u1", "Ann")
    assert await any_store.approve_pairing("AAAA2222", ttl_s=3600) is None
    assert await any_store.approve_pairing("NOSUCH22", ttl_s=3600) is None
    assert await any_store.is_paired("telegram", "u1")
    assert not await any_store.is_paired("discord", "u1")
    # Approval freed a place.
    assert await issue("telegram", "u3", "Cy", code="FFFF7777", ttl_s=3600, max_pending=2) == "FFFF7777"
    pending, paired = await any_store.pairing_state()
    assert sorted(p[0] for p in pending) == ["CCCC4444", "EEEE6666", "FFFF7777"]
    assert paired == [("telegram", "u1", "Ann")]


async def test_pairing_cap_holds_under_concurrency(any_store: Store) -> None:
    issued = await asyncio.gather(*(any_store.pairing_code("telegram", f"u{i}", "X", code=f"CODE{i:04}", ttl_s=60,
                                                           max_pending=3) for i in range(20)))
    assert len([c for c in issued if c is not None]) == 3
    assert len((await any_store.pairing_state())[0]) == 3


async def test_pairing_expiry(any_store: Store) -> None:
    issue = any_store.pairing_code
    assert await issue("telegram", "u1", "Ann", code="AAAA2222", ttl_s=0.3, max_pending=1) == "AAAA2222"
    assert await issue("telegram", "u2", "Bob", code="BBBB3333", ttl_s=0.3, max_pending=1) is None
    await asyncio.sleep(0.4)
    # Expired codes neither count against the cap nor get reused.
    assert await issue("telegram", "u2", "Bob", code="BBBB3333", ttl_s=0.3, max_pending=1) == "BBBB3333"
    assert await issue("telegram", "u1", "Ann", code="CCCC4444", ttl_s=3600, max_pending=2) == "CCCC4444"
    await asyncio.sleep(0.4)
    assert await any_store.approve_pairing("BBBB3333", ttl_s=0.3) is None
    assert not await any_store.is_paired("telegram", "u2")
    assert await any_store.approve_pairing("CCCC4444", ttl_s=3600) == ("telegram", "u1", "Ann")


# --- Redis only ---------------------------------------------------------------------------

async def test_writes_need_the_current_lease(redis_store: RedisStore, redis_server: RedisServer) -> None:
    """A zombie (its lease taken over) and a write with no lease at all change nothing."""
    with pytest.raises(StoreError, match="without a lease"):
        await redis_store.accept_inbound(Fence.local(S1), msg("m0"))
    old = await own(redis_store, S1, "w1")
    inbound = await redis_store.accept_inbound(old, msg("m1"))
    assert inbound is not None
    await redis_store.append(old, 1, ROWS[:1])
    raw = redis_server.client()
    raw.delete(keys.lease(S1))  # w1's lease lapsed; w2 takes the session
    new = await own(redis_store, S1, "w2")
    assert new.number > old.number
    meta = raw.hgetall(keys.meta(S1))

    for write in (redis_store.append(old, 1, ROWS[1:], inbound=(inbound, InboundStatus.DONE, None)),
                  redis_store.finish_inbound(old, inbound, InboundStatus.DONE), redis_store.reset(old),
                  redis_store.accept_inbound(old, msg("m2")),
                  redis_store.accept_inbound(old, msg("m2"), started=(1, ROWS[1]))):
        with pytest.raises(FencedOut):
            await write
    assert await redis_store.conversation(S1) == (1, ROWS[:1])
    assert raw.hgetall(keys.meta(S1)) == meta
    assert [r.status for r in await redis_store.unfinished_inbound(S1)] == [InboundStatus.ACCEPTED]
    assert await redis_store.accept_inbound(new, msg("m2")) is not None  # the refused accept let it through

    await redis_store.append(new, 1, ROWS[1:], inbound=(inbound, InboundStatus.DONE, None))
    assert await redis_store.conversation(S1) == (1, ROWS)
    raw.delete(keys.lease(S1))  # lapsed, and nobody has it: its last owner cannot prove it either
    with pytest.raises(FencedOut):
        await redis_store.reset(new)


def lose_next_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next command runs on the server, but its reply never arrives (the connection drops)."""
    original = Connection.read_response
    lost: list[Any] = []

    async def read_response(self: Connection, *args: Any, **kwargs: Any) -> Any:
        reply = await original(self, *args, **kwargs)
        if not lost:
            lost.append(reply)
            raise redis.ConnectionError("connection dropped (test)")
        return reply

    monkeypatch.setattr(Connection, "read_response", read_response)


async def test_a_write_retried_after_a_lost_reply_is_applied_once(redis_store: RedisStore,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    F1, F2 = await own(redis_store, S1), await own(redis_store, S2)
    await redis_store.append(F2, 1, ROWS[:1])  # load the scripts: lose the writes' replies, not SCRIPT LOAD's
    await redis_store.reset(F2)
    lose_next_reply(monkeypatch)
    inbound = await redis_store.accept_inbound(F1, msg("m1"))  # the retry finds its own dedup claim
    assert inbound is not None
    assert [r.id for r in await redis_store.unfinished_inbound(S1)] == [inbound]
    assert await redis_store.accept_inbound(F1, msg("m1")) is None

    lose_next_reply(monkeypatch)
    await redis_store.append(F1, 1, ROWS[:2], inbound=(inbound, InboundStatus.RUNNING, None))
    assert await redis_store.conversation(S1) == (1, ROWS[:2])

    lose_next_reply(monkeypatch)
    assert await redis_store.reset(F1) == 2
    assert await redis_store.reset(F1) == 3

    lose_next_reply(monkeypatch)  # accepted with its turn's start: the record and the row, once
    started = await redis_store.accept_inbound(F2, msg("m2"), started=(2, ROWS[2]))
    assert started is not None
    assert [(r.id, r.status) for r in await redis_store.unfinished_inbound(S2)] == [(started, InboundStatus.RUNNING)]
    assert await redis_store.conversation(S2) == (2, [ROWS[2]])
    assert await redis_store.accept_inbound(F2, msg("m2"), started=(2, ROWS[2])) is None
    assert await redis_store.conversation(S2) == (2, [ROWS[2]])


async def test_a_write_the_caller_retries_after_an_error_is_applied_once(redis_store: RedisStore) -> None:
    """A turn retries its record write through a Redis restart; the first attempt may have been
    applied with its reply lost. The same write again is the same write: its rows are stored once."""
    fence = await own(redis_store, S1)
    inbound = await redis_store.accept_inbound(fence, msg("m1"))
    assert inbound is not None
    for _ in range(2):
        await redis_store.append(fence, 1, ROWS[:1], inbound=(inbound, InboundStatus.RUNNING, None))
    assert await redis_store.conversation(S1) == (1, ROWS[:1])
    await redis_store.append(fence, 1, ROWS[1:2], inbound=(inbound, InboundStatus.DONE, None))
    assert await redis_store.conversation(S1) == (1, ROWS[:2])  # another write is another write


@pytest.mark.parametrize("session", [S1, S2, "discord:thread:1:2:3", "odd:{brace}:key}{"])
async def test_all_keys_of_a_session_share_one_slot(redis_store: RedisStore, redis_server: RedisServer,
                                                    session: str) -> None:
    fence = await own(redis_store, session)
    inbound = await redis_store.accept_inbound(fence, msg("m1"))
    assert inbound is not None
    await redis_store.append(fence, 1, ROWS, inbound=(inbound, InboundStatus.RUNNING, None))
    await redis_store.reset(fence)
    await redis_store.append(fence, 2, ROWS)
    written = {k for k in redis_server.client().scan_iter("*") if "{s:" in k}
    named = {keys.lease(session), keys.fence(session), keys.meta(session), keys.inbound(session),
             keys.messages(session, 1), keys.messages(session, 2), keys.seen(session, "webchat", "alice", "m1")}
    assert written == named
    assert len({key_slot(k.encode()) for k in named}) == 1
    assert len({key_slot(k.encode()) for k in (keys.pairing_codes("x"), keys.paired_users("x"))}) == 1


async def test_errors_are_store_errors_and_it_recovers_after_a_restart(start_redis: RedisFactory) -> None:
    server = start_redis("redis", persistence=True)
    store = RedisStore(server.url)
    try:
        await store.open()
        F1 = await own(store, S1)
        inbound = await store.accept_inbound(F1, msg("m1"))
        assert inbound is not None
        await store.append(F1, 1, ROWS[:2], inbound=(inbound, InboundStatus.RUNNING, None))
        await asyncio.gather(*(store.conversation(f"other-{i}") for i in range(20)))  # a pool of connections
        server.kill()

        assert not await store.ping()
        for call in (store.accept_inbound(F1, msg("m2")), store.finish_inbound(F1, inbound, InboundStatus.DONE),
                     store.unfinished_inbound(S1), store.conversation(S1), store.append(F1, 1, ROWS[2:]),
                     store.reset(F1), store.sessions(), store.is_paired("telegram", "u1"),
                     store.pairing_code("telegram", "u1", "Ann", code="AAAA2222", ttl_s=60, max_pending=3),
                     store.approve_pairing("AAAA2222", ttl_s=60), store.pairing_state()):
            with pytest.raises(StoreError, match=r"^redis .* failed: ConnectionError"):
                await call

        server.start()
        # Every pooled connection died with the server; the first use of each must not fail.
        await asyncio.gather(*(store.conversation(f"other-{i}") for i in range(20)))
        assert await store.ping()
        assert await store.conversation(S1) == (1, ROWS[:2])
        assert [(r.id, r.status) for r in await store.unfinished_inbound(S1)] == [(inbound, "running")]
        assert await store.accept_inbound(F1, msg("m1")) is None  # dedup survived too
        await store.append(F1, 1, ROWS[2:], inbound=(inbound, InboundStatus.DONE, None))
        assert await store.conversation(S1) == (1, ROWS)
        assert await store.unfinished_inbound(S1) == []
    finally:
        await store.close()
        server.stop()


async def test_errors_never_show_the_password(redis_server: RedisServer) -> None:
    redis_server.client().config_set("requirepass", "another-one")
    store = RedisStore(f"redis://:s3cr%40t-pw@127.0.0.1:{redis_server.port}/0")
    assert "s3cr" not in repr(store)
    with pytest.raises(StoreError, match="AuthenticationError") as raised:
        await store.open()
    redis_server.kill()
    with pytest.raises(StoreError) as refused:
        await store.conversation(S1)
    await store.close()
    for exc in (raised.value, refused.value):
        assert "s3cr" not in str(exc) and exc.__cause__ is None and exc.__suppress_context__
    with pytest.raises(StoreError, match="invalid redis url"):
        RedisStore("http://:s3cr3t@example.com/")


async def test_dedup_expires(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, dedup_ttl_s=0.2)
    await store.open()
    F1 = await own(store, S1)
    try:
        assert await store.accept_inbound(F1, msg("m1")) is not None
        assert await store.accept_inbound(F1, msg("m1")) is None
        await asyncio.sleep(0.3)
        assert await store.accept_inbound(F1, msg("m1")) is not None
    finally:
        await store.close()


def test_redis_server_helper_restarts_on_the_same_port(start_redis: RedisFactory) -> None:
    server = start_redis("r", persistence=True)
    port = server.port
    try:
        server.client().set("k", "v")
        server.stop()
        with pytest.raises(redis.ConnectionError):
            server.client().ping()
        server.start()
        assert server.port == port and server.client().get("k") == "v"
        server.pause()
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            with pytest.raises(TimeoutError):
                sock.recv(16)
        server.resume()
        assert server.client().ping()
    finally:
        server.stop()


async def test_text_is_stored_as_text_and_old_escaped_rows_still_read(redis_store: RedisStore,
                                                                     redis_server: RedisServer) -> None:
    fence = await own(redis_store, S1)
    await redis_store.append(fence, 1, [ChatMessage("user", "Привет, мир — 你好", created_at=1.0)])
    raw = redis_server.client()
    stored = raw.lrange(keys.messages(S1, 1), 0, -1)
    assert "Привет, мир — 你好" in stored[0] and "\\u" not in stored[0]
    escaped = json.dumps({"role": "assistant", "content": "Ответ", "tool_calls": None, "tool_call_id": None,
                          "interrupted_by": None, "reason": None, "created_at": 2.0})  # as rows were written before
    assert "\\u041e" in escaped
    raw.rpush(keys.messages(S1, 1), escaped)
    assert [m.content for m in (await redis_store.conversation(S1))[1]] == ["Привет, мир — 你好", "Ответ"]


async def test_sqlite_a_failing_write_in_a_commit_group_fails_alone(tmp_path: Path) -> None:
    """Writes queued while the writer waits share one transaction; one of them failing rolls the
    group back and each runs again on its own: the others land, the failing one leaves nothing."""
    store = SqliteStore(tmp_path / "group.db")
    await store.open()
    lock = sqlite3.connect(store.path, isolation_level=None)
    try:
        F1, F2 = Fence.local(S1), Fence.local(S2)
        lock.execute("BEGIN IMMEDIATE")  # the writer's next transaction waits for this one
        first = asyncio.create_task(store.append(F1, 1, ROWS[:1]))
        bad = ChatMessage("user", None)  # type: ignore[arg-type]  # NOT NULL: this write must fail
        group = [asyncio.create_task(w) for w in (
            store.append(F1, 1, ROWS[1:2]), store.append(F2, 1, [ROWS[0], bad]), store.append(F1, 1, ROWS[2:3]),
            store.accept_inbound(F1, msg("m1")), store.append(F1, 1, ROWS[3:]))]
        for _ in range(3):  # every task queues its write at its first step; the writer waits for the lock
            await asyncio.sleep(0)
        # However the writer split them into groups, the failing write shares one with others.
        lock.execute("COMMIT")
        await first
        outcomes = await asyncio.gather(*group, return_exceptions=True)
        assert isinstance(outcomes[1], StoreError) and "NOT NULL" in str(outcomes[1])
        assert [o for i, o in enumerate(outcomes) if i != 1] == [None, None, 1, None]
        assert await store.conversation(S1) == (1, ROWS)
        assert await store.conversation(S2) == (1, [])  # nothing of the failed write, not even its session row
        assert [s.key for s in await store.sessions()] == [S1]
    finally:
        lock.close()
        await store.close()


async def test_sqlite_prunes_finished_inbound_records_past_the_window_while_it_runs(tmp_path: Path) -> None:
    """Not only at start: a daemon that runs for months keeps a window of inbound records, not all
    of them. Open records are kept whatever their age (they are still to be answered)."""
    store = SqliteStore(tmp_path / "prune.db", dedup_ttl_s=0.2, prune_every_s=0.05)
    await store.open()
    F1 = Fence.local(S1)
    try:
        done = await store.accept_inbound(F1, msg("m1"))
        assert done is not None and await store.accept_inbound(F1, msg("open")) is not None
        await store.finish_inbound(F1, done, InboundStatus.DONE)
        assert await store.accept_inbound(F1, msg("m1")) is None  # a duplicate within the window
        deadline = time.monotonic() + 10
        while await store.accept_inbound(F1, msg("m1")) is None:  # each write lets a due prune run
            assert time.monotonic() < deadline, "the finished record was never pruned"
            await asyncio.sleep(0.05)
        assert [r.message.message_id for r in await store.unfinished_inbound(S1)] == ["open", "m1"]
    finally:
        await store.close()


async def test_sqlite_lists_sessions_by_an_index_not_by_reading_them_all(tmp_path: Path) -> None:
    """The console asks for the session list every second: its query walks `sessions_by_update`
    and counts messages only for the sessions it returns."""
    store = SqliteStore(tmp_path / "list.db")
    await store.open()
    statements: list[str] = []
    try:
        await store.append(Fence.local(S1), 1, ROWS)
        await store._call(lambda c: c.set_trace_callback(statements.append))
        assert [s.key for s in await store.sessions(limit=5)] == [S1]
        await store._call(lambda c: c.set_trace_callback(None))
    finally:
        await store.close()
    listing = next(s for s in statements if s.startswith("SELECT") and "FROM sessions" in s)
    with sqlite3.connect(store.path) as db:
        plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + listing)]
    assert "SCAN s USING INDEX sessions_by_update" in plan, plan


async def test_session_writes_called_together_reach_redis_in_one_round_trip(
        redis_store: RedisStore, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write its own result: a fenced-out one is refused alone, and a Redis that forgot the
    scripts (restarted empty) is sent them again."""
    sessions = [f"webchat:dm:batch-{i}" for i in range(8)]
    fences = [await own(redis_store, s) for s in sessions]
    await redis_store.append(fences[0], 1, ROWS[:1])  # the scripts are known
    inbound = [i for i in await asyncio.gather(*(redis_store.accept_inbound(f, msg("m1", chat_id=f.session_key))
                                                 for f in fences)) if i is not None]
    assert len(inbound) == len(fences)
    sends: list[int] = []
    original = Connection.send_packed_command

    async def counted(self: Connection, *args: Any, **kwargs: Any) -> Any:
        sends.append(1)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(Connection, "send_packed_command", counted)
    redis_server.client().delete(keys.lease(sessions[3]))  # its lease lapsed: a zombie's write
    results = await asyncio.gather(*(redis_store.append(f, 1, ROWS[:2], inbound=(i, InboundStatus.RUNNING, None))
                                     for f, i in zip(fences, inbound, strict=True)), return_exceptions=True)
    assert len(sends) == 1
    assert [isinstance(r, FencedOut) for r in results] == [i == 3 for i in range(8)]
    assert [await redis_store.conversation(s) for s in sessions[1:3]] == [(1, ROWS[:2])] * 2

    redis_server.client().script_flush()
    again = [f for i, f in enumerate(fences) if i != 3]
    await asyncio.gather(*(redis_store.append(f, 1, ROWS[2:3]) for f in again))
    assert [len((await redis_store.conversation(f.session_key))[1]) for f in again] == [
        2 + (f is fences[0]) + 1 for f in again]

    unencodable = [ChatMessage("assistant", "half a pair \ud800")]
    results = await asyncio.gather(*(redis_store.append(f, 1, unencodable if f is again[1] else ROWS[3:])
                                     for f in again), return_exceptions=True)
    assert [isinstance(r, Exception) for r in results] == [f is again[1] for f in again]
    assert [len((await redis_store.conversation(f.session_key))[1]) for f in again] == [
        2 + (f is fences[0]) + 1 + (f is not again[1]) for f in again]
