"""The answer to one chat completion request: the turn's `Reply`, and the answer in OpenAI's shapes —
a `chat.completion` object, or `chat.completion.chunk` events.

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
from typing import Any

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


class EventStream:
    """A streamed answer: `chat.completion.chunk` events on a prepared response, with a comment
    line whenever it has been silent for `KEEPALIVE_S`. Writes raise ConnectionError (or
    RuntimeError) once the client has gone."""

    def __init__(self, resp: web.StreamResponse, model: str, include_usage: bool) -> None:
        self._resp = resp
        self._id = f"chatcmpl-{unique_id()}"
        self._created = int(time.time())
        self._model = model
        self._include_usage = include_usage  # then every chunk has "usage" (null until the last)
        self._last_write = time.monotonic()
        self._pinger: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, request: web.Request, model: str, include_usage: bool) -> EventStream:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        stream = cls(resp, model, include_usage)
        stream._pinger = asyncio.get_running_loop().create_task(stream._keepalive())
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
            await self._write(event)
            return
        if end.finish_reason == "tool_calls":
            calls = [{"index": i, **call.to_dict()} for i, call in enumerate(report.tool_calls)]
            await self._chunk({"tool_calls": calls})
        extra = switchboard(end, report, streamed=True)
        await self._chunk({}, end.finish_reason, **({"switchboard": extra} if extra else {}))
        if self._include_usage:
            await self._write(self._payload([], usage=usage(report)))
        await self._resp.write(b"data: [DONE]\n\n")

    async def close(self) -> None:
        self.stop_pinging()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._resp.write_eof()

    @property
    def response(self) -> web.StreamResponse:
        return self._resp

    def _payload(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {"id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
               "choices": choices, **extra}
        if self._include_usage:
            out.setdefault("usage", None)
        return out

    async def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
        await self._write(self._payload([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                                        **extra))

    async def _write(self, payload: dict[str, Any]) -> None:
        self._last_write = time.monotonic()
        await self._resp.write(b"data: " + jsonfast.dumps(payload) + b"\n\n")

    async def _keepalive(self) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):  # gone: the handler hears it too
            while True:
                await asyncio.sleep(max(0.0, self._last_write + KEEPALIVE_S - time.monotonic()))
                if time.monotonic() - self._last_write >= KEEPALIVE_S:
                    self._last_write = time.monotonic()
                    await self._resp.write(b": keepalive\n\n")

    def stop_pinging(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
