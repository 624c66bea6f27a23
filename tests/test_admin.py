"""The operator listener: metrics, the session table, operator stops, token auth, the CLI."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from platforms.webchat import WebchatAdapter
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def _ws_say(http: aiohttp.ClientSession, base: str, text: str) -> aiohttp.ClientWebSocketResponse:
    async with http.get(base + "/"):
        pass
    ws = await http.ws_connect(base + "/ws", origin=base)
    await ws.receive_json()
    await ws.send_json({"type": "message", "id": text, "text": text})
    return ws


async def _until(ws: aiohttp.ClientWebSocketResponse, pred: Any) -> list[dict[str, Any]]:
    frames = []
    while True:
        frame = await asyncio.wait_for(ws.receive_json(), 5)
        frames.append(frame)
        if pred(frame):
            return frames


async def test_operator_stop_metrics_and_the_session_table(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 60
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    admin = f"http://127.0.0.1:{daemon.config.admin.port}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as a, \
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as b, aiohttp.ClientSession() as op:
        wa, wb = await _ws_say(a, base, "first user"), await _ws_say(b, base, "second user")
        await _until(wa, lambda f: f["type"] == "message")
        await _until(wb, lambda f: f["type"] == "message")
        async with op.get(admin + "/admin/api/sessions") as resp:
            table = (await resp.json())["sessions"]
        running = [row for row in table if row["state"] == "running"]
        assert len(running) == 2 and all(row["platform"] == "webchat" for row in running)
        cookie = a.cookie_jar.filter_cookies(URL(base))["switchboard_chat"].value
        webchat = daemon.adapters["webchat"]
        assert isinstance(webchat, WebchatAdapter)
        victim = "webchat:dm:" + webchat.session_id(cookie)
        async with op.post(admin + "/admin/api/sessions/stop", json={"key": victim}) as resp:
            assert await resp.json() == {"key": victim, "stopped": True, "worker": None}  # one node: no worker id
        frames = await _until(wa, lambda f: f == {"type": "state", "running": False})
        assert any(f.get("text", "").endswith("⏹ interrupted: stopped by operator") for f in frames)
        frames = await _until(wb, lambda f: f == {"type": "state", "running": False})
        assert "interrupted" not in [f for f in frames if f["type"] == "edit"][-1]["text"]

        async with op.get(admin + "/admin/api/sessions") as resp:
            rows = {r["key"]: r for r in (await resp.json())["sessions"]}
        assert rows[victim]["last_interruption"]["reason"] == "stopped by operator"
        assert rows[victim]["last_interruption"]["kind"] == "system"
        async with op.get(admin + "/metrics") as resp:
            samples = _samples(await resp.text())
        assert samples[("switchboard_cancels_total", (("kind", "system"), ("reason", "stopped by operator")))] == 1
        assert samples[("switchboard_turns_total", (("status", "done"),))] == 1
        assert samples[("switchboard_stop_latency_seconds_count", ())] == 1
        assert samples[("switchboard_messages_in_total", (("outcome", "accepted"), ("platform", "webchat")))] == 2
        assert samples[("switchboard_agent_cache_size", ())] == 2
        assert samples[("switchboard_turns_running", ())] == 0
        async with op.get(admin + "/admin/api/stats") as resp:
            stats = await resp.json()
        assert stats["agent_cache"]["size"] == 2 and stats["health"]["store"]["ok"]
        await wa.close()
        await wb.close()


async def test_a_token_guards_the_admin_listener_and_the_cli_uses_it(make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon(admin={"token": "admin-secret-1234"})
    admin = f"http://127.0.0.1:{daemon.config.admin.port}"
    async with aiohttp.ClientSession() as op:
        async with op.get(admin + "/metrics") as resp:
            assert resp.status == 401
        async with op.get(admin + "/metrics", headers={"Authorization": "Bearer wrong"}) as resp:
            assert resp.status == 401
        async with op.get(admin + "/metrics", headers={"Authorization": "Bearer admin-secret-1234"}) as resp:
            assert resp.status == 200
    env = {**os.environ, "SWITCHBOARD_ADMIN__PORT": str(daemon.config.admin.port),
           "SWITCHBOARD_ADMIN__TOKEN": "admin-secret-1234"}
    listed = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gateway", "sessions", "list"],
                                     env=env, capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    stop = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gateway", "sessions", "stop",
                                                    "webchat:dm:nobody"], env=env, capture_output=True, text=True,
                                   timeout=30)
    assert stop.returncode == 0 and "nothing was running" in stop.stdout
    env["SWITCHBOARD_ADMIN__TOKEN"] = "wrong-token-000"
    denied = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gateway", "sessions", "list"],
                                     env=env, capture_output=True, text=True, timeout=30)
    assert denied.returncode == 1 and "admin token required" in denied.stderr


async def test_the_admin_root_leads_to_the_console_and_both_listeners_have_a_favicon(
        make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon(admin={"token": "admin-secret-1234"})
    admin = f"http://127.0.0.1:{daemon.config.admin.port}"
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(admin + "/", allow_redirects=False) as resp:
            assert (resp.status, resp.headers["Location"]) == (302, "/admin")  # public: the page asks for the token
        async with http.get(admin + "/") as resp:
            assert resp.status == 200 and "Switchboard console" in await resp.text()
        for listener in (admin, base):
            async with http.get(listener + "/favicon.ico") as resp:
                assert resp.status == 200 and resp.content_type == "image/svg+xml"
                assert (await resp.text()).startswith("<svg")
