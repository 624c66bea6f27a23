"""Any OpenAI-compatible Chat Completions endpoint, streamed, with a bounded tool-calling loop.

The provider connection is registered with the run: a hard_cancel closes the socket at once, so
the provider stops generating instead of finishing an answer nobody will read. What is sent fits
the context budget (gateway.core.context); several tool calls of one round run side by side;
messages the user sends meanwhile (busy "steer") join the turn at the next model/tool boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from gateway.agents.jobs import call_note
from gateway.agents.tools import ToolRegistry
from gateway.core import jsonfast
from gateway.core.cancellation import get_run
from gateway.core.context import encode, estimate, fit
from gateway.core.logs import redactor
from gateway.core.ports import AgentError, TurnContext
from gateway.core.transcript import (
    AgentEvent,
    ChatMessage,
    Interjection,
    TextDelta,
    ToolCall,
    ToolCallsRequested,
    ToolResult,
    Usage,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str) -> str:
    """Model output as storable text: a lone surrogate (valid JSON escape, invalid UTF-8) becomes U+FFFD."""
    return value if value.isascii() else _LONE_SURROGATE.sub("\ufffd", value)


@dataclass(frozen=True, slots=True)
class OpenAISettings:
    base_url: str
    model: str
    api_key: str | None = None
    system_prompt: str | None = None
    max_tool_rounds: int = 8
    retries: int = 3
    backoff_s: float = 0.5
    read_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    context_tokens: int = 32_000  # the model's window
    reply_tokens: int = 4_000  # kept free in it for the answer
    include_usage: bool = True  # ask for token counts (stream_options.include_usage)
    parallel_tools: bool = True
    max_parallel_tools: int = 4


class ContextTooLong(AgentError):
    """The provider refused the request for its length."""


SKIPPED = "[not run: the user sent a new message before this call started]"
_TOO_LONG = ("context_length_exceeded", "maximum context length", "context length", "too many tokens",
             "prompt is too long", "reduce the length")


class _Round:
    """What one streamed completion produced."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}

    def add_tool_delta(self, delta: dict[str, Any]) -> None:
        slot = self.calls.setdefault(int(delta.get("index", len(self.calls))),
                                     {"id": "", "name": "", "arguments": ""})
        if delta.get("id"):
            slot["id"] = _text(str(delta["id"]))
        fn = delta.get("function") or {}
        if fn.get("name"):
            slot["name"] += _text(str(fn["name"]))
        if fn.get("arguments"):
            slot["arguments"] += _text(str(fn["arguments"]))

    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(c["id"] or f"call_{i}", c["name"], c["arguments"] or "{}")
                     for i, c in sorted(self.calls.items()))


class OpenAIAgent:
    def __init__(self, settings: OpenAISettings, tools: ToolRegistry) -> None:
        self.settings = settings
        self.tools = tools
        self._session: aiohttp.ClientSession | None = None
        self._head: tuple[tuple[object, ...], bytes] | None = None  # (the tools, the body up to "messages")
        self._url = URL(settings.base_url.rstrip("/") + "/chat/completions")  # parsed once, not per request

    @property
    def description(self) -> str:
        return f"openai:{self.settings.model}"

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            s = self.settings
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s,
                                              sock_read=s.read_timeout_s),
                connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def run_turn(self, history: Sequence[ChatMessage], message: ChatMessage,
                       context: TurnContext | None = None) -> AsyncIterator[AgentEvent]:
        s = self.settings
        budget = s.context_tokens - s.reply_tokens
        ratio = context.token_ratio if context is not None else 1.0
        memo = context.history_memo if context is not None else None
        system = [_dumps({"role": "system", "content": s.system_prompt})] if s.system_prompt else []
        turn: list[dict[str, Any]] = [message.to_openai()]  # this turn's messages so far
        for _round in range(s.max_tool_rounds + 1):
            rnd = _Round()
            for attempt in range(2):  # once more with a smaller budget if the provider says too long
                extra = sum(estimate(json.dumps(m, ensure_ascii=False)) for m in turn[1:])  # this turn's rounds
                fitted = fit(history, message, budget_tokens=budget - extra, system_prompt=s.system_prompt,
                             ratio=ratio, memo=memo)
                rows = fitted.encoded if fitted.encoded is not None else b",".join(map(encode, fitted.messages))
                messages = b"[" + b",".join([*system, *([rows] if rows else []), *map(_dumps, turn)]) + b"]"
                try:
                    async with contextlib.aclosing(self._complete(messages, rnd,
                                                                  fitted.estimated_tokens + extra)) as events:
                        async for event in events:
                            yield event
                    break
                except ContextTooLong as exc:
                    if attempt or rnd.text:
                        raise
                    budget = _smaller_budget(str(exc), fitted.estimated_tokens + extra)
                    log.warning("the provider said the context is too long; retrying with %d tokens", budget)
            calls = rnd.tool_calls()
            text = "".join(rnd.text)
            joined = context.take_interjection() if context is not None else None
            if not calls:
                if joined is None:
                    return
                turn += [{"role": "assistant", "content": text}, {"role": "user", "content": joined}]
                yield Interjection(joined)  # the answer so far stands; the model continues from it
                continue
            yield ToolCallsRequested(text, calls)
            turn.append(ChatMessage("assistant", text, tool_calls=calls).to_openai())
            steered = [joined] if joined is not None else []  # arrived before the calls: none of them runs
            results: dict[str, str] = {}
            async with contextlib.aclosing(self._run_calls(calls, context, steered)) as outcomes:
                async for call, result in outcomes:
                    results[call.id] = result
                    yield ToolResult(call.id, result)
            turn += [{"role": "tool", "tool_call_id": call.id, "content": results[call.id]} for call in calls]
            if context is not None and (late := context.take_interjection()) is not None:
                steered.append(late)
            if steered:
                joined = "\n\n".join(steered)
                turn.append({"role": "user", "content": joined})
                yield Interjection(joined)
        yield TextDelta(f"\n[stopped after {s.max_tool_rounds} tool rounds]")

    async def _run_calls(self, calls: tuple[ToolCall, ...], context: TurnContext | None,
                         steered: list[str]) -> AsyncGenerator[tuple[ToolCall, str], None]:
        """Run a round's calls, side by side up to the cap, yielding each result as it comes. Once
        the user has added a message (collected into `steered`), calls not started yet are skipped:
        the model sees why and answers what the user said instead."""
        s = self.settings
        gate = asyncio.Semaphore(s.max_parallel_tools if s.parallel_tools else 1)
        done: asyncio.Queue[tuple[ToolCall, str]] = asyncio.Queue()

        async def run(call: ToolCall) -> None:
            if context is not None:  # this task's own copy: what became of this call if the turn stops
                call_note.set(functools.partial(context.note_result, call.id))
            async with gate:
                if not steered and context is not None and (added := context.take_interjection()) is not None:
                    steered.append(added)
                result = SKIPPED if steered else await self.tools.call(call.name, call.arguments)
            done.put_nowait((call, result))

        tasks = [asyncio.ensure_future(run(call)) for call in calls]  # each in the run's context
        try:
            for _ in calls:
                yield await done.get()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _body_head(self) -> bytes:
        """The request body up to its messages: model, stream options and tool schemas, encoded
        once (again only if the tools change)."""
        s = self.settings
        registered = tuple(self.tools.available().values())  # asked every round: MCP servers come and go
        if self._head is None or self._head[0] != registered:
            head: dict[str, Any] = {"model": s.model, "stream": True}
            if s.include_usage:
                head["stream_options"] = {"include_usage": True}
            tools = b',"tools":' + _dumps([t.schema() for t in registered]) if registered else b""
            self._head = (registered, _dumps(head)[:-1] + tools + b',"messages":')
        return self._head[1]

    async def _complete(self, messages: bytes, rnd: _Round,
                        estimated: int) -> AsyncGenerator[TextDelta | Usage, None]:
        """One streamed completion; `messages` is the JSON array to send."""
        s = self.settings
        body = self._body_head() + messages + b"}"
        headers = {"Content-Type": "application/json"}
        if s.api_key:
            headers["Authorization"] = f"Bearer {s.api_key}"
        for attempt in range(s.retries + 1):
            try:
                resp = await self._http().post(self._url, data=body, headers=headers)
            except aiohttp.ClientError as exc:
                if attempt < s.retries:
                    await asyncio.sleep(s.backoff_s * 2 ** attempt)
                    continue
                raise AgentError(f"the model provider is unreachable ({type(exc).__name__})") from exc
            if resp.status in RETRY_STATUSES and attempt < s.retries:
                delay = _retry_after(resp) or s.backoff_s * 2 ** attempt
                resp.close()
                log.warning("provider answered HTTP %d; retrying in %.1f s", resp.status, delay)
                await asyncio.sleep(delay)
                continue
            break
        run = get_run()
        async with resp:
            with run.on_cancel(resp.close) if run else contextlib.nullcontext():
                if resp.status != 200:
                    detail = (await resp.text())[:300]
                    text = f"the model provider failed: HTTP {resp.status} {_error_text(detail)}"
                    if resp.status in (400, 413) and any(hint in detail.lower() for hint in _TOO_LONG):
                        raise ContextTooLong(text)
                    raise AgentError(text)
                if resp.content_type == "application/json":  # a provider that ignores stream=true
                    payload = _json(await resp.text())
                    async for ev in _from_message(payload, rnd):
                        yield ev
                    return
                batches = _sse_batches(resp.content)
                try:
                    async for events in batches:
                        words: list[str] = []  # the batch's words: one delta, not one per event
                        for data in events:
                            if data == b"[DONE]":
                                if words:
                                    yield TextDelta("".join(words))
                                return
                            chunk = _json(data.decode("utf-8", "replace"))
                            if "error" in chunk:
                                raise AgentError(f"the model provider failed: {_error_text(json.dumps(chunk))}")
                            if isinstance(usage := chunk.get("usage"), dict):
                                if words:
                                    yield TextDelta("".join(words))
                                    words = []
                                yield Usage(int(usage.get("prompt_tokens") or 0),
                                            int(usage.get("completion_tokens") or 0), estimated)
                            for choice in chunk.get("choices") or []:
                                delta = choice.get("delta") or {}
                                for tc in delta.get("tool_calls") or []:
                                    rnd.add_tool_delta(tc)
                                if content := delta.get("content"):
                                    content = _text(str(content))
                                    rnd.text.append(content)
                                    words.append(content)
                        if words:
                            yield TextDelta("".join(words))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise AgentError(f"the model provider connection broke ({type(exc).__name__})") from exc
                finally:
                    await batches.aclose()  # left at [DONE], before its end: closed here, not by the GC


async def _sse_batches(content: aiohttp.StreamReader) -> AsyncGenerator[list[bytes], None]:
    """The `data:` payloads of a server-sent event stream, in batches: every complete line that has
    arrived when the reader wakes, so a burst of events costs one wake-up, not one per line."""
    partial: list[bytes] = []  # a line not yet ended, in pieces (joined once, however long it grows)
    while chunk := await content.readany():
        if b"\n" not in chunk:
            partial.append(chunk)
            continue
        lines = b"".join([*partial, chunk]).split(b"\n") if partial else chunk.split(b"\n")
        partial = [lines.pop()]
        events = [line[5:].strip() for line in map(bytes.strip, lines) if line.startswith(b"data:")]
        if events:
            yield events
    if (rest := b"".join(partial).strip()).startswith(b"data:"):  # the stream ended without a final newline
        yield [rest[5:].strip()]


async def _from_message(payload: dict[str, Any], rnd: _Round) -> AsyncIterator[TextDelta]:
    try:
        msg = payload["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise AgentError("the model provider returned an unexpected response") from exc
    for i, tc in enumerate(msg.get("tool_calls") or []):
        rnd.add_tool_delta({"index": i, **tc})
    if content := msg.get("content"):
        content = _text(str(content))
        rnd.text.append(content)
        yield TextDelta(content)


_dumps = jsonfast.dumps


def _json(text: str) -> dict[str, Any]:
    try:
        value = jsonfast.loads(text)
    except ValueError as exc:
        raise AgentError("the model provider returned malformed data") from exc
    if not isinstance(value, dict):
        raise AgentError("the model provider returned malformed data")
    return value


def _error_text(detail: str) -> str:
    """The provider's own words, short — with any secret it echoed (e.g. our key) masked."""
    try:
        err = json.loads(detail).get("error")
        if isinstance(err, dict) and err.get("message"):
            return redactor(str(err["message"]))[:200]
    except (ValueError, AttributeError):
        pass
    return redactor(detail)[:200]


def _smaller_budget(error: str, estimated: int) -> int:
    """A budget the provider should accept after refusing `estimated` (our count) as too long: from
    the numbers in its error when it gives them ("maximum context length is X … resulted in Y
    tokens"), else half."""
    limit = re.search(r"(?:maximum context length|context window) (?:is|of) (\d+)", error)
    counted = re.search(r"(\d+) tokens(?!.*\d+ tokens)", error)
    if limit and counted and int(counted.group(1)) > 0:
        ratio = int(counted.group(1)) / max(1, estimated)
        return max(256, int(int(limit.group(1)) / ratio * 0.85))
    return max(256, estimated // 2)


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    try:
        return min(float(resp.headers.get("Retry-After", "")), 30.0)
    except ValueError:
        return None
