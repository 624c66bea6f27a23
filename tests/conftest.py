"""Shared fixtures: a real SQLite store, a fake provider, routers built from real parts."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gateway.agents.echo import EchoAgent
from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.processes import ProcessReaper
from gateway.agents.tools import ProcessToolSettings, ToolRegistry, builtin_registry
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.router import Router
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider
from tests.support.pg_server import PgServer, pg_server_of_our_own
from tests.support.ports import free_port as free_port  # re-exported: the tests import it from here
from tests.support.redis_server import RedisServer, RedisServerMissing
from tests.support.routers import start_router
from tests.support.stopping import stop_or_show_why_not

if TYPE_CHECKING:
    from gateway.ops.daemon import Daemon

# Every test fails if it leaves a process running, and so does the run (see the module).
pytest_plugins = ("tests.support.leaks",)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(tmp_path / "test.db")
    await s.open()
    yield s
    await s.close()


@pytest.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    async with FakeProvider() as p:
        yield p


@pytest.fixture
async def reaper() -> AsyncIterator[ProcessReaper]:
    r = ProcessReaper(grace_s=0.5)
    yield r
    await r.drain()


@pytest.fixture
def tools(reaper: ProcessReaper) -> ToolRegistry:
    return builtin_registry(ProcessToolSettings(reaper=reaper), shell=True)


@pytest.fixture
def chat() -> MemoryChat:
    return MemoryChat()


RouterFactory = Callable[..., Awaitable[Router]]


@pytest.fixture
async def make_router(store: SqliteStore, provider: FakeProvider, tools: ToolRegistry,
                      chat: MemoryChat) -> AsyncIterator[RouterFactory]:
    """Build a started router over the real store; `agent="openai"` talks to the fake provider."""
    made: list[tuple[Router, OpenAIAgent | None]] = []

    async def factory(agent: str = "openai", **settings: object) -> Router:
        oa = None
        if agent == "openai":
            oa = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="fake", retries=1,
                                            backoff_s=0.01), tools)
            router = await start_router(store, oa, chat, **settings)
        else:
            router = await start_router(store, EchoAgent(tools, delay_s=0.0), chat, **settings)
        made.append((router, oa))
        return router

    yield factory
    for router, oa in made:
        await router.shutdown(GATEWAY_RESTART, grace_s=5)
        if oa is not None:
            await oa.close()


def console_script(name: str) -> str:
    """The console script `name` of the Python running the tests (the one `pip install -e` made),
    not whichever `name` comes first on PATH — that may be another checkout's."""
    return str(Path(sys.executable).with_name(name))




DaemonFactory = Callable[..., Awaitable["Daemon"]]


@pytest.fixture
async def make_daemon(tmp_path: Path, provider: FakeProvider) -> AsyncIterator[DaemonFactory]:
    """Start an in-process daemon from a config dict (sections -> keys); stopped at teardown."""
    from gateway.ops.config import load_config
    from gateway.ops.daemon import Daemon

    started: list[Daemon] = []

    async def factory(**sections: dict[str, object]) -> Daemon:
        env = {"SWITCHBOARD_HTTP__PORT": str(free_port()), "SWITCHBOARD_ADMIN__PORT": str(free_port()),
               "SWITCHBOARD_STORE__DATA_DIR": str(tmp_path / "data"),
               "SWITCHBOARD_AGENT__KIND": "openai", "SWITCHBOARD_AGENT__BASE_URL": provider.base_url,
               "SWITCHBOARD_AGENT__RETRIES": "0", "SWITCHBOARD_TOOLS__TOOL_KILL_GRACE_S": "0.5"}
        for section, values in sections.items():
            for key, value in values.items():
                env[f"SWITCHBOARD_{section.upper()}__{key.upper()}"] = (
                    json.dumps(value) if isinstance(value, (list, bool, dict)) else str(value))
        daemon = Daemon(load_config(None, env))
        await daemon.start()
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        await stop_or_show_why_not(daemon.stop())


RedisFactory = Callable[..., RedisServer]


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator[RedisFactory]:
    """Start a real redis-server (`RedisServer`'s arguments; its directory under the test's tmp
    dir), stopped at teardown whatever the test did: `start_redis("redis", persistence=True)`.

    Fails (never skips) when the binary is missing and cannot be installed.
    """
    servers: list[RedisServer] = []

    def start(name: str = "redis", **kwargs: Any) -> RedisServer:
        server = RedisServer(tmp_path / name, **kwargs)
        servers.append(server)  # before the start: a failed start is cleaned up too
        try:
            return server.start()
        except RedisServerMissing as exc:
            pytest.fail(str(exc), pytrace=False)

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_server(start_redis: RedisFactory) -> RedisServer:
    """A real redis-server on a free loopback port (no persistence), stopped at teardown."""
    return start_redis("redis")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A real PostgreSQL server of the test run's own (initdb + pg_ctl on a free loopback port),
    shared by the tests, each of which gets a fresh database (`pg_url`). Never the machine's.

    Fails (never skips) when the binaries are missing and cannot be installed.
    """
    with pg_server_of_our_own() as server:
        yield server


_databases = itertools.count(1)


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """The URL of a fresh, empty database on the shared test server, dropped afterwards."""
    name = f"t{next(_databases)}"
    yield pg_server.create_database(name)
    pg_server.drop_database(name)
