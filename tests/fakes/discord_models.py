"""Data model and payload builders shared by the fake Discord REST API and gateway."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]

DISCORD_EPOCH_MS = 1420070400000
BOT_ID = 1100000000000000001
APPLICATION_ID = BOT_ID  # modern bots share the id of their application
GUILD_ID = 1200000000000000001
TEXT_CHANNEL_ID = 1200000000000000010
THREAD_ID = 1200000000000000020
ALICE_ID = 1300000000000000001
BOB_ID = 1300000000000000002
DEFAULT_TOKEN = "fake-bot-token"

# Channel types and intents (subset of the Discord API).
GUILD_TEXT, DM, PUBLIC_THREAD, PRIVATE_THREAD = 0, 1, 11, 12
THREAD_TYPES = (10, PUBLIC_THREAD, PRIVATE_THREAD)
INTENT_PRESENCES, INTENT_GUILD_MESSAGES, INTENT_DIRECT_MESSAGES = 1 << 8, 1 << 9, 1 << 12
INTENT_MESSAGE_CONTENT = 1 << 15
# VIEW_CHANNEL, SEND_MESSAGES, EMBED_LINKS, ATTACH_FILES, READ_HISTORY, ADD_REACTIONS,
# USE_APP_COMMANDS, SEND_MESSAGES_IN_THREADS, CREATE_PUBLIC_THREADS.
EVERYONE_PERMISSIONS = sum(1 << b for b in (10, 11, 14, 15, 16, 6, 31, 38, 35))


@dataclass
class FakeUser:
    """A Discord user known to the fake."""

    id: int
    username: str
    bot: bool = False
    global_name: str | None = None


@dataclass
class FakeChannel:
    """A guild text channel, thread (``type`` 11/12 with ``parent_id``) or DM channel."""

    id: int
    name: str
    type: int = GUILD_TEXT
    parent_id: int | None = None
    guild_id: int | None = None
    recipient_ids: list[int] = field(default_factory=list)


@dataclass
class FakeGuild:
    """A guild with its channels (threads included) and member user ids."""

    id: int
    name: str
    channels: list[FakeChannel]
    member_ids: list[int]
    owner_id: int | None = None


@dataclass(frozen=True)
class RestCall:
    """One REST request received by the fake (``path`` is relative to the API base)."""

    method: str
    path: str
    status: int
    channel_id: int | None
    json: Any
    files: tuple[tuple[str, bytes], ...]
    query: dict[str, str]
    time: float


@dataclass
class FakeInteraction:
    """An interaction dispatched to the bot (type 2 slash command, 3 component) and its answer:
    ``response_type``/``response_flags`` (64 = ephemeral) and ``responded_at`` once acknowledged;
    ``original_id`` is the message ``@original`` names."""

    id: int
    token: str
    name: str  # command name, or the component's custom_id
    channel_id: int
    guild_id: int | None
    user_id: int
    responded: bool = False
    original_id: int | None = None
    type: int = 2
    message_id: int | None = None  # the message a component interaction came from
    created_at: float = 0.0  # fake.clock() when dispatched
    response_type: int | None = None
    response_flags: int = 0
    responded_at: float | None = None

    @property
    def response_latency(self) -> float | None:
        """Seconds from dispatch to the accepted initial response (Discord allows 3)."""
        return None if self.responded_at is None else self.responded_at - self.created_at


def default_users() -> list[FakeUser]:
    """Two human users: alice and bob."""
    return [FakeUser(ALICE_ID, "alice"), FakeUser(BOB_ID, "bob")]


def default_guilds() -> list[FakeGuild]:
    """One guild with ``#general`` and a public thread under it."""
    channels = [
        FakeChannel(TEXT_CHANNEL_ID, "general"),
        FakeChannel(THREAD_ID, "help-thread", type=PUBLIC_THREAD, parent_id=TEXT_CHANNEL_ID),
    ]
    return [FakeGuild(GUILD_ID, "Switchboard Test", channels, [ALICE_ID, BOB_ID], owner_id=ALICE_ID)]


class Snowflakes:
    """Monotonic generator of realistic snowflake ids."""

    def __init__(self) -> None:
        self._last = 0

    def next(self) -> int:
        """Return a fresh snowflake encoding the current time."""
        value = ((int(time.time() * 1000) - DISCORD_EPOCH_MS) << 22) | (1 << 17)
        self._last = max(value, self._last + 1)
        return self._last


def iso_time(snowflake: int | None = None) -> str:
    """ISO-8601 timestamp of a snowflake (or of now)."""
    if snowflake is None:
        return dt.datetime.now(dt.UTC).isoformat()
    ms = (snowflake >> 22) + DISCORD_EPOCH_MS
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat()


def error_body(code: int, message: str, errors: Json | None = None) -> Json:
    """Discord's JSON error body."""
    body: Json = {"message": message, "code": code}
    if errors is not None:
        body["errors"] = errors
    return body


def form_error(field_name: str, code: str, message: str) -> Json:
    """The 50035 'Invalid Form Body' error for one field (dotted names nest: ``components.0.type``)."""
    errors: Json = {"_errors": [{"code": code, "message": message}]}
    for part in reversed(field_name.split(".")):
        errors = {part: errors}
    return error_body(50035, "Invalid Form Body", errors)


def walk_components(components: list[Json]) -> list[Json]:
    """Every component of a message, nested ones (action row children) included."""
    found: list[Json] = []
    for comp in components:
        found.append(comp)
        found.extend(walk_components(list(comp.get("components") or [])))
        if isinstance(comp.get("accessory"), dict):
            found.append(comp["accessory"])
    return found


def component_error(components: Any) -> Json | None:
    """Discord's 50035 error for a legacy (action row) ``components`` list, or None if valid:
    at most 5 rows of 1-5 components, custom_id 1-100 chars and unique, link buttons
    (style 5) with a url instead. Error codes as Discord names them; field paths as it nests them."""
    if not isinstance(components, list):
        return form_error("components", "MODEL_TYPE_CONVERT", "Only iterables may be used in a ListType")
    if len(components) > 5:
        return form_error("components", "BASE_TYPE_BAD_LENGTH", "Must be between 0 and 5 in length.")
    seen: set[str] = set()
    for r, row in enumerate(components):
        children = row.get("components") if isinstance(row, dict) else None
        if not isinstance(row, dict) or row.get("type") != 1 or not isinstance(children, list):
            return form_error(f"components.{r}.type", "UNION_TYPE_CHOICES", "Value of field \"type\" must be 1.")
        if not 1 <= len(children) <= 5:
            message = "Must be between 1 and 5 in length."
            return form_error(f"components.{r}.components", "BASE_TYPE_BAD_LENGTH", message)
        for c, comp in enumerate(children):
            where = f"components.{r}.components.{c}"
            custom_id = comp.get("custom_id")
            if comp.get("type") == 2 and comp.get("style") == 5:
                if not comp.get("url"):
                    return form_error(f"{where}.url", "BASE_TYPE_REQUIRED", "This field is required")
                continue
            if custom_id is None:
                return form_error(f"{where}.custom_id", "BASE_TYPE_REQUIRED", "This field is required")
            if not 1 <= len(str(custom_id)) <= 100:
                return form_error(f"{where}.custom_id", "BASE_TYPE_BAD_LENGTH", "Must be between 1 and 100 in length.")
            if custom_id in seen:
                return form_error(f"{where}.custom_id", "COMPONENT_CUSTOM_ID_DUPLICATED",
                                  "Component custom id cannot be duplicated")  # fmt: skip
            seen.add(custom_id)
    return None


def user_payload(user: FakeUser) -> Json:
    """Public user object."""
    data: Json = {
        "id": str(user.id),
        "username": user.username,
        "discriminator": "0",
        "global_name": user.global_name,
        "avatar": None,
        "public_flags": 0,
    }
    if user.bot:
        data["bot"] = True
    return data


def member_payload(user: FakeUser | None, joined: str) -> Json:
    """Guild member object; ``user`` omitted as in message ``member`` fields."""
    data: Json = {
        "roles": [],
        "joined_at": joined,
        "deaf": False,
        "mute": False,
        "flags": 0,
        "nick": None,
        "avatar": None,
        "pending": False,
        "premium_since": None,
        "communication_disabled_until": None,
    }
    if user is not None:
        data["user"] = user_payload(user)
    return data


def channel_payload(channel: FakeChannel, position: int, users: dict[int, FakeUser], owner_id: int) -> Json:
    """Channel object for text channels, threads and DMs."""
    data: Json = {"id": str(channel.id), "type": channel.type, "last_message_id": None, "flags": 0}
    if channel.type == DM:
        data["recipients"] = [user_payload(users[u]) for u in channel.recipient_ids if u in users]
        return data
    data.update(guild_id=str(channel.guild_id), name=channel.name, rate_limit_per_user=0)
    data["parent_id"] = None if channel.parent_id is None else str(channel.parent_id)
    if channel.type in THREAD_TYPES:
        created = iso_time(channel.id)
        data.update(owner_id=str(owner_id), message_count=0, member_count=1, total_message_sent=0)
        data["thread_metadata"] = {
            "archived": False,
            "auto_archive_duration": 1440,
            "archive_timestamp": created,
            "locked": False,
            "create_timestamp": created,
        }
    else:
        data.update(position=position, permission_overwrites=[], nsfw=False, topic=None)
        data["default_auto_archive_duration"] = 1440
    return data


def guild_payload(guild: FakeGuild, users: dict[int, FakeUser], bot_id: int, all_members: bool) -> Json:
    """GUILD_CREATE payload (channels, threads, @everyone role); like Discord, ``members`` holds
    only the bot unless ``all_members`` (the GUILD_PRESENCES intent)."""
    owner = guild.owner_id or bot_id
    joined = iso_time(guild.id)
    plain = [c for c in guild.channels if c.type not in THREAD_TYPES]
    threads = [c for c in guild.channels if c.type in THREAD_TYPES]
    member_ids = [bot_id, *[m for m in guild.member_ids if m != bot_id and m in users]]
    everyone = {
        "id": str(guild.id), "name": "@everyone", "permissions": str(EVERYONE_PERMISSIONS), "position": 0,
        "color": 0, "hoist": False, "managed": False, "mentionable": False, "flags": 0, "icon": None,
    }  # fmt: skip
    return {
        "id": str(guild.id), "name": guild.name, "icon": None, "splash": None, "banner": None,
        "owner_id": str(owner), "unavailable": False, "large": False, "joined_at": joined,
        "member_count": len(member_ids), "features": [], "roles": [everyone], "emojis": [], "stickers": [],
        "channels": [channel_payload(c, i, users, owner) for i, c in enumerate(plain)],
        "threads": [channel_payload(c, 0, users, owner) for c in threads],
        "members": [member_payload(users[m], joined) for m in member_ids[: None if all_members else 1]],
        "presences": [], "voice_states": [], "stage_instances": [], "guild_scheduled_events": [],
        "soundboard_sounds": [], "verification_level": 0, "default_message_notifications": 0,
        "explicit_content_filter": 0, "mfa_level": 0, "nsfw_level": 0, "premium_tier": 0,
        "premium_subscription_count": 0, "system_channel_flags": 0, "afk_timeout": 300,
        "preferred_locale": "en-US", "system_channel_id": str(plain[0].id) if plain else None,
        "application_id": None, "description": None, "vanity_url_code": None,
    }  # fmt: skip


def ready_payload(bot: FakeUser, app_id: int, guild_ids: list[int], session_id: str, resume_url: str) -> Json:
    """READY dispatch payload with every guild unavailable (GUILD_CREATE follows)."""
    user = {**user_payload(bot), "verified": True, "mfa_enabled": False, "flags": 0, "email": None}
    return {
        "v": 10,
        "user": user,
        "guilds": [{"id": str(g), "unavailable": True} for g in guild_ids],
        "session_id": session_id,
        "session_type": "normal",
        "resume_gateway_url": resume_url,
        "application": {"id": str(app_id), "flags": 0},
        "private_channels": [],
        "relationships": [],
        "presences": [],
        "guild_join_requests": [],
        "geo_ordered_rtc_regions": [],
        "_trace": ["fake-discord"],
    }


def application_payload(app_id: int, bot: FakeUser, owner: FakeUser) -> Json:
    """``/oauth2/applications/@me`` payload."""
    return {
        "id": str(app_id),
        "name": bot.username,
        "icon": None,
        "description": "",
        "bot_public": True,
        "bot_require_code_grant": False,
        "owner": user_payload(owner),
        "verify_key": "00" * 32,
        "flags": 0,
        "bot": user_payload(bot),
    }


class Waiters:
    """Futures woken whenever something new is recorded (used by ``wait_for``)."""

    def __init__(self) -> None:
        self._futures: list[asyncio.Future[None]] = []

    def new(self) -> asyncio.Future[None]:
        """A future completed on the next ``wake``."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures.append(fut)
        return fut

    def wake(self) -> None:
        """Wake all pending waiters."""
        futures, self._futures = self._futures, []
        for fut in futures:
            if not fut.done():
                fut.set_result(None)
