"""Cancel reaches the I/O: tool process groups (TERM, then KILL) and thread-based tools."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.agents.processes import GroupLedger, ProcessReaper, group_alive, run_in_process_group
from gateway.agents.tools import Tool, ToolRegistry
from gateway.core.cancellation import (
    STOPPED_BY_USER,
    Run,
    ToolReason,
    current_run,
    get_run,
    is_cancelled,
    run_in_executor,
)
from tests.conftest import RouterFactory
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import Proc, argv, pids_from, running, running_in_group, stat, until


async def _gone(pgid: int, timeout: float) -> float:
    """Wait until nothing of group `pgid` is left, zombies included (the reaper collected them)."""
    return await until(lambda: not group_alive(pgid), timeout, f"process group {pgid} still alive", every=0.005)


async def test_stop_kills_the_tool_process_group_with_its_children(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.agents.processes")
    router = await make_router()
    pidfile = tmp_path / "pids"
    command = f"echo $$ >> {pidfile}; sleep 60 & echo $! >> {pidfile}; sleep 60 & echo $! >> {pidfile}; wait"
    provider.then(Script(tool_calls=[("shell", {"command": command})]))
    run = (await router.submit(chat.message("c1", "run it"), chat)).run
    pgid, *_children = await pids_from(pidfile, 3)
    assert len(running_in_group(pgid)) == 3
    await router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await asyncio.wait_for(run.wait(), 5)
    assert run.reason == STOPPED_BY_USER
    await _gone(pgid, timeout=5)
    # SIGTERM was enough: the reaper never had to reach for SIGKILL.
    assert not [r for r in caplog.records if "sending SIGKILL" in r.getMessage()]


async def test_a_tool_that_ignores_sigterm_is_killed_after_the_grace(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, tmp_path: Path) -> None:
    router = await make_router()
    pidfile = tmp_path / "pids"
    # Ignored signals are inherited, so the sleeping child ignores SIGTERM too. The PIDs are
    # written once the trap is in place and the first child runs.
    command = f"trap '' TERM; sleep 60 & echo $$ >> {pidfile}; echo $! >> {pidfile}; sleep 60; wait"
    provider.then(Script(tool_calls=[("shell", {"command": command})]))
    run = (await router.submit(chat.message("c1", "run it"), chat)).run
    pgid, _child = await pids_from(pidfile, 2)
    await router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await asyncio.wait_for(run.wait(), 5)  # the turn ends at once; the group is reaped behind it
    assert run.cancelled_at is not None
    await _gone(pgid, timeout=5)
    # It really ignored SIGTERM: it lived through the 0.5 s grace, until the SIGKILL.
    assert time.perf_counter() - run.cancelled_at >= 0.5


async def test_stopping_one_session_leaves_another_sessions_tool_running(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, tmp_path: Path) -> None:
    router = await make_router()
    pids = {name: tmp_path / name for name in ("a", "b")}
    for name in ("a", "b"):
        command = f"echo $$ >> {pids[name]}; sleep 60"
        provider.by_text[f"run {name}"] = Script(tool_calls=[("shell", {"command": command})])
    run_a = (await router.submit(chat.message("a", "run a"), chat)).run
    run_b = (await router.submit(chat.message("b", "run b"), chat)).run
    (pg_a,), (pg_b,) = await pids_from(pids["a"], 1), await pids_from(pids["b"], 1)
    await router.submit(chat.message("a", "/stop"), chat)
    await _gone(pg_a, timeout=5)
    assert group_alive(pg_b)
    assert run_b is not None and run_b.reason is None and run_a is not None and run_a.reason == STOPPED_BY_USER
    router.hard_cancel("memory:dm:b", ToolReason.system("test cleanup"))
    await _gone(pg_b, timeout=5)


async def _pid_in(path: Path) -> Proc:
    await until(lambda: path.exists() and path.read_text().strip().isdigit(), 10, f"{path.name} never written")
    found = stat(int(path.read_text()))
    assert found is not None
    return found


async def test_a_descendant_that_left_its_tools_group_is_killed_once_the_tool_has_ended(tmp_path: Path) -> None:
    """A tool double-forks a child into a session of its own that ignores SIGTERM: the tool's
    end (TERM, then KILL, to its group) misses it. The sweep kills it — once its tool has ended and
    it was seen twice — and then reaps its zombie; a descendant of a tool still running is left."""
    ledger = GroupLedger(tmp_path / "tool-groups")
    reaper = ProcessReaper(0.5, ledger=ledger)
    # The tool returns only once its child has left the group (the file is written after setsid).
    escape = ("setsid sh -c 'trap \"\" TERM; echo $$ > {0}; exec sleep 300' </dev/null >/dev/null 2>&1 & "
              "while [ ! -s {0} ]; do sleep 0.01; done;")
    ended, running_tool = tmp_path / "ended.pid", tmp_path / "running.pid"
    procs: list[Proc] = []
    spawn = None
    try:
        result = await run_in_process_group(["sh", "-c", escape.format(ended)], reaper=reaper, timeout_s=10,
                                            max_output=1000)
        assert result.returncode == 0
        orphan = await _pid_in(ended)
        procs.append(orphan)
        spawn = reaper.spawn(["sh", "-c", escape.format(running_tool) + " exec sleep 300"])
        live = await _pid_in(running_tool)
        procs.append(live)
        await reaper.drain()  # the ended tool's group is gone: TERM and KILL missed the orphan
        tool = await spawn.task
        assert tool is not None and orphan.pgid != tool.pid and running(orphan) and running(live)

        # (A sweep also reaps zombies other tests left to this process, a subreaper: only ours are checked.)
        assert orphan.pid not in await reaper.reap_orphans()  # seen once: not yet
        assert orphan.pid in await reaper.reap_orphans()  # seen twice, its tool ended: killed
        await until(lambda: not running(orphan), 5, "the orphan was not killed")
        await reaper.reap_orphans()  # its zombie (re-parented to this process, a subreaper) is reaped
        after = stat(orphan.pid)
        assert after is None or after.start != orphan.start
        assert running(live), "a descendant of a tool still running was killed"

        spawn.stop()  # that tool ends too: its escaped descendant is an orphan now
        await reaper.drain()
        assert running(live)
        assert live.pid not in await reaper.reap_orphans()
        assert live.pid in await reaper.reap_orphans()
        await until(lambda: not running(live), 5, "the second orphan was not killed")
    finally:
        if spawn is not None:
            spawn.stop()
        await reaper.drain()
        for p in procs:
            if running(p):
                os.kill(p.pid, signal.SIGKILL)
        await ledger.close()


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
    await until(lambda: "a" in seen, 5, "thread a never saw its cancel")
    assert seen == {"a": "cancelled: [interrupted by user: stopped by user (/stop)]"}
    assert run_b is not None and not run_b.is_cancelled()
    run_b.cancel(ToolReason.system("test cleanup"))
    await run_b.wait()
    await until(lambda: "b" in seen, 5, "thread b never saw its cancel")
    assert seen["b"] == "cancelled: [interrupted by system: test cleanup]"


async def test_echo_sleep_runs_the_sleep_program_and_stop_ends_it(
        make_router: RouterFactory, chat: MemoryChat, reaper: ProcessReaper) -> None:
    router = await make_router(agent="echo")
    run = (await router.submit(chat.message("c1", "!sleep 30"), chat)).run
    # The tool is found among the groups this test's own reaper started, not by name on the machine.
    await until(lambda: bool(reaper.live_groups), 10, "the sleep tool never started")
    (pgid,) = reaper.live_groups
    await router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await run.wait()
    await _gone(pgid, timeout=5)
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


async def test_a_stop_at_any_instant_of_the_spawn_leaves_nothing_running(reaper: ProcessReaper, tmp_path: Path) -> None:
    """Cancel at many offsets around the spawn (loop iterations and random delays): whatever the
    tool had started by then — the shell, its children — is gone once the reaper has drained."""
    seed = int(os.environ.get("SPAWN_RACE_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    for trial in range(60):
        pidfile = tmp_path / f"pids{trial}"
        # The shell writes its own PID (= its group) first, then each child's as it starts.
        command = f"echo $$ >> {pidfile}; sleep 60 & echo $! >> {pidfile}; sleep 60 & echo $! >> {pidfile}; wait"
        run = Run(f"spawn-race-{trial}")
        ctx = contextvars.copy_context()
        ctx.run(current_run.set, run)
        task = loop.create_task(run_in_process_group(["/bin/sh", "-c", command], reaper=reaper, timeout_s=30,
                                                     max_output=1024), context=ctx)
        run.attach(task)
        if trial % 2:
            offset = f"{rng.randrange(12)} loop iterations"
            for _ in range(int(offset.split()[0])):
                await asyncio.sleep(0)
        else:
            delay = rng.uniform(0, 0.03)
            offset = f"{delay * 1000:.1f} ms"
            await asyncio.sleep(delay)
        run.cancel(ToolReason.system("spawn race test"))
        what = f"trial {trial}, cancelled after {offset} (seed {seed}; rerun with SPAWN_RACE_SEED={seed})"
        await asyncio.wait({task}, timeout=10)
        assert task.done(), f"the tool call did not end: {what}"
        await asyncio.wait_for(reaper.drain(), 10)
        assert not reaper.live_groups, what
        started = [int(line) for line in pidfile.read_text().split()] if pidfile.exists() else []
        if started:
            left = running_in_group(started[0])
            assert not left, f"{len(left)} process(es) of the tool outlived its run: {what}"


async def test_a_tool_that_swallows_cancels_is_cancelled_again_until_it_ends(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, tools: ToolRegistry) -> None:
    swallowed = 0
    started = asyncio.Event()

    async def stubborn(args: dict[str, Any]) -> str:
        nonlocal swallowed
        started.set()
        while swallowed < 5:  # a library that catches CancelledError, several times over
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
        return "finished after all"

    tools.register(Tool("stubborn", "swallows cancels", {"type": "object"}, stubborn))
    router = await make_router(cancel_grace_s=30)
    provider.then(Script(tool_calls=[("stubborn", {})]))
    run = (await router.submit(chat.message("c1", "go"), chat)).run
    await asyncio.wait_for(started.wait(), 10)
    await router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await asyncio.wait_for(run.wait(), 10)  # re-delivered: over long before the 30 s grace
    assert swallowed == 5 and run.redeliveries >= 4
    assert run.done_at is not None and run.reason == STOPPED_BY_USER
    assert not any("finished after all" in t for t in chat.texts("c1"))


async def test_a_tool_that_never_ends_frees_its_lane_after_the_grace_and_sends_nothing(
        make_router: RouterFactory, chat: MemoryChat, provider: FakeProvider, tools: ToolRegistry,
        store: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.core.cancellation")
    swallowed = 0
    started, release = asyncio.Event(), asyncio.Event()

    async def stuck(args: dict[str, Any]) -> str:
        nonlocal swallowed
        started.set()
        while not release.is_set():  # swallows every cancel until the test lets it go
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
        return "LEAKED tool output"

    tools.register(Tool("stuck", "never ends", {"type": "object"}, stuck))
    router = await make_router(cancel_grace_s=0.5)
    provider.then(Script(tool_calls=[("stuck", {})]))
    provider.by_text["go"] = Script(text="LEAKED reply")  # what the model would say after the tool
    run = (await router.submit(chat.message("c1", "go"), chat)).run
    await asyncio.wait_for(started.wait(), 10)
    await router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await asyncio.wait_for(run.wait(), 10)  # the lane moved on without the task...
    assert run.cancelled_at is not None and time.perf_counter() - run.cancelled_at >= 0.5  # ...after the grace
    assert run.done_at is None and swallowed > 1  # still running, and cancelled again and again
    _, history = await store.conversation("memory:dm:c1")
    assert (history[-1].interrupted_by, history[-1].reason) == ("user", "stopped by user (/stop)")
    assert chat.texts("c1")[-1] == "Stopped."

    after = (await router.submit(chat.message("c1", "next"), chat)).run  # the session works
    assert after is not None
    await asyncio.wait_for(after.wait(), 10)
    assert after.reason is None and chat.texts("c1")[-1].startswith("reply to: next")

    release.set()  # the stuck task finally ends: nothing of it reaches the chat
    await until(lambda: run.done_at is not None, 10, "the stuck task never ended")
    await asyncio.sleep(0.2)  # room for anything it might (wrongly) still send
    assert not [t for t in chat.texts("c1") if "LEAKED" in t]
    assert any("after its turn was recorded" in r.getMessage() for r in caplog.records)


_STAND_IN = """
import asyncio, sys
from gateway.agents.processes import ProcessReaper, run_in_process_group

async def main() -> None:
    reaper = ProcessReaper(5, pdeathsig=sys.argv[1])
    tool = asyncio.create_task(run_in_process_group(["sleep", "45"], reaper=reaper, timeout_s=60, max_output=100))
    while not reaper.live_groups:
        await asyncio.sleep(0.01)
    print(*reaper.live_groups, flush=True)
    await tool

asyncio.run(main())
"""


@pytest.mark.parametrize("method", ["setpriv", "preexec", "none"])
async def test_the_tool_dies_with_the_process_that_started_it(method: str) -> None:
    """PDEATHSIG, either way it is set: a stand-in for the daemon starts `sleep 45` and is
    SIGKILLed; the sleep must die with it. Without PDEATHSIG ("none") it would run on."""
    stand_in = subprocess.Popen([sys.executable, "-c", _STAND_IN, method], stdout=subprocess.PIPE)
    tool: Proc | None = None
    try:
        assert stand_in.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(stand_in.stdout.readline), 20)
        tool = stat(int(line))
        assert tool is not None and tool.ppid == stand_in.pid and argv(tool.pid) == ["sleep", "45"]
        stand_in.kill()
        stand_in.wait()  # by now the kernel has sent the parent-death signal, if one was set
        if method == "none":
            await asyncio.sleep(0.2)  # a negative check: give a (wrongly) pending kill time to land
            assert running(tool), "the control case: without PDEATHSIG the tool outlives its parent"
        else:
            leader = tool
            await until(lambda: not running(leader), 5, f"PDEATHSIG ({method}) did not kill the tool")
    finally:
        stand_in.kill()
        stand_in.wait()
        if tool is not None and running(tool):
            os.kill(tool.pid, signal.SIGKILL)
