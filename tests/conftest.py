"""Shared fixtures: a real SQLite store, a fake provider, routers built from real parts."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gateway.agents.echo import EchoAgent
from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.tools import ProcessToolSettings, ToolRegistry, builtin_registry
from gateway.cancellation import GATEWAY_RESTART
from gateway.processes import ProcessReaper
from gateway.router import Router, RouterSettings
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider


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
            router = Router(RouterSettings(**settings), store, oa)  # type: ignore[arg-type]
        else:
            router = Router(RouterSettings(**settings), store, EchoAgent(tools, delay_s=0.0))  # type: ignore[arg-type]
        made.append((router, oa))
        await router.start({chat.name: chat})
        return router

    yield factory
    for router, oa in made:
        await router.shutdown(GATEWAY_RESTART, grace_s=5)
        if oa is not None:
            await oa.close()
