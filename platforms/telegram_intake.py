"""Telegram updates to router input: which messages are for us, and what they say. No I/O."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from telegram import Message, MessageEntity, Update, User
from telegram.constants import ChatType as TgChatType

from gateway.core import commands
from gateway.core.attachments import Attachment, mime_of
from gateway.core.messages import ChatRef, ChatType, InboundMessage

PLATFORM = "telegram"
GroupMode = Literal["mention", "all"]


@dataclass(slots=True)
class BotIdentity:
    """Who the bot is, as getMe says; the transport learns it on connecting (until then: nobody)."""

    id: int = 0
    username: str = ""


class CommandFor(Enum):
    US = "us"
    NO_COMMAND = "no command"
    ANOTHER_BOT = "another bot"


def command_for(text: str, username: str, chat_type: ChatType) -> CommandFor:
    """Whom a message's command addresses. `/stop@OtherBot` is another bot's; so is an unknown
    bare `/cmd` in a group (most likely meant for a bot that knows it)."""
    if not text.lstrip().startswith("/"):
        return CommandFor.NO_COMMAND
    ours = commands.parse_command(text, username)
    if ours is None:
        return CommandFor.ANOTHER_BOT if commands.parse_command(text) is not None else CommandFor.NO_COMMAND
    explicit = "@" in text.split(maxsplit=1)[0]
    if not ours.known and not explicit and chat_type is ChatType.GROUP:
        return CommandFor.ANOTHER_BOT
    return CommandFor.US


class TelegramIntake:
    """Turns updates into `InboundMessage`s, or None when they are not for us (bots, other bots'
    commands, group chatter that does not address us in "mention" mode)."""

    def __init__(self, identity: BotIdentity, groups: GroupMode) -> None:
        self._me = identity
        self._groups = groups

    def inbound(self, update: Update, album: Sequence[Update] = ()) -> InboundMessage | None:
        """The message of `update`, with the rest of its `album` (the first part's id, every
        part's files, the first caption)."""
        msg = self.message(update.message) if update.message is not None else None
        return _with_album(msg, album) if msg is not None and album else msg

    def message(self, m: Message) -> InboundMessage | None:
        """The normalized message, or None when it is not for us. Media without a caption gets
        empty text."""
        user, chat = m.from_user, chat_of(m)
        if user is None or user.is_bot or chat is None:  # bots: our own messages included
            return None
        text = m.text if m.text is not None else m.caption
        if text is None and m.effective_attachment is None:
            return None  # service messages: members joining, pins, topic changes...
        mentions = self._mentions(m.parse_entities() if m.text is not None else m.parse_caption_entities())
        if not self._for_us(m, chat, text or "", mentioned=bool(mentions)):
            return None
        return _normalized(m, user, chat, strip_spans(text, mentions) if text and mentions else text or "")

    def _for_us(self, m: Message, chat: ChatRef, text: str, *, mentioned: bool) -> bool:
        command = command_for(text, self._me.username, chat.chat_type)
        if command is CommandFor.ANOTHER_BOT:
            return False
        if chat.chat_type is ChatType.GROUP and self._groups == "mention":
            return command is CommandFor.US or mentioned or self._replies_to_us(m)
        return True

    def _mentions(self, entities: dict[MessageEntity, str]) -> list[tuple[int, int]]:
        """(offset, length) in UTF-16 units of every @mention of this bot."""
        found = []
        for ent, value in entities.items():
            if (ent.type == MessageEntity.MENTION and value[1:].lower() == self._me.username.lower()) or (
                    ent.type == MessageEntity.TEXT_MENTION and ent.user and ent.user.id == self._me.id):
                found.append((ent.offset, ent.length))
        return found

    def _replies_to_us(self, m: Message) -> bool:
        reply = m.reply_to_message
        # In forum topics every message "replies" to the topic's creation message: not to us.
        return (reply is not None and reply.forum_topic_created is None and reply.from_user is not None
                and reply.from_user.id == self._me.id)


def _with_album(msg: InboundMessage, album: Sequence[Update]) -> InboundMessage:
    parts = [u.message for u in album if u.message is not None]
    caption = msg.text or next((p.caption for p in parts if p.caption), "")
    return dataclasses.replace(msg, text=caption, attachments=msg.attachments + tuple(
        a for p in parts for a in attachments(p)))


def _normalized(m: Message, user: User, chat: ChatRef, text: str) -> InboundMessage:
    reply = m.reply_to_message
    files = attachments(m)
    return InboundMessage(
        platform=PLATFORM, chat_id=chat.chat_id, chat_type=chat.chat_type,
        user_id=str(user.id), user_name=user.full_name, user_handle=user.username,
        message_id=str(m.message_id), text=text, thread_id=chat.thread_id,
        reply_to=str(reply.message_id) if reply is not None else None,
        timestamp=m.date.timestamp(), attachments=files,
        media=m.effective_attachment is not None and not files)  # a sticker, a poll...


def chat_of(m: Message) -> ChatRef | None:
    """Where a message is: its chat (private or group) and forum topic; None for a channel."""
    if m.chat.type == TgChatType.PRIVATE:
        chat_type = ChatType.DM
    elif m.chat.type in (TgChatType.GROUP, TgChatType.SUPERGROUP):
        chat_type = ChatType.GROUP
    else:
        return None
    thread = str(m.message_thread_id) if m.is_topic_message and m.message_thread_id else None
    return ChatRef(PLATFORM, str(m.chat.id), chat_type, thread)


def album_of(update: Update) -> tuple[int, str] | None:
    m = update.message
    return (m.chat.id, m.media_group_id) if m is not None and m.media_group_id else None


def albums(updates: Sequence[Update]) -> list[list[Update]]:
    """Updates in order, the consecutive parts of one album (same chat, same media group) together."""
    groups: list[list[Update]] = []
    for update in updates:
        album = album_of(update)
        if groups and album is not None and album_of(groups[-1][0]) == album:
            groups[-1].append(update)
        else:
            groups.append([update])
    return groups


def attachments(m: Message) -> tuple[Attachment, ...]:
    """A photo (its largest size) or a file (a document, voice note, audio or video) as attachments;
    the router decides which are read. Stickers, polls, locations... are not files."""
    if m.photo:
        best = m.photo[-1]
        return (Attachment("image", f"photo_{m.message_id}.jpg", "image/jpeg", best.file_size, best.file_id),)
    if m.document is not None:
        d = m.document
        name = d.file_name or f"file_{m.message_id}"
        mime = mime_of(d.mime_type, name)
        kind: Literal["image", "file"] = "image" if mime.startswith("image/") else "file"
        return (Attachment(kind, name, mime, d.file_size, d.file_id),)
    for media, name, default in ((m.voice, "voice", "audio/ogg"), (m.audio, "audio", "audio/mpeg"),
                                 (m.video, "video", "video/mp4"), (m.video_note, "video_note", "video/mp4"),
                                 (m.animation, "animation", "video/mp4")):
        if media is not None:  # offered to the router, which says why it is not read
            fname = getattr(media, "file_name", None) or f"{name}_{m.message_id}"
            mime = mime_of(getattr(media, "mime_type", None) or default, fname)
            return (Attachment("file", fname, mime, media.file_size, media.file_id),)
    return ()


def strip_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """Remove (offset, length) UTF-16 spans (our @mentions) and tidy the seams."""
    data = text.encode("utf-16-le")
    pieces, pos = [], 0
    for offset, length in sorted(spans):
        pieces.append(data[pos * 2:offset * 2].decode("utf-16-le"))
        pos = offset + length
    pieces.append(data[pos * 2:].decode("utf-16-le"))
    out = pieces[0]
    for piece in pieces[1:]:
        out += piece[1:] if out.endswith((" ", "\n")) and piece.startswith(" ") else piece
    return out.strip().lstrip(",:").strip()
