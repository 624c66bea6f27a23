"""An answer recorded whole but whose end never reached the chat — its worker died between the
record and the last edit — is shown again, whole, by whoever recovers the session: no chat is left
with a frozen half answer and no word of it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent_cache import keys
from tests.fakes.openai_provider import FakeProvider
from tests.fakes.telegram_api import FakeTelegramAPI
from tests.support.procs import until
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, end_all, start_all

TTL = 3.0
SECRET = "hook-secret-1"


def _env(fake: FakeTelegramAPI) -> dict[str, str]:
    settings = {"TOKEN": fake.token, "BASE_URL": fake.base_url, "BASE_FILE_URL": fake.base_file_url,
                "ACCESS": "open", "EDIT_INTERVAL_S": "0.05", "MODE": "webhook", "STREAMING": "edit",
                "WEBHOOK_URL": "https://example.test/tg", "SECRET_TOKEN": SECRET, "STOP_BUTTON": "false"}
    return {f"SWITCHBOARD_TELEGRAM__{key}": value for key, value in settings.items()}


async def test_an_answer_recorded_but_never_shown_whole_is_shown_again_by_the_worker_that_takes_over(
        provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    provider.delay_s, provider.words = 0.02, 30
    async with FakeTelegramAPI() as fake:
        a, b = (Worker(name, redis_server.url, provider.base_url, tmp_path, ttl_s=TTL, **_env(fake)) for name in "ab")
        try:
            await start_all(a, b)
            whole = "reply to: hello " + " ".join(f"w{i}" for i in range(30))
            # Every edit of a's reply is held back by Telegram for 30 s: the answer's end cannot reach the chat.
            fake.fail_next("editMessageText", 429, retry_after=30, times=100, chat_id=42)
            update = {"message": fake.user_message(42, user_id=42, text="hello")}
            assert await fake.post_webhook(a.url + "/telegram/webhook", update, SECRET) == 200
            with redis_server.client() as r:  # the answer is recorded (a's turn is waiting for its end to show)

                def recorded() -> bool:
                    return any(whole in row for row in r.lrange(keys.messages("telegram:dm:42", 1), 0, -1))

                await until(recorded, 30, "the answer was never recorded")
            assert not any(t.strip() == whole for t in fake.messages(42).values())
            a.kill()  # kill -9 before the chat saw the end
            await until(lambda: any(t.strip() == whole for t in fake.messages(42).values()), 3 * TTL + 10,
                        f"the recorded answer was never shown whole: {fake.messages(42)}", every=0.05)
            await asyncio.sleep(1.0)  # room for a (wrong) second showing
            assert sum(t.strip() == whole for t in fake.messages(42).values()) == 1
        finally:
            end_all(a, b)
