"""What a message costs in Redis calls on a session its worker already owns, counted from Redis's
own MONITOR: with history in Redis, one call to accept the message (the id, the de-duplication
claim and the fenced record in one script) and the turn's record writes; with history in
PostgreSQL, no Redis call at all while the chat's messages come back to back."""

from __future__ import annotations

import asyncio
import collections
import threading
from pathlib import Path
from typing import Any

import aiohttp

from tests.fakes.openai_provider import FakeProvider
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, end_all, start_all

N = 20
SESSION = "round-trips"


class Monitor:
    """Every command Redis runs, from a MONITOR connection in a thread, until `stop`."""

    def __init__(self, server: RedisServer) -> None:
        self._client = server.client()
        self.commands: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)

    def _listen(self) -> None:
        with self._client.monitor() as m:
            self._ready.set()
            for cmd in m.listen():
                if cmd["command"].startswith("ECHO round-trips-done"):
                    return
                self.commands.append(cmd)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10)

    def stop(self) -> None:
        self._client.echo("round-trips-done")
        self._thread.join(10)
        self._client.close()

    def calls(self) -> collections.Counter[str]:
        """Commands a worker sent for the session or for its messages (not those run inside
        scripts), by name: what the session's messages cost in round trips at most."""
        out: collections.Counter[str] = collections.Counter()
        for cmd in self.commands:
            if cmd.get("client_type") == "lua":
                continue
            words = cmd["command"].split()
            if SESSION in cmd["command"] or words[:2] == ["INCR", "sb:inbound-ids"]:
                out[words[0] if words[0] != "ZADD" else "ZADD " + words[1]] += 1
        return out


async def _converse(worker: Worker, redis_server: RedisServer) -> collections.Counter[str]:
    async with aiohttp.ClientSession() as http:
        for i in range(3):  # the lease is taken, the session recovered, its first turns run
            status, _ = await worker.ask(http, SESSION, f"warm-up {i}")
            assert status == 200
        monitor = Monitor(redis_server)
        monitor.start()
        try:
            for i in range(N):
                status, _ = await worker.ask(http, SESSION, f"message {i}")
                assert status == 200
            await asyncio.sleep(0.1)  # the last turn's record (written just after its answer went out)
        finally:
            monitor.stop()
    return monitor.calls()


async def test_a_message_on_an_owned_session_costs_one_call_to_accept_it(
        provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    """History in Redis: one script accepts the message with its turn's start (no INCR before it,
    the user's row in the same script); the turn's end is the turn's own record write."""
    worker = Worker("w1", redis_server.url, provider.base_url, tmp_path, ttl_s=60)
    try:
        await start_all(worker)
        calls = await _converse(worker, redis_server)
    finally:
        end_all(worker)
    assert calls["INCR"] == 0, calls
    # Per message: the accept with the user's row (the turn starts), the answer's row with the outcome.
    assert calls["EVALSHA"] + calls["EVAL"] <= 2 * N, calls
    # The watch: listed at most once (the session was idle while the monitor started), never
    # unlisted and listed again while messages come back to back. The sessions index is written
    # by the record scripts themselves.
    assert calls["ZADD sb:leased"] <= 1 and calls["ZREM"] == 0, calls
    assert set(calls) <= {"EVALSHA", "EVAL", "ZADD sb:leased"}, calls


async def test_with_history_in_postgres_a_message_on_an_owned_session_costs_no_redis_call(
        provider: FakeProvider, redis_server: RedisServer, pg_url: str, tmp_path: Path) -> None:
    worker = Worker("w1", redis_server.url, provider.base_url, tmp_path, ttl_s=60, SWITCHBOARD_STORE__URL=pg_url)
    try:
        await start_all(worker)
        calls = await _converse(worker, redis_server)
    finally:
        end_all(worker)
    # At most the watch, once: the session was idle while the monitor started.
    assert sum(calls.values()) <= 1 and calls["ZADD sb:leased"] <= 1, calls
