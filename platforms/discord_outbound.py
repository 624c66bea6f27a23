"""Discord calls on the way out, every discord.py failure mapped to `RateLimited` / `MessageGone` /
`Refused` / `OutboundError`, so a turn never crashes on an `HTTPException` and the streaming engine
can continue after a deleted message or split a refused part smaller."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import discord

from gateway.core.bounded import BoundedMap
from gateway.core.messages import ChatRef
from platforms import stop_button
from platforms.discord_client import TRANSIENT, describe
from platforms.discord_connection import DiscordConnection
from platforms.errors import MessageGone, OutboundError, RateLimited, Refused

T = TypeVar("T")
UNKNOWN_MESSAGE = 10008  # Discord's code for a message that does not exist (deleted)


class DiscordOutbound:
    """Sends, edits and typing through the connection's current client. Every message sent is
    remembered in `sent` (the intake tells replies to the bot by it)."""

    def __init__(self, connection: DiscordConnection, sent: BoundedMap[int, None]) -> None:
        self._connection = connection
        self._sent = sent

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None, stop: str | None) -> str:
        """A message (quoting `reply_to`, with the Stop button `stop`); its id."""
        channel = self._target(chat)
        options: dict[str, Any] = {}
        if reply_to is not None and reply_to.isdigit():
            options["reference"] = discord.MessageReference(message_id=int(reply_to), channel_id=channel.id,
                                                            fail_if_not_exists=False)
        if stop is not None:
            options["view"] = _stop_view(stop)
        message = await _call(lambda: channel.send(text, **options), idempotent=False)
        self._sent[message.id] = None
        return str(message.id)

    async def edit(self, chat: ChatRef, message_id: str, text: str, *, stop: str | None) -> None:
        partial = self._target(chat).get_partial_message(int(message_id))
        view = _stop_view(stop)  # None: a Stop button the message showed is removed
        await _call(lambda: partial.edit(content=text, view=view), idempotent=True)

    async def typing(self, chat: ChatRef) -> None:
        channel = self._target(chat)
        await _call(lambda: channel.typing(), idempotent=True)

    def _target(self, chat: ChatRef) -> discord.PartialMessageable:
        client = self._connection.client
        if client.is_closed():
            raise OutboundError("the Discord client is closed")
        return client.get_partial_messageable(int(chat.thread_id or chat.chat_id))


async def _call(call: Callable[[], Awaitable[T]], *, idempotent: bool) -> T:
    """Await a discord.py call, mapping its failures to what the reply streamer understands."""
    try:
        return await call()
    except discord.RateLimited as exc:  # longer than max_ratelimit_timeout: skip, don't sleep
        raise RateLimited(exc.retry_after) from None
    except discord.HTTPException as exc:
        raise _mapped(exc) from None
    except TRANSIENT as exc:
        if idempotent:  # an edit can simply be repeated; a repeated send could post twice
            raise RateLimited(1.0) from None
        raise OutboundError(describe(exc)) from None


def _mapped(exc: discord.HTTPException) -> Exception:
    if exc.status == 429 and exc.response.headers.get("Via"):  # discord.py gave up retrying
        return RateLimited(float(exc.response.headers.get("Retry-After") or 1.0))
    if exc.code == UNKNOWN_MESSAGE:
        return MessageGone(describe(exc))
    if exc.status == 400:  # Invalid Form Body (too long, empty…): this content, not the channel
        return Refused(describe(exc))
    return OutboundError(describe(exc))


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
