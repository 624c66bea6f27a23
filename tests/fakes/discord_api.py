"""Loopback fake of Discord (REST API + gateway websocket) for driving real discord.py.

Usage::

    async with FakeDiscord() as fake, patch_discord(fake):
        client = discord.Client(intents=..., guild_ready_timeout=0.05)
        await client.login(fake.token)  # before wait_until_ready, which raises until login has run
        task = asyncio.create_task(client.connect())
        await asyncio.wait_for(client.wait_until_ready(), 5)
        await fake.dispatch_message(TEXT_CHANNEL_ID, "hello", author_id=ALICE_ID, mentions_bot=True)
        call = await fake.wait_for(lambda c: c.method == "POST" and c.path.endswith("/messages"))

Buttons: ``push_component_interaction`` clicks a component of a stored message; the bot's
callbacks are validated like Discord's (3 s deadline, one acknowledgement) and recorded on the
returned ``FakeInteraction``. ``delete_message`` and ``set_latency`` simulate a deleted message and
a slow channel.

Shards: a client IDENTIFYing as shard ``[i, N]`` gets the guilds (and their events) of shard
``shard_of(guild_id, N)`` = ``(guild_id >> 22) % N``, and shard 0 the DMs; ``shard_links`` records
every connection's time serving a shard (``shard_overlaps()``: two at once), ``live_shards()`` the
connections serving each shard now. A client closing with 1000 or 1001 ends its session, as on
Discord; any other close leaves it resumable (by any connection: a RESUME names the session).

See ``discord_models`` for the default ids (guild, channel, thread, users). discord.py quirks:
``guild_ready_timeout`` (default 2s) delays on_ready after the last GUILD_CREATE; a non-initial
IDENTIFY sleeps 5s in ``Client.before_identify_hook`` (override it in tests); the bot's own
messages are echoed back as MESSAGE_CREATE like on real Discord (``echo_own_messages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import discord.gateway
import discord.http
import yarl
from aiohttp import web

from tests.fakes.discord_gateway import GatewayMixin, ShardLink, shard_of
from tests.fakes.discord_models import (
    ALICE_ID,
    APPLICATION_ID,
    BOB_ID,
    BOT_ID,
    DEFAULT_TOKEN,
    GUILD_ID,
    PUBLIC_THREAD,
    TEXT_CHANNEL_ID,
    THREAD_ID,
    FakeChannel,
    FakeGuild,
    FakeInteraction,
    FakeUser,
    RestCall,
)
from tests.fakes.discord_rest import RestMixin


class FakeDiscord(RestMixin, GatewayMixin):
    """aiohttp server on 127.0.0.1 (random port) speaking Discord's REST and gateway protocols."""

    def __init__(
        self,
        *,
        bot_id: int = BOT_ID,
        bot_name: str = "switchboard",
        application_id: int | None = None,
        token: str = DEFAULT_TOKEN,
        guilds: Sequence[FakeGuild] | None = None,
        users: Sequence[FakeUser] | None = None,
        echo_own_messages: bool = True,
        heartbeat_interval_ms: int = 41250,
    ) -> None:
        super().__init__(
            bot_id=bot_id,
            bot_name=bot_name,
            application_id=application_id,
            token=token,
            guilds=guilds,
            users=users,
            echo_own_messages=echo_own_messages,
        )
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self._init_rest()
        self._init_gateway()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Start serving on an ephemeral loopback port."""
        app = web.Application(middlewares=[self._middleware])
        app.add_routes(self._rest_routes())
        app.add_routes([web.get(p, self._ws_handler) for p in ("/gateway-ws", "/gateway-resume")])
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self._base_url = f"http://{host}:{port}"

    async def stop(self) -> None:
        """Close websockets and stop the server."""
        if self._runner is not None:
            await self._close_gateway()
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeDiscord:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class _DiscordPatch:
    """Sets ``Route.BASE`` and ``DiscordWebSocket.DEFAULT_GATEWAY``; ``with`` or ``async with``."""

    def __init__(self, fake: FakeDiscord) -> None:
        self._fake = fake
        self._saved: tuple[str, yarl.URL] | None = None

    def __enter__(self) -> FakeDiscord:
        self._saved = (discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY)
        discord.http.Route.BASE = self._fake.rest_base
        discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(self._fake.gateway_url)
        return self._fake

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            discord.http.Route.BASE, discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = self._saved
            self._saved = None

    async def __aenter__(self) -> FakeDiscord:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__()


def patch_discord(fake: FakeDiscord) -> _DiscordPatch:
    """Point discord.py's REST base and default gateway at a started fake; restored on exit."""
    return _DiscordPatch(fake)


__all__ = [
    "ALICE_ID",
    "APPLICATION_ID",
    "BOB_ID",
    "BOT_ID",
    "DEFAULT_TOKEN",
    "GUILD_ID",
    "PUBLIC_THREAD",
    "TEXT_CHANNEL_ID",
    "THREAD_ID",
    "FakeChannel",
    "FakeDiscord",
    "FakeGuild",
    "FakeInteraction",
    "FakeUser",
    "RestCall",
    "ShardLink",
    "patch_discord",
    "shard_of",
]
