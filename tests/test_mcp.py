"""MCP servers as tools, against real servers written with the SDK's FastMCP (tests/fakes/mcp_server.py),
over stdio (a process the daemon owns) and streamable HTTP: the offer, calls end to end through the
daemon's agent loop, /stop reaching the server, timeouts, crashes and restarts, filters."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.agents.mcp_config import McpServerConfig
from gateway.agents.mcp_sdk import V2
from gateway.agents.mcp_servers import McpHub, tool_name
from gateway.agents.processes import ProcessReaper, group_alive
from gateway.core.cancellation import STOPPED_BY_USER, Run, current_run
from gateway.core.logs import redactor
from gateway.ops.config import ConfigError, load_config, render
from gateway.ops.daemon import Daemon
from tests.conftest import DaemonFactory, free_port
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import running, stat, until
from tests.support.spawn import READY_DEADLINE_S, Group

ROOT = Path(__file__).resolve().parent.parent
STOPPED = "[interrupted by user: stopped by user (/stop)]"


class Record:
    """The fake server's event file: one JSON object a line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        found = [json.loads(line) for line in lines if line.strip()]
        return [e for e in found if kind is None or e["event"] == kind]

    async def wait(self, kind: str, count: int = 1, timeout: float = 30) -> dict[str, Any]:
        await until(lambda: len(self.events(kind)) >= count, timeout, f"the server never recorded {kind!r} "
                    f"x{count}: {self.events()}")
        return self.events(kind)[count - 1]


@pytest.fixture
def record(tmp_path: Path) -> Record:
    return Record(tmp_path / "mcp-events.jsonl")


def stdio_server(record: Record, name: str = "fake", **extra: Any) -> dict[str, Any]:
    return {"name": name, "command": sys.executable,
            "args": ["-m", "tests.fakes.mcp_server", "--record", str(record.path)], "cwd": str(ROOT), **extra}


class HttpServer:
    """The fake server on streamable HTTP, as a process of the test's own on a free port."""

    def __init__(self, record: Record) -> None:
        self.port = free_port()
        self.record = record
        self.proc: Group | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    async def start_on(self, port: int) -> HttpServer:
        self.port = port
        return await self.start()

    async def start(self) -> HttpServer:
        """Start the server and wait until it listens; a start that fails ends what it started."""
        self.proc = Group([sys.executable, "-m", "tests.fakes.mcp_server", "--record", str(self.record.path),
                           "--http", str(self.port)], cwd=ROOT)

        def listening() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "the HTTP MCP server exited"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return True
            except OSError:
                return False

        try:
            await until(listening, READY_DEADLINE_S, "the HTTP MCP server never listened", every=0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill its process group and reap it (safe to call again, or before a start)."""
        if self.proc is not None:
            self.proc.end()


async def mcp_up(daemon: Daemon, name: str = "fake", timeout: float = 30) -> None:
    server = next(s for s in daemon.mcp.servers if s.settings.name == name)
    await until(lambda: server.up, timeout, f"MCP server {name} never came up: {server.detail}")


async def ask(daemon: Daemon, http: aiohttp.ClientSession, text: str, session: str = "m",
              key: str | None = None) -> dict[str, Any]:
    url = f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions"
    headers = {"X-Session-Id": session, **({"Authorization": f"Bearer {key}"} if key else {})}
    async with http.post(url, json={"messages": [{"role": "user", "content": text}]}, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


def offered(provider: FakeProvider, index: int = -1) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in provider.connections[index].body.get("tools", [])}


def tool_results(provider: FakeProvider, index: int = -1) -> list[str]:
    return [m["content"] for m in provider.connections[index].body["messages"] if m["role"] == "tool"]


# --- the offer and a call ---------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_tools_are_offered_namespaced_with_the_servers_schemas_and_a_call_works(
        make_daemon: DaemonFactory, provider: FakeProvider, record: Record, transport: str,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if transport == "http":
        server = HttpServer(record)
        request.addfinalizer(server.stop)  # before the start: a failed start is cleaned up too
        await server.start()
        headers = tmp_path / "headers"
        headers.write_text("# a comment\nX-Api-Key: hdr-secret-7781\n")
        entry: dict[str, Any] = {"name": "fake", "url": server.url, "headers_file": str(headers)}
    else:
        entry = stdio_server(record)
    provider.words = 2
    daemon = await make_daemon(api={"enabled": True}, mcp={"servers": [entry]})
    await mcp_up(daemon)
    provider.then(Script(tool_calls=[("fake__echo", {"text": "hello over mcp"}), ("fake__add", {"a": 2, "b": 40})]))
    async with aiohttp.ClientSession() as http:
        await ask(daemon, http, "use the tools")
        if transport == "http":  # the headers file's header reaches the server with every call
            provider.then(Script(tool_calls=[("fake__header", {"name": "X-Api-Key"})]))
            await ask(daemon, http, "which key", "h")
            assert tool_results(provider) == ["hdr-secret-7781"]
    tools = offered(provider, 0)
    assert {"sleep", "fake__echo", "fake__add", "fake__slow", "fake__crash"} <= set(tools)
    assert tools["fake__add"]["parameters"]["properties"] == {"a": {"title": "A", "type": "integer"},
                                                              "b": {"title": "B", "type": "integer"}}
    assert tools["fake__add"]["parameters"]["required"] == ["a", "b"]
    assert tools["fake__echo"]["description"] == "Return the text unchanged."
    assert tool_results(provider, 1) == ["hello over mcp", "42"]
    if transport == "http":  # the logs mask the header's value (the formatters apply the redactor)
        assert "hdr-secret-7781" not in redactor("sent hdr-secret-7781")
    assert [e["text"] for e in record.events("echo")] == ["hello over mcp"]
    _, rows = await daemon.store.conversation("api:dm:m")
    assert [r.content for r in rows if r.role == "tool"] == ["hello over mcp", "42"]


async def test_filters_choose_the_tools_offered(tmp_path: Path, record: Record) -> None:
    reaper = ProcessReaper(grace_s=0.5)
    settings = McpServerConfig(**stdio_server(record, enabled_tools=["echo", "s*"], disabled_tools=["slow"]))
    hub = McpHub.build([settings], reaper, max_output=1000)
    hub.start()
    try:
        await until(lambda: hub.servers[0].up, 30, f"never up: {hub.servers[0].detail}")
        assert sorted(t.name for t in hub.tools()) == ["fake__echo", "fake__secret", "fake__spawn_child"]
        assert await hub.servers[0].call("echo", {"text": "x"}) == "x"
    finally:
        await hub.close()
        await reaper.drain()
    assert not reaper.live_groups


async def test_a_stdio_server_gets_a_minimal_environment_plus_its_own(
        tmp_path: Path, record: Record, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_AGENT__API_KEY", "daemon-only-key-5521")
    env_file = tmp_path / "server.env"
    env_file.write_text("# tokens\nSERVICE_TOKEN=tok-from-file-9931\n")
    reaper = ProcessReaper(grace_s=0.5)
    settings = McpServerConfig(**stdio_server(record, env={"PLAIN": "visible"}, env_file=str(env_file)))
    hub = McpHub.build([settings], reaper, max_output=1000)
    hub.start()
    server = hub.servers[0]
    try:
        await until(lambda: server.up, 30, f"never up: {server.detail}")
        assert await server.call("getenv", {"name": "PLAIN"}) == "visible"
        assert await server.call("getenv", {"name": "SERVICE_TOKEN"}) == "tok-from-file-9931"
        assert await server.call("getenv", {"name": "SWITCHBOARD_AGENT__API_KEY"}) == "(no output)"
        assert await server.call("getenv", {"name": "PATH"}) not in ("", "(no output)")
    finally:
        await hub.close()
        await reaper.drain()
    assert "tok-from-file-9931" not in redactor("the token is tok-from-file-9931")  # masked in the logs


async def test_an_http_server_that_goes_away_is_reconnected_when_it_is_back(record: Record) -> None:
    first, again = HttpServer(record), HttpServer(record)
    hub: McpHub | None = None
    try:
        await first.start()
        reaper = ProcessReaper(grace_s=0.5)
        settings = McpServerConfig(name="web", url=first.url, ping_interval_s=0.2, connect_timeout_s=2,
                                   max_backoff_s=0.5)
        hub = McpHub.build([settings], reaper, max_output=1000)
        hub.start()
        server = hub.servers[0]
        await until(lambda: server.up, 30, f"never up: {server.detail}")
        first.stop()  # gone without a word
        await until(lambda: server.state == "down", 15, "the outage was never noticed")
        assert hub.tools() == []
        assert await server.call("echo", {"text": "x"}) == f"error: MCP server web is not available ({server.detail})"
        await again.start_on(first.port)
        await until(lambda: server.up, 30, f"never back: {server.detail}")
        assert await server.call("echo", {"text": "again"}) == "again"
    finally:
        if hub is not None:
            await hub.close()
        first.stop()
        again.stop()


def test_tool_names_fit_what_providers_accept() -> None:
    assert tool_name("fs", "read_file") == "fs__read_file"
    assert tool_name("fs", "files.read/all") == "fs__files_read_all"
    long = tool_name("server", "x" * 100)
    assert len(long) == 64 and long.startswith("server__xxx")
    assert tool_name("server", "y" * 100) != tool_name("server", "y" * 101)
    clash = tool_name("fs", "a.b", taken=["fs__a_b"])
    assert clash != "fs__a_b" and clash.startswith("fs__a_b_")
    for name in (long, clash, tool_name("s", "ünïcode tool!")):
        assert all(c.isascii() and (c.isalnum() or c in "_-") for c in name)


# --- stops and timeouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_stop_during_a_slow_call_tells_the_server_and_marks_the_transcript(
        make_daemon: DaemonFactory, provider: FakeProvider, record: Record, transport: str) -> None:
    server = HttpServer(record) if transport == "http" else None
    try:
        if server is not None:
            await server.start()
        entry = {"name": "fake", "url": server.url} if server is not None else stdio_server(record)
        daemon = await make_daemon(api={"enabled": True}, mcp={"servers": [entry]})
        await mcp_up(daemon)
        provider.then(Script(tool_calls=[("fake__slow", {"seconds": 60, "tag": "t1"})]))
        async with aiohttp.ClientSession() as http:
            pending = asyncio.create_task(ask(daemon, http, "take your time", "s"))
            await record.wait("slow_started")
            stopped = time.time()
            await ask(daemon, http, "/stop", "s")
            answer = await asyncio.wait_for(pending, 10)
            cancelled = await record.wait("slow_cancelled", timeout=10)
        latency = cancelled["t"] - stopped
        print(f"[mcp {transport}] /stop -> server saw notifications/cancelled after {latency * 1000:.0f} ms")
        assert latency < 5
        assert answer["switchboard"]["interrupted_by"] == "user"
        assert not record.events("slow_finished")
        _, rows = await daemon.store.conversation("api:dm:s")
        assert [r.content for r in rows if r.role == "tool"] == [STOPPED]
        # The server lives on and answers the next call; the late result of the first never shows.
        provider.then(Script(tool_calls=[("fake__echo", {"text": "still here"})]))
        async with aiohttp.ClientSession() as http:
            await ask(daemon, http, "again", "s")
        assert tool_results(provider)[-1] == "still here"
        assert daemon.mcp.servers[0].up and daemon.mcp.servers[0].restarts == 0
        assert daemon.mcp.servers[0].calls == {"cancelled": 1, "ok": 1}
    finally:
        if server is not None:
            server.stop()


async def test_a_call_past_its_timeout_is_an_error_result_and_the_server_is_told(
        make_daemon: DaemonFactory, provider: FakeProvider, record: Record) -> None:
    provider.words = 2
    daemon = await make_daemon(api={"enabled": True}, mcp={"servers": [stdio_server(record, timeout_s=0.5)]})
    await mcp_up(daemon)
    provider.then(Script(tool_calls=[("fake__slow", {"seconds": 60, "tag": "late"})]))
    async with aiohttp.ClientSession() as http:
        answer = await ask(daemon, http, "slow please", "t")
    assert tool_results(provider) == ["error: fake__slow timed out after 0.5 s (the server was told to stop)"]
    assert answer["choices"][0]["message"]["content"].startswith("reply to: slow please")  # the turn went on
    await record.wait("slow_cancelled", timeout=10)
    assert daemon.mcp.servers[0].up
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{daemon.config.admin.port}/metrics") as resp:
        metrics = await resp.text()
    assert 'switchboard_mcp_calls_total{outcome="timeout",server="fake"} 1.0' in metrics
    assert 'switchboard_mcp_server_up{server="fake"} 1.0' in metrics


async def test_calls_stopped_at_random_offsets_each_reach_the_server(tmp_path: Path, record: Record) -> None:
    """Stops at random instants of a call (before it is sent, while it is sent, while the server runs it):
    every call the server started is cancelled there, none finishes, and the connection stays up."""
    seed = int(os.environ.get("MCP_CANCEL_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    reaper = ProcessReaper(grace_s=0.5)
    hub = McpHub.build([McpServerConfig(**stdio_server(record))], reaper, max_output=1000)
    hub.start()
    server = hub.servers[0]
    try:
        await until(lambda: server.up, 30, f"never up: {server.detail}")
        tags = [f"r{i}" for i in range(12)]
        for tag in tags:
            run = Run(f"test:{tag}")
            token = current_run.set(run)
            try:
                task = asyncio.ensure_future(server.call("slow", {"seconds": 30, "tag": tag}))
            finally:
                current_run.reset(token)
            run.attach(task)
            await asyncio.sleep(rng.uniform(0, 0.05))
            run.cancel(STOPPED_BY_USER)
            assert await run.join(2.0), f"seed {seed}: the call did not end after its cancel"
            assert task.cancelled(), f"seed {seed}: {tag} was not cancelled"
        started = {e["tag"] for e in record.events("slow_started")}
        # Every call the server saw is cancelled there (the notices are sent by tasks of their own).
        await until(lambda: {e["tag"] for e in record.events("slow_cancelled")} >= started, 10,
                    f"seed {seed}: some calls were never cancelled on the server")
        assert not record.events("slow_finished"), f"seed {seed}"
        assert server.up and server.restarts == 0, f"seed {seed}"
        assert server.session is not None and server.session.cancels_sent >= len(started), f"seed {seed}"
        assert await server.call("echo", {"text": "after"}) == "after", f"seed {seed}"
    finally:
        await hub.close()
        await reaper.drain()


async def test_an_answer_that_arrives_after_the_stop_is_dropped(tmp_path: Path, record: Record) -> None:
    """SDK 1.x's server answers a cancelled request anyway (an error, "Request cancelled"): it comes
    after the call was given up, finds no waiter, and is dropped (and counted) without harm to the
    connection. SDK 2.x's server answers nothing once told: then nothing comes, and the connection
    is just as unharmed. (The fake server runs on the same SDK as the daemon.)"""
    reaper = ProcessReaper(grace_s=0.5)
    hub = McpHub.build([McpServerConfig(**stdio_server(record))], reaper, max_output=1000)
    hub.start()
    server = hub.servers[0]
    try:
        await until(lambda: server.up, 30, f"never up: {server.detail}")
        run = Run("test:late")
        token = current_run.set(run)
        try:
            task = asyncio.ensure_future(server.call("slow", {"seconds": 30, "tag": "late"}))
        finally:
            current_run.reset(token)
        run.attach(task)
        await record.wait("slow_started")
        run.cancel(STOPPED_BY_USER)
        assert await run.join(2.0) and task.cancelled()  # the stop does not wait for the server
        await record.wait("slow_cancelled", timeout=10)
        if not V2:
            await until(lambda: server.late_results >= 1, 10, "the late answer never arrived")
        assert await server.call("echo", {"text": "next"}) == "next"  # the connection is unharmed
        assert server.up and server.restarts == 0
    finally:
        await hub.close()
        await reaper.drain()


async def test_a_slow_call_blocks_no_other_session(make_daemon: DaemonFactory, provider: FakeProvider,
                                                   record: Record) -> None:
    provider.words = 2
    daemon = await make_daemon(api={"enabled": True}, mcp={"servers": [stdio_server(record)]})
    await mcp_up(daemon)
    provider.then(Script(tool_calls=[("fake__slow", {"seconds": 60, "tag": "long"})]))  # for "nap"
    provider.then(Script(tool_calls=[("fake__echo", {"text": "fast"})]))  # for "quick", asked next
    async with aiohttp.ClientSession() as http:
        slow = asyncio.create_task(ask(daemon, http, "nap", "a"))
        await record.wait("slow_started")
        answer = await asyncio.wait_for(ask(daemon, http, "quick", "b"), 15)  # while the other call runs
        assert not slow.done()
        await ask(daemon, http, "/stop", "a")
        await asyncio.wait_for(slow, 10)
    assert answer["choices"][0]["message"]["content"].startswith("reply to: quick")
    assert [e["text"] for e in record.events("echo")] == ["fast"]


async def test_access_can_be_limited_to_listed_sessions_and_tenants(
        make_daemon: DaemonFactory, provider: FakeProvider, record: Record) -> None:
    """API tenants (named keys): `acme` may use the server from any session, `beta` only from its
    team-* sessions; anyone else is neither offered its tools nor able to call them by name."""
    provider.words = 2
    acme, beta = "sk-acme-0123456789abcdef", "sk-beta-0123456789abcdef"
    entry = stdio_server(record, allow_sessions=["api:dm:beta/team-*"], allow_tenants=["acme"])
    daemon = await make_daemon(api={"enabled": True, "tenants": f"acme={acme},beta={beta}"},
                               mcp={"servers": [entry]})
    await mcp_up(daemon)

    async def attempt(http: aiohttp.ClientSession, session: str, key: str, text: str) -> tuple[set[str], list[str]]:
        provider.then(Script(tool_calls=[("fake__echo", {"text": text})]))
        await ask(daemon, http, "use it", session, key)
        first, second = provider.connections[-2:]
        return ({t["function"]["name"] for t in first.body["tools"]},
                [m["content"] for m in second.body["messages"] if m["role"] == "tool"])

    async with aiohttp.ClientSession() as http:
        acme_any = await attempt(http, "anything", acme, "acme anywhere")
        beta_team = await attempt(http, "team-1", beta, "beta team")
        beta_other = await attempt(http, "outsider", beta, "beta outside")
    assert "fake__echo" in acme_any[0] and acme_any[1] == ["acme anywhere"]
    assert "fake__echo" in beta_team[0] and beta_team[1] == ["beta team"]
    assert "sleep" in beta_other[0] and not any(n.startswith("fake__") for n in beta_other[0])
    # Even a model that names the tool anyway cannot reach it from there.
    assert beta_other[1] == ["error: unknown tool 'fake__echo'"]
    assert [e["text"] for e in record.events("echo")] == ["acme anywhere", "beta team"]
    assert "MCP: fake up" in daemon.router.status_text("api:dm:beta/team-1")
    assert "MCP" not in daemon.router.status_text("api:dm:beta/outsider")
    assert not daemon.mcp.servers[0].allows(None)  # outside any run: only unrestricted servers


# --- failures ------------------------------------------------------------------------------------------


async def test_a_crashed_server_is_reported_its_tools_withdrawn_and_it_is_restarted(
        make_daemon: DaemonFactory, provider: FakeProvider, record: Record, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    caplog.set_level(logging.INFO, logger="gateway.agents.mcp_servers")
    provider.words = 2
    block = tmp_path / "block"
    entry = stdio_server(record, max_backoff_s=2)
    entry["args"] += ["--fail-if", str(block)]
    daemon = await make_daemon(api={"enabled": True}, mcp={"servers": [entry]})
    await mcp_up(daemon)
    server = daemon.mcp.servers[0]
    first_pid = server.pid
    assert first_pid is not None
    first = stat(first_pid)
    assert first is not None
    provider.then(Script(tool_calls=[("fake__crash", {})]))
    block.touch()  # it may not come back until the test says so
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with aiohttp.ClientSession() as http:
        await ask(daemon, http, "crash it", "c")
        assert tool_results(provider)[0] == "error: MCP server fake closed the connection during the call"
        await until(lambda: server.state == "down", 10, "the crash was never noticed")
        async with http.get(base + "/readyz") as resp:
            ready = await resp.json()
        assert resp.status == 200  # not a required server: the daemon serves on
        assert ready["checks"]["mcp"]["detail"].startswith("fake: down: exited (code 3)")
        status = daemon.router.status_text("api:dm:c")
        assert "MCP: fake down" in status
        # While it is down its tools are not offered, and the daemon answers as usual.
        await until(lambda: server.restarts >= 2, 15, "no restart attempts")
        answer = await ask(daemon, http, "are you there", "c")
        assert answer["choices"][0]["message"]["content"].startswith("reply to: are you there")
        assert "sleep" in offered(provider) and not [n for n in offered(provider) if n.startswith("fake__")]
        assert "refusing to start" in server.detail
        provider.then(Script(tool_calls=[("fake__echo", {"text": "anyone?"})]))  # named from memory
        await ask(daemon, http, "try anyway", "c")
        assert tool_results(provider)[-1].startswith(
            "error: fake__echo is not available now: MCP server fake is down: exited (code 1): refusing to start")
        block.unlink()
        await mcp_up(daemon)
        assert server.restarts >= 1 and server.pid != first_pid
        assert not running(first)
        provider.then(Script(tool_calls=[("fake__echo", {"text": "back"})]))
        await ask(daemon, http, "again", "c")
        assert tool_results(provider)[-1] == "back"
    downs = [r for r in caplog.records if "is down" in r.getMessage()]
    assert len(downs) == 1 and "exited (code 3)" in downs[0].getMessage()
    assert any("is back" in r.getMessage() for r in caplog.records)


async def test_a_server_that_never_starts_is_logged_once_and_retried_with_backoff(
        make_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level(logging.INFO, logger="gateway.agents.mcp_servers")
    broken = {"name": "broken", "command": sys.executable, "args": ["-c", "import sys; sys.exit('no config here')"],
              "max_backoff_s": 0.2}
    missing = {"name": "missing", "command": str(tmp_path / "no-such-program"), "max_backoff_s": 0.2,
               "required": True}
    silent = {"name": "silent", "command": "sleep", "args": ["600"], "connect_timeout_s": 0.3, "max_backoff_s": 0.2}
    daemon = await make_daemon(mcp={"servers": [broken, missing, silent]})
    hub = daemon.mcp
    await until(lambda: all(s.restarts >= 3 for s in hub.servers), 30, "no retries")
    downs = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
    assert len(downs) == 3, downs  # once per server, not once per retry
    assert "no config here" in hub.servers[0].detail
    assert "No such file or directory" in hub.servers[1].detail and "retry in" in hub.servers[1].detail
    assert hub.servers[2].detail.startswith("down: not ready within 0.3 s")
    # Every attempt's process group is ended: they do not pile up while the retries go on.
    await until(lambda: len(daemon.reaper.live_groups) <= 2, 10, "the failed attempts' groups are still alive")
    checks = await daemon.readiness()
    assert not checks["mcp"].ok  # "missing" is required
    assert hub.tools() == []


async def test_a_server_that_stops_answering_pings_is_restarted(tmp_path: Path, record: Record) -> None:
    reaper = ProcessReaper(grace_s=0.5)
    # The connect deadline is also a ping's: long enough for a server on SDK 2.x to start on a busy
    # machine (its imports take seconds), short enough to notice the hang soon.
    settings = McpServerConfig(**stdio_server(record, ping_interval_s=0.2, connect_timeout_s=8, max_backoff_s=0.5))
    hub = McpHub.build([settings], reaper, max_output=1000)
    hub.start()
    server = hub.servers[0]
    try:
        await until(lambda: server.up, 30, f"never up: {server.detail}")
        pid = server.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # hung: alive, silent
        await until(lambda: server.state == "down", 20, "the hang was never noticed")
        assert "ping" in server.detail
        await until(lambda: server.up, 30, f"never back: {server.detail}")
        await until(lambda: not group_alive(pid), 10, "the hung server's group was not killed")
    finally:
        await hub.close()
        await reaper.drain()


# --- the process: owned by the daemon ----------------------------------------------------------------------


async def test_a_stdio_servers_group_dies_with_the_daemon_even_on_kill_9(
        tmp_path: Path, provider: FakeProvider, record: Record) -> None:
    from tests.test_daemon_process import Daemon as DaemonProcess

    provider.then(Script(tool_calls=[("fake__spawn_child", {})]))
    daemon = DaemonProcess(tmp_path, ("SWITCHBOARD_AGENT__KIND", "openai"),
                           ("SWITCHBOARD_AGENT__BASE_URL", provider.base_url), ("SWITCHBOARD_AGENT__RETRIES", "0"),
                           ("SWITCHBOARD_MCP__SERVERS", json.dumps([stdio_server(record)])),
                           ("PYTHONPATH", str(ROOT)), module=True)  # this checkout's gateway
    try:
        await daemon.ready()
        started = await record.wait("started")
        leader = stat(started["pid"])
        assert leader is not None and leader.pgid == leader.pid  # a process group of its own
        async with aiohttp.ClientSession() as http:

            async def detail() -> str:
                async with http.get(daemon.base + "/readyz") as resp:
                    return str((await resp.json())["checks"]["mcp"]["detail"])

            deadline = time.monotonic() + 30
            while not (await detail()).startswith("fake: up") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            request = daemon.post(http, "start a child", "k")
            child = stat((await record.wait("child"))["child"])
            assert child is not None and child.pgid == leader.pid
            daemon.kill()  # kill -9
            await until(lambda: not (running(leader) or running(child)), 10, "the MCP server outlived the daemon")
            request.cancel()
    finally:
        daemon.kill()


async def test_shutdown_terminates_the_stdio_server(make_daemon: DaemonFactory, record: Record) -> None:
    daemon = await make_daemon(mcp={"servers": [stdio_server(record)]})
    await mcp_up(daemon)
    pid = daemon.mcp.servers[0].pid
    assert pid is not None and group_alive(pid)
    await daemon.stop()
    assert not group_alive(pid)
    assert not daemon.reaper.live_groups



# --- config ------------------------------------------------------------------------------------------------


def test_the_example_configs_servers_load(tmp_path: Path) -> None:
    example = (ROOT / "deploy" / "switchboard.example.toml").read_text()
    section = example.split("\n[mcp]", 1)[1].split("\n[", 1)[0]
    block = [line[4:] for line in section.splitlines() if line.startswith("#   ")]
    headers = tmp_path / "search.headers"
    headers.write_text("Authorization: Bearer tok-123456789\n")
    text = "\n".join(block).replace("/etc/switchboard/search.headers", str(headers))
    path = tmp_path / "mcp.toml"
    path.write_text(text)
    servers = load_config(path, env={}).mcp.servers
    assert [s.name for s in servers] == ["files", "search"]
    assert servers[0].command == "npx" and servers[0].env == {"NODE_OPTIONS": "--max-old-space-size=256"}
    assert servers[0].disabled_tools == ["write_*", "move_file"]
    assert servers[1].url == "http://127.0.0.1:8000/mcp" and servers[1].enabled_tools == ["web_search"]
    assert "tok-123456789" not in render(load_config(path, env={}))


@pytest.mark.parametrize(("entry", "error"), [
    ({"name": "a b", "command": "x"}, "mcp.servers[0].name"),
    ({"name": "a", "command": "x", "url": "http://h/mcp"}, "set either command"),
    ({"name": "a"}, "set either command"),
    ({"name": "a", "url": "ftp://h/mcp"}, "must be an http(s) URL"),
    ({"name": "a", "url": "http://h/mcp", "args": ["x"]}, "are for stdio servers"),
    ({"name": "a", "command": "x", "timeout_s": 0}, "timeout_s: must be greater than 0"),
    ({"name": "a", "command": "x", "env": {"A": 1}}, "mcp.servers[0].env.A: must be a string"),
    ({"name": "a", "command": "x", "bogus": 1}, "mcp.servers[0].bogus: unknown key"),
    ({"name": "a", "url": "http://h/mcp", "headers_file": "/nonexistent/h"}, "headers_file: cannot read"),
    ({"name": "a", "command": " "}, "mcp.servers.a.command: must not be empty"),
    ({"name": "a", "command": "x", "headers_file": "/etc/hostname"}, "mcp.servers.a.headers_file: is for HTTP"),
    ({"name": "a", "command": "x", "env_file": "/nonexistent/e"}, "mcp.servers.a.env_file: cannot read"),
])
def test_bad_server_entries_are_refused_by_key(entry: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, {"SWITCHBOARD_MCP__SERVERS": json.dumps([entry])})
    assert error in str(exc.value)


def test_two_servers_may_not_share_a_name() -> None:
    with pytest.raises(ConfigError, match="used twice"):
        load_config(None, {"SWITCHBOARD_MCP__SERVERS": json.dumps([{"name": "a", "command": "x"},
                                                                   {"name": "a", "url": "http://h/mcp"}])})
