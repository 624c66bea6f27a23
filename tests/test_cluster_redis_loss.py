"""Redis restarted empty under a running cluster: what was created once at start is made again,
and no message a platform was told is taken gets lost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from agent_cache import keys
from gateway.cluster.coordinator import Cluster
from gateway.core.metrics import Metrics
from gateway.store.redis import connect
from tests.conftest import RedisFactory
from tests.fakes.openai_provider import Connection, FakeProvider, Script
from tests.fakes.telegram_api import FakeTelegramAPI
from tests.support.cluster_events import Working
from tests.support.procs import until
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, content, end_all, start_all

TTL = 3.0
SECRET = "hook-secret-1"


def _env(fake: FakeTelegramAPI) -> dict[str, str]:
    settings = {"TOKEN": fake.token, "BASE_URL": fake.base_url, "BASE_FILE_URL": fake.base_file_url,
                "ACCESS": "open", "EDIT_INTERVAL_S": "0.05", "MODE": "webhook",
                "WEBHOOK_URL": "https://example.test/tg", "SECRET_TOKEN": SECRET}
    return {f"SWITCHBOARD_TELEGRAM__{key}": value for key, value in settings.items()}


def _answers(fake: FakeTelegramAPI, chat: int, text: str) -> list[str]:
    return [t for t in fake.messages(chat).values() if t.startswith(f"reply to: {text}")]


async def test_redis_restarted_empty_gets_its_inboxes_back_and_loses_no_forwarded_message(
        provider: FakeProvider, start_redis: RedisFactory, tmp_path: Path) -> None:
    provider.delay_s, provider.words = 0.0, 2
    redis = start_redis()  # no persistence: a restart comes back empty
    workers: list[Worker] = []
    try:
        async with FakeTelegramAPI() as fake:
            a, b = (Worker(name, redis.url, provider.base_url, tmp_path, ttl_s=TTL, **_env(fake)) for name in "ab")
            workers += [a, b]
            await start_all(a, b)

            async def post(worker: Worker, text: str) -> int:
                update = {"message": fake.user_message(42, user_id=42, text=text)}
                return await fake.post_webhook(worker.url + "/telegram/webhook", update, SECRET)

            assert await post(a, "first") == 200  # a owns the chat's session
            await until(lambda: bool(_answers(fake, 42, "first")), 10, "first never answered", every=0.05)
            redis.kill()
            redis.start()  # the same port, nothing in it: no leases, no inbox groups
            await until(lambda: "Redis lost its data" in a.log.read_text(), 3 * TTL, "a never noticed", every=0.1)
            await until(lambda: "Redis lost its data" in b.log.read_text(), 3 * TTL, "b never noticed", every=0.1)
            # a takes the session again (once the quarantine after the loss is over: the webhook
            # is answered 503 until then, and Telegram delivers it again); then b gets a message
            # for it and forwards it to a's inbox, whose consumer group Redis had lost.
            await until_taken(lambda: post(a, "second"), 4 * TTL)
            await until(lambda: bool(_answers(fake, 42, "second")), 10, "second never answered", every=0.05)
            status = await post(b, "third")
            await until(lambda: bool(_answers(fake, 42, "third")), 15, "the forwarded message was lost",
                        every=0.05)
            assert status == 200  # acknowledged only once the owner had it
            assert len(_answers(fake, 42, "third")) == 1
    finally:
        end_all(*workers)


async def until_taken(send: Callable[[], Awaitable[int]], timeout: float) -> list[int]:
    """Send until the worker takes it (200), as a platform or a client told 503 does; the statuses."""
    statuses: list[int] = []
    deadline = time.monotonic() + timeout
    while not statuses or statuses[-1] == 503:
        assert time.monotonic() < deadline, f"not taken within {timeout} s: {statuses}"
        if statuses:
            await asyncio.sleep(0.1)
        statuses.append(await send())
    assert statuses[-1] == 200, statuses
    return statuses


def _overlaps(conns: list[Connection]) -> list[tuple[str, str, float]]:
    """Pairs of provider streams (of one session) open at the same time, with the overlap in s."""
    spans = sorted((c.opened_at, c.ended_at if c.ended_at is not None else float("inf"), c.last_user)
                   for c in conns)
    return [(first[2], second[2], first[1] - second[0])
            for i, first in enumerate(spans) for second in spans[i + 1:] if second[0] < first[1]]


async def test_after_redis_restarts_empty_no_worker_runs_a_session_another_may_still_be_running(
        provider: FakeProvider, start_redis: RedisFactory, tmp_path: Path) -> None:
    """a is streaming a long answer for a session when Redis restarts empty; a message for that
    session then reaches b, which finds no lease in the empty Redis. b must not start a provider
    stream for the session before a has closed its own: a notices the loss within a look at the
    sentinel and stops its turn, and every worker refuses new acquisitions (503, retryable) for a
    lease TTL after it noticed, so a worker that noticed late has stopped by its own clock."""
    ttl = 6.0  # renewal rounds every 2 s: without the fix, a's turn runs on for up to that long
    provider.words = 2
    provider.by_text["long"] = Script(text=" ".join(f"w{i}" for i in range(600)), delay_s=0.05)  # 30 s
    redis = start_redis()  # no persistence: a restart comes back empty
    workers: list[Worker] = []
    try:
        async with aiohttp.ClientSession() as http:
            a, b = (Worker(name, redis.url, provider.base_url, tmp_path, ttl_s=ttl) for name in "ab")
            workers += [a, b]
            await start_all(a, b)
            long_turn = asyncio.ensure_future(a.ask(http, "s1", "long"))
            try:
                await until(lambda: any(c.words for c in provider.requests_for("long")), 10,
                            "a never started streaming", every=0.02)
                redis.kill()
                await asyncio.to_thread(redis.start)  # the same port, nothing in it; the provider keeps serving
                restarted = time.perf_counter()
                answers: list[tuple[int, str]] = []

                async def ask_b() -> int:
                    status, body = await b.ask(http, "s1", "second")
                    answers.append((status, content(body)))
                    return status

                statuses = await until_taken(ask_b, 5 * ttl)
                await asyncio.wait_for(long_turn, 15)  # a's client is answered (cut off), not left waiting
            finally:
                long_turn.cancel()
            assert answers[-1][1].startswith("reply to: second"), answers
            [long] = provider.requests_for("long")
            [second] = provider.requests_for("second")
            assert long.closed_at is not None and not long.completed  # a's turn was stopped
            assert _overlaps(provider.connections) == [], (_overlaps(provider.connections), statuses)
            noticed = long.closed_at - restarted
            waited = second.opened_at - restarted
            assert noticed < 1.0, f"a stopped its turn {noticed:.2f} s after the restart"
            assert waited >= ttl * 0.9, f"b ran the session {waited:.2f} s after the restart"
            print(f"a stopped its stream {noticed:.3f} s after Redis was back; b ran the session "
                  f"{waited:.2f} s after; b answered {statuses}")
    finally:
        end_all(*workers)


async def test_after_redis_restarts_empty_the_telegram_poller_stops_and_nobody_polls_during_the_quarantine(
        provider: FakeProvider, start_redis: RedisFactory, tmp_path: Path) -> None:
    """The poller's ingress lease is lost with Redis's data like a session's: its holder stops
    polling as soon as it notices, and nobody takes the lease for one TTL — a holder that has not
    noticed yet may still be polling, and two pollers of one bot cut each other off (409). Then
    polling resumes and a message sent meanwhile is answered."""
    ttl = 6.0
    provider.delay_s, provider.words = 0.0, 2
    redis = start_redis()  # no persistence: a restart comes back empty
    workers: list[Worker] = []
    try:
        async with FakeTelegramAPI() as fake:
            env = {**_env(fake), "SWITCHBOARD_TELEGRAM__MODE": "polling", "SWITCHBOARD_TELEGRAM__POLL_TIMEOUT_S": "1"}
            a, b = (Worker(name, redis.url, provider.base_url, tmp_path, ttl_s=ttl, **env) for name in "ab")
            workers += [a, b]
            await start_all(a, b)
            fake.push_text(42, "first", user_id=42)
            await until(lambda: bool(_answers(fake, 42, "first")), 15, "first never answered", every=0.05)
            redis.kill()
            await asyncio.to_thread(redis.start)  # the same port, nothing in it
            restarted = fake.clock()
            await until(lambda: all("Redis lost its data" in w.log.read_text() for w in (a, b)), 3 * ttl,
                        "a worker never noticed", every=0.1)
            fake.push_text(42, "second", user_id=42)
            await until(lambda: bool(_answers(fake, 42, "second")), 4 * ttl, "second never answered", every=0.05)
    finally:
        end_all(*workers)
    after = [p.time - restarted for p in fake.polls if p.time >= restarted]
    # A poll started before the holder noticed ends within its 1 s timeout; then none until the
    # quarantine (one TTL from when each worker noticed) is over.
    early = [round(t, 2) for t in after if 1.5 <= t < 0.9 * ttl]
    assert early == [], f"polled during the quarantine, at {early} s after the restart"
    assert [p.status for p in fake.polls if p.time >= restarted and p.status == 409] == []
    assert len(_answers(fake, 42, "second")) == 1


async def test_a_session_lost_at_renewal_just_before_the_data_loss_was_noticed_is_listed_again(
        redis_server: RedisServer) -> None:
    """Redis came back empty and a renewal round found the session's lease gone an instant before
    the sentinel look noticed why: the session had been dropped already, so the loss handling did
    not list it, and the wipe had taken its listing too — nobody adopted it, and its open turn
    stayed open for good (the chaos soak, PostgreSQL with --wipe, seed 2: 14 sessions)."""
    worker = Cluster(connect(redis_server.url, decode_responses=True), "w", ttl_s=TTL, metrics=Metrics())
    await worker.start(Working())
    client = redis_server.client()
    try:
        assert (await worker.route("api:dm:s1")).fence is not None
        client.delete(keys.lease("api:dm:s1"))  # the wipe, as the renewal round meets it first
        await worker.leases.renew_all()
        assert "api:dm:s1" not in worker.leases.held
        client.flushall()  # ... and the rest of it, which the sentinel look notices
        await worker.loss.lost()
        assert client.zscore(keys.leased(), "api:dm:s1") is not None, "the lost session is listed nowhere"
    finally:
        client.close()
        await worker.stop()
