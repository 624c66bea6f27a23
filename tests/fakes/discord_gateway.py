"""Gateway (websocket) half of the fake Discord, sharded as Discord shards: a connection
IDENTIFYs as shard ``[i, N]`` (none: ``[0, 1]``), and a guild's events go to every session whose
shard is ``(guild_id >> 22) % N`` (`shard_of`), DMs to shard 0. Sessions of one shard do not
exclude each other (Discord lets a bot token connect the same shard twice, and then both get
the events): `shard_links` records which connection served which shard when, to tell."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib
import itertools
import json
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from tests.fakes.discord_models import (
    INTENT_DIRECT_MESSAGES,
    INTENT_GUILD_MESSAGES,
    INTENT_MESSAGE_CONTENT,
    INTENT_PRESENCES,
    FakeChannel,
    FakeInteraction,
    FakeUser,
    Json,
    guild_payload,
    iso_time,
    member_payload,
    ready_payload,
    user_payload,
    walk_components,
)
from tests.fakes.discord_state import FakeState

_MESSAGE_EVENTS = ("MESSAGE_CREATE", "MESSAGE_UPDATE", "MESSAGE_DELETE")
_OPTION_TYPES: dict[type, int] = {str: 3, int: 4, bool: 5, float: 10}


def shard_of(guild_id: int | None, shard_count: int) -> int:
    """Discord's rule: a guild's events go to shard ``(guild_id >> 22) % shard_count``; DMs to shard 0."""
    return 0 if guild_id is None else (guild_id >> 22) % shard_count


@dataclass
class ShardLink:
    """One websocket's time as the live connection of a session of shard ``shard`` of ``count``:
    from its READY (``how`` = "identify") or RESUMED ("resume") until it closed, was dropped, or
    another connection resumed the session. Times are ``time.monotonic()``."""

    shard: int
    count: int
    session: str
    how: str
    attached: float
    detached: float | None = None


@dataclass(eq=False)
class _Session:
    id: str
    intents: int
    shard: int = 0
    count: int = 1
    sharded: bool = False  # the IDENTIFY named a shard (READY then names it too)
    seq: int = 0
    events: list[Json] = field(default_factory=list)
    conn: _Conn | None = None  # the connection events go to; None: buffered for RESUME
    link: ShardLink | None = None


def _stream_compressor(kind: str | None) -> Callable[[bytes], bytes] | None:
    """One connection's transport compression, as discord.py asks for it: `zlib-stream`, or
    `zstd-stream` (what it asks for when `zstandard` or Python 3.14's `compression.zstd` is
    importable): one stream for the connection, flushed after each message."""
    if kind == "zlib-stream":
        zobj = zlib.compressobj()
        return lambda data: zobj.compress(data) + zobj.flush(zlib.Z_SYNC_FLUSH)
    if kind != "zstd-stream":
        return None
    try:
        zstandard: Any = importlib.import_module("zstandard")
        cobj = zstandard.ZstdCompressor().compressobj()
        return lambda data: cobj.compress(data) + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    except ModuleNotFoundError:
        stdlib: Any = importlib.import_module("compression.zstd")
        compressor = stdlib.ZstdCompressor()
        return lambda data: compressor.compress(data, mode=stdlib.ZstdCompressor.FLUSH_BLOCK)


class _Conn:
    """One websocket connection; frames are compressed (zlib-stream or zstd-stream) when requested."""

    def __init__(self, ws: web.WebSocketResponse, compress: str | None) -> None:
        self.ws = ws
        self.session: _Session | None = None
        self._compress = _stream_compressor(compress)
        self._lock = asyncio.Lock()

    async def send(self, payload: Json) -> None:
        text = json.dumps(payload, separators=(",", ":"))
        async with self._lock:
            if self.ws.closed:
                return
            try:
                if self._compress is None:
                    await self.ws.send_str(text)
                else:
                    await self.ws.send_bytes(self._compress(text.encode()))
            except (ConnectionError, RuntimeError):
                pass  # connection is going away; the event stays buffered for RESUME


class GatewayMixin(FakeState):
    """Serves the gateway websocket and exposes test controls for it."""

    heartbeat_interval_ms = 41250

    def _init_gateway(self) -> None:
        self.connections = 0
        self.identify_count = 0
        self.resume_count = 0
        self.gateway_received: list[Json] = []
        self.gateway_queries: list[dict[str, str]] = []
        self.shard_links: list[ShardLink] = []  # every connection's time serving a shard, in order
        self._sessions: dict[str, _Session] = {}  # the valid ones (resumable, or live)
        self._conns: set[_Conn] = set()
        self._changed = asyncio.Event()  # set (and replaced) whenever a session gains or loses its connection

    # ----- test controls ----------------------------------------------------
    async def dispatch_message(
        self,
        channel_id: int,
        content: str,
        *,
        author_id: int | None = None,
        author_name: str | None = None,
        guild_id: int | None = None,
        mentions_bot: bool = False,
        reference_message_id: int | None = None,
        bot_author: bool = False,
        attachments: list[Json] | None = None,
    ) -> int:
        """Deliver a MESSAGE_CREATE from a user; returns the new message id.

        ``attachments`` items: ``{"filename", "content": bytes, "content_type"?}``; the
        files are then downloadable from the fake. ``guild_id`` defaults to the channel's.
        """
        channel = self.channels.get(channel_id)
        if channel is None:
            raise ValueError(f"unknown channel {channel_id}; use dm_channel_id() for DMs")
        self._require_session(channel.guild_id)
        if guild_id is not None and guild_id != channel.guild_id:
            raise ValueError(f"channel {channel_id} is not in guild {guild_id}")
        author = self._user(author_id, author_name, bot=bot_author)
        if bot_author and not author.bot:
            author = dataclasses.replace(author, bot=True)
        mentions = [self.bot] if mentions_bot else []
        if mentions_bot and f"<@{self.bot.id}>" not in content:
            content = f"<@{self.bot.id}> {content}"
        body: Json = {"content": content}
        if reference_message_id is not None:
            body["message_reference"] = {"message_id": str(reference_message_id)}
        files = [
            self._attachment(channel_id, a["filename"], a.get("content", b""), a.get("content_type"))
            for a in attachments or []
        ]
        msg = self._new_message(channel, author, body, mentions=mentions, attachments=files)
        await self._dispatch("MESSAGE_CREATE", self._event_message(msg))
        return int(msg["id"])

    async def dispatch_interaction(
        self,
        name: str,
        *,
        channel_id: int,
        user_id: int | None = None,
        user_name: str | None = None,
        options: Mapping[str, str | int | bool | float] | None = None,
        command_id: int | None = None,
    ) -> FakeInteraction:
        """Deliver an INTERACTION_CREATE for the slash command ``name`` (type 2)."""
        channel = self.channels[channel_id]
        self._require_session(channel.guild_id)
        user = self._user(user_id, user_name)
        gid = channel.guild_id
        if command_id is None:
            known = [c for c in self._all_commands(gid) if c["name"] == name]
            command_id = int(known[0]["id"]) if known else self.ids.next()
        opts = [{"name": k, "type": _OPTION_TYPES[type(v)], "value": v} for k, v in (options or {}).items()]
        data: Json = {"id": str(command_id), "name": name, "type": 1, "options": opts}
        if gid is not None:
            data["guild_id"] = str(gid)
        return await self._send_interaction(2, name, channel, user, data)

    async def push_component_interaction(
        self,
        channel_id: int,
        message_id: int,
        custom_id: str,
        *,
        user_id: int | None = None,
        user_name: str | None = None,
        values: list[str] | None = None,
        check_component: bool = True,
    ) -> FakeInteraction:
        """A user clicks the component ``custom_id`` (a button, or a select with ``values``) of
        a message in a guild channel or DM: INTERACTION_CREATE type 3 (MESSAGE_COMPONENT).
        Raises ValueError unless the message shows that enabled component; with
        ``check_component=False`` a button no longer shown may be clicked (a client that has not
        caught up with an edit)."""
        channel = self.channels[channel_id]
        self._require_session(channel.guild_id)
        msg = self._messages.get(message_id)
        if msg is None or msg["channel_id"] != str(channel_id):
            raise ValueError(f"no message {message_id} in channel {channel_id}")
        found = [c for c in walk_components(msg["components"]) if c.get("custom_id") == custom_id]
        if not check_component and not found:
            found = [{"type": 2, "custom_id": custom_id}]
        if not found or found[0].get("disabled"):
            raise ValueError(f"message {message_id} shows no enabled component {custom_id!r}")
        data: Json = {"custom_id": custom_id, "component_type": found[0]["type"]}
        if "id" in found[0]:
            data["id"] = found[0]["id"]
        if values is not None:
            data["values"] = values
        user = self._user(user_id, user_name)
        return await self._send_interaction(3, custom_id, channel, user, data, msg)

    async def _send_interaction(
        self, itype: int, name: str, channel: FakeChannel, user: FakeUser, data: Json, msg: Json | None = None
    ) -> FakeInteraction:
        """Register and dispatch an INTERACTION_CREATE with what discord.py reads from it."""
        gid = channel.guild_id
        inter = FakeInteraction(self.ids.next(), uuid.uuid4().hex, name, channel.id, gid, user.id, type=itype)
        inter.message_id, inter.created_at = (int(msg["id"]) if msg else None), self.clock()
        self._interactions[inter.token] = inter
        payload: Json = {
            "id": str(inter.id), "application_id": str(self.application_id), "type": itype, "data": data,
            "token": inter.token, "version": 1, "channel_id": str(channel.id), "locale": "en-US",
            "app_permissions": "0", "entitlements": [], "attachment_size_limit": 8 * 1024 * 1024,
            "channel": {k: v for k, v in self._channel_json(channel).items() if k != "recipients"},
        }  # fmt: skip
        if msg is not None:
            payload["message"] = copy.deepcopy(msg)
        if gid is not None:
            member = member_payload(user, iso_time(gid))
            payload.update(guild_id=str(gid), guild_locale="en-US", context=0, member=member)
            payload["guild"] = {"id": str(gid), "locale": "en-US", "features": []}
            payload["app_permissions"] = "2147483647"
            payload["member"]["permissions"] = str(self.member_permissions.get(user.id, 2147483647))
            payload["authorizing_integration_owners"] = {"0": str(gid)}
        else:
            payload.update(user=user_payload(user), context=1, authorizing_integration_owners={"1": str(user.id)})
        await self._dispatch("INTERACTION_CREATE", payload)
        return inter

    async def drop_gateway(self, code: int = 4000, *, resumable: bool = True, shard: int | None = None) -> None:
        """Close the live websockets (of ``shard``'s sessions only, if given) with ``code``; with
        ``resumable=False`` their sessions are invalidated, so the client's RESUME gets op 9 and
        it re-identifies."""
        for session in self._of_shard(shard):
            conn = session.conn
            self._detach(session)
            if not resumable:
                self._sessions.pop(session.id, None)
            if conn is not None:
                await conn.ws.close(code=code, message=b"dropped by fake")

    async def send_reconnect(self, *, shard: int | None = None) -> None:
        """Send op 7 RECONNECT (to ``shard``'s sessions only, if given); the client closes and resumes."""
        for session in self._of_shard(shard):
            conn = session.conn
            self._detach(session)
            if conn is not None:
                await conn.send({"op": 7, "d": None, "s": None, "t": None})

    async def wait_connected(self, timeout: float = 5.0, *, shard: int | None = None) -> None:
        """Wait until there is a session (of ``shard``, if given) and each such session is live
        (READY and its GUILD_CREATEs, or RESUMED, were sent)."""
        async with asyncio.timeout(timeout):
            while not ((sessions := self._of_shard(shard)) and all(s.conn is not None for s in sessions)):
                await self._changed.wait()

    def live_shards(self) -> dict[int, int]:
        """Shard id -> how many connections serve a session of it now (Discord would send its
        events to each)."""
        live: dict[int, int] = {}
        for session in self._sessions.values():
            if session.conn is not None:
                live[session.shard] = live.get(session.shard, 0) + 1
        return live

    def shard_overlaps(self) -> list[tuple[ShardLink, ShardLink]]:
        """Pairs of connections that served the same shard at the same time (none, if every
        shard had one connection at a time)."""
        now = time.monotonic()
        found = []
        for a, b in itertools.combinations(self.shard_links, 2):
            if a.shard == b.shard and a.attached < (b.detached or now) and b.attached < (a.detached or now):
                found.append((a, b))
        return found

    def _of_shard(self, shard: int | None) -> list[_Session]:
        return [s for s in self._sessions.values() if shard is None or s.shard == shard]

    def _require_session(self, guild_id: int | None) -> None:
        if not self._targets(guild_id):
            where = "DMs" if guild_id is None else f"guild {guild_id}"
            raise RuntimeError(
                f"no gateway session for the shard of {where}: the client has not identified (or was invalidated)"
            )

    def _targets(self, guild_id: int | None) -> list[_Session]:
        """The sessions a guild's (or, for None, a DM's) events go to."""
        return [s for s in self._sessions.values() if shard_of(guild_id, s.count) == s.shard]

    # ----- sessions and their connections ------------------------------------
    def _attach(self, session: _Session, conn: _Conn, how: str) -> None:
        """``conn`` serves ``session`` from now on (a connection that served it before no longer does)."""
        self._detach(session)
        session.conn, conn.session = conn, session
        session.link = ShardLink(session.shard, session.count, session.id, how, time.monotonic())
        self.shard_links.append(session.link)
        self._notify()

    def _detach(self, session: _Session) -> None:
        if session.link is not None:
            session.link.detached = time.monotonic()
        session.conn, session.link = None, None
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ----- websocket server -------------------------------------------------
    async def _ws_handler(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        self.connections += 1
        self.gateway_queries.append(dict(request.query))
        conn = _Conn(ws, request.query.get("compress"))
        self._conns.add(conn)
        try:
            await conn.send({"op": 10, "d": {"heartbeat_interval": self.heartbeat_interval_ms}, "s": None, "t": None})
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await self._on_client_op(conn, json.loads(msg.data))
        finally:
            self._conns.discard(conn)
            session = conn.session
            if session is not None and session.conn is conn:
                self._detach(session)
                if ws.close_code in (1000, 1001):  # like Discord: a clean close ends the session
                    self._sessions.pop(session.id, None)
        return ws

    async def _on_client_op(self, conn: _Conn, payload: Json) -> None:
        self.gateway_received.append(payload)
        op, data = payload.get("op"), payload.get("d")
        if op == 1:
            await conn.send({"op": 11, "d": None, "s": None, "t": None})
        elif op == 2:
            await self._identify(conn, data or {})
        elif op == 6:
            await self._resume(conn, data or {})
        elif op == 8:
            await self._members_chunk(conn, data or {})

    async def _identify(self, conn: _Conn, data: Json) -> None:
        if data.get("token") != self.token:
            await conn.ws.close(code=4004, message=b"Authentication failed.")
            return
        if conn.session is not None:
            await conn.ws.close(code=4005, message=b"Already authenticated.")
            return
        shard, count = data.get("shard") or (0, 1)
        if not 0 <= shard < count:
            await conn.ws.close(code=4010, message=b"Invalid shard.")
            return
        self.identify_count += 1
        session = _Session(uuid.uuid4().hex, int(data.get("intents", 0)), shard, count, "shard" in data)
        self._sessions[session.id] = session
        self._attach(session, conn, "identify")
        guilds = [g for g in self.guilds.values() if shard_of(g.id, count) == shard]
        ready = ready_payload(
            self.bot, self.application_id, [g.id for g in guilds], session.id, self.resume_gateway_url
        )
        if session.sharded:
            ready["shard"] = [shard, count]
        await self._send(session, "READY", ready)
        for guild in guilds:
            payload = guild_payload(guild, self.users, self.bot.id, bool(session.intents & INTENT_PRESENCES))
            await self._send(session, "GUILD_CREATE", payload)

    async def _resume(self, conn: _Conn, data: Json) -> None:
        session = self._sessions.get(str(data.get("session_id")))
        if session is None or data.get("token") != self.token:
            await conn.send({"op": 9, "d": False, "s": None, "t": None})
            return
        self.resume_count += 1
        seq = int(data.get("seq") or 0)
        self._detach(session)  # whoever served it before gets nothing more; new events wait for the replay
        while missed := [e for e in session.events if e["s"] > seq]:  # replay, catching up with new events
            for event in missed:
                await conn.send(event)
                seq = event["s"]
        self._attach(session, conn, "resume")
        await self._send(session, "RESUMED", {"_trace": ["fake-discord"]})

    async def _members_chunk(self, conn: _Conn, data: Json) -> None:
        guild = self.guilds.get(int(data.get("guild_id", 0)))
        if guild is None or conn.session is None:
            return
        wanted = {int(u) for u in data.get("user_ids") or []}
        ids = [self.bot.id, *guild.member_ids]
        ids = [i for i in dict.fromkeys(ids) if i in self.users and (not wanted or i in wanted)]
        members = [member_payload(self.users[i], iso_time(guild.id)) for i in ids]
        chunk: Json = {"guild_id": str(guild.id), "members": members, "chunk_index": 0, "chunk_count": 1}
        chunk.update(not_found=[], nonce=data.get("nonce"))
        await self._send(conn.session, "GUILD_MEMBERS_CHUNK", chunk)

    async def _dispatch(self, event: str, data: Json) -> bool:
        """Send an event to the sessions of its shard (buffered for RESUME while disconnected);
        False if none wanted it."""
        guild = data.get("guild_id")
        targets = self._targets(int(guild) if guild is not None else None)
        sent = False
        for session in targets:
            copied = copy.deepcopy(data) if len(targets) > 1 else data  # intents may blank a copy
            if self._wanted(session.intents, event, copied):
                await self._send(session, event, copied)
                sent = True
        return sent

    async def _send(self, session: _Session, event: str, data: Json) -> None:
        """Sequence an event in ``session`` and send it to its connection, if it has one."""
        session.seq += 1
        payload: Json = {"op": 0, "t": event, "s": session.seq, "d": data}
        session.events.append(payload)
        del session.events[:-1000]
        if session.conn is not None:
            await session.conn.send(payload)

    def _wanted(self, intents: int, event: str, data: Json) -> bool:
        """Apply intents: drop message events without the intent, blank content without
        MESSAGE_CONTENT (except DMs, mentions and the bot's own messages)."""
        if event not in _MESSAGE_EVENTS:
            return True
        is_dm = "guild_id" not in data
        if not intents & (INTENT_DIRECT_MESSAGES if is_dm else INTENT_GUILD_MESSAGES):
            return False
        own = data.get("author", {}).get("id") == str(self.bot.id)
        exempt = is_dm or own or event == "MESSAGE_DELETE" or self._is_mentioned(data)
        if not exempt and not intents & INTENT_MESSAGE_CONTENT:
            data.update(content="", embeds=[], attachments=[], components=[])
        return True

    async def _close_gateway(self) -> None:
        """Close every websocket (used on shutdown)."""
        for session in list(self._sessions.values()):
            self._detach(session)
        for conn in list(self._conns):
            await conn.ws.close(code=1001, message=b"server shutdown")
