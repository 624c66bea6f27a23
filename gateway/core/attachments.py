"""Images and files that came with a message: what an adapter reports, which are taken, and what the
model is given. The bytes are fetched later, in the turn (`MediaLoader`); nothing here does I/O.

An attachment is refused with a reason (type not allowed, too large, vision off), never dropped:
the user is told in one sentence and the model sees a short note in its place.
"""

from __future__ import annotations

import base64
import dataclasses
import mimetypes
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

AttachmentKind = Literal["image", "file"]
PartKind = Literal["image", "text", "note"]
MB = 1024 * 1024
MAX_NAME = 120
_UNSAFE_NAME = re.compile(r"[\x00-\x1f\x7f\[\]]")  # a name must not break out of its placeholder
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
# Text the model can read inline: any text/*, and the common structured-text types.
FILE_TYPES = ("text/*", "application/json", "application/xml", "application/x-yaml", "application/yaml",
              "application/toml", "application/x-sh", "application/javascript", "application/sql",
              "application/x-python", "application/csv")


@dataclass(frozen=True, slots=True)
class Attachment:
    """One image or file as the platform described it, and how to fetch it again (`ref`: a platform
    file id, a URL, or `sha256:<hex>` for bytes that came inline). Persisted with the message, so
    a replay after a restart can fetch it again; `data` (inline bytes) never is."""

    kind: AttachmentKind
    name: str
    mime: str
    size: int | None  # bytes, as declared (None: known once downloaded)
    ref: str
    refused: str | None = None  # why it is not passed to the model
    data: bytes | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "mime": self.mime, "size": self.size, "ref": self.ref,
                "refused": self.refused}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Attachment:
        kind: AttachmentKind = "image" if d.get("kind") == "image" else "file"
        size = d.get("size")
        return cls(kind, str(d.get("name") or "file"), str(d.get("mime") or "application/octet-stream"),
                   int(size) if isinstance(size, int) else None, str(d.get("ref") or ""), d.get("refused"))

    def placeholder(self) -> str:
        """What the transcript keeps instead of the bytes: `[image: photo.jpg, 120 KB]`."""
        size = f", {human_size(self.size)}" if self.size is not None else ""
        if self.refused:
            return f"[{self.kind} not read: {self.name}{size} — {self.refused}]"
        return f"[{self.kind}: {self.name}{size}]"


@dataclass(frozen=True, slots=True)
class MediaPart:
    """An attachment as the model gets it: image bytes, a text file's text, or a note saying why not."""

    kind: PartKind
    attachment: Attachment
    data: bytes = b""  # kind "image": the bytes; `mime` says their type
    mime: str = ""
    text: str = ""  # kind "text": the file's text (already cut to the budget); "note": the note
    tokens: int = 0  # kind "image": its fixed cost in the context budget (0: the default)
    problem: str = ""  # kind "note": why it could not be read, for the user

    def to_openai(self) -> dict[str, Any]:
        """An OpenAI-compatible content part."""
        if self.kind == "image":
            url = f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"
            return {"type": "image_url", "image_url": {"url": url}}
        return {"type": "text", "text": self.text}


@dataclass
class MediaSettings:
    """The `[media]` section of the config."""

    enabled: bool = True
    max_image_bytes: int = 10 * MB
    max_file_bytes: int = 1 * MB
    max_message_bytes: int = 20 * MB  # all attachments of one message together
    max_per_message: int = 10
    image_types: list[str] = field(default_factory=lambda: list(IMAGE_TYPES))
    file_types: list[str] = field(default_factory=lambda: list(FILE_TYPES))
    download_timeout_s: float = 30.0
    inline_chars: int = 20_000  # of a text file, at most this much is given to the model
    image_tokens: int = 800  # what an image counts for in the context budget
    retention_hours: float = 72.0  # stored copies older than this are deleted (0: kept)


def mime_of(declared: str | None, name: str) -> str:
    """The declared type without parameters, else one guessed from the name (`notes.md` is text)."""
    mime = (declared or "").split(";")[0].strip().lower()
    if mime and mime != "application/octet-stream":
        return mime
    guessed = mimetypes.guess_type(name, strict=False)[0]
    if guessed is None and name.lower().endswith((".md", ".log", ".toml", ".yaml", ".yml", ".ini", ".cfg")):
        guessed = "text/plain"
    return guessed or "application/octet-stream"


def human_size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < MB:
        return f"{n / 1024:.0f} KB"
    return f"{n // MB} MB" if n % MB == 0 else f"{n / MB:.1f} MB"


def _allowed(mime: str, patterns: Sequence[str]) -> bool:
    mime = mime.lower().split(";")[0].strip()
    return any(mime == p or (p.endswith("/*") and mime.startswith(p[:-1])) for p in patterns)


def screen(attachments: Sequence[Attachment], settings: MediaSettings, *, vision: bool) -> tuple[Attachment, ...]:
    """Mark every attachment that will not be passed on with the reason why. Pure, and idempotent
    (a forwarded or replayed message is screened again with the same result)."""
    out: list[Attachment] = []
    total = 0
    for i, att in enumerate(attachments):
        name = _UNSAFE_NAME.sub("_", att.name)[:MAX_NAME] or "file"
        if name != att.name:
            att = dataclasses.replace(att, name=name)
        reason = att.refused or _refusal(att, settings, vision=vision)
        if reason is None and i >= settings.max_per_message:
            reason = f"only {settings.max_per_message} attachments are read per message"
        if reason is None and att.size is not None:
            if total + att.size > settings.max_message_bytes:
                reason = f"the attachments of one message may add up to {human_size(settings.max_message_bytes)}"
            else:
                total += att.size
        out.append(att if reason == att.refused else dataclasses.replace(att, refused=reason))
    return tuple(out)


def _refusal(att: Attachment, settings: MediaSettings, *, vision: bool) -> str | None:
    if not settings.enabled:
        return "images and files are turned off here"
    if att.kind == "image":
        if not vision:
            return "this model cannot see images"
        if not _allowed(att.mime, settings.image_types):
            return f"{att.mime or 'this'} images are not supported"
        limit = settings.max_image_bytes
    else:
        if not _allowed(att.mime, settings.file_types):
            return f"{att.mime or 'this'} files are not supported (text files only)"
        limit = settings.max_file_bytes
    if att.size is not None and att.size > limit:
        return f"over the {human_size(limit)} limit"
    return None


def limit_for(att: Attachment, settings: MediaSettings) -> int:
    return settings.max_image_bytes if att.kind == "image" else settings.max_file_bytes


def refusal_sentence(attachments: Sequence[Attachment]) -> str | None:
    """One sentence for the user about the refused attachments, or None if none was."""
    refused = [a for a in attachments if a.refused]
    if not refused:
        return None
    if len(refused) == 1:
        a = refused[0]
        return f"I could not read {a.name}: {a.refused}."
    return "I could not read " + "; ".join(f"{a.name} ({a.refused})" for a in refused) + "."


def with_placeholders(text: str, attachments: Sequence[Attachment]) -> str:
    """The user's text as the transcript keeps it: the caption, then a placeholder per attachment."""
    if not attachments:
        return text
    marks = "\n".join(a.placeholder() for a in attachments)
    return f"{text}\n{marks}" if text.strip() else marks


def note(att: Attachment, why: str) -> MediaPart:
    return MediaPart("note", att, text=f"[{att.kind} not read: {att.name} — {why}]", problem=why)
