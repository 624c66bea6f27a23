"""The daemon as a real process: embedded defaults, `python -m gateway`, and SIGTERM mid-turn."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.conftest import free_port
from tests.fakes.openai_provider import FakeProvider, Script


async def _wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
            try:
                async with http.get(base + "/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("daemon never became ready")


async def _tool_group(cmdline: str) -> int:
    """The process group of the tool process running exactly `cmdline`, once it has started."""
    for _ in range(300):
        out = subprocess.run(["pgrep", "-f", "-x", cmdline], capture_output=True, text=True).stdout
        if out.split():
            return os.getpgid(int(out.split()[0]))
        await asyncio.sleep(0.02)
    raise AssertionError(f"the tool ({cmdline}) never started")


def _running_in_group(pgid: int) -> list[int]:
    """Processes of a group that are alive (not zombies waiting for whoever adopted them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _start(tmp_path: Path, *extra_env: tuple[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """The daemon under the interpreter running the tests (never a `switchboard` found on PATH)."""
    port = free_port()
    env = {**os.environ, "SWITCHBOARD_HTTP__PORT": str(port), "SWITCHBOARD_ADMIN__PORT": str(free_port()),
           "SWITCHBOARD_API__ENABLED": "true",
           "SWITCHBOARD_TOOLS__TOOL_KILL_GRACE_S": "1", **dict(extra_env)}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "run"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{port}"


async def test_embedded_defaults_serve_the_web_chat_and_store_under_dot_switchboard(tmp_path: Path) -> None:
    proc, base = _start(tmp_path)
    try:
        await _wait_healthy(base, proc)
        async with aiohttp.ClientSession() as http, http.get(base + "/") as resp:
            assert resp.status == 200
        assert (tmp_path / ".switchboard" / "switchboard.db").exists()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0


async def test_sigterm_mid_turn_cancels_with_the_system_reason_and_leaves_no_orphans(tmp_path: Path) -> None:
    secs = f"{random.uniform(60, 69):g}"  # this test's own tool, whatever else runs on the machine
    proc, base = _start(tmp_path)
    try:
        await _wait_healthy(base, proc)
        async with aiohttp.ClientSession() as http:
            body = {"messages": [{"role": "user", "content": f"!sleep {secs}"}], "user": "erin"}
            request = asyncio.create_task(http.post(base + "/v1/chat/completions", json=body))
            pgid = await _tool_group(f"sleep {secs}")
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 10) == 0
            assert time.monotonic() - started < 5
            assert not _running_in_group(pgid), "the tool's process group outlived the daemon"
            resp = await request
            answer = await resp.json()
            assert answer["switchboard"] == {"interrupted_by": "system", "reason": "gateway restart"}
    finally:
        if proc.poll() is None:
            proc.kill()
    db = sqlite3.connect(tmp_path / ".switchboard" / "switchboard.db")
    rows = db.execute("SELECT role, content, interrupted_by, reason FROM messages ORDER BY id").fetchall()
    assert rows[-1] == ("tool", "[interrupted by system: gateway restart]", "system", "gateway restart")
    assert db.execute("SELECT status, detail FROM inbound").fetchall() == [
        ("restart", "[interrupted by system: gateway restart]")]  # to be resumed on the next start
    logs = proc.stderr.read().decode() if proc.stderr else ""
    assert '"msg": "shutting down: [interrupted by system: gateway restart]"' in logs


async def test_a_second_sigterm_during_the_drain_exits_at_once_without_orphans(
        tmp_path: Path, provider: FakeProvider) -> None:
    # A tool that ignores SIGTERM (and so does its child), mid-drain: the second signal must still
    # leave nothing behind.
    secs = f"{random.uniform(50, 59):.3f}"  # this test's own tool, whatever else runs on the machine
    provider.then(Script(tool_calls=[("shell", {"command": f"trap '' TERM; sleep {secs}; sleep {secs}"})]))
    proc, base = _start(tmp_path, ("SWITCHBOARD_DAEMON__DRAIN_TIMEOUT_S", "60"), ("SWITCHBOARD_TOOLS__SHELL", "true"),
                        ("SWITCHBOARD_AGENT__KIND", "openai"), ("SWITCHBOARD_AGENT__BASE_URL", provider.base_url))
    try:
        await _wait_healthy(base, proc)
        async with aiohttp.ClientSession() as http:
            body = {"messages": [{"role": "user", "content": "run the tool"}], "user": "drainer"}
            request = asyncio.create_task(http.post(base + "/v1/chat/completions", json=body))
            pgid = await _tool_group(f"sleep {secs}")
            proc.send_signal(signal.SIGTERM)  # drain: the turn may finish (it will not, for a minute)
            await asyncio.sleep(1.0)
            assert proc.poll() is None and _running_in_group(pgid)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # enough: now
            await asyncio.to_thread(proc.wait, 10)
            assert time.monotonic() - started < 3
            for _ in range(100):
                if not _running_in_group(pgid):
                    break
                await asyncio.sleep(0.02)
            assert not _running_in_group(pgid), "the tool outlived the daemon"
            request.cancel()
    finally:
        if proc.poll() is None:
            proc.kill()
