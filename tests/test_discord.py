"""The Discord adapter end to end: the real daemon and real discord.py against the loopback fake."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import pytest_asyncio

from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.commands import help_text
from gateway.core.logs import JsonFormatter
from gateway.core.ports import Health
from gateway.ops.daemon import Daemon
from platforms.discord_bot import DiscordAdapter
from tests.conftest import DaemonFactory
from tests.fakes.discord_api import (
    ALICE_ID,
    BOB_ID,
    BOT_ID,
    GUILD_ID,
    PUBLIC_THREAD,
    TEXT_CHANNEL_ID,
    THREAD_ID,
    FakeChannel,
    FakeDiscord,
    FakeGuild,
    patch_discord,
)
from tests.fakes.openai_provider import FakeProvider, Script

T = TypeVar("T")
Json = dict[str, Any]
Start = Callable[..., Awaitable[tuple[Daemon, DiscordAdapter]]]

OTHER_CHANNEL_ID = 1200000000000000011
OTHER_BOT_ID = 1300000000000000009
SECRET_TOKEN = "MTEwMDAwMDAwMDAwMDAwMDAwMQ.Gx7yZq.very-secret-discord-token-value"


@pytest.fixture(autouse=True)
def _fast_discord(monkeypatch: pytest.MonkeyPatch) -> None:
    """discord.py waits 2 s for guilds before on_ready and 5 s before a re-IDENTIFY."""
    monkeypatch.setattr(DiscordAdapter, "client_options", {"guild_ready_timeout": 0.01})
    monkeypatch.setattr(DiscordAdapter, "reidentify_delay_s", 0.0)


@pytest_asyncio.fixture
async def fake(request: pytest.FixtureRequest) -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(**getattr(request, "param", {})) as server, patch_discord(server):
        yield server


@pytest.fixture
def start(fake: FakeDiscord, make_daemon: DaemonFactory) -> Start:
    """Start the daemon with Discord on (after `fake`, so it is stopped before the fake is)."""

    async def _start(**discord: object) -> tuple[Daemon, DiscordAdapter]:
        daemon = await make_daemon(discord={"token": fake.token, "access": "open", "edit_interval_s": 0.05,
                                            **discord})
        adapter = daemon.adapters["discord"]
        assert isinstance(adapter, DiscordAdapter)
        await eventually(lambda: adapter.health().ok, 5, "the gateway to be ready")
        return daemon, adapter

    return _start


async def eventually(probe: Callable[[], T | None], timeout: float = 3.0, what: str = "a condition") -> T:
    """Poll `probe` until it returns something truthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = probe()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def bot_messages(fake: FakeDiscord, channel_id: int) -> list[Json]:
    """Messages the bot posted in a channel (not interaction responses)."""
    return [m for m in fake.messages(channel_id) if m["author"]["id"] == str(BOT_ID) and not m.get("webhook_id")]


def answer(text: str, words: int) -> str:
    """What the fake provider streams by default, as the final message shows it."""
    return " ".join([f"reply to: {text}"] + [f"w{i}" for i in range(words)]) + " "


async def reply_with(fake: FakeDiscord, channel_id: int, content: str, timeout: float = 3.0) -> Json:
    return await eventually(lambda: next((m for m in bot_messages(fake, channel_id) if m["content"] == content),
                                         None), timeout, f"{content!r} in channel {channel_id}")


def two_channels() -> list[FakeGuild]:
    channels = [FakeChannel(TEXT_CHANNEL_ID, "general"), FakeChannel(OTHER_CHANNEL_ID, "random"),
                FakeChannel(THREAD_ID, "help-thread", type=PUBLIC_THREAD, parent_id=TEXT_CHANNEL_ID)]
    return [FakeGuild(GUILD_ID, "Switchboard Test", channels, [ALICE_ID, BOB_ID], owner_id=ALICE_ID)]


# --- messages in, replies out -----------------------------------------------------------------


async def test_dm_round_trip(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.then(Script(text="hi", delay_s=0.3))  # slow enough for a typing indicator (after 0.2 s)
    daemon, adapter = await start()
    assert adapter.health() == Health(True, "connected as switchboard")
    dm = fake.dm_channel_id(ALICE_ID)
    mid = await fake.dispatch_message(dm, "hello", author_id=ALICE_ID, author_name="alice")
    reply = await reply_with(fake, dm, "hi ")
    assert reply["message_reference"]["message_id"] == str(mid)
    assert len(bot_messages(fake, dm)) == 1
    assert any(c.path == f"/channels/{dm}/typing" for c in fake.sent)
    assert [c.last_user for c in provider.connections] == ["hello"]
    assert (await daemon.readiness())["discord"].ok is True


async def test_guild_mention_mode(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.words = 1
    await start()
    await fake.dispatch_message(TEXT_CHANNEL_ID, "just chatting", author_id=BOB_ID)
    await fake.dispatch_message(TEXT_CHANNEL_ID, "beep", author_id=OTHER_BOT_ID, author_name="otherbot",
                                bot_author=True, mentions_bot=True)
    mid = await fake.dispatch_message(TEXT_CHANNEL_ID, "hello bot", author_id=ALICE_ID, mentions_bot=True)
    first = await reply_with(fake, TEXT_CHANNEL_ID, answer("hello bot", 1))  # the mention is stripped
    assert first["message_reference"]["message_id"] == str(mid)
    # A reply to one of the bot's messages needs no mention; a known command needs none either.
    await fake.dispatch_message(TEXT_CHANNEL_ID, "and more", author_id=ALICE_ID, reference_message_id=int(first["id"]))
    await reply_with(fake, TEXT_CHANNEL_ID, answer("and more", 1))
    await fake.dispatch_message(TEXT_CHANNEL_ID, "/help@otherbot", author_id=BOB_ID)  # not ours
    await fake.dispatch_message(TEXT_CHANNEL_ID, "!help", author_id=BOB_ID)
    await reply_with(fake, TEXT_CHANNEL_ID, help_text())
    assert [c.last_user for c in provider.connections] == ["hello bot", "and more"]
    assert [m["content"] for m in bot_messages(fake, TEXT_CHANNEL_ID)][-1] == help_text()


@pytest.mark.parametrize("fake", [{"guilds": two_channels()}], indirect=True)
async def test_guild_all_mode_allowed_channels(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.words = 1
    await start(guild_mode="all", allowed_channels=[str(TEXT_CHANNEL_ID)])
    await fake.dispatch_message(OTHER_CHANNEL_ID, "not here", author_id=ALICE_ID)
    await fake.dispatch_message(TEXT_CHANNEL_ID, "here", author_id=ALICE_ID)
    await reply_with(fake, TEXT_CHANNEL_ID, answer("here", 1))
    await fake.dispatch_message(THREAD_ID, "in its thread", author_id=BOB_ID)  # the parent is allowed
    await reply_with(fake, THREAD_ID, answer("in its thread", 1))
    await fake.dispatch_message(OTHER_CHANNEL_ID, "hey you", author_id=ALICE_ID, mentions_bot=True)
    await reply_with(fake, OTHER_CHANNEL_ID, answer("hey you", 1))
    assert [c.last_user for c in provider.connections] == ["here", "in its thread", "hey you"]


async def test_thread_is_its_own_session(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.words = 1
    await start()
    mid = await fake.dispatch_message(THREAD_ID, "in the thread", author_id=ALICE_ID, mentions_bot=True)
    reply = await reply_with(fake, THREAD_ID, answer("in the thread", 1))
    assert reply["message_reference"]["message_id"] == str(mid)
    assert bot_messages(fake, TEXT_CHANNEL_ID) == []
    await fake.dispatch_message(TEXT_CHANNEL_ID, "in the channel", author_id=ALICE_ID, mentions_bot=True)
    await reply_with(fake, TEXT_CHANNEL_ID, answer("in the channel", 1))
    users = [m["content"] for m in provider.connections[1].body["messages"] if m["role"] == "user"]
    assert users == ["in the channel"]  # the thread's conversation is not in the channel's


async def test_an_image_the_model_cannot_see_gets_a_reason(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    await start()
    dm = fake.dm_channel_id(ALICE_ID)
    files = [{"filename": "cat.png", "content": b"\x89PNG", "content_type": "image/png"}]
    mid = await fake.dispatch_message(dm, "", author_id=ALICE_ID, attachments=files)
    notice = await reply_with(fake, dm, "I could not read cat.png: this model cannot see images.")  # vision off
    assert notice["message_reference"]["message_id"] == str(mid)
    await fake.dispatch_message(TEXT_CHANNEL_ID, "", author_id=ALICE_ID, attachments=files)  # not addressed
    await fake.dispatch_message(TEXT_CHANNEL_ID, "ping", author_id=ALICE_ID, mentions_bot=True)
    await reply_with(fake, TEXT_CHANNEL_ID, answer("ping", provider.words))
    assert len(bot_messages(fake, TEXT_CHANNEL_ID)) == 1
    assert [c.last_user for c in provider.connections] == ["ping"]


# --- stopping and interrupting ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["/stop", "!stop"])
async def test_stop_by_text(start: Start, fake: FakeDiscord, provider: FakeProvider, command: str) -> None:
    provider.delay_s, provider.words = 0.03, 40
    await start()
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "long one", author_id=ALICE_ID)
    await fake.dispatch_message(TEXT_CHANNEL_ID, "other chat", author_id=BOB_ID, mentions_bot=True)
    streaming = (await eventually(lambda: bot_messages(fake, dm), what="the DM stream"))[0]
    conn = provider.requests_for("long one")[0]
    await fake.dispatch_message(dm, command, author_id=ALICE_ID)
    await provider.wait_closed(conn, 2)
    assert not conn.completed
    stopped = await eventually(lambda: [m for m in bot_messages(fake, dm) if m["content"].endswith("⏹ stopped")])
    assert stopped[0]["id"] == streaming["id"]
    await reply_with(fake, dm, "Stopped.")
    assert any(c.method == "PATCH" and c.channel_id == dm for c in fake.sent)  # it streamed by edits
    other = provider.requests_for("other chat")[0]
    await reply_with(fake, TEXT_CHANNEL_ID, answer("other chat", 40))
    assert other.completed


async def test_stop_by_application_command(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.03, 40
    await start()
    put = await fake.wait_for(lambda c: c.method == "PUT")
    assert sorted(c["name"] for c in put.json) == ["busy", "help", "jobs", "kill", "new", "reset", "status", "stop"]
    dm = fake.dm_channel_id(BOB_ID)
    await fake.dispatch_message(THREAD_ID, "long one", author_id=ALICE_ID, mentions_bot=True)
    await fake.dispatch_message(dm, "other chat", author_id=BOB_ID)
    await eventually(lambda: bot_messages(fake, THREAD_ID), what="the thread stream")
    conn = provider.requests_for("long one")[0]
    inter = await fake.dispatch_interaction("stop", channel_id=THREAD_ID, user_id=BOB_ID)
    call = await fake.wait_for(lambda c: c.path == f"/interactions/{inter.id}/{inter.token}/callback")
    assert call.json["type"] == 4 and call.json["data"]["content"] == "Stopped."
    await provider.wait_closed(conn, 2)
    await eventually(lambda: bot_messages(fake, THREAD_ID)[0]["content"].endswith("⏹ stopped"))
    await reply_with(fake, dm, answer("other chat", 40))
    assert not conn.completed and provider.requests_for("other chat")[0].completed


async def test_application_commands_answer(start: Start, fake: FakeDiscord, provider: FakeProvider,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    daemon, _adapter = await start()
    dm = fake.dm_channel_id(ALICE_ID)
    inter = await fake.dispatch_interaction("help", channel_id=dm, user_id=ALICE_ID)
    call = await fake.wait_for(lambda c: c.path.endswith(f"/{inter.token}/callback"))
    assert (call.json["data"]["content"], call.json["data"]["flags"]) == (help_text(), 64)  # only the asker sees it
    # A slow router answer: the interaction is deferred first, then the "thinking" message is edited.
    monkeypatch.setattr(DiscordAdapter, "DEFER_AFTER_S", 0.05)
    submit = daemon.router.submit

    async def slow_submit(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.2)
        return await submit(*args, **kwargs)

    monkeypatch.setattr(daemon.router, "submit", slow_submit)
    inter = await fake.dispatch_interaction("status", channel_id=TEXT_CHANNEL_ID, user_id=BOB_ID)
    edit = await fake.wait_for(lambda c: c.method == "PATCH" and inter.token in c.path)
    assert edit.path.endswith("/messages/@original") and edit.json["content"].startswith("Idle · queued: 0")
    callback = next(c for c in fake.sent if c.path.endswith(f"/{inter.token}/callback"))
    assert callback.json["type"] == 5
    inter = await fake.dispatch_interaction("new", channel_id=TEXT_CHANNEL_ID, user_id=BOB_ID)
    edit = await fake.wait_for(lambda c: c.method == "PATCH" and inter.token in c.path)
    assert edit.json["content"].startswith("Started a new conversation")
    assert provider.connections == [] and bot_messages(fake, dm) == []


async def test_follow_up_interrupts(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.03, 40
    await start()
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "first", author_id=ALICE_ID)
    await eventually(lambda: bot_messages(fake, dm), what="the first stream")
    provider.words = 2
    second = await fake.dispatch_message(dm, "second", author_id=ALICE_ID)
    reply = await reply_with(fake, dm, answer("second", 2))
    assert reply["message_reference"]["message_id"] == str(second)
    first = bot_messages(fake, dm)[0]
    assert first["content"].endswith("⏹ interrupted: user sent a new message")
    sent = provider.requests_for("second")[0].body["messages"]
    assert sent[-2]["role"] == "assistant"
    assert sent[-2]["content"].endswith("[interrupted by user: user sent a new message]")


# --- long replies, rate limits, failures -------------------------------------------------------


async def test_long_reply_split_with_code_fences(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    code = "\n".join(f"result_{i} = compute({i}) * 2  # padding to make lines long" for i in range(50))
    text = f"Here is the code:\n\n```python\n{code}\n```\n\nThat is all."
    provider.then(Script(text=text, delay_s=0.0))
    await start()
    dm = fake.dm_channel_id(ALICE_ID)
    mid = await fake.dispatch_message(dm, "write code", author_id=ALICE_ID)
    parts = await eventually(lambda: (ms := bot_messages(fake, dm)) and "That is all." in ms[-1]["content"] and ms,
                             what="the last part")
    await asyncio.sleep(0.1)  # nothing more arrives
    parts = bot_messages(fake, dm)
    assert len(parts) == 2
    assert all(len(p["content"]) <= 2000 and p["content"].count("```") % 2 == 0 for p in parts)
    assert parts[1]["content"].startswith("```python\n")
    assert parts[0]["message_reference"]["message_id"] == str(mid) and "message_reference" not in parts[1]
    joined = "\n".join(p["content"] for p in parts)
    assert all(joined.count(f"result_{i} = compute({i})") == 1 for i in range(50))


async def test_rate_limits_on_send_and_edit(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.01, 20
    await start()
    fake.fail_next("POST", "/channels/*/messages", status=429, retry_after=0.1)
    fake.fail_next("PATCH", "/channels/*/messages/*", status=429, retry_after=0.1, times=2)
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "busy", author_id=ALICE_ID)
    await reply_with(fake, dm, answer("busy", 20))
    writes = [(c.method, c.status) for c in fake.sent if c.channel_id == dm and c.method in ("POST", "PATCH")
              and "/messages" in c.path]
    assert writes[:2] == [("POST", 429), ("POST", 200)] and ("PATCH", 429) in writes
    assert len(bot_messages(fake, dm)) == 1


async def test_failed_edit_is_not_a_new_message(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 15
    await start()
    fake.fail_next("PATCH", "/channels/*/messages/*", status=400)
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "edit me", author_id=ALICE_ID)
    await reply_with(fake, dm, answer("edit me", 15))
    assert ("PATCH", 400) in [(c.method, c.status) for c in fake.sent]
    assert len(bot_messages(fake, dm)) == 1


# --- connection -------------------------------------------------------------------------------


@pytest.mark.parametrize("resumable", [True, False], ids=["resume", "reidentify"])
async def test_gateway_drop(start: Start, fake: FakeDiscord, provider: FakeProvider, resumable: bool) -> None:
    provider.delay_s, provider.words = 0.03, 30
    _daemon, adapter = await start()
    await fake.dispatch_message(TEXT_CHANNEL_ID, "before", author_id=ALICE_ID, mentions_bot=True)
    streaming = (await eventually(lambda: bot_messages(fake, TEXT_CHANNEL_ID), what="the stream"))[0]
    await fake.drop_gateway(resumable=resumable)
    await fake.wait_connected()
    # The stream keeps editing the message it started before the drop.
    done = await reply_with(fake, TEXT_CHANNEL_ID, answer("before", 30))
    assert done["id"] == streaming["id"] and len(bot_messages(fake, TEXT_CHANNEL_ID)) == 1
    await eventually(lambda: adapter.health().ok, what="healthy again")
    provider.words = 1
    # A reply to the pre-drop message still counts as addressed (the adapter remembers its messages).
    await fake.dispatch_message(TEXT_CHANNEL_ID, "after", author_id=ALICE_ID, reference_message_id=int(done["id"]))
    await reply_with(fake, TEXT_CHANNEL_ID, answer("after", 1))
    assert (fake.identify_count, fake.resume_count) == ((1, 1) if resumable else (2, 0))


async def test_shutdown_marks_streams_interrupted(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.03, 40
    daemon, adapter = await start()
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "long one", author_id=ALICE_ID)
    await eventually(lambda: bot_messages(fake, dm), what="the stream")
    await adapter.stop()  # as Daemon.stop does: intake first, then the router
    await fake.dispatch_message(dm, "too late", author_id=ALICE_ID)
    await daemon.router.shutdown(GATEWAY_RESTART)
    assert bot_messages(fake, dm)[0]["content"].endswith("⏹ interrupted: gateway restart")
    assert adapter.client.is_closed() and adapter.health() == Health(False, "stopped")
    assert provider.requests_for("too late") == []


async def test_login_retried_after_a_transient_failure(start: Start, fake: FakeDiscord, provider: FakeProvider,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DiscordAdapter, "LOGIN_RETRY_S", 0.05)
    fake.fail_next("GET", "/users/@me", status=400)
    _daemon, adapter = await start()
    # The REST client's login failed and was retried; then the gateway shard's client logged in.
    assert [c.status for c in fake.requests if c.path == "/users/@me"] == [400, 200, 200]
    assert adapter.health().ok
    await fake.dispatch_message(fake.dm_channel_id(ALICE_ID), "still there?", author_id=ALICE_ID)
    await reply_with(fake, fake.dm_channel_id(ALICE_ID), answer("still there?", provider.words))


# --- access and secrets -----------------------------------------------------------------------


async def test_pairing_flow(start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.words = 1
    daemon, _adapter = await start(access="pairing")
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "hi there", author_id=ALICE_ID)
    notice = (await eventually(lambda: bot_messages(fake, dm), what="the pairing notice"))[0]["content"]
    found = re.search(r"\b([2-9A-HJ-NP-Z]{8})$", notice)
    assert found, notice
    await fake.dispatch_message(dm, "hello?", author_id=ALICE_ID)  # nothing more: notices are throttled
    inter = await fake.dispatch_interaction("status", channel_id=dm, user_id=ALICE_ID)
    call = await fake.wait_for(lambda c: c.path.endswith(f"/{inter.token}/callback"))
    assert call.json["data"]["content"] == "Sorry, you cannot use this bot yet."
    assert provider.connections == [] and len(bot_messages(fake, dm)) == 1
    env = {**os.environ, "SWITCHBOARD_STORE__DATA_DIR": daemon.config.store.data_dir}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "pairing", "approve", found[1],
                                                env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, out + err
    await fake.dispatch_message(dm, "now?", author_id=ALICE_ID)
    await reply_with(fake, dm, answer("now?", 1))
    assert [c.last_user for c in provider.connections] == ["now?"]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.raw: list[str] = []
        self.formatted: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.raw.append(record.getMessage() + repr(record.args) + str(record.exc_info))
        self.formatted.append(self.format(record))


@pytest.fixture
def logs() -> Iterator[_Capture]:
    root = logging.getLogger()
    handler, level = _Capture(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.mark.parametrize("fake", [{"token": SECRET_TOKEN}], indirect=True)
async def test_rejected_token_is_never_logged(fake: FakeDiscord, make_daemon: DaemonFactory,
                                              logs: _Capture) -> None:
    wrong = SECRET_TOKEN + "-revoked"
    daemon = await make_daemon(discord={"token": wrong})
    health = (await daemon.readiness())["discord"]
    ok, detail = health.ok, health.detail
    assert not ok and "token was rejected" in detail
    assert fake.requests[0].status == 401
    assert any("token was rejected" in line for line in logs.formatted)
    everything = json.dumps([logs.raw, logs.formatted, detail])
    assert wrong not in everything and SECRET_TOKEN not in everything


@pytest.mark.parametrize("fake", [{"token": SECRET_TOKEN}], indirect=True)
async def test_token_absent_from_error_logs(start: Start, fake: FakeDiscord, provider: FakeProvider,
                                            logs: _Capture) -> None:
    provider.words = 1
    await start()
    fake.fail_next("POST", "/channels/*/messages", status=403, times=10)
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "fail please", author_id=ALICE_ID)
    await eventually(lambda: any("send failed: HTTP 403" in line for line in logs.formatted), what="the error log")
    everything = json.dumps([logs.raw, logs.formatted])
    assert SECRET_TOKEN not in everything


async def test_a_message_deleted_mid_stream_is_continued_in_a_new_one(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 60
    await start()
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "go on", author_id=ALICE_ID)
    first = await eventually(lambda: next((m for m in bot_messages(fake, dm) if "w5" in m["content"]), None),
                             what="the stream")
    assert await fake.delete_message(int(first["id"]))
    last = await reply_with(fake, dm, answer("go on", 60)[len(first["content"]):])  # the rest, no more
    assert [m["id"] for m in bot_messages(fake, dm)] == [last["id"]] and last["id"] != first["id"]
    assert [c.status for c in fake.sent if c.method == "PATCH" and c.status == 404]  # 10008 was seen


async def test_a_refused_part_is_split_smaller_and_everything_arrives(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    lines = [f"line {i:03d} " + "x" * 60 for i in range(80)]  # about 5,500 characters
    provider.then(Script(text="\n".join(lines), delay_s=0.0))
    await start()
    fake.fail_next("POST", "/channels/*/messages", status=400, times=2)  # Invalid Form Body, twice
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "write a lot", author_id=ALICE_ID)
    await eventually(lambda: any(lines[-1] in m["content"] for m in bot_messages(fake, dm)), 5, "the last line")
    parts = [m["content"] for m in bot_messages(fake, dm)]
    seen = [line.rstrip() for part in parts for line in part.split("\n") if line.startswith("line ")]
    assert seen == lines and all(len(p) <= 2000 for p in parts)
    assert [c.status for c in fake.sent if c.method == "POST" and "/messages" in c.path][:2] == [400, 400]
    assert not [p for p in parts if "could not be delivered" in p]


async def test_a_running_tool_shows_a_status_line_in_the_streaming_message(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.words = 2
    provider.then(Script(tool_calls=[("sleep", {"seconds": 2.2})]))
    await start()
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "take your time", author_id=ALICE_ID, author_name="alice")
    seen: list[str] = []

    def finished() -> bool:
        for m in bot_messages(fake, dm):
            if m["content"] not in seen:
                seen.append(m["content"])
        return any(m["content"] == answer("take your time", 2) for m in bot_messages(fake, dm))

    await eventually(finished, 10, "the answer after the tool")
    ticks = [int(m[1]) for t in seen if (m := re.search(r"⏳ running `sleep 2\.2` · (\d) s$", t))]
    assert 0 in ticks and 1 in ticks, seen  # shown at once, then brought up to date
    assert len(bot_messages(fake, dm)) == 1  # the line lived in the answer's own message
