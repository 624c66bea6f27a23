"""The `Run` cancellation scope on its own: reasons, races, closers, context in threads."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway.core.cancellation import (
    STOPPED_BY_USER,
    Run,
    RunCancelled,
    ToolReason,
    checkpoint,
    current_run,
    get_run,
    is_cancelled,
    run_in_executor,
)
from gateway.core.transcript import ChatMessage, TextDelta, ToolCall, ToolCallsRequested, ToolResult, TurnRecorder


def test_a_reason_has_a_kind_and_text_and_no_default() -> None:
    with pytest.raises(TypeError):
        ToolReason()  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        ToolReason("admin", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ToolReason.system("  ")
    assert ToolReason.system("gateway restart").marker == "[interrupted by system: gateway restart]"
    with pytest.raises(TypeError):
        Run("s").cancel(None)  # type: ignore[arg-type]


async def test_a_cancel_before_the_task_is_attached_still_wins() -> None:
    run = Run("s")
    started = False

    async def body() -> None:
        nonlocal started
        started = True

    assert run.cancel(STOPPED_BY_USER)
    task = asyncio.get_running_loop().create_task(body())
    run.attach(task)
    await asyncio.wait({task})
    assert task.cancelled() and not started


async def test_closers_run_synchronously_inside_cancel_and_only_once() -> None:
    run = Run("s")
    closed: list[str] = []
    with run.on_cancel(lambda: closed.append("http")), run.on_cancel(lambda: closed.append("proc")):
        assert run.cancel(ToolReason.user("stopped by user (/stop)"))
        assert closed == ["http", "proc"]
        assert not run.cancel(ToolReason.system("gateway restart"))  # the first reason stands
    assert run.reason == STOPPED_BY_USER
    assert closed == ["http", "proc"]
    with run.on_cancel(lambda: closed.append("late")):  # registering after the cancel closes at once
        pass
    assert closed[-1] == "late"


async def test_a_closer_left_behind_does_not_fire() -> None:
    run = Run("s")
    closed: list[str] = []
    with run.on_cancel(lambda: closed.append("http")):
        pass
    run.cancel(STOPPED_BY_USER)
    assert closed == []


async def test_threads_find_their_own_run_through_the_copied_context() -> None:
    runs = [Run("a"), Run("b")]

    def work() -> tuple[str | None, bool]:
        run = get_run()
        return (run.session_key if run else None), is_cancelled()

    async def in_run(run: Run) -> list[tuple[str | None, bool]]:
        current_run.set(run)
        with ThreadPoolExecutor(1) as pool:
            return [await asyncio.to_thread(work), await run_in_executor(pool, work)]

    runs[0].cancel(STOPPED_BY_USER)
    results = await asyncio.gather(*(asyncio.get_running_loop().create_task(
        in_run(r), context=contextvars.copy_context()) for r in runs))
    assert results == [[("a", True), ("a", True)], [("b", False), ("b", False)]]
    assert get_run() is None and not is_cancelled()  # nothing leaked into the caller
    with pytest.raises(RunCancelled):
        runs[0].raise_if_cancelled()


def test_the_recorder_marks_partial_text_and_in_flight_tools() -> None:
    rec = TurnRecorder()
    call = ToolCall("c1", "sleep", "{}")
    done = ToolCall("c0", "sleep", "{}")
    for event in (TextDelta("Let me "), ToolCallsRequested("Let me ", (done, call)),
                  ToolResult("c0", "slept"), TextDelta("still")):
        rec.feed(event)
    rows = rec.interrupted(ToolReason.system("gateway restart"))
    assert [(r.role, r.content) for r in rows] == [
        ("assistant", "Let me "), ("tool", "slept"),
        ("tool", "[interrupted by system: gateway restart]"), ("assistant", "still")]
    assert rows[-1].model_content() == "still\n\n[interrupted by system: gateway restart]"
    assert rows[2].to_openai() == {"role": "tool", "content": "[interrupted by system: gateway restart]",
                                   "tool_call_id": "c1"}
    assert ChatMessage("assistant", "", interrupted_by="user", reason="x").model_content() == \
        "[interrupted by user: x]"


def test_a_turn_stopped_between_a_tool_result_and_the_next_round_still_ends_with_the_marker() -> None:
    rec = TurnRecorder()
    for event in (ToolCallsRequested("", (ToolCall("c1", "sleep", "{}"),)), ToolResult("c1", "slept")):
        rec.feed(event)
    rows = rec.interrupted(ToolReason.user("user sent a new message"))
    assert [(r.role, r.content, r.interrupted_by) for r in rows] == [
        ("assistant", "", None), ("tool", "slept", None), ("assistant", "", "user")]


def test_a_stopped_turn_keeps_exactly_the_text_the_user_was_shown() -> None:
    def recorder() -> TurnRecorder:
        rec = TurnRecorder()
        call = ToolCall("c1", "sleep", "{}")
        for event in (TextDelta("Let me "), ToolCallsRequested("Let me ", (call,)), ToolResult("c1", "slept"),
                      TextDelta("The answer "), TextDelta("is 42")):
            rec.feed(event)
        return rec

    reason = ToolReason.user("stopped by user (/stop)")
    # The reply showed the turn's text up to "The answer " (deltas are shown across rounds).
    rows = recorder().interrupted(reason, shown="Let me The answer ")
    assert [(r.role, r.content) for r in rows] == [("assistant", "Let me "), ("tool", "slept"),
                                                   ("assistant", "The answer ")]
    assert rows[-1].model_content() == "The answer \n\n[interrupted by user: stopped by user (/stop)]"
    # Nothing of this round was shown yet: the row is kept (it carries the mark), empty.
    assert recorder().interrupted(reason, shown="Let")[-1].content == ""
    # A platform that shows everything it is given (None) keeps the whole partial text.
    assert recorder().interrupted(reason)[-1].content == "The answer is 42"
async def test_a_cancel_is_redelivered_until_the_task_ends() -> None:
    run = Run("s")
    swallowed = 0

    async def stubborn() -> str:
        nonlocal swallowed
        while swallowed < 5:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
        return "gave up"

    task = asyncio.get_running_loop().create_task(stubborn())
    run.attach(task)
    await asyncio.sleep(0)  # it is inside its sleep now
    assert run.cancel(STOPPED_BY_USER)
    assert await asyncio.wait_for(run.join(grace_s=30), 10)
    assert task.result() == "gave up" and swallowed == 5 and run.redeliveries >= 4


async def test_join_gives_up_on_a_task_that_never_ends_only_after_the_grace() -> None:
    run = Run("s")
    release = asyncio.Event()

    async def stuck() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):  # a library that swallows every cancel
                await asyncio.sleep(3600)

    task = asyncio.get_running_loop().create_task(stuck())
    run.attach(task)
    joining = asyncio.get_running_loop().create_task(run.join(grace_s=0.3))
    await asyncio.sleep(0.05)
    assert not joining.done()  # not cancelled: join waits for the task, however long
    run.cancel(STOPPED_BY_USER)
    assert await asyncio.wait_for(joining, 10) is False
    assert run.cancelled_at is not None and time.perf_counter() - run.cancelled_at >= 0.3
    release.set()
    await asyncio.wait_for(asyncio.wait({task}), 10)  # the next re-delivery wakes it: it ends
    assert run.done_at is not None
    assert await run.join(grace_s=0.3)  # and join says so at once


async def test_a_run_that_was_never_cancelled_is_joined_when_its_task_ends() -> None:
    run = Run("s")
    task = asyncio.get_running_loop().create_task(asyncio.sleep(0.01, "done"))
    run.attach(task)
    assert await asyncio.wait_for(run.join(grace_s=0), 10)
    assert task.result() == "done" and run.redeliveries == 0


async def test_a_cancelled_run_takes_no_new_step_even_if_its_cancel_was_swallowed() -> None:
    checkpoint()  # outside any run: nothing to stop
    run = Run("s")
    ctx = contextvars.copy_context()
    ctx.run(current_run.set, run)
    ctx.run(checkpoint)  # a live run goes on
    run.cancel(STOPPED_BY_USER)
    with pytest.raises(asyncio.CancelledError):
        ctx.run(checkpoint)  # before a provider request or a tool start: refused, whatever was swallowed
