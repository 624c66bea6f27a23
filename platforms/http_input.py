"""Reading a client's request: its JSON body (every way it can be wrong is a 4xx, never an
exception) and whether it came over https.

The ways: a body over the size limit (413, before a byte of it is read when its length is
declared), a body that does not arrive within the deadline (408), a charset Python does not know
(415), a body that cannot be decoded (a bad gzip stream, broken chunking: 400), bytes that are not
text in the declared charset, text with lone surrogates, JSON that does not parse, JSON nested
deeper than the parser goes (400), or more JSON values than any real request holds (413).

The parse is bounded so that no body holds the event loop (and every other client) for long:
before it is parsed, the body's structural bytes are counted — `[` and `{` (containers, the
costly values) and `,` and `:` (values), wherever they stand, strings included — a megabyte at a
time with the loop let go between megabytes, and a body with more than the bounds is refused
unparsed. A body within them parses in a few tens of milliseconds at most (measured in
docs/performance.md). Large bodies are also read a few at a time (`LARGE_AT_ONCE`), which bounds
the memory they take together.
"""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

ErrorResponse = Callable[[int, str], web.Response]

MB = 1 << 20
LARGE = MB  # a body this big or bigger is "large": read a few at a time, counted with pauses
LARGE_AT_ONCE = 4
MAX_CONTAINERS = 50_000  # `[` and `{` in a body
MAX_VALUES = 500_000  # `,` and `:` in a body


class BadJson(Exception):
    """A body or frame that is refused: the HTTP status and what to tell the client."""

    def __init__(self, status: int, problem: str) -> None:
        super().__init__(problem)
        self.status = status
        self.problem = problem


@dataclass
class BodyLimits:
    """What a listener's routes may be sent: `max_bytes` by default (a route may allow more),
    within `timeout_s` of the request's head."""

    max_bytes: int = MB
    timeout_s: float = 10.0
    _large: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(LARGE_AT_ONCE), repr=False)

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.timeout_s <= 0:
            raise ValueError("body limits must be positive")


BODY_LIMITS = web.AppKey("body_limits", BodyLimits)


def json_error(status: int, problem: str) -> web.Response:
    """The plain error body of the daemon's own endpoints."""
    return web.json_response({"error": problem}, status=status)


async def read_json(request: web.Request, error: ErrorResponse = json_error, *, max_bytes: int | None = None) -> Any:
    """The parsed body, or `error(status, problem)` as the response to send instead. `max_bytes`:
    this route's size limit, if not the listener's."""
    try:
        raw = await _read(request, max_bytes)  # counted as it arrived
        return _loads(raw, request.charset)
    except BadJson as exc:
        response = error(exc.status, exc.problem)
        if not request.content.is_eof():  # the rest of the body is not read: the connection ends with the answer
            response.force_close()
            if exc.status != 413:  # a body too large is drained a moment (LINGER_S), so its client reads the 413;
                request.content.feed_eof()  # a slow one or one that cannot be decoded is not
        return response


async def _read(request: web.Request, max_bytes: int | None) -> bytearray:
    limits = request.config_dict.get(BODY_LIMITS) or BodyLimits()  # (an app of a test's own has none)
    limit = max_bytes or limits.max_bytes
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BadJson(413, f"The request body is larger than {limit} bytes.")
    if declared is not None and declared < LARGE:
        return await _read_within(request, limit, limits.timeout_s)
    try:
        async with asyncio.timeout(limits.timeout_s):
            await limits._large.acquire()
    except TimeoutError:
        raise BadJson(503, "Too many large requests are being read at once; please try again shortly.") from None
    try:
        return await _read_within(request, limit, limits.timeout_s)
    finally:
        limits._large.release()


async def _read_within(request: web.Request, limit: int, timeout_s: float) -> bytearray:
    """The body as it arrives, counted as it comes (a body with too many values is refused as soon as
    that is known, unread), in one buffer that is never copied whole: a 27 MB copy alone holds the
    loop for tens of milliseconds."""
    body, count = bytearray(), _Count()
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise BadJson(413, f"The request body is larger than {limit} bytes.")
                count.add(chunk)
    except TimeoutError:
        raise BadJson(408, f"The request body did not arrive within {timeout_s:g} s.") from None
    except RequestPayloadError:  # a bad gzip stream, broken chunking
        raise BadJson(400, "The request body could not be decoded (its Content-Encoding or chunking).") from None
    return body


async def parse_json(raw: bytes | bytearray | str, charset: str | None = None) -> Any:
    """A body or frame as JSON, bounded as the module says; raises `BadJson`. Lone surrogates are
    refused wherever they stand (text that cannot be stored or sent on)."""
    await too_many_values(raw)
    return _loads(raw, charset)


def _loads(raw: bytes | bytearray | str, charset: str | None) -> Any:
    if not isinstance(raw, str) and charset:
        raw = _decode(raw, charset)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadJson(400, _why(str(exc), charset)) from None


def _decode(raw: bytes | bytearray, charset: str) -> bytes | bytearray | str:
    """`raw` as text in `charset` (UTF-8 stays bytes: orjson reads it as it is)."""
    try:
        info = codecs.lookup(charset)
    except LookupError:
        info = None
    if info is None or not getattr(info, "_is_text_encoding", True):  # rot13 and the like are not charsets
        raise BadJson(415, f"Unknown charset {charset!r}; send UTF-8.")
    if info.name == "utf-8":
        return raw
    try:
        return raw.decode(info.name)
    except UnicodeDecodeError:
        raise BadJson(400, f"The request body is not valid {charset} text.") from None


def _why(error: str, charset: str | None) -> str:
    if "depth" in error or "recursion" in error:
        return "The request body is nested too deeply."
    if "surrogate" in error:
        return "The request body contains text that is not valid text (a lone surrogate)."
    if "UTF-8" in error:
        return f"The request body is not valid {charset or 'utf-8'} text."
    return "The request body must be JSON."


class _Count:
    """The structural bytes seen so far; raises `BadJson` (413) once past the bounds."""

    __slots__ = ("containers", "values")

    def __init__(self) -> None:
        self.containers = self.values = 0

    def add(self, part: bytes | bytearray | str, start: int = 0, end: int | None = None) -> None:
        if isinstance(part, str):
            self.containers += part.count("[", start, end) + part.count("{", start, end)
            self.values += part.count(",", start, end) + part.count(":", start, end)
        else:
            self.containers += part.count(b"[", start, end) + part.count(b"{", start, end)
            self.values += part.count(b",", start, end) + part.count(b":", start, end)
        if self.containers > MAX_CONTAINERS or self.values > MAX_VALUES:
            raise BadJson(413, f"The request body holds more JSON values than allowed ({MAX_CONTAINERS} arrays "
                               f"and objects, {MAX_VALUES} values).")


async def too_many_values(raw: bytes | bytearray | str) -> None:
    """Raise `BadJson` (413) if `raw` holds more JSON values than any real request does. A megabyte
    at a time, letting the loop go between megabytes."""
    count = _Count()
    for start in range(0, len(raw), LARGE):
        if start:
            await asyncio.sleep(0)
        count.add(raw, start, start + LARGE)


def served_over_https(request: web.Request) -> bool:
    """Did the browser use https (directly, or through a TLS proxy that says so)? Used only to
    mark cookies `Secure`: a client that lies about it only spoils its own cookie, so the proxy
    headers need no trust here."""
    if request.secure or request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower() == "https":
        return True
    first = request.headers.get("Forwarded", "").split(",")[0]
    return any(part.strip().lower() == "proto=https" for part in first.split(";"))
