"""Splitting long replies into platform-sized parts without breaking code blocks."""

from __future__ import annotations

from collections.abc import Callable

FENCE = "```"


def utf16_len(text: str) -> int:
    """Telegram counts message length in UTF-16 code units."""
    return len(text.encode("utf-16-le")) // 2


def split_text(text: str, limit: int, measure: Callable[[str], int] = len) -> list[str]:
    """Split at paragraph, then line, then word boundaries into parts of at most `limit`.

    Nothing is dropped. A part that ends inside a ``` block is closed with a fence and the next
    part reopens it (with the same info string), so every part renders on its own.
    """
    if measure(text) <= limit:
        return [text] if text else []
    parts: list[str] = []
    rest = text
    reopen = ""
    while rest:
        budget = limit - measure(reopen) - measure("\n" + FENCE)
        if budget <= 0:
            raise ValueError("limit too small to split with code fences")
        if measure(reopen + rest) <= limit:
            parts.append(reopen + rest)
            break
        cut = _cut(rest, budget, measure)
        chunk, rest = rest[:cut], rest[cut:]
        body = reopen + chunk
        fence_info = _open_fence(body)
        if fence_info is not None:
            body = body.rstrip("\n") + "\n" + FENCE
            reopen = FENCE + fence_info + "\n"
            rest = rest.lstrip("\n")
        else:
            reopen = ""
            rest = rest.lstrip("\n") if chunk.endswith("\n") else rest
        parts.append(body)
    return parts


def _cut(text: str, budget: int, measure: Callable[[str], int]) -> int:
    """Largest prefix length within `budget`, preferring a paragraph, line or space boundary."""
    lo, hi = 1, len(text)
    while lo < hi:  # binary search on the measure (UTF-16 aware)
        mid = (lo + hi + 1) // 2
        if measure(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    window = text[:lo]
    for sep in ("\n\n", "\n", " "):
        at = window.rfind(sep)
        if at > lo // 2:
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
