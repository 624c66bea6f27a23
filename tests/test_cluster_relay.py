"""Any worker takes any message: a client connected to one worker, its session owned by another,
gets the owner's turn relayed — its text, its end, its stop — as if it were talking to the owner."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent_cache import keys
from tests.fakes.openai_provider import FakeProvider
from tests.support.procs import until
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, content, end_all, start_all

TTL = 3.0


@pytest.fixture
async def workers(redis_server: RedisServer, provider: FakeProvider, tmp_path: Path) -> AsyncIterator[Any]:
    started: list[Worker] = []

    async def make(n: int) -> list[Worker]:
        new = [Worker(f"w{len(started) + i + 1}", redis_server.url, provider.base_url, tmp_path, ttl_s=TTL)
               for i in range(n)]
        started.extend(new)  # before the start: ended at teardown whatever happens
        await start_all(*new)
        return new

    try:
        yield make
    finally:
        end_all(*started)


async def _stream(http: aiohttp.ClientSession, worker: Worker, session: str,
                  text: str) -> tuple[int, str, dict[str, Any]]:
    """A streamed completion: (status, the text streamed, the last chunk with a finish_reason)."""
    body = {"messages": [{"role": "user", "content": text}], "stream": True}
    async with http.post(worker.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session},
                         timeout=aiohttp.ClientTimeout(60)) as resp:
        if resp.status != 200:
            return resp.status, await resp.text(), {}
        streamed, final = "", {}
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                streamed += chunk["choices"][0]["delta"].get("content") or ""
                if chunk["choices"][0]["finish_reason"]:
                    final = chunk
        return resp.status, streamed, final


async def test_an_api_request_to_a_worker_that_does_not_own_the_session_is_answered_through_the_owner(
        workers: Any, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 5
    a, b = await workers(2)
    async with aiohttp.ClientSession() as http:
        status, body = await a.ask(http, "s1", "first")  # a owns s1 now
        assert status == 200 and content(body).startswith("reply to: first")
        status, body = await b.ask(http, "s1", "second")  # b does not: the turn runs on a, relayed
        assert status == 200, body
        assert content(body).startswith("reply to: second")
        status, streamed, final = await _stream(http, b, "s1", "third")
        assert status == 200 and streamed.startswith("reply to: third"), streamed
        assert final["choices"][0]["finish_reason"] == "stop"
    # One session, one owner: every turn ran on a, in order, with the whole history.
    requests = [provider.requests_for(t)[0] for t in ("first", "second", "third")]
    users = [m["content"] for m in requests[-1].body["messages"] if m["role"] == "user"]
    assert users == ["first", "second", "third"]


async def test_stop_and_disconnect_through_the_relaying_worker_reach_the_owners_run(
        workers: Any, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 400
    a, b = await workers(2)
    async with aiohttp.ClientSession() as http:
        assert (await a.ask(http, "s2", "hello"))[0] == 200  # a owns s2
        # A streamed request through b, stopped through b.
        streaming = asyncio.create_task(_stream(http, b, "s2", "long one"))
        await until(lambda: any(c.words >= 3 for c in provider.requests_for("long one")), 10,
                    "the owner never streamed")
        status, body = await b.ask(http, "s2", "/stop")
        assert (status, content(body)) == (200, "Stopped.")
        status, streamed, final = await asyncio.wait_for(streaming, 10)
        assert status == 200 and final["switchboard"]["interrupted_by"] == "user", final
        assert streamed.startswith("reply to:")  # what the owner streamed before the stop came through
        conn = provider.requests_for("long one")[0]
        await provider.wait_closed(conn)
        assert not conn.completed
        # A request through b whose client hangs up: the owner's provider connection is closed.
        gone = asyncio.create_task(b.ask(http, "s2", "left behind"))
        await until(lambda: bool(provider.requests_for("left behind")), 10, "the owner never asked the provider")
        gone.cancel()
        conn = provider.requests_for("left behind")[0]
        await asyncio.wait_for(provider.wait_closed(conn), 10)
        assert not conn.completed


async def test_every_workers_console_shows_the_real_owner_and_stops_the_turn_where_it_runs(
        workers: Any, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 400
    a, b = await workers(2)
    key = "api:dm:s3"

    async def table(w: Worker) -> dict[str, Any]:
        async with http.get(f"http://127.0.0.1:{w.admin_port}/admin/api/sessions") as resp:
            assert resp.status == 200
            return {row["key"]: row for row in (await resp.json())["sessions"]}

    async with aiohttp.ClientSession() as http:
        asking = asyncio.create_task(a.ask(http, "s3", "a long answer"))
        await until(lambda: bool(provider.requests_for("a long answer")), 10, "the owner never asked the provider")
        for w in (a, b):  # the same truth from either console
            row = (await table(w))[key]
            assert (row["state"], row["worker"]) == ("running", a.worker_id), (w.worker_id, row)
        async with http.post(f"http://127.0.0.1:{b.admin_port}/admin/api/sessions/stop", json={"key": key}) as resp:
            assert await resp.json() == {"key": key, "stopped": True, "worker": a.worker_id}
        status, body = await asyncio.wait_for(asking, 10)
    assert status == 200 and body["switchboard"]["reason"] == "stopped by operator", body


async def test_a_relayed_message_claimed_from_a_dead_owners_inbox_is_answered_through_whoever_ran_it(
        workers: Any, provider: FakeProvider) -> None:
    """The owner dies just before its inbox is read; another worker claims the message from the
    dead owner's inbox and runs it. The relaying worker watched the dead owner, not the worker
    that ran the turn, and told its client "the worker running this conversation stopped; please
    try again" while the answer streamed, and was recorded, elsewhere."""
    from tests.fakes.openai_provider import Script

    a, b, _c = await workers(3)  # c: another worker that may claim the message
    words = " ".join(f"w{i}" for i in range(300))
    provider.by_text["slow one"] = Script(text=words, delay_s=0.05)  # 15 s: streaming when a dead owner is given up
    async with aiohttp.ClientSession() as http:
        assert (await a.ask(http, "r", "hello"))[0] == 200  # a owns r
        a.kill()  # its heartbeat key outlives it by up to a TTL: b still forwards to it
        statuses: list[int] = []
        deadline = time.monotonic() + 10 * TTL
        while not statuses or statuses[-1] == 503:  # as the SDKs do: a 503 is tried again
            assert time.monotonic() < deadline, statuses
            status, body = await b.ask(http, "r", "slow one")
            statuses.append(status)
            await asyncio.sleep(0.2 if status == 503 else 0)
    assert statuses[-1] == 200, (statuses, body)
    assert content(body).rstrip() == words
    # Told "try again" only while nothing ran it: it ran once, whole, and nobody was told otherwise.
    assert [conn.completed for conn in provider.requests_for("slow one")] == [True], statuses


async def test_a_relay_that_reaches_a_worker_the_session_has_left_goes_again_from_its_clients_worker(
        workers: Any, provider: FakeProvider, redis_server: RedisServer) -> None:
    """A relays a request to B, the owner it found; before B reads it, the session moves to C.
    B relayed it on to C, so the turn ran on C while A watched B: when B then stopped, A told its
    client "the worker running this conversation stopped; please try again" and C answered it
    whole. A relay never chains: B answers that the session moved, and A relays it to C itself."""
    from tests.fakes.openai_provider import Script

    a, b, c = await workers(3)
    r = redis_server.client()
    words = " ".join(f"w{i}" for i in range(300))
    provider.by_text["slow one"] = Script(text=words, delay_s=0.05)  # 15 s: streaming when B stops
    async with aiohttp.ClientSession() as http:
        assert (await b.ask(http, "r", "hello"))[0] == 200  # b owns r
        b.signal(signal.SIGSTOP)
        try:
            r.pexpire(keys.worker_alive(b.worker_id), 60_000)  # b still looks alive: a relays to it
            asking = asyncio.create_task(_stream(http, a, "r", "slow one"))
            await until(lambda: r.xlen(keys.worker_inbox(b.worker_id)) > 0, 10, "a never relayed to b")
            await until(lambda: not r.exists(keys.lease("api:dm:r")), 10, "b's lease never lapsed")
            assert (await c.ask(http, "r", "moved"))[0] == 200  # c owns r now
        finally:
            b.signal(signal.SIGCONT)
        await until(lambda: bool(provider.requests_for("slow one")), 15, "the relayed request never ran")
        b.signal(signal.SIGSTOP)  # b stops for good while the turn streams on c
        try:
            r.delete(keys.worker_alive(b.worker_id))
            status, streamed, final = await asking
        finally:
            b.signal(signal.SIGCONT)
    assert status == 200, streamed
    assert streamed.rstrip() == words and final["choices"][0]["finish_reason"] == "stop"
    assert [conn.completed for conn in provider.requests_for("slow one")] == [True]
