"""Discord adapter on discord.py 2.7: DMs, guild channels and threads; text and application commands.

discord.py owns the gateway (heartbeats, RESUME, re-IDENTIFY) and paces REST calls; this adapter
turns messages and interactions into router input, and maps every discord.py failure on the way
out to `RateLimited` / `MessageGone` / `Refused` / `OutboundError` so a turn never crashes on an
`HTTPException` and the streaming engine can continue after a deleted message or split a refused
part smaller. Outbound calls queue on the adapter's per-channel outbox. Its own state lives on the
adapter, not in discord.py's caches, which a re-IDENTIFY clears.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import aiohttp
import discord
from discord import app_commands

from gateway.core import commands
from gateway.core.attachments import Attachment, mime_of
from gateway.core.backoff import Backoff
from gateway.core.bounded import BoundedMap
from gateway.core.cancellation import Run, ToolReason
from gateway.core.messages import Capabilities, ChatRef, ChatType, InboundMessage
from gateway.core.ports import Gateway, Health, NoticeKind, Outcome, Reply, Submitted
from platforms import stop_button
from platforms.base import Adapter, MessageGone, OutboundError, RateLimited, Refused
from platforms.config import DiscordConfig
from platforms.ingress import IngressLeader
from platforms.stop_button import PressOutcome, StopButton, StopButtons
from platforms.streaming import EditStreamReply

log = logging.getLogger(__name__)

PLATFORM = "discord"
MAX_LEN = 2000
UNKNOWN_MESSAGE = 10008  # Discord's code for a message that does not exist (deleted)
CLOSE_FLUSH_S = 5.0
SENT_IDS_MAX = 10_000  # our latest messages, to tell a reply to the bot (older ones: by the resolved author)
_TRANSIENT = (aiohttp.ClientError, OSError, TimeoutError)
_USER_MESSAGES = (discord.MessageType.default, discord.MessageType.reply)
T = TypeVar("T")
Interaction = discord.Interaction[Any]


class _Fatal(Exception):
    """A failure no retry fixes (a rejected token); the text says what to do."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, discord.HTTPException):
        return f"HTTP {exc.status} (code {exc.code}): {exc.text or 'no details'}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _Client(discord.Client):
    """A discord.Client that forwards events to its adapter; it holds no state of its own."""

    def __init__(self, adapter: DiscordAdapter, **options: Any) -> None:
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
        self.adapter = adapter
        self.tree: app_commands.CommandTree[_Client] = app_commands.CommandTree(self)

    async def before_identify_hook(self, shard_id: int | None, *, initial: bool = False) -> None:
        if not initial:  # Discord allows one IDENTIFY per 5 s; discord.py's default waits that long
            await asyncio.sleep(self.adapter.reidentify_delay_s)

    async def on_ready(self) -> None:
        self.adapter._set_connected(True)

    async def on_resumed(self) -> None:
        self.adapter._set_connected(True)

    async def on_disconnect(self) -> None:
        self.adapter._set_connected(False)

    async def on_message(self, message: discord.Message) -> None:
        await self.adapter._on_message(message)

    async def on_interaction(self, interaction: Interaction) -> None:
        if interaction.type is discord.InteractionType.component:
            await self.adapter._on_component(interaction)


@dataclass(eq=False)
class _PendingInteraction:
    """An application command not answered yet; the lock orders defer against the answer."""

    interaction: Interaction
    ephemeral: bool
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    answered: bool = False


class DiscordAdapter(Adapter):
    name = PLATFORM
    # discord.Client keyword arguments for every instance (tests lower guild_ready_timeout here).
    client_options: ClassVar[dict[str, Any]] = {}
    reidentify_delay_s: ClassVar[float] = 5.0
    DEFER_AFTER_S: ClassVar[float] = 1.5  # Discord drops interactions not acknowledged within 3 s
    LOGIN_RETRY_S: ClassVar[float] = 1.0  # doubling up to LOGIN_RETRY_MAX_S
    LOGIN_RETRY_MAX_S: ClassVar[float] = 60.0
    CLOSE_GRACE_S: ClassVar[float] = 15.0

    def __init__(self, config: DiscordConfig, *, leader: IngressLeader | None = None, **client_options: Any) -> None:
        if config.token is None:
            raise ValueError("discord.token is required")
        self._config = config
        self._token = config.token.reveal()
        self._client_kwargs = {**self.client_options, **client_options}
        self.capabilities = Capabilities(max_message_len=MAX_LEN, can_edit=True, can_stream=True,
                                         edit_interval_s=config.edit_interval_s)
        self.client = self._new_client()
        self._task: asyncio.Task[None] | None = None
        self._connected = False
        self._problem: str | None = None
        # Cluster mode: only the worker holding this lease connects to the gateway; any may send.
        self.leader = leader
        self._standby = False
        self._closing = False
        self._closed = False
        self._close_timer: asyncio.Task[None] | None = None
        self._replies: set[_DiscordReply] = set()
        self._interactions: dict[str, _PendingInteraction] = {}
        self._sent_ids: BoundedMap[int, None] = BoundedMap(SENT_IDS_MAX)  # ours, to spot replies to the bot
        self.stop_buttons = StopButtons(PLATFORM)

    def _new_client(self) -> _Client:
        client = _Client(self, **self._client_kwargs)
        for name, description in commands.menu():
            client.tree.add_command(app_commands.Command(name=name, description=description,
                                                         callback=self._command_callback(name)))
        return client

    def _command_callback(self, name: str) -> Callable[[Interaction], Coroutine[Any, Any, None]]:
        async def callback(interaction: Interaction) -> None:
            await self._on_app_command(interaction, name)
        return callback

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def bot_username(self) -> str | None:
        user = self.client.user
        return user.name if user is not None else None

    async def start(self, gateway: Gateway) -> None:
        """Log in (a rejected token leaves the adapter unhealthy, not the daemon down), then connect."""
        await super().start(gateway)
        try:
            logged_in = await self._login()
        except _Fatal as exc:
            self._fail(str(exc))
            return
        self._task = asyncio.get_running_loop().create_task(self._run(logged_in), name="discord-gateway")

    async def _login(self) -> bool:
        """True once logged in, False on a transient failure; raises _Fatal for a rejected token."""
        try:
            await self.client.login(self._token)
            return True
        except discord.LoginFailure:
            raise _Fatal("the bot token was rejected (401 Unauthorized); check discord.token") from None
        except (discord.HTTPException, *_TRANSIENT) as exc:
            log.warning("discord: login failed (%s); will retry", _describe(exc))
            await self.client.close()  # a retry logs in on a fresh client (fresh HTTP session)
            self.client = self._new_client()
            return False

    async def _run(self, logged_in: bool) -> None:
        retry = Backoff(self.LOGIN_RETRY_S, self.LOGIN_RETRY_MAX_S, jitter=0.0)
        try:
            while not logged_in:
                await asyncio.sleep(retry.step())
                logged_in = await self._login()
            if self._config.register_commands:
                await self._sync_commands()
            if self.leader is not None:  # cluster mode: one gateway connection per bot token
                self._standby = True
                await self.leader.wait()
                self._standby = False
            await self.client.connect(reconnect=True)  # returns when closed; reconnects on its own
        except _Fatal as exc:
            self._fail(str(exc))
        except discord.PrivilegedIntentsRequired:
            self._fail("the Message Content intent is not enabled for this bot in the Discord developer portal")
        except (discord.DiscordException, *_TRANSIENT) as exc:
            if not self.client.is_closed():
                self._fail(f"the gateway connection ended: {_describe(exc)}")
        except Exception:
            log.exception("discord: the gateway task crashed")
            self._problem = "the gateway task crashed (see the log)"

    async def _sync_commands(self) -> None:
        try:
            synced = await self.client.tree.sync()
            log.info("discord: registered %d application commands", len(synced))
        except (discord.DiscordException, *_TRANSIENT) as exc:  # text commands still work without them
            log.warning("discord: could not register application commands: %s", _describe(exc))

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

    async def stop(self) -> None:
        """Stop intake now; close the client once in-flight replies have shown how they ended."""
        self._closing = True
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
        timer, task = self._close_timer, self._task
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
        await self.outbox.close(CLOSE_FLUSH_S)  # what replies queued last (stop marks) still goes out
        if task is not None and not self.client.is_ready():
            task.cancel()  # still logging in or connecting: nothing to wind down
        await self.client.close()
        if task is not None:
            _done, late = await asyncio.wait({task}, timeout=5.0)
            for stuck in late:
                log.warning("discord: the gateway task did not end after close")
                stuck.cancel()

    async def _reply_done(self, reply: _DiscordReply) -> None:
        self._replies.discard(reply)
        if self._closing and not self._replies:
            await self._close()

    # --- inbound --------------------------------------------------------------------------

    @staticmethod
    def _chat_for(channel: object) -> ChatRef | None:
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

    def _addressed(self, message: discord.Message, chat: ChatRef, text: str) -> bool:
        """In a guild: a mention, a reply to the bot, a known command, or any message in "all" mode."""
        me = self.client.user
        if me is None:
            return False
        role = message.guild.self_role if message.guild else None
        if any(u.id == me.id for u in message.mentions) or (role is not None and role in message.role_mentions):
            return True
        ref = message.reference
        if ref is not None and ref.message_id is not None:
            resolved = ref.resolved
            if ref.message_id in self._sent_ids or (
                    isinstance(resolved, discord.Message) and resolved.author.id == me.id):
                return True
        command = commands.parse_command(text, self.bot_username)
        if command is not None and command.known:
            return True
        allowed = self._config.allowed_channels
        return self._config.guild_mode == "all" and (
            not allowed or chat.chat_id in allowed or (chat.thread_id is not None and chat.thread_id in allowed))

    def _strip_mentions(self, message: discord.Message) -> str:
        me = self.client.user
        role = message.guild.self_role if message.guild else None
        ids = [str(x.id) for x in (me, role) if x is not None]
        if not ids:
            return message.content
        return re.sub(rf"<@[!&]?(?:{'|'.join(ids)})>", "", message.content).strip()

    async def _on_message(self, message: discord.Message) -> None:
        if self._closing or message.author.bot or message.type not in _USER_MESSAGES:
            return  # bot messages (our own echoes included) never start turns
        chat = self._chat_for(message.channel)
        if chat is None:
            return
        try:
            text = message.content
            if chat.chat_type is not ChatType.DM:
                text = self._strip_mentions(message)
                if not self._addressed(message, chat, text):
                    return
            ref = message.reference
            msg = InboundMessage(
                platform=PLATFORM, chat_id=chat.chat_id, chat_type=chat.chat_type, thread_id=chat.thread_id,
                user_id=str(message.author.id), user_name=message.author.display_name,
                message_id=str(message.id), text=text, timestamp=message.created_at.timestamp(),
                reply_to=str(ref.message_id) if ref is not None and ref.message_id is not None else None,
                attachments=tuple(_attachment(a) for a in message.attachments), media=bool(message.stickers))
            await self.gateway.submit(msg, self)
        except Exception:
            log.exception("discord: could not handle message %s", message.id)

    async def _submit(self, msg: InboundMessage, key: str | None = None) -> Submitted:
        return await self.gateway.submit(msg, self, key=key)

    async def attachment_url(self, att: Attachment) -> str:
        return att.ref  # the attachment's CDN URL, as the message carried it

    async def _on_app_command(self, interaction: Interaction, name: str) -> None:
        """Run `/name` as the router's text command; the interaction is always answered."""
        spec = commands.lookup(name)
        pending = _PendingInteraction(interaction, ephemeral=spec is not None and spec.private)
        chat = self._chat_for(interaction.channel)
        if self._closing or chat is None:
            await self._answer(pending, "The gateway is restarting; please try again in a moment." if self._closing
                               else "This command works in DMs, text channels and threads.")
            return
        msg = InboundMessage(platform=PLATFORM, chat_id=chat.chat_id, chat_type=chat.chat_type,
                             thread_id=chat.thread_id, user_id=str(interaction.user.id),
                             user_name=interaction.user.display_name, message_id=f"i{interaction.id}",
                             text=f"/{name}")
        self._interactions[msg.message_id] = pending  # the router's notice for it goes to `notify`
        submit = asyncio.ensure_future(self.gateway.submit(msg, self))
        text = "Done."
        try:
            done, _ = await asyncio.wait({submit}, timeout=self.DEFER_AFTER_S)
            if not done:
                await self._defer(pending)
            result = await submit
            text = result.detail or text
            if result.outcome is Outcome.REJECTED:  # access refused with the notice throttled
                text = "Sorry, you cannot use this bot yet."
        except Exception:
            log.exception("discord: /%s failed", name)
            text = "Something went wrong on our side; it has been logged."
        finally:
            self._interactions.pop(msg.message_id, None)
        await self._answer(pending, text)

    async def _defer(self, pending: _PendingInteraction) -> None:
        async with pending.lock:
            if pending.answered or pending.interaction.response.is_done():
                return
            try:
                await pending.interaction.response.defer(thinking=True, ephemeral=pending.ephemeral)
            except (discord.HTTPException, *_TRANSIENT) as exc:
                log.warning("discord: could not defer an interaction: %s", _describe(exc))

    async def _answer(self, pending: _PendingInteraction, text: str) -> None:
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
            except (discord.HTTPException, *_TRANSIENT) as exc:
                log.warning("discord: could not answer an interaction: %s", _describe(exc))

    async def _on_component(self, interaction: Interaction) -> None:
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
            press = await self.stop_buttons.press(
                self._submit, self._chat_for(interaction.channel), raw, user_id=str(interaction.user.id),
                user_name=interaction.user.display_name, press_id=f"dc{interaction.id}", is_admin=is_admin)
        except Exception:
            log.exception("discord: could not handle a Stop button press")
            press = stop_button.Press(PressOutcome.FAILED, "Something went wrong; please try /stop.")
        try:
            if press.outcome is PressOutcome.STOPPED:
                await interaction.response.defer()  # a deferred update: the message changes itself
            else:
                await interaction.response.send_message(press.text[:MAX_LEN], ephemeral=True)
        except (discord.HTTPException, *_TRANSIENT) as exc:
            log.warning("discord: could not answer a button press: %s", _describe(exc))

    # --- outbound -------------------------------------------------------------------------

    def _target(self, chat: ChatRef) -> discord.PartialMessageable:
        if self.client.is_closed():
            raise OutboundError("the Discord client is closed")
        return self.client.get_partial_messageable(int(chat.thread_id or chat.chat_id))

    async def _call(self, call: Callable[[], Awaitable[T]], *, idempotent: bool) -> T:
        """Await a discord.py call, mapping its failures to what the reply streamer understands."""
        try:
            return await call()
        except discord.RateLimited as exc:  # longer than max_ratelimit_timeout: skip, don't sleep
            raise RateLimited(exc.retry_after) from None
        except discord.HTTPException as exc:
            if exc.status == 429 and exc.response.headers.get("Via"):  # discord.py gave up retrying
                raise RateLimited(float(exc.response.headers.get("Retry-After") or 1.0)) from None
            if exc.code == UNKNOWN_MESSAGE:
                raise MessageGone(_describe(exc)) from None
            if exc.status == 400:  # Invalid Form Body (too long, empty…): this content, not the channel
                raise Refused(_describe(exc)) from None
            raise OutboundError(_describe(exc)) from None
        except _TRANSIENT as exc:
            if idempotent:  # an edit can simply be repeated; a repeated send could post twice
                raise RateLimited(1.0) from None
            raise OutboundError(_describe(exc)) from None

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        return await self.send_part(chat, text, reply_to=reply_to, stop=None)

    async def send_part(self, chat: ChatRef, text: str, *, reply_to: str | None, stop: str | None) -> str:
        channel = self._target(chat)
        options: dict[str, Any] = {}
        if reply_to is not None and reply_to.isdigit():
            options["reference"] = discord.MessageReference(message_id=int(reply_to), channel_id=channel.id,
                                                            fail_if_not_exists=False)
        if stop is not None:
            options["view"] = _stop_view(stop)
        message = await self._call(lambda: channel.send(text, **options), idempotent=False)
        self._sent_ids[message.id] = None
        return str(message.id)

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        await self.edit_part(chat, message_id, text, stop=None)

    async def edit_part(self, chat: ChatRef, message_id: str, text: str, *, stop: str | None) -> None:
        partial = self._target(chat).get_partial_message(int(message_id))
        view = _stop_view(stop)  # None: a Stop button the message showed is removed
        await self._call(lambda: partial.edit(content=text, view=view), idempotent=True)

    def outbox_key(self, chat: ChatRef) -> str:
        return chat.thread_id or chat.chat_id  # Discord rate-limits per channel; a thread is one

    async def typing(self, chat: ChatRef) -> None:
        channel = self._target(chat)
        await self._call(lambda: channel.typing(), idempotent=True)

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        """Notices about an application command answer its interaction; others are messages."""
        if self.stop_buttons.absorb(reply_to, text):  # about a Stop button press: its answer says it
            return
        pending = self._interactions.pop(reply_to, None) if reply_to else None
        if pending is not None:
            await self._answer(pending, text)
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
        super().__init__(adapter, msg.chat, run, reply_to=msg.message_id, stop=button)
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


def _stop_view(data: str | None) -> discord.ui.View | None:
    """A message's Stop button, as a component layout. The view is stopped before it is sent, so
    discord.py does not keep it: presses arrive in `on_interaction`, whether discord.py still
    knows the message or not (a restart, a re-IDENTIFY)."""
    if data is None:
        return None
    view = discord.ui.View(timeout=None)
    view.add_item(discord.ui.Button(label=stop_button.LABEL, style=discord.ButtonStyle.secondary, custom_id=data))
    view.stop()
    return view


__all__ = ["DiscordAdapter"]


def _attachment(a: discord.Attachment) -> Attachment:
    """A Discord attachment as the router sees it (its URL is how it is fetched in the turn)."""
    mime = mime_of(a.content_type, a.filename)
    return Attachment("image" if mime.startswith("image/") else "file", a.filename, mime, a.size, a.url)
