"""Discord adapter on discord.py 2.7: DMs, guild channels and threads; text and application commands.

The adapter wires three owners together: `DiscordConnection` (`platforms/discord_connection.py`:
login, the gateway's shards — `platforms/discord_shards.py` —, health), `DiscordIntake`
(`platforms/discord_intake.py`: which messages address the bot, application commands, Stop
button presses) and `DiscordOutbound` (`platforms/discord_outbound.py`: sends and edits, failures
mapped). Outbound calls queue on the adapter's per-channel outbox. On stop, the clients stay open
until the replies in flight have shown how they ended; in cluster mode the shards held here go to
other workers at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, ClassVar

import discord

from gateway.core.attachments import Attachment
from gateway.core.backoff import Backoff
from gateway.core.bounded import BoundedMap
from gateway.core.cancellation import Run, ToolReason
from gateway.core.messages import Capabilities, ChatRef, InboundMessage
from gateway.core.ports import Gateway, Health, NoticeKind, Reply, Submitted
from platforms.base import Adapter
from platforms.config import DiscordConfig
from platforms.discord_connection import DiscordConnection
from platforms.discord_intake import MAX_LEN, PLATFORM, DiscordIntake
from platforms.discord_outbound import DiscordOutbound
from platforms.ingress import IngressLeader
from platforms.stop_button import StopButton, StopButtons
from platforms.streaming import EditStreamReply

CLOSE_FLUSH_S = 5.0
SENT_IDS_MAX = 10_000  # our latest messages, to tell a reply to the bot (older ones: by the resolved author)


class DiscordAdapter(Adapter):
    name = PLATFORM
    # discord.Client keyword arguments for every instance (tests lower guild_ready_timeout here).
    client_options: ClassVar[dict[str, Any]] = {}
    reidentify_delay_s: ClassVar[float] = 5.0
    DEFER_AFTER_S: ClassVar[float] = 1.5  # Discord drops interactions not acknowledged within 3 s
    LOGIN_RETRY_S: ClassVar[float] = 1.0  # doubling up to LOGIN_RETRY_MAX_S
    LOGIN_RETRY_MAX_S: ClassVar[float] = 60.0
    CLOSE_GRACE_S: ClassVar[float] = 15.0

    def __init__(self, config: DiscordConfig, *, leaders: Sequence[IngressLeader] | None = None,
                 **client_options: Any) -> None:
        if config.token is None:
            raise ValueError("discord.token is required")
        self._config = config
        self.capabilities = Capabilities(max_message_len=MAX_LEN, can_edit=True, can_stream=True,
                                         edit_interval_s=config.edit_interval_s)
        self.stop_buttons = StopButtons(PLATFORM)
        sent: BoundedMap[int, None] = BoundedMap(SENT_IDS_MAX)
        self._intake = DiscordIntake(config, self._submit, self.stop_buttons, sent,
                                     defer_after_s=lambda: self.DEFER_AFTER_S)
        # Cluster mode: a shard is connected by the worker holding its lease (`leaders`, one per
        # shard); any worker may send.
        self._connection = DiscordConnection(
            config.token.reveal(), self._intake, register_commands=config.register_commands,
            shard_count=config.shard_count, leaders=leaders,
            retry=Backoff(self.LOGIN_RETRY_S, self.LOGIN_RETRY_MAX_S, jitter=0.0),
            reidentify_delay_s=self.reidentify_delay_s, client_options={**self.client_options, **client_options})
        self._out = DiscordOutbound(self._connection, sent)
        self._closing = False
        self._closed = False
        self._close_timer: asyncio.Task[None] | None = None
        self._replies: set[_DiscordReply] = set()

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def client(self) -> discord.Client:
        """The discord.py client for REST calls (a login retry replaces it)."""
        return self._connection.client

    @property
    def bot_username(self) -> str | None:
        user = self._connection.client.user
        return user.name if user is not None else None

    async def start(self, gateway: Gateway) -> None:
        """Log in (a rejected token leaves the adapter unhealthy, not the daemon down), then connect."""
        await super().start(gateway)
        await self._connection.start()

    def health(self) -> Health:
        return self._connection.health()

    async def stop(self) -> None:
        """Stop intake now (in cluster mode handing the shards held here on to other workers);
        close the clients once in-flight replies have shown how they ended."""
        self._closing = True
        self._intake.stop()  # what arrives from now on is not looked at: the shard's next holder gets it
        await self._connection.hand_on()
        if not self._replies:
            await self._close()
        elif self._close_timer is None:  # in case a reply never reports its end
            self._close_timer = asyncio.get_running_loop().create_task(self._close_later())

    async def _close_later(self) -> None:
        await asyncio.sleep(self.CLOSE_GRACE_S)
        await self._close()

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        timer = self._close_timer
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
        await self.outbox.close(CLOSE_FLUSH_S)  # what replies queued last (stop marks) still goes out
        await self._connection.close()

    async def _reply_done(self, reply: _DiscordReply) -> None:
        self._replies.discard(reply)
        if self._closing and not self._replies:
            await self._close()

    # --- intake ---------------------------------------------------------------------------

    async def _submit(self, msg: InboundMessage, key: str | None = None) -> Submitted:
        return await self.gateway.submit(msg, self, key=key)

    async def attachment_url(self, att: Attachment) -> str:
        return att.ref  # the attachment's CDN URL, as the message carried it

    # --- outbound -------------------------------------------------------------------------

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        return await self._out.send(chat, text, reply_to=reply_to, stop=None)

    async def send_part(self, chat: ChatRef, text: str, *, reply_to: str | None, stop: str | None) -> str:
        return await self._out.send(chat, text, reply_to=reply_to, stop=stop)

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        await self._out.edit(chat, message_id, text, stop=None)

    async def edit_part(self, chat: ChatRef, message_id: str, text: str, *, stop: str | None) -> None:
        await self._out.edit(chat, message_id, text, stop=stop)

    def outbox_key(self, chat: ChatRef) -> str:
        return chat.thread_id or chat.chat_id  # Discord rate-limits per channel; a thread is one

    async def typing(self, chat: ChatRef) -> None:
        await self._out.typing(chat)

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        """Notices about an application command answer its interaction; others are messages."""
        if self.stop_buttons.absorb(reply_to, text):  # about a Stop button press: its answer says it
            return
        if await self._intake.answer(reply_to, text):
            return
        await super().notify(chat, text, reply_to=reply_to)

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        button = self.stop_buttons.open(msg, run) if self._config.stop_button else None
        reply = _DiscordReply(self, msg, run, button)
        self._replies.add(reply)
        return reply


class _DiscordReply(EditStreamReply):
    """EditStreamReply that tells the adapter when it has ended, so shutdown can wait for it."""

    def __init__(self, adapter: DiscordAdapter, msg: InboundMessage, run: Run, button: StopButton | None) -> None:
        super().__init__(adapter, msg.chat, run, reply_to=msg.reply_target, stop=button)
        self._owner = adapter

    async def finish(self, text: str) -> None:
        try:
            await super().finish(text)
        finally:
            await self._owner._reply_done(self)

    async def interrupted(self, reason: ToolReason) -> None:
        try:
            await super().interrupted(reason)
        finally:
            await self._owner._reply_done(self)

    async def failed(self, text: str, *, retry_after_s: float | None = None) -> None:
        try:
            await super().failed(text, retry_after_s=retry_after_s)
        finally:
            await self._owner._reply_done(self)


__all__ = ["DiscordAdapter"]
