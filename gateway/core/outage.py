"""One way to log an outage: its first failure (and each change of kind) loudly, the repeats
quietly, and its end once."""

from __future__ import annotations

import logging


class OutageLog:
    """Log a dependency's failures once per outage, then its recovery.

    Invariant: between two `recovered()` calls that log, at most one line per distinct failure
    kind is logged above DEBUG — a dependency down for an hour writes a handful of lines, not
    thousands.
    """

    __slots__ = ("_kind", "_log", "_what")

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self._kind: str | None = None

    @property
    def failing(self) -> bool:
        return self._kind is not None

    def failed(self, kind: str, text: str, *, level: int = logging.WARNING,
               exc_info: BaseException | None = None) -> bool:
        """Record a failure of `kind`; True if it was logged loudly (a new outage or a new kind)."""
        if kind == self._kind:
            self._log.debug("%s: still failing (%s)", self._what, text)
            return False
        self._kind = kind
        self._log.log(level, "%s: %s", self._what, text, exc_info=exc_info)
        return True

    def recovered(self, state: str, *, level: int = logging.INFO) -> bool:
        """Record a success; True if it ended an outage (and said so, at `level`)."""
        if self._kind is None:
            return False
        self._kind = None
        self._log.log(level, "%s: %s", self._what, state)
        return True
