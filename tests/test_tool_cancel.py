"""Cancel reaches the I/O: tool process groups (TERM, then KILL) and thread-based tools."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

from gateway.agents.processes import group_alive
from gateway.agents.tools import Tool, ToolRegistry
from gateway.core.cancellation import STOPPED_BY_USER, ToolReason, get_run, is_cancelled, run_in_executor
from tests.conftest import RouterFactory
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script


async def _pgid_from(path: Path) -> int:
    for _ in range(500):
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        await asyncio.sleep(0.01)
    raise AssertionError("the tool never started")


async def _gone(pgid: int, timeout: float) -> float:
    start = time.monotonic()
    while group_alive(pgid):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"process group {pgid} still alive after {timeout} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def test_stop_kills_the_tool_process_group_with_its_children(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, tmp_path: Path) -> None:
    router = await make_router()
    pidfile = tmp_path / "pgid"
    command = f"echo $$ > {pidfile}; sleep 60 & sleep 60 & wait"
    provider.then(Script(tool_calls=[("shell", {"command": command})]))
    run = (await router.submit(chat.message("c1", "run it"), chat)).run
    pgid = await _pgid_from(pidfile)
    assert group_alive(pgid)
    await router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await asyncio.wait_for(run.wait(), 1)
    assert run.reason == STOPPED_BY_USER
    await _gone(pgid, timeout=0.4)  # well inside the 0.5 s grace: SIGTERM was enough


async def test_a_tool_that_ignores_sigterm_is_killed_after_the_grace(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, tmp_path: Path) -> None:
    router = await make_router()
    pidfile = tmp_path / "pgid"
    # Ignored signals are inherited, so the sleeping child ignores SIGTERM too.
    command = f"trap '' TERM; echo $$ > {pidfile}; sleep 60 & sleep 60; wait"
    provider.then(Script(tool_calls=[("shell", {"command": command})]))
    run = (await router.submit(chat.message("c1", "run it"), chat)).run
    pgid = await _pgid_from(pidfile)
    await asyncio.sleep(0.05)  # let the shell install its trap and start the children
    await router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await asyncio.wait_for(run.wait(), 1)  # the turn ends at once; the group is reaped behind it
    await asyncio.sleep(0.3)
    assert group_alive(pgid), "still alive inside the grace period: it really ignored SIGTERM"
    await _gone(pgid, timeout=1.0)  # SIGKILL after the 0.5 s grace


async def test_stopping_one_session_leaves_another_sessions_tool_running(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, tmp_path: Path) -> None:
    router = await make_router()
    pids = {name: tmp_path / name for name in ("a", "b")}
    for name in ("a", "b"):
        command = f"echo $$ > {pids[name]}; sleep 60"
        provider.by_text[f"run {name}"] = Script(tool_calls=[("shell", {"command": command})])
    run_a = (await router.submit(chat.message("a", "run a"), chat)).run
    run_b = (await router.submit(chat.message("b", "run b"), chat)).run
    pg_a, pg_b = await _pgid_from(pids["a"]), await _pgid_from(pids["b"])
    await router.submit(chat.message("a", "/stop"), chat)
    await _gone(pg_a, timeout=0.4)
    assert group_alive(pg_b)
    assert run_b is not None and run_b.reason is None and run_a is not None and run_a.reason == STOPPED_BY_USER
    router.hard_cancel("memory:dm:b", ToolReason.system("test cleanup"))
    await _gone(pg_b, timeout=0.4)


async def test_thread_tools_see_only_their_own_runs_cancellation(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, tools: ToolRegistry) -> None:
    seen: dict[str, str] = {}
    started = {"a": threading.Event(), "b": threading.Event()}

    def blocking_work(name: str) -> str:
        run = get_run()
        assert run is not None
        started[name].set()
        for _ in range(1000):  # cooperative: poll this run's flag between units of work
            if is_cancelled():
                seen[name] = f"cancelled: {run.reason.marker if run.reason else '?'}"
                return "partial"
            run.thread_event.wait(0.01)
        seen[name] = "finished"
        return "done"

    async def threaded(args: dict[str, Any]) -> str:
        name = str(args["name"])
        if name == "a":  # one via to_thread, one via our run_in_executor: both carry the run
            return await asyncio.to_thread(blocking_work, name)
        return await run_in_executor(None, blocking_work, name)

    tools.register(Tool("work", "block in a thread", {"type": "object"}, threaded))
    router = await make_router()
    provider.by_text["go a"] = Script(tool_calls=[("work", {"name": "a"})])
    provider.by_text["go b"] = Script(tool_calls=[("work", {"name": "b"})], text="ok")
    run_a = (await router.submit(chat.message("a", "go a"), chat)).run
    run_b = (await router.submit(chat.message("b", "go b"), chat)).run
    assert await asyncio.to_thread(started["a"].wait, 5) and await asyncio.to_thread(started["b"].wait, 5)
    await router.submit(chat.message("a", "/stop"), chat)
    assert run_a is not None
    await run_a.wait()
    for _ in range(100):
        if "a" in seen:
            break
        await asyncio.sleep(0.01)
    assert seen == {"a": "cancelled: [interrupted by user: stopped by user (/stop)]"}
    assert run_b is not None and not run_b.is_cancelled()
    run_b.cancel(ToolReason.system("test cleanup"))
    await run_b.wait()
    for _ in range(100):
        if "b" in seen:
            break
        await asyncio.sleep(0.01)
    assert seen["b"] == "cancelled: [interrupted by system: test cleanup]"


async def test_echo_sleep_runs_the_sleep_program_and_stop_ends_it(
        make_router: RouterFactory, chat: MemoryChat) -> None:
    router = await make_router(agent="echo")
    secs = f"{random.uniform(30, 39):g}"  # this test's own tool, whatever else runs on the machine
    run = (await router.submit(chat.message("c1", f"!sleep {secs}"), chat)).run
    pgid = None
    for _ in range(200):
        out = os.popen(f"pgrep -f -x 'sleep {secs}'").read().split()
        if out:
            pgid = os.getpgid(int(out[0]))
            break
        await asyncio.sleep(0.01)
    assert pgid is not None
    await router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await run.wait()
    await _gone(pgid, timeout=0.4)
    done = (await router.submit(chat.message("c1", "!sleep 0.1"), chat)).run
    assert done is not None
    await done.wait()
    assert chat.texts("c1")[-1] == "Done: slept 0.1 s."


async def test_the_shell_allowlist_and_working_directory_are_enforced(reaper: object, tmp_path: Path) -> None:
    from gateway.agents.processes import ProcessReaper
    from gateway.agents.tools import ProcessToolSettings, shell_tool

    assert isinstance(reaper, ProcessReaper)
    tool = shell_tool(ProcessToolSettings(reaper=reaper, allow_prefixes=("pwd", "echo "), cwd=str(tmp_path)))
    assert (await tool.func({"command": "pwd"})).strip() == str(tmp_path)
    assert (await tool.func({"command": "echo hi"})).strip() == "hi"
    assert "not allowed" in await tool.func({"command": "rm -rf /tmp/nothing"})
    assert "not allowed" in await tool.func({"command": "echo hi; rm -rf /tmp/nothing"})
    assert "not allowed" in await tool.func({"command": "echo $(cat /etc/passwd)"})
