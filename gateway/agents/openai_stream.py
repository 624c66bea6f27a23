"""Reading a Chat Completions answer: the server-sent event stream in batches, each chunk into agent
events, and the round's tool calls assembled from their pieces.

Everything here is about what the provider sent back; what is asked, and when to ask again, is
`gateway.agents.openai`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

import aiohttp

from gateway.core import jsonfast
from gateway.core.cancellation import checkpoint, get_run
from gateway.core.logs import redactor
from gateway.core.ports import AgentError
from gateway.core.transcript import TextDelta, ToolCall, Usage

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
DONE = b"[DONE]"


def text_of(value: str) -> str:
    """Model output as storable text: a lone surrogate (valid JSON escape, invalid UTF-8) becomes U+FFFD."""
    return value if value.isascii() else _LONE_SURROGATE.sub("\ufffd", value)


class Round:
    """What one completion produced: its text, and its tool calls as their pieces arrive (a call's
    id, name and arguments come in deltas keyed by the call's index)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}

    def add_text(self, content: object) -> str:
        text = text_of(str(content))
        self.text.append(text)
        return text

    def add_tool_delta(self, delta: dict[str, Any]) -> None:
        slot = self.calls.setdefault(int(delta.get("index", len(self.calls))),
                                     {"id": "", "name": "", "arguments": ""})
        if delta.get("id"):
            slot["id"] = text_of(str(delta["id"]))
        fn = delta.get("function") or {}
        if fn.get("name"):
            slot["name"] += text_of(str(fn["name"]))
        if fn.get("arguments"):
            slot["arguments"] += text_of(str(fn["arguments"]))

    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(c["id"] or f"call_{i}", c["name"], c["arguments"] or "{}")
                     for i, c in sorted(self.calls.items()))


async def read_stream(content: aiohttp.StreamReader, rnd: Round, estimated: int,
                      pace: Pace | None = None) -> AsyncGenerator[TextDelta | Usage, None]:
    """The events of a streamed completion, until `[DONE]` or the end of the stream. A broken
    connection is an AgentError. `pace`: see `sse_batches`."""
    decoder = StreamDecoder(rnd, estimated)
    batches = sse_batches(content, pace)
    try:
        async for payloads in batches:
            for event in decoder.batch(payloads):
                yield event
            if decoder.done:
                return
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise AgentError(f"the model provider connection broke ({type(exc).__name__})") from exc
    finally:
        await batches.aclose()  # left at [DONE], before its end: closed here, not by the GC


class StreamDecoder:
    """Chunks of a streamed completion into events: the text of a batch as one delta (not one per
    chunk), token counts as they come; text and tool calls also collected into the round."""

    def __init__(self, rnd: Round, estimated: int) -> None:
        self.rnd = rnd
        self.estimated = estimated  # our own count of the prompt, reported beside the provider's
        self.done = False  # `[DONE]` seen: nothing after it counts

    def batch(self, payloads: list[bytes]) -> Iterator[TextDelta | Usage]:
        """The events of one batch, in order. The batch's words are held until its end, a
        `[DONE]`, or token counts (which come after the words they count)."""
        words: list[str] = []
        for data in payloads:
            if data == DONE:
                self.done = True
                break
            chunk = parse_json(data.decode("utf-8", "replace"))
            if "error" in chunk:
                raise AgentError(f"the model provider failed: {error_text(json.dumps(chunk))}")
            if isinstance(usage := chunk.get("usage"), dict):
                if words:
                    yield TextDelta("".join(words))
                    words = []
                yield Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                            self.estimated)
            words += self._choices(chunk)
        if words:
            yield TextDelta("".join(words))

    def _choices(self, chunk: dict[str, Any]) -> list[str]:
        """A chunk's tool-call pieces go to the round; its words are returned (and kept in the round)."""
        words = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for tc in delta.get("tool_calls") or []:
                self.rnd.add_tool_delta(tc)
            if content := delta.get("content"):
                words.append(self.rnd.add_text(content))
        return words


async def sse_batches(content: aiohttp.StreamReader, pace: Pace | None = None) -> AsyncGenerator[list[bytes], None]:
    """The `data:` payloads of a server-sent event stream, in batches: every complete line that has
    arrived when the reader wakes, so a burst of events costs one wake-up, not one per line.

    With a `pace` (the least time between two states the reader's chat can show), the next read
    waits until that long after the last batch was taken, or until the stream ends: what arrives
    meanwhile is read and parsed as one batch. A provider's deltas then cost a wake-up per state
    shown rather than one each, and the answer's end is never held back."""
    partial: list[bytes] = []  # a line not yet ended, in pieces (joined once, however long it grows)
    pause = _Pause(content, pace) if pace is not None and pace() > 0 else None  # (0: a client streaming it)
    while True:
        if pause is not None:
            await pause.wait()
        chunk = await content.readany()
        if not chunk:
            break
        if b"\n" not in chunk:
            partial.append(chunk)
            continue
        lines = b"".join([*partial, chunk]).split(b"\n") if partial else chunk.split(b"\n")
        partial = [lines.pop()]
        events = [line[5:].strip() for line in map(bytes.strip, lines) if line.startswith(b"data:")]
        if events:
            yield events
            if pause is not None:
                pause.taken()
    if (rest := b"".join(partial).strip()).startswith(b"data:"):  # the stream ended without a final newline
        yield [rest[5:].strip()]


Pace = Callable[[], float]  # seconds between two states the chat can show, asked as it streams (0: each delta)


class _Pause:
    """The wait between two reads of a paced stream: the rest of the pace since the last batch was
    taken, cut short when the stream ends (so the answer's end and its tool calls are not held) or
    the run is cancelled (which then reads nothing more, whatever became of the cancel itself)."""

    __slots__ = ("_ended", "_pace", "_until", "_waiter")

    def __init__(self, content: aiohttp.StreamReader, pace: Pace) -> None:
        self._pace = pace
        self._until = 0.0
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None
        content.on_eof(self._on_eof)

    def taken(self) -> None:
        self._until = asyncio.get_running_loop().time() + self._pace()

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self._until - loop.time()
        if delay <= 0 or self._ended:
            checkpoint()
            return
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(delay, _wake, waiter)
        run = get_run()
        try:
            with run.on_cancel(functools.partial(_wake, waiter)) if run is not None else contextlib.nullcontext():
                await waiter
        finally:
            timer.cancel()
            self._waiter = None
        checkpoint()  # a run cancelled meanwhile takes no new read

    def _on_eof(self) -> None:
        self._ended = True
        if self._waiter is not None:
            _wake(self._waiter)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def from_message(payload: dict[str, Any], rnd: Round) -> Iterator[TextDelta]:
    """A whole (unstreamed) answer, from a provider that ignores `stream: true`."""
    try:
        msg = payload["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise AgentError("the model provider returned an unexpected response") from exc
    for i, tc in enumerate(msg.get("tool_calls") or []):
        rnd.add_tool_delta({"index": i, **tc})
    if content := msg.get("content"):
        yield TextDelta(rnd.add_text(content))


def parse_json(text: str) -> dict[str, Any]:
    try:
        value = jsonfast.loads(text)
    except ValueError as exc:
        raise AgentError("the model provider returned malformed data") from exc
    if not isinstance(value, dict):
        raise AgentError("the model provider returned malformed data")
    return value


def error_text(detail: str) -> str:
    """The provider's own words, short — with any secret it echoed (e.g. our key) masked."""
    try:
        err = json.loads(detail).get("error")
        if isinstance(err, dict) and err.get("message"):
            return redactor(str(err["message"]))[:200]
    except (ValueError, AttributeError):
        pass
    return redactor(detail)[:200]
