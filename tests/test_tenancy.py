"""Tenancy, probed as a second client would: another API key's session id, another browser's cookie.

A key reaches only its own sessions (the provider's recorded requests prove what history a turn
was given); the web chat cookie opens a session but never names one (logs, the admin API and the
metrics are searched for it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.core.cancellation import ToolReason
from platforms.tenants import ApiKeys, key_id
from platforms.webchat_sessions import SECRET_FILE
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import until

K1, K2 = "sk-tenant-one-0123456789", "sk-tenant-two-9876543210"
API = {"enabled": True, "tenants": {"team-a": K1}, "keys": [K2]}  # one named key, one plain one
B = key_id(K2)  # the plain key's tenant name


def _url(daemon: Any, path: str = "/v1/chat/completions") -> str:
    return f"http://127.0.0.1:{daemon.config.http.port}{path}"


async def _ask(http: aiohttp.ClientSession, daemon: Any, key: str, text: str, *, session: str = "alice",
               via: str = "header") -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]}
    headers = {"Authorization": f"Bearer {key}"}
    if via == "header":
        headers["X-Session-Id"] = session
    else:
        body["metadata"] = {"session_id": session}
    async with http.post(_url(daemon), json=body, headers=headers) as resp:
        return resp.status, dict(await resp.json())


def _content(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["message"]["content"])


@pytest.mark.parametrize("via", ["header", "metadata"])
async def test_another_key_with_the_same_session_id_never_sees_the_first_keys_history(
        make_daemon: DaemonFactory, provider: FakeProvider, via: str) -> None:
    provider.words = 1
    daemon = await make_daemon(api=API)
    async with aiohttp.ClientSession() as http:
        assert (await _ask(http, daemon, K1, "my pin is 4711", via=via))[0] == 200
        assert (await _ask(http, daemon, K2, "what is my pin?", via=via))[0] == 200
        assert (await _ask(http, daemon, K1, "and again?", via=via))[0] == 200
    (k2_turn,) = provider.requests_for("what is my pin?")
    assert [m["content"] for m in k2_turn.body["messages"]] == ["what is my pin?"], "K2 was given K1's history"
    assert "4711" not in json.dumps(k2_turn.body)
    (k1_turn,) = provider.requests_for("and again?")
    assert k1_turn.body["messages"][0]["content"] == "my pin is 4711"  # K1 keeps its own
    assert "what is my pin?" not in json.dumps(k1_turn.body)
    _, a_rows = await daemon.store.conversation("api:dm:team-a/alice")
    _, b_rows = await daemon.store.conversation(f"api:dm:{B}/alice")
    assert [r.content for r in a_rows if r.role == "user"] == ["my pin is 4711", "and again?"]
    assert [r.content for r in b_rows if r.role == "user"] == ["what is my pin?"]
    assert await daemon.store.conversation("api:dm:alice") == (1, [])  # no shared, un-namespaced session
    # Token use is counted per tenant, by name: never by key.
    async with aiohttp.ClientSession() as http, http.get(
            f"http://127.0.0.1:{daemon.config.admin.port}/metrics") as resp:
        metrics = await resp.text()
    assert 'tenant="team-a"' in metrics and f'tenant="{B}"' in metrics
    assert K1 not in metrics and K2 not in metrics


async def test_another_keys_stop_status_and_new_cannot_touch_a_running_turn(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 40
    daemon = await make_daemon(api=API)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(30)) as http:
        running = asyncio.create_task(_ask(http, daemon, K1, "a long answer", via="metadata"))
        await until(lambda: daemon.router.status("api:dm:team-a/alice").running, 10, "K1's turn never started")
        for command in ("/stop", "/new", "/status"):
            status, answer = await _ask(http, daemon, K2, command, via="metadata")
            assert status == 200, command
            if command == "/stop":
                assert _content(answer) == "Nothing is running."
            if command == "/status":
                assert _content(answer).startswith("Idle"), "K2 sees K1's running turn"
        assert daemon.router.status("api:dm:team-a/alice").running
        status, answer = await asyncio.wait_for(running, 20)
    assert status == 200 and "switchboard" not in answer, f"K1's turn was interrupted: {answer.get('switchboard')}"
    assert _content(answer).endswith("w39 ")
    conversation, rows = await daemon.store.conversation("api:dm:team-a/alice")
    assert conversation == 1 and [r.role for r in rows] == ["user", "assistant"]  # K2's /new archived nothing
    # And the owner's own /stop still works on its own session.
    async with aiohttp.ClientSession() as http:
        assert _content((await _ask(http, daemon, K1, "/stop", via="metadata"))[1]) == "Nothing is running."


async def test_keys_and_tenants_are_checked_and_no_key_means_one_shared_namespace(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api=API)
    async with aiohttp.ClientSession() as http:
        for header in ({"Authorization": f"Bearer {K1}x"}, {"Authorization": f"bearer {K1[:-1]}"},
                       {"Authorization": "Basic Zm9vOmJhcg=="}, {}):
            async with http.get(_url(daemon, "/v1/models"), headers=header) as resp:
                assert resp.status == 401, header
        async with http.get(_url(daemon, "/v1/models"), headers={"Authorization": f"bearer {K1}"}) as resp:
            assert resp.status == 200  # the scheme is case-insensitive (RFC 9110)
        # A session id past the limit is refused, not made into a key of any length.
        status, answer = await _ask(http, daemon, K1, "hi", session="x" * 300, via="metadata")
        assert status == 400 and answer["error"]["param"] == "metadata"
    await daemon.stop()
    open_api = await make_daemon(api={"enabled": True})  # no keys: a single anonymous tenant, keys as before
    async with aiohttp.ClientSession() as http:
        assert (await _ask(http, open_api, "anything", "hello"))[0] == 200
    assert (await open_api.store.conversation("api:dm:alice"))[1][0].content == "hello"


def test_each_of_ten_thousand_keys_names_its_own_tenant_and_near_misses_name_none() -> None:
    keys = [f"sk-plain-{i:05d}-0123456789abcdef" for i in range(10_000)]
    table = ApiKeys(keys, {"team-a": K1})
    for key in (keys[0], keys[4_321], keys[-1]):
        assert table.tenant(f"Bearer {key}") == key_id(key)
    assert table.tenant(f"bearer {K1}") == "team-a"
    for guess in (K1[:-1], K1 + "x", K1.upper(), keys[7][:-1] + "g", "", "\udcff", f" {keys[7]}"):
        assert table.tenant(f"Bearer {guess}") is None, guess
    assert table.tenant(f"Basic {keys[7]}") is None and table.tenant("") is None
    assert ApiKeys().tenant("") == "" and not ApiKeys().required  # no keys: the one anonymous tenant


# --- the web chat cookie is a credential, not an identifier ---------------------------------------


def _browser() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def _frames_until(ws: aiohttp.ClientWebSocketResponse, pred: Any) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    while True:
        frame = await asyncio.wait_for(ws.receive_json(), 10)
        seen.append(frame)
        if pred(frame):
            return seen


async def test_the_cookie_never_appears_in_keys_logs_metrics_or_the_admin_api(
        make_daemon: DaemonFactory, provider: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    provider.delay_s, provider.words = 0.02, 30
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    admin = f"http://127.0.0.1:{daemon.config.admin.port}"
    async with _browser() as victim, aiohttp.ClientSession() as op:
        async with victim.get(base + "/") as resp:
            set_cookie = resp.headers["Set-Cookie"]
        cookie = next(c.value for c in victim.cookie_jar if c.key == "switchboard_chat")
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
        ws = await victim.ws_connect(base + "/ws", origin=base)
        await ws.receive_json()
        await ws.send_json({"type": "message", "id": "m1", "text": "the secret plan"})
        await _frames_until(ws, lambda f: f["type"] == "message")
        await ws.send_json({"type": "command", "name": "stop"})
        await _frames_until(ws, lambda f: f == {"type": "state", "running": False})
        await ws.send_json({"type": "command", "name": "status"})
        await _frames_until(ws, lambda f: f["type"] == "notice" and "agent" in f["text"])
        async with op.get(admin + "/admin/api/sessions") as resp:
            table = await resp.text()
        async with op.get(admin + "/metrics") as resp:
            metrics = await resp.text()
        await ws.close()
    sid = daemon.adapters["webchat"].session_id(cookie)  # type: ignore[attr-defined]
    assert sid != cookie and len(sid) == 32
    key = f"webchat:dm:{sid}"
    assert (await daemon.store.conversation(key))[1][0].content == "the secret plan"
    assert key in table  # the operator sees the session, by its derived id
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    for where, text in (("the log", logged), ("the admin sessions list", table), ("/metrics", metrics)):
        assert cookie not in text, f"the cookie value appears in {where}"
    assert await daemon.store.sessions(limit=50), "no sessions to check"
    assert all(cookie not in s.key for s in await daemon.store.sessions(limit=50))


async def test_the_cookie_is_secure_when_the_page_is_served_over_https(make_daemon: DaemonFactory) -> None:
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with aiohttp.ClientSession() as http:  # no cookie jar of note: every request is a new browser
        for headers, secure in (({}, False), ({"X-Forwarded-Proto": "https"}, True),
                                ({"Forwarded": "for=1.2.3.4;proto=https"}, True),
                                ({"X-Forwarded-Proto": "http"}, False)):
            async with http.get(base + "/", headers=headers) as resp:
                cookie = resp.headers["Set-Cookie"]
            assert ("; Secure" in cookie) is secure, (headers, cookie)
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
            http.cookie_jar.clear()


async def test_a_session_id_sent_back_as_a_cookie_opens_nothing(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    admin = f"http://127.0.0.1:{daemon.config.admin.port}"
    async with _browser() as victim:
        async with victim.get(base + "/"):
            pass
        ws = await victim.ws_connect(base + "/ws", origin=base)
        await ws.receive_json()
        await ws.send_json({"type": "message", "id": "v1", "text": "private words"})
        await _frames_until(ws, lambda f: f == {"type": "state", "running": False})
        await ws.close()
    async with aiohttp.ClientSession() as attacker:  # learns every session id from the console
        async with attacker.get(admin + "/admin/api/sessions") as resp:
            (row,) = [r for r in (await resp.json())["sessions"] if r["platform"] == "webchat"]
        ws = await attacker.ws_connect(base + "/ws", origin=base,
                                       headers={"Cookie": f"switchboard_chat={row['chat']}"})
        hello = await ws.receive_json()
        await ws.close()
    assert hello["history"] == [], "a session id opened the session it names"


async def test_the_server_secret_survives_a_restart_and_is_private(
        make_daemon: DaemonFactory, provider: FakeProvider, tmp_path: Path) -> None:
    provider.words = 1
    daemon = await make_daemon()
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    async with _browser() as http:
        async with http.get(base + "/"):
            pass
        cookie = next(c.value for c in http.cookie_jar if c.key == "switchboard_chat")
        ws = await http.ws_connect(base + "/ws", origin=base)
        await ws.receive_json()
        await ws.send_json({"type": "message", "id": "r1", "text": "remember me"})
        await _frames_until(ws, lambda f: f == {"type": "state", "running": False})
        await ws.close()
    await daemon.stop()
    secret = tmp_path / "data" / SECRET_FILE
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    again = await make_daemon()
    base = f"http://127.0.0.1:{again.config.http.port}"
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(base + "/ws", origin=base, headers={"Cookie": f"switchboard_chat={cookie}"})
        hello = await ws.receive_json()
        await ws.close()
    assert hello["history"][0]["text"] == "remember me"
    # A configured secret wins over the file (and, being another key, opens other sessions).
    await again.stop()
    configured = await make_daemon(webchat={"session_secret": "a-configured-webchat-secret-0123456789"})
    assert configured.adapters["webchat"].session_id(cookie) != again.adapters["webchat"].session_id(cookie)  # type: ignore[attr-defined]


async def test_cluster_workers_share_one_webchat_secret_through_redis(
        make_daemon: DaemonFactory, redis_server: Any, tmp_path: Path) -> None:
    """A browser's next connection may reach another worker: every worker must derive the same id."""
    workers = [await make_daemon(redis={"url": redis_server.url}, cluster={"worker_id": f"w{i}"},
                                 webchat={"enabled": True}, store={"data_dir": str(tmp_path / f"w{i}")})
               for i in (1, 2)]
    cookie = "c" * 32
    ids = {w.adapters["webchat"].session_id(cookie) for w in workers}  # type: ignore[attr-defined]
    assert len(ids) == 1, "two workers name one browser's session differently"
    assert not any((tmp_path / f"w{i}" / SECRET_FILE).exists() for i in (1, 2))  # it lives in Redis


# --- issue 31: tenants cannot take what another one needs -----------------------------------------


async def _flood(http: aiohttp.ClientSession, daemon: Any, key: str, count: int,
                 text: str = "a long one") -> list[asyncio.Task[tuple[int, dict[str, Any], str | None]]]:
    """`count` requests of one tenant, each in a session of its own, all at once."""
    async def one(i: int) -> tuple[int, dict[str, Any], str | None]:
        body = {"messages": [{"role": "user", "content": f"{text} {i}"}], "metadata": {"session_id": f"{text}-{i}"}}
        async with http.post(_url(daemon), json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, dict(await resp.json()), resp.headers.get("Retry-After")

    return [asyncio.create_task(one(i)) for i in range(count)]


async def _end(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_flood_of_new_sessions_from_one_tenant_leaves_another_tenants_answer_whole(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """Finding 1 as it was found, with the shipped defaults (256 agent slots): tenant A streams a
    long answer; tenant B starts 255 long turns in 255 new sessions, then one more. A's answer was
    cut ("evicted from agent cache"); now it is whole, and B hears 429 with Retry-After past its
    turns in flight."""
    provider.delay_s, provider.words = 0.2, 60  # B's turns: 12 s each
    provider.by_text["the victim's answer"] = Script(delay_s=0.1)  # A's: 6 s
    daemon = await make_daemon(api=API)

    def landed() -> bool:  # every turn of B's running, or refused
        running = sum(s.running for s in daemon.router.sessions())
        return running + sum(t.done() for t in flood) >= 256

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(60)) as http:
        victim = asyncio.create_task(_ask(http, daemon, K1, "the victim's answer", via="metadata"))
        await until(lambda: daemon.router.status("api:dm:team-a/alice").running, 10, "A's turn never started")
        flood = await _flood(http, daemon, K2, 255)
        try:
            await until(landed, 30, "B's turns neither ran nor were refused")
            flood += await _flood(http, daemon, K2, 1, "one more")
            status, answer = await asyncio.wait_for(victim, 30)
            assert status == 200 and "switchboard" not in answer, f"A's answer was cut: {answer.get('switchboard')}"
            assert _content(answer).endswith("w59 ")
            refused = [t.result() for t in flood if t.done()]
            assert len(refused) == 256 - 128 and all(status == 429 and retry is not None and int(retry) >= 1
                                                    for status, _, retry in refused), refused[:3]
            assert "at once (128)" in refused[0][1]["error"]["message"]
        finally:
            await _end(flood)


async def test_a_full_agent_cache_evicts_a_running_turn_of_the_same_tenant_only(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """The cache's own rule, with the quotas off: when every slot runs a turn, a new session of
    tenant B cuts B's oldest running turn, never tenant A's."""
    provider.delay_s, provider.words = 0.05, 100
    daemon = await make_daemon(api=API, agent_cache={"max_agents": 4},
                               quotas={"running_turns": 0, "live_sessions": 0})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(60)) as http:
        victim = asyncio.create_task(_ask(http, daemon, K1, "the victim's answer", via="metadata"))
        await until(lambda: daemon.router.status("api:dm:team-a/alice").running, 10, "A's turn never started")
        first = await _flood(http, daemon, K2, 3, "b first")
        last: list[asyncio.Task[tuple[int, dict[str, Any], str | None]]] = []
        try:
            await until(lambda: sum(s.running for s in daemon.router.sessions()) == 4, 10, "B's turns did not start")
            last = await _flood(http, daemon, K2, 1, "b last")
            status, answer = await asyncio.wait_for(victim, 30)
            assert status == 200 and "switchboard" not in answer, f"A's answer was cut: {answer.get('switchboard')}"
            # B's first three end one way or the other: exactly one of them made room (cut, with
            # the cache's reason), the others ran to their end.
            ends = await asyncio.wait_for(asyncio.gather(*first), 30)
            reasons = sorted(body.get("switchboard", {}).get("reason") or "" for _, body, _ in ends)
            assert reasons == ["", "", "evicted from agent cache"], reasons
            assert (await asyncio.wait_for(last[0], 30))[0] == 200
        finally:
            await _end(first + last)


async def _post(http: aiohttp.ClientSession, daemon: Any, key: str, text: str,
                session: str | None = None) -> tuple[int, dict[str, Any], str | None]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]}
    if session is not None:
        body["metadata"] = {"session_id": session}
    async with http.post(_url(daemon), json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, dict(await resp.json()), resp.headers.get("Retry-After")


async def test_a_rate_limit_answers_429_with_retry_after(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """Finding 5, first half: over the limit, the API answered 400 without Retry-After."""
    provider.words = 1
    daemon = await make_daemon(api=API, router={"messages_per_minute": 3})
    async with aiohttp.ClientSession() as http:
        for i in range(3):
            assert (await _post(http, daemon, K2, f"m{i}", "s1"))[0] == 200
        status, body, retry = await _post(http, daemon, K2, "m3", "s1")
        assert status == 429 and retry is not None and 1 <= int(retry) <= 60, (status, body)
        # The first refusal in a minute tells the user (the notice); later ones say why (the reason).
        assert body["error"]["type"] == "rate_limit_exceeded" and "(3 a minute)" in body["error"]["message"]
        status, answer, _ = await _post(http, daemon, K2, "/stop", "s1")  # commands get through
        assert status == 200 and _content(answer) == "Nothing is running."


async def test_a_tenants_rate_counts_every_session_stateless_requests_and_commands_but_not_stop(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """Finding 5, second half: the limit counted per session, so a new session id reset it, and
    stateless requests and commands were never counted. `/stop` still gets through."""
    provider.words = 1
    daemon = await make_daemon(api=API, quotas={"messages_per_minute": 4})
    async with aiohttp.ClientSession() as http:
        assert (await _post(http, daemon, K2, "x", "s1"))[0] == 200
        assert (await _post(http, daemon, K2, "y", "s2"))[0] == 200
        assert (await _post(http, daemon, K2, "stateless"))[0] == 200
        assert (await _post(http, daemon, K2, "/status", "s3"))[0] == 200  # the fourth: the minute is full
        for text, session in (("a new session", "s4"), ("stateless again", None), ("/status", "s5"),
                              ("/new", "s6")):
            status, answer, retry = await _post(http, daemon, K2, text, session)
            assert status == 429 and retry is not None, (text, status, answer)
            assert "4 a minute" in answer["error"]["message"] or "4 messages a minute" in answer["error"]["message"]
        status, answer, _ = await _post(http, daemon, K2, "/stop", "s1")
        assert status == 200 and _content(answer) == "Nothing is running."
        assert (await _post(http, daemon, K1, "tenant A is fine", "s1"))[0] == 200


async def test_response_and_job_ids_tell_a_tenant_nothing_of_another_tenants_traffic(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """Finding 8: response ids were a per-process prefix and one global counter, so tenant B read
    tenant A's exact request count between two of its own; job ids were one global counter too."""
    provider.words = 1
    daemon = await make_daemon(api=API, tools={"shell": True})
    start_job = Script(tool_calls=[("shell", {"command": "sleep 30", "background": True})])
    async with aiohttp.ClientSession() as http:
        _, first = await _ask(http, daemon, K2, "b's first", session="b1")
        for i in range(5):
            await _ask(http, daemon, K1, f"a's {i}", session="a1")
        provider.then(start_job)  # the next request is answered with this tool call, once
        assert (await _ask(http, daemon, K1, "start a job for a", session="a1"))[0] == 200
        _, second = await _ask(http, daemon, K2, "b's second", session="b1")
        provider.then(start_job)
        assert (await _ask(http, daemon, K2, "start a job for b", session="b1"))[0] == 200
    ids = [first["id"], second["id"]]
    assert all(i.startswith("chatcmpl-") and len(i) == len("chatcmpl-") + 32 for i in ids)
    a, b = (i.removeprefix("chatcmpl-") for i in ids)
    common = next((n for n, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    assert common < 6, f"two ids share a {common}-digit prefix: {ids}"  # one of a million by chance
    (b_job,) = {t["content"] for c in provider.connections if c.last_user == "start a job for b"
                for t in c.body["messages"] if t["role"] == "tool"}
    assert b_job.startswith("[started in background: job j1]"), b_job  # A's job is not counted
    for key in ("api:dm:team-a/a1", f"api:dm:{B}/b1"):
        for job in daemon.jobs.jobs(key):
            job.kill(ToolReason.system("test over"))


def test_an_mcp_server_limited_to_a_tenant_is_in_that_tenants_status() -> None:
    """Finding 10: a server limited by `allow_tenants` was missing from its own tenant's /status."""
    from gateway.agents.mcp_config import McpServerConfig
    from gateway.agents.mcp_servers import McpHub
    from gateway.agents.processes import ProcessReaper

    hub = McpHub.build([McpServerConfig(name="files", url="http://127.0.0.1:9/mcp", allow_tenants=["team-a"])],
                       ProcessReaper(), max_output=100)  # never started: only its status line is asked for
    line = hub.status_line("api:dm:team-a/alice")
    assert line is not None and line.startswith("MCP: files")
    assert hub.status_line(f"api:dm:{B}/alice") is None and hub.status_line("webchat:dm:team-a/x") is None


def _image_request(text: str, images: int, size: int, session: str | None) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for _ in range(images):
        png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + os.urandom(size)).decode()
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}})
    body: dict[str, Any] = {"messages": [{"role": "user", "content": parts}]}
    return body if session is None else {**body, "metadata": {"session_id": session}}


async def test_media_on_disk_is_held_to_each_tenants_quota_and_stateless_requests_keep_none(
        make_daemon: DaemonFactory, provider: FakeProvider, tmp_path: Path) -> None:
    """Finding 6: 30 stateless requests with nine unique 2 MB images each wrote 527 MB to the media
    folder in 40 s, kept 72 h, with no quota per tenant."""
    provider.words = 1
    daemon = await make_daemon(api=API, agent={"vision": True}, quotas={"media_mb": 2})
    media = tmp_path / "data" / "media"

    def kept() -> int:
        return sum(f.stat().st_size for f in media.glob("**/*") if f.is_file())

    async with aiohttp.ClientSession() as http:
        async def send(key: str, body: dict[str, Any]) -> None:
            async with http.post(_url(daemon), json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
                assert resp.status == 200, await resp.text()

        await send(K1, _image_request("a's picture", 1, 200_000, "a1"))
        a_kept = kept()
        assert 200_000 < a_kept < 300_000  # A's session keeps its copy for a replay
        for i in range(6):  # B: stateless, three unique images each
            await send(K2, _image_request(f"stateless {i}", 3, 200_000, None))
        assert kept() == a_kept, "a stateless request kept copies nothing will replay"
        for i in range(15):  # B: a session, 3 MB of unique images in all
            await send(K2, _image_request(f"session {i}", 1, 200_000, "b1"))
    assert kept() - a_kept <= 2 * 1024 * 1024, f"B keeps {kept() - a_kept} bytes, over its 2 MB"
    assert kept() - a_kept > 1_500_000  # ...and its newest copies are there
    # A's copy survived B's flood:
    folders = [f for f in media.iterdir() if f.is_dir()]
    assert len(folders) == 2 and any(200_000 < sum(x.stat().st_size for x in f.iterdir()) < 300_000 for f in folders)
