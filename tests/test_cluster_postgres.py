"""Cluster mode with history in PostgreSQL: real worker processes, a real redis-server for
coordination and a PostgreSQL server of the test's own — restarted under load, and a worker killed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from gateway.core.ports import OPEN_STATUSES
from gateway.ops.config import load_config
from gateway.ops.stores import build_store, store_kind
from gateway.store.composite import PostgresClusterStore
from gateway.store.postgres import PostgresStore
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider
from tests.support.pg_server import PgServer, pg_server_of_our_own
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, content, end_all, start_all

TTL = 3.0


@pytest.fixture
def own_pg() -> Iterator[PgServer]:
    with pg_server_of_our_own() as server:
        yield server


def test_build_store_picks_the_backend(tmp_path: Path) -> None:
    pg, redis = "postgresql://sb:pw@127.0.0.1:5/sb", "redis://127.0.0.1:6/0"
    for env, kind, cls in (({}, "sqlite", "SqliteStore"), ({"SWITCHBOARD_REDIS__URL": redis}, "redis", "RedisStore"),
                           ({"SWITCHBOARD_STORE__URL": pg}, "postgres", "PostgresStore"),
                           ({"SWITCHBOARD_STORE__URL": pg, "SWITCHBOARD_REDIS__URL": redis}, "postgres+redis",
                            "PostgresClusterStore")):
        config = load_config(None, {"SWITCHBOARD_STORE__DATA_DIR": str(tmp_path), **env})
        store = build_store(config, retention=True)
        assert (store_kind(config), type(store).__name__) == (kind, cls)
        if isinstance(store, PostgresStore):
            assert not store.require_fence  # one process: local fences
        if isinstance(store, PostgresClusterStore):
            assert store.history.require_fence  # a cluster: every write carries a lease's fence


def test_store_config_is_validated_in_one_line(tmp_path: Path) -> None:
    from gateway.ops.config import ConfigError

    for env, error in (({"SWITCHBOARD_STORE__URL": "mysql://db/x"}, "store.url: must start with postgresql://"),
                       ({"SWITCHBOARD_STORE__KEEP_DAYS": "30"}, "store.keep_days: needs the PostgreSQL store"),
                       ({"SWITCHBOARD_STORE__URL": "postgres://db/x", "SWITCHBOARD_STORE__KEEP_DAYS": "-1"},
                        "store.keep_days: must not be negative")):
        with pytest.raises(ConfigError, match=error) as raised:
            load_config(None, env)
        assert "\n" not in str(raised.value)
    # A secret like the others: from a file, or from systemd's credentials directory.
    (tmp_path / "url").write_text("postgresql://sb:pw@db/sb\n")
    (tmp_path / "store.url").write_text("postgresql://sb:cred@db/sb\n")
    assert load_config(None, {"SWITCHBOARD_STORE__URL_FILE": str(tmp_path / "url")}).store.url.reveal() == (  # type: ignore[union-attr]
        "postgresql://sb:pw@db/sb")
    config = load_config(None, {"CREDENTIALS_DIRECTORY": str(tmp_path), "SWITCHBOARD_STORE__KEEP_DAYS": "365"})
    assert config.store.url is not None and config.store.url.reveal() == "postgresql://sb:cred@db/sb"
    assert config.store.keep_days == 365 and "cred" not in repr(config.store)


async def readyz(http: aiohttp.ClientSession, worker: Worker) -> tuple[int, dict[str, Any]]:
    async with http.get(worker.url + "/readyz") as resp:
        return resp.status, await resp.json()


async def until(what: str, check: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_one_process_on_postgres(make_daemon: DaemonFactory, pg_url: str) -> None:
    daemon = await make_daemon(store={"url": pg_url}, api={"enabled": True}, webchat={"enabled": False})
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/readyz") as resp:
            assert resp.status == 200 and (await resp.json())["checks"]["store"]["detail"] == "postgres"
        async with http.post(base + "/v1/chat/completions", headers={"X-Session-Id": "s1"},
                             json={"messages": [{"role": "user", "content": "hello"}]}) as resp:
            assert resp.status == 200, await resp.text()
    conversation = await daemon.store.conversation("api:dm:s1")
    assert [m.role for m in conversation[1]] == ["user", "assistant"]


async def test_a_cluster_on_postgres_rides_out_a_postgres_restart_and_a_dead_worker(
        redis_server: RedisServer, provider: FakeProvider, tmp_path: Path, own_pg: PgServer) -> None:
    url = own_pg.create_database("cluster")
    a, b = (Worker(name, redis_server.url, provider.base_url, tmp_path, ttl_s=TTL, SWITCHBOARD_STORE__URL=url)
            for name in ("a", "b"))
    pinned = {f"x{i}": a for i in range(4)} | {f"y{i}": b for i in range(4)}  # as a load balancer would
    try:
        await start_all(a, b)
        async with aiohttp.ClientSession() as http:
            status, body = await readyz(http, a)
            assert status == 200 and body["checks"]["store"]["detail"] == "postgres+redis"
            for session, worker in pinned.items():
                status, body = await worker.ask(http, session, f"before {session}")
                assert status == 200, body

            own_pg.kill()
            for worker in (a, b):
                status, body = await readyz(http, worker)
                assert status == 503 and not body["checks"]["store"]["ok"]
            status, body = await a.ask(http, "x0", "while down")
            assert status in (400, 503) and "storage" in body["error"]["message"], body

            own_pg.start()
            for worker in (a, b):
                await until("readiness after the restart", lambda w=worker: _ready(http, w))
            for session, worker in pinned.items():
                status, body = await worker.ask(http, session, f"after {session}")
                assert status == 200, body
                assert content(body)

            a.kill()  # its sessions move to b after the lease TTL
            for session in [s for s, w in pinned.items() if w is a]:
                async def answered(session: str = session) -> bool:
                    status, _ = await b.ask(http, session, f"taken over {session}")
                    return status == 200
                await until(f"b answering in {session}", answered, timeout_s=TTL * 5)
    finally:
        end_all(a, b)

    conn = await asyncpg.connect(url)
    try:
        stored = await conn.fetch("SELECT session_key, role, content FROM messages ORDER BY id")
        fences = await conn.fetch("SELECT session_key, fence FROM fences")
    finally:
        await conn.close()
    users = [(r[0], r[2]) for r in stored if r[1] == "user"]
    for session in pinned:
        mine = [text for key, text in users if key == f"api:dm:{session}"]
        # Each acknowledged message stored once, in order; the one refused while down not at all.
        assert mine[:2] == [f"before {session}", f"after {session}"], mine
        assert "while down" not in mine
        if session.startswith("x"):
            assert mine[2:] and set(mine[2:]) == {f"taken over {session}"}
    assert len(fences) == len(pinned)  # every session's writes carried a lease's fence


async def _ready(http: aiohttp.ClientSession, worker: Worker) -> bool:
    status, _ = await readyz(http, worker)
    return status == 200


async def test_a_session_whose_adoption_met_postgres_down_is_adopted_again_once_it_is_back(
        redis_server: RedisServer, provider: FakeProvider, tmp_path: Path, own_pg: PgServer) -> None:
    """A worker dies mid-turn and PostgreSQL is down when another worker adopts the session: the
    adoption cannot read what was left open. It must not keep the session unrecovered (its
    message would stay open for good, the session released as idle and never adopted again); it
    lets it go, listed, and adopts it again once the store answers, closing the cut-off turn."""
    url = own_pg.create_database("adoption")
    provider.delay_s, provider.words = 0.05, 600  # a 30 s answer: a's turn is mid-stream when a dies
    a, b = (Worker(name, redis_server.url, provider.base_url, tmp_path, ttl_s=TTL, SWITCHBOARD_STORE__URL=url)
            for name in ("a", "b"))
    try:
        await start_all(a, b)
        async with aiohttp.ClientSession() as http:
            asking = asyncio.create_task(a.ask(http, "t", "a long one"))
            await until("a's turn streaming", _streaming(provider, "a long one"))
            a.kill()
            own_pg.kill()
            await asyncio.gather(asking, return_exceptions=True)
            # b's scan finds the lapsed lease (TTL) and tries to adopt it while the store is down.
            await until("b trying to adopt t while PostgreSQL is down",
                        _logged(b, "could not read what api:dm:t left open"), timeout_s=TTL * 10)
            await asyncio.sleep(2.0)  # several more scans (every 0.5 s) meet the store down: not logged again
            own_pg.start()
            await until("t's open message closed by b", _closed(url, "api:dm:t"), timeout_s=TTL * 10)
    finally:
        end_all(a, b)
    text = b.log.read_text(errors="replace")
    assert "Traceback" not in text
    # Retried every scan while the store was down, said once per outage (and once more per new kind).
    assert 1 <= text.count("could not read what api:dm:t left open") <= 2
    assert "recovering sessions taken over: the store answers again" in text


def _streaming(provider: FakeProvider, text: str) -> Any:
    async def check() -> bool:
        return any(c.words > 0 for c in provider.requests_for(text))
    return check


def _logged(worker: Worker, line: str) -> Any:
    async def check() -> bool:
        return line in worker.log.read_text(errors="replace")
    return check


def _closed(url: str, session: str) -> Any:
    async def check() -> bool:
        try:
            conn = await asyncpg.connect(url)
        except (OSError, asyncpg.PostgresError):
            return False
        try:
            rows = await conn.fetch("SELECT status FROM inbound WHERE session_key = $1", session)
        finally:
            await conn.close()
        return bool(rows) and all(r["status"] not in OPEN_STATUSES for r in rows)
    return check


async def test_a_relayed_answer_that_ends_while_redis_is_down_still_reaches_its_client(
        start_redis: Any, provider: FakeProvider, tmp_path: Path, pg_url: str) -> None:
    """The client waits on b; a owns the session and runs the turn. Its answer ends, and is recorded
    in PostgreSQL, while Redis is down: the relay events carrying the end could not be written.
    They were dropped, and the client was left waiting (or told to retry an answer already
    recorded, which its retry then recorded twice); now they are written once Redis is back."""
    from tests.fakes.openai_provider import Script

    redis = start_redis("redis", persistence=True)  # a restart keeps the leases: only the outage matters
    provider.delay_s, provider.words = 0.0, 2
    words = " ".join(f"w{i}" for i in range(40))
    provider.by_text["long"] = Script(text=words, delay_s=0.05)  # 2 s
    a, b = (Worker(name, redis.url, provider.base_url, tmp_path, ttl_s=6.0, SWITCHBOARD_STORE__URL=pg_url)
            for name in ("a", "b"))
    try:
        await start_all(a, b)
        async with aiohttp.ClientSession() as http:
            assert (await a.ask(http, "r", "hello"))[0] == 200  # a owns r
            asking = asyncio.ensure_future(b.ask(http, "r", "long"))
            try:
                await until("a streaming", _streaming(provider, "long"), timeout_s=15)
                redis.kill()
                await until("a's answer recorded while Redis is down", _recorded(pg_url, "api:dm:r", words),
                            timeout_s=15)
                await asyncio.sleep(0.5)  # its end is published (and fails) right after the record lands
                assert "relay publisher: could not publish" in a.log.read_text(errors="replace")
                await asyncio.to_thread(redis.start)
                status, body = await asyncio.wait_for(asking, 30)
            finally:
                asking.cancel()
    finally:
        end_all(a, b)
    assert status == 200, body
    assert content(body).rstrip() == words
    assert body["choices"][0]["finish_reason"] == "stop"


def _recorded(url: str, session: str, text: str) -> Any:
    async def check() -> bool:
        conn = await asyncpg.connect(url)
        try:
            rows = await conn.fetch("SELECT content FROM messages WHERE session_key = $1 AND role = 'assistant'",
                                    session)
        finally:
            await conn.close()
        return any(r["content"].rstrip() == text for r in rows)
    return check
