"""Images and files from Discord, end to end: real discord.py against the loopback fake, whose
attachment URLs serve the files (slowly when asked), and the fake provider recording the request."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio

from gateway.core.attachments import MB
from gateway.ops.daemon import Daemon
from platforms.discord_bot import DiscordAdapter
from tests.conftest import DaemonFactory
from tests.fakes.discord_api import ALICE_ID, BOT_ID, FakeDiscord, patch_discord
from tests.fakes.openai_provider import FakeProvider

Json = dict[str, Any]
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(200))
Start = Callable[..., Awaitable[Daemon]]


@pytest.fixture(autouse=True)
def _fast_discord(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DiscordAdapter, "client_options", {"guild_ready_timeout": 0.01})
    monkeypatch.setattr(DiscordAdapter, "reidentify_delay_s", 0.0)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord() as server, patch_discord(server):
        yield server


@pytest.fixture
def start(fake: FakeDiscord, make_daemon: DaemonFactory) -> Start:
    async def go(**sections: dict[str, object]) -> Daemon:
        daemon = await make_daemon(discord={"token": fake.token, "access": "open", "edit_interval_s": 0.05},
                                   agent={"vision": True}, **sections)
        adapter = daemon.adapters["discord"]
        assert isinstance(adapter, DiscordAdapter)
        async with asyncio.timeout(5):
            while not adapter.health().ok:
                await asyncio.sleep(0.01)
        return daemon

    return go


async def bot_says(fake: FakeDiscord, channel: int, pred: Callable[[str], bool], timeout: float = 5.0) -> str:
    async with asyncio.timeout(timeout):
        while True:
            for m in fake.messages(channel):
                if m["author"]["id"] == str(BOT_ID) and pred(m["content"]):
                    return str(m["content"])
            await asyncio.sleep(0.01)


async def test_an_image_and_a_text_file_in_one_message_reach_the_model(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    await start()
    dm = fake.dm_channel_id(ALICE_ID)
    files: list[Json] = [{"filename": "shot.png", "content": PNG, "content_type": "image/png"},
                         {"filename": "app.log", "content": b"ERROR boom\n"}]  # no type: guessed from the name
    await fake.dispatch_message(dm, "why does it fail?", author_id=ALICE_ID, attachments=files)
    await bot_says(fake, dm, lambda t: t.startswith("reply to: why does it fail?"))
    (asked,) = provider.connections
    text, image, log = asked.last_user_parts
    assert text["text"] == "why does it fail?\n[image: shot.png, 208 B]\n[file: app.log, 11 B]"
    assert image == {"type": "image_url",
                     "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}}
    assert log["text"].startswith("File app.log (text/plain, 11 B):\n```\nERROR boom\n")


async def test_an_image_alone_is_a_message_and_a_fake_image_is_refused_with_a_reason(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    await start()
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "", author_id=ALICE_ID,
                                attachments=[{"filename": "cat.png", "content": PNG, "content_type": "image/png"}])
    await bot_says(fake, dm, lambda t: t.startswith("reply to: [image: cat.png"))
    # Declared an image, but the bytes are not one: the provider would refuse it, so it never gets it.
    await fake.dispatch_message(dm, "and this", author_id=ALICE_ID, attachments=[
        {"filename": "evil.png", "content": b"<script>alert(1)</script>", "content_type": "image/png"}])
    await bot_says(fake, dm, lambda t: t == "I could not read evil.png: it is not a JPEG, PNG, GIF or WebP image.")
    await bot_says(fake, dm, lambda t: t.startswith("reply to: and this"))
    assert provider.connections[-1].last_user_parts[1]["type"] == "text"


async def test_an_oversize_attachment_is_refused_with_a_reason_and_never_fetched(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    await start(media={"max_image_bytes": 100_000})
    dm = fake.dm_channel_id(ALICE_ID)
    big = PNG + bytes(100_000)
    await fake.dispatch_message(dm, "", author_id=ALICE_ID,
                                attachments=[{"filename": "huge.png", "content": big, "content_type": "image/png"}])
    await bot_says(fake, dm, lambda t: t == "I could not read huge.png: over the 98 KB limit.")
    await fake.dispatch_message(dm, "and now?", author_id=ALICE_ID, attachments=[
        {"filename": "huge.png", "content": big, "content_type": "image/png"},
        {"filename": "small.txt", "content": b"ok", "content_type": "text/plain"}])
    await bot_says(fake, dm, lambda t: t.startswith("reply to: and now?"))
    assert [p.get("type") for p in provider.connections[-1].last_user_parts] == ["text", "text"]
    assert "[image not read: huge.png, 98 KB — over the 98 KB limit]" in provider.connections[-1].last_user
    assert [d.path.rsplit("/", 1)[1] for d in fake.file_serving.downloads] == ["small.txt"]
    assert len(provider.connections) == 1  # the image alone was no message


async def test_a_new_message_during_a_slow_download_cancels_it(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    await start()
    fake.file_serving.chunk, fake.file_serving.delay_s = 2048, 0.05
    dm = fake.dm_channel_id(ALICE_ID)
    slow = [{"filename": "slow.txt", "content": b"z" * (MB // 2), "content_type": "text/plain"}]
    await fake.dispatch_message(dm, "first", author_id=ALICE_ID, attachments=slow)
    downloads = fake.file_serving.downloads
    await fake.file_serving.wait_until(lambda: bool(downloads) and downloads[0].sent > 0)
    await fake.dispatch_message(dm, "never mind", author_id=ALICE_ID)  # busy "interrupt": the first stops
    await bot_says(fake, dm, lambda t: t.startswith("reply to: never mind"))
    await fake.file_serving.wait_until(lambda: downloads[0].closed_at is not None, timeout=3)
    assert not downloads[0].completed
    assert [c.last_user for c in provider.connections] == ["never mind"]
