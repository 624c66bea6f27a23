"""Secrets never reach logs, errors or output — fed through every error path we can provoke."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.conftest import free_port
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.spawn import Group, wait_ready

AGENT_KEY = "sk-agent-SECRET-0a1b2c3d"
TG_TOKEN = "123456:TG-SECRET-abcdefghijklmnop"
API_KEY = "api-key-SECRET-9f8e7d"
ADMIN_TOKEN = "admin-SECRET-5544"
REDIS_PASSWORD = "redis-SECRET-pw-3344"
SECRETS = (AGENT_KEY, TG_TOKEN, API_KEY, ADMIN_TOKEN, REDIS_PASSWORD, TG_TOKEN.split(":")[1])


def _clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret} leaked:\n{text[:4000]}"


async def test_secrets_stay_out_of_logs_errors_and_replies(tmp_path: Path, provider: FakeProvider) -> None:
    port, dead = free_port(), free_port()
    env = {**os.environ, "SWITCHBOARD_HTTP__PORT": str(port), "SWITCHBOARD_ADMIN__PORT": str(free_port()),
           "SWITCHBOARD_ADMIN__TOKEN": ADMIN_TOKEN, "SWITCHBOARD_API__ENABLED": "true",
           "SWITCHBOARD_API__KEYS": API_KEY, "SWITCHBOARD_AGENT__KIND": "openai",
           "SWITCHBOARD_AGENT__BASE_URL": provider.base_url, "SWITCHBOARD_AGENT__API_KEY": AGENT_KEY,
           "SWITCHBOARD_AGENT__RETRIES": "0", "SWITCHBOARD_TELEGRAM__TOKEN": TG_TOKEN,
           "SWITCHBOARD_TELEGRAM__BASE_URL": f"http://127.0.0.1:{dead}/bot",  # nothing listens: errors
           "SWITCHBOARD_TELEGRAM__BASE_FILE_URL": f"http://127.0.0.1:{dead}/file/bot",
           "SWITCHBOARD_WEBCHAT__ENABLED": "true", "SWITCHBOARD_LOG__LEVEL": "debug"}
    proc = Group([sys.executable, "-m", "gateway", "run"], cwd=tmp_path, env=env, log=tmp_path / "daemon.log")
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(base + "/healthz", proc, "the daemon", proc.log)
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/readyz") as resp:  # Telegram unreachable: health says why
                _clean(await resp.text())
            provider.then(Script(echo_key=True))  # the provider quotes our key back in its error
            body = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"session_id": "u1"}}
            async with http.post(base + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
                answer = await resp.text()
            assert "Incorrect API key provided: ***" in answer
            _clean(answer)
            async with http.post(base + "/v1/chat/completions", json=body,
                                 headers={"Authorization": "Bearer wrong"}) as resp:
                _clean(await resp.text())
            async with http.get(f"http://127.0.0.1:{env['SWITCHBOARD_ADMIN__PORT']}/metrics") as resp:
                assert resp.status == 401
                _clean(await resp.text())
            await asyncio.sleep(2.0)  # let the Telegram poller fail and back off a few times
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        proc.end()
    logs = proc.log_tail(10_000_000)
    assert "telegram" in logs.lower() and "***" in logs  # the errors were logged, masked
    _clean(logs)
    check = subprocess.run([sys.executable, "-m", "gateway", "check"], env=env, capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0
    _clean(check.stdout + check.stderr)


def test_an_unreachable_redis_is_one_line_without_its_password(tmp_path: Path) -> None:
    env = {**os.environ, "SWITCHBOARD_REDIS__URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{free_port()}/0",
           "SWITCHBOARD_HTTP__PORT": str(free_port()), "SWITCHBOARD_ADMIN__PORT": str(free_port())}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "gateway", "run"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30
    assert "cannot start" in result.stderr and "Traceback" not in result.stderr
    _clean(result.stdout + result.stderr)


def test_the_database_pool_retrying_through_an_outage_logs_one_line_per_retry(tmp_path: Path) -> None:
    """asyncpg logs every reconnect attempt of its pool with a traceback (about one a second while
    PostgreSQL is down); the daemon's log keeps the line and the error, not 40 lines of stack."""
    emit = ("import logging\nfrom gateway.core.logs import setup_logging\nsetup_logging('info', 'json')\n"
            "try:\n    raise ConnectionRefusedError(111, 'Connection refused')\nexcept OSError:\n"
            "    logging.getLogger('asyncpg.pool').warning('Failed to restore the pool connection floor; retrying',"
            " exc_info=True)\n"
            "logging.getLogger('gateway.store').error('ours keep theirs', exc_info=ValueError('boom'))\n")
    result = subprocess.run([sys.executable, "-c", emit], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert result.returncode == 0, result.stderr
    pool, ours = [json.loads(line) for line in result.stderr.splitlines()]
    assert pool["msg"] == ("Failed to restore the pool connection floor; retrying: "
                           "ConnectionRefusedError: [Errno 111] Connection refused") and "exc" not in pool
    assert "ValueError: boom" in ours["exc"]  # only the library's expected retries lose their stack
