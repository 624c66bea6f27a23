"""The real discord.py library, driven against the loopback Discord fake."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import discord
import pytest
import pytest_asyncio
from discord import app_commands

from tests.fakes.discord_api import (
    ALICE_ID,
    APPLICATION_ID,
    BOT_ID,
    GUILD_ID,
    TEXT_CHANNEL_ID,
    THREAD_ID,
    FakeChannel,
    FakeDiscord,
    FakeGuild,
    patch_discord,
    shard_of,
)


class Bot(discord.Client):
    """Client that queues every non-own message and flags lifecycle events."""

    def __init__(self, *, message_content: bool = True, members: bool = False, **options: Any) -> None:
        intents = discord.Intents.default()
        intents.message_content = message_content
        intents.members = members
        # guild_ready_timeout: discord.py waits this long after the last GUILD_CREATE before on_ready.
        super().__init__(intents=intents, guild_ready_timeout=0.05, **options)
        self.inbox: asyncio.Queue[discord.Message] = asyncio.Queue()
        self.ready_count = 0
        self.resumed = asyncio.Event()
        self.interactions: list[discord.Interaction] = []

    async def before_identify_hook(self, shard_id: int | None, *, initial: bool = False) -> None:
        """discord.py sleeps 5s before every non-initial IDENTIFY; skip that in tests."""

    async def on_ready(self) -> None:
        self.ready_count += 1

    async def on_resumed(self) -> None:
        self.resumed.set()

    async def on_message(self, message: discord.Message) -> None:
        if message.author != self.user:
            await self.inbox.put(message)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        self.interactions.append(interaction)

    async def next_message(self) -> discord.Message:
        return await asyncio.wait_for(self.inbox.get(), 3.0)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord() as server, patch_discord(server):
        yield server


async def _run(bot: discord.Client, fake: FakeDiscord) -> asyncio.Task[None]:
    """Log in, connect in a task, and return that task once READY has arrived.

    ``wait_until_ready`` raises until ``login`` has run, so logging in comes first and is awaited:
    ``create_task(bot.start(...))`` followed by ``wait_for(bot.wait_until_ready(), ...)`` only worked
    while ``wait_for`` wrapped its coroutine in a new task (Python 3.11). Since 3.12 it runs the
    coroutine in the calling task, before the start task has run at all.
    """
    await bot.login(fake.token)
    task = asyncio.create_task(bot.connect())
    ready = asyncio.create_task(bot.wait_until_ready())
    done, _ = await asyncio.wait({task, ready}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    if ready in done:
        return task
    ready.cancel()
    await bot.close()
    await asyncio.wait_for(task, 5)  # raises why the gateway connection failed, if it did
    raise AssertionError("no READY from the fake gateway within 5 s")


async def _stop(bot: discord.Client, task: asyncio.Task[None]) -> None:
    await bot.close()
    await asyncio.wait_for(task, 5)


@pytest_asyncio.fixture
async def client(fake: FakeDiscord) -> AsyncIterator[Bot]:
    bot = Bot()
    task = await _run(bot, fake)
    yield bot
    await _stop(bot, task)


async def test_login_and_ready(fake: FakeDiscord, client: Bot) -> None:
    assert client.ready_count == 1
    assert client.user is not None and client.user.id == BOT_ID
    assert client.application_id == APPLICATION_ID
    guild = client.get_guild(GUILD_ID)
    assert guild is not None and guild.me is not None
    assert isinstance(guild.get_channel(TEXT_CHANNEL_ID), discord.TextChannel)
    thread = guild.get_thread(THREAD_ID)
    assert thread is not None and thread.parent_id == TEXT_CHANNEL_ID
    paths = [c.path for c in fake.requests]
    assert paths[:2] == ["/users/@me", "/oauth2/applications/@me"]
    assert fake.connections == fake.identify_count == 1
    # zstd-stream when discord.py finds zstandard (or Python 3.14's compression.zstd), else zlib-stream.
    assert fake.gateway_queries[0] == {"v": "10", "encoding": "json",
                                       "compress": discord.utils._ActiveDecompressionContext.COMPRESSION_TYPE}


async def test_bad_token_is_rejected(fake: FakeDiscord) -> None:
    bot = Bot()
    with pytest.raises(discord.LoginFailure):
        await bot.login("wrong-token")
    await bot.close()
    assert fake.requests[0].status == 401


async def test_uncompressed_fallback(fake: FakeDiscord, monkeypatch: pytest.MonkeyPatch) -> None:
    # discord.py asks for zstd-stream when zstandard / Python 3.14 is available; the fake then
    # sends plain TEXT frames, which discord.py accepts whatever compression it requested.
    monkeypatch.setattr(discord.utils._ActiveDecompressionContext, "COMPRESSION_TYPE", "zstd-stream")
    bot = Bot()
    task = await _run(bot, fake)
    try:
        assert fake.gateway_queries[0]["compress"] == "zstd-stream"
        await fake.dispatch_message(TEXT_CHANNEL_ID, "plain", author_id=ALICE_ID)
        assert (await bot.next_message()).content == "plain"
    finally:
        await _stop(bot, task)


async def test_guild_mention_received(fake: FakeDiscord, client: Bot) -> None:
    mid = await fake.dispatch_message(
        TEXT_CHANNEL_ID, "hello there", author_id=ALICE_ID, author_name="alice", mentions_bot=True
    )
    message = await client.next_message()
    assert message.id == mid
    assert message.content == f"<@{BOT_ID}> hello there"
    assert client.user in message.mentions
    assert message.guild is not None and message.guild.id == GUILD_ID
    assert isinstance(message.channel, discord.TextChannel)
    assert isinstance(message.author, discord.Member) and message.author.name == "alice"


async def test_reply_records_reference(fake: FakeDiscord, client: Bot) -> None:
    mid = await fake.dispatch_message(TEXT_CHANNEL_ID, "ping", author_id=ALICE_ID, author_name="alice")
    message = await client.next_message()
    reply = await message.reply("hi")
    assert reply.reference is not None and reply.reference.message_id == mid
    call = await fake.wait_for(lambda c: c.method == "POST" and c.channel_id == TEXT_CHANNEL_ID)
    assert call.json["content"] == "hi"
    assert int(call.json["message_reference"]["message_id"]) == mid
    stored = fake.messages(TEXT_CHANNEL_ID)[-1]
    assert stored["type"] == 19 and stored["referenced_message"]["id"] == str(mid)
    assert stored["author"]["id"] == str(BOT_ID)


async def test_edit_and_delete(fake: FakeDiscord, client: Bot) -> None:
    channel = client.get_channel(TEXT_CHANNEL_ID)
    assert isinstance(channel, discord.TextChannel)
    sent = await channel.send("draft")
    edited = await sent.edit(content="final")
    assert edited.content == "final" and edited.edited_at is not None
    state = fake.message(sent.id)
    assert state is not None and state["content"] == "final"
    assert [c.method for c in fake.sent] == ["POST", "PATCH"]
    await sent.delete()
    assert fake.message(sent.id) is None
    with pytest.raises(discord.NotFound):
        await channel.fetch_message(sent.id)


async def test_too_long_message_is_rejected(fake: FakeDiscord, client: Bot) -> None:
    channel = client.get_channel(TEXT_CHANNEL_ID)
    assert isinstance(channel, discord.TextChannel)
    with pytest.raises(discord.HTTPException) as info:
        await channel.send("x" * 2001)
    assert info.value.status == 400 and info.value.code == 50035
    assert fake.messages(TEXT_CHANNEL_ID) == []


async def test_dm_message(fake: FakeDiscord, client: Bot) -> None:
    dm_id = fake.dm_channel_id(ALICE_ID)
    await fake.dispatch_message(dm_id, "psst", author_id=ALICE_ID, author_name="alice")
    message = await client.next_message()
    assert isinstance(message.channel, discord.DMChannel)
    assert message.guild is None and message.content == "psst"
    await message.channel.send("hello in private")
    assert fake.messages(dm_id)[-1]["content"] == "hello in private"
    user = await client.fetch_user(ALICE_ID)
    dm = await user.create_dm()
    assert dm.id == dm_id


async def test_thread_message(fake: FakeDiscord, client: Bot) -> None:
    await fake.dispatch_message(THREAD_ID, "in a thread", author_id=ALICE_ID, author_name="alice")
    message = await client.next_message()
    assert isinstance(message.channel, discord.Thread)
    assert message.channel.id == THREAD_ID and message.channel.parent_id == TEXT_CHANNEL_ID
    async with message.channel.typing():
        await message.channel.send("thread reply")
    assert [c.path for c in fake.sent] == [f"/channels/{THREAD_ID}/typing", f"/channels/{THREAD_ID}/messages"]


async def test_rate_limit_is_retried(fake: FakeDiscord, client: Bot) -> None:
    channel = client.get_channel(TEXT_CHANNEL_ID)
    assert isinstance(channel, discord.TextChannel)
    fake.fail_next("POST", "/channels/*/messages", status=429, retry_after=0.2)
    started = time.monotonic()
    await channel.send("eventually")
    assert time.monotonic() - started >= 0.2
    assert [c.status for c in fake.sent] == [429, 200]
    assert [m["content"] for m in fake.messages(TEXT_CHANNEL_ID)] == ["eventually"]


async def test_drop_gateway_resumes(fake: FakeDiscord, client: Bot) -> None:
    await fake.drop_gateway()
    # Dispatched while disconnected: buffered in the session and replayed on RESUME.
    await fake.dispatch_message(TEXT_CHANNEL_ID, "while away", author_id=ALICE_ID)
    await asyncio.wait_for(client.resumed.wait(), 5)
    assert (await client.next_message()).content == "while away"
    assert fake.resume_count == 1 and fake.identify_count == 1 and fake.connections == 2
    await fake.dispatch_message(TEXT_CHANNEL_ID, "after resume", author_id=ALICE_ID)
    assert (await client.next_message()).content == "after resume"


async def test_invalidated_session_reidentifies(fake: FakeDiscord, client: Bot) -> None:
    await fake.drop_gateway(resumable=False)
    await fake.wait_connected()
    assert fake.identify_count == 2 and fake.resume_count == 0
    await fake.dispatch_message(TEXT_CHANNEL_ID, "new session", author_id=ALICE_ID)
    assert (await client.next_message()).content == "new session"


async def test_message_content_intent_is_enforced(fake: FakeDiscord) -> None:
    bot = Bot(message_content=False)
    task = await _run(bot, fake)
    try:
        await fake.dispatch_message(TEXT_CHANNEL_ID, "secret", author_id=ALICE_ID)
        assert (await bot.next_message()).content == ""
        await fake.dispatch_message(TEXT_CHANNEL_ID, "visible", author_id=ALICE_ID, mentions_bot=True)
        assert (await bot.next_message()).content == f"<@{BOT_ID}> visible"
    finally:
        await _stop(bot, task)


async def test_members_intent_chunks_guild(fake: FakeDiscord) -> None:
    bot = Bot(members=True)
    task = await _run(bot, fake)
    try:
        guild = bot.get_guild(GUILD_ID)
        assert guild is not None and guild.chunked
        member = guild.get_member(ALICE_ID)
        assert member is not None and member.name == "alice"
        assert any(p["op"] == 8 for p in fake.gateway_received)
    finally:
        await _stop(bot, task)


async def test_attachment_download(fake: FakeDiscord, client: Bot) -> None:
    files = [{"filename": "notes.txt", "content": b"hello file", "content_type": "text/plain"}]
    await fake.dispatch_message(TEXT_CHANNEL_ID, "see file", author_id=ALICE_ID, attachments=files)
    message = await client.next_message()
    assert message.attachments[0].filename == "notes.txt"
    assert await message.attachments[0].read() == b"hello file"


async def test_slash_command_roundtrip(fake: FakeDiscord) -> None:
    bot = Bot()
    tree = app_commands.CommandTree(bot)
    seen: list[Any] = []

    @tree.command(name="ask", description="Ask the agent")
    async def ask(interaction: discord.Interaction, question: str) -> None:
        seen.append(question)
        await interaction.response.defer(thinking=True)
        await interaction.edit_original_response(content=f"answer to {question}")
        await interaction.followup.send("anything else?")

    @tree.command(name="ping", description="Liveness check")
    async def ping(interaction: discord.Interaction) -> None:
        await interaction.response.send_message("pong", ephemeral=True)

    task = await _run(bot, fake)
    try:
        synced = await tree.sync()
        assert sorted(c.name for c in synced) == ["ask", "ping"]
        put = await fake.wait_for(lambda c: c.method == "PUT")
        assert put.path == f"/applications/{APPLICATION_ID}/commands" and len(put.json) == 2
        inter = await fake.dispatch_interaction("ask", channel_id=TEXT_CHANNEL_ID, options={"question": "why"})
        await fake.wait_for(lambda c: c.method == "POST" and c.path == f"/webhooks/{APPLICATION_ID}/{inter.token}")
        assert seen == ["why"]
        contents = [m["content"] for m in fake.messages(TEXT_CHANNEL_ID)]
        assert contents == ["answer to why", "anything else?"]
        callback = next(c for c in fake.sent if c.path.endswith("/callback"))
        assert callback.json["type"] == 5 and callback.channel_id == TEXT_CHANNEL_ID
        ping_inter = await fake.dispatch_interaction("ping", channel_id=TEXT_CHANNEL_ID)
        call = await fake.wait_for(lambda c: c.path == f"/interactions/{ping_inter.id}/{ping_inter.token}/callback")
        assert call.status == 200 and call.json["type"] == 4
        assert call.json["data"]["content"] == "pong" and call.json["data"]["flags"] == 64
    finally:
        await _stop(bot, task)


async def test_client_closes_cleanly(fake: FakeDiscord) -> None:
    loop = asyncio.get_running_loop()
    problems: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: problems.append(context))
    try:
        bot = Bot()
        task = await _run(bot, fake)
        await _stop(bot, task)
        assert bot.is_closed() and bot.ws.socket.closed
        assert bot.http.connector.closed  # the aiohttp session closed its connector
        del bot, task
        gc.collect()
        await asyncio.sleep(0.05)
    finally:
        loop.set_exception_handler(previous)
    assert problems == []
    assert fake.connections == 1


OnClick = Callable[[discord.Interaction], Awaitable[None]]


class StopView(discord.ui.View):
    """One "Stop" button (custom_id "stop"); each click runs `on_click` and is queued."""

    def __init__(self, on_click: OnClick) -> None:
        super().__init__(timeout=None)
        self.on_click = on_click
        self.clicks: asyncio.Queue[discord.Interaction] = asyncio.Queue()

    @discord.ui.button(label="Stop", style=discord.ButtonStyle.danger, custom_id="stop")
    async def stop_button(self, interaction: discord.Interaction, button: discord.ui.Button[StopView]) -> None:
        await self.on_click(interaction)
        await self.clicks.put(interaction)

    async def next_click(self) -> discord.Interaction:
        return await asyncio.wait_for(self.clicks.get(), 3.0)


async def _nothing(interaction: discord.Interaction) -> None:
    pass


def _text_channel(client: discord.Client) -> discord.TextChannel:
    channel = client.get_channel(TEXT_CHANNEL_ID)
    assert isinstance(channel, discord.TextChannel)
    return channel


async def test_components_stored_replaced_and_validated(fake: FakeDiscord, client: Bot) -> None:
    channel = _text_channel(client)
    sent = await channel.send("working", view=StopView(_nothing))
    stored = fake.message(sent.id)
    assert stored is not None
    (row,) = stored["components"]
    assert row["type"] == 1 and [(b["type"], b["custom_id"], b["style"]) for b in row["components"]] == [
        (2, "stop", 4),
    ]  # fmt: skip
    button = sent.components[0].children[0]  # type: ignore[union-attr]
    assert isinstance(button, discord.Button) and button.custom_id == "stop"
    relabelled = discord.ui.View()
    relabelled.add_item(discord.ui.Button(label="Stopping…", custom_id="stop", disabled=True))
    await sent.edit(view=relabelled)  # components replaced, content kept
    stored = fake.message(sent.id)
    assert stored is not None and stored["content"] == "working"
    assert stored["components"][0]["components"][0]["disabled"] is True
    edited = await sent.edit(content="done", view=None)  # components removed
    assert edited.components == [] and (fake.message(sent.id) or {})["components"] == []
    twins = discord.ui.View()
    for label in ("a", "b"):
        twins.add_item(discord.ui.Button(label=label, custom_id="same"))
    with pytest.raises(discord.HTTPException, match="custom id cannot be duplicated") as info:
        await channel.send("twins", view=twins)
    assert info.value.status == 400 and info.value.code == 50035


async def test_component_click_routes_to_view_and_updates_message(fake: FakeDiscord, client: Bot) -> None:
    async def stop(interaction: discord.Interaction) -> None:
        await interaction.response.edit_message(content="stopped", view=None)  # UPDATE_MESSAGE (7)

    view = StopView(stop)
    sent = await _text_channel(client).send("working", view=view)
    inter = await fake.push_component_interaction(TEXT_CHANNEL_ID, sent.id, "stop", user_id=ALICE_ID)
    clicked = await view.next_click()
    assert clicked.type is discord.InteractionType.component and clicked.id == inter.id
    assert clicked.data is not None and clicked.data.get("custom_id") == "stop"
    assert clicked.message is not None and clicked.message.id == sent.id
    assert isinstance(clicked.user, discord.Member) and clicked.user.name == "alice"
    assert clicked.guild_id == GUILD_ID and client.interactions == [clicked]  # on_interaction too
    assert (inter.type, inter.message_id, inter.response_type, inter.response_flags) == (3, sent.id, 7, 0)
    assert inter.response_latency is not None and 0 <= inter.response_latency < 3
    stored = fake.message(sent.id)
    assert stored is not None and (stored["content"], stored["components"]) == ("stopped", [])
    with pytest.raises(ValueError, match="no enabled component"):  # the button is gone now
        await fake.push_component_interaction(TEXT_CHANNEL_ID, sent.id, "stop", user_id=ALICE_ID)
    # discord.py refuses a second response itself, so ask the fake directly: Discord's 40060
    url = f"{fake.rest_base}/interactions/{inter.id}/{inter.token}/callback"
    async with aiohttp.ClientSession() as http, http.post(url, json={"type": 6}) as resp:
        assert resp.status == 400 and (await resp.json())["code"] == 40060


async def test_component_click_in_dm_deferred_update_and_ephemeral_followup(fake: FakeDiscord, client: Bot) -> None:
    async def stop(interaction: discord.Interaction) -> None:
        await interaction.response.defer()  # DEFERRED_UPDATE_MESSAGE (6) for a component
        await interaction.edit_original_response(content="stopped", view=None)  # the button's message
        await interaction.followup.send("only you see this", ephemeral=True)

    dm_id = fake.dm_channel_id(ALICE_ID)
    dm = await (await client.fetch_user(ALICE_ID)).create_dm()
    view = StopView(stop)
    sent = await dm.send("working", view=view)
    inter = await fake.push_component_interaction(dm_id, sent.id, "stop", user_id=ALICE_ID)
    clicked = await view.next_click()
    assert clicked.guild is None and isinstance(clicked.user, discord.User)
    assert isinstance(clicked.channel, discord.DMChannel) and clicked.channel.id == dm_id
    assert (inter.guild_id, inter.response_type, inter.original_id) == (None, 6, sent.id)
    component_msg, followup = fake.messages(dm_id)
    assert (component_msg["id"], component_msg["content"], component_msg["components"]) == (
        str(sent.id), "stopped", [],
    )  # fmt: skip
    assert followup["content"] == "only you see this" and followup["flags"] & 64
    assert followup["interaction_metadata"]["type"] == 3


async def test_late_interaction_response_is_unknown(fake: FakeDiscord, client: Bot) -> None:
    errors: list[discord.HTTPException] = []

    async def too_late(interaction: discord.Interaction) -> None:
        for attempt in (interaction.response.defer(), interaction.followup.send("late")):
            try:
                await attempt
            except discord.NotFound as exc:
                errors.append(exc)

    fake.interaction_deadline_s = 0.0  # any response now comes after the deadline (Discord: 3 s)
    view = StopView(too_late)
    sent = await _text_channel(client).send("working", view=view)
    inter = await fake.push_component_interaction(TEXT_CHANNEL_ID, sent.id, "stop", user_id=ALICE_ID)
    await view.next_click()
    assert [(e.status, e.code) for e in errors] == [(404, 10062), (404, 10015)]
    assert "Unknown interaction" in str(errors[0])
    assert not inter.responded and inter.response_type is None


async def test_deleted_message_edit_is_unknown(fake: FakeDiscord, client: Bot) -> None:
    sent = await _text_channel(client).send("streaming…")
    deleted = asyncio.create_task(client.wait_for("raw_message_delete", timeout=3))
    assert await fake.delete_message(sent.id)  # a moderator deletes it mid-stream
    assert (await deleted).message_id == sent.id
    with pytest.raises(discord.NotFound) as info:
        await sent.edit(content="streaming… more")
    assert (info.value.status, info.value.code) == (404, 10008)
    assert not await fake.delete_message(sent.id)


async def test_latency_slows_one_channel_only(fake: FakeDiscord, client: Bot) -> None:
    guild = client.get_guild(GUILD_ID)
    thread = guild.get_thread(THREAD_ID) if guild else None
    assert thread is not None
    fake.set_latency(TEXT_CHANNEL_ID, 0.5)
    started = time.monotonic()
    slow = asyncio.create_task(_text_channel(client).send("slow"))
    await thread.send("fast")
    fast_done = time.monotonic() - started
    await asyncio.wait_for(slow, 5)
    slow_done = time.monotonic() - started
    assert fast_done < 0.5 <= slow_done
    assert [c.channel_id for c in fake.sent] == [THREAD_ID, TEXT_CHANNEL_ID]


# --- shards -------------------------------------------------------------------------------------

EVEN_GUILD, EVEN_CHANNEL = GUILD_ID + (1 << 22), 1200000000000000030  # shard 0 of 2 (GUILD_ID: shard 1)


def test_shard_of_follows_discords_rule() -> None:
    assert shard_of((5 << 22) | 123, 3) == 2 and shard_of(5 << 22, 5) == 0 and shard_of(7 << 22, 1) == 0
    assert (shard_of(EVEN_GUILD, 2), shard_of(GUILD_ID, 2)) == (0, 1)
    assert shard_of(None, 4) == 0  # DMs: shard 0


@pytest_asyncio.fixture
async def two_guilds() -> AsyncIterator[FakeDiscord]:
    guilds = [FakeGuild(GUILD_ID, "odd", [FakeChannel(TEXT_CHANNEL_ID, "general")], [ALICE_ID]),
              FakeGuild(EVEN_GUILD, "even", [FakeChannel(EVEN_CHANNEL, "general")], [ALICE_ID])]
    async with FakeDiscord(guilds=guilds) as server, patch_discord(server):
        yield server


async def _shards(fake: FakeDiscord, *shard_ids: int) -> list[tuple[Bot, asyncio.Task[None]]]:
    bots = []
    for shard_id in shard_ids:
        bot = Bot(shard_id=shard_id, shard_count=2)
        bots.append((bot, await _run(bot, fake)))
    return bots


async def test_each_shard_gets_its_guilds_and_shard_zero_the_dms(two_guilds: FakeDiscord) -> None:
    fake = two_guilds
    (zero, t0), (one, t1) = await _shards(fake, 0, 1)
    try:
        assert [g.id for g in zero.guilds] == [EVEN_GUILD] and [g.id for g in one.guilds] == [GUILD_ID]
        identified = [p["d"]["shard"] for p in fake.gateway_received if p["op"] == 2]
        assert identified == [[0, 2], [1, 2]]
        await fake.dispatch_message(TEXT_CHANNEL_ID, "odd", author_id=ALICE_ID)
        await fake.dispatch_message(EVEN_CHANNEL, "even", author_id=ALICE_ID)
        await fake.dispatch_message(fake.dm_channel_id(ALICE_ID), "dm", author_id=ALICE_ID)
        assert (await one.next_message()).content == "odd"
        assert [(await zero.next_message()).content for _ in range(2)] == ["even", "dm"]
        await asyncio.sleep(0.1)
        assert one.inbox.empty() and zero.inbox.empty()
        assert fake.live_shards() == {0: 1, 1: 1} and fake.shard_overlaps() == []
        assert [(link.shard, link.count, link.how) for link in fake.shard_links] == [(0, 2, "identify"),
                                                                                     (1, 2, "identify")]
    finally:
        await _stop(zero, t0)
        await _stop(one, t1)
    assert fake.live_shards() == {}


async def test_a_shard_connected_twice_gets_its_events_twice_and_is_recorded(two_guilds: FakeDiscord) -> None:
    fake = two_guilds
    (first, t0), (second, t1) = await _shards(fake, 1, 1)
    try:
        await fake.dispatch_message(TEXT_CHANNEL_ID, "both", author_id=ALICE_ID)
        assert (await first.next_message()).content == (await second.next_message()).content == "both"
        assert fake.live_shards() == {1: 2}
        ((a, b),) = fake.shard_overlaps()
        assert (a.shard, b.shard) == (1, 1) and a.session != b.session
    finally:
        await _stop(first, t0)
        await _stop(second, t1)


async def _raw_resume(fake: FakeDiscord, session: str, seq: int) -> tuple[aiohttp.ClientSession, Any, list[Any]]:
    """A bare websocket that RESUMEs `session` from `seq` (what another process taking a shard over
    does): its open socket and what it received up to RESUMED or op 9."""
    http = aiohttp.ClientSession()
    ws = await http.ws_connect(fake.gateway_url)
    got = [await ws.receive_json(timeout=5)]  # HELLO
    await ws.send_json({"op": 6, "d": {"token": fake.token, "session_id": session, "seq": seq}})
    while got[-1]["op"] != 9 and got[-1].get("t") != "RESUMED":
        got.append(await ws.receive_json(timeout=5))
    return http, ws, got[1:]


async def test_a_session_is_resumed_by_another_connection(two_guilds: FakeDiscord) -> None:
    fake = two_guilds
    ((bot, task),) = await _shards(fake, 1)
    await fake.dispatch_message(TEXT_CHANNEL_ID, "seen", author_id=ALICE_ID)
    assert (await bot.next_message()).content == "seen"
    session, seq = bot.ws.session_id, bot.ws.sequence
    assert session is not None and seq is not None
    task.cancel()  # the holder goes away without a clean close (as a killed process does)
    await asyncio.wait({task})
    await bot.ws.close(code=4000)
    await bot.close()
    assert fake.live_shards() == {}
    missed = await fake.dispatch_message(TEXT_CHANNEL_ID, "while nobody held the shard", author_id=ALICE_ID)
    http, ws, got = await _raw_resume(fake, session, seq)
    try:
        assert [(e.get("t"), e["d"].get("id")) for e in got] == [("MESSAGE_CREATE", str(missed)), ("RESUMED", None)]
        assert fake.live_shards() == {1: 1} and fake.shard_links[-1].how == "resume"
        assert fake.shard_overlaps() == []
    finally:
        await ws.close(code=1000)
        await http.close()


async def test_a_cleanly_closed_session_cannot_be_resumed(two_guilds: FakeDiscord) -> None:
    fake = two_guilds
    ((bot, task),) = await _shards(fake, 1)
    session, seq = bot.ws.session_id, bot.ws.sequence
    assert session is not None and seq is not None
    # Closed with 1000 while nothing reads the socket (discord.py's own close races its reader,
    # which closes with 4000 first: the session then stays resumable).
    task.cancel()
    await asyncio.wait({task})
    await bot.ws.close(code=1000)
    await bot.close()
    with pytest.raises(RuntimeError, match="no gateway session"):
        await fake.dispatch_message(TEXT_CHANNEL_ID, "nobody there", author_id=ALICE_ID)
    http, ws, got = await _raw_resume(fake, session, seq)
    try:
        assert [e["op"] for e in got] == [9]
    finally:
        await ws.close()
        await http.close()
