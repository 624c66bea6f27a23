"""The normalized message every platform adapter produces, where replies go, and how it maps to a session."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from gateway.core.attachments import Attachment


class ChatType(StrEnum):
    DM = "dm"
    GROUP = "group"
    CHANNEL = "channel"


@dataclass(frozen=True, slots=True)
class ChatRef:
    """Where a reply goes: enough for any adapter to address the chat (and topic/thread)."""

    platform: str
    chat_id: str
    chat_type: ChatType
    thread_id: str | None = None


# Message ids of the turns the gateway asks for itself: a turn cut off by a restart or a takeover,
# asked to continue. No platform knows them: what answers one quotes the user's message it continues.
RESUME_PREFIX = "resume:"


@dataclass(frozen=True, slots=True)
class InboundMessage:
    """One inbound chat event, the same shape for every platform."""

    platform: str
    chat_id: str
    chat_type: ChatType
    user_id: str
    user_name: str
    message_id: str
    text: str
    thread_id: str | None = None
    reply_to: str | None = None
    timestamp: float = field(default_factory=time.time)
    user_handle: str | None = None  # e.g. a Telegram @username, for allowlists
    media: bool = False  # it carried something besides text that is not an attachment (a sticker)
    attachments: tuple[Attachment, ...] = ()  # images and files, screened by the router
    tenant: str | None = None  # who it belongs to, where the platform knows (an API key's name)
    # Platform-specific bits an adapter wants back when replying (never persisted).
    extra: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def chat(self) -> ChatRef:
        return ChatRef(self.platform, self.chat_id, self.chat_type, self.thread_id)

    @property
    def reply_target(self) -> str | None:
        """The message an answer to this one quotes: itself, or for a resume (an id no platform
        knows) the user's message whose cut-off answer it continues."""
        return self.reply_to if self.message_id.startswith(RESUME_PREFIX) else self.message_id

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form for stores and forwarding (without `extra`, which stays local)."""
        out: dict[str, object] = {
            "platform": self.platform, "chat_id": self.chat_id, "chat_type": self.chat_type.value,
            "user_id": self.user_id, "user_name": self.user_name, "message_id": self.message_id,
            "text": self.text, "thread_id": self.thread_id, "reply_to": self.reply_to,
            "timestamp": self.timestamp, "user_handle": self.user_handle, "media": self.media,
            "tenant": self.tenant}
        if self.attachments:  # absent when there are none: older records and peers read the same
            out["attachments"] = [a.to_dict() for a in self.attachments]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InboundMessage:
        return cls(platform=d["platform"], chat_id=d["chat_id"], chat_type=ChatType(d["chat_type"]),
                   user_id=d["user_id"], user_name=d["user_name"], message_id=d["message_id"], text=d["text"],
                   thread_id=d.get("thread_id"), reply_to=d.get("reply_to"),
                   timestamp=d.get("timestamp", time.time()), user_handle=d.get("user_handle"),
                   media=bool(d.get("media", False)), tenant=d.get("tenant"),
                   attachments=tuple(Attachment.from_dict(a) for a in d.get("attachments") or ()
                                     if isinstance(a, dict)))


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a platform's outbound side can do; the reply streamer adapts to it."""

    max_message_len: int
    can_edit: bool
    can_stream: bool
    edit_interval_s: float = 1.0
    length_unit: Literal["chars", "utf16"] = "chars"  # Telegram counts UTF-16 code units


def session_key(msg: InboundMessage, *, per_user_in_groups: bool = False) -> str:
    """`platform:chat_type:chat_id[:thread_id][:user_id]`.

    DMs get one session per chat; groups and channels share one per chat and thread unless
    ``per_user_in_groups`` splits them by user. Threads/topics are always separate sessions.
    """
    parts = [msg.platform, msg.chat_type.value, msg.chat_id]
    if msg.thread_id:
        parts.append(msg.thread_id)
    if per_user_in_groups and msg.chat_type is not ChatType.DM:
        parts.append(msg.user_id)
    return ":".join(parts)
