"""Shared state of the fake Discord: users, guilds, channels, messages, interactions."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.fakes.discord_models import (
    BOT_ID,
    DEFAULT_TOKEN,
    DM,
    FakeChannel,
    FakeGuild,
    FakeInteraction,
    FakeUser,
    Json,
    Snowflakes,
    channel_payload,
    default_guilds,
    default_users,
    iso_time,
    member_payload,
    user_payload,
)
from tests.fakes.file_serving import FileServing

_MENTION_RE = re.compile(r"<@!?(\d+)>")


class FakeState:
    """Configuration and stored objects; subclasses add the REST and gateway servers."""

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
    ) -> None:
        self.token = token
        self.bot = FakeUser(bot_id, bot_name, bot=True)
        self.application_id = application_id or bot_id
        self.echo_own_messages = echo_own_messages
        self.users: dict[int, FakeUser] = {self.bot.id: self.bot}
        self.users.update({u.id: u for u in (default_users() if users is None else users)})
        self.guilds: dict[int, FakeGuild] = {}
        self.channels: dict[int, FakeChannel] = {}
        for guild in default_guilds() if guilds is None else guilds:
            self.guilds[guild.id] = guild
            for channel in guild.channels:
                channel.guild_id = guild.id
                self.channels[channel.id] = channel
        self.ids = Snowflakes()
        self._messages: dict[int, Json] = {}
        self._files: dict[int, bytes] = {}
        self.file_serving = FileServing()  # how fast attachments download, and every download so far
        self._interactions: dict[str, FakeInteraction] = {}
        # A member's permissions as interactions carry them (user id -> bit set); default: all of them.
        self.member_permissions: dict[int, int] = {}
        self._commands: dict[int | None, list[Json]] = {}
        self._latency: dict[int, float] = {}
        self._base_url = ""
        self.clock: Callable[[], float] = time.monotonic  # request and interaction times
        self.interaction_deadline_s: float | None = 3.0  # initial response later: 10062
        self.interaction_token_ttl_s = 900.0  # webhooks (followups, @original) after: 50027

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``: the REST API is under ``/api/v10``, the gateway at ``/gateway-ws``."""
        return self._base_url

    @property
    def rest_base(self) -> str:
        """REST base to assign to ``discord.http.Route.BASE``."""
        return f"{self._base_url}/api/v10"

    @property
    def gateway_url(self) -> str:
        """Websocket URL to assign to ``DiscordWebSocket.DEFAULT_GATEWAY``."""
        return self._base_url.replace("http://", "ws://", 1) + "/gateway-ws"

    @property
    def resume_gateway_url(self) -> str:
        """The ``resume_gateway_url`` sent in READY (a distinct path of the same server)."""
        return self._base_url.replace("http://", "ws://", 1) + "/gateway-resume"

    async def _dispatch(self, event: str, data: Json) -> bool:
        """Send a DISPATCH to the gateway session (implemented by the gateway mixin)."""
        raise NotImplementedError

    # ----- public helpers -------------------------------------------------
    def dm_channel_id(self, user_id: int) -> int:
        """Id of the DM channel between the bot and ``user_id`` (created on first use)."""
        for channel in self.channels.values():
            if channel.type == DM and channel.recipient_ids == [user_id]:
                return channel.id
        channel = FakeChannel(self.ids.next(), "", type=DM, recipient_ids=[user_id])
        self.channels[channel.id] = channel
        return channel.id

    def messages(self, channel_id: int) -> list[Json]:
        """Current (edited, non-deleted) message objects of a channel, oldest first."""
        return [copy.deepcopy(m) for m in self._messages.values() if m["channel_id"] == str(channel_id)]

    def message(self, message_id: int) -> Json | None:
        """One stored message object, or None."""
        found = self._messages.get(message_id)
        return copy.deepcopy(found) if found is not None else None

    @property
    def interactions(self) -> list[FakeInteraction]:
        """Every interaction dispatched so far, oldest first."""
        return list(self._interactions.values())

    async def delete_message(self, message_id: int) -> bool:
        """Delete a message as a user/moderator would (MESSAGE_DELETE is dispatched; later
        edits get 404 10008 "Unknown Message")."""
        msg = self._messages.pop(message_id, None)
        if msg is None:
            return False
        event = self._event_message(msg)
        await self._dispatch("MESSAGE_DELETE", {k: event[k] for k in ("id", "channel_id", "guild_id") if k in event})
        return True

    def set_latency(self, channel_id: int, seconds: float) -> None:
        """Delay every REST request about ``channel_id`` (interaction webhooks included) by
        ``seconds`` before it is handled; 0 removes the delay."""
        self._latency[channel_id] = seconds

    # ----- internals --------------------------------------------------------
    def _user(self, user_id: int | None, name: str | None = None, *, bot: bool = False) -> FakeUser:
        """Known user, registering a new one when needed."""
        uid = user_id if user_id is not None else min(u for u in self.users if u != self.bot.id)
        if uid not in self.users:
            self.users[uid] = FakeUser(uid, name or f"user{uid}", bot=bot)
        return self.users[uid]

    def _channel_json(self, channel: FakeChannel) -> Json:
        """Channel object as returned by ``GET /channels/{id}``."""
        guild = self.guilds.get(channel.guild_id or 0)
        owner = (guild.owner_id if guild else None) or self.bot.id
        position = guild.channels.index(channel) if guild else 0
        return channel_payload(channel, position, self.users, owner)

    def _all_commands(self, guild_id: int | None) -> list[Json]:
        """Registered commands visible in a guild (global first)."""
        return self._commands.get(None, []) + (self._commands.get(guild_id, []) if guild_id else [])

    def _attachment(self, channel_id: int, filename: str, data: bytes, content_type: str | None) -> Json:
        """Attachment object whose url is served by the fake."""
        att_id = self.ids.next()
        self._files[att_id] = data
        url = f"{self._base_url}/attachments/{channel_id}/{att_id}/{filename}"
        att: Json = {"id": str(att_id), "filename": filename, "size": len(data), "url": url, "proxy_url": url}
        if content_type:
            att["content_type"] = content_type
        return att

    def _new_message(
        self,
        channel: FakeChannel,
        author: FakeUser,
        body: Json,
        *,
        mentions: list[FakeUser] | None = None,
        attachments: list[Json] | None = None,
        msg_type: int = 0,
        extra: Json | None = None,
    ) -> Json:
        """Build and store a REST-shaped message object (no guild_id/member)."""
        msg_id = self.ids.next()
        content = str(body.get("content") or "")
        if mentions is None:
            ids = [int(m) for m in _MENTION_RE.findall(content)]
            mentions = [self.users[i] for i in dict.fromkeys(ids) if i in self.users]
        msg: Json = {
            "id": str(msg_id), "channel_id": str(channel.id), "author": user_payload(author),
            "content": content, "timestamp": iso_time(msg_id), "edited_timestamp": None,
            "tts": bool(body.get("tts")),
            "mention_everyone": False, "mentions": [user_payload(u) for u in mentions], "mention_roles": [],
            "attachments": attachments or [], "embeds": list(body.get("embeds") or []), "pinned": False,
            "type": msg_type, "flags": int(body.get("flags") or 0),
            "components": list(body.get("components") or []),
        }  # fmt: skip
        if body.get("nonce") is not None:
            msg["nonce"] = body["nonce"]
        ref = body.get("message_reference")
        if ref and ref.get("message_id"):
            msg["type"] = 19 if msg_type == 0 else msg_type
            ref = {k: str(v) if k.endswith("_id") else v for k, v in ref.items()}
            msg["message_reference"] = {"type": 0, "channel_id": str(channel.id), **ref}
            if channel.guild_id is not None:
                msg["message_reference"].setdefault("guild_id", str(channel.guild_id))
            referenced = self._messages.get(int(ref["message_id"]))
            msg["referenced_message"] = {
                k: v for k, v in (referenced or {}).items() if k != "referenced_message"
            } or None
        msg.update(extra or {})
        self._messages[msg_id] = msg
        return msg

    def _event_message(self, msg: Json) -> Json:
        """Gateway-shaped copy of a message: adds guild_id and member fields in guilds."""
        event = copy.deepcopy(msg)
        channel = self.channels.get(int(msg["channel_id"]))
        if channel is not None and channel.guild_id is not None:
            joined = iso_time(channel.guild_id)
            event["guild_id"] = str(channel.guild_id)
            if not msg.get("webhook_id"):
                event["member"] = member_payload(None, joined)
            for mention in event["mentions"]:
                mention["member"] = member_payload(None, joined)
        return event

    def _is_mentioned(self, msg: Any) -> bool:
        """Whether the bot is mentioned in a message payload."""
        return any(m.get("id") == str(self.bot.id) for m in msg.get("mentions", []))
