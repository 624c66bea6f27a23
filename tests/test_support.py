"""The test helpers that start processes end them on every path: a start that fails, one that is
cancelled, one of several that fails."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from gateway.agents.openai import hang_up
from tests.fakes.openai_provider import FakeProvider, HangupWatch
from tests.support.ports import free_port
from tests.support.procs import running_in_group, until
from tests.support.redis_server import RedisServer
from tests.support.spawn import Group, wait_ready
from tests.support.workers import Worker, end_all, start_all


async def test_a_group_ends_with_everything_in_it_and_a_readiness_deadline_shows_the_log(tmp_path: Path) -> None:
    proc = Group(["/bin/sh", "-c", "echo starting up; sleep 60 & sleep 61"], log=tmp_path / "log")
    try:
        await until(lambda: len(running_in_group(proc.pid)) == 3, 30, "the shell never started both sleeps")
        with pytest.raises(AssertionError, match=r"(?s)was not ready after 1 s.*starting up"):
            await wait_ready(f"http://127.0.0.1:{free_port()}/readyz", proc, "the shell", proc.log, deadline_s=1)
    finally:
        proc.end()
    assert proc.returncode is not None and running_in_group(proc.pid) == []
    proc.end()  # again: nothing to do, nothing raised


async def test_a_worker_that_exits_during_its_start_fails_with_its_log(tmp_path: Path) -> None:
    worker = Worker("bad", "redis://127.0.0.1:1/0", "http://127.0.0.1:1/v1", tmp_path,
                    SWITCHBOARD_CLUSTER__LEASE_TTL_S="-1")  # refused by the config check: the daemon exits
    try:
        with pytest.raises(AssertionError, match=r"(?s)worker bad exited \(\d+\) before it was ready.*lease_ttl"):
            await worker.start()
        assert worker.proc is not None and worker.proc.returncode is not None
        assert running_in_group(worker.proc.pid) == []
    finally:
        worker.end()


async def test_a_cancelled_worker_start_ends_the_worker(redis_server: RedisServer, provider: FakeProvider,
                                                         tmp_path: Path) -> None:
    worker = Worker("w", redis_server.url, provider.base_url, tmp_path)
    try:
        starting = asyncio.create_task(worker.start())
        await until(lambda: worker.proc is not None, 30, "the worker process was never started")
        assert worker.proc is not None and worker.proc.poll() is None
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        assert worker.proc.returncode is not None and running_in_group(worker.proc.pid) == []
    finally:
        worker.end()


async def test_when_one_of_several_starts_fails_all_are_ended(redis_server: RedisServer, provider: FakeProvider,
                                                               tmp_path: Path) -> None:
    good = Worker("good", redis_server.url, provider.base_url, tmp_path)
    bad = Worker("bad", redis_server.url, provider.base_url, tmp_path, SWITCHBOARD_CLUSTER__LEASE_TTL_S="-1")
    try:
        with pytest.raises(AssertionError, match="worker bad exited"):
            await start_all(good, bad)
        for w in (good, bad):
            assert w.proc is not None and w.proc.returncode is not None
            assert running_in_group(w.proc.pid) == []
    finally:
        end_all(good, bad)


async def test_the_fake_providers_hangup_watch_sees_a_client_leave_while_its_loop_is_busy() -> None:
    """The stop-latency benchmark's (b): the moment the kernel reports a client's hangup, noted by
    a thread while the provider's own loop is busy (here: blocked), before that loop notes it."""
    provider = FakeProvider(delay_s=0.05, words=10_000)
    provider.hangups = HangupWatch()
    await provider.start()
    try:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(provider.base_url + "/chat/completions",
                                   json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
            await resp.content.readany()
            [conn] = provider.connections
            hang_up(resp)  # as a cancelled run does: the socket shut down at once
            deadline = time.monotonic() + 30
            while conn.hangup_at is None and time.monotonic() < deadline:
                time.sleep(0.01)  # the loop blocked, as a busy one: only the watch can see the hangup
            assert conn.hangup_at is not None, "the watch never saw the hangup"
            assert conn.closed_at is None  # (the loop could not have run meanwhile)
            await until(lambda: conn.closed_at is not None, 30, "the provider's loop never saw the close")
    finally:
        await provider.stop()
