"""The event loop the daemon runs on (`daemon.event_loop`): uvloop where it is installed — its
transports and callbacks cost noticeably less CPU per message — else the standard library's."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from typing import Literal

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]


class LoopUnavailable(Exception):
    """`uvloop` was asked for and is not installed."""


def loop_factory(choice: EventLoopChoice) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory for `asyncio.Runner`: "auto" takes uvloop when it can be imported."""
    if choice == "asyncio" or (choice == "auto" and importlib.util.find_spec("uvloop") is None):
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as exc:
        raise LoopUnavailable("daemon.event_loop = \"uvloop\", but uvloop is not installed") from exc
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """"uvloop" or "asyncio": what the startup log says the daemon runs on."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
