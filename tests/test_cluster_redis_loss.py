"""Redis restarted empty under a running cluster: what was created once at start is made again,
and no message a platform was told is taken gets lost."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import RedisFactory
from tests.fakes.openai_provider import FakeProvider
from tests.fakes.telegram_api import FakeTelegramAPI
from tests.support.procs import until
from tests.support.workers import Worker, end_all, start_all

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
            # a takes the session again; then b gets a message for it and forwards it to a's inbox,
            # whose consumer group Redis had lost.
            assert await post(a, "second") == 200
            await until(lambda: bool(_answers(fake, 42, "second")), 10, "second never answered", every=0.05)
            status = await post(b, "third")
            await until(lambda: bool(_answers(fake, 42, "third")), 15, "the forwarded message was lost",
                        every=0.05)
            assert status == 200  # acknowledged only once the owner had it
            assert len(_answers(fake, 42, "third")) == 1
    finally:
        end_all(*workers)
