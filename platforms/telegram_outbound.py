"""Bot API calls on the way out, with Telegram's failures mapped to what the streaming engine
understands: `RateLimited` (a 429, or a transient network failure), `MessageGone`, `Refused` (this
text, even as plain text) or `OutboundError` (this chat). Text goes as HTML rendered from our
Markdown first, as plain text if Telegram refuses the HTML."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import warnings
from collections.abc import Awaitable, Callable
from typing import TypeVar

from telegram import Bot, InlineKeyboardButton, InlineKeyboardMarkup, Message, ReplyParameters
from telegram.constants import ChatAction, ChatMemberStatus, ParseMode
from telegram.error import (
    BadRequest,
    EndPointNotFound,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
)

from gateway.core.attachments import Attachment
from gateway.core.messages import ChatRef, ChatType
from platforms import stop_button
from platforms.errors import MessageGone, OutboundError, RateLimited, Refused, explain
from platforms.telegram_draft import DraftsRefused
from platforms.telegram_format import to_html, visible_text

log = logging.getLogger("platforms.telegram_bot")  # the Telegram adapter logs under one name
T = TypeVar("T")
Scrub = Callable[[str], str]

# Bad Requests about the message rather than its text: retrying with other text will not help.
_GONE = ("message to edit not found", "message_id_invalid", "message can't be edited")
_CHAT = ("chat not found", "not enough rights", "have no rights", "chat_write_forbidden", "bot is not a member",
         "topic_closed", "topic_deleted", "message thread not found", "peer_id_invalid", "group chat was upgraded")


def token_scrubber(token: str) -> Scrub:
    """Belt and braces next to the log redactor: PTB puts the token in some messages."""
    def scrub(text: str) -> str:
        return text.replace(token, "***")
    return scrub


class TelegramOutbound:
    """Sends, edits, drafts, typing and the few questions asked of the Bot API on the way (a file's
    URL, a member's status). Every method raises as described above, or never (cosmetic calls)."""

    def __init__(self, bot: Bot, scrub: Scrub) -> None:
        self._bot = bot
        self._scrub = scrub

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None, stop: str | None = None,
                   silent: bool = False) -> str:
        """A message (with the Stop button `stop`); its id."""
        # Quoting the question helps in a busy group; in a private chat it is noise.
        quote = (ReplyParameters(message_id=int(reply_to), allow_sending_without_reply=True)
                 if reply_to and reply_to.isdigit() and chat.chat_type is not ChatType.DM else None)
        markup = _stop_markup(stop)

        async def call(body: str, mode: str | None) -> Message:
            return await self._bot.send_message(int(chat.chat_id), body, parse_mode=mode,
                                                message_thread_id=_thread(chat), reply_parameters=quote,
                                                reply_markup=markup, disable_notification=silent or None)

        sent = await self._deliver(text, call)
        return str(sent.message_id)

    async def send_status(self, chat: ChatRef, text: str, *, stop: str) -> str:
        """A silent message carrying the Stop button (beside a draft, which has no buttons)."""
        return await self.send(chat, text, reply_to=None, stop=stop, silent=True)

    async def edit(self, chat: ChatRef, message_id: str, text: str, *, stop: str | None) -> None:
        """Replace a message's text; without `stop` a Stop button it showed is removed."""
        markup = _stop_markup(stop)

        async def call(body: str, mode: str | None) -> None:
            try:
                await self._bot.edit_message_text(body, chat_id=int(chat.chat_id), message_id=int(message_id),
                                                  parse_mode=mode, reply_markup=markup)
            except BadRequest as exc:
                if "not modified" not in str(exc).lower():  # same text again: already shown
                    raise

        await self._deliver(text, call)

    async def send_draft(self, chat: ChatRef, draft_id: int, text: str) -> None:
        """Show `text` as the chat's draft `draft_id` (empty: "Thinking…"). Raises `DraftsRefused`
        if the chat takes no drafts, else as `send` does."""
        async def call(body: str, mode: str | None) -> None:
            try:
                await self._bot.send_message_draft(int(chat.chat_id), draft_id, body, parse_mode=mode,
                                                   message_thread_id=_thread(chat))
            except (EndPointNotFound, InvalidToken) as exc:
                # PTB reports a 404 (an unknown method: a Bot API server from before 9.3) as InvalidToken.
                if isinstance(exc, InvalidToken) and "not found" not in str(exc).lower():
                    raise
                raise DraftsRefused("sendMessageDraft is not known to this Bot API server", everywhere=True) from None
            except BadRequest as exc:
                if _kind(exc) != "refused" or "draft" in str(exc).lower() or "peer" in str(exc).lower():
                    raise DraftsRefused(self._scrub(str(exc))) from None
                raise

        await self._deliver(text, call)

    async def delete_status(self, chat: ChatRef, message_id: str) -> None:
        """Remove a status message; where it cannot be deleted, at least its button."""
        try:
            await self._bot.delete_message(int(chat.chat_id), int(message_id))
        except RetryAfter as exc:
            raise RateLimited(retry_after_s(exc)) from None
        except TelegramError as exc:
            log.info("telegram: could not delete a status message (%s); removing its button",
                     self._scrub(str(exc)))
            with contextlib.suppress(TelegramError):
                await self._bot.edit_message_reply_markup(int(chat.chat_id), int(message_id), reply_markup=None)

    async def typing(self, chat: ChatRef) -> None:
        with contextlib.suppress(TelegramError):  # cosmetic
            await self._bot.send_chat_action(int(chat.chat_id), ChatAction.TYPING, message_thread_id=_thread(chat))

    async def answer_press(self, query_id: str, text: str | None, *, alert: bool) -> None:
        """Answer a button press (a toast, or an alert); never raises."""
        try:
            await self._bot.answer_callback_query(query_id, text=(text or "")[:200] or None, show_alert=alert)
        except TelegramError as exc:  # too old, or answered already: the stop itself stands
            log.info("telegram: could not answer a button press: %s", self._scrub(explain(exc)))

    async def is_admin(self, chat_id: int, user_id: int) -> bool:
        try:
            member = await self._bot.get_chat_member(chat_id, user_id)
        except TelegramError as exc:
            log.info("telegram: could not check a member's status: %s", self._scrub(explain(exc)))
            return False
        return member.status in (ChatMemberStatus.ADMINISTRATOR, ChatMemberStatus.OWNER)

    async def file_url(self, att: Attachment) -> str:
        """getFile: the download URL of an attachment (it carries the token: never logged)."""
        try:
            file = await self._bot.get_file(att.ref)
        except TelegramError as exc:
            raise LookupError(f"Telegram would not hand it out ({self._scrub(str(exc))})") from None
        if not file.file_path:
            raise LookupError("Telegram gave no download path for it")
        return file.file_path

    async def _deliver(self, text: str, call: Callable[[str, str | None], Awaitable[T]]) -> T:
        """A send or edit: HTML first, plain text if Telegram refuses the HTML part."""
        try:
            rendered = to_html(text)
            if visible_text(rendered).strip():
                try:
                    return await call(rendered, ParseMode.HTML)
                except BadRequest as exc:
                    if _kind(exc) != "refused":
                        raise
                    log.info("telegram: HTML refused (%s); sending plain text", self._scrub(explain(exc)))
            return await call(text, None)
        except RetryAfter as exc:
            raise RateLimited(retry_after_s(exc)) from None
        except BadRequest as exc:  # a NetworkError subclass in PTB: must come first
            detail = self._scrub(str(exc))
            kind = _kind(exc)
            raise (MessageGone(detail) if kind == "gone" else Refused(detail) if kind == "refused"
                   else OutboundError(detail)) from None
        except Forbidden as exc:
            raise OutboundError(self._scrub(str(exc))) from None
        except NetworkError as exc:
            raise RateLimited(1.0) from exc
        except TelegramError as exc:
            raise OutboundError(self._scrub(str(exc))) from None


def _kind(exc: BadRequest) -> str:
    """A Bad Request about the message to edit ("gone"), the chat ("chat"), or the text ("refused")."""
    text = str(exc).lower()
    if any(k in text for k in _GONE):
        return "gone"
    if any(k in text for k in _CHAT):
        return "chat"
    return "refused"


def _stop_markup(data: str | None) -> InlineKeyboardMarkup | None:
    if data is None:
        return None
    return InlineKeyboardMarkup([[InlineKeyboardButton(stop_button.LABEL, callback_data=data)]])


def _thread(chat: ChatRef) -> int | None:
    return int(chat.thread_id) if chat.thread_id else None


def retry_after_s(exc: RetryAfter) -> float:
    with warnings.catch_warnings():  # PTB 22 deprecates the int form; accept either
        warnings.simplefilter("ignore")
        value: int | dt.timedelta = exc.retry_after
    return value.total_seconds() if isinstance(value, dt.timedelta) else float(value)
