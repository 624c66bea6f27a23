"""Structured logging: one JSON object a line, run context attached, secrets redacted everywhere."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

# Session key, platform and run id of the turn being logged; set per run, copied to its threads.
log_context: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("log_context",
                                                                                     default=None)


_EXTRA_KEYS = ("session", "run", "platform")


class Redactor:
    """Replaces every registered secret (tokens, API keys) with `***`."""

    def __init__(self) -> None:
        self._secrets: set[str] = set()

    def add(self, secret: str | None) -> None:
        if secret and len(secret) >= 6:  # very short values would redact ordinary words
            self._secrets.add(secret)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text


redactor = Redactor()


def _record_text(record: logging.LogRecord, formatter: logging.Formatter) -> tuple[str, str | None]:
    message = record.getMessage()
    exc = formatter.formatException(record.exc_info) if record.exc_info else None
    return redactor(message), redactor(exc) if exc else None


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message, exc = _record_text(record, self)
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": message,
        }
        ctx = log_context.get()
        if ctx:
            out.update(ctx)
        for key in _EXTRA_KEYS:
            if key in record.__dict__:
                out[key] = redactor(str(record.__dict__[key]))
        if exc:
            out["exc"] = exc
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message, exc = _record_text(record, self)
        ctx = log_context.get()
        where = " ".join(f"{k}={v}" for k, v in ctx.items()) if ctx else ""
        line = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname:<7} " \
               f"{record.name}: {message}" + (f"  [{where}]" if where else "")
        return line + ("\n" + exc if exc else "")


class _OneLine(logging.Filter):
    """A library's expected, repeated failure as one line: the exception's summary, not its
    traceback (asyncpg retries its pool about once a second while the database is down; the
    store says what that outage means for messages itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and (exc := record.exc_info[1]) is not None:
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", None
            record.exc_info = record.exc_text = None
        return True


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library chatter (httpx logs every Telegram request URL, which holds the token; httpx2 every
    # request of the MCP SDK 2.x) stays quiet unless debugging; the redactor guards it anyway.
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2", "discord", "telegram", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    pool = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, _OneLine) for f in pool.filters):
        pool.addFilter(_OneLine())
