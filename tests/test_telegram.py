"""The Telegram adapter end to end: the real daemon and python-telegram-bot against the fake Bot API."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import logging
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from telegram.error import BadRequest, Conflict, InvalidToken, NetworkError, RetryAfter

from gateway.core.logs import JsonFormatter
from gateway.core.ports import Health
from gateway.core.router import MEDIA_ONLY as MEDIA_NOTICE
from gateway.ops.daemon import Daemon
from platforms.splitting import utf16_len
from platforms.telegram_bot import TelegramAdapter
from platforms.telegram_transport import failure
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider, Script
from tests.fakes.telegram_api import ApiError, FakeTelegramAPI, SentRecord

TOKEN = "123456:TEST-TOKEN-never-in-logs"
BOT = "switchboard_bot"
Start = Callable[..., Awaitable[tuple[Daemon, TelegramAdapter]]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegramAPI]:
    async with FakeTelegramAPI(TOKEN, username=BOT) as api:
        yield api


@pytest.fixture
def start(fake: FakeTelegramAPI, make_daemon: DaemonFactory) -> Start:
    """Start a daemon with Telegram pointed at the fake (set up after it, so stopped before it)."""

    async def go(router: dict[str, object] | None = None, **telegram: object) -> tuple[Daemon, TelegramAdapter]:
        config: dict[str, object] = {"token": fake.token, "base_url": fake.base_url,
                                     "base_file_url": fake.base_file_url, "access": "open",
                                     "edit_interval_s": 0.05, "poll_timeout_s": 1,
                                     "streaming": "edit", **telegram}  # drafts: test_telegram_streaming.py
        daemon = await make_daemon(telegram=config, **({"router": router} if router else {}))
        adapter = daemon.adapters["telegram"]
        assert isinstance(adapter, TelegramAdapter)
        await asyncio.wait_for(adapter.ready.wait(), 5)
        return daemon, adapter

    return go


async def shown(fake: FakeTelegramAPI, chat: int, pred: Callable[[str], bool], timeout: float = 5.0) -> int:
    """Wait until one of the bot's messages in `chat` satisfies `pred`; returns its id."""
    def hit() -> int | None:
        return next((mid for mid, text in fake.messages(chat).items() if pred(text)), None)

    try:
        await fake.wait_until(lambda: hit() is not None, timeout)
    except TimeoutError:
        raise AssertionError(f"nothing matched in chat {chat}: {fake.messages(chat)}") from None
    mid = hit()
    assert mid is not None
    return mid


async def settled(daemon: Daemon, timeout: float = 3.0) -> None:
    """Wait until no turn is running or queued (outcomes recorded)."""
    for _ in range(int(timeout / 0.02)):
        if not daemon.router.sessions():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"turns still running: {daemon.router.sessions()}")


def bot_sends(fake: FakeTelegramAPI, chat: int) -> list[SentRecord]:
    return [r for r in fake.sent if r.chat_id == chat and r.method == "sendMessage"]


def mention(text: str) -> list[dict[str, Any]]:
    at = text.index("@" + BOT)
    return [{"type": "mention", "offset": utf16_len(text[:at]), "length": len(BOT) + 1}]


async def test_dm_round_trip(start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.25, 2  # a slow first token: typing shows meanwhile
    _daemon, adapter = await start()
    update_id = fake.push_text(42, "hello", user_id=42, username="alice")
    mid = await shown(fake, 42, lambda t: t.endswith("w1 "))
    assert fake.messages(42) == {mid: "reply to: hello w0 w1 "}
    edits = [r for r in fake.sent if r.method == "editMessageText"]
    assert edits and all(r.message_id == mid for r in edits)
    texts = [r.text for r in fake.sent if r.message_id == mid]
    assert all(a != b for a, b in itertools.pairwise(texts)), "unchanged text re-sent"
    assert any(r.method == "sendChatAction" and r.text == "typing" for r in fake.sent)
    assert [c["command"] for c in fake.commands()] == ["stop", "new", "reset", "status", "busy", "jobs", "kill", "help"]
    delete = next(c for c in fake.calls if c.method == "deleteWebhook")
    assert not delete.params.get("drop_pending_updates")
    await fake.wait_until(lambda: bool(fake.polls) and (fake.polls[-1].offset or 0) > update_id)
    assert fake.pending_updates == [] and fake.polls[-1].allowed_updates == ["message", "callback_query"]
    assert adapter.health() == Health(True, "polling")
    assert "reply_parameters" not in fake.sent[-1].params  # no quoting in private chats


async def test_group_answers_mentions_replies_and_its_commands_only(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 2
    await start()
    group = -100200
    fake.push_text(group, "hello everyone", user_id=7)
    fake.push_text(group, "/stop@other_bot", user_id=7)
    fake.push_text(group, "/weather", user_id=7)  # some other bot's command
    robot = fake.user_message(group, user_id=8, text=f"@{BOT} hi from a bot", entities=mention(f"@{BOT} hi"))
    robot["from"]["is_bot"] = True
    fake.push_update({"message": robot})
    text = f"@{BOT} what is up"
    fake.push_text(group, text, user_id=7, entities=mention(text))
    first = await shown(fake, group, lambda t: t == "reply to: what is up w0 w1 ")
    assert [c.last_user for c in provider.connections] == ["what is up"]  # mention stripped
    asked = fake.message(group, first)
    assert asked is not None and asked["reply_to_message"]["text"] == text  # quotes the question in groups

    fake.push_text(group, "and more?", user_id=7, reply_to=fake.message(group, first))
    await shown(fake, group, lambda t: t.startswith("reply to: and more?"))
    fake.push_text(group, f"/status@{BOT}", user_id=7)
    await shown(fake, group, lambda t: "agent:" in t)  # the /status answer
    assert [c.last_user for c in provider.connections] == ["what is up", "and more?"]
    assert len(fake.messages(group)) == 3


async def test_group_all_mode_and_forum_topics_reply_in_their_topic(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.01, 5
    daemon, _ = await start(groups="all")
    forum = -1001234567890
    fake.push_text(forum, "in topic 77", user_id=9, chat_type="supergroup", message_thread_id=77)
    fake.push_text(forum, "in topic 78", user_id=9, chat_type="supergroup", message_thread_id=78)
    await shown(fake, forum, lambda t: t == "reply to: in topic 77 w0 w1 w2 w3 w4 ")
    await shown(fake, forum, lambda t: t == "reply to: in topic 78 w0 w1 w2 w3 w4 ")
    for mid, text in fake.messages(forum).items():
        msg = fake.message(forum, mid)
        assert msg is not None and msg["message_thread_id"] == int(text.split()[-6])
    assert {(r.method, r.message_thread_id) for r in fake.sent if r.chat_id == forum} <= {
        ("sendMessage", 77), ("sendMessage", 78), ("editMessageText", None),
        ("sendChatAction", 77), ("sendChatAction", 78)}
    await settled(daemon)
    history = [(await daemon.store.conversation(f"telegram:group:{forum}:{t}"))[1] for t in (77, 78)]
    assert [len(h) for h in history] == [2, 2]  # one session per topic


async def test_media_the_model_cannot_read_gets_a_reason_and_captions_count_as_text(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    await start()  # vision off (the default): photos are refused, with the reason
    fake.push_photo(42, user_id=42)
    voice = fake.user_message(42, user_id=42, voice={"file_id": "v1", "file_unique_id": "u1", "duration": 2})
    fake.push_update({"message": voice})
    sticker = fake.user_message(42, user_id=42, sticker={
        "file_id": "s1", "file_unique_id": "us1", "type": "regular", "width": 1, "height": 1,
        "is_animated": False, "is_video": False})
    fake.push_update({"message": sticker})
    fake.push_photo(42, user_id=42, caption="look at this")
    await shown(fake, 42, lambda t: t.startswith("reply to: look at this"))
    notices = [r.text or "" for r in bot_sends(fake, 42)][:4]
    assert re.fullmatch(r"I could not read photo_\d+\.jpg: this model cannot see images\.", notices[0])
    assert re.fullmatch(r"I could not read voice_\d+: audio/ogg files are not supported \(text files only\)\.",
                        notices[1])
    assert notices[2] == MEDIA_NOTICE  # a sticker is not a file at all
    assert re.fullmatch(r"I could not read photo_\d+\.jpg: this model cannot see images\.", notices[3])
    (asked,) = provider.connections
    assert asked.last_user.startswith("look at this\n[image not read: photo_")
    assert asked.last_user_parts == []  # nothing but text went to the model


async def test_stop_mid_stream_leaves_other_chats_alone(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.04, 40
    await start()
    group = -100301
    text = f"@{BOT} one"
    fake.push_text(group, text, user_id=1, entities=mention(text))
    fake.push_text(2, "two", user_id=2)
    await shown(fake, group, lambda t: "w2" in t)
    await shown(fake, 2, lambda t: "w2" in t)
    fake.push_text(group, f"/stop@{BOT}", user_id=1)  # the group form of the command
    (one,) = provider.requests_for("one")
    await provider.wait_closed(one, timeout=2)
    assert not one.completed
    await shown(fake, group, lambda t: t.startswith("reply to: one") and t.endswith("⏹ stopped"))
    await shown(fake, group, lambda t: t == "Stopped.")
    final = await shown(fake, 2, lambda t: t.endswith("w39 "), timeout=5)
    (two,) = provider.requests_for("two")
    assert two.completed and "stopped" not in fake.messages(2)[final]


async def test_a_follow_up_interrupts_with_the_user_reason(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 40
    await start()
    fake.push_text(5, "first", user_id=5)
    await shown(fake, 5, lambda t: "w1" in t)
    provider.delay_s = 0.0
    fake.push_text(5, "second", user_id=5)
    await shown(fake, 5, lambda t: t.startswith("reply to: second") and t.endswith("w39 "))
    (first,) = provider.requests_for("first")
    await provider.wait_closed(first, timeout=2)
    assert not first.completed
    (second,) = provider.requests_for("second")
    assert "[interrupted by user: user sent a new message]" in json.dumps(second.body["messages"])
    await shown(fake, 5, lambda t: t.startswith("reply to: first") and
                t.endswith("⏹ interrupted: user sent a new message"))


async def test_long_replies_split_into_utf16_parts_with_balanced_code_fences(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    lines = [f"row_{i} = '😀 {i}'" for i in range(700)]
    long = "Here is the code:\n\n```python\n" + "\n".join(lines) + "\n```\n\nThe end."
    assert utf16_len(long) > 2 * 4096
    provider.then(Script(text=long, delay_s=0.0))
    await start()
    fake.push_text(3, "write it", user_id=3)
    await shown(fake, 3, lambda t: t.rstrip().endswith("The end."), timeout=8)
    await asyncio.sleep(0.2)  # let the last edits land
    parts = [fake.message(3, mid) for mid in sorted(fake.messages(3))]
    assert len(parts) >= 3
    seen: list[str] = []
    for part in parts:
        assert part is not None and utf16_len(part["text"]) <= 4096
        pres = [e for e in part.get("entities", []) if e["type"] == "pre"]
        if "row_" in part["text"]:
            assert [p.get("language") for p in pres] == ["python"], "every code part renders as python code"
        seen += re.findall(r"row_\d+ = '😀 \d+'", part["text"])
    assert seen == lines  # nothing lost, nothing repeated
    assert all("```" not in (p or {}).get("text", "") for p in parts)


async def test_rejected_html_is_resent_as_plain_text(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.then(Script(text="**bold** <tag> & stuff", delay_s=0.1))
    await start()
    fake.fail_next("sendMessage", 400, description="Bad Request: can't parse entities: Unsupported start tag")
    fake.push_text(6, "format", user_id=6)
    mid = await shown(fake, 6, lambda t: t.startswith("**bold**"))
    failed = [c for c in fake.calls if c.method == "sendMessage" and c.status == 400]
    assert len(failed) == 1 and failed[0].params["parse_mode"] == "HTML"
    first = bot_sends(fake, 6)[0]
    assert first.parse_mode is None and first.text is not None and first.text.startswith("**bold**")
    await shown(fake, 6, lambda t: t == "bold <tag> & stuff ")  # later edits are HTML again
    assert len(fake.messages(6)) == 1
    msg = fake.message(6, mid)
    assert msg is not None and msg["entities"] == [{"type": "bold", "offset": 0, "length": 4}]


@pytest.mark.filterwarnings("ignore:.*retry_after.*")  # PTB 22 warns when it builds RetryAfter
async def test_429_on_send_and_edit_still_delivers_the_final_text(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.04, 40
    await start()
    fake.fail_next("sendMessage", 429, retry_after=1)
    fake.push_text(8, "slowly", user_id=8)
    await shown(fake, 8, lambda t: t.startswith("reply to"))
    fake.fail_next("editMessageText", 429, retry_after=1)
    await fake.wait_until(lambda: any(c.method == "editMessageText" and c.status == 429 for c in fake.calls))
    mid = await shown(fake, 8, lambda t: t.endswith("w39 "), timeout=6)
    assert list(fake.messages(8)) == [mid], "a failed call must never become an extra message"
    limited = [c.time for c in fake.calls if c.status == 429]
    after = [r.time for r in fake.sent if r.chat_id == 8 and r.method != "sendChatAction"]
    for t in limited:  # the chat's gate honoured retry_after: nothing was sent to it meanwhile
        assert not [s for s in after if t < s < t + 0.95]


async def test_409_conflict_degrades_health_logs_once_and_backs_off(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    provider.delay_s, provider.words = 0.0, 1
    caplog.set_level(logging.INFO, logger="platforms.telegram_bot")
    daemon, adapter = await start()
    await fake.wait_until(lambda: fake.poll_count >= 1)
    before = fake.poll_count
    fake.conflict_polling(True)
    await asyncio.sleep(1.2)
    assert fake.poll_count - before <= 3, "tight retry loop"
    ok, reason = adapter.health().ok, adapter.health().detail
    assert not ok and "409" in reason and "another process is polling" in reason
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{daemon.config.http.port}/readyz") as resp:
        body = await resp.json()
    assert resp.status == 503 and body["checks"]["telegram"]["ok"] is False
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "another process" in r.getMessage()]
    assert len(errors) == 1
    fake.conflict_polling(False)
    fake.push_text(4, "back", user_id=4)
    await shown(fake, 4, lambda t: t == "reply to: back w0 ", timeout=3)
    assert adapter.health() == Health(True, "polling")
    assert any("connection restored" in r.getMessage() for r in caplog.records)


async def test_webhook_checks_the_secret_token(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    secret = "s3cret-webhook-token"
    daemon, adapter = await start(mode="webhook", webhook_url="https://example.test/tg", secret_token=secret)
    assert fake.webhook["url"] == "https://example.test/tg" and fake.webhook["secret_token"] == secret
    assert fake.webhook["allowed_updates"] == ["message", "callback_query"] and adapter.health().ok
    url = f"http://127.0.0.1:{daemon.config.http.port}/telegram/webhook"

    def update(text: str) -> dict[str, Any]:
        return {"message": fake.user_message(11, user_id=11, text=text)}

    assert await fake.post_webhook(url, update("no secret")) == 401
    assert await fake.post_webhook(url, update("wrong secret"), secret_token="nope") == 401
    assert await fake.post_webhook(url, update("right secret"), secret_token=secret) == 200
    await shown(fake, 11, lambda t: t == "reply to: right secret w0 ")
    assert [c.last_user for c in provider.connections] == ["right secret"]
    assert fake.poll_count == 0


async def test_pairing_flow_end_to_end(start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    daemon, _ = await start(access="pairing")
    fake.push_text(99, "hello", user_id=99, first_name="Zoe")
    notice = await shown(fake, 99, lambda t: "pairing code" in t)
    match = re.search(r"\b([2-9A-Z]{8})$", fake.messages(99)[notice])
    assert match is not None
    await asyncio.sleep(0.1)
    assert provider.connections == [] and len(fake.messages(99)) == 1
    assert not [r for r in fake.sent if r.chat_id == 99 and r.method == "sendChatAction"]

    env = {**os.environ, "SWITCHBOARD_STORE__DATA_DIR": daemon.config.store.data_dir}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "pairing", "approve", match.group(1), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert b"approved Zoe (telegram:99)" in out
    fake.push_text(99, "hello again", user_id=99, first_name="Zoe")
    await shown(fake, 99, lambda t: t == "reply to: hello again w0 ")
    assert [c.last_user for c in provider.connections] == ["hello again"]


async def test_restart_between_fetch_and_processing_loses_nothing(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    """B is recorded (queued behind A) but its offset is never confirmed; the daemon restarts."""
    provider.delay_s, provider.words = 0.05, 100
    provider.by_text["B"] = Script(text="answer to B", delay_s=0.0)
    first, _ = await start(router={"busy": "queue"})
    fake.push_text(12, "A", user_id=12)
    await shown(fake, 12, lambda t: t.startswith("reply to: A"))
    # The poll after B is stored and the confirm on stop fail: a crash, in effect. (Set before B
    # arrives: intake does not wait for B's "Queued" notice, so the next poll follows at once.)
    fake.fail_next("getUpdates", 502, times=3)
    b_update = fake.push_text(12, "B", user_id=12)
    await shown(fake, 12, lambda t: t.startswith("Queued"))
    await first.stop()
    assert b_update in [u["update_id"] for u in fake.pending_updates]
    assert provider.requests_for("B") == []

    provider.delay_s, provider.words = 0.0, 2  # whatever the router resumes of A, quickly
    await start(router={"busy": "queue"})  # same data dir, same fake
    await shown(fake, 12, lambda t: t == "answer to B ")
    await fake.wait_until(lambda: fake.pending_updates == [])  # the refetched update was confirmed
    await asyncio.sleep(0.2)
    assert len(provider.requests_for("B")) == 1
    assert sum(t.startswith("answer to B") for t in fake.messages(12).values()) == 1


async def test_the_token_never_reaches_logs_or_health(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())  # the daemon's own formatter, redactor included
    ours: list[str] = []  # our own records, before any redaction

    class Raw(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name.startswith("platforms."):
                ours.append(record.getMessage())

    raw = Raw()
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in ("", "httpx", "telegram")}
    root.addHandler(handler)
    root.addHandler(raw)
    for name in levels:
        logging.getLogger(name).setLevel(logging.DEBUG)  # httpx logs every URL, token included
    try:
        fake.fail_next("getMe", 401, description="Unauthorized")  # PTB: "The token `…` was rejected"
        fake.fail_next("getUpdates", 502, description="Bad Gateway")
        fake.fail_next("sendMessage", 403, description="Forbidden: bot was blocked by the user")
        _daemon, adapter = await start()
        fake.push_photo(13, user_id=13)  # the media notice hits the 403
        fake.push_text(13, "hi", user_id=13)
        await shown(fake, 13, lambda t: t == "reply to: hi w0 ")
        assert TOKEN not in adapter.health().detail
    finally:
        root.removeHandler(handler)
        root.removeHandler(raw)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    logged = buffer.getvalue()
    assert "rejected the bot token" in logged and "Forbidden" in logged and "Bad Gateway" in logged
    assert "***" in logged  # there was something to redact
    assert TOKEN not in logged
    assert ours and not [line for line in ours if TOKEN in line]


async def test_stopping_during_a_long_poll_is_prompt(start: Start, fake: FakeTelegramAPI) -> None:
    daemon, _ = await start(poll_timeout_s=30)
    await fake.wait_until(lambda: fake.poll_count >= 1)
    began = time.monotonic()
    await daemon.stop()
    assert time.monotonic() - began < 2


# --- intake never waits on outbound; stops jump the queue --------------------------------------


async def test_a_slow_chat_never_delays_another_chats_stop(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    """Sends to chat A take 3 s; /stop in chat A, then in other chats: each handled at once."""
    provider.delay_s, provider.words = 0.02, 1000
    daemon, _ = await start()
    slow, others = 601, [602, 603, 604]
    fake.set_latency(slow, 3.0)
    fake.push_text(slow, "slow one", user_id=slow)
    for chat in others:
        fake.push_text(chat, f"quick {chat}", user_id=chat)
    for chat in others:
        await shown(fake, chat, lambda t: "w3" in t)
    (slow_conn,) = provider.requests_for("slow one")
    assert fake.messages(slow) == {}, "A's first send is still on the wire"
    fake.push_text(slow, "/stop", user_id=slow)  # its "Stopped." waits behind A's send, not intake
    latencies = []
    for chat in others:
        (conn,) = provider.requests_for(f"quick {chat}")
        pushed = time.perf_counter()
        fake.push_text(chat, "/stop", user_id=chat)
        latencies.append(await provider.wait_closed(conn, timeout=2) - pushed)
        await shown(fake, chat, lambda t: t == "Stopped.")
    print(f"/stop beside a 3 s chat: provider closed {[f'{x * 1000:.1f} ms' for x in latencies]} after the update")
    assert max(latencies) < 0.1
    await provider.wait_closed(slow_conn, timeout=2)
    # Chat A is told too, once its own calls get through: "Stopped.", and its message marked.
    await shown(fake, slow, lambda t: t == "Stopped.", timeout=15)
    marked = await shown(fake, slow, lambda t: t.endswith("\n\n⏹ stopped"), timeout=15)
    fake.set_latency(slow, 0)
    await settled(daemon)
    _, history = await daemon.store.conversation(f"telegram:dm:{slow}")
    assert history[-1].content + "\n\n⏹ stopped" == fake.messages(slow)[marked]  # as shown, no more


@pytest.mark.filterwarnings("ignore:.*retry_after.*")  # PTB 22 warns when it builds RetryAfter
async def test_a_stop_under_the_group_limit_goes_out_next_and_the_transcript_is_what_was_shown(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    fake.clock = time.perf_counter  # the provider's clock: a stop and the chat's calls compare
    group, window = -100700, 3.0
    fake.set_group_limit(4, window_s=window)
    provider.delay_s, provider.words = 0.02, 1000
    for i in range(3):
        provider.by_text[f"short {i}"] = Script(text=f"short answer {i}", delay_s=0.0)
    daemon, _ = await start(groups="all")
    for i in range(3):  # three sends of the four the window allows
        fake.push_text(group, f"short {i}", user_id=7)
        await shown(fake, group, f"short answer {i} ".__eq__)
    fake.push_text(group, "long one", user_id=7)  # the fourth: the window is full from here on
    mid = await shown(fake, group, lambda t: "w10" in t)
    (conn,) = provider.requests_for("long one")
    fake.push_text(group, "/stop", user_id=7)
    stop_at = await provider.wait_closed(conn, timeout=2)
    notice = await fake.wait_for(lambda r: r.chat_id == group and r.text == "Stopped.", timeout=window + 3)
    mark = await fake.wait_for(lambda r: r.message_id == mid and (r.text or "").endswith("⏹ stopped"))
    assert [c for c in fake.calls if c.method == "sendMessage" and c.status == 429 and c.time > stop_at], \
        "the stop notice met the group limit"
    sends = sorted(r.time for r in fake.sent if r.chat_id == group and r.method == "sendMessage" and r.time < stop_at)
    allowed_at = sends[-4] + window  # the window frees up then (Telegram's retry_after: whole seconds)
    after = [r for r in fake.sent if r.chat_id == group and r.time > stop_at and r.method != "sendChatAction"]
    late = [r for r in after if r not in (notice, mark)]
    assert all(r.method == "editMessageText" and r.time - stop_at < 0.05 for r in late), \
        f"only an edit already on the wire may land after the stop: {late}"
    assert after.index(mark) <= len(late) and after.index(notice) <= len(late) + 1
    print(f"stop under the group limit: mark {1000 * (mark.time - stop_at):.0f} ms, "
          f"'Stopped.' {1000 * (notice.time - stop_at):.0f} ms after the stop "
          f"(the group's window allowed a send {1000 * (allowed_at - stop_at):.0f} ms after it)")
    assert mark.time - stop_at < 0.5 and allowed_at <= notice.time < allowed_at + 1.2
    await settled(daemon, timeout=5)
    _, history = await daemon.store.conversation(f"telegram:group:{group}")
    final = fake.messages(group)[mid]
    assert history[-1].content + "\n\n⏹ stopped" == final  # stored = what the chat shows


def _tokens(n: int) -> tuple[str, list[str]]:
    """A long answer whose raw HTML is much longer than its visible text (&, <, > escape)."""
    words = [f"t{i:04d}&<x>" for i in range(n)]
    lines = [" ".join(words[i:i + 12]) for i in range(0, n, 12)]
    code = "```python\n" + "\n".join(f"if a<b and c>d: print('{i}&')" for i in range(40)) + "\n```"
    text = "\n\n".join(lines[: len(lines) // 2]) + "\n\n" + code + "\n\n" + "\n\n".join(lines[len(lines) // 2:])
    return text, words


async def test_every_character_of_a_long_answer_arrives_when_telegram_counts_raw_html(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    fake.count_raw_html = True  # stricter than Telegram: the 4096 limit on the HTML as sent
    text, words = _tokens(900)
    assert len(text) > 10_000
    provider.then(Script(text=text, delay_s=0.0005))
    daemon, _ = await start()
    fake.push_text(9, "write it", user_id=9)
    await shown(fake, 9, lambda t: t.startswith(words[0]))
    await settled(daemon, timeout=30)
    parts = [fake.messages(9)[mid] for mid in sorted(fake.messages(9))]
    seen = [w for part in parts for w in re.findall(r"t\d{4}&<x>", part)]
    assert seen == words  # every word, once, in order
    code = [line for part in parts for line in part.split("\n") if line.startswith("if a<b")]
    assert code == [f"if a<b and c>d: print('{i}&')" for i in range(40)]
    assert any(c.status == 400 for c in fake.calls), "the old failure was reproduced"
    assert not [t for t in parts if "could not be delivered" in t]


async def test_a_part_that_cannot_be_sent_is_replaced_by_a_notice_and_the_rest_arrives(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(method: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        def handler(p: dict[str, Any]) -> Any:
            if "☠" in str(p.get("text")):
                raise ApiError(400, "Bad Request: MESSAGE_FORBIDDEN_CONTENT")
            return method(p)
        return handler

    fake.set_handler("sendMessage", refuse(fake._send_message))
    fake.set_handler("editMessageText", refuse(fake._edit_message_text))
    words = [f"w{i}" for i in range(600)]
    words[300] = "☠"
    provider.then(Script(text=" ".join(words), delay_s=0.001))
    daemon, _ = await start()
    fake.push_text(10, "go", user_id=10)
    await shown(fake, 10, lambda t: t.startswith("w0"))
    await settled(daemon, timeout=30)
    await shown(fake, 10, lambda t: t.lower() == "⚠️ part of this answer could not be delivered: "
                                                 "message_forbidden_content")
    texts = [fake.messages(10)[mid] for mid in sorted(fake.messages(10))]
    seen = [w for t in texts for w in t.split() if re.fullmatch(r"w\d+", w)]
    lost = sorted(set(words) - set(seen) - {"☠"}, key=lambda w: int(w[1:]))
    assert seen == [w for w in words if w in seen]  # in order, once
    at = sorted([300, *(int(w[1:]) for w in lost)])  # one run of words around the poison, under 256
    assert at == list(range(at[0], at[-1] + 1)) and at[0] - 1 <= 300 <= at[-1] + 1 and len(" ".join(lost)) < 256
    assert words[0] in seen and words[-1] in seen
    assert any("could not be delivered" in r.getMessage() and "forbidden_content" in r.getMessage().lower()
               for r in caplog.records if r.levelno == logging.WARNING)


async def test_a_message_deleted_mid_stream_is_continued_in_a_new_one(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 60
    daemon, _ = await start()
    fake.push_text(11, "go on", user_id=11)
    first = await shown(fake, 11, lambda t: "w5" in t)
    deleted = fake.messages(11)[first]
    assert fake.delete_message(11, first)
    last = await shown(fake, 11, lambda t: t.endswith("w59 "))
    assert last != first and list(fake.messages(11)) == [last]
    full = "reply to: go on " + " ".join(f"w{i}" for i in range(60)) + " "
    assert deleted + fake.messages(11)[last] == full  # the rest, from where the deleted one ended
    assert any(c.status == 400 and c.method == "editMessageText" for c in fake.calls)
    await settled(daemon)


def test_each_intake_failure_has_a_kind_a_level_and_a_text_without_the_token() -> None:
    def scrub(text: str) -> str:
        return text.replace(TOKEN, "***")

    polling = failure(Conflict("Conflict: terminated by other getUpdates request"), scrub)
    assert polling[:2] == ("conflict", logging.ERROR) and "another process is polling" in polling[2]
    assert "a webhook is set" in failure(Conflict("can't use getUpdates method while webhook is active"), scrub)[2]
    assert failure(InvalidToken(), scrub)[:2] == ("token", logging.ERROR)
    assert failure(RetryAfter(3), scrub)[:2] == ("flood", logging.WARNING)
    # PTB's BadRequest is a NetworkError, but about the request, not the connection.
    assert failure(BadRequest("chat not found"), scrub) == ("api", logging.WARNING, "Telegram error: chat not found")
    assert failure(NetworkError(f"bad gateway at /bot{TOKEN}/getUpdates"), scrub) == (
        "network", logging.WARNING, "cannot reach Telegram: bad gateway at /bot***/getUpdates")
    assert failure(KeyError("x"), scrub) == ("bug", logging.ERROR, "unexpected KeyError in the Telegram loop")


async def test_a_resumed_answer_in_a_group_quotes_the_question_it_continues(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    """A turn cut off by a restart is resumed as a message of the gateway's own, whose id no
    platform knows: its answer quoted nothing, and in a busy group read as an answer to nobody."""
    provider.delay_s, provider.words = 0.05, 200
    daemon, _ = await start()
    group = -100300
    text = f"@{BOT} tell me everything"
    fake.push_text(group, text, user_id=7, entities=mention(text))
    first = await shown(fake, group, lambda t: t.startswith("reply to: tell me everything w0 w1"))
    await daemon.stop()  # a restart: the turn is cut off, and resumed by the next start
    provider.delay_s, provider.words = 0.0, 3
    await start()
    await fake.wait_until(lambda: len(provider.connections) == 2, 10)
    await fake.wait_until(lambda: len(fake.messages(group)) == 2, 10)
    resumed = max(fake.messages(group))
    assert resumed != first
    quoted = fake.message(group, resumed)
    assert quoted is not None and quoted.get("reply_to_message", {}).get("text") == text
