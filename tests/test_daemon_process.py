"""The daemon as a real process: embedded defaults, `python -m gateway`, SIGTERM mid-turn, and
`kill -9` — after which no tool it started may be left running."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from gateway.agents.processes import GroupLedger
from tests.conftest import DaemonFactory, console_script, free_port
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import Proc, argv, child_running, children, pids_from, running, running_in_group, stat, until
from tests.support.spawn import Group, wait_ready

SENTINEL = ["-m", "gateway.agents.sentinel"]


class Daemon:
    """`switchboard run` in `cwd` (its data dir is `cwd/.switchboard`), logging to a file."""

    def __init__(self, cwd: Path, *extra_env: tuple[str, str], module: bool = False, name: str = "daemon") -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = cwd / f"{name}.log"
        env = {**os.environ, "SWITCHBOARD_HTTP__PORT": str(self.port), "SWITCHBOARD_ADMIN__PORT": str(free_port()),
               "SWITCHBOARD_API__ENABLED": "true", "SWITCHBOARD_TOOLS__TOOL_KILL_GRACE_S": "1", **dict(extra_env)}
        command = [sys.executable, "-m", "gateway", "run"] if module else [console_script("switchboard"), "run"]
        self.proc = Group(command, cwd=cwd, env=env, log=self.log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def post(self, http: aiohttp.ClientSession, text: str, user: str) -> asyncio.Task[aiohttp.ClientResponse]:
        """A chat completion, sent in the background."""
        body = {"messages": [{"role": "user", "content": text}], "metadata": {"session_id": user}}
        return asyncio.create_task(http.post(self.base + "/v1/chat/completions", json=body))

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    async def ready(self) -> None:
        """Until /readyz answers 200; a daemon that exits or is not ready in time is ended, and the
        failure shows its log."""
        try:
            await wait_ready(self.base + "/readyz", self.proc, "the daemon", self.log)
        except BaseException:
            self.end()
            raise

    async def logged(self, text: str, timeout: float = 10) -> None:
        await until(lambda: text in self.logs(), timeout, f"the daemon never logged {text!r}")

    async def exited(self, timeout: float = 10) -> int:
        return await asyncio.to_thread(self.proc.wait, timeout)

    def kill(self) -> None:
        """`kill -9` of the daemon process alone: the scenario (the clean-up is `end()`)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def end(self) -> None:
        """Kill the daemon's process group and reap it: the clean-up every path ends with."""
        self.proc.end()

    async def sentinel(self) -> Proc:
        """The daemon's tool sentinel (started with its first tool)."""
        found: list[Proc] = []

        def started() -> bool:
            found[:] = [p for p in children(self.pid) if argv(p.pid)[1:3] == SENTINEL]
            return bool(found)

        await until(started, 10, "the daemon has no tool sentinel")
        return found[0]


def _shell_agent(provider: FakeProvider) -> tuple[tuple[str, str], ...]:
    """The shell unconfined: these tests follow a tool's processes by the PIDs it writes to a file of
    the test's, which a sandboxed command can neither see nor name (tests/test_sandbox.py has the
    same guarantees for sandboxed commands)."""
    return (("SWITCHBOARD_TOOLS__SHELL", "true"), ("SWITCHBOARD_TOOLS__SANDBOX", "off"),
            ("SWITCHBOARD_AGENT__KIND", "openai"), ("SWITCHBOARD_AGENT__BASE_URL", provider.base_url),
            ("SWITCHBOARD_AGENT__RETRIES", "0"))


async def test_embedded_defaults_serve_the_web_chat_and_store_under_dot_switchboard(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, module=True)
    try:
        await daemon.ready()
        async with aiohttp.ClientSession() as http, http.get(daemon.base + "/") as resp:
            assert resp.status == 200
        assert (tmp_path / ".switchboard" / "switchboard.db").exists()
        daemon.proc.send_signal(signal.SIGINT)
        assert await daemon.exited() == 0
    finally:
        daemon.end()


@pytest.mark.parametrize(("choice", "expected"), [(None, "uvloop"), ("asyncio", "asyncio"), ("uvloop", "uvloop")])
async def test_the_event_loop_is_chosen_by_config_and_named_in_the_startup_log(tmp_path: Path, choice: str | None,
                                                                              expected: str) -> None:
    here = ("PYTHONPATH", str(Path(__file__).resolve().parents[1]))  # this checkout's gateway, whatever is installed
    daemon = Daemon(tmp_path, here, *([("SWITCHBOARD_DAEMON__EVENT_LOOP", choice)] if choice else []), module=True)
    try:
        await daemon.ready()
        await daemon.logged(f"event loop {expected}")  # the start-up line ends with it
        async with aiohttp.ClientSession() as http, await daemon.post(http, "hello", "loop-user") as resp:
            assert resp.status == 200 and "hello" in (await resp.json())["choices"][0]["message"]["content"]
        daemon.proc.send_signal(signal.SIGTERM)
        assert await daemon.exited() == 0
    finally:
        daemon.end()


async def test_signals_repeated_until_it_has_exited_still_end_in_a_clean_exit(tmp_path: Path) -> None:
    """An operator (or a supervisor) that sends SIGTERM again and again while the daemon stops gets
    exit status 0 once it has stopped: a signal that arrives after the event loop has closed, while
    the interpreter winds down, does not turn a clean stop into death by signal (-15)."""
    here = ("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    daemon = Daemon(tmp_path, here, module=True)
    try:
        await daemon.ready()
        deadline = time.monotonic() + 60
        while daemon.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                daemon.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.002)
        assert await daemon.exited(timeout=5) == 0, daemon.logs()[-3000:]
    finally:
        daemon.end()


async def test_sigterm_mid_turn_cancels_with_the_system_reason_and_leaves_no_orphans(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path)
    try:
        await daemon.ready()
        async with aiohttp.ClientSession() as http:
            request = daemon.post(http, "!sleep 60", "erin")
            tool = await child_running(daemon.pid, ["sleep", "60"])  # the daemon's own child: nobody else's sleep
            started = time.monotonic()
            daemon.proc.send_signal(signal.SIGTERM)
            assert await daemon.exited() == 0
            assert time.monotonic() - started < 5
            assert not running_in_group(tool.pgid), "the tool's process group outlived the daemon"
            resp = await request
            answer = await resp.json()
            assert answer["switchboard"].items() >= {"interrupted_by": "system", "reason": "gateway restart"}.items()
    finally:
        daemon.end()
    db = sqlite3.connect(tmp_path / ".switchboard" / "switchboard.db")
    rows = db.execute("SELECT role, content, interrupted_by, reason FROM messages ORDER BY id").fetchall()
    assert rows[-1] == ("tool", "[interrupted by system: gateway restart]", "system", "gateway restart")
    assert db.execute("SELECT status, detail FROM inbound").fetchall() == [
        ("restart", "[interrupted by system: gateway restart]")]  # to be resumed on the next start
    assert '"msg": "shutting down: [interrupted by system: gateway restart]"' in daemon.logs()
    assert not list((tmp_path / ".switchboard" / "tool-groups").glob("*/*")), "a clean stop leaves no records"


async def test_a_second_sigterm_during_the_drain_exits_at_once_without_orphans(
        tmp_path: Path, provider: FakeProvider) -> None:
    # A tool that ignores SIGTERM (and so does its child), mid-drain: the second signal must still
    # leave nothing behind.
    pidfile = tmp_path / "pids"
    command = f"trap '' TERM; echo $$ >> {pidfile}; sleep 55; sleep 55"
    provider.then(Script(tool_calls=[("shell", {"command": command})]))
    daemon = Daemon(tmp_path, ("SWITCHBOARD_DAEMON__DRAIN_TIMEOUT_S", "60"), *_shell_agent(provider))
    try:
        await daemon.ready()
        async with aiohttp.ClientSession() as http:
            request = daemon.post(http, "run the tool", "drainer")
            (pgid,) = await pids_from(pidfile, 1)
            daemon.proc.send_signal(signal.SIGTERM)  # drain: the turn may finish (it will not, for a minute)
            await daemon.logged("draining 1 running turn(s)")
            assert daemon.proc.poll() is None and running_in_group(pgid)
            started = time.monotonic()
            daemon.proc.send_signal(signal.SIGTERM)  # enough: now
            await daemon.exited()
            assert time.monotonic() - started < 3
            await until(lambda: not running_in_group(pgid), 5, "the tool outlived the daemon")
            request.cancel()
    finally:
        daemon.end()


async def test_kill_9_of_the_daemon_takes_its_tool_with_it(tmp_path: Path) -> None:
    """The README's own `!sleep 30`: the daemon is SIGKILLed; its tool must not run on."""
    daemon = Daemon(tmp_path)
    try:
        await daemon.ready()
        async with aiohttp.ClientSession() as http:
            request = daemon.post(http, "!sleep 30", "kim")
            tool = await child_running(daemon.pid, ["sleep", "30"])
            sentinel = await daemon.sentinel()
            daemon.kill()  # kill -9
            await until(lambda: not running(tool), 5, "the tool outlived the daemon's kill -9")
            await until(lambda: not running(sentinel), 10, "the sentinel did not exit after the daemon died")
            request.cancel()
    finally:
        daemon.end()
    assert not list((tmp_path / ".switchboard" / "tool-groups").glob("*/*")), "the sentinel cleared the records"


async def test_kill_9_of_the_daemon_takes_the_tools_children_too(tmp_path: Path, provider: FakeProvider) -> None:
    """The group's leader dies with the daemon (PDEATHSIG); its children, which PDEATHSIG does not
    reach — one in the group, one that left it with setsid — are killed by the sentinel. The
    daemon is killed the instant the tool has started them, recorded or not."""
    pidfile = tmp_path / "pids"
    command = f"echo $$ >> {pidfile}; sleep 45 & echo $! >> {pidfile}; setsid sleep 44 & echo $! >> {pidfile}; wait"
    provider.then(Script(tool_calls=[("shell", {"command": command})]))
    daemon = Daemon(tmp_path, *_shell_agent(provider))
    try:
        await daemon.ready()
        async with aiohttp.ClientSession() as http:
            request = daemon.post(http, "go", "lee")
            leader, child, escaped = (stat(pid) for pid in await pids_from(pidfile, 3))
            assert leader is not None and child is not None and escaped is not None
            assert child.pgid == leader.pid
            await until(lambda: (p := stat(escaped.pid)) is not None and p.pgid == escaped.pid, 5,
                        "the setsid child never got a session of its own")
            daemon.kill()
            await until(lambda: not (running(leader) or running(child) or running(escaped)), 10,
                        "the tool outlived the daemon")
            request.cancel()
    finally:
        daemon.end()
    await daemon.logged("the daemon is gone; killed its tool process group(s)")  # the sentinel's word


async def test_tools_of_a_daemon_that_died_with_its_sentinel_are_killed_at_the_next_start(
        tmp_path: Path, provider: FakeProvider) -> None:
    pidfile = tmp_path / "pids"
    provider.then(Script(tool_calls=[("shell", {"command": f"echo $$ >> {pidfile}; sleep 45 & echo $! >> {pidfile}; "
                                                           "wait"})]))
    first = Daemon(tmp_path, *_shell_agent(provider), name="first")
    second: Daemon | None = None
    tool: list[Proc] = []
    try:
        await first.ready()
        async with aiohttp.ClientSession() as http:
            request = first.post(http, "go", "max")
            tool = [p for p in map(stat, await pids_from(pidfile, 2)) if p is not None]
            assert len(tool) == 2
            leader, child = tool
            sentinel = await first.sentinel()
            os.kill(sentinel.pid, signal.SIGSTOP)  # it cannot act...
            first.kill()
            os.kill(sentinel.pid, signal.SIGKILL)  # ...and dies with the daemon
            await until(lambda: not running(leader), 5, "PDEATHSIG did not kill the group leader")
            assert running(child), "nothing but the next start may have killed the child"
            request.cancel()
        second = Daemon(tmp_path, *_shell_agent(provider), name="second")
        await second.ready()  # the sweep runs before the daemon takes any message
        await until(lambda: not running(child), 5, "the next start did not kill the orphaned tool")
        assert "tool process group(s) or process(es) left running by a daemon that died" in second.logs()
    finally:
        first.end()
        if second is not None:
            second.end()
        for p in tool:
            if running(p):
                os.kill(p.pid, signal.SIGKILL)


async def test_the_start_sweep_kills_recorded_groups_and_never_a_reused_pid(tmp_path: Path,
                                                                           make_daemon: DaemonFactory) -> None:
    """Records left by a daemon that is gone: a group still alive is killed (its leader, or what is
    left of it once the leader is gone); a PID whose start time differs is someone else's."""
    started: list[Group] = []
    ledger: GroupLedger | None = None

    def own_session(command: str) -> Group:
        started.append(Group(["/bin/sh", "-c", command], stdout=subprocess.PIPE))
        return started[-1]

    try:
        ours, stranger = own_session("exec sleep 50"), own_session("exec sleep 50")
        leaderless = own_session("sleep 50 & echo $!")  # the leader exits; its child stays in the group
        assert leaderless.stdout is not None
        member_pid = int(leaderless.stdout.readline())
        procs = {name: stat(p.pid) for name, p in (("ours", ours), ("stranger", stranger),
                                                   ("leaderless", leaderless))}
        leaderless.wait()  # (its stat was read while it was still a zombie of ours)
        dead = subprocess.Popen(["true"])
        dead.wait()  # a daemon that no longer exists
        member = stat(member_pid)
        assert procs["ours"] and procs["stranger"] and procs["leaderless"] and member
        assert member.pgid == leaderless.pid and stat(leaderless.pid) is None
        ledger = GroupLedger(tmp_path / "data" / "tool-groups", owner=(dead.pid, 12345))
        ledger.add(ours.pid, procs["ours"].start)
        ledger.add(stranger.pid, procs["stranger"].start + 1)  # the PID was reused since it was recorded
        ledger.add(leaderless.pid, procs["leaderless"].start)
        await make_daemon()
        assert ours.wait(5) == -signal.SIGKILL
        await until(lambda: not running(member), 5, "the leaderless group's member was not killed")
        assert running(procs["stranger"]), "a process that merely reused a recorded PID was killed"
        assert not ledger.dir.exists()
    finally:
        for p in started:
            p.end()  # its group: the leaderless group's member too, if it is still there
        if ledger is not None:
            await ledger.close()  # its sentinel (started by `add`) waits for this, or for pytest's end
