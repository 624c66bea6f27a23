"""What a person sees of a turn's tool calls while they run: a short label for each call (its name
and the gist of its arguments), how long it has been running, and one status line for the chat
platforms that show progress inside the streaming message ("⏳ running `sleep 30` · 12 s").

No I/O: the streaming reply (`platforms/streaming.py`) asks for the line when it renders (woken
by `keep_current`'s ticker while a call runs), and the web chat sends the same labels as rows of
their own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.cancellation import ToolReason, stop_notice
from gateway.core.transcript import ToolCall

LABEL_CHARS = 60  # a call's arguments are summed up in about this much
PREVIEW_CHARS = 400  # what the web chat shows of a result (the model gets all of it)
TICK_S = 1.0  # a status line's elapsed time is brought up to date at most this often
_COMMAND_KEYS = ("command", "cmd", "query", "url", "path", "name")  # the argument that says what a call does


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _scalar(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def summary(arguments: str) -> str:
    """The gist of a call's JSON arguments: the one that says what it does (a command, a query),
    else its only value, else `key=value` pairs; short, on one line."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return _short(arguments, LABEL_CHARS)
    if not isinstance(args, dict):
        return _short(_scalar(args), LABEL_CHARS)
    for key in _COMMAND_KEYS:
        if isinstance(args.get(key), str):
            return _short(args[key], LABEL_CHARS)
    if len(args) == 1:
        return _short(_scalar(next(iter(args.values()))), LABEL_CHARS)
    return _short(", ".join(f"{k}={_scalar(v)}" for k, v in args.items()), LABEL_CHARS)


def label(call: ToolCall) -> str:
    """`sleep 30`, `shell ls -la`: the call as a person reads it."""
    gist = summary(call.arguments)
    return f"{call.name} {gist}" if gist else call.name


def elapsed_text(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s" if seconds else f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60} min"


def preview(result: str, limit: int = PREVIEW_CHARS) -> str:
    """The start of a result, for a person (the model gets it whole)."""
    return result if len(result) <= limit else result[:limit - 1].rstrip() + "…"


@dataclass(slots=True)
class _Call:
    label: str
    started: float
    ended: float | None = None


class ToolProgress:
    """A turn's tool calls as they start and end, and the status line that shows them."""

    __slots__ = ("_calls", "_clock", "_last", "_ticker")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._calls: dict[str, _Call] = {}
        self._last: _Call | None = None  # the call that ended last
        # Wakes the reply while a call runs. Only this task holds the reply's callbacks, and `close`
        # ends it: no reference cycle outlives the turn.
        self._ticker: asyncio.Task[None] | None = None

    def keep_current(self, wake: Callable[[], None], interval: Callable[[], float]) -> None:
        """While a call runs, `wake` the reply so its line's elapsed time stays current: every
        `interval()` (the platform's edit pace), at most once a second, every 5 s past a minute."""
        if self._calls and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.get_running_loop().create_task(self._tick(wake, interval))

    async def _tick(self, wake: Callable[[], None], interval: Callable[[], float]) -> None:
        while self._calls:
            slow = self.running_for() >= 60  # minutes: a tick every few seconds is plenty
            await asyncio.sleep(max(interval(), TICK_S * (5 if slow else 1)))
            if self._calls:
                wake()

    async def close(self) -> None:
        """The turn's reply ended: nothing runs any more, nothing is shown, the ticker stops."""
        self.stop_all()
        ticker, self._ticker = self._ticker, None
        if ticker is not None and not ticker.done():
            ticker.cancel()
            await asyncio.wait({ticker})  # (not `await ticker`: a cancel aimed at the caller must not be swallowed)

    def _now(self) -> float:
        return self._clock()

    def start(self, call: ToolCall) -> None:
        self._calls[call.id] = _Call(label(call), self._now())

    def end(self, call_id: str) -> float | None:
        """The call returned; how long it ran (None: not one we saw start)."""
        found = self._calls.pop(call_id, None)
        if found is None:
            return None
        found.ended = self._now()
        self._last = found
        return found.ended - found.started

    def running(self) -> bool:
        return bool(self._calls)

    def running_for(self) -> float:
        """How long the oldest running call has been running (0: none is)."""
        return self._now() - min(c.started for c in self._calls.values()) if self._calls else 0.0

    def cut_short(self, reason: ToolReason) -> str:
        """The running calls as a stop left them — "⏹ `sleep 30` stopped after 12 s", or
        "⏹ `sleep 30` interrupted after 12 s: gateway restart" — or "" if none was running."""
        if not self._calls:
            return ""
        labels = ", ".join(f"`{c.label}`" for c in self._calls.values())
        after = f"after {elapsed_text(self.running_for())}"
        if stop_notice(reason) == "⏹ stopped":
            return f"⏹ {labels} stopped {after}"
        return f"⏹ {labels} interrupted {after}: {reason.text}"

    def stop_all(self) -> None:
        """The turn ended: nothing runs any more, nothing is shown."""
        self._calls.clear()
        self._last = None

    def line(self, *, has_text: bool) -> str:
        """The status line: the running calls and for how long; once they returned and before the
        answer's text arrives, what ran ("✓ ran `sleep 30` · 30 s"); else nothing."""
        if self._calls:
            labels = ", ".join(f"`{c.label}`" for c in self._calls.values())
            return f"⏳ running {labels} · {elapsed_text(self.running_for())}"
        if self._last is not None and self._last.ended is not None and not has_text:
            return f"✓ ran `{self._last.label}` · {elapsed_text(self._last.ended - self._last.started)}"
        return ""
