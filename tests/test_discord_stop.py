"""Discord's one-tap Stop button, end to end: the real daemon and discord.py against the loopback fake."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from platforms.discord_bot import DiscordAdapter
from tests.conftest import DaemonFactory
from tests.fakes.discord_api import ALICE_ID, BOB_ID, TEXT_CHANNEL_ID, FakeDiscord, patch_discord
from tests.fakes.discord_models import FakeInteraction
from tests.fakes.openai_provider import FakeProvider
from tests.test_discord import Start, answer, bot_messages, eventually, reply_with

Json = dict[str, Any]


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
    async def _start(**discord: object) -> tuple[Any, DiscordAdapter]:
        daemon = await make_daemon(discord={"token": fake.token, "access": "open", "edit_interval_s": 0.05,
                                            **discord})
        adapter = daemon.adapters["discord"]
        assert isinstance(adapter, DiscordAdapter)
        await eventually(lambda: adapter.health().ok, 5, "the gateway to be ready")
        return daemon, adapter

    return _start


def stop_ids(msg: Json) -> list[str]:
    return [c["custom_id"] for row in msg.get("components", []) for c in row.get("components", [])
            if str(c.get("custom_id", "")).startswith("stop:")]


async def streaming_with_button(fake: FakeDiscord, channel: int) -> tuple[Json, str]:
    msg = await eventually(lambda: next((m for m in bot_messages(fake, channel) if stop_ids(m)), None),
                           5, "a message with a Stop button")
    return msg, stop_ids(msg)[0]


async def response(fake: FakeDiscord, inter: FakeInteraction) -> Json:
    call = await fake.wait_for(lambda c: c.path == f"/interactions/{inter.id}/{inter.token}/callback")
    return dict(call.json)


async def test_the_stop_button_stops_the_turn_and_leaves_with_it(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 1000
    daemon, _ = await start()
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "long one", author_id=ALICE_ID)
    msg, custom_id = await streaming_with_button(fake, dm)
    await eventually(lambda: "w10" in (fake.message(int(msg["id"])) or {}).get("content", ""))
    (conn,) = provider.requests_for("long one")
    pressed = time.perf_counter()
    inter = await fake.push_component_interaction(dm, int(msg["id"]), custom_id, user_id=ALICE_ID)
    closed = await provider.wait_closed(conn, 2)
    assert (await response(fake, inter))["type"] == 6  # acknowledged without a spinner or a message
    print(f"Discord Stop button: provider socket closed {1000 * (closed - pressed):.1f} ms after the press")
    assert not conn.completed
    shown = await eventually(lambda: next((m for m in bot_messages(fake, dm) if m["content"].endswith("⏹ stopped")),
                                          None))
    assert shown["id"] == msg["id"]
    await eventually(lambda: not stop_ids(fake.message(int(msg["id"])) or {}), what="the button removed")
    await asyncio.sleep(0.2)
    assert [m["content"] for m in bot_messages(fake, dm)] == [shown["content"]]  # no "Stopped." besides
    _, history = await daemon.store.conversation(f"discord:dm:{dm}")
    assert history[-1].content + "\n\n⏹ stopped" == fake.message(int(msg["id"]))["content"]  # type: ignore[index]


async def test_the_final_message_has_no_button_and_a_late_press_stops_nothing(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 20
    await start()
    dm = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm, "first", author_id=ALICE_ID)
    msg, custom_id = await streaming_with_button(fake, dm)
    final = await reply_with(fake, dm, answer("first", 20))
    await eventually(lambda: not stop_ids(fake.message(int(final["id"])) or {}), what="no button on the final")
    provider.words = 1000
    await fake.dispatch_message(dm, "second", author_id=ALICE_ID)
    await eventually(lambda: provider.requests_for("second"))
    inter = await fake.push_component_interaction(dm, int(msg["id"]), custom_id, user_id=ALICE_ID,
                                                  check_component=False)  # a client not caught up
    body = await response(fake, inter)
    assert body["type"] == 4 and body["data"]["flags"] & 64 and "already ended" in body["data"]["content"]
    (conn,) = provider.requests_for("second")
    assert conn.closed_at is None, "the old button stopped the new answer"


async def test_in_a_server_only_the_asker_or_a_moderator_may_press_stop(
        start: Start, fake: FakeDiscord, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.02, 1000
    fake.member_permissions[BOB_ID] = 1 << 10  # view channel only
    await start()
    await fake.dispatch_message(TEXT_CHANNEL_ID, "mine", author_id=ALICE_ID, mentions_bot=True)
    msg, custom_id = await streaming_with_button(fake, TEXT_CHANNEL_ID)
    (conn,) = provider.requests_for("mine")
    inter = await fake.push_component_interaction(TEXT_CHANNEL_ID, int(msg["id"]), custom_id, user_id=BOB_ID)
    body = await response(fake, inter)
    assert body["type"] == 4 and body["data"]["flags"] & 64 and "Only alice" in body["data"]["content"]
    assert conn.closed_at is None
    fake.member_permissions[BOB_ID] = 1 << 13  # manage messages: a moderator
    inter = await fake.push_component_interaction(TEXT_CHANNEL_ID, int(msg["id"]), custom_id, user_id=BOB_ID)
    await provider.wait_closed(conn, 2)
    assert (await response(fake, inter))["type"] == 6
