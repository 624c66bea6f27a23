"""Background jobs with real subprocesses: a long shell command moves to the background when the
user writes (busy "steer" and "interrupt"), the model reads and kills it, its end is reported to
the chat once, `/new` and the daemon's end (even `kill -9`) take it down, and the limits hold.
Processes are found by PID and start time (tests/support/procs.py), never by name."""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.agents.jobs import JobRegistry, JobSettings
from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.processes import ProcessReaper, group_alive
from gateway.agents.tools import ProcessToolSettings, ToolRegistry, builtin_registry
from gateway.core.background import KILLED_BY_USER
from gateway.core.cancellation import GATEWAY_RESTART, LEASE_LOST, NEW_MESSAGE, SESSION_RESET, Run, current_run
from gateway.core.router import Router
from gateway.store.sqlite import SqliteStore
from tests.conftest import DaemonFactory
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import Proc, pids_from, running, stat, until
from tests.support.routers import build_router
from tests.test_daemon_process import Daemon, _shell_agent

KEY = "memory:dm:c1"


class Setup:
    def __init__(self, router: Router, jobs: JobRegistry, tools: ToolRegistry,
                 delivered: Sequence[tuple[str, str]]) -> None:
        self.router, self.jobs, self.tools, self.delivered = router, jobs, tools, delivered


Make = Callable[..., Awaitable[Setup]]


@pytest.fixture
async def make(store: SqliteStore, provider: FakeProvider, chat: MemoryChat) -> AsyncIterator[Make]:
    """A router with the shell tool and background jobs over the real store, the fake provider and
    the in-memory chat; every completion notice it delivers is also listed in `delivered`."""
    made: list[tuple[Router, JobRegistry, OpenAIAgent, ProcessReaper]] = []

    async def factory(busy: str = "steer", **job_settings: Any) -> Setup:
        reaper = ProcessReaper(grace_s=0.5)
        jobs = JobRegistry(reaper, JobSettings(**{"yield_after_s": 0.3, **job_settings}))
        tools = builtin_registry(ProcessToolSettings(reaper=reaper), shell=True, jobs=jobs)
        agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="fake", retries=1, backoff_s=0.01),
                            tools)
        router = build_router(store, agent, chat, busy=busy, jobs=jobs)
        delivered = jobs.notices_sent  # every completion notice the registry handed to the router
        await chat.start(router)
        await router.start()
        made.append((router, jobs, agent, reaper))
        return Setup(router, jobs, tools, delivered)

    yield factory
    for router, jobs, agent, reaper in made:
        await router.shutdown(GATEWAY_RESTART, grace_s=5)
        await jobs.close()
        await agent.close()
        await asyncio.wait_for(reaper.drain(), 10)


def gated(pidfile: Path, gates: Path, *steps: str) -> str:
    """A shell command that writes its PID, then prints each step once its gate file exists."""
    script = [f"echo $$ >> {pidfile}"]
    for i, step in enumerate(steps):
        if i:
            script.append(f"while [ ! -e {gates}{i} ]; do sleep 0.02; done")
        script.append(f"echo {step}")
    return "; ".join(script)


def tool_rows(body: dict[str, Any]) -> list[str]:
    return [str(m["content"]) for m in body["messages"] if m["role"] == "tool"]


async def settled(chat: MemoryChat, router: Router, store: SqliteStore) -> None:
    """Every message of the session answered and nothing running."""
    async def idle() -> bool:
        return not router.status(KEY).running and not router.status(KEY).queued and \
            not await store.unfinished_inbound()
    deadline = asyncio.get_running_loop().time() + 10
    while not await idle():
        assert asyncio.get_running_loop().time() < deadline, "the session never settled"
        await asyncio.sleep(0.01)


async def test_steer_moves_a_long_command_to_the_background_the_model_reads_it_and_its_end_is_told_once(
        make: Make, chat: MemoryChat, provider: FakeProvider, store: SqliteStore, tmp_path: Path) -> None:
    s = await make(busy="steer")
    pidfile, gate = tmp_path / "pids", tmp_path / "gate"
    provider.then(Script(tool_calls=[("shell", {"command": gated(pidfile, gate, "first", "second", "third")})]))
    provider.then(Script(text="it runs in the background"))
    await s.router.submit(chat.message("c1", "build it"), chat)
    (pgid,) = await pids_from(pidfile, 1)
    leader = stat(pgid)
    assert leader is not None
    await s.router.submit(chat.message("c1", "how is it going?"), chat)
    await until(lambda: len(provider.connections) >= 2, 10, "the turn never went on after the steer")
    tools = tool_rows(provider.connections[1].body)
    assert tools[0].startswith("[moved to background: job j1 (the user sent a new message)]")
    assert "output so far:\nfirst" in tools[0]
    assert provider.connections[1].body["messages"][-1] == {"role": "user", "content": "how is it going?"}
    await settled(chat, s.router, store)
    assert running(leader), "the command was killed instead of moved"

    # The model polls it in a later turn: only the output since the move.
    (gate.parent / "gate1").touch()
    job = s.jobs.jobs(KEY)[0]
    await until(lambda: "second" in job.out.text, 10, "the job's output never came")
    provider.then(Script(tool_calls=[("job_read", {"job_id": "j1"})]))
    provider.then(Script(text="still going"))
    await s.router.submit(chat.message("c1", "check the job"), chat)
    await settled(chat, s.router, store)
    assert tool_rows(provider.connections[3].body)[-1] == "second\n[job j1 still running]"
    assert not s.delivered

    # It ends on its own: one automatic message tells the model, the chat sees the answer.
    (gate.parent / "gate2").touch()
    await until(lambda: len(s.delivered) == 1, 10, "the job's end was never reported")
    await until(lambda: any("finished: exit 0" in c.last_user for c in provider.connections), 10,
                "the model never heard of the job's end")
    await settled(chat, s.router, store)
    notice = next(c for c in provider.connections if "finished: exit 0" in c.last_user).last_user
    assert notice.startswith("[background job j1 finished: exit 0]\n$ echo ") and notice.endswith("third")
    # The model's answer reaches the chat; the gateway's own words it was given do not (the fake
    # provider answers "reply to: <them>": they are taken out of what it streams).
    assert chat.texts("c1")[-1].startswith("reply to:  w0") and "[background job" not in chat.texts("c1")[-1]
    # A second delivery of the same notice (a retry) is the same message: refused by the store.
    await s.router.deliver_automatic(KEY, *s.delivered[0])
    await settled(chat, s.router, store)
    _, rows = await store.conversation(KEY)
    assert sum(r.role == "user" and r.content.startswith("[background job j1") for r in rows) == 1
    assert sum("[background job j1" in c.last_user for c in provider.connections) == 1
    assert not running(leader)


async def test_interrupt_moves_a_command_old_enough_and_kills_a_young_one(
        make: Make, chat: MemoryChat, provider: FakeProvider, store: SqliteStore, tmp_path: Path) -> None:
    s = await make(busy="interrupt", yield_after_s=0.5)
    pidfile, gate = tmp_path / "pids", tmp_path / "gate"
    provider.then(Script(tool_calls=[("shell", {"command": gated(pidfile, gate, "first", "second")})]))
    first = (await s.router.submit(chat.message("c1", "build it"), chat)).run
    (pgid,) = await pids_from(pidfile, 1)
    leader = stat(pgid)
    assert leader is not None and first is not None
    await asyncio.sleep(0.6)  # older than yield_after_s
    await s.router.submit(chat.message("c1", "something else"), chat)
    await asyncio.wait_for(first.wait(), 5)
    assert first.reason == NEW_MESSAGE
    await settled(chat, s.router, store)
    assert running(leader), "an old enough command was killed by the interrupt"
    _, rows = await store.conversation(KEY)
    cut = next(r for r in rows if r.role == "tool")
    assert cut.content.startswith("[moved to background: job j1 (the user sent a new message)]")
    assert cut.content.endswith("\n[interrupted by user: user sent a new message]") and cut.interrupted_by == "user"
    assert [j.state for j in s.jobs.jobs(KEY)] == ["running"]

    # A command younger than yield_after_s dies with its turn, as before.
    young = tmp_path / "young"
    provider.then(Script(tool_calls=[("shell", {"command": f"echo $$ >> {young}; sleep 60"})]))
    turn = (await s.router.submit(chat.message("c1", "another"), chat)).run
    (young_pgid,) = await pids_from(young, 1)
    young_leader = stat(young_pgid)
    assert young_leader is not None and turn is not None
    await s.router.submit(chat.message("c1", "stop that"), chat)
    await asyncio.wait_for(turn.wait(), 5)
    await until(lambda: not running(young_leader), 5, "the young command outlived its turn")
    assert len(s.jobs.jobs(KEY)) == 1 and running(leader)
    s.jobs.kill_session(KEY, GATEWAY_RESTART)
    await until(lambda: not running(leader), 5, "the job outlived its kill")


async def test_job_kill_ends_the_whole_group_and_no_notice_follows(
        make: Make, chat: MemoryChat, provider: FakeProvider, store: SqliteStore, tmp_path: Path) -> None:
    s = await make()
    pidfile = tmp_path / "pids"
    command = f"echo $$ >> {pidfile}; sleep 60 & echo $! >> {pidfile}; sleep 60 & echo $! >> {pidfile}; wait"
    provider.then(Script(tool_calls=[("shell", {"command": command, "background": True})]))
    provider.then(Script(text="started"))
    await s.router.submit(chat.message("c1", "start it"), chat)
    procs = [stat(pid) for pid in await pids_from(pidfile, 3)]
    await settled(chat, s.router, store)
    assert tool_rows(provider.connections[1].body)[0].startswith("[started in background: job j1]")
    assert all(p is not None and running(p) and p.pgid == procs[0].pid for p in procs if p and procs[0])
    provider.then(Script(tool_calls=[("job_kill", {"job_id": "j1"})]))
    provider.then(Script(text="killed"))
    await s.router.submit(chat.message("c1", "kill it"), chat)
    await settled(chat, s.router, store)
    assert tool_rows(provider.connections[3].body)[-1] == (
        "job j1 killed ([interrupted by system: killed by the agent (job_kill)])")
    alive = [p for p in procs if p is not None and running(p)]
    assert not alive, f"left running: {alive}"
    await asyncio.sleep(0.2)  # a notice would have been handed over by now
    assert not s.delivered


async def test_stop_leaves_jobs_running_and_new_kills_them_with_the_reset_reason(
        make: Make, chat: MemoryChat, provider: FakeProvider, store: SqliteStore, tmp_path: Path) -> None:
    s = await make()
    pidfile = tmp_path / "pids"
    command = f"echo $$ >> {pidfile}; sleep 60 & echo $! >> {pidfile}; wait"
    provider.then(Script(tool_calls=[("shell", {"command": command, "background": True})]))
    provider.then(Script(text="started", delay_s=0.5))  # still streaming when /stop comes
    run = (await s.router.submit(chat.message("c1", "start it"), chat)).run
    procs = [stat(pid) for pid in await pids_from(pidfile, 2)]
    await until(lambda: len(provider.connections) >= 2, 10, "the second round never started")
    await s.router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await asyncio.wait_for(run.wait(), 5)
    assert all(p is not None and running(p) for p in procs), "/stop killed a background job"
    await s.router.submit(chat.message("c1", "/jobs"), chat)
    await chat.wait_for(lambda: re.match(r"Background jobs:\nj1 · running for \d+ s · (no output yet|[\d,]+ "
                                         r"characters of output) · \$ echo", chat.texts("c1")[-1]) is not None)
    # A second job, ended by the user with /kill; another chat's /kill cannot reach it.
    ctx = contextvars.copy_context()
    ctx.run(current_run.set, Run(KEY))
    other = tmp_path / "other"
    started = await asyncio.get_running_loop().create_task(s.tools.call("shell", json.dumps(
        {"command": f"echo $$ >> {other}; sleep 60", "background": True})), context=ctx)
    assert started.startswith("[started in background: job j2]")
    second = stat((await pids_from(other, 1))[0])
    assert second is not None
    await s.router.submit(chat.message("c2", "/kill j2"), chat)
    await chat.wait_for(lambda: chat.texts("c2")[-1] == "No background job j2 in this chat (/jobs lists them).")
    await s.router.submit(chat.message("c1", "/kill j2"), chat)
    await chat.wait_for(lambda: chat.texts("c1")[-1] == "Killed job j2.")
    await until(lambda: not running(second), 5, "/kill left the job running")
    assert s.jobs.jobs(KEY)[1].reason == KILLED_BY_USER
    await s.router.submit(chat.message("c1", "/new"), chat)
    await until(lambda: not any(p is not None and running(p) for p in procs), 5, "/new left the job running")
    job = s.jobs.jobs(KEY)[0]
    await asyncio.wait_for(job.ended.wait(), 5)
    assert job.state == "killed" and job.reason == SESSION_RESET
    assert job.end_line() == "[background job j1 stopped: [interrupted by user: session reset (/new)]]"
    await asyncio.sleep(0.2)
    assert not s.delivered  # the session it would tell is gone


async def test_limits_per_session_and_in_total_and_jobs_are_private_to_their_session(
        make: Make, chat: MemoryChat, tmp_path: Path) -> None:
    s = await make(max_per_session=1, max_total=2)

    async def call(session: str, name: str, **args: Any) -> str:
        run = Run(session)
        ctx = contextvars.copy_context()
        ctx.run(current_run.set, run)
        return await asyncio.get_running_loop().create_task(s.tools.call(name, json.dumps(args)), context=ctx)

    assert (await call("a", "shell", command="echo from-a; sleep 60", background=True)).startswith(
        "[started in background: job j1]")
    refused = await call("a", "shell", command="sleep 60", background=True)
    assert refused.startswith("error: not started: this chat already has 1 background jobs running")
    assert (await call("b", "shell", command="echo from-b; sleep 60", background=True)).startswith(
        "[started in background: job j1]")  # ids count per chat: they say nothing of other chats' jobs
    full = await call("c", "shell", command="sleep 60", background=True)
    assert full.startswith("error: not started: the gateway already runs 2 background jobs")
    (a_job,), (b_job,) = s.jobs.jobs("a"), s.jobs.jobs("b")
    # Another session can neither see, read, wait for nor kill it: its "j1" is its own job.
    await until(lambda: "from-a" in a_job.out.text and "from-b" in b_job.out.text, 10, "no output")
    read = await call("b", "job_read", job_id="j1")
    assert "from-b" in read and "from-a" not in read
    assert (await call("b", "job_read", job_id="j2")).startswith("error: no job 'j2' in this chat")
    listed = await call("b", "job_status")
    assert listed.startswith("j1: running") and listed.count("j1:") == 1
    assert s.router.kill_job("c", "j1") is None
    assert a_job.state == "running" and s.jobs.count_running("a") == 1
    # Hostile arguments come back as errors the model can read.
    assert (await call("a", "job_wait", job_id=a_job.id, timeout_s="soon")).startswith("error: job_wait failed")
    assert (await call("a", "job_read")).startswith("error: job_read failed: 'job_id' must be")
    waited = await call("a", "job_wait", job_id=a_job.id, timeout_s=0.05)
    assert waited == f"[job {a_job.id} still running after 0.05 s]"
    # A slot frees once a job ends.
    assert s.router.kill_job("a", a_job.id) == f"Killed job {a_job.id}."
    await asyncio.wait_for(a_job.ended.wait(), 5)
    assert (await call("c", "shell", command="sleep 60", background=True)).startswith("[started in background")
    assert len(s.jobs.kill_all(GATEWAY_RESTART)) == 2


async def test_a_command_past_the_foreground_limit_moves_on_its_own_and_job_wait_reports_its_end(
        make: Make, chat: MemoryChat, tmp_path: Path) -> None:
    s = await make(foreground_max_s=0.3)
    run = Run("a")
    ctx = contextvars.copy_context()
    ctx.run(current_run.set, run)
    gate = tmp_path / "gate"
    command = gated(tmp_path / "pids", gate, "first", "last")
    result = await asyncio.get_running_loop().create_task(
        s.tools.call("shell", json.dumps({"command": command})), context=ctx)
    assert result.startswith("[moved to background: job j1 (it ran past tools.foreground_max_s (0.3 s))]")
    waiting = asyncio.get_running_loop().create_task(s.tools.call("job_wait", '{"job_id": "j1", "timeout_s": 20}'),
                                                     context=ctx)
    (gate.parent / "gate1").touch()
    assert await asyncio.wait_for(waiting, 10) == "last\n[background job j1 finished: exit 0]"
    await asyncio.sleep(0.2)
    assert not s.delivered  # the model saw the end itself: no automatic message


async def test_the_daemon_killed_with_9_leaves_no_job_behind(tmp_path: Path, provider: FakeProvider) -> None:
    """A job outlives its turn, not its daemon: the same ledger and sentinel as any tool."""
    pidfile = tmp_path / "pids"
    command = f"echo $$ >> {pidfile}; sleep 45 & echo $! >> {pidfile}; setsid sleep 44 & echo $! >> {pidfile}; wait"
    provider.then(Script(tool_calls=[("shell", {"command": command, "background": True})]))
    provider.then(Script(text="started"))
    # `python -m gateway` from this checkout (the console script may belong to another one).
    daemon = Daemon(tmp_path, *_shell_agent(provider), ("PYTHONPATH", str(Path(__file__).resolve().parent.parent)),
                    module=True)
    try:
        await daemon.ready()
        async with aiohttp.ClientSession() as http:
            resp = await daemon.post(http, "start it", "kim")
            assert resp.status == 200  # the turn is over; the job runs on
        procs: list[Proc] = [p for p in (stat(pid) for pid in await pids_from(pidfile, 3)) if p is not None]
        assert len(procs) == 3 and all(map(running, procs))
        daemon.kill()  # kill -9
        await until(lambda: not any(map(running, procs)), 10, "a job process outlived the daemon's kill -9")
    finally:
        daemon.kill()


async def test_a_daemon_stop_kills_jobs_with_its_reason(make_daemon: DaemonFactory, provider: FakeProvider,
                                                        tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    provider.then(Script(tool_calls=[("shell", {"command": f"echo $$ >> {pidfile}; sleep 60", "background": True})]))
    provider.then(Script(text="started"))
    daemon = await make_daemon(tools={"shell": True, "sandbox": "off"}, api={"enabled": True})  # PIDs in a file
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions"
        async with http.post(url, json={"messages": [{"role": "user", "content": "go"}]}) as resp:
            assert resp.status == 200
    (pgid,) = await pids_from(pidfile, 1)
    leader = stat(pgid)
    assert leader is not None and running(leader)
    (job,) = [j for s in daemon.jobs._jobs.values() for j in s.values()]
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{daemon.config.admin.port}/metrics") as resp:
        assert "\nswitchboard_background_jobs 1.0\n" in await resp.text()
    await daemon.stop()
    assert not running(leader)
    assert job.state == "killed" and job.reason == GATEWAY_RESTART


async def test_job_wait_gives_way_to_a_steered_message_and_a_stop_ends_it_but_not_the_job(
        make: Make, chat: MemoryChat, provider: FakeProvider, store: SqliteStore, tmp_path: Path) -> None:
    s = await make(busy="steer")
    pidfile = tmp_path / "pids"
    provider.then(Script(tool_calls=[("shell", {"command": f"echo $$ >> {pidfile}; sleep 60", "background": True})]))
    provider.then(Script(tool_calls=[("job_wait", {"job_id": "j1", "timeout_s": 120})]))
    provider.then(Script(text="it is still running"))
    await s.router.submit(chat.message("c1", "start it and wait"), chat)
    (pgid,) = await pids_from(pidfile, 1)
    leader = stat(pgid)
    assert leader is not None
    await until(lambda: bool(s.jobs.jobs(KEY)), 10, "the job was never made")
    (job,) = s.jobs.jobs(KEY)
    await until(lambda: job.waiters == 1, 10, "the model never waited for the job")
    await s.router.submit(chat.message("c1", "anything yet?"), chat)
    await settled(chat, s.router, store)
    sent = provider.connections[2].body["messages"]
    assert tool_rows(provider.connections[2].body)[-1] == (
        "[wait ended: the user sent a new message; job j1 still running]")
    assert sent[-1] == {"role": "user", "content": "anything yet?"}

    provider.then(Script(tool_calls=[("job_wait", {"job_id": "j1", "timeout_s": 120})]))
    run = (await s.router.submit(chat.message("c1", "wait for it"), chat)).run
    await until(lambda: job.waiters == 1, 10, "the model never waited for the job")
    await s.router.submit(chat.message("c1", "/stop"), chat)
    assert run is not None
    await asyncio.wait_for(run.wait(), 5)
    assert job.waiters == 0 and running(leader) and job.state == "running"
    _, rows = await store.conversation(KEY)
    assert [r.role for r in rows[-2:]] == ["assistant", "tool"]  # the wait, cut off
    assert rows[-1].content == "[interrupted by user: stopped by user (/stop)]"


async def test_a_move_racing_a_cancel_leaves_each_command_a_job_or_gone(tmp_path: Path) -> None:
    """The user writes (and the turn is cancelled, busy "interrupt", or goes on, "steer") at random
    offsets around `yield_after_s`: every command ends up either a running job the registry knows
    or a group that is gone — never a group nobody owns, never a job whose group died with the turn."""
    seed = int(os.environ.get("JOB_RACE_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    reaper = ProcessReaper(grace_s=0.2)
    jobs = JobRegistry(reaper, JobSettings(yield_after_s=0.05, max_per_session=100, max_total=100))
    tools = builtin_registry(ProcessToolSettings(reaper=reaper), shell=True, jobs=jobs)
    loop = asyncio.get_running_loop()
    try:
        for trial in range(40):
            session, mode = f"race-{trial}", rng.choice(["interrupt", "steer"])
            run = Run(session)
            ctx = contextvars.copy_context()
            ctx.run(current_run.set, run)
            task = loop.create_task(tools.call("shell", json.dumps({"command": "sleep 60 & sleep 60; wait"})),
                                    context=ctx)
            run.attach(task)
            delay = rng.uniform(0, 0.12)
            await asyncio.sleep(delay)
            what = f"trial {trial} ({mode}, user wrote after {delay * 1000:.1f} ms; seed {seed}, JOB_RACE_SEED={seed})"
            jobs.yield_foreground(session, now=mode == "interrupt")
            if mode == "interrupt" or rng.random() < 0.5:
                await asyncio.sleep(rng.uniform(0, 0.1) if mode == "steer" else 0)
                run.cancel(NEW_MESSAGE)
            await asyncio.wait({task}, timeout=10)
            assert task.done(), f"the tool call did not end: {what}"
            await asyncio.wait_for(reaper.drain(), 10)
            made = jobs.jobs(session)  # nothing kills a job here: each one made must run on
            owned = {job.pgid for job in made}
            assert all(j.state == "running" and group_alive(j.pgid) for j in made), \
                f"a job's group died with its turn: {what}"
            assert reaper.live_groups >= owned, what
            orphans = [pgid for pgid in reaper.live_groups - {j.pgid for j in jobs.running()} if group_alive(pgid)]
            assert not orphans, f"groups nobody owns: {orphans}: {what}"
            if not task.cancelled() and owned:
                assert task.result().startswith("[moved to background: job"), what
    finally:
        jobs.kill_all(GATEWAY_RESTART)
        await asyncio.wait_for(jobs.close(), 10)
        await asyncio.wait_for(reaper.drain(), 10)
    assert not any(map(group_alive, reaper.live_groups))


async def test_a_job_cut_off_by_a_restart_is_told_at_the_next_start(
        make: Make, chat: MemoryChat, provider: FakeProvider, store: SqliteStore, tmp_path: Path) -> None:
    s = await make()
    pidfile = tmp_path / "pids"
    command = f"echo $$ >> {pidfile}; echo working; sleep 60"
    provider.then(Script(tool_calls=[("shell", {"command": command, "background": True})]))
    provider.then(Script(text="started"))
    await s.router.submit(chat.message("c1", "start it"), chat)
    (pgid,) = await pids_from(pidfile, 1)
    leader = stat(pgid)
    assert leader is not None
    await settled(chat, s.router, store)
    await until(lambda: "working" in s.jobs.jobs(KEY)[0].out.text, 10, "no output")
    await s.router.shutdown(GATEWAY_RESTART, grace_s=5)
    await until(lambda: not running(leader), 5, "the job outlived the router's stop")
    assert [r.message.text.split("\n")[0] for r in await store.unfinished_inbound()] == [
        "[background job j1 stopped: [interrupted by system: gateway restart]]"]
    assert not s.delivered

    again = await make()  # the next start: the stored notice is replayed, once
    await until(lambda: any(c.last_user.startswith("[background job j1 stopped") for c in provider.connections),
                10, "the restart's notice was never told")
    await settled(chat, again.router, store)
    told = [c.last_user for c in provider.connections if c.last_user.startswith("[background job j1")]
    assert told == [f"[background job j1 stopped: [interrupted by system: gateway restart]]\n$ {command}\nworking"]
    assert chat.texts("c1")[-1].startswith("reply to:  w0")  # answered, without the gateway's own words


async def test_a_flood_of_output_stays_bounded_and_reads_say_what_they_missed(make: Make, tmp_path: Path) -> None:
    s = await make(buffer_chars=1000, read_chars=100)
    run = Run("flood")
    ctx = contextvars.copy_context()
    ctx.run(current_run.set, run)

    async def call(name: str, **args: Any) -> str:
        return await asyncio.get_running_loop().create_task(s.tools.call(name, json.dumps(args)), context=ctx)

    gate = tmp_path / "gate"
    # A megabyte of output, invalid UTF-8 in it, then it waits; then one last line.
    command = (f"head -c 1000000 /dev/zero | tr '\\0' x; printf '\\377\\376\\n'; "
               f"while [ ! -e {gate} ]; do sleep 0.02; done; echo the-end")
    assert (await call("shell", command=command, background=True)).startswith("[started in background: job j1]")
    (job,) = s.jobs.jobs("flood")
    await until(lambda: job.out.total >= 1_000_002, 10, "the output never came")
    first = await call("job_read", job_id="j1")
    cap = job.out.cap  # job_buffer_chars, or the shell's max_output if larger (16 000 here)
    text, *notes = first.split("\n")
    assert text == "x" * 100 and len(job.out.text) == cap == 16_000
    assert notes == [f"[{1_000_003 - cap} characters lost: only the last {cap} are kept]",
                     f"[{cap - 100} more characters: read again]"]
    fifth = await call("job_read", job_id="j1", max_chars=5)
    assert fifth.startswith(f"xxxxx\n[{cap - 105} more characters")
    gate.touch()
    await asyncio.wait_for(job.ended.wait(), 10)
    last = await call("job_read", job_id="j1", max_chars=10_000)
    assert last.endswith(f"[{cap - 105 - 100 + 8} more characters: read again]")  # at most 100 a read
    assert len(last) < 200 and last.startswith("x" * 100)
    read = [fifth.split("\n[")[0], last.split("\n[")[0]]
    while "[background job" not in last and len(read) < 500:
        last = await call("job_read", job_id="j1")
        read.append(last.split("\n[")[0])
    assert last.endswith("\n[background job j1 finished: exit 0]")
    # Every character kept was read once, in order; the bytes that were not UTF-8 became U+FFFD.
    moved = len("the-end\n")  # arrived after the first read: the buffer's start moved on by that much
    assert "".join(read) == job.out.text[100 - moved:].rstrip("\n")
    assert job.out.text.endswith("x\ufffd\ufffd\nthe-end\n")


async def test_through_the_daemon_a_steered_web_chat_message_moves_the_command_and_its_end_is_answered(
        make_daemon: DaemonFactory, provider: FakeProvider, tmp_path: Path) -> None:
    from tests.test_agent_loop import Page

    pidfile, gate = tmp_path / "pids", tmp_path / "gate"
    provider.then(Script(tool_calls=[("shell", {"command": gated(pidfile, gate, "compiling", "linked")})]))
    provider.then(Script(text="moved it to the background"))
    provider.words = 2
    daemon = await make_daemon(router={"busy": "steer"}, tools={"shell": True, "yield_after_s": 0.2, "sandbox": "off"})
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        page = await Page(http, f"http://127.0.0.1:{daemon.config.http.port}").open()
        try:
            await page.say("m1", "build the thing")
            (pgid,) = await pids_from(pidfile, 1)
            leader = stat(pgid)
            assert leader is not None
            await page.say("m2", "while that runs: hello")
            await until(lambda: page.ack("m2") == "steered", 10, "not steered")
            await until(lambda: page.idle() >= 1, 10, "the turn never ended")
            assert running(leader)
            assert tool_rows(provider.connections[1].body)[0].startswith("[moved to background: job j1")
            gate.with_name("gate1").touch()
            await until(lambda: any(f["type"] in ("message", "edit") and f["text"].startswith("reply to:  w")
                                    for f in page.frames), 10, "the page never saw the answer to the job's end")
            await until(lambda: page.idle() >= 2, 10, "the automatic turn never ended")
            assert not any("[background job" in str(f.get("text")) for f in page.frames)  # the gateway's own words
            # A page opened later shows the gateway's word as a notice, not as something the user said.
            later = await Page(http, f"http://127.0.0.1:{daemon.config.http.port}").open()
            await later.close()
            history = next(f for f in later.frames if f["type"] == "hello")["history"]
            assert [r.get("job") for r in history if r["role"] == "user"] == [
                None, None, "[background job j1 finished: exit 0]"]
        finally:
            await page.close()
    key = next(s.key for s in await daemon.store.sessions())
    _, rows = await daemon.store.conversation(key)
    told = [r.content for r in rows if r.role == "user" and r.content.startswith("[background job")]
    assert len(told) == 1 and told[0].endswith("\nlinked")
    assert await daemon.store.unfinished_inbound() == []


async def test_two_background_starts_side_by_side_for_the_last_slot_get_one_job_and_one_refusal(
        make: Make, chat: MemoryChat, provider: FakeProvider, store: SqliteStore, tmp_path: Path) -> None:
    s = await make(max_per_session=1)
    provider.then(Script(tool_calls=[("shell", {"command": "sleep 60", "background": True}),
                                     ("shell", {"command": "sleep 61", "background": True})]))
    provider.then(Script(text="one of them"))
    await s.router.submit(chat.message("c1", "two at once"), chat)
    await settled(chat, s.router, store)
    results = sorted(tool_rows(provider.connections[1].body))
    assert results[0].startswith("[started in background: job j")
    assert results[1] == ("error: not started: this chat already has 1 background jobs running"
                          " (tools.jobs_per_session)")
    assert s.jobs.count_running(KEY) == 1
    # The refused one's process is gone (its group was the turn's, and the turn is over).
    await until(lambda: {pgid for pgid in s.jobs.reaper.live_groups if group_alive(pgid)}
                == {j.pgid for j in s.jobs.running(KEY)}, 5, "the refused command's group lives on")


async def test_a_job_past_job_max_s_is_killed_and_told_and_lease_loss_kills_silently(
        make: Make, chat: MemoryChat, provider: FakeProvider, store: SqliteStore, tmp_path: Path) -> None:
    s = await make(job_max_s=0.5)
    pidfile = tmp_path / "pids"
    command = f"echo $$ >> {pidfile}; sleep 60 & echo $! >> {pidfile}; wait"
    provider.then(Script(tool_calls=[("shell", {"command": command, "background": True})]))
    provider.then(Script(text="started"))
    await s.router.submit(chat.message("c1", "start it"), chat)
    procs = [p for p in (stat(pid) for pid in await pids_from(pidfile, 2)) if p is not None]
    await until(lambda: len(s.delivered) == 1, 10, "the limit's kill was never told")
    assert not any(map(running, procs))
    assert s.delivered[0][1].startswith(
        "[background job j1 stopped: [interrupted by system: ran past tools.job_max_s (0.5 s)]]")
    await until(lambda: any(c.last_user.startswith("[background job j1 stopped") for c in provider.connections),
                10, "the model never heard of it")
    await settled(chat, s.router, store)

    other = tmp_path / "other"
    provider.then(Script(tool_calls=[("shell", {"command": f"echo $$ >> {other}; sleep 0.3; sleep 60",
                                                "background": True})]))
    provider.then(Script(text="started again"))
    s.jobs.settings = JobSettings(yield_after_s=0.3)
    await s.router.submit(chat.message("c1", "once more"), chat)
    second = stat((await pids_from(other, 1))[0])
    assert second is not None
    await settled(chat, s.router, store)
    s.router.lease_lost(KEY)  # another worker owns the session now
    await until(lambda: not running(second), 5, "the job outlived the session's lease")
    job = s.jobs.jobs(KEY)[-1]
    await asyncio.wait_for(job.ended.wait(), 5)
    assert job.reason == LEASE_LOST and len(s.delivered) == 1
