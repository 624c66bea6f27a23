"""Splitting long replies into platform-sized parts without breaking code blocks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

FENCE = "```"
_CLOSER = "\n" + FENCE
_CLOSE_ENOUGH = 48  # a cut found by the real measure may fall this short of the longest that fits

Measure = Callable[[str], int]


def utf16_len(text: str) -> int:
    """Telegram counts message length in UTF-16 code units."""
    return len(text.encode("utf-16-le")) // 2


@dataclass(frozen=True, slots=True)
class Part:
    """One message's worth: `text` to send, carrying the source characters [start, end)."""

    text: str
    start: int
    end: int


@dataclass
class SplitMemo:
    """Cuts found in a text that only grows (a streaming answer), reused while the text they
    looked at is unchanged, so re-splitting on every edit measures only the new tail."""

    text: str = ""
    limit: int = 0
    cuts: dict[tuple[int, str], int] = field(default_factory=dict)  # (position, reopen) -> cut

    def sync(self, text: str, limit: int) -> None:
        if limit != self.limit or not text.startswith(self.text):
            self.cuts.clear()
            self.limit = limit
        self.text = text


def split_text(text: str, limit: int, measure: Measure = len) -> list[str]:
    """Split at paragraph, then line, then word boundaries into parts of at most `limit`.

    Nothing is dropped. A part that ends inside a ``` block is closed with a fence and the next
    part reopens it (with the same info string), so every part renders on its own. `measure` is
    what the platform counts (UTF-16 units, the visible text after its markup is parsed…).
    """
    return [p.text for p in split_parts(text, limit, measure)]


def split_parts(text: str, limit: int, measure: Measure = len, *, bound: Measure | None = None,
                memo: SplitMemo | None = None) -> list[Part]:
    """`split_text`, with the source span of every part. Blank parts (whitespace between two cuts)
    are left out: no platform shows an empty message. See `iter_parts` for `bound` and `memo`."""
    return list(iter_parts(text, limit, measure, bound=bound, memo=memo))


def iter_parts(text: str, limit: int, measure: Measure = len, *, bound: Measure | None = None,
               memo: SplitMemo | None = None) -> Iterator[Part]:
    """The parts of `split_parts`, each cut made only when it is asked for.

    `bound` is a cheap upper bound of a costly `measure` that counts every character at least
    once (Telegram: the source's UTF-16 length bounds the visible text's): what fits by it is not
    measured, and the real measure is used only to go past it. `memo` carries cuts over between
    calls on a text that only grows."""
    if not text.strip():
        return
    m = _Fits(measure, bound, limit)
    if memo is not None:
        memo.sync(text, limit)
    pos, reopen = 0, ""
    while pos < len(text):
        rest = text[pos:]
        if m.whole(reopen + rest):
            if rest.strip():
                yield Part(reopen + rest, pos, len(text))
            return
        if not m.fits(reopen + "x" + _CLOSER):
            raise ValueError("limit too small to split with code fences")
        end = pos + _cut_from(text, pos, reopen, m, memo)
        body, after, reopen_next = _close(text, pos, end, reopen)
        if text[pos:end].strip():
            yield Part(body, pos, end)
        pos, reopen = after, reopen_next


def _cut_from(text: str, pos: int, reopen: str, m: _Fits, memo: SplitMemo | None) -> int:
    """How much of the text from `pos` the next part takes; a cut the memo holds is reused."""
    cut = memo.cuts.get((pos, reopen)) if memo is not None else None
    if cut is None:
        rest = text[pos:]
        cut, probed = _cut(rest, m, reopen)
        if memo is not None and probed < len(rest):  # it looked only at text that will not change
            memo.cuts[(pos, reopen)] = cut
    return cut


def _close(text: str, pos: int, end: int, reopen: str) -> tuple[str, int, str]:
    """The part carrying [pos, end) as it is sent, where the next part starts, and the fence line
    the next part starts with. A part ending inside a code block closes it and the next reopens
    it (the newlines after the cut are left out: the reopening fence line stands for them); a
    part cut after a line break leaves out the blank lines that follow."""
    chunk = text[pos:end]
    body = reopen + chunk
    info = _open_fence(body)
    if info is not None:
        return body.rstrip("\n") + _CLOSER, _past_newlines(text, end), FENCE + info + "\n"
    return body, _past_newlines(text, end) if chunk.endswith("\n") else end, ""


def _past_newlines(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] == "\n":
        pos += 1
    return pos


def open_fence(text: str) -> str | None:
    """If `text` ends inside a ``` block, the line that reopens it (```info + newline); else None."""
    info = _open_fence(text)
    return None if info is None else FENCE + info + "\n"


class _Fits:
    """Does a text fit in the limit: by the cheap bound if there is one, else by the measure."""

    def __init__(self, measure: Measure, bound: Measure | None, limit: int) -> None:
        self.measure, self.bound, self.limit = measure, bound, limit

    def cheap(self, text: str) -> bool:
        return (self.bound or self.measure)(text) <= self.limit

    def fits(self, text: str) -> bool:
        return self.cheap(text) or (self.bound is not None and self.measure(text) <= self.limit)

    def whole(self, text: str) -> bool:
        """Does all of `text` fit? Beyond twice the limit by the bound it is not measured: such
        a text is split (its parts may come out shorter than the platform would allow)."""
        if self.cheap(text):
            return True
        return self.bound is not None and self.bound(text) <= 2 * self.limit and self.measure(text) <= self.limit


def _cut(text: str, m: _Fits, reopen: str) -> tuple[int, int]:
    """(cut, how far into `text` the measures looked): the longest prefix that fits (after the
    fence line reopening its code block, with room for a closing fence), preferring a
    paragraph, line or space boundary."""

    def fits(k: int) -> bool:
        return m.fits(reopen + text[:k] + _CLOSER)

    # The cheap measure is monotonic (a binary search) and counts every character at least once
    # when it is a bound (so no prefix longer than the limit fits by it).
    lo, hi = 1, len(text) if m.bound is None else min(len(text), m.limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if m.cheap(reopen + text[:mid] + _CLOSER):
            lo = mid
        else:
            hi = mid - 1
    probed = min(len(text), lo + 1)
    if m.bound is not None:  # markup the platform does not count: go past the bound
        lo, probed = _past_bound(text, m, reopen, lo, probed)
    window = text[:lo]
    for sep in ("\n\n", "\n", " "):
        at = window.rfind(sep)
        # A boundary counts if it keeps at least half the room (and, for measures that are not
        # monotonic, such as visible text after markup, if the shorter prefix still fits).
        if at > lo // 2 and fits(at + len(sep)):
            return at + len(sep), probed
    return lo, probed


def _past_bound(text: str, m: _Fits, reopen: str, good: int, probed: int) -> tuple[int, int]:
    """From a prefix that fits by the bound, the longest (within `_CLOSE_ENOUGH`) that fits by the
    real measure: guesses assume the markup density seen so far, so a few measures suffice."""
    seen = m.measure(reopen + text[:good] + _CLOSER)
    bad = len(text) + 1  # the shortest prefix known not to fit
    for _ in range(8):
        if good >= len(text) or bad - good <= _CLOSE_ENOUGH or m.limit - seen <= _CLOSE_ENOUGH:
            break
        guess = good + max(_CLOSE_ENOUGH, int((m.limit - seen) * good / max(seen, 1) * 0.97))
        k = min(len(text), guess if guess < bad else (good + bad) // 2)
        probed = max(probed, k)
        value = m.measure(reopen + text[:k] + _CLOSER)
        if value <= m.limit:
            good, seen = k, value
        else:
            bad = k
    return good, probed


def _open_fence(text: str) -> str | None:
    """If `text` ends inside a ``` block, the info string of that block (maybe ""); else None."""
    info: str | None = None
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith(FENCE):
            info = None if info is not None else stripped[3:].strip()
    return info
