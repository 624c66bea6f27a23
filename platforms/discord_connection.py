"""The Discord gateway connection: log in, register the application commands, connect, report health.

discord.py owns the connection itself (heartbeats, RESUME, re-IDENTIFY); this module decides when
to connect (in cluster mode only while this worker holds the ingress lease), retries a login that
failed on the way (on a fresh client), and turns what happened into the adapter's health.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import aiohttp
import discord
from discord import app_commands

from gateway.core import commands
from gateway.core.backoff import Backoff
from gateway.core.ports import Health
from platforms.ingress import IngressLeader

log = logging.getLogger("platforms.discord_bot")  # the Discord adapter logs under one name

TRANSIENT = (aiohttp.ClientError, OSError, TimeoutError)
CLOSE_WAIT_S = 5.0  # how long the gateway task may take to end after the client is closed
Interaction = discord.Interaction[Any]


class Fatal(Exception):
    """A failure no retry fixes (a rejected token); the text says what to do."""


def describe(exc: BaseException) -> str:
    if isinstance(exc, discord.HTTPException):
        return f"HTTP {exc.status} (code {exc.code}): {exc.text or 'no details'}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class ClientEvents(Protocol):
    """Where the client hands what users do (the adapter's intake)."""

    async def message(self, client: discord.Client, message: discord.Message) -> None: ...

    async def component(self, interaction: Interaction) -> None: ...

    async def command(self, interaction: Interaction, name: str) -> None: ...


class _Client(discord.Client):
    """A discord.Client that forwards events; it holds no state of its own."""

    def __init__(self, events: ClientEvents, connected: Callable[[bool], None], *, reidentify_delay_s: float,
                 **options: Any) -> None:
        intents = discord.Intents.none()
        intents.guilds = intents.guild_messages = intents.dm_messages = intents.message_content = True
        defaults: dict[str, Any] = {
            "allowed_mentions": discord.AllowedMentions.none(),  # model text must never ping anyone
            "max_messages": None,  # edits go through PartialMessage; no message cache needed
            "max_ratelimit_timeout": 30.0,  # longer waits raise discord.RateLimited instead of sleeping
        }
        # The daemon never joins voice: skip discord.py's warnings about missing voice libraries.
        discord.VoiceClient.warn_nacl = discord.VoiceClient.warn_dave = False
        super().__init__(intents=intents, **{**defaults, **options})
        self._events = events
        self._connected = connected
        self._reidentify_delay_s = reidentify_delay_s
        self.tree: app_commands.CommandTree[_Client] = app_commands.CommandTree(self)
        for name, description in commands.menu():
            self.tree.add_command(app_commands.Command(name=name, description=description,
                                                       callback=_command_callback(events, name)))

    async def before_identify_hook(self, shard_id: int | None, *, initial: bool = False) -> None:
        if not initial:  # Discord allows one IDENTIFY per 5 s; discord.py's default waits that long
            await asyncio.sleep(self._reidentify_delay_s)

    async def on_ready(self) -> None:
        self._connected(True)

    async def on_resumed(self) -> None:
        self._connected(True)

    async def on_disconnect(self) -> None:
        self._connected(False)

    async def on_message(self, message: discord.Message) -> None:
        await self._events.message(self, message)

    async def on_interaction(self, interaction: Interaction) -> None:
        if interaction.type is discord.InteractionType.component:
            await self._events.component(interaction)


def _command_callback(events: ClientEvents, name: str) -> Callable[[Interaction], Coroutine[Any, Any, None]]:
    async def callback(interaction: Interaction) -> None:
        await events.command(interaction, name)
    return callback


class DiscordConnection:
    """One bot's gateway connection; `client` is the current discord.py client (a login retry
    starts on a fresh one)."""

    def __init__(self, token: str, events: ClientEvents, *, register_commands: bool, leader: IngressLeader | None,
                 retry: Backoff, reidentify_delay_s: float, client_options: dict[str, Any]) -> None:
        self._token = token
        self._events = events
        self._register_commands = register_commands
        self._leader = leader
        self._retry = retry
        self._client_options = {"reidentify_delay_s": reidentify_delay_s, **client_options}
        self.client = self._new_client()
        self._task: asyncio.Task[None] | None = None
        self._connected = False
        self._standby = False
        self._problem: str | None = None

    def _new_client(self) -> _Client:
        return _Client(self._events, self._set_connected, **self._client_options)

    async def start(self) -> None:
        """Log in (a rejected token leaves the adapter unhealthy, not the daemon down), then connect
        in the background."""
        try:
            logged_in = await self._login()
        except Fatal as exc:
            self._fail(str(exc))
            return
        self._task = asyncio.get_running_loop().create_task(self._run(logged_in), name="discord-gateway")

    async def _login(self) -> bool:
        """True once logged in, False on a transient failure; raises Fatal for a rejected token."""
        try:
            await self.client.login(self._token)
            return True
        except discord.LoginFailure:
            raise Fatal("the bot token was rejected (401 Unauthorized); check discord.token") from None
        except (discord.HTTPException, *TRANSIENT) as exc:
            log.warning("discord: login failed (%s); will retry", describe(exc))
            await self.client.close()  # a retry logs in on a fresh client (fresh HTTP session)
            self.client = self._new_client()
            return False

    async def _run(self, logged_in: bool) -> None:
        try:
            while not logged_in:
                await asyncio.sleep(self._retry.step())
                logged_in = await self._login()
            if self._register_commands:
                await self._sync_commands()
            if self._leader is not None:  # cluster mode: one gateway connection per bot token
                self._standby = True
                await self._leader.wait()
                self._standby = False
            await self.client.connect(reconnect=True)  # returns when closed; reconnects on its own
        except Fatal as exc:
            self._fail(str(exc))
        except discord.PrivilegedIntentsRequired:
            self._fail("the Message Content intent is not enabled for this bot in the Discord developer portal")
        except (discord.DiscordException, *TRANSIENT) as exc:
            if not self.client.is_closed():
                self._fail(f"the gateway connection ended: {describe(exc)}")
        except Exception:
            log.exception("discord: the gateway task crashed")
            self._problem = "the gateway task crashed (see the log)"

    async def _sync_commands(self) -> None:
        try:
            synced = await self.client.tree.sync()
            log.info("discord: registered %d application commands", len(synced))
        except (discord.DiscordException, *TRANSIENT) as exc:  # text commands still work without them
            log.warning("discord: could not register application commands: %s", describe(exc))

    def _fail(self, problem: str) -> None:
        self._problem = problem
        log.error("discord: %s", problem)

    def _set_connected(self, connected: bool) -> None:
        was, self._connected = self._connected, connected
        user = self.client.user
        if connected and user is not None:
            if not was:
                log.info("discord: connected as %s (%s)", user.name, user.id)
        elif was and not connected and not self.client.is_closed():
            log.info("discord: gateway disconnected; discord.py is reconnecting")

    def health(self) -> Health:
        if self._problem is not None:
            return Health(False, self._problem)
        if self._standby:
            return Health(True, "standing by: another worker holds the Discord gateway")
        if self.client.is_closed():
            return Health(False, "stopped")
        if self._connected and self.client.is_ready():
            return Health(True, f"connected as {self.client.user}")
        return Health(False, "connecting to the Discord gateway")

    async def close(self) -> None:
        """Close the client and end the gateway task."""
        task = self._task
        if task is not None and not self.client.is_ready():
            task.cancel()  # still logging in or connecting: nothing to wind down
        await self.client.close()
        if task is not None:
            _done, late = await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
            for stuck in late:
                log.warning("discord: the gateway task did not end after close")
                stuck.cancel()
