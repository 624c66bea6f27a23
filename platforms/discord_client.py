"""The discord.py client the Discord adapter runs: one for REST calls (sends, edits, the command
registration) and one per gateway shard this worker holds.

A shard's client can take over a gateway session another process left (`Handoff`): its first
connection RESUMEs that session instead of IDENTIFYing a new one, and Discord replays what the
session missed meanwhile. While connected it keeps `progress`: the session, where to resume it,
and the sequence number up to which the intake has looked at every message — what the shard's
holder hands on. discord.py has no way to start with a RESUME, so `BotClient.connect` is
discord.py's own loop (2.7) with that one difference, and with a check before every connection
that the shard is still this worker's. Nor does a client hand a message to the intake once the
shard is not this worker's any more: its next holder gets it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import discord
import yarl
from discord import app_commands
from discord.backoff import ExponentialBackoff
from discord.gateway import DiscordWebSocket, ReconnectWebSocket

from gateway.core import commands

log = logging.getLogger("platforms.discord_bot")  # the Discord adapter logs under one name

TRANSIENT = (aiohttp.ClientError, OSError, TimeoutError)
# What discord.py's own connect loop reconnects after (a clean close included: Discord sends 1000 at times).
RECONNECTABLE = (OSError, discord.HTTPException, discord.GatewayNotFound, discord.ConnectionClosed,
                 aiohttp.ClientError, asyncio.TimeoutError)
RESUMABLE_CLOSE = 4000  # any code but 1000 and 1001 leaves the session resumable
Interaction = discord.Interaction[Any]


class Fatal(Exception):
    """A failure no retry fixes (a rejected token); the text says what to do."""


def describe(exc: BaseException) -> str:
    if isinstance(exc, discord.HTTPException):
        return f"HTTP {exc.status} (code {exc.code}): {exc.text or 'no details'}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class ClientEvents(Protocol):
    """Where the clients hand what users do (the adapter's intake)."""

    async def message(self, client: discord.Client, message: discord.Message) -> bool:
        """False if the message was not looked at (intake is closing): it is the next holder's."""

    async def component(self, interaction: Interaction) -> None: ...

    async def command(self, interaction: Interaction, name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Handoff:
    """Where a shard's gateway session stands: its id, the URL to resume it at, and the sequence
    number up to which every message has been handed to the router. Resuming from there replays
    the rest; what was handled already comes again and is de-duplicated by its message id."""

    session: str
    url: str
    seq: int

    def dumps(self) -> str:
        return json.dumps({"session": self.session, "url": self.url, "seq": self.seq})

    @classmethod
    def loads(cls, raw: str | None) -> Handoff | None:
        """A handoff as `dumps` wrote it; None for nothing, or for anything else."""
        try:
            data = json.loads(raw) if raw else None
            return cls(str(data["session"]), str(data["url"]), int(data["seq"])) if data else None
        except (ValueError, TypeError, KeyError):
            return None


class IdentifyGate:
    """Discord accepts one IDENTIFY per 5 s from a bot: the shards of this process take turns."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._last = -math.inf
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        async with self._lock:
            delay = self._last + self._interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self._last = time.monotonic()


def _never_asked(_connected: bool) -> None:
    pass


class BotClient(discord.Client):
    """A discord.Client that forwards events to the adapter's intake and keeps `progress`; it
    holds no other state. `shard_id`/`shard_count` (discord.py options) make it one shard's."""

    def __init__(self, events: ClientEvents, *, gate: IdentifyGate, connected: Callable[[bool], None] = _never_asked,
                 handoff: Handoff | None = None, may_connect: Callable[[], bool] = lambda: True,
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
        self._gate = gate
        self._connected = connected
        self._handoff = handoff
        self._may_connect = may_connect
        self.progress = handoff  # where the session stands (see `Handoff`)
        # Messages dispatched and not looked at yet: message id -> (session, sequence number).
        self._in_hand: dict[int, tuple[str | None, int]] = {}
        self._idle = asyncio.Event()  # set while nothing is in hand
        self._idle.set()
        self._unread: tuple[str | None, int] | None = None  # the first message the intake did not look at
        self.tree: app_commands.CommandTree[BotClient] = app_commands.CommandTree(self)
        for name, description in commands.menu():
            self.tree.add_command(app_commands.Command(name=name, description=description,
                                                       callback=self._command(name)))

    def ours(self) -> bool:
        """Is the shard still this worker's (always, in one process)?"""
        return self._may_connect()

    # --- progress -------------------------------------------------------------------------

    def dispatch(self, event: str, /, *args: Any, **kwargs: Any) -> None:
        # Called as each gateway event is parsed, with `ws.sequence` already the event's.
        ws: DiscordWebSocket | None = self.ws
        if event == "message" and ws is not None and ws.sequence is not None:
            self._in_hand[args[0].id] = (ws.session_id, ws.sequence)
            self._idle.clear()
        super().dispatch(event, *args, **kwargs)
        self._settle()

    def _settle(self) -> None:
        """Move `progress` on: up to the current sequence number, but short of any message still
        in hand, and of the first one the intake did not look at (and so never past it again)."""
        ws: DiscordWebSocket | None = self.ws
        if ws is None or ws.session_id is None or ws.sequence is None:
            return
        session, upto = ws.session_id, ws.sequence
        for stop in [*self._in_hand.values(), self._unread]:
            if stop is not None and stop[0] == session:
                upto = min(upto, stop[1] - 1)
        current = self.progress
        if current is None or current.session != session or upto > current.seq:
            self.progress = Handoff(session, str(ws.gateway), upto)

    async def settled(self) -> None:
        """Return once every message dispatched has been looked at or let go."""
        await self._idle.wait()

    # --- the gateway connection -----------------------------------------------------------

    async def connect(self, *, reconnect: bool = True) -> None:
        """discord.py's `Client.connect` (always reconnecting), except that the first connection
        RESUMEs the session handed on (if any), and that none is opened once `may_connect` says no.
        On an invalid session discord.py's websocket IDENTIFYs anew, as it does for its own."""
        backoff = ExponentialBackoff()
        params: dict[str, Any] = {"initial": True, "shard_id": self.shard_id}
        if self._handoff is not None:
            h = self._handoff
            params.update(resume=True, session=h.session, sequence=h.seq, gateway=yarl.URL(h.url))
        while not self.is_closed() and self._may_connect():
            try:
                self.ws = await asyncio.wait_for(DiscordWebSocket.from_client(self, **params), timeout=60.0)
                params["initial"] = False
                while True:
                    await self.ws.poll_event()
            except ReconnectWebSocket as exc:
                self.dispatch("disconnect")
                params.update(self._where(), resume=exc.resume)
            except RECONNECTABLE as exc:
                self.dispatch("disconnect")
                if self.is_closed():
                    return
                if isinstance(exc, discord.ConnectionClosed):
                    if exc.code == 4014:
                        raise discord.PrivilegedIntentsRequired(exc.shard_id) from None
                    if exc.code != 1000:  # a close code no reconnect fixes (4004, 4010-4013)
                        await self.close()
                        raise
                await asyncio.sleep(backoff.delay())
                params.update(self._where(), resume=True)

    def _where(self) -> dict[str, Any]:
        """The session the last websocket had, to resume (nothing, if none was opened yet)."""
        ws: DiscordWebSocket | None = self.ws  # None until the first websocket opened
        if ws is None:
            return {}
        return {"sequence": ws.sequence, "session": ws.session_id, "gateway": ws.gateway}

    async def disconnect(self, connecting: asyncio.Task[None] | None) -> None:
        """End the gateway connection (the task running `connect`) and leave the session
        resumable, for whoever holds the shard next; REST calls (interactions being answered)
        still work until `close`."""
        if connecting is not None:
            connecting.cancel()
            await asyncio.wait({connecting})
        ws: DiscordWebSocket | None = self.ws
        if ws is not None and ws.open:
            with contextlib.suppress(*TRANSIENT):
                await ws.close(code=RESUMABLE_CLOSE)
        self._connected(False)

    async def before_identify_hook(self, shard_id: int | None, *, initial: bool = False) -> None:
        await self._gate.wait()

    # --- events ---------------------------------------------------------------------------

    async def on_ready(self) -> None:
        self._connected(True)

    async def on_resumed(self) -> None:
        self._connected(True)

    async def on_disconnect(self) -> None:
        self._connected(False)

    async def on_message(self, message: discord.Message) -> None:
        looked = False
        try:
            looked = self.ours() and await self._events.message(self, message)
        except Exception:
            looked = True  # a bug, logged by discord.py: the next holder would only fail the same way
            raise
        finally:
            where = self._in_hand.pop(message.id, None)
            if not looked and where is not None and (self._unread is None or where[1] < self._unread[1]):
                self._unread = where
            if not self._in_hand:
                self._idle.set()
            self._settle()

    async def on_interaction(self, interaction: Interaction) -> None:
        if interaction.type is discord.InteractionType.component and self.ours():
            await self._events.component(interaction)

    def _command(self, name: str) -> Callable[[Interaction], Coroutine[Any, Any, None]]:
        async def callback(interaction: Interaction) -> None:
            if self.ours():
                await self._events.command(interaction, name)
        return callback


async def log_in(client: BotClient, token: str) -> bool:
    """True once logged in; False after a failure that may pass (logged; the client is closed,
    try again on a fresh one); raises Fatal for a rejected token."""
    try:
        await client.login(token)
        return True
    except discord.LoginFailure:
        raise Fatal("the bot token was rejected (401 Unauthorized); check discord.token") from None
    except (discord.HTTPException, *TRANSIENT) as exc:
        log.warning("discord: login failed (%s); will retry", describe(exc))
        await client.close()
        return False
