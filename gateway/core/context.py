"""The context budget: which part of a conversation is sent to the model, within its window.

The system prompt, the new message and the most recent turns always go; older tool outputs are
shortened first, then the oldest turns are left out — whole turns only, so a tool call never loses
its result and an interruption marker never loses the turn it closes. The transcript itself keeps
everything. Token counts are estimated locally (no tokenizer download) and corrected per session
from what the provider reports it counted.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gateway.core import jsonfast
from gateway.core.transcript import ChatMessage

IMAGE_TOKENS = 800  # what one image counts for, whatever its size (providers scale large ones down)
MESSAGE_OVERHEAD = 4  # role, separators: what a chat template adds per message
SHORTENED = "\n[… output shortened to fit the context …]\n"
KEEP_OF_OLD_TOOL_OUTPUT = 400  # characters kept of a shortened tool output (its start and end)


def estimate(text: str) -> int:
    """Tokens, roughly: about four characters a token for English and code, about one and a half
    for other scripts (Cyrillic, CJK...), which tokenizers split finer. O(1) for ASCII text."""
    if text.isascii():
        return len(text) // 4 + 1
    return len(text.encode("utf-8")) // 3 + 1


def message_tokens(m: ChatMessage) -> int:
    n = estimate(m.content) + MESSAGE_OVERHEAD
    for call in m.tool_calls:
        n += estimate(call.arguments) + estimate(call.name) + MESSAGE_OVERHEAD
    for part in m.media:  # an image at a fixed cost, never by the length of its base64
        n += (part.tokens or IMAGE_TOKENS if part.kind == "image" else estimate(part.text)) + MESSAGE_OVERHEAD
    return n


@dataclass(frozen=True, slots=True)
class Fitted:
    messages: list[ChatMessage]  # what to send (history part), oldest first
    estimated_tokens: int  # of everything sent: system prompt, these, and the new message
    left_out: int  # older messages not sent (the first `left_out` of the history)
    shortened: int  # tool outputs sent shortened
    encoded: bytes | None = None  # `messages` as comma-separated JSON objects (from a HistoryMemo)


def fit(history: Sequence[ChatMessage], message: ChatMessage, *, budget_tokens: int, system_prompt: str | None = None,
        ratio: float = 1.0, memo: HistoryMemo | None = None) -> Fitted:
    """The newest turns of `history` that fit `budget_tokens` beside the system prompt and
    `message`. `ratio` corrects the local estimate (provider's count / ours, per session): rows
    cost `int(their estimate * ratio)` plus one token each.

    Works from the newest turn backwards and stops at the first that does not fit, so its cost
    grows with what is sent, not with how long the conversation is. With a `memo` (the session's,
    kept between turns) the same cut comes from running totals, and the rows come encoded."""
    fixed = int(message_tokens(message) * ratio) + 1 + (
        int((estimate(system_prompt) + MESSAGE_OVERHEAD) * ratio) if system_prompt else 0)
    room = budget_tokens - fixed
    if memo is not None:
        return memo.fit(history, fixed, room, ratio)
    kept: list[list[ChatMessage]] = []
    used = count = shortened = 0  # estimate (unscaled) and number of the rows kept
    start = len(history)  # history[start:] is kept
    for begin, turn in _turns_backwards(history):
        cost = sum(message_tokens(m) for m in turn)
        if kept and int((used + cost) * ratio) + count + len(turn) > room:  # the newest turn is always sent whole
            short = [_shorten(m) for m in turn]
            cost = sum(message_tokens(m) for m in short)
            if int((used + cost) * ratio) + count + len(turn) > room:
                break
            shortened += sum(1 for a, b in zip(turn, short, strict=True) if a is not b)
            turn = short
        kept.append(turn)
        used += cost
        count += len(turn)
        start = begin
    messages = [m for turn in reversed(kept) for m in turn]
    return Fitted(messages, fixed + int(used * ratio) + count, start, shortened)


def encode(m: ChatMessage) -> bytes:
    """One message as the provider's JSON (compact UTF-8; a lone surrogate comes as an escape)."""
    return jsonfast.dumps(m.to_openai())


class HistoryMemo:
    """What `fit` derives from a session's history, kept between its turns: per-row estimates as
    running totals (plain and with old tool outputs shortened), where turns start, and the rows
    encoded as JSON, back to back in one buffer, so what is sent is one slice of it. A history
    only grows between turns, so each turn adds its new rows; a history that is not an extension
    of the one seen (a /new, an older snapshot) is read again. Compact: machine integers, no
    object per row (about 60 bytes a row besides its JSON)."""

    __slots__ = ("_changed", "_encoded", "_ends", "_first", "_last", "_media", "_short", "_short_total", "_starts",
                 "_total")

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._first: ChatMessage | None = None  # the history seen: its first and last row...
        self._last: ChatMessage | None = None
        self._total = array("q", [0])  # ...and its length, len(_total) - 1; _total[i]: estimate of rows[:i]
        self._short_total = array("q", [0])  # the same, old tool outputs shortened
        self._changed = array("q", [0])  # rows among rows[:i] that shortening changes
        self._starts = array("q")  # where each turn starts, ascending
        self._encoded = bytearray()  # every row's JSON followed by a comma
        self._ends = array("q", [0])  # _encoded[_ends[i]:_ends[i + 1] - 1] is row i
        self._short: dict[int, tuple[ChatMessage, bytes]] = {}  # rows that shortening changes, shortened
        self._media = array("q")  # rows with images or files: encoded when sent, never kept (base64 is big)

    def _sync(self, history: Sequence[ChatMessage]) -> None:
        n = len(self._total) - 1
        if n and (len(history) < n or history[n - 1] is not self._last or history[0] is not self._first):
            self._clear()
            n = 0
        if len(history) == n:
            return
        total, short_total, changed, ends, encoded = (self._total, self._short_total, self._changed, self._ends,
                                                      self._encoded)
        for i in range(n, len(history)):
            m = history[i]
            tokens = message_tokens(m)
            total.append(total[-1] + tokens)
            short = _shorten(m)
            if short is not m:
                self._short[i] = (short, encode(short))
                tokens = message_tokens(short)
            short_total.append(short_total[-1] + tokens)
            changed.append(changed[-1] + (short is not m))
            if m.media:
                self._media.append(i)
            else:
                encoded += encode(m)
                encoded += b","
            ends.append(len(encoded))
            if m.role == "user" or i == 0:
                self._starts.append(i)
        self._first, self._last = history[0], history[-1]

    def fit(self, history: Sequence[ChatMessage], fixed: int, room: int, ratio: float) -> Fitted:
        self._sync(history)
        total, starts = self._total, self._starts
        n = len(total) - 1
        if not n:
            return Fitted([], fixed, 0, 0, b"")
        # The newest turns that fit whole: the cost of a suffix only grows with its length, so the
        # oldest turn start whose suffix fits is a binary search (the newest turn goes regardless).
        lo, hi = 0, len(starts) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if int((total[n] - total[starts[mid]]) * ratio) + n - starts[mid] > room:
                lo = mid + 1
            else:
                hi = mid
        whole = start = starts[lo]
        used, count = total[n] - total[start], n - start
        older: list[tuple[int, int, bool]] = []
        shortened = 0
        for t in range(lo - 1, -1, -1):  # older turns: shortened, as `fit` without a memo does
            begin, end = starts[t], starts[t + 1]
            cost, short = total[end] - total[begin], False
            if int((used + cost) * ratio) + count + end - begin > room:
                cost, short = self._short_total[end] - self._short_total[begin], True
                if int((used + cost) * ratio) + count + end - begin > room:
                    break
                shortened += self._changed[end] - self._changed[begin]
            used += cost
            count += end - begin
            start = begin
            older.append((begin, end, short))
        messages: list[ChatMessage] = []
        parts: list[bytes | bytearray] = []
        for begin, end, short in reversed(older):
            if not short:
                messages += history[begin:end]
                self._encoded_rows(history, begin, end, parts)
                continue
            for i in range(begin, end):
                if (replaced := self._short.get(i)) is not None:
                    messages.append(replaced[0])
                    parts.append(replaced[1])
                else:
                    messages.append(history[i])
                    self._encoded_rows(history, i, i + 1, parts)
        messages += history[whole:n]
        self._encoded_rows(history, whole, n, parts)
        return Fitted(messages, fixed + int(used * ratio) + count, start, shortened, b",".join(parts))


    def _encoded_rows(self, history: Sequence[ChatMessage], begin: int, end: int,
                      parts: list[bytes | bytearray]) -> None:
        """history[begin:end] as JSON: slices of the buffer, rows with media encoded now."""
        ends, media = self._ends, self._media
        at = begin
        for i in media[bisect_left(media, begin):bisect_left(media, end)]:
            if i > at:
                parts.append(self._encoded[ends[at]:ends[i] - 1])
            parts.append(encode(history[i]))
            at = i + 1
        if end > at:
            parts.append(self._encoded[ends[at]:ends[end] - 1])


def _turns_backwards(history: Sequence[ChatMessage]) -> Iterator[tuple[int, list[ChatMessage]]]:
    """(start index, rows) of whole turns — a user row and what follows it up to the next — newest
    first. Rows before the first user row (a resumed or odd history) count as one turn."""
    end = len(history)
    for i in range(len(history) - 1, -1, -1):
        if history[i].role == "user" or i == 0:
            yield i, list(history[i:end])
            end = i


def _shorten(m: ChatMessage) -> ChatMessage:
    if m.role != "tool" or len(m.content) <= KEEP_OF_OLD_TOOL_OUTPUT + len(SHORTENED):
        return m
    half = KEEP_OF_OLD_TOOL_OUTPUT // 2
    return ChatMessage(m.role, m.content[:half] + SHORTENED + m.content[-half:], m.tool_calls, m.tool_call_id,
                       m.interrupted_by, m.reason, m.created_at)
