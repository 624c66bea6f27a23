"""A turn is freed by reference counting when it ends, answered or stopped: it leaves no reference
cycle for the garbage collector, whose collections scan every live object (at 10,000 sessions
they were 40 % of the router's time, mostly spent on such cycles and the objects they held)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from gateway.core.cancellation import STOPPED_BY_USER, Run
from gateway.core.turns import Turn
from platforms.outbox import Job
from platforms.streaming import EditStreamReply
from tests.conftest import RouterFactory
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script

OURS = (Run, Turn, EditStreamReply, Job)


@pytest.fixture
def garbage() -> Iterator[list[object]]:
    """What the collector finds unreachable from here on (kept for inspection, not freed)."""
    gc.collect()
    gc.garbage.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def ours(found: list[object]) -> list[str]:
    return [repr(o) for o in found if isinstance(o, OURS)]


async def test_answered_stopped_and_replaced_turns_leave_no_reference_cycles(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, garbage: list[object]) -> None:
    provider.by_text["slow"] = Script(delay_s=0.5)  # still streaming when it is stopped or replaced
    router = await make_router()
    for i in range(5):  # answered, each streamed in two states (the last words wait for the record)
        sub = await router.submit(chat.message(f"a{i}", f"hello {i}"), chat)
        assert sub.run is not None
        await asyncio.wait_for(sub.run.wait(), 10)
    for key in ("s0", "s1", "s2"):  # stopped mid-stream
        sub = await router.submit(chat.message(key, "slow"), chat)
        assert sub.run is not None
        await chat.wait_for(lambda: bool(chat.texts(key)), timeout=10)  # noqa: B023 (awaited here)
        assert router.hard_cancel(f"memory:dm:{key}", STOPPED_BY_USER) is sub.run
        await asyncio.wait_for(sub.run.wait(), 10)
    first = await router.submit(chat.message("r", "slow"), chat)  # replaced by a follow-up
    assert first.run is not None
    await chat.wait_for(lambda: bool(chat.texts("r")), timeout=10)
    second = await router.submit(chat.message("r", "hello again"), chat)
    assert second.run is not None
    await asyncio.wait_for(asyncio.gather(first.run.wait(), second.run.wait()), 10)
    await asyncio.sleep(0.05)  # the outbox workers and final deliveries finish
    del sub, first, second

    gc.collect()
    assert ours(garbage) == []
