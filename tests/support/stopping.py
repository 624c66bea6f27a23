"""A stop that either ends or fails the test with where it waits."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Awaitable

import pytest

STOP_DEADLINE_S = 60.0  # far above any stop's own bounds; below the suite's per-test timeout


async def stop_or_show_why_not(stop: Awaitable[None], deadline_s: float = STOP_DEADLINE_S) -> None:
    """Await `stop` (a daemon's or a coordinator's); if it hangs, fail with the stack of every task
    still waiting, which the suite's timeout (a dump of the threads only) would not show."""
    stopping = asyncio.ensure_future(stop)
    done, _ = await asyncio.wait({stopping}, timeout=deadline_s)
    if done:
        stopping.result()
        return
    stacks = []
    for task in asyncio.all_tasks():
        out = io.StringIO()
        task.print_stack(file=out)
        stacks.append(f"{task!r}\n{out.getvalue()}")
    stopping.cancel()
    pytest.fail(f"the stop did not end within {deadline_s:g} s; the tasks:\n" + "\n".join(stacks))
