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
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from gateway.agents.jobs import call_note
from gateway.agents.openai_stream import Pace, Round, error_text, from_message, parse_json, read_stream
from gateway.agents.tools import ToolRegistry
from gateway.core import jsonfast
from gateway.core.backoff import Backoff
from gateway.core.cancellation import checkpoint, get_run
from gateway.core.context import encode, estimate, fit, message_tokens
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
from gateway.core.turn_options import TurnOptions, TurnReport

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_dumps = jsonfast.dumps


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """A further model a client may name: the provider's name for it, and its provider when not the
    agent's own (`[[agent.models]]`)."""

    name: str
    model: str
    base_url: str | None = None
    api_key: str | None = None


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
    models: tuple[ModelRoute, ...] = ()


class ContextTooLong(AgentError):
    """The provider refused the request for its length."""


SKIPPED = "[not run: the user sent a new message before this call started]"
_TOO_LONG = ("context_length_exceeded", "maximum context length", "context length", "too many tokens",
             "prompt is too long", "reduce the length")


class OpenAIAgent:
    def __init__(self, settings: OpenAISettings, tools: ToolRegistry) -> None:
        self.settings = settings
        self.tools = tools
        self._session: aiohttp.ClientSession | None = None
        self._head: tuple[tuple[object, ...], bytes] | None = None  # (the tools, the body up to "messages")
        # Where each model's requests go: the agent's own (None), and each further one, by the name
        # clients use; URLs parsed once, not per request.
        self._routes: dict[str | None, _Route] = {None: _route(settings.model, settings.base_url, settings.api_key)}
        for m in settings.models:
            key = settings.api_key if m.base_url is None else m.api_key
            self._routes[m.name] = _route(m.model, m.base_url or settings.base_url, key)

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
        turn = _Turn(s, history, message, context)
        for _round in range(s.max_tool_rounds + 1):
            rnd = Round()
            try:
                async with contextlib.aclosing(self._completion(turn, rnd)) as events:
                    async for event in events:
                        yield event
            finally:  # a round cut short used tokens too
                turn.round_done(rnd)
            calls = rnd.tool_calls()
            text = "".join(rnd.text)
            if calls and turn.client_tools:  # the client runs its own tools: the answer ends with the calls
                turn.report.tool_calls = calls
                return
            joined = context.take_interjection() if context is not None else None
            if calls:
                async with contextlib.aclosing(self._tool_round(turn, text, calls, joined)) as steps:
                    async for step in steps:
                        yield step
            elif joined is not None:
                turn.sent += [{"role": "assistant", "content": text}, {"role": "user", "content": joined}]
                yield Interjection(joined)  # the answer so far stands; the model continues from it
            else:
                return
        yield TextDelta(f"\n[stopped after {s.max_tool_rounds} tool rounds]")

    async def _completion(self, turn: _Turn, rnd: Round) -> AsyncGenerator[TextDelta | Usage, None]:
        """One model round; asked once more, with a smaller budget, if the provider refuses the
        request as too long before it has answered anything."""
        for attempt in range(2):
            messages, estimated = turn.request()
            try:
                route = self._routes.get(turn.options.model if turn.options is not None else None) \
                    or self._routes[None]
                body = self._body_head(turn.options, route.model) + messages + b"}"
                async with contextlib.aclosing(self._complete(route, body, rnd, estimated, turn.pace)) as events:
                    async for event in events:
                        if isinstance(event, Usage):
                            turn.counted(event)
                        yield event
                return
            except ContextTooLong as exc:
                if attempt or rnd.text:
                    raise
                turn.shrink(str(exc), estimated)

    async def _tool_round(self, turn: _Turn, text: str, calls: tuple[ToolCall, ...],
                          joined: str | None) -> AsyncGenerator[AgentEvent, None]:
        """The round's tool calls and their results. A message the user added (`joined`: before the
        calls; or while they ran) follows the results, and calls not started by then are skipped."""
        yield ToolCallsRequested(text, calls)
        turn.sent.append(ChatMessage("assistant", text, tool_calls=calls).to_openai())
        steered = [joined] if joined is not None else []  # arrived before the calls: none of them runs
        results: dict[str, str] = {}
        async with contextlib.aclosing(self._run_calls(calls, turn.context, steered)) as outcomes:
            async for call, result in outcomes:
                results[call.id] = result
                yield ToolResult(call.id, result)
        turn.sent += [{"role": "tool", "tool_call_id": call.id, "content": results[call.id]} for call in calls]
        if turn.context is not None and (late := turn.context.take_interjection()) is not None:
            steered.append(late)
        if steered:
            joined = "\n\n".join(steered)
            turn.sent.append({"role": "user", "content": joined})
            yield Interjection(joined)

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

    def _body_head(self, options: TurnOptions | None = None, model: str | None = None) -> bytes:
        """The request body up to its messages: model, stream options and tool schemas, encoded
        once (again only if the tools change) — or, for a client that asked for its own tools,
        parameters or model, made for its request."""
        s = self.settings
        registered = tuple(self.tools.available().values())  # asked every round: MCP servers come and go
        if options is not None and (options.tools is not None or options.params or options.model is not None):
            schemas = list(options.tools) if options.tools is not None else [t.schema() for t in registered]
            return _head(s, options.params, schemas, model or s.model)
        if self._head is None or self._head[0] != registered:
            self._head = (registered, _head(s, {}, [t.schema() for t in registered], s.model))
        return self._head[1]

    async def _complete(self, route: _Route, body: bytes, rnd: Round, estimated: int,
                        pace: Pace | None = None) -> AsyncGenerator[TextDelta | Usage, None]:
        """One streamed completion of the request `body`, from the route's provider, read at the
        `pace` its chat can show."""
        resp = await self._post(route, body)
        run = get_run()
        async with resp:
            with run.on_cancel(functools.partial(hang_up, resp)) if run else contextlib.nullcontext():
                if resp.status != 200:
                    raise await _refusal(resp)
                if resp.content_type == "application/json":  # a provider that ignores stream=true
                    for delta in from_message(parse_json(await resp.text()), rnd):
                        yield delta
                    return
                async with contextlib.aclosing(read_stream(resp.content, rnd, estimated, pace)) as events:
                    async for event in events:
                        yield event

    async def _post(self, route: _Route, body: bytes) -> aiohttp.ClientResponse:
        """The provider's response, once it is not one worth retrying — or the last retry's.
        Retries wait `backoff_s`, doubling (or what the provider's Retry-After says)."""
        s = self.settings
        backoff = Backoff(s.backoff_s, s.backoff_s * 2 ** s.retries, jitter=0.0)  # never capped: doubling only
        while True:
            checkpoint()  # a stopped run opens no new provider request, whatever cancel it swallowed
            try:
                resp = await self._http().post(route.url, data=body, headers=route.headers)
            except aiohttp.ClientError as exc:
                if backoff.attempt >= s.retries:
                    raise AgentError(f"the model provider is unreachable ({type(exc).__name__})") from exc
                await asyncio.sleep(backoff.step())
                continue
            if resp.status not in RETRY_STATUSES or backoff.attempt >= s.retries:
                return resp
            step = backoff.step()  # taken even when Retry-After sets the delay: it counts the attempt
            delay = _retry_after(resp) or step
            resp.close()
            log.warning("provider answered HTTP %d; retrying in %.1f s", resp.status, delay)
            await asyncio.sleep(delay)


class _Turn:
    """What one turn sends each round: the system prompt (and the client's own instructions), the
    history fitted to the budget, and this turn's own messages so far (the user's, the client's
    tool rounds after it, then each round's answer, tool results and interjections). The budget
    shrinks if the provider finds a request too long. Token counts go to the client's report."""

    def __init__(self, s: OpenAISettings, history: Sequence[ChatMessage], message: ChatMessage,
                 context: TurnContext | None) -> None:
        self.history = history
        self.message = message
        self.context = context
        self.options = options = context.options if context is not None else None
        self.report = options.report if options is not None else TurnReport()
        self.client_tools = options is not None and options.tools is not None
        instructions = options.instructions if options is not None else ()
        self.system_prompt = s.system_prompt
        # The client's instructions are always sent, like the system prompt: the budget is what is left.
        self.budget = s.context_tokens - s.reply_tokens - sum(message_tokens(m) for m in instructions)
        self.ratio = context.token_ratio if context is not None else 1.0
        self.memo = context.history_memo if context is not None else None
        self.system = [_dumps({"role": "system", "content": s.system_prompt})] if s.system_prompt else []
        self.system += [encode(m) for m in instructions]
        self.sent: list[dict[str, Any]] = [message.to_openai()]  # this turn's messages so far
        if options is not None:
            self.sent += [m.to_openai() for m in options.continuation]
        # How often the chat can show new text: text arriving faster is read in bigger pieces.
        self.pace: Pace | None = (lambda: context.pace_s) if context is not None else None
        self.estimated = 0  # our count of the last request's prompt
        self.round_counted = False  # the provider gave token counts for the current round

    def request(self) -> tuple[bytes, int]:
        """The messages to send, as a JSON array, and our estimate of their tokens."""
        extra = sum(estimate(json.dumps(m, ensure_ascii=False)) for m in self.sent[1:])  # this turn's rounds
        fitted = fit(self.history, self.message, budget_tokens=self.budget - extra, system_prompt=self.system_prompt,
                     ratio=self.ratio, memo=self.memo)
        rows = fitted.encoded if fitted.encoded is not None else b",".join(map(encode, fitted.messages))
        messages = b"[" + b",".join([*self.system, *([rows] if rows else []), *map(_dumps, self.sent)]) + b"]"
        self.estimated = fitted.estimated_tokens + extra
        return messages, self.estimated

    def counted(self, usage: Usage) -> None:
        self.report.add(usage.prompt_tokens, usage.completion_tokens)
        self.round_counted = True

    def round_done(self, rnd: Round) -> None:
        """A round ended, or was cut short: if the provider did not count it, our estimate stands in
        (and says so)."""
        if not self.round_counted and self.estimated:
            answer = estimate("".join(rnd.text)) + sum(estimate(c.name) + estimate(c.arguments)
                                                       for c in rnd.tool_calls())
            self.report.add(self.estimated, answer, estimated=True)
        self.round_counted = False
        self.estimated = 0

    def shrink(self, error: str, estimated: int) -> None:
        """The provider refused `estimated` tokens as too long: the rest of the turn fits a smaller budget."""
        self.budget = _smaller_budget(error, estimated)
        log.warning("the provider said the context is too long; retrying with %d tokens", self.budget)


@dataclass(frozen=True, slots=True)
class _Route:
    model: str
    url: URL
    headers: dict[str, str]


def _route(model: str, base_url: str, api_key: str | None) -> _Route:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return _Route(model, URL(base_url.rstrip("/") + "/chat/completions"), headers)


def _head(s: OpenAISettings, params: Mapping[str, Any], tools: list[Any], model: str) -> bytes:
    """The start of a request body, up to `"messages":`: the model, the client's parameters, streaming
    (with token counts if configured) and the tools."""
    head: dict[str, Any] = {"model": model, **params, "stream": True}
    if s.include_usage:
        head["stream_options"] = {"include_usage": True}
    encoded = b',"tools":' + _dumps(tools) if tools else b""
    return _dumps(head)[:-1] + encoded + b',"messages":'


async def _refusal(resp: aiohttp.ClientResponse) -> AgentError:
    """What a non-200 answer means: too long a request (the caller may ask again, smaller), or a failure."""
    detail = (await resp.text())[:300]
    text = f"the model provider failed: HTTP {resp.status} {error_text(detail)}"
    if resp.status in (400, 413) and any(hint in detail.lower() for hint in _TOO_LONG):
        return ContextTooLong(text)
    return AgentError(text)


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


def hang_up(resp: aiohttp.ClientResponse) -> None:
    """Close a provider response now, from a run's cancel. Its socket is shut down at once: the
    event loop closes a transport's socket only on a later iteration, and under load that waits
    behind every provider delta already queued — the provider would go on generating meanwhile."""
    transport = resp.connection.transport if resp.connection is not None else None
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        try:  # a plain socket over the transport's descriptor (uvloop's own refuses shutdown)
            raw = socket.socket(fileno=sock.fileno())
        except OSError:
            raw = None
        if raw is not None:
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)
            raw.detach()  # the descriptor stays the transport's: it closes it
    resp.close()


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    try:
        return min(float(resp.headers.get("Retry-After", "")), 30.0)
    except ValueError:
        return None
