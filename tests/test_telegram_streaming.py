"""Telegram's native streaming (sendMessageDraft) and the one-tap Stop button, end to end: the real
daemon and python-telegram-bot against the fake Bot API."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider, Script
from tests.fakes.telegram_api import FakeTelegramAPI, SentRecord
from tests.test_telegram import BOT, TOKEN, Start, mention, settled, shown
from tests.test_telegram import start as start_fixture


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegramAPI]:
    async with FakeTelegramAPI(TOKEN, username=BOT) as api:
        yield api


@pytest.fixture
def start(fake: FakeTelegramAPI, make_daemon: DaemonFactory) -> Start:
    return start_fixture.__wrapped__(fake, make_daemon)  # type: ignore[attr-defined, no-any-return]


def keyboard(fake: FakeTelegramAPI, chat: int, mid: int) -> list[str]:
    """The callback data of the buttons a message shows now."""
    msg = fake.message(chat, mid) or {}
    return [b.get("callback_data", "") for row in msg.get("reply_markup", {}).get("inline_keyboard", []) for b in row]


def stop_data(fake: FakeTelegramAPI, chat: int) -> tuple[int, str]:
    """The bot message in `chat` showing a Stop button, and the button's data."""
    for mid in fake.messages(chat):
        data = [d for d in keyboard(fake, chat, mid) if d.startswith("stop:")]
        if data:
            return mid, data[0]
    raise AssertionError(f"no Stop button in chat {chat}")


async def stop_button(fake: FakeTelegramAPI, chat: int, timeout: float = 5.0) -> tuple[int, str]:
    await fake.wait_until(lambda: any(any(d.startswith("stop:") for d in keyboard(fake, chat, mid))
                                      for mid in fake.messages(chat)), timeout)
    return stop_data(fake, chat)


async def answered(fake: FakeTelegramAPI, query: int, timeout: float = 5.0) -> Any:
    await fake.wait_until(lambda: fake.callback_answer(query) is not None, timeout)
    return fake.callback_answer(query)


def drafts_to(fake: FakeTelegramAPI, chat: int) -> list[SentRecord]:
    return [r for r in fake.sent if r.chat_id == chat and r.method == "sendMessageDraft"]


# --- drafts ---------------------------------------------------------------------------------------


async def test_a_dm_answer_streams_as_one_draft_and_ends_in_one_message(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.03, 30
    provider.by_text["hello"] = Script(think_s=0.5)  # the model takes a moment: "Thinking…" meanwhile
    daemon, _ = await start(streaming="draft", draft_interval_s=0.05)
    fake.push_text(42, "hello", user_id=42)
    final = "reply to: hello " + " ".join(f"w{i}" for i in range(30)) + " "
    await shown(fake, 42, final.__eq__)
    await fake.wait_until(lambda: len(fake.messages(42)) == 1)  # the status message is gone
    (draft,) = fake.draft_history(42)  # one draft for the turn...
    assert draft.ended == "message"  # ...replaced by the answer's message
    texts = [u.text for u in draft.updates]
    assert texts[0] == "" and len(texts) > 3, texts  # "Thinking…" first, then the text as it grew
    assert all(final.startswith(t.rstrip()) for t in texts)
    assert not [r for r in fake.sent if r.chat_id == 42 and r.method == "editMessageText"]  # no edits
    (mid,) = fake.messages(42)
    assert keyboard(fake, 42, mid) == []  # the final message carries no button
    status = next(r for r in fake.sent if r.chat_id == 42 and r.method == "sendMessage")
    assert status.params.get("disable_notification") and status.time <= draft.updates[0].time, \
        "the Stop button's status message comes first (a later message would replace the draft), silently"
    assert [r.method for r in fake.sent if r.chat_id == 42][-1] == "deleteMessage"
    await settled(daemon)
    _, history = await daemon.store.conversation("telegram:dm:42")
    assert history[-1].content == final


async def test_a_quiet_turn_keeps_its_draft_alive_past_its_lifetime(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    fake.draft_ttl_s = 1.5
    provider.by_text["think"] = Script(text="done thinking", think_s=3.5, delay_s=0.0)
    await start(streaming="draft", draft_refresh_s=0.2, stop_button=False)
    fake.push_text(42, "think", user_id=42)
    await shown(fake, 42, "done thinking ".__eq__, timeout=10)
    (draft,) = fake.draft_history(42)  # never expired: one bubble, then the message
    assert draft.ended == "message"
    quiet = [u for u in draft.updates if u.text == ""]
    assert quiet[-1].time - quiet[0].time > fake.draft_ttl_s, "the wait outlasted a draft's life"
    assert len(quiet) >= 5  # refreshed all along
    assert fake.messages(42) == {min(fake.messages(42)): "done thinking "}  # no status message


async def test_a_long_answer_drafts_its_last_part_and_is_sent_split(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    body = " ".join(f"word{i:05d}" for i in range(1200))  # ~12 000 characters: three messages
    provider.by_text["long"] = Script(text=body, delay_s=0.0005)
    await start(streaming="draft", draft_interval_s=0.02, stop_button=False)
    fake.push_text(42, "long", user_id=42)
    await fake.wait_until(lambda: "word01199" in "".join(fake.messages(42).values()), timeout=20)
    assert all(len(r.params.get("text", "")) <= 4096 for r in drafts_to(fake, 42))
    parts = [fake.messages(42)[m] for m in sorted(fake.messages(42))]
    assert len(parts) >= 3 and " ".join(p.strip() for p in parts) == body


async def test_groups_stream_by_edits_with_a_stop_button_and_the_final_has_none(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.03, 30
    await start(streaming="draft")
    group = -100901
    text = f"@{BOT} hi"
    fake.push_text(group, text, user_id=5, entities=mention(text))
    mid, _data = await stop_button(fake, group)
    assert fake.messages(group)[mid].startswith("reply")
    await shown(fake, group, lambda t: t.endswith("w29 "))
    await fake.wait_until(lambda: keyboard(fake, group, mid) == [])
    assert not [c for c in fake.calls if c.method == "sendMessageDraft"]
    edits = [r for r in fake.sent if r.chat_id == group and r.method == "editMessageText"]
    assert edits and "reply_markup" not in edits[-1].params


async def test_a_refused_draft_falls_back_to_edits_and_is_remembered(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    fake.drafts_enabled = False  # as Telegram answers where drafts are not accepted
    provider.delay_s, provider.words = 0.03, 20
    daemon, _ = await start(streaming="draft", draft_interval_s=0.05)
    fake.push_text(43, "first", user_id=43)
    await shown(fake, 43, lambda t: t.endswith("w19 "))
    await fake.wait_until(lambda: len(fake.messages(43)) == 1)  # the status message was deleted
    refused = [c for c in fake.calls if c.method == "sendMessageDraft"]
    assert refused and all(c.status == 400 for c in refused)
    assert [r for r in fake.sent if r.chat_id == 43 and r.method == "editMessageText"], "streamed by edits"
    await settled(daemon)
    before = len(refused)
    fake.push_text(43, "second", user_id=43)
    _mid, _data = await stop_button(fake, 43)  # edit streaming, with its button on the message
    await shown(fake, 43, lambda t: t.startswith("reply to: second") and t.endswith("w19 "))
    assert len([c for c in fake.calls if c.method == "sendMessageDraft"]) == before, "not asked again"


# --- the Stop button ------------------------------------------------------------------------------


async def test_the_stop_button_stops_the_turn_at_once(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    fake.clock = time.perf_counter  # the provider's clock
    provider.delay_s, provider.words = 0.02, 1000
    daemon, _ = await start(streaming="edit", groups="all")
    group = -100902
    fake.push_text(group, "go on", user_id=5)
    mid, data = await stop_button(fake, group)
    await shown(fake, group, lambda t: "w10" in t)
    (conn,) = provider.requests_for("go on")
    pushed = time.perf_counter()
    query = fake.push_callback(group, mid, data, user_id=5)
    closed = await provider.wait_closed(conn, timeout=2)
    answer = await answered(fake, query)
    print(f"Stop button: provider socket closed {1000 * (closed - pushed):.1f} ms after the press, "
          f"press answered {1000 * (answer.time - pushed):.1f} ms after it")
    assert not conn.completed and answer.text == "Stopped." and not answer.show_alert
    marked = await shown(fake, group, lambda t: t.endswith("\n\n⏹ stopped"))
    assert marked == mid and keyboard(fake, group, mid) == []  # the button is gone with the turn
    await settled(daemon)
    assert "Stopped." not in fake.messages(group).values()  # the press's answer said it
    _, history = await daemon.store.conversation(f"telegram:group:{group}")
    assert history[-1].content + "\n\n⏹ stopped" == fake.messages(group)[mid]


async def test_the_stop_button_beside_a_draft_ends_it_with_what_was_shown(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 1000
    daemon, _ = await start(streaming="draft", draft_interval_s=0.05)
    fake.push_text(44, "go on", user_id=44)
    status, data = await stop_button(fake, 44)
    await fake.wait_until(lambda: "w10" in (fake.draft_state(44) or ""))
    (conn,) = provider.requests_for("go on")
    query = fake.push_callback(44, status, data, user_id=44)
    await provider.wait_closed(conn, timeout=2)
    assert (await answered(fake, query)).text == "Stopped."
    marked = await shown(fake, 44, lambda t: t.endswith("\n\n⏹ stopped"))
    await fake.wait_until(lambda: list(fake.messages(44)) == [marked])  # the status message is gone
    (draft,) = fake.draft_history(44)
    assert draft.ended == "message" and fake.messages(44)[marked] == f"{draft.text}\n\n⏹ stopped"
    await settled(daemon)
    _, history = await daemon.store.conversation("telegram:dm:44")
    assert history[-1].content + "\n\n⏹ stopped" == fake.messages(44)[marked]  # stored = shown


async def test_a_button_of_an_ended_turn_stops_nothing(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 20
    daemon, _ = await start(streaming="edit")
    fake.push_text(45, "first", user_id=45)
    mid, old = await stop_button(fake, 45)
    await shown(fake, 45, lambda t: t.startswith("reply to: first") and t.endswith("w19 "))
    await settled(daemon)
    provider.words = 1000
    fake.push_text(45, "second", user_id=45)
    await shown(fake, 45, lambda t: t.startswith("reply to: second") and "w5" in t)
    query = fake.push_callback(45, mid, old, user_id=45, check_button=False)  # a stale client's tap
    answer = await answered(fake, query)
    assert answer.text == "This answer has already ended."
    (conn,) = provider.requests_for("second")
    assert conn.closed_at is None, "the stale press stopped the next answer"
    fake.push_text(45, "/stop", user_id=45)
    await provider.wait_closed(conn, timeout=2)


async def test_only_the_asker_or_an_admin_may_press_stop_in_a_group(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 1000
    await start(streaming="edit", groups="all")
    group = -100903
    fake.chat_admins[group] = {9}
    fake.push_text(group, "mine", user_id=5, first_name="Alice")
    mid, data = await stop_button(fake, group)
    (conn,) = provider.requests_for("mine")
    query = fake.push_callback(group, mid, data, user_id=6)  # a bystander
    answer = await answered(fake, query)
    assert answer.show_alert and "Only Alice or an admin" in (answer.text or "")
    assert conn.closed_at is None and keyboard(fake, group, mid) == [data]
    query = fake.push_callback(group, mid, data, user_id=9)  # an admin
    await provider.wait_closed(conn, timeout=2)
    assert (await answered(fake, query)).text == "Stopped."
    await shown(fake, group, lambda t: t.endswith("⏹ stopped"))


async def test_a_press_from_a_user_the_bot_does_not_serve_is_refused(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 1000
    await start(streaming="edit", access="allowlist", allowlist=["46"])
    fake.push_text(46, "go", user_id=46)
    mid, data = await stop_button(fake, 46)
    (conn,) = provider.requests_for("go")
    query = fake.push_callback(46, mid, data, user_id=777)  # not the chat's user (a forged update)
    answer = await answered(fake, query)
    assert answer.text and "allowlist" in answer.text
    await asyncio.sleep(0.1)
    assert conn.closed_at is None


async def test_presses_at_random_moments_always_keep_what_the_chat_shows(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    """A Stop pressed at a random moment of a draft (seeded; the seed is in the failure message):
    the chat ends with exactly the transcript's text, marked, and nothing of the turn is left behind."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    provider.delay_s, provider.words = 0.01, 2000
    daemon, _ = await start(streaming="draft", draft_interval_s=0.05)
    chat = 47
    for turn in range(4):
        before = set(fake.messages(chat))
        fake.push_text(chat, f"turn {turn}", user_id=chat)
        await fake.wait_until(lambda t=turn: bool(provider.requests_for(f"turn {t}")), 5)  # type: ignore[misc]
        status, data = await stop_button(fake, chat)
        await asyncio.sleep(rng.uniform(0.0, 0.6))  # anywhere: before the first draft, or well into it
        (conn,) = provider.requests_for(f"turn {turn}")
        query = fake.push_callback(chat, status, data, user_id=chat)
        await provider.wait_closed(conn, 3)
        assert (await answered(fake, query)).text == "Stopped.", f"seed {seed}"
        await settled(daemon)
        await fake.wait_until(lambda s=status: s not in fake.messages(chat), 3)  # type: ignore[misc]
        new = {m: t for m, t in fake.messages(chat).items() if m not in before}
        _, history = await daemon.store.conversation(f"telegram:dm:{chat}")
        shown = history[-1].content
        drafts = fake.draft_history(chat)
        assert all(d.ended is not None for d in drafts), f"seed {seed}: a draft left behind"
        if new:  # a draft was up: it ended in one message, what it showed, marked
            (text,) = new.values()
            assert text == (f"{shown}\n\n⏹ stopped" if shown.strip() else "⏹ stopped"), f"seed {seed}"
        else:  # stopped before any draft: nothing was shown, nothing is kept
            assert not shown.strip() or shown.startswith("[interrupted"), f"seed {seed}: {shown!r}"


@pytest.mark.filterwarnings("ignore:.*retry_after.*")  # PTB 22 warns when it builds RetryAfter
async def test_a_429_on_a_draft_skips_states_and_the_answer_arrives_whole(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 150  # 3 s: the 429 (1 s) passes mid-answer
    await start(streaming="draft", draft_interval_s=0.05)
    fake.fail_next("sendMessageDraft", 429, retry_after=1, times=2)
    fake.push_text(48, "hi", user_id=48)
    await shown(fake, 48, lambda t: t.endswith("w149 "), timeout=15)
    assert [c for c in fake.calls if c.method == "sendMessageDraft" and c.status == 429]
    assert [d for d in fake.drafts if d.chat_id == 48], "drafting resumed after the 429"
    await fake.wait_until(lambda: len(fake.messages(48)) == 1)


async def test_streaming_off_sends_the_final_text_only(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 20
    await start(streaming="off")
    fake.push_text(49, "hi", user_id=49)
    await shown(fake, 49, lambda t: t.endswith("w19 "))
    assert [r.method for r in fake.sent if r.chat_id == 49 and r.method != "sendChatAction"] == ["sendMessage"]
    (mid,) = fake.messages(49)
    assert keyboard(fake, 49, mid) == []


async def test_an_answer_ending_as_its_status_message_goes_out_leaves_no_status_behind(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    """Quick answers that end around the moment the Stop button's status message is sent (0.2 s
    in), on a slow chat: seeded random timings; the seed is in the failure message."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    daemon, _ = await start(streaming="draft", draft_interval_s=0.05)
    chat = 50
    fake.set_latency(chat, 0.08)
    for turn in range(6):
        provider.by_text[f"q{turn}"] = Script(text=f"answer {turn}", think_s=rng.uniform(0.1, 0.4), delay_s=0.0)
        fake.push_text(chat, f"q{turn}", user_id=chat)
        await shown(fake, chat, f"answer {turn} ".__eq__, timeout=5)
        await settled(daemon)
        await asyncio.sleep(0.3)  # a late status message would have landed by now
        texts = sorted(fake.messages(chat).values())
        assert texts == sorted(f"answer {i} " for i in range(turn + 1)), f"seed {seed}: {texts}"
        assert all(keyboard(fake, chat, m) == [] for m in fake.messages(chat)), f"seed {seed}"


async def test_a_bot_api_server_without_drafts_turns_them_off_for_every_chat(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    fake.drop_method("sendMessageDraft")  # a self-hosted Bot API server from before 9.3: 404
    provider.delay_s, provider.words = 0.03, 20
    daemon, _ = await start(streaming="draft", draft_interval_s=0.05)
    fake.push_text(51, "one", user_id=51)
    await shown(fake, 51, lambda t: t.endswith("w19 "))
    await settled(daemon)
    def statuses(chat: int) -> list[SentRecord]:  # the status message goes out only to stand beside a draft
        return [r for r in fake.sent if r.chat_id == chat and r.method == "sendMessage" and r.text == "✍️ writing…"]

    assert statuses(51), "the first chat tried a draft"
    fake.push_text(52, "two", user_id=52)  # another chat: drafts are not tried again
    await stop_button(fake, 52)
    await shown(fake, 52, lambda t: t.endswith("w19 "))
    assert not statuses(52) and [r for r in fake.sent if r.chat_id == 52 and r.method == "editMessageText"]


async def test_a_typed_stop_during_an_empty_draft_says_stopped_once(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    """The draft shows no text yet (a tool runs): the typed /stop's "Stopped." is the one message
    that ends it — not that and a bare "⏹ stopped" besides."""
    provider.then(Script(tool_calls=[("sleep", {"seconds": 30})]))
    daemon, _ = await start(streaming="draft", draft_interval_s=0.05, stop_button=False)
    fake.push_text(45, "take your time", user_id=45)
    await fake.wait_until(lambda: bool(fake.draft_history(45)) and any(c.completed for c in provider.connections))
    fake.push_text(45, "/stop", user_id=45)
    await settled(daemon)
    await fake.wait_until(lambda: all(d.ended is not None for d in fake.draft_history(45)))
    await asyncio.sleep(0.3)  # room for a second stop message, were one on its way
    said = [t for t in fake.messages(45).values() if "stopped" in t.lower()]
    assert len(said) == 1, fake.messages(45)  # "Stopped.", or the tool's line saying it was stopped


def test_a_log_line_names_an_exception_that_has_no_text() -> None:
    from platforms.errors import explain

    assert explain(TimeoutError()) == "TimeoutError"  # "could not confirm the last updates on stop: TimeoutError"
    assert explain(ValueError("bad chat")) == "bad chat"


# --- tool progress --------------------------------------------------------------------------------

STATUS = re.compile(r"⏳ running `?sleep 2\.5`? · (\d+) s$")


async def _watch(fake: FakeTelegramAPI, chat: int, done: Callable[[str], bool], *, drafts: bool = False,
                 timeout: float = 10.0) -> list[str]:
    """Every distinct text the chat's messages (and, with `drafts`, its draft) showed, until `done`."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        texts = list(fake.messages(chat).values()) + ([fake.draft_state(chat) or ""] if drafts else [])
        for text in texts:
            if text and text not in seen:
                seen.append(text)
        if any(done(t) for t in fake.messages(chat).values()):
            return seen
        await asyncio.sleep(0.02)
    raise AssertionError(f"not done in {timeout} s; saw {seen}")


@pytest.mark.parametrize("streaming", ["edit", "draft"])
async def test_a_running_tool_shows_a_ticking_status_line_that_gives_way_to_the_answer(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider, streaming: str) -> None:
    provider.words = 3
    provider.then(Script(tool_calls=[("sleep", {"seconds": 2.5})]))
    await start(streaming=streaming, draft_interval_s=0.05, stop_button=False, groups="all")
    chat = 46 if streaming == "draft" else -100946  # drafts are for private chats
    fake.push_text(chat, "take your time", user_id=46)
    seen = await _watch(fake, chat, lambda t: t.rstrip().endswith("w2"), drafts=streaming == "draft")
    ticks = [int(m[1]) for t in seen if (m := STATUS.search(t))]
    assert ticks[:1] == [0] and {1, 2} <= set(ticks), seen  # shown as it started, brought up to date
    (final,) = fake.messages(chat).values()  # the status line lived in the answer's message (or its draft)
    assert final.strip() == "reply to: take your time w0 w1 w2" and "⏳" not in final


async def test_a_stop_during_a_tool_turns_its_status_line_into_the_stop_mark(
        start: Start, fake: FakeTelegramAPI, provider: FakeProvider) -> None:
    provider.then(Script(tool_calls=[("sleep", {"seconds": 30})]))
    daemon, _ = await start(streaming="edit", stop_button=False, groups="all")
    group = -100947
    fake.push_text(group, "take your time", user_id=5)
    await shown(fake, group, lambda t: t.endswith("· 1 s"))
    fake.push_text(group, "/stop", user_id=5)
    await settled(daemon)
    marked = await shown(fake, group, lambda t: t.startswith("⏹ ") and "sleep" in t)
    assert re.fullmatch(r"⏹ `?sleep 30`? stopped after [12] s", fake.messages(group)[marked]), fake.messages(group)
    _, history = await daemon.store.conversation(f"telegram:group:{group}")
    assert history[-1].role == "tool" and history[-1].interrupted_by == "user"  # no text was shown or kept
