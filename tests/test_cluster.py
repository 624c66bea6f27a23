"""Several real worker processes sharing one real redis-server: one owner per session."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_cache import keys
from gateway.store.redis import RedisStore
from platforms.telegram_draft import STATUS_TEXT
from tests.conftest import RedisFactory
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import child_running, running, until
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, content, end_all, start_all

TTL = 3.0
WEBHOOK = {"MODE": "webhook", "WEBHOOK_URL": "https://example.test/tg", "SECRET_TOKEN": "hook-secret-1"}


def _telegram_env(fake: Any, **telegram: str) -> dict[str, str]:
    """Worker environment for a Telegram bot on the fake Bot API (anyone may talk to it)."""
    settings = {"TOKEN": fake.token, "BASE_URL": fake.base_url, "BASE_FILE_URL": fake.base_file_url,
                "ACCESS": "open", "EDIT_INTERVAL_S": "0.05", **telegram}
    return {f"SWITCHBOARD_TELEGRAM__{key}": value for key, value in settings.items()}


@pytest.fixture
async def workers(redis_server: RedisServer, provider: FakeProvider, tmp_path: Path) -> AsyncIterator[list[Worker]]:
    started: list[Worker] = []

    async def make(n: int, redis: RedisServer = redis_server) -> list[Worker]:
        new = [Worker(f"w{len(started) + i + 1}", redis.url, provider.base_url, tmp_path, ttl_s=TTL)
               for i in range(n)]
        started.extend(new)  # before the start: ended at teardown whatever happens
        await start_all(*new)
        return new

    try:
        yield make  # type: ignore[misc]
    finally:
        end_all(*started)


async def _transcript(redis_server: RedisServer, session: str, rows: int) -> list[tuple[str, str, str | None]]:
    """The session's transcript once it has `rows` rows (an HTTP answer goes out just before the
    turn's rows are written), or as it is after 30 s."""
    store = RedisStore(redis_server.url)
    await store.open()
    try:
        deadline = time.monotonic() + 30
        while True:
            _, found = await store.conversation(session)
            if len(found) >= rows or time.monotonic() > deadline:
                return [(m.role, m.content, m.reason) for m in found]
            await asyncio.sleep(0.05)
    finally:
        await store.close()


@pytest.mark.parametrize("redis_kind", ["single", "cluster"])
async def test_stop_sent_to_another_worker_reaches_the_owners_turn(workers: Any, provider: FakeProvider,
                                                                  start_redis: RedisFactory, redis_kind: str) -> None:
    provider.delay_s, provider.words = 0.05, 200
    if redis_kind == "cluster":  # the same code on Redis Cluster (a one-node cluster owning every slot)
        a, b = await workers(2, start_redis("redis-cluster", cluster=True))
    else:
        a, b = await workers(2)
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(a.ask(http, "s1", "long answer"))
        await until(lambda: bool(provider.requests_for("long answer")), 10, "the owner never asked the provider")
        status, body = await b.ask(http, "s1", "/stop")
        assert (status, content(body)) == (200, "Stopped.")
        status, body = await asyncio.wait_for(first, 5)
    assert body["switchboard"].items() >= {"interrupted_by": "user", "reason": "stopped by user (/stop)"}.items()
    conn = provider.requests_for("long answer")[0]
    await provider.wait_closed(conn)
    assert not conn.completed


async def test_a_killed_owner_is_taken_over_within_the_ttl_and_nothing_is_lost(
        workers: Any, provider: FakeProvider, redis_server: RedisServer) -> None:
    provider.delay_s, provider.words = 0.05, 400
    a, b = await workers(2)
    async with aiohttp.ClientSession() as http:
        pending = asyncio.create_task(a.ask(http, "s2", "first question"))
        await until(lambda: bool(provider.requests_for("first question")), 10, "the owner never asked the provider")
        a.kill()  # kill -9 mid-turn
        killed = time.monotonic()
        with pytest.raises(aiohttp.ClientError):
            await pending
        provider.delay_s, provider.words = 0.0, 3
        while True:
            status, body = await b.ask(http, "s2", "second question")
            if status == 200:
                break
            # Until its lease lapses, the session is a's: "not now, retry" — never a refusal.
            assert status == 503 and "taken over" in content(body), (status, body)
            assert time.monotonic() - killed < TTL + 2, "no takeover within TTL + 2 s"
            await asyncio.sleep(0.2)
    assert time.monotonic() - killed < TTL + 2
    assert content(body).startswith("reply to: second question")
    assert len(provider.requests_for("second question")) == 1
    assert await _transcript(redis_server, "api:dm:s2", 4) == [
        ("user", "first question", None),
        ("assistant", "", "worker stopped responding; session taken over"),
        ("user", "second question", None),
        ("assistant", content(body), None)]


async def test_a_paused_owner_that_wakes_after_losing_its_lease_cannot_write_or_send(
        workers: Any, provider: FakeProvider, redis_server: RedisServer) -> None:
    provider.delay_s, provider.words = 0.1, 200
    a, b = await workers(2)
    deltas: list[tuple[float, str]] = []
    async with aiohttp.ClientSession() as http:
        async def stream() -> dict[str, Any]:
            body = {"messages": [{"role": "user", "content": "zombie turn"}], "stream": True}
            async with http.post(a.url + "/v1/chat/completions", json=body,
                                 headers={"X-Session-Id": "s3"}) as resp:
                last: dict[str, Any] = {}
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        last = json.loads(line[6:])
                        delta = last["choices"][0]["delta"].get("content")
                        if delta:
                            deltas.append((time.monotonic(), delta))
                return last

        streaming = asyncio.create_task(stream())
        await until(lambda: len(deltas) >= 3, 10, "the answer never started streaming")
        a.signal(signal.SIGSTOP)
        paused = time.monotonic()
        await asyncio.sleep(TTL + 0.5)  # the scenario itself: a pause longer than the lease
        assert time.monotonic() - paused >= TTL
        provider.delay_s, provider.words = 0.0, 2
        status, body = await b.ask(http, "s3", "new owner")
        assert status == 200 and content(body).startswith("reply to: new owner")
        woke = time.monotonic()
        a.signal(signal.SIGCONT)
        last = await asyncio.wait_for(streaming, 10)
    assert last["switchboard"].items() >= {"interrupted_by": "system", "reason": "session lease lost"}.items()
    assert [d for t, d in deltas if t > woke] == [], "the zombie kept sending after it woke"
    rows = await _transcript(redis_server, "api:dm:s3", 4)
    # The zombie's turn is closed by the new owner; nothing the zombie did after waking is there.
    assert rows == [("user", "zombie turn", None),
                    ("assistant", "", "worker stopped responding; session taken over"),
                    ("user", "new owner", None), ("assistant", content(body), None)]


async def test_a_paused_owner_whose_tool_ended_meanwhile_takes_no_further_step(
        workers: Any, provider: FakeProvider, redis_server: RedisServer) -> None:
    """Paused past its lease while a tool ran, the zombie wakes to the tool's result: it must not
    ask the provider for the next round (a paid request nobody will see) nor run another tool."""
    a, b = await workers(2)
    provider.then(Script(tool_calls=[("sleep", {"seconds": 0.5})]))
    async with aiohttp.ClientSession() as http:
        asking = asyncio.create_task(a.ask(http, "s5", "zombie tool"))
        await until(lambda: bool(provider.requests_for("zombie tool")), 10, "the owner never asked the provider")
        await asyncio.sleep(0.1)  # the tool call reached the worker; the tool runs on while it is paused
        a.signal(signal.SIGSTOP)
        paused = time.monotonic()
        await asyncio.sleep(TTL + 0.5)  # the scenario itself: a pause longer than the lease
        assert time.monotonic() - paused >= TTL
        status, body = await b.ask(http, "s5", "new owner")
        assert status == 200 and content(body).startswith("reply to: new owner")
        a.signal(signal.SIGCONT)
        status, zombie = await asyncio.wait_for(asking, 10)
    assert zombie.get("switchboard") == {"interrupted_by": "system", "reason": "session lease lost"}, zombie
    assert len(provider.requests_for("zombie tool")) == 1, "the zombie asked the provider after its tool"


async def test_redis_restarting_mid_run_runs_no_session_twice_and_service_resumes(
        workers: Any, provider: FakeProvider, start_redis: RedisFactory) -> None:
    provider.delay_s, provider.words = 0.02, 20
    redis_server = start_redis("redis", persistence=True)
    a, b = await workers(2, redis_server)
    async with aiohttp.ClientSession() as http:
        first = [asyncio.create_task(w.ask(http, f"r{i}", f"before {i}")) for i, w in enumerate([a, b] * 5)]
        await asyncio.sleep(0.1)
        redis_server.stop()
        await asyncio.sleep(1.0)
        redis_server.start()
        results = await asyncio.gather(*first)
        for status, body in results:
            assert status in (200, 400, 503), body
        after = await asyncio.gather(*(w.ask(http, f"r{i}", f"after {i}") for i, w in enumerate([a, b] * 5)))
    redis_server.stop()
    assert [content(body)[:20] for status, body in after if status != 200] == []
    for i in range(10):
        conns = sorted(provider.requests_for(f"before {i}") + provider.requests_for(f"after {i}"),
                       key=lambda c: c.opened_at)
        for earlier, later in itertools.pairwise(conns):
            assert earlier.ended_at is not None and earlier.ended_at <= later.opened_at + 0.05, \
                f"session r{i} ran two turns at once"


async def test_telegram_poller_fails_over_without_losing_or_repeating_an_update(
        workers: Any, provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    from tests.fakes.telegram_api import FakeTelegramAPI

    provider.delay_s, provider.words = 0.0, 2
    async with FakeTelegramAPI() as fake:
        env = _telegram_env(fake, POLL_TIMEOUT_S="1")
        pair = [Worker(f"t{i}", redis_server.url, provider.base_url, tmp_path, ttl_s=TTL, **env) for i in (1, 2)]
        try:
            await start_all(*pair)
            def answered(chat: int) -> bool:
                return any(t.startswith(f"reply to: update {chat} ") and t.rstrip().endswith("w1")
                           for t in fake.messages(chat).values())

            async def settle(chats: range, timeout: float) -> None:
                deadline = time.monotonic() + timeout
                while not all(answered(c) for c in chats):
                    assert time.monotonic() < deadline, [fake.messages(c) for c in chats if not answered(c)]
                    await asyncio.sleep(0.05)

            for chat in range(1, 11):
                fake.push_text(chat, f"update {chat}", user_id=chat)
            await settle(range(1, 11), 15)
            leaders: list[Worker] = []

            def leader_known() -> bool:  # the heartbeat names the worker holding the poller lease
                beats = {w: json.loads(v) for w, v in redis_server.client().hgetall("sb:workers").items()}
                leaders[:] = [w for w in pair if beats.get(w.worker_id, {}).get("ingress")]
                return bool(leaders)

            await until(leader_known, TTL + 10, "no worker reports holding the poller lease", every=0.1)
            # Every answer so far confirmed shown (its record done): this test is about the poller's
            # failover. (A worker killed between an answer reaching the chat and its record being
            # marked done has that answer shown again by whoever recovers the session: at least once.)
            await until(lambda: not redis_server.client().zcard("sb:leased"), TTL + 10, "answers still open",
                        every=0.1)
            leader = leaders[0]
            leader.kill()
            for chat in range(11, 21):
                fake.push_text(chat, f"update {chat}", user_id=chat)
            await settle(range(11, 21), TTL + 10)
        finally:
            end_all(*pair)
        # (the draft's "writing…" status message, which carries the Stop button, is not an answer)
        sends = [r for r in fake.sent if r.method == "sendMessage" and r.text != STATUS_TEXT]
        for chat in range(1, 21):  # each update answered, by exactly one message
            assert len([r for r in sends if str(r.chat_id) == str(chat)]) == 1, (chat, fake.messages(chat))
        assert len(provider.connections) == 20


def _chat_story(fake: Any, provider: FakeProvider, chat: int) -> str:
    """What happened in a chat of the 300-session test, for a failure: its requests to the provider
    and its Telegram calls, with times relative to now."""
    now, perf = time.monotonic(), time.perf_counter()
    lines = [f"  provider: {c.last_user} opened {c.opened_at - perf:+.1f} s, {c.words} words, "
             f"{'completed' if c.completed else 'closed' if c.closed_at is not None else 'streaming'}"
             for c in provider.connections if c.last_user.startswith(f"q{chat}-")]
    lines += [f"  telegram: {c.method} {c.status} at {c.time - now:+.1f} s via {c.via}: "
              f"{str(c.params.get('text'))[:40]!r}" for c in fake.calls if str(c.params.get("chat_id")) == str(chat)]
    return "\n".join(lines)


@pytest.mark.timeout(300)  # ~60 s beside two CPU hogs; its own deadlines (below) report first
async def test_three_workers_300_sessions_random_stops_and_follow_ups_account_exactly(
        workers: Any, provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    from tests.fakes.telegram_api import FakeTelegramAPI

    rng = random.Random(3)
    # About four seconds per answer, so a follow-up or a stop lands mid-answer. Few words, slowly:
    # every word is an event for the fakes (in this process) and the workers, and 300 sessions'
    # worth of them at once would make the machine, not the cluster, what is tested.
    provider.delay_s, provider.words = 0.1, 40
    last_word = f"w{provider.words - 1}"
    async with FakeTelegramAPI() as fake:
        env = _telegram_env(fake, **{**WEBHOOK, "EDIT_INTERVAL_S": "0.5"})  # keeps the test process (fakes) unloaded
        trio = [Worker(f"x{i}", redis_server.url, provider.base_url, tmp_path, ttl_s=10, **env) for i in (1, 2, 3)]
        sent: dict[int, list[str]] = {}  # chat -> texts in the order they were sent
        statuses: list[int] = []
        try:
            await start_all(*trio)
            async def say(chat: int, text: str) -> None:
                sent.setdefault(chat, []).append(text)
                entities = [{"type": "bot_command", "offset": 0, "length": len(text)}] if text == "/stop" else None
                update = {"message": fake.user_message(chat, user_id=chat, text=text, entities=entities)}
                worker = rng.choice(trio)
                statuses.append(await fake.post_webhook(worker.url + "/telegram/webhook", update, "hook-secret-1"))

            async def session(chat: int) -> None:
                follow_up, stop = rng.random() < 0.5, rng.random() < 0.3
                if stop:  # answers to be stopped stream for 40 s: on a loaded machine a webhook can
                    for n in (1, 2):  # wait many seconds behind the others (one at a time per worker)
                        provider.by_text[f"q{chat}-{n}"] = Script(delay_s=1.0)
                await asyncio.sleep(rng.random() * 0.5)
                # The follow-up goes out while the first is still on its way (as a user typing
                # twice would), so webhook queueing cannot stretch the gap past the answer.
                first = asyncio.create_task(say(chat, f"q{chat}-1"))
                if follow_up:
                    await asyncio.sleep(0.05 + rng.random() * 0.3)
                    await say(chat, f"q{chat}-2")
                await first
                if stop:
                    # Stop while an answer streams (a draft shows it), however long a loaded machine
                    # took to get there; a random moment later. (Which message runs last is not
                    # known: one posted straight to the owner can overtake one forwarded to it.)
                    def streaming() -> bool:
                        draft = fake.draft_state(chat)
                        return (draft or "").startswith(f"reply to: q{chat}-") or any(
                            t.startswith(f"reply to: q{chat}-") for t in fake.messages(chat).values())

                    try:
                        await until(streaming, 60, f"no answer in chat {chat} ever started", every=0.05)
                    except AssertionError as exc:
                        raise AssertionError(f"{exc}\n{_chat_story(fake, provider, chat)}") from None
                    await asyncio.sleep(rng.random() * 0.4)
                    await say(chat, "/stop")

            await asyncio.gather(*(session(chat) for chat in range(1, 301)))
            assert set(statuses) == {200}
            def settled(chat: int, rows: list[Any]) -> bool:
                """The transcript closes each message the chat got, and the chat shows each answer
                the transcript has as answered (its last message goes out just after it is recorded)."""
                if not (_closed(rows) and len([r for r in rows if r.role == "user"]) ==
                        len([t for t in sent[chat] if t != "/stop"])):
                    return False
                shown = list(fake.messages(chat).values())
                return all(any(t.startswith(f"reply to: {user.content} ") and t.rstrip().endswith(last_word)
                               for t in shown)
                           for user, answer in itertools.pairwise(rows)
                           if user.role == "user" and answer.role == "assistant" and answer.interrupted_by is None)

            store = RedisStore(redis_server.url)
            await store.open()
            try:
                deadline = time.monotonic() + 90
                while True:  # settle
                    transcripts = {chat: (await store.conversation(f"telegram:dm:{chat}"))[1] for chat in sent}
                    if all(settled(chat, rows) for chat, rows in transcripts.items()):
                        break
                    assert time.monotonic() < deadline, ("sessions did not settle", {
                        chat: ([(r.role, r.content[:20], r.reason) for r in rows], sent[chat],
                               list(fake.messages(chat).values()))
                        for chat, rows in transcripts.items() if not settled(chat, rows)})
                    await asyncio.sleep(0.25)
            finally:
                await store.close()
            with redis_server.client() as r:  # a handled forward leaves nothing behind in Redis
                assert [r.xlen(keys.worker_inbox(w.worker_id)) for w in trio] == [0, 0, 0]
            forwarded = 0.0
            async with aiohttp.ClientSession() as http:
                for w in trio:
                    async with http.get(f"http://127.0.0.1:{w.admin_port}/metrics") as resp:
                        for family in text_string_to_metric_families(await resp.text()):
                            forwarded += sum(x.value for x in family.samples
                                             if x.name == "switchboard_messages_in_total"
                                             and x.labels.get("outcome") == "forwarded")
        finally:
            end_all(*trio)
    assert forwarded > 50  # many messages reached a worker that did not own their session
    outcomes = {"answered": 0, "user sent a new message": 0, "stopped by user (/stop)": 0}
    requests: dict[str, int] = {}
    for conn in provider.connections:
        requests[conn.last_user] = requests.get(conn.last_user, 0) + 1
    for chat, rows in transcripts.items():
        asked = [t for t in sent[chat] if t != "/stop"]
        users = [r.content for r in rows if r.role == "user"]
        # Each message recorded exactly once. (Order across workers: a message posted straight to the
        # owner within a millisecond of one forwarded to it can overtake it; exact order is not asserted.)
        assert sorted(users) == sorted(asked), (chat, users, asked)
        for user, answer in itertools.pairwise(rows):
            if user.role != "user":
                continue
            assert answer.role == "assistant", (chat, rows)
            assert requests.get(user.content, 0) <= 1, f"{user.content} reached the model twice"
            if answer.interrupted_by is None:  # answered: the full text reached the chat exactly once
                shown = [t for t in fake.messages(chat).values() if t.startswith(f"reply to: {user.content} ")]
                assert len(shown) == 1 and shown[0].rstrip().endswith(last_word), (chat, fake.messages(chat))
                outcomes["answered"] += 1
            else:
                assert answer.reason in ("user sent a new message", "stopped by user (/stop)"), answer
                outcomes[answer.reason] += 1
    assert min(outcomes.values()) >= 5, outcomes  # the mix really happened


def _webhook_pair(fake: Any, redis: RedisServer, provider: FakeProvider, tmp: Path) -> tuple[Worker, Worker]:
    """Workers a and b taking Telegram webhooks from the fake, sharing `redis` (not started yet:
    the caller starts them inside the `try` whose `finally` ends them)."""
    env = _telegram_env(fake, **WEBHOOK)
    a, b = (Worker(name, redis.url, provider.base_url, tmp, ttl_s=TTL, **env) for name in "ab")
    return a, b


async def _post(fake: Any, worker: Worker, chat: int, text: str) -> None:
    """A user's message in `chat`, delivered to `worker`'s webhook."""
    update = {"message": fake.user_message(chat, user_id=chat, text=text)}
    assert await fake.post_webhook(worker.url + "/telegram/webhook", update, WEBHOOK["SECRET_TOKEN"]) == 200


def _closed(rows: list[Any]) -> bool:
    """Every user row is followed by an assistant row (an answer or an interruption marker)."""
    return bool(rows) and all(b.role == "assistant" for a, b in itertools.pairwise(rows) if a.role == "user") \
        and rows[-1].role == "assistant"


async def test_messages_forwarded_to_a_worker_that_died_are_reclaimed_and_answered_once(
        provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    from tests.fakes.telegram_api import FakeTelegramAPI

    provider.delay_s, provider.words = 0.0, 2
    async with FakeTelegramAPI() as fake:
        a, b = _webhook_pair(fake, redis_server, provider, tmp_path)
        try:
            await start_all(a, b)
            async def say(worker: Worker, text: str) -> None:
                await _post(fake, worker, 42, text)

            await say(a, "first")  # a owns the session now
            await until(lambda: any(t.startswith("reply to: first") for t in fake.messages(42).values()), 10,
                        "the first message was never answered", every=0.05)
            a.signal(signal.SIGSTOP)  # a cannot read its inbox any more...
            await say(b, "second")  # ...but b forwards this to it, since a still holds the lease
            a.kill()  # and a dies without ever acknowledging it
            died = time.monotonic()
            while not any(t.startswith("reply to: second") for t in fake.messages(42).values()):
                # a's liveness lapses within a TTL, its inbox entry is claimed once idle for a TTL
                assert time.monotonic() - died < 2 * TTL + TTL / 3 + 2, fake.messages(42)
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # a negative check: room for a (wrong) second answer to show up
            with redis_server.client() as r:  # the dead worker's inbox does not keep the entry
                assert r.xlen(keys.worker_inbox("a")) == 0
        finally:
            end_all(a, b)
    answers = [t for t in fake.messages(42).values() if t.startswith("reply to: second")]
    assert len(answers) == 1 and len(provider.requests_for("second")) == 1


async def test_a_turn_running_on_a_worker_that_dies_is_resumed_without_waiting_for_the_user(
        provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    from tests.fakes.telegram_api import FakeTelegramAPI

    provider.delay_s, provider.words = 0.05, 400
    async with FakeTelegramAPI() as fake:
        a, b = _webhook_pair(fake, redis_server, provider, tmp_path)
        try:
            await start_all(a, b)
            await _post(fake, a, 43, "tell me a long story")
            await until(lambda: bool(fake.messages(43)), 10, "the story never started", every=0.05)
            provider.delay_s, provider.words = 0.0, 2
            a.kill()  # mid-turn, and the user says nothing more
            died = time.monotonic()
            while not any(t.startswith("reply to:  w") for t in fake.messages(43).values()):  # resumed
                # Adopted within TTL + 2 s of the owner's last renewal (which came before the kill).
                assert time.monotonic() - died < TTL + 2, fake.messages(43)
                await asyncio.sleep(0.05)
        finally:
            end_all(a, b)
    texts = list(fake.messages(43).values())
    assert "⏹ interrupted: worker stopped responding; session taken over" in texts
    resumed = provider.connections[-1].body["messages"]
    assert resumed[0]["content"] == "tell me a long story"
    assert resumed[1]["content"] == "[interrupted by system: worker stopped responding; session taken over]"
    assert resumed[2]["content"].startswith("[interrupted by system: worker stopped responding")


async def test_a_worker_stopped_for_a_rolling_restart_hands_its_cut_off_turns_to_the_others(
        workers: Any, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 400
    a, b = await workers(2)
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "essay please"}], "stream": False}
        pending = asyncio.create_task(http.post(a.url + "/v1/chat/completions", json=body,
                                                headers={"X-Session-Id": "roll"}))
        await until(lambda: bool(provider.requests_for("essay please")), 10, "the essay was never asked for")
        assert await a.stop() == 0  # SIGTERM: the turn is cut off with "gateway restart"
        answer = await (await pending).json()
        assert answer["switchboard"].items() >= {"interrupted_by": "system", "reason": "gateway restart"}.items()
        provider.delay_s, provider.words = 0.0, 2
        status, body2 = await b.ask(http, "roll", "are you back?")
    assert status == 200 and content(body2).startswith("reply to: are you back?")
    sent = provider.connections[-1].body["messages"]
    assert sent[1]["content"].endswith("[interrupted by system: gateway restart]")


async def test_a_worker_restarted_with_the_same_id_takes_its_sessions_over_at_once_and_alone(
        provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    """systemd's Restart=on-failure: the same worker id back at once. Its previous incarnation's
    lease is not its own; it takes it over (new fence) without waiting for the TTL, closes and
    resumes the cut-off turn, and the other worker never answers the session too."""
    from tests.fakes.telegram_api import FakeTelegramAPI

    ttl = 10.0  # long, so that "at once" cannot be the TTL running out
    provider.delay_s, provider.words = 0.05, 400
    async with FakeTelegramAPI() as fake:
        env = _telegram_env(fake, **WEBHOOK)
        a, b = (Worker(name, redis_server.url, provider.base_url, tmp_path, ttl_s=ttl, **env) for name in "ab")
        again = Worker("a", redis_server.url, provider.base_url, tmp_path, ttl_s=ttl, **env)
        raw = redis_server.client()
        try:
            await start_all(a, b)
            await _post(fake, a, 51, "tell me a long story")
            while not fake.messages(51):
                await asyncio.sleep(0.05)
            old = raw.hgetall("sb:{s:telegram:dm:51}:lease")
            provider.delay_s, provider.words = 0.0, 2
            a.kill()
            killed = time.monotonic()
            await again.start()
            while not any(t.startswith("reply to:  w") for t in fake.messages(51).values()):  # resumed
                assert time.monotonic() - killed < ttl - 2, fake.messages(51)
                await asyncio.sleep(0.05)
            took_over = time.monotonic() - killed
            lease = raw.hgetall("sb:{s:telegram:dm:51}:lease")
            assert lease["worker"] == "a" and lease["token"] != old["token"]  # a new incarnation...
            assert int(lease["fence"]) > int(old["fence"])  # ...through the fenced takeover path
            await _post(fake, b, 51, "and then?")  # reaches b: forwarded to the new a, answered once
            while not any(t.startswith("reply to: and then?") for t in fake.messages(51).values()):
                await asyncio.sleep(0.05)
            await asyncio.sleep(ttl - (time.monotonic() - killed) + 1)  # past the old lease's TTL
        finally:
            end_all(a, b, again)
    print(f"taken over {took_over:.2f} s after the kill (TTL {ttl:g} s)")
    texts = list(fake.messages(51).values())
    assert texts.count("⏹ interrupted: worker stopped responding; session taken over") == 1
    assert len([t for t in texts if t.startswith("reply to: and then?")]) == 1
    assert len(provider.requests_for("and then?")) == 1
    rows = await _transcript(redis_server, "telegram:dm:51", 6)
    assert [(role, reason) for role, _, reason in rows] == [
        ("user", None), ("assistant", "worker stopped responding; session taken over"),
        ("user", None), ("assistant", None), ("user", None), ("assistant", None)]


async def test_an_owner_paused_for_less_than_the_ttl_leaves_no_turn_stalled(
        provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    """Paused just under the TTL, the owner gives the lease up by its own clock when it wakes; the
    turn it was running is closed, told and resumed (by whichever worker adopts it) — not left
    "running" with nobody answering."""
    from gateway.store.redis import RedisStore
    from tests.fakes.telegram_api import FakeTelegramAPI

    ttl = 5.0
    provider.delay_s, provider.words = 0.05, 400
    async with FakeTelegramAPI() as fake:
        env = _telegram_env(fake, **WEBHOOK)
        a, b = (Worker(name, redis_server.url, provider.base_url, tmp_path, ttl_s=ttl, **env) for name in "ab")
        try:
            await start_all(a, b)
            await _post(fake, a, 52, "a long answer please")
            while not fake.messages(52):
                await asyncio.sleep(0.05)
            provider.delay_s, provider.words = 0.0, 2
            a.signal(signal.SIGSTOP)
            paused = time.monotonic()
            await asyncio.sleep(ttl * 0.9)
            a.signal(signal.SIGCONT)
            while not any(t.startswith("reply to:  w") for t in fake.messages(52).values()):  # resumed
                assert time.monotonic() - paused < ttl + 2, fake.messages(52)
                await asyncio.sleep(0.05)
            store = RedisStore(redis_server.url)
            await store.open()
            try:
                deadline = time.monotonic() + 5
                while await store.unfinished_inbound("telegram:dm:52"):
                    assert time.monotonic() < deadline, await store.unfinished_inbound("telegram:dm:52")
                    await asyncio.sleep(0.1)
            finally:
                await store.close()
        finally:
            end_all(a, b)
    texts = list(fake.messages(52).values())
    assert len([t for t in texts if t.startswith("⏹ interrupted:")]) == 1, texts
    # Resumed once; the fake provider's "reply to: <the resume prompt>" shows without the prompt.
    assert len([t for t in texts if t.startswith("reply to:  w")]) == 1, texts


async def test_an_answer_that_ends_while_redis_is_down_is_shown_whole_only_once_it_is_recorded(
        provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    """The answer ends during a Redis outage longer than the lease's remaining life: its record is
    refused once Redis is back (another worker owns the session by then), so the chat must never
    have seen it whole — the new owner says it was cut off and answers it again."""
    from tests.fakes.telegram_api import FakeTelegramAPI

    provider.delay_s, provider.words = 0.05, 40
    async with FakeTelegramAPI() as fake:
        a, b = (Worker(name, redis_server.url, provider.base_url, tmp_path, ttl_s=TTL,
                       **_telegram_env(fake, BASE_URL=fake.base_url_via(name), **WEBHOOK)) for name in "ab")
        try:
            await start_all(a, b)
            await _post(fake, a, 62, "answer while redis sleeps")
            await until(lambda: any("w30" in str(c.params.get("text")) for c in fake.calls), 10,
                        "the answer never streamed", every=0.01)
            redis_server.pause()  # the last ten words arrive while Redis is down
            await asyncio.sleep(TTL + 1.5)
            provider.delay_s, provider.words = 0.0, 2
            redis_server.resume()
            await until(lambda: any(t.startswith("reply to:  w")  # the resumed answer, without its prompt
                                    for t in fake.messages(62).values()),
                        TTL + 5, "the cut-off turn was never resumed", every=0.05)
        finally:
            end_all(a, b)
    whole = [c.params.get("text") for c in fake.calls
             if c.via == "a" and str(c.params.get("text", "")).rstrip().endswith("w39")]
    assert whole == [], "the first owner showed the whole answer, which was then taken over"
    texts = list(fake.messages(62).values())
    assert len([t for t in texts if t.startswith("⏹ interrupted:")]) == 1, texts
    assert len(provider.requests_for("answer while redis sleeps")) == 1


async def test_an_answer_recorded_after_an_outage_that_outlasted_the_workers_clock_is_still_shown(
        provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    """Redis hangs as the answer ends and comes back after the worker's own clock gave up on the
    lease but before Redis let it go: the record lands under the lease, so the answer's end must
    be shown (asking Redis first) — not held back forever with the record saying "answered"."""
    from agent_cache import keys
    from tests.fakes.telegram_api import FakeTelegramAPI

    ttl = 10.0  # a wide margin (1 s) between the worker's deadline and Redis's
    provider.delay_s, provider.words = 0.05, 40
    async with FakeTelegramAPI() as fake:
        a = Worker("a", redis_server.url, provider.base_url, tmp_path, ttl_s=ttl, **_telegram_env(fake, **WEBHOOK))
        try:
            await a.start()
            await _post(fake, a, 63, "answer across the outage")
            await until(lambda: any("w30" in str(c.params.get("text")) for c in fake.calls), 10,
                        "the answer never streamed", every=0.01)
            left_s = redis_server.client().pttl(keys.lease("telegram:dm:63")) / 1000
            assert left_s > 1.0, left_s
            redis_server.pause()  # the answer ends while Redis hangs...
            await asyncio.sleep(left_s - 0.4)  # ...past the worker's deadline (1 s before Redis's)
            redis_server.resume()
            await until(lambda: any(t.rstrip().endswith("w39") for t in fake.messages(63).values()), 10,
                        "the recorded answer was never shown whole", every=0.05)
        finally:
            a.end()
    texts = list(fake.messages(63).values())
    assert not any(t.startswith("⏹") for t in texts), texts
    assert len(provider.requests_for("answer across the outage")) == 1


async def test_while_redis_is_down_clients_are_told_to_retry_and_nothing_is_lost(
        provider: FakeProvider, tmp_path: Path, start_redis: RedisFactory) -> None:
    """The API answers 503 with Retry-After (not 400), the Telegram webhook answers non-2xx so
    Telegram delivers the update again, and the redelivery is answered once Redis is back."""
    from tests.fakes.telegram_api import FakeTelegramAPI

    provider.delay_s, provider.words = 0.0, 2
    redis_server = start_redis("redis", persistence=True)
    async with FakeTelegramAPI() as fake:
        env = _telegram_env(fake, **WEBHOOK)
        a = Worker("a", redis_server.url, provider.base_url, tmp_path, ttl_s=TTL, **env)
        try:
            await a.start()
            redis_server.stop()
            async with aiohttp.ClientSession() as http:
                body = {"messages": [{"role": "user", "content": "anyone there?"}]}
                async with http.post(a.url + "/v1/chat/completions", json=body,
                                     headers={"X-Session-Id": "down"}) as resp:
                    assert resp.status == 503, await resp.text()
                    assert int(resp.headers["Retry-After"]) > 0
                    assert (await resp.json())["error"]["type"] == "service_unavailable"
                update = {"message": fake.user_message(53, user_id=53, text="hello while down")}
                assert await fake.post_webhook(a.url + "/telegram/webhook", update, WEBHOOK["SECRET_TOKEN"]) >= 500
                redis_server.start()
                deadline = time.monotonic() + 10
                while (status := await fake.post_webhook(a.url + "/telegram/webhook", update,
                                                         WEBHOOK["SECRET_TOKEN"])) != 200:
                    assert time.monotonic() < deadline, status  # Telegram keeps redelivering
                    await asyncio.sleep(0.2)
                while not any(t.startswith("reply to: hello while down") for t in fake.messages(53).values()):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                # One more redelivery (Telegram may send it twice): de-duplicated, not answered again.
                assert await fake.post_webhook(a.url + "/telegram/webhook", update, WEBHOOK["SECRET_TOKEN"]) == 200
                await asyncio.sleep(0.5)
        finally:
            a.end()
            redis_server.stop()
    assert len([t for t in fake.messages(53).values() if t.startswith("reply to: hello while down")]) == 1
    assert len(provider.requests_for("hello while down")) == 1


async def test_status_lists_workers_with_their_incarnation_and_sessions(workers: Any, redis_server: RedisServer,
                                                                       provider: FakeProvider) -> None:
    import subprocess
    import sys

    provider.delay_s, provider.words = 0.0, 2
    (a,) = await workers(1)
    async with aiohttp.ClientSession() as http:
        assert (await a.ask(http, "listed", "hi"))[0] == 200
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gateway", "status"],
                                  env={**a.env}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    incarnation = str(redis_server.client().get("sb:alive:{w1}"))
    assert f"w1  alive ({incarnation})" in out.stdout and "session  api:dm:listed" in out.stdout, out.stdout
async def test_a_worker_killed_mid_tool_takes_the_tool_with_it(workers: Any, provider: FakeProvider) -> None:
    """Cluster mode, `kill -9` of the worker running a tool: the tool does not run on."""
    provider.then(Script(tool_calls=[("sleep", {"seconds": 30})]))
    (a,) = await workers(1)
    assert a.proc is not None
    async with aiohttp.ClientSession() as http:
        pending = asyncio.create_task(a.ask(http, "nap", "take a nap"))
        tool = await child_running(a.proc.pid, ["sleep", "30"])  # the worker's own child
        a.kill()
        await until(lambda: not running(tool), 5, "the tool outlived its worker")
        with pytest.raises(aiohttp.ClientError):
            await pending


async def test_a_session_is_listed_for_adoption_while_it_has_work_and_unlisted_soon_after(
        workers: Any, provider: FakeProvider, redis_server: RedisServer) -> None:
    """Listed (`sb:leased`) while a turn is open, so a live worker adopts it if its owner dies; no
    longer listed a moment after the work ends, and never marked lapsed by a stop that finds it
    idle (nobody adopts a session with nothing to do). The sessions index lists it by its last write."""
    r = redis_server.client()
    (a,) = await workers(1)
    async with aiohttp.ClientSession() as http:
        provider.delay_s, provider.words = 0.05, 40
        asking = asyncio.create_task(a.ask(http, "busy", "a long one"))
        await until(lambda: bool(provider.requests_for("a long one")), 10, "never asked")
        assert r.zscore("sb:leased", "api:dm:busy") is not None  # while it runs
        assert (await asking)[0] == 200
        provider.delay_s, provider.words = 0.0, 2
        for n in range(5):  # back to back: it may stay listed in between, never lapsed
            assert (await a.ask(http, "busy", f"quick {n}"))[0] == 200
        await until(lambda: r.zscore("sb:leased", "api:dm:busy") is None, 5, "still listed after its work ended")
        assert (await a.ask(http, "idle-at-stop", "hi"))[0] == 200
        written = time.time()
    assert await a.stop() == 0  # within the unlisting delay or after it: either way not lapsed
    assert r.zscore("sb:leased", "api:dm:idle-at-stop") is None
    assert r.zscore("sb:sessions", "api:dm:idle-at-stop") == pytest.approx(written, abs=2.0)
    assert r.zscore("sb:sessions", "api:dm:busy") is not None
