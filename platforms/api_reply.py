"""The answer to one API request: the turn's `Reply`, and the answer in OpenAI's shapes — here a
`chat.completion` object or `chat.completion.chunk` events (`ChatShape`); the Responses API's are in
`platforms/api_responses.py`.

How an answer ends, as a client sees it:

- `finish_reason: "stop"`: complete; `"tool_calls"`: complete, ending with calls of the client's
  own tools for it to run;
- `finish_reason: "length"`: cut short (stopped, interrupted by a newer message, a timeout, a
  restart): the one standard value that says an answer did not end where the model would have
  ended it, so every OpenAI client parses it (typed ones too) and none takes the text for complete.
  The `switchboard` field says who cut it and why;
- a failure: a non-streamed answer is an HTTP error; a streamed one (its status already 200) ends
  with an `error` event, which the official SDKs raise as an APIError.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from aiohttp import web

from gateway.core import jsonfast
from gateway.core.cancellation import ToolReason
from gateway.core.ids import unique_id
from gateway.core.ports import Reply
from gateway.core.turn_options import TurnReport

# While an answer is silent (the model thinking, a tool running), a comment line this often: a
# client that closed its end without the socket closing yet (a sync client closing a stream from
# another thread: its reader is asleep in recv) wakes at it and lets go, so the run stops within a
# second, not at a keepalive ten seconds away.
KEEPALIVE_S = 0.5


@dataclass(frozen=True, slots=True)
class End:
    """How the turn ended."""

    finish_reason: str  # "stop", "tool_calls", "length" (cut short) or "error"
    interrupted_by: str | None = None  # "user" or "system", when cut short
    reason: str | None = None
    error: str | None = None  # the failure, in the words the chat would see
    retry_after_s: float | None = None  # with `error`: our side is down for now, so the same request may work later
    unsaved: str | None = None  # the answer could not be saved (a session's turn)


class ApiReply(Reply):
    """Feeds one HTTP request: the answer's text, how it ended, and — once the turn is recorded (or
    could not be) — `settled`, when the response is complete. A streaming request also gets each
    delta as it comes; a whole answer wakes its handler once, at the end."""

    def __init__(self, report: TurnReport, streaming: bool = False) -> None:
        self.text = ""
        self.report = report  # what the agent tells: token counts, the client's tool calls
        self._end = End("error", error="the turn ended without an answer")
        self._settled: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._deltas: asyncio.Queue[str] | None = asyncio.Queue() if streaming else None

    async def delta(self, text: str) -> None:
        self.text += text
        if self._deltas is not None:
            self._deltas.put_nowait(text)

    async def finish(self, text: str) -> None:
        self.text = text
        self._end = End("tool_calls" if self.report.tool_calls else "stop")

    async def interrupted(self, reason: ToolReason) -> None:
        self._end = End("length", interrupted_by=reason.kind, reason=reason.text)

    async def failed(self, text: str, *, retry_after_s: float | None = None) -> None:
        self._end = End("error", error=text, retry_after_s=retry_after_s)

    async def settled(self, problem: str | None = None) -> None:
        if not self._settled.done():  # (cancelled if the client has gone)
            self._settled.set_result(problem)
        if self._deltas is not None:
            self._deltas.put_nowait("")  # wakes the streaming handler: the end is known

    async def outcome(self, stream: Callable[[str], Awaitable[None]] | None = None) -> End:
        """How the turn ended, once it has settled, with any problem saving it; deltas go to
        `stream` meanwhile."""
        if self._deltas is not None:
            while not self._settled.done() or not self._deltas.empty():
                text = await self._deltas.get()
                if text and stream is not None:
                    await stream(text)
        problem = await self._settled
        return replace(self._end, unsaved=problem) if problem else self._end


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_kind(end: End) -> tuple[int, str]:
    """The HTTP status and error type of a failed turn: our side down for now (retry), else the provider."""
    return (503, "service_unavailable") if end.retry_after_s is not None else (502, "provider_error")


def usage(report: TurnReport) -> dict[str, int]:
    return {"prompt_tokens": report.prompt_tokens, "completion_tokens": report.completion_tokens,
            "total_tokens": report.prompt_tokens + report.completion_tokens}


def switchboard(end: End, report: TurnReport, *, streamed: bool) -> dict[str, Any]:
    """The extra top-level field: why an answer was cut short, and what else a client may want to
    know (its token counts are estimates; a streamed answer could not be saved)."""
    out: dict[str, Any] = {}
    if end.interrupted_by is not None:
        out |= {"interrupted_by": end.interrupted_by, "reason": end.reason}
    if streamed and end.unsaved:
        out["unsaved"] = end.unsaved
    if report.estimated:
        out["usage_estimated"] = True
    return out


def message(text: str, end: End, report: TurnReport) -> dict[str, Any]:
    calls = report.tool_calls if end.finish_reason == "tool_calls" else ()
    out: dict[str, Any] = {"role": "assistant", "content": None if calls and not text else text}
    if calls:
        out["tool_calls"] = [call.to_dict() for call in calls]
    return out


def completion(model: str, text: str, end: End, report: TurnReport) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": f"chatcmpl-{unique_id()}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message(text, end, report), "logprobs": None,
                     "finish_reason": end.finish_reason}],
        "usage": usage(report),
    }
    if extra := switchboard(end, report, streamed=False):
        out["switchboard"] = extra
    return out


class Shape(Protocol):
    """How one API shapes its answers: OpenAI's chat completions (`ChatShape`) or its Responses
    (`platforms.api_responses.ResponsesShape`)."""

    async def whole(self, reply: ApiReply) -> web.StreamResponse:
        """The answer once the turn has settled (an error status if it failed)."""

    async def stream(self, request: web.Request, reply: ApiReply, gone: Callable[[], object]) -> web.StreamResponse:
        """The answer as events while the turn runs; `gone()` when the client can no longer be written to."""

    async def command(self, request: web.Request, text: str) -> web.StreamResponse:
        """A command's answer, at once."""


def json_response(payload: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    # Text as text in every body: no \\uXXXX escapes for the languages people write in.
    return web.Response(body=jsonfast.dumps(payload), status=status, headers=headers,
                        content_type="application/json", charset="utf-8")


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | None = None) -> web.Response:
    return json_response(error_body(message, kind, param, code), status=status, headers=headers)


def failure_response(end: End) -> web.Response:
    """A failed turn's HTTP error: 503 with Retry-After when our side is down for now, else 502."""
    assert end.error is not None
    status, kind = error_kind(end)
    headers = {"Retry-After": f"{end.retry_after_s:.0f}"} if end.retry_after_s is not None else None
    return error_response(status, end.error, kind, headers=headers)


class SseResponse:
    """A response of server-sent events, with a comment line whenever it has been silent for
    `KEEPALIVE_S`. Writes raise ConnectionError (or RuntimeError) once the client has gone."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self._resp = resp
        self._last_write = time.monotonic()
        self._pinger: asyncio.Task[None] | None = None

    @staticmethod
    async def prepared(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    def start_pinging(self) -> None:
        self._pinger = asyncio.get_running_loop().create_task(self._keepalive())

    def stop_pinging(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()

    @property
    def response(self) -> web.StreamResponse:
        return self._resp

    async def close(self) -> None:
        self.stop_pinging()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._resp.write_eof()

    async def write(self, payload: dict[str, Any], event: str | None = None) -> None:
        self._last_write = time.monotonic()
        head = b"event: " + event.encode() + b"\n" if event else b""
        await self._resp.write(head + b"data: " + jsonfast.dumps(payload) + b"\n\n")

    async def _keepalive(self) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):  # gone: the handler hears it too
            while True:
                await asyncio.sleep(max(0.0, self._last_write + KEEPALIVE_S - time.monotonic()))
                if time.monotonic() - self._last_write >= KEEPALIVE_S:
                    self._last_write = time.monotonic()
                    await self._resp.write(b": keepalive\n\n")


class EventStream(SseResponse):
    """A streamed chat completion: `chat.completion.chunk` events."""

    def __init__(self, resp: web.StreamResponse, model: str, include_usage: bool) -> None:
        super().__init__(resp)
        self._id = f"chatcmpl-{unique_id()}"
        self._created = int(time.time())
        self._model = model
        self._include_usage = include_usage  # then every chunk has "usage" (null until the last)

    @classmethod
    async def open(cls, request: web.Request, model: str, include_usage: bool) -> EventStream:
        stream = cls(await cls.prepared(request), model, include_usage)
        stream.start_pinging()
        await stream._chunk({"role": "assistant", "content": ""})
        return stream

    async def text(self, text: str) -> None:
        await self._chunk({"content": text})

    async def end(self, text: str, end: End, report: TurnReport) -> None:
        """The last events: the client's tool calls, the finish reason, the token counts, [DONE] —
        or, for a failure, an error event."""
        self.stop_pinging()
        if end.error is not None:
            event = error_body(end.error, error_kind(end)[1])
            if end.retry_after_s is not None:
                event["switchboard"] = {"retry_after_s": end.retry_after_s}
            await self.write(event)
            return
        if end.finish_reason == "tool_calls":
            calls = [{"index": i, **call.to_dict()} for i, call in enumerate(report.tool_calls)]
            await self._chunk({"tool_calls": calls})
        extra = switchboard(end, report, streamed=True)
        await self._chunk({}, end.finish_reason, **({"switchboard": extra} if extra else {}))
        if self._include_usage:
            await self.write(self._payload([], usage=usage(report)))
        await self._resp.write(b"data: [DONE]\n\n")

    def _payload(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {"id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
               "choices": choices, **extra}
        if self._include_usage:
            out.setdefault("usage", None)
        return out

    async def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
        await self.write(self._payload([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                                       **extra))


class ChatShape:
    """Answers as chat completions: a `chat.completion` object, or `chat.completion.chunk` events."""

    def __init__(self, model: str, *, streamed: bool, include_usage: bool) -> None:
        self._model = model
        self._streamed = streamed
        self._include_usage = include_usage

    async def whole(self, reply: ApiReply) -> web.StreamResponse:
        end = await reply.outcome()
        if end.error is not None:
            return failure_response(end)
        return json_response(completion(self._model, reply.text, end, reply.report))

    async def stream(self, request: web.Request, reply: ApiReply, gone: Callable[[], object]) -> web.StreamResponse:
        events = await EventStream.open(request, self._model, self._include_usage)
        try:
            end = await reply.outcome(events.text)
            await events.end(reply.text, end, reply.report)
        except (ConnectionError, RuntimeError):
            gone()
        finally:
            events.stop_pinging()  # also when the handler is cancelled (the client has gone)
        await events.close()
        return events.response

    async def command(self, request: web.Request, text: str) -> web.StreamResponse:
        end, report = End("stop"), TurnReport()
        if not self._streamed:
            return json_response(completion(self._model, text, end, report))
        events = await EventStream.open(request, self._model, self._include_usage)
        try:
            await events.text(text)
            await events.end(text, end, report)
        except (ConnectionError, RuntimeError):
            pass  # nothing runs for it: the client has gone, and that is all
        finally:
            events.stop_pinging()
        await events.close()
        return events.response
