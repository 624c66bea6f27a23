"""Discord shards: every shard in one process, or — in cluster mode — each shard a lease held by one
worker, moved with its gateway session when that worker dies or stops. Real discord.py against the
fake Discord; real worker processes and a real redis-server for the cluster."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest
import pytest_asyncio

from agent_cache import keys
from gateway.core.ports import Health
from platforms.discord_bot import DiscordAdapter
from platforms.discord_shards import HANDOFF
from tests.conftest import DaemonFactory
from tests.fakes.discord_api import (
    ALICE_ID,
    BOB_ID,
    BOT_ID,
    GUILD_ID,
    PUBLIC_THREAD,
    THREAD_ID,
    FakeChannel,
    FakeDiscord,
    FakeGuild,
    RestCall,
    patch_discord,
    shard_of,
)
from tests.fakes.openai_provider import FakeProvider
from tests.support.procs import until
from tests.support.redis_server import RedisServer
from tests.support.spawn import Group
from tests.support.workers import Worker, end_all, start_all

TTL = 3.0
ODD_GUILD, EVEN_GUILD = GUILD_ID, GUILD_ID + (1 << 22)  # shard 1 and shard 0 of 2
CHANNELS = 8  # per guild: one message per channel, so that no message waits for another's turn


def _channel(guild: int, i: int) -> int:
    return guild + 100 + i


def _guilds() -> list[FakeGuild]:
    """Two guilds, one per shard of 2, with `CHANNELS` text channels each; the odd one a thread too."""
    guilds = []
    for gid, name in ((ODD_GUILD, "odd"), (EVEN_GUILD, "even")):
        channels = [FakeChannel(_channel(gid, i), f"c{i}") for i in range(CHANNELS)]
        guilds.append(FakeGuild(gid, name, channels, [ALICE_ID, BOB_ID], owner_id=ALICE_ID))
    guilds[0].channels.append(FakeChannel(THREAD_ID, "help", type=PUBLIC_THREAD, parent_id=_channel(ODD_GUILD, 0)))
    return guilds


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(guilds=_guilds()) as server, patch_discord(server):
        yield server


def _answer(text: str, words: int) -> str:
    """The fake provider's answer, as the final message shows it."""
    return " ".join([f"reply to: {text}"] + [f"w{i}" for i in range(words)]) + " "


@dataclass
class Sent:
    """What the test said, by message id: its text and channel."""

    messages: dict[int, tuple[str, int]] = field(default_factory=dict)

    async def say(self, fake: FakeDiscord, channel: int, text: str) -> None:
        mid = await fake.dispatch_message(channel, text, author_id=ALICE_ID, mentions_bot=True)
        self.messages[mid] = (text, channel)


def _answers(fake: FakeDiscord) -> dict[int, list[RestCall]]:
    """The bot's messages (not edits) by the message they answer."""
    found: dict[int, list[RestCall]] = {}
    for call in fake.requests:
        ref = (call.json or {}).get("message_reference") if call.method == "POST" else None
        if call.status == 200 and call.path.endswith("/messages") and ref:
            found.setdefault(int(ref["message_id"]), []).append(call)
    return found


def _all_answered(fake: FakeDiscord, sent: Sent, words: int) -> Callable[[], bool]:
    return lambda: not _unanswered(fake, sent, words)


def _unanswered(fake: FakeDiscord, sent: Sent, words: int) -> dict[str, str | None]:
    """Each message not answered as it should be, with what answers it (if anything)."""
    shown = {text: _shown_answer(fake, channel, mid) for mid, (text, channel) in sent.messages.items()}
    return {text: answer for text, answer in shown.items() if answer != _answer(text, words)}


def _shown_answer(fake: FakeDiscord, channel: int, mid: int) -> str | None:
    """The text of the bot's message in `channel` that answers `mid`, as it shows now."""
    for m in fake.messages(channel):
        ref = m.get("message_reference") or {}
        if m["author"]["id"] == str(BOT_ID) and ref.get("message_id") == str(mid):
            return str(m["content"])
    return None


def _check_each_answered_once(fake: FakeDiscord, provider: FakeProvider, sent: Sent, words: int) -> None:
    answers = _answers(fake)
    for mid, (text, channel) in sent.messages.items():
        assert len(answers.get(mid, [])) == 1, (text, answers.get(mid))
        assert _shown_answer(fake, channel, mid) == _answer(text, words), text
        assert len(provider.requests_for(text)) == 1, text


# --- one process ----------------------------------------------------------------------------------


async def test_one_process_runs_every_shard(fake: FakeDiscord, make_daemon: DaemonFactory, provider: FakeProvider,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DiscordAdapter, "client_options", {"guild_ready_timeout": 0.01})
    monkeypatch.setattr(DiscordAdapter, "reidentify_delay_s", 0.0)
    provider.words = 2
    daemon = await make_daemon(discord={"token": fake.token, "access": "open", "edit_interval_s": 0.05,
                                        "shard_count": 2})
    adapter = daemon.adapters["discord"]
    await until(lambda: adapter.health().ok, 10, "both shards connected")
    assert adapter.health() == Health(True, "connected as switchboard (shards 0, 1 of 2)")
    assert sorted(p["d"]["shard"] for p in fake.gateway_received if p["op"] == 2) == [[0, 2], [1, 2]]
    assert fake.live_shards() == {0: 1, 1: 1} and (shard_of(ODD_GUILD, 2), shard_of(EVEN_GUILD, 2)) == (1, 0)
    sent = Sent()
    await sent.say(fake, _channel(ODD_GUILD, 0), "odd guild")
    await sent.say(fake, _channel(EVEN_GUILD, 0), "even guild")
    await sent.say(fake, THREAD_ID, "in the thread")
    dm = fake.dm_channel_id(BOB_ID)
    mid = await fake.dispatch_message(dm, "a DM", author_id=BOB_ID)  # DMs: shard 0
    sent.messages[mid] = ("a DM", dm)
    await until(_all_answered(fake, sent, 2), 10, "every message answered")
    _check_each_answered_once(fake, provider, sent, 2)
    assert fake.shard_overlaps() == []


# --- cluster mode ---------------------------------------------------------------------------------


class DiscordWorker(Worker):
    """A worker whose discord.py talks to the fake Discord (`tests/support/discord_worker.py`)."""

    async def start(self) -> Worker:
        self.proc = Group([sys.executable, "-m", "tests.support.discord_worker", "run"], env=self.env, log=self.log)
        await self.until_ready()
        return self


def _workers(n: int, fake: FakeDiscord, redis_server: RedisServer, provider: FakeProvider,
             tmp_path: Path) -> list[Worker]:
    env = {"FAKE_DISCORD_URL": fake.base_url, "SWITCHBOARD_DISCORD__TOKEN": fake.token,
           "SWITCHBOARD_DISCORD__ACCESS": "open", "SWITCHBOARD_DISCORD__EDIT_INTERVAL_S": "0.05",
           "SWITCHBOARD_DISCORD__SHARD_COUNT": "2"}
    return [DiscordWorker(f"d{i}", redis_server.url, provider.base_url, tmp_path, ttl_s=TTL, **env)
            for i in range(1, n + 1)]


def _shard_holders(redis_server: RedisServer, fake: FakeDiscord) -> dict[int, str | None]:
    """Shard -> the worker holding its lease (from Redis)."""
    r = redis_server.client()
    name = f"discord:{keys.token_id(fake.token)}:shard"
    return {i: cast("str | None", r.hget(keys.ingress(f"{name}:{i}"), "worker")) for i in (0, 1)}


def _handoff_saved(redis_server: RedisServer, fake: FakeDiscord, shard: int) -> Callable[[], bool]:
    """The holder of `shard` has saved its gateway session (what a takeover resumes)."""
    name = f"discord:{keys.token_id(fake.token)}:shard:{shard}"
    return lambda: redis_server.client().get(keys.ingress_state(name, HANDOFF)) is not None


def _no_open_work(redis_server: RedisServer) -> Callable[[], bool]:
    """No session has a turn queued or running anywhere (a killed owner would leave one to adopt)."""
    return lambda: redis_server.client().zcard(keys.leased()) == 0


async def _status(worker: Worker) -> str:
    """What `switchboard status` prints (run with the worker's environment)."""
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gateway", "status"], env=worker.env,
                                  capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _status_ingress(text: str) -> dict[str, list[int]]:
    """Worker -> the Discord shards `switchboard status` lists under it."""
    found: dict[str, list[int]] = {}
    worker = ""
    for line in text.splitlines():
        if not line.startswith(" "):
            worker = line.split()[0]
            found.setdefault(worker, [])
        elif line.strip().startswith("ingress  discord:"):
            found[worker].append(int(line.rsplit(":", 1)[1]))
    return found


async def _send_round(fake: FakeDiscord, sent: Sent, label: str, channel: int) -> None:
    """One message in channel `channel` of each guild."""
    for guild in (ODD_GUILD, EVEN_GUILD):
        await sent.say(fake, _channel(guild, channel), f"{label} {'odd' if guild == ODD_GUILD else 'even'}")


@pytest.mark.timeout(150)  # about 30 s; more beside two CPU hogs
async def test_two_workers_hold_a_shard_each_and_a_killed_holders_shard_resumes_on_the_other(
        fake: FakeDiscord, redis_server: RedisServer, provider: FakeProvider, tmp_path: Path) -> None:
    provider.words = 2
    pair = _workers(2, fake, redis_server, provider, tmp_path)
    sent = Sent()
    try:
        await start_all(*pair)
        # Whoever took both first hands one on: a shard each.
        await until(lambda: set(_shard_holders(redis_server, fake).values()) == {w.worker_id for w in pair}, 30,
                    f"a shard held by each worker: {_shard_holders(redis_server, fake)}")
        await until(lambda: fake.live_shards() == {0: 1, 1: 1}, 30, f"both shards connected: {fake.live_shards()}")
        holders = _shard_holders(redis_server, fake)
        # Before: a message in each guild, and one in the thread (its session is checked after the move).
        await _send_round(fake, sent, "before", 1)
        await sent.say(fake, THREAD_ID, "thread, first")
        await until(_all_answered(fake, sent, 2), 30, "the messages sent before the failover answered")
        await until(_no_open_work(redis_server), 30, "no turn open anywhere")

        victim = next(w for w in pair if w.worker_id == holders[1])  # the holder of the odd guild's shard
        moved = [shard for shard, holder in holders.items() if holder == victim.worker_id]
        links_before = len(fake.shard_links)
        victim.kill()
        killed_at = time.monotonic()
        # During: while the victim's shards have nobody (Discord keeps their events for a RESUME).
        for i in range(3):
            await _send_round(fake, sent, f"during {i}", 2 + i)
            await asyncio.sleep(TTL / 3)
        survivor = next(w for w in pair if w is not victim)

        def moved_over() -> bool:
            new = [link for link in fake.shard_links[links_before:] if link.shard in moved]
            return fake.live_shards() == {0: 1, 1: 1} and {link.shard for link in new} == set(moved)

        await until(moved_over, TTL + 10, f"shards {moved} connected again")
        resumed = [next(link for link in fake.shard_links[links_before:] if link.shard == shard) for shard in moved]
        took = {link.shard: link.attached - killed_at for link in resumed}
        print(f"shards {moved} of the killed worker connected again on {survivor.worker_id} after "
              + ", ".join(f"{t:.2f} s" for t in took.values()))
        assert all(t <= TTL + 2 for t in took.values()), took
        assert [link.how for link in resumed] == ["resume"] * len(resumed)  # the session handed on
        assert set(_shard_holders(redis_server, fake).values()) == {survivor.worker_id}
        assert fake.live_shards() == {0: 1, 1: 1}
        # `switchboard status` names the ingress leases its workers' heartbeats name: the
        # survivor's next heartbeat (every TTL/3) names the shard it took over.
        deadline = time.monotonic() + TTL + 10
        while True:
            listed = _status_ingress(await _status(survivor))  # the dead worker: listed DEAD, or gone
            if listed.get(survivor.worker_id) == [0, 1] and not listed.get(victim.worker_id):
                break
            assert time.monotonic() < deadline, f"switchboard status never listed both shards on the survivor: {listed}"
            await asyncio.sleep(0.2)
        # After.
        await _send_round(fake, sent, "after", 6)
        await sent.say(fake, THREAD_ID, "thread, second")
        await until(_all_answered(fake, sent, 2), 30, "every message answered")
        await until(_no_open_work(redis_server), 30, "no turn open anywhere")
    finally:
        end_all(*pair)
    _check_each_answered_once(fake, provider, sent, 2)
    # The thread is still a session of its own after the move (its history came along), though the
    # resumed session never told the new holder it is a thread: it looked the channel up.
    (second,) = provider.requests_for("thread, second")
    assert "thread, first" in [m["content"] for m in second.body["messages"] if m["role"] == "user"]
    lookups = [c.status for c in fake.requests if c.method == "GET" and c.path == f"/channels/{THREAD_ID}"]
    assert lookups and set(lookups) == {200}  # (once by each holder that resumed the session)
    assert fake.shard_overlaps() == []  # never two connections on one shard
    assert fake.identify_count == 2  # each shard identified once: every move resumed its session


@pytest.mark.timeout(150)
async def test_a_stopping_worker_hands_its_shards_on_at_once(
        fake: FakeDiscord, redis_server: RedisServer, provider: FakeProvider, tmp_path: Path) -> None:
    provider.words = 2
    pair = _workers(2, fake, redis_server, provider, tmp_path)
    sent = Sent()
    try:
        await start_all(*pair)
        await until(lambda: set(_shard_holders(redis_server, fake).values()) == {w.worker_id for w in pair}, 30,
                    f"a shard held by each worker: {_shard_holders(redis_server, fake)}")
        await until(lambda: fake.live_shards() == {0: 1, 1: 1}, 30, "both shards connected")
        holders = _shard_holders(redis_server, fake)
        leaving = next(w for w in pair if w.worker_id == holders[0])
        await _send_round(fake, sent, "before", 1)
        await until(_all_answered(fake, sent, 2), 30, "the messages sent before the stop answered")
        await until(_no_open_work(redis_server), 30, "no turn open anywhere")
        (link,) = [link for link in fake.shard_links if link.shard == 0 and link.detached is None]
        leaving.signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        # What reaches the stopping worker before its intake stops is its own to answer (or cut off:
        # the core's shutdown); what comes once it has let go of the shard is the next holder's.
        await until(lambda: link.detached is not None, 10, "the stopping worker let go of shard 0")
        await _send_round(fake, sent, "during", 2)

        def moved_over() -> bool:
            return fake.live_shards() == {0: 1, 1: 1} and fake.shard_links[-1] is not link
        await until(moved_over, 10, "shard 0 connected again")
        (taken,) = [new for new in fake.shard_links if new.shard == 0 and new.attached > link.attached]
        assert link.detached is not None
        print(f"shard 0 handed on: disconnected {link.detached - stopped_at:.2f} s after SIGTERM, "
              f"resumed by the other worker {taken.attached - stopped_at:.2f} s after it")
        assert taken.how == "resume" and taken.session == link.session  # the session handed on
        assert taken.attached - stopped_at < TTL  # handed on, not left to lapse
        assert await leaving.stop() == 0
        await _send_round(fake, sent, "after", 3)
        await until(_all_answered(fake, sent, 2), 30, "every message answered")
    finally:
        end_all(*pair)
    _check_each_answered_once(fake, provider, sent, 2)
    assert fake.shard_overlaps() == [] and fake.identify_count == 2


@pytest.mark.timeout(150)
async def test_a_holder_paused_past_its_lease_lets_go_of_its_shard_when_it_wakes(
        fake: FakeDiscord, redis_server: RedisServer, provider: FakeProvider, tmp_path: Path) -> None:
    provider.words = 2
    pair = _workers(2, fake, redis_server, provider, tmp_path)
    sent = Sent()
    try:
        await start_all(*pair)
        await until(lambda: set(_shard_holders(redis_server, fake).values()) == {w.worker_id for w in pair}, 30,
                    f"a shard held by each worker: {_shard_holders(redis_server, fake)}")
        await until(lambda: fake.live_shards() == {0: 1, 1: 1}, 30, "both shards connected")
        # Its holder has saved where shard 1's session is (at most once a second): a takeover
        # resumes it. (Paused before that, the next holder has no session to resume and identifies
        # anew, while the paused one's connection stays open until Discord's heartbeat check.)
        await until(_handoff_saved(redis_server, fake, 1), 30, "shard 1's session saved in its lease state")
        paused = next(w for w in pair if w.worker_id == _shard_holders(redis_server, fake)[1])
        other = next(w for w in pair if w is not paused)
        links_before = len(fake.shard_links)
        paused.signal(signal.SIGSTOP)
        try:
            await _send_round(fake, sent, "while paused", 1)
            await until(lambda: _shard_holders(redis_server, fake)[1] == other.worker_id, TTL + 10,
                        "the paused worker's shard taken over")
            await until(lambda: fake.live_shards() == {0: 1, 1: 1}, 10, "shard 1 connected again")
        finally:
            paused.signal(signal.SIGCONT)
        # Awake, the paused worker can no longer prove its lease: it lets the shard go, and must not
        # take the session back from the worker now holding it.
        await until(lambda: "cannot prove its lease" in paused.log.read_text(), 10, "the woken worker let go")
        await _send_round(fake, sent, "after waking", 2)
        await until(_all_answered(fake, sent, 2), 30, "every message answered")
        assert fake.live_shards() == {0: 1, 1: 1}
        # Each move (the takeover; later maybe the shard's way back, to spread the load) resumed the session.
        assert {link.how for link in fake.shard_links[links_before:]} == {"resume"}
    finally:
        end_all(*pair)
    _check_each_answered_once(fake, provider, sent, 2)
    assert fake.shard_overlaps() == []
