"""The context budget: which part of a conversation is sent to the model, within its window.

The system prompt, the new message and the most recent turns always go; older tool outputs are
shortened first, then the oldest turns are left out — whole turns only, so a tool call never loses
its result and an interruption marker never loses the turn it closes. The transcript itself keeps
everything. Token counts are estimated locally (no tokenizer download) and corrected per session
from what the provider reports it counted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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


def fit(history: Sequence[ChatMessage], message: ChatMessage, *, budget_tokens: int, system_prompt: str | None = None,
        ratio: float = 1.0) -> Fitted:
    """The newest turns of `history` that fit `budget_tokens` beside the system prompt and
    `message`. `ratio` corrects the local estimate (provider's count / ours, per session).

    Works from the newest turn backwards and stops at the first that does not fit, so its cost
    grows with what is sent, not with how long the conversation is."""
    def tokens(m: ChatMessage) -> int:
        return int(message_tokens(m) * ratio) + 1

    fixed = tokens(message) + (int((estimate(system_prompt) + MESSAGE_OVERHEAD) * ratio) if system_prompt else 0)
    room = budget_tokens - fixed
    kept: list[list[ChatMessage]] = []
    used = shortened = 0
    start = len(history)  # history[start:] is kept
    for begin, turn in _turns_backwards(history):
        cost = sum(tokens(m) for m in turn)
        if used + cost > room and kept:  # the newest turn is always sent whole
            short = [_shorten(m) for m in turn]
            cost = sum(tokens(m) for m in short)
            if used + cost > room:
                break
            shortened += sum(1 for a, b in zip(turn, short, strict=True) if a is not b)
            turn = short
        kept.append(turn)
        used += cost
        start = begin
    messages = [m for turn in reversed(kept) for m in turn]
    return Fitted(messages, fixed + used, start, shortened)


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
