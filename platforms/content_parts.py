"""OpenAI-style message content for the HTTP API: a string, or a list of parts — `text`, `image_url`
with a `data:` URL, `file` with `file_data` — turned into text and attachments.

Only inline `data:` URLs are accepted: the gateway never fetches a URL a client names (it would be
a way to make the daemon reach into its own network). A part that cannot be read is a client error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal

from gateway.core.attachments import Attachment, mime_of

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.ASCII)
_EXT = {"image/jpeg": "jpg", "image/png": "png", "image/gif": "gif", "image/webp": "webp"}


class BadContent(ValueError):
    """The content cannot be read; the text says why (for a 400)."""


@dataclass(frozen=True, slots=True)
class Content:
    text: str
    attachments: tuple[Attachment, ...]
    earlier_media: int  # image and file parts of a history message (not sent again; counted)


def decode_data_url(url: str, max_bytes: int) -> tuple[str, bytes]:
    """(mime, bytes) of a base64 `data:` URL; BadContent if it is not one or is over `max_bytes`."""
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise BadContent("must be a base64 data: URL (data:<type>;base64,...)")
    payload = url[m.end():]
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:  # refuse before decoding what is far too big
        raise BadContent(f"is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadContent("is not valid base64") from None
    if not data:
        raise BadContent("is empty")
    return (m.group("mime") or "application/octet-stream").lower(), data


def parse_content(content: Any, *, latest: bool, max_bytes: int) -> Content:
    """Text and attachments of one message's `content`. Parts of earlier messages (`latest` False)
    are not decoded: they stand as a placeholder in the text."""
    if isinstance(content, str):
        return Content(content, (), 0)
    if not isinstance(content, list) or not content:
        raise BadContent("must be a string or a non-empty array of content parts")
    texts: list[str] = []
    attachments: list[Attachment] = []
    earlier = 0
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        if kind not in ("image_url", "file"):
            raise BadContent(f"part {i} must be a text, image_url or file part")
        if not latest:
            earlier += 1
            texts.append(f"[{'image' if kind == 'image_url' else 'file'} sent earlier]")
            continue
        attachments.append(_attachment(i, kind, part, max_bytes))
    return Content("\n".join(texts) if attachments or earlier else "".join(texts), tuple(attachments), earlier)


def _attachment(i: int, kind: Literal["image_url", "file"], part: dict[str, Any], max_bytes: int) -> Attachment:
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        name = None
    else:
        ref = part.get("file")
        url = ref.get("file_data") if isinstance(ref, dict) else None
        name = ref.get("filename") if isinstance(ref, dict) else None
    if not isinstance(url, str):
        raise BadContent(f"part {i} has no {'image_url.url' if kind == 'image_url' else 'file.file_data'}")
    if not url.startswith("data:"):
        raise BadContent(f"part {i}: only data: URLs are accepted (the gateway does not fetch URLs)")
    try:
        declared, data = decode_data_url(url, max_bytes)
    except BadContent as exc:
        raise BadContent(f"part {i}: the data URL {exc}") from None
    if kind == "image_url":
        if not declared.startswith("image/"):
            raise BadContent(f"part {i}: an image_url must hold an image (got {declared})")
        name = f"image_{i + 1}.{_EXT.get(declared, 'img')}"
    name = name if isinstance(name, str) and name else f"file_{i + 1}"
    mime = mime_of(declared, name)
    digest = hashlib.sha256(data).hexdigest()
    return Attachment("image" if mime.startswith("image/") else "file", name, mime, len(data), f"sha256:{digest}",
                      data=data)
