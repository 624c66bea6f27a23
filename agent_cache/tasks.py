"""Stopping background tasks: the cancel is delivered again until each task has ended.

A cancel can be lost. On Python 3.11, `asyncio.wait_for` returns the inner result when the task
awaiting it is cancelled in the loop iteration the inner one finished (bpo-42130; fixed in 3.12,
where `wait_for` is built on `asyncio.timeout`). redis-py sends every command inside such a
`wait_for` (the socket timeout), so a loop around Redis calls, cancelled at that instant, carries
on as if nothing had happened — and a stop that awaits it once waits forever. Same idea as
`Run.cancel` for turns: cancel, and cancel again until the task is done."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from typing import Any

REDELIVER_FIRST_S = 0.25  # a cleanup shorter than this (a task's `finally`) is never cut short
REDELIVER_MAX_S = 2.0


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], *,
                          give_up_s: float | None = None) -> set[asyncio.Future[Any]]:
    """Cancel `tasks` and wait for them to end, cancelling again (after REDELIVER_FIRST_S, the
    interval doubling to REDELIVER_MAX_S) those still running. Returns the tasks that had not ended
    after `give_up_s` (None: waits for all, and returns nothing)."""
    pending = {task for task in tasks if not task.done()}
    loop = asyncio.get_running_loop()
    deadline = math.inf if give_up_s is None else loop.time() + give_up_s
    interval = REDELIVER_FIRST_S
    while pending and (left := deadline - loop.time()) > 0:
        for task in pending:
            task.cancel()
        _done, pending = await asyncio.wait(pending, timeout=min(interval, left))
        interval = min(2 * interval, REDELIVER_MAX_S)
    return pending


def where(tasks: Iterable[asyncio.Future[Any]]) -> str:
    """Each task's name and the line its coroutine waits at: for the log of a stop that gave up."""
    parts = []
    for task in tasks:
        if not isinstance(task, asyncio.Task):
            parts.append(repr(task))
            continue
        frames = task.get_stack()
        at = f"{frames[-1].f_code.co_filename}:{frames[-1].f_lineno}" if frames else "?"
        parts.append(f"{task.get_name()} ({getattr(task.get_coro(), '__qualname__', '?')}) at {at}")
    return "; ".join(parts)
