"""Splitting long replies into platform-sized parts without breaking code blocks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

FENCE = "```"
_CLOSER = "\n" + FENCE


def utf16_len(text: str) -> int:
    """Telegram counts message length in UTF-16 code units."""
    return len(text.encode("utf-16-le")) // 2


@dataclass(frozen=True, slots=True)
class Part:
    """One message's worth: `text` to send, carrying the source characters [start, end)."""

    text: str
    start: int
    end: int


def split_text(text: str, limit: int, measure: Callable[[str], int] = len) -> list[str]:
    """Split at paragraph, then line, then word boundaries into parts of at most `limit`.

    Nothing is dropped. A part that ends inside a ``` block is closed with a fence and the next
    part reopens it (with the same info string), so every part renders on its own. `measure` is
    what the platform counts (UTF-16 units, the visible text after its markup is parsed…).
    """
    return [p.text for p in split_parts(text, limit, measure)]


def split_parts(text: str, limit: int, measure: Callable[[str], int] = len) -> list[Part]:
    """`split_text`, with the source span of every part. Blank parts (whitespace between two cuts)
    are left out: no platform shows an empty message."""
    if not text.strip():
        return []
    if measure(text) <= limit:
        return [Part(text, 0, len(text))]
    parts: list[Part] = []
    pos = 0
    reopen = ""
    while pos < len(text):
        rest = text[pos:]
        if measure(reopen + rest) <= limit:
            if rest.strip():
                parts.append(Part(reopen + rest, pos, len(text)))
            break
        if measure(reopen + "x" + _CLOSER) > limit:
            raise ValueError("limit too small to split with code fences")
        cut = _cut(rest, functools.partial(_fits, measure, limit, reopen))
        chunk = rest[:cut]
        body = reopen + chunk
        fence_info = _open_fence(body)
        end = pos + cut
        pos = end
        if fence_info is not None:
            body = body.rstrip("\n") + _CLOSER
            reopen = FENCE + fence_info + "\n"
            while pos < len(text) and text[pos] == "\n":
                pos += 1
        else:
            reopen = ""
            if chunk.endswith("\n"):
                while pos < len(text) and text[pos] == "\n":
                    pos += 1
        if chunk.strip():
            parts.append(Part(body, end - cut, end))
    return parts


def open_fence(text: str) -> str | None:
    """If `text` ends inside a ``` block, the line that reopens it (```info + newline); else None."""
    info = _open_fence(text)
    return None if info is None else FENCE + info + "\n"


def _fits(measure: Callable[[str], int], limit: int, reopen: str, chunk: str) -> bool:
    """Does `chunk`, after the fence line reopening its code block and with room for a closing
    fence, fit in `limit`?"""
    return measure(reopen + chunk + _CLOSER) <= limit


def _cut(text: str, fits: Callable[[str], bool]) -> int:
    """Largest prefix length that fits, preferring a paragraph, line or space boundary."""
    lo, hi = 1, len(text)
    while lo < hi:  # binary search on the measure (UTF-16 aware)
        mid = (lo + hi + 1) // 2
        if fits(text[:mid]):
            lo = mid
        else:
            hi = mid - 1
    window = text[:lo]
    for sep in ("\n\n", "\n", " "):
        at = window.rfind(sep)
        # A boundary counts if it keeps at least half the room (and, for measures that are not
        # monotonic, such as visible text after markup, if the shorter prefix still fits).
        if at > lo // 2 and fits(text[:at + len(sep)]):
            return at + len(sep)
    return lo


def _open_fence(text: str) -> str | None:
    """If `text` ends inside a ``` block, the info string of that block (maybe ""); else None."""
    info: str | None = None
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith(FENCE):
            info = None if info is not None else stripped[3:].strip()
    return info
