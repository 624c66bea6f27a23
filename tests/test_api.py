"""The OpenAI-compatible HTTP API, spoken to over a real socket."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.core.cancellation import CLIENT_DISCONNECTED
from platforms.api_reply import SseResponse
from platforms.tenants import key_id
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import until

KEY = "sk-test-0123456789"
STOPPED = {"interrupted_by": "user", "reason": "stopped by user (/stop)"}  # (and usage_estimated, for a cut round)


def _key(session: str) -> str:
    """The session key of KEY's session `session` (sessions are namespaced by the key's tenant)."""
    return f"api:dm:{key_id(KEY)}/{session}"


def _url(daemon: Any, path: str) -> str:
    return f"http://127.0.0.1:{daemon.config.http.port}{path}"


def _auth(**extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", **extra}


async def _sse_events(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


async def test_stateless_completion_and_models(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 3
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    async with aiohttp.ClientSession() as http:
        async with http.get(_url(daemon, "/v1/models"), headers=_auth()) as resp:
            assert (await resp.json())["data"][0]["id"] == "switchboard"
        body = {"model": "switchboard", "messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hi"}]}
        async with http.post(_url(daemon, "/v1/chat/completions"), json=body, headers=_auth()) as resp:
            assert resp.status == 200
            out = await resp.json()
        assert out["choices"][0]["message"]["content"] == "reply to: hi w0 w1 w2 "
        assert out["object"] == "chat.completion"
        # Stateless: the provider saw exactly the request's messages, and nothing was kept.
        assert provider.connections[-1].body["messages"] == body["messages"]
        async with http.post(_url(daemon, "/v1/chat/completions"), json=body, headers=_auth()) as resp:
            await resp.json()
        assert provider.connections[-1].body["messages"] == body["messages"]


async def test_a_session_keeps_history_and_streams(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 2
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    async with aiohttp.ClientSession() as http:
        for text in ("first", "second"):
            body = {"messages": [{"role": "user", "content": text}], "stream": True}
            async with http.post(_url(daemon, "/v1/chat/completions"), json=body,
                                 headers=_auth(**{"X-Session-Id": "alice"})) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                events = await _sse_events(resp)
            content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
            assert content == f"reply to: {text} w0 w1 "
            assert events[-1]["choices"][0]["finish_reason"] == "stop"
    sent = provider.connections[-1].body["messages"]
    assert [m["content"] for m in sent] == ["first", "reply to: first w0 w1 ", "second"]


async def test_bad_requests_get_openai_style_errors(make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    url = _url(daemon, "/v1/chat/completions")
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json={"messages": []}) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"] == {"message": "Incorrect API key provided.",
                                                    "type": "invalid_request_error", "param": None,
                                                    "code": "invalid_api_key"}
        async with http.post(url, json={"messages": []}, headers={"Authorization": "Bearer nope"}) as resp:
            assert resp.status == 401
        for body, needle in ((b"{not json", "must be JSON"), (b"[]", "JSON object"),
                             (b'{"messages": []}', "non-empty"),
                             (b'{"messages": [{"role": "tool", "content": "x"}]}', "user message"),
                             (b'{"messages": [{"role": "robot", "content": "x"}]}', "role"),
                             (b'{"messages": [{"role": "user", "content": 5}]}', "content"),
                             (b'{"messages": [{"role": "user", "content": ""}]}', "empty")):
            async with http.post(url, data=body, headers=_auth(**{"Content-Type": "application/json"})) as resp:
                assert resp.status == 400, body
                error = (await resp.json())["error"]
                assert needle in error["message"] and error["type"] == "invalid_request_error"


async def test_a_streaming_client_that_disconnects_cancels_its_run(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.1, 200
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "long one"}], "stream": True}
        resp = await http.post(_url(daemon, "/v1/chat/completions"), json=body,
                               headers=_auth(**{"X-Session-Id": "bob"}))
        await resp.content.readline()
        await asyncio.sleep(0.3)
        resp.close()  # the client goes away mid-stream
    conn = provider.connections[-1]
    await provider.wait_closed(conn, timeout=2)
    assert not conn.completed
    history: list[Any] = []

    async def recorded() -> bool:
        history[:] = (await daemon.store.conversation(_key("bob")))[1]
        return bool(history) and history[-1].role == "assistant"

    deadline = time.monotonic() + 10
    while not await recorded():
        assert time.monotonic() < deadline, "the interrupted turn was never recorded"
        await asyncio.sleep(0.02)
    assert (history[-1].interrupted_by, history[-1].reason) == ("system", CLIENT_DISCONNECTED.text)


async def test_a_client_gone_as_its_stream_begins_still_cancels_its_run(
        make_daemon: DaemonFactory, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves after its message was taken, before the stream's headers are written:
    aiohttp's `prepare` raises (the transport is closing) before the stream has hooked its cancel.
    The run went on, and the provider streamed the whole answer to nobody (Python 3.13, the
    balancer test: "its stream still open 35 s after its client hung up")."""
    provider.delay_s, provider.words = 0.1, 200

    async def gone(_request: object) -> None:
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")  # as aiohttp's own

    monkeypatch.setattr(SseResponse, "prepared", staticmethod(gone))
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "gone at once"}], "stream": True}
        async with http.post(_url(daemon, "/v1/chat/completions"), json=body,
                             headers=_auth(**{"X-Session-Id": "carol"})) as resp:
            await resp.read()
    history: list[Any] = []
    deadline = time.monotonic() + 10
    while not (history and history[-1].role == "assistant"):
        assert time.monotonic() < deadline, f"the run went on after its client had gone: {history}"
        await asyncio.sleep(0.02)
        history[:] = (await daemon.store.conversation(_key("carol")))[1]
    assert (history[-1].interrupted_by, history[-1].reason) == ("system", CLIENT_DISCONNECTED.text)
    for conn in provider.requests_for("gone at once"):  # (cancelled before its request, it sent none)
        await provider.wait_closed(conn, timeout=10)
        assert not conn.completed


async def test_a_silent_turn_still_notices_the_disconnect_within_a_second(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    # A long tool call: nothing is streamed, yet the client's disappearance is noticed.
    provider.then(Script(tool_calls=[("sleep", {"seconds": 30})]))
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "wait"}], "stream": False}
        task = asyncio.create_task(http.post(_url(daemon, "/v1/chat/completions"), json=body,
                                             headers=_auth(**{"X-Session-Id": "carol"})))
        await until(lambda: daemon.reaper.pending + len(daemon.reaper.live_groups) > 0, 10,
                    "the tool never started")
        task.cancel()
    loop = asyncio.get_running_loop()
    gone_at = loop.time()
    while daemon.router.status(_key("carol")).running:
        await asyncio.sleep(0.01)
        assert loop.time() - gone_at < 1.0, "disconnect not noticed within 1 s"
    _, history = await daemon.store.conversation(_key("carol"))
    assert history[-1].content == "[interrupted by system: client disconnected]"


async def test_stop_through_the_api_stops_the_sessions_run(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.1, 100
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    url = _url(daemon, "/v1/chat/completions")
    async with aiohttp.ClientSession() as http:
        async def ask() -> dict[str, Any]:
            body = {"messages": [{"role": "user", "content": "go on"}], "metadata": {"session_id": "dave"}}
            async with http.post(url, json=body, headers=_auth()) as resp:
                return dict(await resp.json())

        pending = asyncio.create_task(ask())
        await until(lambda: bool(provider.requests_for("go on")), 10, "the turn never reached the provider")
        await until(lambda: provider.requests_for("go on")[0].words >= 6, 10, "the answer never streamed")
        stop = {"messages": [{"role": "user", "content": "/stop"}], "metadata": {"session_id": "dave"}}
        async with http.post(url, json=stop, headers=_auth()) as resp:
            assert (await resp.json())["choices"][0]["message"]["content"] == "Stopped."
        answer = await asyncio.wait_for(pending, 10)
    assert answer["switchboard"].items() >= STOPPED.items()
    assert answer["choices"][0]["message"]["content"].startswith("reply to:")  # the partial answer


async def test_text_that_cannot_be_stored_is_refused_before_it_is_acknowledged(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """A lone surrogate is valid JSON but not valid text: a clear 400, nothing stored, no replay."""
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    raw = '{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
    async with aiohttp.ClientSession() as http, http.post(_url(daemon, "/v1/chat/completions"), data=raw.encode(),
                         headers=_auth(**{"Content-Type": "application/json", "X-Session-Id": "poison"})) as resp:
        assert resp.status == 400
        assert "not valid text" in (await resp.json())["error"]["message"]
    assert provider.connections == []
    assert await daemon.store.unfinished_inbound() == []
    assert await daemon.store.conversation(_key("poison")) == (1, [])


async def test_model_output_that_is_not_valid_text_is_stored_with_a_replacement_character(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.by_text["odd"] = Script(text="broken \ud800 char")
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    body = {"messages": [{"role": "user", "content": "odd"}]}
    async with aiohttp.ClientSession() as http, http.post(_url(daemon, "/v1/chat/completions"), json=body,
                         headers=_auth(**{"X-Session-Id": "odd"})) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "broken \ufffd char "
    _conv, rows = await daemon.store.conversation(_key("odd"))
    assert [r.content for r in rows] == ["odd", "broken \ufffd char "]
    assert await daemon.store.unfinished_inbound() == []


@pytest.mark.parametrize(("text", "piece"), [
    ("déjà vu — 雪 🙂 ok", 3),  # lines cut anywhere: mid-line, mid-character
    ("0123456789" * 150_000, 1 << 16),  # one event of 1.5 MB, longer than any read
], ids=["odd-pieces", "one-big-event"])
async def test_a_stream_that_arrives_in_pieces_is_read_whole_and_exact(
        make_daemon: DaemonFactory, provider: FakeProvider, text: str, piece: int) -> None:
    """The provider's stream in writes of `piece` bytes, CRLF endings, no newline after the last event."""
    provider.by_text["pieces"] = Script(text=text, fragments=piece)
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    body = {"messages": [{"role": "user", "content": "pieces"}]}
    async with aiohttp.ClientSession() as http, http.post(_url(daemon, "/v1/chat/completions"), json=body,
                         headers=_auth(**{"X-Session-Id": "pieces"})) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == text + " "
    _conv, rows = await daemon.store.conversation(_key("pieces"))
    assert [r.content for r in rows] == ["pieces", text + " "]


async def test_text_travels_as_text_not_as_escapes(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.by_text["Привет"] = Script(text="Здравствуйте")
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    body = {"messages": [{"role": "user", "content": "Привет"}], "stream": True}
    async with aiohttp.ClientSession() as http, http.post(_url(daemon, "/v1/chat/completions"), json=body,
                         headers=_auth(**{"X-Session-Id": "ru"})) as resp:
        raw = await resp.read()
    assert "Здравствуйте".encode() in raw and b"\\u04" not in raw


# --- a client that closes its socket stops its run at once --------------------------------------

TERM_SPY = """
import pathlib, signal, sys, time
ready = pathlib.Path(sys.argv[1])
def term(*_):
    ready.with_suffix(".term").write_text(repr(time.perf_counter()))
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
ready.write_text("ready")
time.sleep(60)
"""
DISCONNECT_LIMIT_S = 0.05
TRIALS = 3


def _idle(daemon: Any, session: str) -> bool:
    return not daemon.router.status(_key(session)).running


def _written(path: Path) -> bool:
    return path.exists() and bool(path.read_text())


async def _eventually(probe: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def _raw_request(port: int, session: str, body: dict[str, Any]) -> tuple[asyncio.StreamReader,
                                                                               asyncio.StreamWriter]:
    """A client on a plain socket, so the test decides the moment it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nX-Session-Id: {session}\r\nContent-Length: {len(payload)}\r\n\r\n")
    writer.write(head.encode() + payload)
    await writer.drain()
    return reader, writer


async def _hang_up(writer: asyncio.StreamWriter) -> float:
    """Close the client's socket; returns when (perf_counter) it was closed."""
    closed_at = time.perf_counter()
    writer.close()
    await writer.wait_closed()
    return closed_at


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "plain"])
async def test_a_client_closing_its_socket_mid_stream_closes_the_provider_within_50_ms(
        make_daemon: DaemonFactory, provider: FakeProvider, stream: bool) -> None:
    provider.delay_s, provider.words = 0.02, 2000
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    port = daemon.config.http.port
    latencies = []
    for trial in range(TRIALS):
        session, text = f"s{trial}-{stream}", f"long one {trial}"
        reader, writer = await _raw_request(port, session, {"messages": [{"role": "user", "content": text}],
                                                            "stream": stream})
        if stream:
            await asyncio.wait_for(reader.readuntil(b"w3 "), 5)  # the answer is streaming to the client
        else:
            await _eventually(functools.partial(provider.requests_for, text), 5, "the provider request")
            await asyncio.sleep(0.1)  # the provider is streaming; the client hears nothing yet
        (conn,) = provider.requests_for(text)
        gone_at = await _hang_up(writer)
        closed_at = await provider.wait_closed(conn, timeout=2)
        assert not conn.completed
        latencies.append(closed_at - gone_at)
        await _eventually(functools.partial(_idle, daemon, session), 2, "the turn to end")
        _, history = await daemon.store.conversation(_key(session))
        assert (history[-1].interrupted_by, history[-1].reason) == ("system", CLIENT_DISCONNECTED.text)
    figures = [f"{x * 1000:.1f} ms" for x in latencies]
    print(f"disconnect mid-stream ({'sse' if stream else 'plain'}): provider closed {figures} after the client")
    assert max(latencies) < DISCONNECT_LIMIT_S, f"provider closed {figures} after the client"


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "plain"])
async def test_a_client_closing_its_socket_mid_tool_signals_the_tool_group_within_50_ms(
        make_daemon: DaemonFactory, provider: FakeProvider, tmp_path: Path, stream: bool) -> None:
    script = tmp_path / "spy.py"
    script.write_text(TERM_SPY)
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]}, tools={"shell": True, "sandbox": "off"})
    port = daemon.config.http.port
    latencies = []
    for trial in range(TRIALS):
        ready = tmp_path / f"ready{trial}"
        provider.then(Script(tool_calls=[("shell", {"command": f"{sys.executable} {script} {ready}"})]))
        session = f"tool{trial}-{stream}"
        _reader, writer = await _raw_request(port, session, {"messages": [{"role": "user", "content": "run it"}],
                                                             "stream": stream})
        await _eventually(functools.partial(_written, ready), 10, "the tool to start")
        gone_at = await _hang_up(writer)  # nothing is streaming: the tool is running
        term = ready.with_suffix(".term")
        await _eventually(functools.partial(_written, term), 5, "SIGTERM to reach the tool")
        latencies.append(float(term.read_text()) - gone_at)
        await _eventually(functools.partial(_idle, daemon, session), 2, "the turn to end")
        _, history = await daemon.store.conversation(_key(session))
        assert history[-1].role == "tool" and history[-1].content == CLIENT_DISCONNECTED.marker
    figures = [f"{x * 1000:.1f} ms" for x in latencies]
    print(f"disconnect mid-tool ({'sse' if stream else 'plain'}): tool group signalled {figures} after the client")
    assert max(latencies) < DISCONNECT_LIMIT_S, f"tool group signalled {figures} after the client"
async def test_a_request_whose_turn_never_runs_still_gets_an_answer(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """A turn stopped while still queued never opens its reply: the waiting request must still end
    (with the reason), not hang until the client gives up."""
    provider.delay_s, provider.words = 0.1, 200
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]}, router={"busy": "queue"})
    url = _url(daemon, "/v1/chat/completions")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(20)) as http:
        async def ask(text: str) -> tuple[int, dict[str, Any]]:
            body = {"messages": [{"role": "user", "content": text}], "metadata": {"session_id": "eve"}}
            async with http.post(url, json=body, headers=_auth()) as resp:
                return resp.status, dict(await resp.json())

        running = asyncio.create_task(ask("a long one"))
        await until(lambda: bool(provider.requests_for("a long one")), 10, "the first turn never started")
        queued = asyncio.create_task(ask("and then this"))
        await until(lambda: daemon.router.status(_key("eve")).queued == 1, 10, "the second turn was never queued")
        status, body = await ask("/stop")
        assert (status, body["choices"][0]["message"]["content"]) == (200, "Stopped.")
        for task in (running, queued):
            status, answer = await asyncio.wait_for(task, 10)
            assert status == 200
            assert answer["switchboard"].items() >= STOPPED.items()
    assert len(provider.requests_for("and then this")) == 0


async def test_at_capacity_a_request_is_told_to_retry_not_that_the_provider_failed(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """Our side being unavailable for now (every agent slot running, storage down) is a 503 with
    Retry-After — a client retries it — never a 502 that blames the provider."""
    provider.delay_s, provider.words = 0.1, 200
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]},
                               agent_cache={"max_agents": 1, "when_full": "reject"})
    url = _url(daemon, "/v1/chat/completions")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(20)) as http:
        async def ask(user: str, text: str) -> tuple[int, dict[str, Any], str | None]:
            body = {"messages": [{"role": "user", "content": text}], "metadata": {"session_id": user}}
            async with http.post(url, json=body, headers=_auth()) as resp:
                return resp.status, dict(await resp.json()), resp.headers.get("Retry-After")

        running = asyncio.create_task(ask("alice", "a long one"))
        await until(lambda: bool(provider.requests_for("a long one")), 10, "the first turn never started")
        status, body, retry = await ask("bob", "anyone there?")
        assert (status, body["error"]["type"], retry) == (503, "service_unavailable", "5")
        assert provider.requests_for("anyone there?") == []
        await ask("alice", "/stop")
        assert (await asyncio.wait_for(running, 10))[0] == 200


async def test_a_request_found_taken_already_is_told_to_retry_not_that_it_is_a_duplicate(
        make_daemon: DaemonFactory, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's message id is minted per request, so the router finds one taken already only
    when its inbox entry reached two workers in cluster mode, the first of which died before it
    answered (chaos soak, PostgreSQL, seed 2: a 409 "Duplicate request" for a request whose turn
    was cut off). The answer is the retryable 503, not a 409 the client cannot act on. Here the
    same id is minted twice to make the second request find its message taken."""
    provider.words = 2
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    monkeypatch.setattr("platforms.api.unique_id", lambda: "the-same-id")
    body = {"model": "switchboard", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(_url(daemon, "/v1/chat/completions"), json=body,
                             headers=_auth(**{"X-Session-Id": "taken"})) as resp:
            assert resp.status == 200
        async with http.post(_url(daemon, "/v1/chat/completions"), json=body,
                             headers=_auth(**{"X-Session-Id": "taken"})) as resp:
            assert resp.status == 503, await resp.text()
            assert resp.headers.get("Retry-After")
