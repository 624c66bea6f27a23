"""A Stop button pressed on a worker that does not run the answer: real workers, a real redis-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.fakes.openai_provider import FakeProvider
from tests.fakes.telegram_api import FakeTelegramAPI
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, end_all, start_all
from tests.test_cluster import TTL, WEBHOOK, _telegram_env


def _stop_button(fake: FakeTelegramAPI, chat: int) -> tuple[int, str] | None:
    for mid in fake.messages(chat):
        msg = fake.message(chat, mid) or {}
        for row in msg.get("reply_markup", {}).get("inline_keyboard", []):
            for button in row:
                if str(button.get("callback_data", "")).startswith("stop:"):
                    return mid, button["callback_data"]
    return None


async def test_a_press_reaching_another_worker_stops_the_answer_on_its_owner(
        redis_server: RedisServer, provider: FakeProvider, tmp_path: Path) -> None:
    provider.delay_s, provider.words = 0.02, 3000
    async with FakeTelegramAPI() as fake:
        env = _telegram_env(fake, **WEBHOOK, STREAMING="edit")
        a, b = (Worker(name, redis_server.url, provider.base_url, tmp_path, ttl_s=TTL, **env) for name in "ab")
        try:
            await start_all(a, b)
            chat, secret = 7001, WEBHOOK["SECRET_TOKEN"]
            update = {"message": fake.user_message(chat, user_id=chat, text="go on")}
            assert await fake.post_webhook(a.url + "/telegram/webhook", update, secret) == 200  # a owns it
            await fake.wait_until(lambda: _stop_button(fake, chat) is not None, 10)
            found = _stop_button(fake, chat)
            assert found is not None
            mid, data = found
            (conn,) = provider.requests_for("go on")
            query = fake.push_callback(chat, mid, data, user_id=chat)
            press = next(u for u in fake.pending_updates if u["update_id"] == query)
            assert await fake.post_webhook(b.url + "/telegram/webhook", press, secret) == 200  # b takes the press
            await provider.wait_closed(conn, 5)
            assert not conn.completed
            await fake.wait_until(lambda: fake.callback_answer(query) is not None, 5)
            answer = fake.callback_answer(query)
            assert answer is not None and not answer.show_alert
            await fake.wait_until(lambda: fake.messages(chat).get(mid, "").endswith("\n\n⏹ stopped"), 5)
            await asyncio.sleep(0.3)
            assert list(fake.messages(chat)) == [mid], "a press is answered by its toast, not a chat message"
            # The same button again (a client not caught up): the answer has ended; nothing else stops.
            provider.words = 3000
            update = {"message": fake.user_message(chat, user_id=chat, text="next")}
            assert await fake.post_webhook(a.url + "/telegram/webhook", update, secret) == 200
            await fake.wait_until(lambda: bool(provider.requests_for("next")), 10)
            (following,) = provider.requests_for("next")
            again = fake.push_callback(chat, mid, data, user_id=chat, check_button=False)
            press = next(u for u in fake.pending_updates if u["update_id"] == again)
            assert await fake.post_webhook(b.url + "/telegram/webhook", press, secret) == 200
            await fake.wait_until(lambda: fake.callback_answer(again) is not None, 5)
            await asyncio.sleep(0.3)
            assert following.closed_at is None, "a stale press on another worker stopped the next answer"
            assert "This answer has already ended." not in fake.messages(chat).values()
        finally:
            end_all(a, b)
