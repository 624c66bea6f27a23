"""The built-in web chat over a real websocket: streaming, Stop, New, history on reconnect."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider, Script


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


async def test_a_stopped_answer_is_stored_exactly_as_the_page_was_shown_it(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    # Tokens arrive far faster than the 50 ms edit interval: text the page never saw is in flight
    # at every stop. The stop mark's body and the stored row must agree to the character.
    provider.delay_s, provider.words = 0.002, 3000
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with _browser() as http:
        ws = await _open(http, base)
        await ws.receive_json()
        for trial in range(4):
            await ws.send_json({"type": "message", "id": f"m{trial}", "text": f"long {trial}"})
            enough = 200 * (trial + 1)
            frames = await _frames_until(ws, lambda f, n=enough: f["type"] == "edit" and len(f["text"]) > n)
            await ws.send_json({"type": "command", "name": "stop"})
            frames += await _frames_until(ws, lambda f: f == {"type": "state", "running": False})
            mark = next(f for f in frames if f.get("interrupted"))
            assert mark["text"] == mark["body"] + "\n\n⏹ stopped"
            shown = [f["text"] for f in frames if f["type"] in ("message", "edit") and not f.get("interrupted")]
            assert mark["body"] == shown[-1]  # the mark goes on what the page showed last, nothing newer
            _, history = await daemon.store.conversation(_key(daemon, http))
            assert history[-1].content == mark["body"], f"trial {trial}"
        await ws.close()


async def test_hello_gives_the_message_limit_and_keeps_the_stop_mark_of_a_tool_turn(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.then(Script(tool_calls=[("sleep", {"seconds": 30})]))
    daemon = await make_daemon(router={"max_message_chars": 1234})
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with _browser() as http:
        ws = await _open(http, base)
        assert (await ws.receive_json())["max_chars"] == 1234
        await ws.send_json({"type": "message", "id": "t1", "text": "wait a bit"})
        await _frames_until(ws, lambda f: f == {"type": "state", "running": True})
        key = _key(daemon, http)
        for _ in range(500):  # until the tool runs
            if [c for c in provider.connections if c.completed] and daemon.router.status(key).running:
                break
            await asyncio.sleep(0.01)
        await ws.send_json({"type": "command", "name": "stop"})
        await _frames_until(ws, lambda f: f == {"type": "state", "running": False})
        await ws.close()
        ws = await http.ws_connect(base + "/ws", origin=base)
        history = (await ws.receive_json())["history"]
        assert [(m["role"], m["tools"], m["interruption"]) for m in history] == [
            ("user", [], None),
            ("assistant", ["sleep"], {"by": "user", "reason": "stopped by user (/stop)", "kind": "stopped"})]
        await ws.close()


def _cookie(http: aiohttp.ClientSession) -> str:
    return next(c.value for c in http.cookie_jar if c.key == "switchboard_chat")


def _key(daemon: Any, http: aiohttp.ClientSession) -> str:
    """The session key of a browser's session: named by a keyed hash of its cookie, never the cookie."""
    return f"webchat:dm:{daemon.adapters['webchat'].session_id(_cookie(http))}"
