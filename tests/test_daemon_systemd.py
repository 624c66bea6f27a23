"""The daemon under a (fake) systemd: sd_notify states, SIGHUP reloads, SIGTERM mid-turn."""

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

from gateway.ops.config import load_config
from tests.conftest import free_port
from tests.fakes.notify_socket import FakeSystemd
from tests.fakes.openai_provider import FakeProvider
from tests.support.procs import until
from tests.support.spawn import READY_DEADLINE_S, Group


def _daemon(tmp_path: Path, config: Path, notify: str, **env: str) -> Group:
    """`python -m gateway run` under the fake systemd, in a process group of its own, logging to
    tmp_path/daemon.log (a file: a pipe nobody reads until the end could fill and block it)."""
    full = {**os.environ, "NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "1000000", **env}
    return Group([sys.executable, "-m", "gateway", "run", "--config", str(config)], cwd=tmp_path, env=full,
                 log=tmp_path / "daemon.log")


def _wait(systemd: FakeSystemd, needle: str, proc: Group, timeout: float = READY_DEADLINE_S) -> str:
    """The first notification holding `needle`, once it came. The deadline only keeps a daemon that
    never says it from hanging the test (a start takes tens of seconds on a busy machine)."""
    deadline = time.monotonic() + timeout
    while True:
        for message in systemd.messages():
            if needle in message:
                return message
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited ({proc.returncode}) before it sent {needle!r}; "
                                 f"log tail:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {needle!r} within {timeout:.0f} s in {systemd.messages()}; "
                                 f"log tail:\n{proc.log_tail()}")
        time.sleep(0.02)


async def test_notify_states_reload_and_sigterm_mid_turn(tmp_path: Path, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.1, 200
    port = free_port()
    config = tmp_path / "switchboard.toml"
    base = (f'[http]\nport = {port}\n[admin]\nport = {free_port()}\n[api]\nenabled = true\n'
            f'[agent]\nkind = "openai"\nbase_url = "{provider.base_url}"\nretries = 0\n')
    config.write_text(base + '[router]\nbusy = "interrupt"\n')
    systemd = FakeSystemd(str(tmp_path / "notify.sock"))
    proc = _daemon(tmp_path, config, systemd.notify_socket)
    try:
        ready = await asyncio.to_thread(_wait, systemd, "READY=1", proc)
        assert "STATUS=ready: webchat, api" in ready
        await asyncio.to_thread(_wait, systemd, "WATCHDOG=1", proc)  # pings follow once ready

        config.write_text(base + '[router]\nbusy = "queue"\n[log]\nlevel = "debug"\n[http]\n')  # a bad config
        proc.send_signal(signal.SIGHUP)
        rejected = await asyncio.to_thread(_wait, systemd, "reload rejected", proc)
        assert "http: must be a table" in rejected or "duplicate" in rejected.lower() or "TOML" in rejected
        reloading = [m for m in systemd.messages() if "RELOADING=1" in m]
        assert reloading and "MONOTONIC_USEC=" in reloading[0]

        config.write_text(base + '[router]\nbusy = "queue"\n[log]\nlevel = "debug"\n')
        systemd.clear()
        proc.send_signal(signal.SIGHUP)
        reloaded = await asyncio.to_thread(_wait, systemd, "ready (reloaded", proc)
        assert "restart needed" not in reloaded

        async with aiohttp.ClientSession() as http:
            body = {"messages": [{"role": "user", "content": "a long one"}], "metadata": {"session_id": "zed"}}
            request = asyncio.create_task(http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body))
            await until(lambda: bool(provider.requests_for("a long one")), 10, "the turn never started")
            await until(lambda: provider.requests_for("a long one")[0].words >= 3, 10, "the answer never streamed")
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 20) == 0
            assert time.monotonic() - started < 10  # well inside TimeoutStopSec
            answer = await (await request).json()
        assert answer["switchboard"].items() >= {"interrupted_by": "system", "reason": "gateway restart"}.items()
        assert any("STOPPING=1" in m for m in systemd.messages())
        conn = provider.requests_for("a long one")[0]
        await provider.wait_closed(conn)
        assert not conn.completed
    finally:
        proc.end()
        systemd.close()
    logs = proc.log_tail(1_000_000)
    assert "config reloaded: applied router, log" in logs
    db = sqlite3.connect(tmp_path / ".switchboard" / "switchboard.db")
    assert db.execute("SELECT reason FROM messages ORDER BY id DESC LIMIT 1").fetchone() == ("gateway restart",)


async def test_the_restarted_daemon_resumes_the_interrupted_turn_with_the_system_marker(
        tmp_path: Path, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 100
    port = free_port()
    config = tmp_path / "switchboard.toml"
    config.write_text(f'[http]\nport = {port}\n[admin]\nport = {free_port()}\n'
                      f'[agent]\nkind = "openai"\nbase_url = "{provider.base_url}"\nretries = 0\n')
    systemd = FakeSystemd(str(tmp_path / "notify.sock"))
    proc = _daemon(tmp_path, config, systemd.notify_socket)
    first = proc
    base = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(_wait, systemd, "READY=1", proc)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            async with http.get(base + "/"):
                pass
            ws = await http.ws_connect(base + "/ws", origin=base)
            await ws.receive_json()
            await ws.send_json({"type": "message", "id": "m1", "text": "write an essay"})
            while True:
                frame = await asyncio.wait_for(ws.receive_json(), 30)  # (a deadline, not a pace)
                if frame["type"] == "edit":
                    break
            proc.send_signal(signal.SIGTERM)
            frames = []
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    frames.append(msg.json())
            assert any(f.get("text", "").endswith("⏹ interrupted: gateway restart") for f in frames)
            assert await asyncio.to_thread(proc.wait, 20) == 0
            provider.delay_s, provider.words = 0.0, 3
            systemd.clear()
            proc = _daemon(tmp_path, config, systemd.notify_socket)
            await asyncio.to_thread(_wait, systemd, "READY=1", proc)
            await until(lambda: len(provider.connections) == 2 and provider.connections[1].completed, 30,
                        "the restarted daemon never resumed the interrupted turn")
            resumed = provider.connections[1].body["messages"]
            assert resumed[0] == {"role": "user", "content": "write an essay"}
            assert resumed[1]["content"].endswith("[interrupted by system: gateway restart]")
            assert resumed[2]["content"].startswith("[interrupted by system: gateway restart]")
            ws = await http.ws_connect(base + "/ws", origin=base)
            hello = await ws.receive_json()
            assert hello["history"][-1]["text"].startswith("reply to:  w0")  # the resume prompt is not shown
            await ws.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        for each in (first, proc):
            each.end()
        systemd.close()


def test_an_api_keys_file_holds_one_key_a_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-one-111111\nsk-two-222222\n")
    config = tmp_path / "c.toml"
    config.write_text(f'[api]\nenabled = true\nkeys_file = "{keys}"\n')
    assert [k.reveal() for k in load_config(config, {}).api.keys] == ["sk-one-111111", "sk-two-222222"]
