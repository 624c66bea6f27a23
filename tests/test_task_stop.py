"""Stopping background tasks (`agent_cache.tasks.cancel_and_wait`): a cancel that a task lost is
delivered again. On Python 3.11 redis-py loses one now and then: it sends each command inside
`asyncio.wait_for`, which returns normally when its task is cancelled in the loop iteration the
send finished (bpo-42130). A loop around Redis calls then carries on, and a stop that cancels it
once waits forever (a coordinator's stop hung so, in CI, on its claims loop)."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
from redis.exceptions import RedisError

from agent_cache.tasks import cancel_and_wait
from gateway.store.redis import connect
from tests.support.redis_server import RedisServer

ROUNDS = 8
ROUND_DEADLINE_S = 30.0  # readiness on a busy machine; never a figure asserted on


async def test_a_task_that_lost_its_cancel_is_cancelled_again() -> None:
    lost: list[int] = []

    async def loses_the_first_cancel() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost.append(1)  # as a `wait_for` that returned its result instead

    task = asyncio.create_task(loses_the_first_cancel())
    await asyncio.sleep(0.05)
    late = await asyncio.wait_for(cancel_and_wait([task]), ROUND_DEADLINE_S)
    assert not late and task.cancelled() and lost == [1]


async def test_a_task_that_never_ends_is_given_up_on_and_named() -> None:
    stop = asyncio.Event()

    async def stubborn() -> None:
        while not stop.is_set():
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(10)

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    try:
        late = await cancel_and_wait([task], give_up_s=0.6)
        assert late == {task}
    finally:
        stop.set()
        await cancel_and_wait([task])


async def test_loops_around_redis_calls_end_however_their_cancel_lands(redis_server: RedisServer) -> None:
    """Loops of Redis commands (as the coordinator's chores and readers run) on a small pool,
    cancelled at random instants: every one ends. On 3.11, a single plain cancel left one running
    within the first few rounds."""
    seed = int(os.environ.get("SWITCHBOARD_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    failures: list[str] = []

    async def chore(redis: object) -> None:
        while True:
            await asyncio.sleep(rng.random() * 0.005)
            try:
                await redis.hkeys("workers")  # type: ignore[attr-defined]
                await redis.exists("alive")  # type: ignore[attr-defined]
            except (RedisError, OSError) as exc:  # as `periodically` does: logged, tried again
                failures.append(type(exc).__name__)

    async def reader(redis: object) -> None:
        while True:
            try:
                await redis.xread({"inbox": "$"}, block=1000)  # type: ignore[attr-defined]
            except (RedisError, OSError):
                await asyncio.sleep(0.1)

    for n in range(ROUNDS):
        redis = connect(redis_server.url + "?max_connections=4", decode_responses=True)
        try:
            tasks = [asyncio.create_task(reader(redis)) for _ in range(2)]
            tasks += [asyncio.create_task(chore(redis)) for _ in range(8)]
            await asyncio.sleep(rng.random() * 0.2)
            late = await cancel_and_wait(tasks, give_up_s=ROUND_DEADLINE_S)
            assert not late, f"seed {seed}, round {n}: {len(late)} task(s) still running after their stop"
        finally:
            await redis.aclose()
