"""The built-in web chat over a real websocket: streaming, Stop, New, history on reconnect."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider


async def _frames_until(ws: aiohttp.ClientWebSocketResponse, pred: Any, timeout: float = 5) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    async def read() -> None:
        while True:
            frame = await ws.receive_json()
            seen.append(frame)
            if pred(frame):
                return

    await asyncio.wait_for(read(), timeout)
    return seen


def _browser() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))  # keeps cookies for 127.0.0.1


async def _open(http: aiohttp.ClientSession, base: str) -> aiohttp.ClientWebSocketResponse:
    async with http.get(base + "/") as resp:
        assert resp.status == 200 and "<title>Switchboard</title>" in await resp.text()
    return await http.ws_connect(base + "/ws", origin=base)


async def test_stream_stop_and_history_on_reconnect(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.01, 3
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with _browser() as http:
        ws = await _open(http, base)
        hello = await ws.receive_json()
        assert hello["type"] == "hello" and hello["history"] == [] and hello["running"] is False
        await ws.send_json({"type": "message", "id": "c1", "text": "hello there"})
        frames = await _frames_until(ws, lambda f: f == {"type": "state", "running": False})
        assert {"type": "state", "running": True} in frames
        texts = [f["text"] for f in frames if f["type"] in ("message", "edit")]
        assert texts[-1] == "reply to: hello there w0 w1 w2 "
        # A resend of the same client id after a reconnect is not answered twice.
        await ws.send_json({"type": "message", "id": "c1", "text": "hello there"})

        provider.delay_s, provider.words = 0.1, 100
        await ws.send_json({"type": "message", "id": "c2", "text": "long answer please"})
        await _frames_until(ws, lambda f: f["type"] == "message")
        await ws.send_json({"type": "command", "name": "stop"})
        frames = await _frames_until(ws, lambda f: f == {"type": "state", "running": False})
        assert any(f["type"] == "edit" and f["text"].endswith("⏹ stopped") for f in frames)
        assert any(f["type"] == "notice" and f["text"] == "Stopped." for f in frames)
        await ws.close()

        ws = await http.ws_connect(base + "/ws", origin=base)  # same cookie: same session
        hello = await ws.receive_json()
        assert [(m["role"], m["text"][:5]) for m in hello["history"]] == [
            ("user", "hello"), ("assistant", "reply"), ("user", "long "), ("assistant", "reply")]
        assert hello["history"][1]["text"] == "reply to: hello there w0 w1 w2 "
        assert (hello["history"][-1]["interrupted_by"], hello["history"][-1]["reason"]) == (
            "user", "stopped by user (/stop)")
        assert len(provider.requests_for("hello there")) == 1

        await ws.send_json({"type": "command", "name": "new"})
        await _frames_until(ws, lambda f: f["type"] == "notice" and "new conversation" in f["text"])
        await ws.close()
        ws = await http.ws_connect(base + "/ws", origin=base)
        assert (await ws.receive_json())["history"] == []
        await ws.close()


async def test_two_browsers_are_two_sessions(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 40
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with _browser() as a, _browser() as b:
        wa, wb = await _open(a, base), await _open(b, base)
        await wa.receive_json()
        await wb.receive_json()
        await wa.send_json({"type": "message", "id": "x", "text": "from a"})
        await wb.send_json({"type": "message", "id": "x", "text": "from b"})
        await _frames_until(wa, lambda f: f["type"] == "message")
        await _frames_until(wb, lambda f: f["type"] == "message")
        await wa.send_json({"type": "command", "name": "stop"})
        await _frames_until(wa, lambda f: f.get("text") == "Stopped.")
        frames = await _frames_until(wb, lambda f: f == {"type": "state", "running": False}, timeout=10)
        final = [f["text"] for f in frames if f["type"] == "edit"][-1]
        assert final.endswith("w39 ") and "stopped" not in final
        await wa.close()
        await wb.close()


async def test_cross_origin_websockets_are_refused(make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with _browser() as http:
        async with http.get(base + "/"):
            pass
        try:
            await http.ws_connect(base + "/ws", origin="http://evil.example")
            raise AssertionError("connected")
        except aiohttp.WSServerHandshakeError as exc:
            assert exc.status == 403
