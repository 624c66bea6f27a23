"""Discord events to router input: which messages address the bot, application commands (each
interaction answered exactly once), and Stop button presses."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import discord

from gateway.core import commands
from gateway.core.attachments import Attachment, mime_of
from gateway.core.bounded import BoundedMap
from gateway.core.messages import ChatRef, ChatType, InboundMessage
from gateway.core.ports import Outcome, Submitted
from platforms import stop_button
from platforms.config import DiscordConfig
from platforms.discord_client import TRANSIENT, Interaction, describe
from platforms.stop_button import PressOutcome, StopButtons, Submit

log = logging.getLogger("platforms.discord_bot")  # the Discord adapter logs under one name

PLATFORM = "discord"
MAX_LEN = 2000
RESTARTING = "The gateway is restarting; please try again in a moment."
WRONG_PLACE = "This command works in DMs, text channels and threads."
_USER_MESSAGES = (discord.MessageType.default, discord.MessageType.reply)
CHANNELS_MAX = 10_000  # guild channels looked up (not in discord.py's cache), by id


@dataclass(eq=False)
class _PendingInteraction:
    """An application command not answered yet; the lock orders defer against the answer."""

    interaction: Interaction
    ephemeral: bool
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    answered: bool = False


class DiscordIntake:
    """Hands what users do to the router (`submit`); its state lives here, not in discord.py's
    caches, which a re-IDENTIFY clears. `sent` holds the ids of the bot's latest messages (the
    outbound side adds them), to tell a reply to the bot."""

    def __init__(self, config: DiscordConfig, submit: Submit, buttons: StopButtons, sent: BoundedMap[int, None], *,
                 defer_after_s: Callable[[], float]) -> None:
        self._config = config
        self._submit = submit
        self._buttons = buttons
        self._sent = sent
        self._defer_after_s = defer_after_s  # read at each command (a setting of the adapter class)
        self._interactions: dict[str, _PendingInteraction] = {}
        self._channels: BoundedMap[int, ChatRef] = BoundedMap(CHANNELS_MAX, touch=True)
        self._closing = False

    def stop(self) -> None:
        """Take no more messages; application commands are answered that we are restarting."""
        self._closing = True

    async def answer(self, reply_to: str | None, text: str) -> bool:
        """A notice the router sends about an application command answers its interaction; True
        if `reply_to` was one."""
        pending = self._interactions.pop(reply_to, None) if reply_to else None
        if pending is None:
            return False
        await _answer(pending, text)
        return True

    # --- messages -------------------------------------------------------------------------

    async def message(self, client: discord.Client, message: discord.Message) -> bool:
        """Hand a message that addresses the bot to the router; False if it was not looked at
        (intake has stopped: in cluster mode the shard's next holder gets it again)."""
        if self._closing:
            return False
        if message.author.bot or message.type not in _USER_MESSAGES:
            return True  # bot messages (our own echoes included) never start turns
        try:
            chat = await self._chat(client, message.channel)
            if chat is None:
                return True
            text = message.content
            if chat.chat_type is not ChatType.DM:
                text = strip_mentions(message, client.user)
                if not self._addressed(client, message, chat, text):
                    return True
            await self._submit(_inbound(message, chat, text), None)
        except Exception:
            log.exception("discord: could not handle message %s", message.id)
        return True

    async def _chat(self, client: discord.Client, channel: object) -> ChatRef | None:
        """The chat of a message's channel. A guild channel discord.py has not cached is looked up
        once: a shard whose session was resumed from another worker never received its guilds,
        and a thread is a session of its own there too."""
        if not isinstance(channel, discord.PartialMessageable) or channel.guild_id is None:
            return chat_for(channel)
        known = self._channels.get(channel.id)
        if known is None:
            try:
                known = chat_for(await client.fetch_channel(channel.id)) or chat_for(channel)
            except (discord.HTTPException, *TRANSIENT) as exc:
                log.warning("discord: could not look channel %s up: %s", channel.id, describe(exc))
                return chat_for(channel)
            if known is not None:
                self._channels[channel.id] = known
        return known

    def _addressed(self, client: discord.Client, message: discord.Message, chat: ChatRef, text: str) -> bool:
        """In a guild: a mention, a reply to the bot, a known command, or any message in "all" mode."""
        me = client.user
        if me is None:
            return False
        return (mentions(message, me) or replies_to(message, me.id, self._sent)
                or _known_command(text, me.name) or open_channel(chat, self._config))

    # --- application commands -------------------------------------------------------------

    async def command(self, interaction: Interaction, name: str) -> None:
        """Run `/name` as the router's text command; the interaction is always answered."""
        spec = commands.lookup(name)
        pending = _PendingInteraction(interaction, ephemeral=spec is not None and spec.private)
        chat = chat_for(interaction.channel)
        if self._closing or chat is None:
            await _answer(pending, RESTARTING if self._closing else WRONG_PLACE)
            return
        msg = InboundMessage(platform=PLATFORM, chat_id=chat.chat_id, chat_type=chat.chat_type,
                             thread_id=chat.thread_id, user_id=str(interaction.user.id),
                             user_name=interaction.user.display_name, message_id=f"i{interaction.id}",
                             text=f"/{name}")
        self._interactions[msg.message_id] = pending  # the router's notice for it goes to `answer`
        try:
            text = _command_answer(await self._run(msg, pending))
        except Exception:
            log.exception("discord: /%s failed", name)
            text = "Something went wrong on our side; it has been logged."
        finally:
            self._interactions.pop(msg.message_id, None)
        await _answer(pending, text)

    async def _run(self, msg: InboundMessage, pending: _PendingInteraction) -> Submitted:
        """Submit; if the router is slow, defer the interaction (Discord drops one not
        acknowledged within 3 s) while it works."""
        submit = asyncio.ensure_future(self._submit(msg, None))
        done, _ = await asyncio.wait({submit}, timeout=self._defer_after_s())
        if not done:
            await _defer(pending)
        return await submit

    # --- Stop buttons ---------------------------------------------------------------------

    async def component(self, interaction: Interaction) -> None:
        """A button press: a Stop button's is `/stop` for its answer. The interaction is answered
        once the cancel is issued: silently (no spinner; the answer's message shows the stop), or
        with a note only the presser sees."""
        data: dict[str, Any] = dict(interaction.data or {})
        raw = data.get("custom_id")
        if not isinstance(raw, str) or not raw.startswith(stop_button.PREFIX):
            return  # not ours: discord.py's view store, if anyone, answers it
        perms = interaction.permissions

        async def is_admin() -> bool:  # Discord sends the presser's permissions with the press
            return perms.administrator or perms.manage_messages

        try:
            press = await self._buttons.press(
                self._submit, chat_for(interaction.channel), raw, user_id=str(interaction.user.id),
                user_name=interaction.user.display_name, press_id=f"dc{interaction.id}", is_admin=is_admin)
        except Exception:
            log.exception("discord: could not handle a Stop button press")
            press = stop_button.Press(PressOutcome.FAILED, "Something went wrong; please try /stop.")
        try:
            if press.outcome is PressOutcome.STOPPED:
                await interaction.response.defer()  # a deferred update: the message changes itself
            else:
                await interaction.response.send_message(press.text[:MAX_LEN], ephemeral=True)
        except (discord.HTTPException, *TRANSIENT) as exc:
            log.warning("discord: could not answer a button press: %s", describe(exc))


def _command_answer(result: Submitted) -> str:
    if result.outcome is Outcome.REJECTED:  # access refused with the notice throttled
        return "Sorry, you cannot use this bot yet."
    return result.detail or "Done."


async def _defer(pending: _PendingInteraction) -> None:
    async with pending.lock:
        if pending.answered or pending.interaction.response.is_done():
            return
        try:
            await pending.interaction.response.defer(thinking=True, ephemeral=pending.ephemeral)
        except (discord.HTTPException, *TRANSIENT) as exc:
            log.warning("discord: could not defer an interaction: %s", describe(exc))


async def _answer(pending: _PendingInteraction, text: str) -> None:
    async with pending.lock:
        if pending.answered:
            return
        pending.answered = True
        response = pending.interaction.response
        try:
            if response.is_done():  # deferred: the "thinking…" message becomes the answer
                await pending.interaction.edit_original_response(content=text[:MAX_LEN])
            else:
                await response.send_message(text[:MAX_LEN], ephemeral=pending.ephemeral)
        except (discord.HTTPException, *TRANSIENT) as exc:
            log.warning("discord: could not answer an interaction: %s", describe(exc))


def chat_for(channel: object) -> ChatRef | None:
    """Threads are sessions of their own: chat_id is the parent channel, thread_id the thread."""
    if isinstance(channel, discord.DMChannel):
        return ChatRef(PLATFORM, str(channel.id), ChatType.DM)
    if isinstance(channel, discord.Thread):
        return ChatRef(PLATFORM, str(channel.parent_id), ChatType.GROUP, str(channel.id))
    if isinstance(channel, (discord.TextChannel, discord.VoiceChannel, discord.StageChannel)):
        return ChatRef(PLATFORM, str(channel.id), ChatType.GROUP)
    if isinstance(channel, discord.PartialMessageable):  # not in discord.py's cache
        return ChatRef(PLATFORM, str(channel.id), ChatType.DM if channel.guild_id is None else ChatType.GROUP)
    return None


def mentions(message: discord.Message, me: discord.ClientUser) -> bool:
    """Does the message mention the bot, or its role in the guild?"""
    role = message.guild.self_role if message.guild else None
    return any(u.id == me.id for u in message.mentions) or (role is not None and role in message.role_mentions)


def replies_to(message: discord.Message, my_id: int, sent: BoundedMap[int, None]) -> bool:
    """Is the message a reply to one of the bot's (one it sent lately, or one Discord says is its)?"""
    ref = message.reference
    if ref is None or ref.message_id is None:
        return False
    resolved = ref.resolved
    return ref.message_id in sent or (isinstance(resolved, discord.Message) and resolved.author.id == my_id)


def open_channel(chat: ChatRef, config: DiscordConfig) -> bool:
    """Is every message here for the bot? In "all" mode: in the allowed channels and their threads
    (a thread by its own id or its channel's), or anywhere if none are listed."""
    allowed = config.allowed_channels
    return config.guild_mode == "all" and (
        not allowed or chat.chat_id in allowed or (chat.thread_id is not None and chat.thread_id in allowed))


def _known_command(text: str, username: str) -> bool:
    command = commands.parse_command(text, username)
    return command is not None and command.known


def strip_mentions(message: discord.Message, me: discord.ClientUser | None) -> str:
    role = message.guild.self_role if message.guild else None
    ids = [str(x.id) for x in (me, role) if x is not None]
    if not ids:
        return message.content
    return re.sub(rf"<@[!&]?(?:{'|'.join(ids)})>", "", message.content).strip()


def _inbound(message: discord.Message, chat: ChatRef, text: str) -> InboundMessage:
    ref = message.reference
    return InboundMessage(
        platform=PLATFORM, chat_id=chat.chat_id, chat_type=chat.chat_type, thread_id=chat.thread_id,
        user_id=str(message.author.id), user_name=message.author.display_name,
        message_id=str(message.id), text=text, timestamp=message.created_at.timestamp(),
        reply_to=str(ref.message_id) if ref is not None and ref.message_id is not None else None,
        attachments=tuple(_attachment(a) for a in message.attachments), media=bool(message.stickers))


def _attachment(a: discord.Attachment) -> Attachment:
    """A Discord attachment as the router sees it (its URL is how it is fetched in the turn)."""
    mime = mime_of(a.content_type, a.filename)
    return Attachment("image" if mime.startswith("image/") else "file", a.filename, mime, a.size, a.url)

