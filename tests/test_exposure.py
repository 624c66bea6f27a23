"""Exposure, probed as an attacker would: foreign Host and Origin (DNS rebinding, cross-site posts),
hostile bodies and malformed HTTP (never a 5xx, never an error traceback in the log), poison text
(refused before it is acknowledged, never replayed after a restart).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.ops import client_faults
from tests.conftest import DaemonFactory, free_port
from tests.fakes.openai_provider import FakeProvider
from tests.support.procs import until

KEY = "sk-exposure-0123456789"
ADMIN_TOKEN = "admin-exposure-0123456789"


@pytest.fixture(autouse=True)
def _fresh_log_throttle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own first client-fault line (the throttle is per process)."""
    monkeypatch.setattr(client_faults, "_throttle", client_faults._Throttle())


async def _raw(port: int, request: bytes, timeout: float = 10) -> tuple[int, bytes]:
    """Send bytes as they are (no client library to tidy them up); (status, whole response)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    return int(data.split(b" ", 2)[1]), data


def _post(path: str, port: int, body: bytes, *, headers: bytes = b"", content_type: bytes = b"application/json",
          auth: bytes | None = KEY.encode()) -> bytes:
    head = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1:" + str(port).encode() + b"\r\n"
            b"Content-Type: " + content_type + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
            b"Connection: close\r\n" + (b"Authorization: Bearer " + auth + b"\r\n" if auth is not None else b"")
            + headers + b"\r\n")
    return head + body


def _no_error_records(caplog: pytest.LogCaptureFixture) -> None:
    bad = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records
           if r.levelno >= logging.ERROR or r.exc_info]
    assert bad == [], "client input produced error-level lines or tracebacks"


NESTED = b"[" * 100_000
CHAT = "/v1/chat/completions"


async def test_hostile_api_requests_get_a_clean_4xx_and_no_traceback(
        make_daemon: DaemonFactory, provider: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]}, media={"max_message_bytes": 1 << 20})
    port = daemon.config.http.port
    ok = b'{"messages": [{"role": "user", "content": "hi"}]}'
    probes: list[tuple[str, bytes, int]] = [
        ("100,000 nested [ (more values than any request holds)", _post(CHAT, port, NESTED), 413),
        ("nested content", _post(CHAT, port, b'{"messages": [{"role": "user", "content": ' + NESTED + b"}]}"), 413),
        ("2,000 nested [ (past the parser's depth)", _post(CHAT, port, b"[" * 2000 + b"]" * 2000), 400),
        ("charset=bogus", _post(CHAT, port, ok, content_type=b"application/json; charset=bogus"), 415),
        ("charset=rot13 (not a text codec)", _post(CHAT, port, ok, content_type=b"application/json; charset=rot13"),
         415),
        ("bytes that are not UTF-8", _post(CHAT, port, b'{"messages": "\xff\xfe"}'), 400),
        ("over the size limit", _post(CHAT, port, b'{"x": "' + b"a" * (6 << 20) + b'"}'), 413),
        ("a bearer with non-ASCII bytes", _post(CHAT, port, ok, auth=b"sk-\xff\xfe\xc3\x28"), 401),
        ("a bearer that is the key plus UTF-8", _post(CHAT, port, ok, auth=KEY.encode() + "é".encode()), 401),
        ("a session id with non-UTF-8 bytes", _post(CHAT, port, ok, headers=b"X-Session-Id: al\xffice\r\n"), 400),
        ("a lone surrogate in user", _post(CHAT, port, b'{"messages": [{"role": "user", "content": "hi"}], '
                                                       b'"user": "\\ud800"}'), 400),
        ("stream is not a boolean", _post(CHAT, port, b'{"messages": [{"role": "user", "content": "x"}], '
                                                      b'"stream": "yes"}'), 400),
        ("text parts that are not text", _post(CHAT, port, b'{"messages": [{"role": "user", "content": '
                                                           b'[{"type": "text", "text": 5}]}]}'), 400),
        ("a NUL in a header", _post(CHAT, port, ok, headers=b"X-Evil: a\x00b\r\n"), 400),
        ("Content-Length: -1", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
        ("not HTTP at all", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, 400),
    ]
    for what, request, expected in probes:
        status, response = await _raw(port, request)
        assert status == expected, f"{what}: {status} {response[:300]!r}"
    assert provider.connections == [], "hostile input reached the model"
    assert await daemon.store.unfinished_inbound() == []
    _no_error_records(caplog)
    assert any("client fault" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as resp:
        assert resp.status == 200  # and the listener is still fine


async def test_a_flood_of_bad_requests_is_a_few_log_lines(
        make_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    port = daemon.config.http.port
    loop = asyncio.get_running_loop()
    started = loop.time()
    for i in range(60):
        bad = _post(CHAT, port, NESTED) if i % 2 else _post(CHAT, port, b"{}", headers=b"X-A: \x00\r\n")
        assert (await _raw(port, bad))[0] == (413 if i % 2 else 400)
    elapsed = loop.time() - started
    lines = [r for r in caplog.records if "client fault" in r.getMessage()]
    print(f"60 bad requests in {elapsed:.2f} s: {len(lines)} log line(s)")
    assert 1 <= len(lines) <= 2 + elapsed / client_faults.LOG_EVERY_S, f"{len(lines)} lines in {elapsed:.1f} s"
    _no_error_records(caplog)


async def test_hostile_admin_requests_get_a_clean_4xx_and_no_traceback(
        make_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    daemon = await make_daemon(admin={"token": ADMIN_TOKEN})
    port = daemon.config.admin.port
    token = ADMIN_TOKEN.encode()
    probes: list[tuple[str, bytes, int]] = [
        ("login with a lone surrogate", _post("/admin/login", port, b'{"token": "\\ud800"}', auth=None), 400),
        ("login with a surrogate pair half", _post("/admin/login", port, b'{"token": "\\udcff\\ud83d"}', auth=None),
         400),
        ("login with charset=bogus", _post("/admin/login", port, b'{"token": "x"}', auth=None,
                                           content_type=b"application/json; charset=bogus"), 415),
        ("login nested", _post("/admin/login", port, NESTED, auth=None), 413),
        ("login not an object", _post("/admin/login", port, b'"token"', auth=None), 400),
        ("a bearer with non-ASCII bytes", b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                          b"Authorization: Bearer \xff\xfe\xfd\r\n\r\n", 401),
        ("a cookie with non-ASCII bytes", b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                          b"Cookie: switchboard_admin=\xc3\x28\xff\r\n\r\n", 401),
        ("stop nested", _post("/admin/api/sessions/stop", port, NESTED, auth=token), 413),
        ("stop with a key that is not text", _post("/admin/api/sessions/stop", port, b'{"key": 5}', auth=token), 400),
        ("a NUL in a header", _post("/admin/login", port, b"{}", auth=None, headers=b"X-A: \x00\r\n"), 400),
    ]
    for what, request, expected in probes:
        status, response = await _raw(port, request)
        assert status == expected, f"{what}: {status} {response[:300]!r}"
    status, _ = await _raw(port, _post("/admin/login", port, b'{"token": "' + token + b'"}', auth=None))
    assert status == 200  # the right token still signs in
    _no_error_records(caplog)


async def test_hostile_websocket_frames_are_refused_and_the_socket_lives_on(
        make_daemon: DaemonFactory, provider: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    provider.words = 1
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(base + "/"):
            pass
        ws = await http.ws_connect(base + "/ws", origin=base)
        await ws.receive_json()
        for hostile in ("[" * 100_000, '{"type": "message", "id": "n", "text": ' + "[" * 100_000 + "}",
                      '{"type": "message", "id": "d", "text": ' + "[" * 900 + "]" * 900 + "}"):
            await ws.send_str(hostile)
            reply = await asyncio.wait_for(ws.receive_json(), 10)
            assert reply["type"] in ("notice", "ack"), reply
            if reply["type"] == "notice":
                assert reply["kind"] == "error"
        await ws.send_str('{"type": "message", "id": "s1", "text": "bad \\ud800 text"}')
        while (frame := await asyncio.wait_for(ws.receive_json(), 10)).get("id") != "s1":
            pass  # the turn the 900-deep text started streams meanwhile
        assert frame == {"type": "ack", "id": "s1", "outcome": "rejected"}
        await ws.send_json({"type": "message", "id": "fine", "text": "still here?"})
        while not (frame := await asyncio.wait_for(ws.receive_json(), 10)).get("text", "").startswith(
                "reply to: still here?"):
            pass
        await ws.close()
    assert len(provider.requests_for("still here?")) == 1
    _no_error_records(caplog)


# --- Host and Origin --------------------------------------------------------------------------


async def _status(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> int:
    async with http.request(method, url, **kw) as resp:
        return resp.status


async def _ws_status(http: aiohttp.ClientSession, url: str, **kw: Any) -> int:
    try:
        ws = await http.ws_connect(url, **kw)
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status
    await ws.close()
    return 101


async def test_a_foreign_host_or_origin_is_refused_on_both_listeners(
        make_daemon: DaemonFactory, provider: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    """The DNS-rebinding shape: the attacker's name in Host (and Origin), the daemon's address underneath."""
    caplog.set_level(logging.INFO)
    provider.delay_s, provider.words = 0.05, 100
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    port, aport = daemon.config.http.port, daemon.config.admin.port
    base, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{aport}"
    evil = {"Host": "evil.example", "Origin": "http://evil.example"}
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(base + "/"):
            pass
        ws = await http.ws_connect(base + "/ws", origin=base)  # a running turn the attacker wants to stop
        await ws.receive_json()
        await ws.send_json({"type": "message", "id": "v", "text": "long one"})
        while (await asyncio.wait_for(ws.receive_json(), 10))["type"] != "message":
            pass
        victim = f"webchat:dm:{daemon.adapters['webchat'].session_id(next(c.value for c in http.cookie_jar))}"  # type: ignore[attr-defined]
        stop = {"key": victim}
        # Admin: rebinding (foreign Host) and cross-site posts (foreign Origin, "null") are refused.
        assert await _status(http, "POST", admin + "/admin/api/sessions/stop", json=stop, headers=evil) == 421
        assert await _status(http, "GET", admin + "/admin/api/sessions", headers={"Host": "evil.example"}) == 421
        assert await _status(http, "GET", admin + "/metrics", headers={"Host": "evil.example:8766"}) == 421
        for origin in ("http://evil.example", f"http://127.0.0.1:{aport + 1}", "null", f"file://127.0.0.1:{aport}"):
            status = await _status(http, "POST", admin + "/admin/api/sessions/stop", json=stop,
                                   headers={"Origin": origin})
            assert status == 403, origin
        assert daemon.router.status(victim).running, "a refused request stopped the turn"
        # The http listener: the page, the socket and the API.
        assert await _status(http, "GET", base + "/", headers={"Host": "evil.example"}) == 421
        assert await _ws_status(http, base + "/ws", headers=evil) == 421
        assert await _ws_status(http, base + "/ws", origin="http://evil.example") == 403
        assert await _ws_status(http, base + "/ws", origin="null") == 403
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert await _status(http, "POST", base + CHAT, json=chat,
                             headers={"Authorization": f"Bearer {KEY}", "Host": "evil.example"}) == 421
        # Probes need no name; names that are this machine's pass.
        assert await _status(http, "GET", base + "/healthz", headers={"Host": "evil.example"}) == 200
        for host in (f"localhost:{port}", f"LOCALHOST:{port}", f"app.localhost:{port}", f"[::1]:{port}",
                     f"10.1.2.3:{port}"):
            assert await _status(http, "GET", base + "/", headers={"Host": host}) == 200, host
        assert await _ws_status(http, base + "/ws", headers={"Host": f"localhost:{port}"},
                                origin=f"http://localhost:{port}") == 101
        # The operator's own same-origin stop still works.
        assert await _status(http, "POST", admin + "/admin/api/sessions/stop", json=stop, headers={
            "Origin": admin}) == 200
        await until(lambda: not daemon.router.status(victim).running, 10, "the operator's stop did not stop it")
        await ws.close()
    _no_error_records(caplog)


async def test_configured_names_are_served_and_each_listener_has_its_own(make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon(http={"allowed_hosts": ["chat.example.org", "*.example.net"]},
                               admin={"allowed_hosts": ["ops.example.org"]})
    base, admin = f"http://127.0.0.1:{daemon.config.http.port}", f"http://127.0.0.1:{daemon.config.admin.port}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(base + "/"):
            pass
        assert await _status(http, "GET", base + "/", headers={"Host": "chat.example.org"}) == 200
        assert await _status(http, "GET", base + "/", headers={"Host": "a.b.example.net"}) == 200
        assert await _status(http, "GET", base + "/", headers={"Host": "example.net.evil.example"}) == 421
        assert await _status(http, "GET", base + "/", headers={"Host": "ops.example.org"}) == 421
        # Behind a TLS proxy: the page's origin is https://chat.example.org, whatever Host the proxy sends.
        assert await _ws_status(http, base + "/ws", headers={"Host": "chat.example.org"},
                                origin="https://chat.example.org") == 101
        assert await _ws_status(http, base + "/ws", origin="https://chat.example.org") == 101
        assert await _ws_status(http, base + "/ws", origin="https://evil.example") == 403
        assert await _status(http, "GET", admin + "/admin/api/sessions", headers={"Host": "ops.example.org"}) == 200
        assert await _status(http, "GET", admin + "/admin/api/sessions", headers={"Host": "chat.example.org"}) == 421


# --- poison text ----------------------------------------------------------------------------------


async def test_text_that_cannot_be_stored_is_never_left_accepted_nor_replayed_after_a_restart(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    port = daemon.config.http.port
    base = f"http://127.0.0.1:{port}"
    poisons = [b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "metadata": {"session_id": "p1"}}',
               b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"session_id": "p\\udfff2"}}',
               b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc80"}]}], '
               b'"metadata": {"session_id": "p3"}}']
    for body in poisons:
        status, response = await _raw(port, _post(CHAT, port, body))
        assert status == 400 and b"not valid text" in response, response
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(base + "/"):
            pass
        ws = await http.ws_connect(base + "/ws", origin=base)
        await ws.receive_json()
        await ws.send_str('{"type": "message", "id": "w1", "text": "web \\ud800"}')
        await ws.send_str('{"type": "message", "id": "w\\ud8002", "text": "an id that is not text"}')
        frames = [await asyncio.wait_for(ws.receive_json(), 10) for _ in range(3)]
        await ws.close()
        assert {"type": "ack", "id": "w1", "outcome": "rejected"} in frames
        assert any(f["type"] == "notice" and f["kind"] == "error" and "could not read" in f["text"] for f in frames)
        # A good message on the same session, so the restart below has something it could replay.
        status, _ = await _raw(port, _post(CHAT, port, b'{"messages": [{"role": "user", "content": "fine"}], '
                                                       b'"metadata": {"session_id": "p1"}}'))
        assert status == 200
    assert await daemon.store.unfinished_inbound() == [], "a refused message was left accepted"
    requests = len(provider.connections)
    await daemon.stop()
    again = await make_daemon(api={"enabled": True, "keys": [KEY]})
    assert await again.store.unfinished_inbound() == []
    assert again.router.sessions() == [] or not any(s.running or s.queued for s in again.router.sessions())
    await asyncio.sleep(0.2)  # a replay would have reached the provider by now (recovery ran in start)
    assert len(provider.connections) == requests, "something was replayed after the restart"


def test_the_telegram_webhook_host_is_served_by_itself() -> None:
    from gateway.ops.config import load_config
    from gateway.ops.daemon import http_hosts

    config = load_config(None, {"SWITCHBOARD_TELEGRAM__TOKEN": "1:x", "SWITCHBOARD_TELEGRAM__MODE": "webhook",
                                "SWITCHBOARD_TELEGRAM__WEBHOOK_URL": "https://Bot.Example.test/tg",
                                "SWITCHBOARD_TELEGRAM__SECRET_TOKEN": "s3cret-token"})
    hosts = http_hosts(config)
    assert hosts.host_ok("bot.example.test") and not hosts.host_ok("example.test")


async def test_the_middleware_turns_what_a_naive_handler_trips_over_into_400_and_nothing_else() -> None:
    """The safety net under every route: a handler that parses carelessly still answers 400 to
    hostile input, while a bug of our own (a KeyError) stays a 500."""

    async def naive(request: web.Request) -> web.Response:
        body = json.loads(await request.text())  # no guard at all: RecursionError, LookupError
        return web.json_response({"keys": sorted(body)})

    async def buggy(_request: web.Request) -> web.Response:
        table: dict[str, int] = {}
        return web.json_response(table["not there"])  # KeyError: a LookupError, but ours

    app = web.Application(middlewares=[client_faults.client_faults])
    app.add_routes([web.post("/naive", naive), web.post("/buggy", buggy)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        assert (await _raw(port, _post("/naive", port, b'{"a": 1}')))[0] == 200
        assert (await _raw(port, _post("/naive", port, NESTED)))[0] == 400
        assert (await _raw(port, _post("/naive", port, b"{}", content_type=b"text/plain; charset=bogus")))[0] == 400
        assert (await _raw(port, _post("/buggy", port, b"{}")))[0] == 500
    finally:
        await runner.cleanup()
