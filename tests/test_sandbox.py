"""The shell tool's sandbox (issue 31, finding 9), probed as tenant B's model would use the shell:
the store, the web chat secret, tenant A's files and processes, the daemon's environment and the
admin listener are all out of reach. And what every tool keeps: a stop reaches every process in
the sandbox (TERM, then KILL), and none outlives the daemon, even after `kill -9`."""

from __future__ import annotations

import asyncio
import contextvars
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.agents.processes import ProcessReaper, group_members, run_in_process_group
from gateway.agents.sandbox import Sandbox
from gateway.core.cancellation import STOPPED_BY_USER, Run, ToolReason, current_run
from platforms.tenants import key_id
from platforms.webchat_sessions import SECRET_FILE
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import Proc, argv, children, running, stat, until
from tests.support.sandbox import ensure_bwrap
from tests.test_daemon_process import Daemon

K1, K2 = "sk-sandbox-tenant-a-0123456789", "sk-sandbox-tenant-b-9876543210"
API = {"enabled": True, "tenants": {"team-a": K1, "team-b": K2}}


@pytest.fixture(autouse=True)
def _bwrap() -> None:
    ensure_bwrap()


async def _shell(http: aiohttp.ClientSession, daemon: Any, provider: FakeProvider, key: str, session: str,
                 command: str, *, background: bool = False) -> str:
    """Have the model run `command` in `session` of `key`'s tenant; the tool's result."""
    provider.then(Script(tool_calls=[("shell", {"command": command, "background": background})]))
    body = {"messages": [{"role": "user", "content": f"run: {command}"}], "metadata": {"session_id": session}}
    async with http.post(f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status == 200, await resp.text()
    return _tool_result(provider, f"run: {command}")


def _tool_result(provider: FakeProvider, text: str) -> str:
    """The result of the one tool call the model made for `text` (the session's earlier ones left out)."""
    results = set()
    for c in provider.connections:
        messages = c.body["messages"]
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        if messages[last_user]["content"] == text:
            results |= {m["content"] for m in messages[last_user:] if m["role"] == "tool"}
    assert len(results) == 1, results
    return str(results.pop())


def _tagged(tag_prefix: str) -> list[int]:
    """PIDs whose environment carries a tool tag starting with `tag_prefix` (a daemon's tools)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                environ = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(v.startswith(f"SWITCHBOARD_TOOL_OF={tag_prefix}".encode()) for v in environ):
                found.append(int(entry.name))
    return found


async def test_a_sandboxed_shell_cannot_reach_the_store_the_secret_or_another_tenants_files_and_processes(
        make_daemon: DaemonFactory, provider: FakeProvider, tmp_path: Path) -> None:
    """Finding 9: tenant B's model, through the shell, listed A's job command lines, killed A's job's
    process group, read A's messages from switchboard.db, read the web chat secret, read a process's
    secrets from /proc/<pid>/environ and called the token-less loopback admin API to stop A's turn."""
    provider.words = 1
    daemon = await make_daemon(api=API, tools={"shell": True}, webchat={"enabled": True})
    data = tmp_path / "data"
    admin = daemon.config.admin.port
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{daemon.config.http.port}/"):
            pass  # the web chat secret exists once a browser came
        started = await _shell(http, daemon, provider, K1, "a1", "echo the plan of a > /work/a.txt; sleep 60",
                               background=True)
        assert started.startswith("[started in background: job j1]"), started
        (a_job,) = daemon.jobs.jobs("api:dm:team-a/a1")
        assert (data / "switchboard.db").exists() and (data / SECRET_FILE).exists()
        probes = {
            "the store": f"cat {data}/switchboard.db | head -c 100; ls {data}",
            "the web chat secret": f"cat {data}/{SECRET_FILE}",
            "A's files": f"cat {data}/sandbox/*/work/a.txt; ls /work",
            "A's processes": f"ls /proc | grep -c '^[0-9]'; ps -eo pid,args 2>/dev/null | grep -v ps; "
                             f"kill -9 -{a_job.pgid}; kill -9 {a_job.pgid}",
            "the daemon's environment": f"cat /proc/{os.getpid()}/environ; env | grep -i switchboard",
            "the admin listener": f"bash -c 'exec 3<>/dev/tcp/127.0.0.1/{admin} && echo CONNECTED'",
        }
        seen = {what: await _shell(http, daemon, provider, K2, "b1", command) for what, command in probes.items()}
    assert "SQLite" not in seen["the store"] and "No such file" in seen["the store"], seen["the store"]
    assert "No such file" in seen["the web chat secret"], seen["the web chat secret"]
    assert "the plan of a" not in seen["A's files"] and "No such file" in seen["A's files"], seen["A's files"]
    assert "sleep 60" not in seen["A's processes"] and "No such process" in seen["A's processes"]
    lines = [line for line in seen["A's processes"].splitlines() if not line.startswith("exit code")]
    assert int(lines[0]) <= 6, seen["A's processes"]  # the sandbox's own: bwrap, sh, ls, grep
    assert a_job.state == "running" and running(stat(a_job.pgid))  # type: ignore[arg-type]
    env = seen["the daemon's environment"]
    assert "No such file" in env and "SWITCHBOARD_TOOL_OF=" in env and "SWITCHBOARD_API" not in env, env
    assert "CONNECTED" not in seen["the admin listener"] and "refused" in seen["the admin listener"]
    # B's own folder works, and is B's alone: A's session cannot see what B leaves there.
    async with aiohttp.ClientSession() as http:
        mine = await _shell(http, daemon, provider, K2, "b1", "echo b was here > /work/b.txt; cat /work/b.txt")
        theirs = await _shell(http, daemon, provider, K1, "a1", "ls /work; cat /work/b.txt")
    assert "b was here" in mine and "a.txt" in theirs and "b was here" not in theirs
    a_job.kill(ToolReason.system("test over"))


async def test_the_shell_is_offered_only_to_the_tenants_and_sessions_allowed(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """`tools.shell_allow_tenants` (and `shell_allow_sessions`), as MCP servers have: the shell and
    the job tools are not even offered to anyone else."""
    provider.words = 1
    daemon = await make_daemon(api=API, tools={"shell": True, "shell_allow_tenants": ["team-a"],
                                               "shell_allow_sessions": ["webchat:*"]})
    url = f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        for key, text in ((K1, "from a"), (K2, "from b")):
            body = {"messages": [{"role": "user", "content": text}], "user": "s"}
            async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
                assert resp.status == 200
    offered = {c.last_user: {t["function"]["name"] for t in c.body.get("tools", [])} for c in provider.connections}
    assert "shell" in offered["from a"] and "job_kill" in offered["from a"]
    assert "shell" not in offered["from b"] and "job_kill" not in offered["from b"], offered["from b"]
    # A model that names it anyway gets the unknown-tool answer.
    provider.then(Script(tool_calls=[("shell", {"command": "echo should not run"})]))
    async with aiohttp.ClientSession() as http, http.post(
            url, json={"messages": [{"role": "user", "content": "sneaky"}], "user": "s"},
            headers={"Authorization": f"Bearer {K2}"}) as resp:
        assert resp.status == 200
    assert _tool_result(provider, "sneaky") == "error: unknown tool 'shell'"
    assert key_id(K2) not in str(offered)


# --- what every tool keeps, sandboxed ------------------------------------------------------------


async def _sandboxed(reaper: ProcessReaper, sandbox: Sandbox, command: str,
                     run: Run) -> asyncio.Task[Any]:
    argv_, env = sandbox.wrap(["/bin/sh", "-c", command], run.session_key)
    ctx = contextvars.copy_context()
    ctx.run(current_run.set, run)
    task = asyncio.get_running_loop().create_task(
        run_in_process_group(argv_, reaper=reaper, timeout_s=60, max_output=4096, env=env), context=ctx)
    run.attach(task)  # as a turn's task is: a cancel of the run cancels it
    return task


async def test_a_stop_reaches_every_process_in_the_sandbox_term_then_kill(tmp_path: Path) -> None:
    reaper = ProcessReaper(grace_s=0.5)
    sandbox = Sandbox(tmp_path / "sandbox")
    try:
        for command, why in (("sleep 60 & sleep 61 & wait", "TERM ends them"),
                             ("trap '' TERM; sleep 62 & sleep 63 & wait", "they ignore TERM: KILL after the grace")):
            await _stop_in_sandbox(reaper, sandbox, command, why)
    finally:
        await reaper.drain()


async def _stop_in_sandbox(reaper: ProcessReaper, sandbox: Sandbox, command: str, why: str) -> None:
    run = Run("telegram:dm:1")
    task = await _sandboxed(reaper, sandbox, command, run)
    await until(lambda: len(reaper.live_groups) == 1, 10, "the sandbox never started")
    (pgid,) = reaper.live_groups
    sleeps = lambda: [m for m in group_members(pgid) if argv(m.pid)[:1] == ["sleep"]]  # noqa: E731
    await until(lambda: len(sleeps()) == 2, 10, "the commands never started")
    assert any(argv(m.pid)[:1] == ["bwrap"] for m in group_members(pgid))  # the sandbox is in the group too
    run.cancel(STOPPED_BY_USER)
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: not group_members(pgid), 5, f"{why}: the sandbox outlived its stop")
    await until(lambda: not reaper.live_groups, 5, "the reaper still holds the group")


async def test_kill_9_of_the_daemon_takes_every_sandboxed_process_with_it(
        tmp_path: Path, provider: FakeProvider) -> None:
    """PDEATHSIG on bwrap (the group's leader), --die-with-parent inside, and the sentinel for the
    rest: a sandboxed command's processes — one that left the group with setsid too — end with the
    daemon, however it dies."""
    command = "sleep 45 & setsid sleep 44 & wait"
    provider.then(Script(tool_calls=[("shell", {"command": command})]))
    daemon = Daemon(tmp_path, ("SWITCHBOARD_TOOLS__SHELL", "true"), ("SWITCHBOARD_AGENT__KIND", "openai"),
                    ("SWITCHBOARD_AGENT__BASE_URL", provider.base_url), ("SWITCHBOARD_AGENT__RETRIES", "0"))
    try:
        await daemon.ready()
        async with aiohttp.ClientSession() as http:
            request = daemon.post(http, "go", "lee")
            tools: list[Proc] = []

            def started() -> bool:
                tools[:] = [p for pid in _tagged(f"{daemon.pid}-") if (p := stat(pid)) is not None]
                return sum(argv(p.pid)[:1] == ["sleep"] for p in tools) == 2

            await until(started, 20, "the sandboxed commands never started")
            assert any(argv(p.pid)[:1] == ["bwrap"] for p in tools)
            assert any(p.ppid == daemon.pid for p in tools if argv(p.pid)[:1] == ["bwrap"])
            daemon.kill()
            await until(lambda: not any(running(p) for p in tools), 10, "a sandboxed process outlived the daemon")
            request.cancel()
    finally:
        daemon.end()
    assert not any(p.ppid == daemon.pid for p in children(daemon.pid))
