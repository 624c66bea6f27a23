"""The Telegram Bot API fake, exercised through the real python-telegram-bot library."""

from __future__ import annotations

import asyncio
import datetime as dtm
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import ClientSession, FormData, web
from telegram import Bot, InlineKeyboardButton, InlineKeyboardMarkup, ReplyParameters, Update
from telegram.error import BadRequest, Conflict, InvalidToken, RetryAfter
from telegram.ext import ApplicationBuilder, ContextTypes, MessageHandler, filters

from tests.fakes.telegram_api import DRAFT_PEER_INVALID, FakeTelegramAPI
from tests.fakes.telegram_html import HtmlParseError, parse_html

TOKEN = "123456:TEST-TOKEN"
pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeTelegramAPI]:
    async with FakeTelegramAPI(TOKEN, username="switchboard_bot", first_name="Switchboard") as api:
        yield api


@pytest_asyncio.fixture
async def bot(fake: FakeTelegramAPI) -> AsyncIterator[Bot]:
    async with Bot(TOKEN, base_url=fake.base_url, base_file_url=fake.base_file_url) as b:
        yield b


async def test_get_me(bot: Bot) -> None:
    me = await bot.get_me()
    assert (me.id, me.username, me.first_name, me.is_bot) == (
        123456, "switchboard_bot", "Switchboard", True,
    )  # fmt: skip


async def test_unknown_token_is_unauthorized(fake: FakeTelegramAPI) -> None:
    with pytest.raises(InvalidToken):  # __aenter__ calls getMe, then shuts the client down
        async with Bot("999:WRONG", base_url=fake.base_url):
            pass


async def test_send_and_edit_round_trip(bot: Bot, fake: FakeTelegramAPI) -> None:
    first = await bot.send_message(42, "hello")
    second = await bot.send_message(42, "123")  # raw string param must not be JSON-decoded
    assert (first.message_id, second.message_id, second.text) == (1, 2, "123")
    assert first.chat.id == 42 and first.from_user is not None and first.from_user.is_bot
    edited = await bot.edit_message_text("hello, world", chat_id=42, message_id=1)
    assert isinstance(edited, type(first)) and edited.text == "hello, world"
    assert fake.messages(42) == {1: "hello, world", 2: "123"}
    with pytest.raises(BadRequest, match=r"(?i)message is not modified"):
        await bot.edit_message_text("hello, world", chat_id=42, message_id=1)
    with pytest.raises(BadRequest, match=r"(?i)message to edit not found"):
        await bot.edit_message_text("x", chat_id=42, message_id=99)
    assert [r.method for r in fake.sent] == ["sendMessage", "sendMessage", "editMessageText"]
    assert fake.sent[-1].message_id == 1 and fake.sent[-1].text == "hello, world"


async def test_html_entities_reply_and_limits(bot: Bot, fake: FakeTelegramAPI) -> None:
    msg = await bot.send_message(7, "<b>bold</b> &amp; <a href='https://x.y'>link</a>", "HTML")
    assert msg.text == "bold & link"
    assert [(e.type, e.offset, e.length) for e in msg.entities] == [
        ("bold", 0, 4), ("text_link", 7, 4),
    ]  # fmt: skip
    assert (fake.sent[-1].text or "").startswith("<b>") and fake.sent[-1].parse_mode == "HTML"
    reply = await bot.send_message(7, "re", reply_parameters=ReplyParameters(msg.message_id))
    assert reply.reply_to_message is not None and reply.reply_to_message.message_id == 1
    for bad in ("<b>unclosed", "<div>x</div>", "<b><i>x</b></i>", "1 < 2"):
        with pytest.raises(BadRequest, match=r"(?i)can't parse entities"):
            await bot.send_message(7, bad, parse_mode="HTML")
    with pytest.raises(BadRequest, match=r"(?i)message is too long"):
        await bot.send_message(7, "😀" * 2049)  # 4098 UTF-16 code units
    await bot.send_message(7, "😀" * 2048)
    with pytest.raises(BadRequest, match=r"(?i)message text is empty"):
        await bot.send_message(7, "")


# PTB 22.2+ warns that RetryAfter.retry_after becomes a timedelta (opt in: PTB_TIMEDELTA=1)
@pytest.mark.filterwarnings("ignore:.*retry_after.*")
async def test_retry_after_injection(bot: Bot, fake: FakeTelegramAPI) -> None:
    fake.fail_next("sendMessage", 429, retry_after=7)
    with pytest.raises(RetryAfter) as info:
        await bot.send_message(1, "hi")
    delay = info.value.retry_after
    assert (delay.total_seconds() if isinstance(delay, dtm.timedelta) else delay) == 7
    assert fake.calls[-1].status == 429 and fake.sent == []
    await bot.send_message(1, "hi")  # only the next call fails
    fake.fail_next("sendMessage", 400, description="Bad Request: chat not found")
    with pytest.raises(BadRequest, match=r"(?i)chat not found"):
        await bot.send_message(1, "hi")


async def test_long_poll_wakes_on_push(bot: Bot, fake: FakeTelegramAPI) -> None:
    async def push_later() -> None:
        await asyncio.sleep(0.3)
        fake.push_text(5, "ping", user_id=5)

    started = time.monotonic()
    pusher = asyncio.create_task(push_later())
    updates = await bot.get_updates(timeout=5)
    elapsed = time.monotonic() - started
    await pusher
    assert 0.25 < elapsed < 2.0
    assert len(updates) == 1 and updates[0].message is not None
    assert updates[0].message.text == "ping" and updates[0].message.chat.type == "private"


async def test_long_poll_timeout_returns_empty(bot: Bot, fake: FakeTelegramAPI) -> None:
    started = time.monotonic()
    assert await bot.get_updates(timeout=1) == ()
    assert time.monotonic() - started >= 0.9
    assert fake.polls[-1].timeout == 1 and fake.polls[-1].returned == []


async def test_offset_confirms_updates(bot: Bot, fake: FakeTelegramAPI) -> None:
    ids = [fake.push_text(5, f"m{i}", user_id=5) for i in range(3)]
    first = await bot.get_updates(limit=2)
    assert [u.update_id for u in first] == ids[:2]
    again = await bot.get_updates()  # nothing confirmed yet
    assert [u.update_id for u in again] == ids
    rest = await bot.get_updates(offset=ids[1] + 1)
    assert [u.update_id for u in rest] == ids[2:]
    assert [u["update_id"] for u in fake.pending_updates] == ids[2:]
    assert await bot.get_updates(offset=ids[2] + 1) == ()
    assert fake.poll_offsets == [None, None, ids[1] + 1, ids[2] + 1]
    assert fake.poll_count == 4


async def test_command_entity_and_conflict(bot: Bot, fake: FakeTelegramAPI) -> None:
    fake.push_text(5, "/start@switchboard_bot now", user_id=5, username="alice")
    (update,) = await bot.get_updates()
    assert update.message is not None
    assert update.message.parse_entities(["bot_command"]).popitem()[1] == "/start@switchboard_bot"
    fake.conflict_polling(True)
    with pytest.raises(Conflict, match=r"(?i)terminated by other getUpdates request"):
        await bot.get_updates()
    fake.conflict_polling(False)
    assert len(await bot.get_updates()) == 1


async def test_forum_topic_message(bot: Bot, fake: FakeTelegramAPI) -> None:
    chat_id = -1001234567890
    fake.push_text(
        chat_id, "in topic", user_id=9, chat_type="supergroup", message_thread_id=77
    )  # fmt: skip
    (update,) = await bot.get_updates()
    msg = update.message
    assert msg is not None and msg.chat.is_forum and msg.chat.type == "supergroup"
    assert msg.message_thread_id == 77 and msg.is_topic_message
    sent = await bot.send_message(chat_id, "answer", message_thread_id=77)
    assert sent.message_thread_id == 77 and sent.message_id == msg.message_id + 1
    await bot.send_chat_action(chat_id, "typing", message_thread_id=77)
    assert [(r.method, r.message_thread_id) for r in fake.sent] == [
        ("sendMessage", 77), ("sendChatAction", 77),
    ]  # fmt: skip


async def test_commands_webhook_and_misc(bot: Bot, fake: FakeTelegramAPI) -> None:
    await bot.set_my_commands([("help", "Show help"), ("new", "New session")])
    assert [c.command for c in await bot.get_my_commands()] == ["help", "new"]
    assert fake.commands()[0] == {"command": "help", "description": "Show help"}
    await bot.delete_my_commands()
    assert await bot.get_my_commands() == ()
    await bot.set_webhook("https://example.test/hook", secret_token="s3cret")
    info = await bot.get_webhook_info()
    assert info.url == "https://example.test/hook"
    with pytest.raises(Conflict, match=r"(?i)webhook is active"):
        await bot.get_updates()
    await bot.delete_webhook()
    assert (await bot.get_webhook_info()).url == ""
    chat = await bot.get_chat(42)
    assert chat.type == "private"
    msg = await bot.send_message(42, "bye")
    assert await bot.delete_message(42, msg.message_id)
    assert fake.messages(42) == {}
    fake.push_photo(42, user_id=42, caption="look")
    (update,) = await bot.get_updates()
    assert update.message is not None and update.message.text is None
    photo = await update.message.photo[-1].get_file()
    assert bytes(await photo.download_as_bytearray()) == b"\xff\xd8fake-jpeg"


async def test_post_webhook_sends_secret_header(fake: FakeTelegramAPI) -> None:
    seen: list[tuple[str | None, int]] = []

    async def hook(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.headers.get("X-Telegram-Bot-Api-Secret-Token"), body["update_id"]))
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
        status = await fake.post_webhook(url, {"update_id": 5, "message": {}}, secret_token="tok")
        assert status == 200 and seen == [("tok", 5)]
    finally:
        await runner.cleanup()


async def test_application_polling_round_trip(fake: FakeTelegramAPI) -> None:
    async def echo(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        assert update.effective_message is not None
        await update.effective_message.reply_text(f"echo: {update.effective_message.text}")

    app = ApplicationBuilder().token(TOKEN).base_url(fake.base_url).base_file_url(fake.base_file_url).build()
    app.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, echo))
    async with app:
        await app.start()
        assert app.updater is not None
        await app.updater.start_polling(timeout=2, poll_interval=0.0)
        try:
            await fake.wait_until(lambda: fake.poll_count >= 1)
            update_id = fake.push_text(-100777, "hi all", user_id=42, chat_type="supergroup")
            record = await fake.wait_for(lambda r: r.method == "sendMessage", timeout=5)
            assert (record.chat_id, record.text) == (-100777, "echo: hi all")
            reply = fake.message(-100777, record.message_id or 0)
            # PTB 22's reply_text quotes the incoming message only in group chats
            assert reply is not None and reply["reply_to_message"]["message_id"] == 1
        finally:
            await app.updater.stop()
            await app.stop()
    # the shutdown getUpdates call confirmed the processed update
    assert fake.poll_offsets[-1] == update_id + 1
    assert fake.pending_updates == []
    assert any(c.method == "deleteWebhook" for c in fake.calls)
    # PTB abandons its in-flight long poll on stop (499 here); there was never a 409 conflict
    assert {p.status for p in fake.polls} <= {200, 499}


async def test_raw_http_encodings_and_errors(fake: FakeTelegramAPI) -> None:
    url = f"{fake.base_url}{TOKEN}"
    async with ClientSession() as http:
        async with http.post(f"{url}/sendMessage", json={"chat_id": 3, "text": "json"}) as r:
            assert r.status == 200 and r.content_type == "application/json"
            assert (await r.json())["result"]["text"] == "json"
        form = FormData({"chat_id": "3", "text": "true", "reply_parameters": '{"message_id": 1}'})
        form.add_field("document", b"bytes", filename="f.txt")  # forces multipart
        async with http.post(f"{url}/SENDMESSAGE", data=form) as r:
            result = (await r.json())["result"]
            assert result["text"] == "true" and result["reply_to_message"]["message_id"] == 1
        async with http.get(f"{url}/getMe?x=1") as r:
            assert (await r.json())["result"]["username"] == "switchboard_bot"
        async with http.post(f"{url}/noSuchMethod") as r:
            body = await r.json()
            assert r.status == 404 and body == {
                "ok": False, "error_code": 404, "description": "Not Found",
            }  # fmt: skip
        async with http.post(f"{fake.base_url}1:bad/getMe") as r:
            body = await r.json()
            assert r.status == 401 and body["description"] == "Unauthorized"
        fake.fail_next("getMe", 429, retry_after=3)
        async with http.post(f"{url}/getMe") as r:
            assert r.status == 429 and await r.json() == {
                "ok": False, "error_code": 429, "description": "Too Many Requests: retry after 3",
                "parameters": {"retry_after": 3},
            }  # fmt: skip
        # a second poller terminates the first one with 409, like the real server
        first = asyncio.create_task(http.post(f"{url}/getUpdates", data={"timeout": "5"}))
        await fake.wait_until(lambda: fake.poll_count == 1)
        async with http.post(f"{url}/getUpdates") as r:
            assert r.status == 200
        async with await first as r:
            assert r.status == 409 and "terminated by other" in (await r.json())["description"]


async def test_callback_query_and_user_reply(bot: Bot, fake: FakeTelegramAPI) -> None:
    keyboard = InlineKeyboardMarkup([[InlineKeyboardButton("Approve", callback_data="ok")]])
    sent = await bot.send_message(42, "approve?", reply_markup=keyboard)
    fake.push_callback(42, sent.message_id, "ok", user_id=42)
    fake.push_text(42, "later", user_id=42, reply_to=fake.message(42, sent.message_id))
    cb_update, text_update = await bot.get_updates()
    query = cb_update.callback_query
    assert query is not None and query.data == "ok" and query.message is not None
    assert query.message.message_id == sent.message_id
    assert await query.answer("done")
    with pytest.raises(BadRequest, match=r"(?i)query id is invalid"):
        await bot.answer_callback_query("nope")
    msg = text_update.message
    assert msg is not None and msg.message_id == sent.message_id + 1
    assert msg.reply_to_message is not None and msg.reply_to_message.text == "approve?"
    edited = await bot.edit_message_text("approved", chat_id=42, message_id=sent.message_id)
    assert not isinstance(edited, bool) and edited.reply_markup is None


async def test_parse_html_entities_use_utf16_offsets() -> None:
    text, entities = parse_html(
        '😀 <pre><code class="language-py">x = 1</code></pre> <tg-spoiler>s</tg-spoiler>'
    )
    assert text == "😀 x = 1 s"
    assert entities == [
        {"type": "pre", "offset": 3, "length": 5, "language": "py"},
        {"type": "spoiler", "offset": 9, "length": 1},
    ]
    with pytest.raises(HtmlParseError, match="Unsupported start tag"):
        parse_html("<br>")


class FakeClock:
    """Stands in for `fake.clock`, so a test moves time instead of sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_message_draft_streams_then_message_replaces_it(bot: Bot, fake: FakeTelegramAPI) -> None:
    assert await bot.send_message_draft(42, 7, "")  # empty text: the "Thinking…" placeholder
    assert fake.draft_state(42) == ""
    await bot.send_message_draft(42, 7, "<b>Hel</b>", parse_mode="HTML")
    await bot.send_message_draft(42, 7, "Hello")
    assert fake.draft_state(42) == "Hello"
    assert [(d.chat_id, d.draft_id, d.text) for d in fake.drafts] == [(42, 7, ""), (42, 7, "Hel"), (42, 7, "Hello")]
    assert fake.drafts[1].entities == [{"type": "bold", "offset": 0, "length": 3}]
    assert fake.drafts[0].time <= fake.drafts[1].time <= fake.drafts[2].time
    await bot.send_message(43, "other chat")  # a message elsewhere keeps the draft
    assert fake.draft_state(42) == "Hello"
    await bot.send_message(42, "Hello, world")
    assert fake.draft_state(42) is None
    (draft,) = fake.draft_history(42)
    assert (draft.draft_id, draft.text, draft.ended, len(draft.updates)) == (7, "Hello", "message", 3)
    assert [r.method for r in fake.sent].count("sendMessageDraft") == 3


async def test_message_draft_errors(bot: Bot, fake: FakeTelegramAPI) -> None:
    for chat_id in (-100, -1001234567890):  # a group, a supergroup (forum topics included)
        with pytest.raises(BadRequest, match="Textdraft_peer_invalid"):
            await bot.send_message_draft(chat_id, 1, "x", message_thread_id=5)
    with pytest.raises(BadRequest, match="Random_id_invalid"):
        await bot.send_message_draft(42, 0, "x")
    with pytest.raises(BadRequest, match=r"(?i)can't parse entities"):
        await bot.send_message_draft(42, 1, "<b>x", parse_mode="HTML")
    with pytest.raises(BadRequest, match=r"(?i)message is too long"):
        await bot.send_message_draft(42, 1, "x" * 4097)
    await bot.send_message_draft(42, 1, "<b>" + "x" * 4096 + "</b>", parse_mode="HTML")  # visible: 4096
    fake.drafts_enabled = False  # a bot without the feature (before Bot API 9.5: no topic mode)
    with pytest.raises(BadRequest, match="Textdraft_peer_invalid"):
        await bot.send_message_draft(42, 1, "x")
    assert [(d.chat_id, d.draft_id) for d in fake.drafts] == [(42, 1)]
    assert fake.calls[-1].status == 400 and DRAFT_PEER_INVALID.endswith("TEXTDRAFT_PEER_INVALID")


async def test_message_draft_lifetime_and_replacement(bot: Bot, fake: FakeTelegramAPI) -> None:
    clock = fake.clock = FakeClock()
    fake.draft_ttl_s = 30.0
    await bot.send_message_draft(42, 1, "a")
    clock.now += 29.0
    await bot.send_message_draft(42, 1, "ab")  # refreshed in time: same bubble
    clock.now += 29.0
    assert fake.draft_state(42) == "ab"
    clock.now += 2.0  # 31 s since the last refresh
    assert fake.draft_state(42) is None
    await bot.send_message_draft(42, 1, "abc")  # after expiry: a new bubble, same id
    await bot.send_message_draft(42, 2, "other")  # another id replaces it
    first, second, third = fake.draft_history(42)
    assert (first.ended, first.ended_at, len(first.updates)) == ("expired", 1000.0 + 29 + 30, 2)
    assert (second.text, second.ended, third.draft_id, third.ended) == ("abc", "replaced", 2, None)


async def test_inline_keyboard_stored_edited_and_removed(bot: Bot, fake: FakeTelegramAPI) -> None:
    stop = InlineKeyboardMarkup([[InlineKeyboardButton("Stop", callback_data="stop:1")]])
    sent = await bot.send_message(42, "working", reply_markup=stop)
    stored = fake.message(42, sent.message_id)
    assert stored is not None and stored["reply_markup"] == stop.to_dict()
    assert sent.reply_markup == stop
    both = InlineKeyboardMarkup([[InlineKeyboardButton("Stop", callback_data="stop:1"),
                                  InlineKeyboardButton("More", callback_data="more")]])  # fmt: skip
    edited = await bot.edit_message_reply_markup(42, sent.message_id, reply_markup=both)
    assert not isinstance(edited, bool) and edited.reply_markup == both
    with pytest.raises(BadRequest, match=r"(?i)message is not modified"):
        await bot.edit_message_reply_markup(42, sent.message_id, reply_markup=both)
    kept = await bot.edit_message_text("still working", 42, sent.message_id, reply_markup=both)
    assert not isinstance(kept, bool) and kept.reply_markup == both
    done = await bot.edit_message_text("done", 42, sent.message_id)  # no markup: keyboard removed
    assert not isinstance(done, bool) and done.reply_markup is None
    assert "reply_markup" not in (fake.message(42, sent.message_id) or {})
    with pytest.raises(BadRequest, match=r"(?i)message is not modified"):
        await bot.edit_message_reply_markup(42, sent.message_id)
    with pytest.raises(ValueError, match="no button"):
        fake.push_callback(42, sent.message_id, "stop:1", user_id=42)  # the button is gone
    too_long = InlineKeyboardMarkup([[InlineKeyboardButton("x", callback_data="é" * 33)]])  # 66 bytes
    with pytest.raises(BadRequest, match="Button_data_invalid"):
        await bot.send_message(42, "x", reply_markup=too_long)
    assert [r.method for r in fake.sent] == [
        "sendMessage", "editMessageReplyMarkup", "editMessageText", "editMessageText",
    ]  # fmt: skip


async def test_callback_answers_recorded_and_validated(bot: Bot, fake: FakeTelegramAPI) -> None:
    clock = fake.clock = FakeClock()
    stop = InlineKeyboardMarkup([[InlineKeyboardButton("Stop", callback_data="stop")]])
    sent = await bot.send_message(42, "working", reply_markup=stop)
    first = fake.push_callback(42, sent.message_id, "stop", user_id=42, username="alice")
    clock.now += 0.5  # the tap reaches the bot half a second later
    (update,) = await bot.get_updates()
    query = update.callback_query
    assert query is not None and query.id == str(first) and query.from_user.username == "alice"
    clock.now += 0.25
    assert await query.answer("Stopping…", show_alert=True)
    answer = fake.callback_answer(first)
    assert answer is not None and (answer.data, answer.text, answer.show_alert) == ("stop", "Stopping…", True)
    assert (answer.chat_id, answer.message_id, answer.latency) == (42, sent.message_id, 0.25)
    with pytest.raises(BadRequest, match=r"(?i)query id is invalid"):
        await query.answer()  # a query is answered once
    second = fake.push_callback(42, sent.message_id, "stop", user_id=42)
    await bot.get_updates(offset=update.update_id + 1)
    clock.now += 16.0  # past callback_ttl_s (15 s)
    with pytest.raises(BadRequest, match=r"(?i)query is too old"):
        await bot.answer_callback_query(str(second))
    with pytest.raises(BadRequest, match=r"(?i)message_too_long"):
        await bot.answer_callback_query(str(fake.push_callback(42, sent.message_id, "stop", user_id=42)), "x" * 201)
    assert [a.query_id for a in fake.callback_answers] == [str(first)]


async def test_length_counts_visible_text_unless_raw_mode(bot: Bot, fake: FakeTelegramAPI) -> None:
    html = "<b>" + "x" * 4090 + "</b>&amp;" + "y" * 5  # 4096 visible, 4112 raw
    sent = await bot.send_message(42, html, parse_mode="HTML")
    assert len(sent.text or "") == 4096
    with pytest.raises(BadRequest, match="Message_too_long"):  # editMessageText's own wording
        await bot.edit_message_text(html + "z", 42, sent.message_id, parse_mode="HTML")
    fake.count_raw_html = True  # the stricter, raw-HTML counting
    with pytest.raises(BadRequest, match=r"(?i)message is too long"):
        await bot.send_message(42, html, parse_mode="HTML")
    with pytest.raises(BadRequest, match="Message_too_long"):
        await bot.edit_message_text(html[:-1], 42, sent.message_id, parse_mode="HTML")
    with pytest.raises(BadRequest, match=r"(?i)message is too long"):
        await bot.send_message_draft(42, 1, html, parse_mode="HTML")


async def test_deleted_message_cannot_be_edited(bot: Bot, fake: FakeTelegramAPI) -> None:
    sent = await bot.send_message(42, "streaming…")
    await bot.edit_message_text("streaming… more", 42, sent.message_id)
    assert fake.delete_message(42, sent.message_id)  # the user deletes it mid-stream
    assert not fake.delete_message(42, sent.message_id)
    with pytest.raises(BadRequest, match=r"(?i)message to edit not found"):
        await bot.edit_message_text("streaming… more and more", 42, sent.message_id)
    with pytest.raises(BadRequest, match=r"(?i)message to edit not found"):
        await bot.edit_message_reply_markup(42, sent.message_id)
    assert fake.messages(42) == {}


async def test_latency_slows_one_chat_only(bot: Bot, fake: FakeTelegramAPI) -> None:
    fake.set_latency(42, 0.5)
    started = time.monotonic()
    slow = asyncio.create_task(bot.send_message(42, "slow"))
    fast = await bot.send_message(43, "fast")
    fast_done = time.monotonic() - started
    await asyncio.wait_for(slow, 5)
    slow_done = time.monotonic() - started
    assert fast.chat.id == 43 and fast_done < 0.5 <= slow_done
    assert [r.chat_id for r in fake.sent] == [43, 42]
    fake.set_latency(42, 0)
    await bot.send_message(42, "fast again")


# PTB 22.2+ warns that RetryAfter.retry_after becomes a timedelta (opt in: PTB_TIMEDELTA=1)
@pytest.mark.filterwarnings("ignore:.*retry_after.*")
async def test_group_limit_and_per_chat_faults(bot: Bot, fake: FakeTelegramAPI) -> None:
    clock = fake.clock = FakeClock()
    fake.set_group_limit(3, window_s=60.0)
    for i in range(3):
        await bot.send_message(-100, f"m{i}")
        clock.now += 10.0
    with pytest.raises(RetryAfter) as info:
        await bot.send_message(-100, "m3")
    delay = info.value.retry_after
    assert (delay.total_seconds() if isinstance(delay, dtm.timedelta) else delay) == 30  # oldest at t-30
    await bot.send_message(-200, "another group")  # counted per group
    for i in range(5):
        await bot.send_message(42, f"private {i}")  # private chats are not limited
    clock.now += 30.0
    await bot.send_message(-100, "m3")  # the oldest send left the window
    fake.set_group_limit(None)
    fake.fail_next("sendMessage", 429, retry_after=4, chat_id=-100)
    await bot.send_message(42, "unaffected")
    with pytest.raises(RetryAfter):
        await bot.send_message(-100, "limited")
    await bot.send_message(-100, "fine again")
