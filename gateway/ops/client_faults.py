"""Client faults are 4xx answers and warning lines, never 5xx answers or error tracebacks.

Two places see them. A handler that trips over hostile input (JSON nested past the parser's
depth, a charset Python does not know, bytes that are not text) raises out of our code: the
middleware answers 400 and logs one warning line. A request aiohttp cannot even parse (a NUL in
a header, `Content-Length: -1`) is answered 400 by aiohttp itself, which logs it at error level
with a traceback: the filter turns that record into a warning line without one. Both kinds of
line are rate-limited, so anonymous clients cannot flood the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOG_EVERY_S = 10.0  # at most one client-fault line per this many seconds (the rest are counted)


class _Throttle:
    def __init__(self) -> None:
        self._last = -LOG_EVERY_S
        self.suppressed = 0

    def allow(self) -> int | None:
        """None: stay quiet; otherwise how many lines were held back since the last one."""
        now = time.monotonic()
        if now - self._last < LOG_EVERY_S:
            self.suppressed += 1
            return None
        self._last, held, self.suppressed = now, self.suppressed, 0
        return held


_throttle = _Throttle()


def _client_caused(exc: BaseException) -> str | None:
    """What the client did wrong, if this exception is the client's doing."""
    if isinstance(exc, RecursionError):
        return "input nested too deeply"
    if isinstance(exc, UnicodeError):
        return "input that is not valid text"
    if type(exc) is LookupError:  # codecs.lookup's "unknown encoding" (not KeyError or IndexError)
        return "an unknown charset"
    if isinstance(exc, RequestPayloadError):
        return "a body that cannot be decoded (Content-Encoding or chunking)"
    return None


def note(what: str) -> None:
    """Log one client fault at warning level, rate-limited, never with a traceback."""
    held = _throttle.allow()
    if held is not None:
        log.warning("client fault: %s%s", what, f" ({held} more since the last such line)" if held else "")


@web.middleware
async def client_faults(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Exception as exc:
        why = _client_caused(exc)
        if why is None or request.writer.output_size > 0:  # not the client's, or too late for an answer
            raise
        note(f"{request.method} {request.path} from {request.remote}: {why}")
        response = web.json_response({"error": f"bad request: {why}"}, status=400)
        if not request.content.is_eof():  # what is left of the body is never read: the connection ends
            response.force_close()
            request.content.feed_eof()
        return response


class ParserFaults(logging.Filter):
    """On aiohttp's server logger: a request it could not parse is the client's fault, so its
    error-with-traceback record becomes a rate-limited warning line (or nothing)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not _unparsable(exc):
            return True
        held = _throttle.allow()
        if held is None:
            return False
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        # The parser's message can quote the offending bytes (a header, a credential): not logged.
        record.msg, record.args = "client fault: a request that is not valid HTTP from %s (%s)%s", (
            record.args[0] if isinstance(record.args, tuple) and record.args else "?",
            type(exc).__name__, f"; {held} more since the last such line" if held else "")
        record.exc_info = record.exc_text = None
        return True


def _unparsable(exc: BaseException | None) -> bool:
    """A request aiohttp could not parse, or whose body it could not decode (lingering after an
    answer, say): the client's doing."""
    if isinstance(exc, RequestPayloadError):
        return True
    return isinstance(exc, (BadHttpMessage, HttpProcessingError)) and (exc.code or 400) < 500


def install_parser_filter() -> None:
    """Once per process: idempotent."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ParserFaults) for f in logger.filters):
        logger.addFilter(ParserFaults())
