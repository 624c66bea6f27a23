"""Who may use the admin listener: the token, the session cookie derived from it, and a throttle on
wrong guesses.

- **The cookie is not the token.** The console's sign-in sets a cookie whose value is an
  HMAC-SHA256 of a fixed label under the token: it opens the admin listener, but the token cannot
  be recovered from it (cookies are not kept apart by port, so any service on the same host name
  may see it), and it stops working when the token changes.
- **Bearer, in any case** (`Authorization: bearer …`, as RFC 9110 has it).
- **Wrong guesses are throttled per source address and in all**, by token buckets: a source that
  guessed wrong `PER_SOURCE_BURST` times is held to one guess every `PER_SOURCE_EVERY_S`, and
  guesses from everywhere together to one every `GLOBAL_EVERY_S` once `GLOBAL_BURST` are spent.
  A throttled request is answered 429 with `Retry-After` and its credential is not even looked
  at, so guessing in parallel gains nothing. A source that signed in lately is exempt from the
  global bucket (not from its own): someone guessing from many addresses does not lock the
  operator out.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.bounded import BoundedMap
from platforms.tenants import as_bytes

PER_SOURCE_BURST = 5.0
PER_SOURCE_EVERY_S = 12.0  # ...then five a minute
GLOBAL_BURST = 30.0
GLOBAL_EVERY_S = 2.0  # ...then thirty a minute, from all sources together
TRUSTED_FOR_S = 3600.0  # a source that signed in is exempt from the global bucket this long
_COOKIE_LABEL = b"switchboard admin session v1"


def session_cookie(token: str) -> str:
    """The cookie value that stands for `token`."""
    return hmac.new(as_bytes(token), _COOKIE_LABEL, hashlib.sha256).hexdigest()


def bearer(header: str) -> str | None:
    """The credential of an `Authorization: Bearer …` header (the scheme in any case), else None."""
    scheme, _, value = header.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


class _Bucket:
    __slots__ = ("tokens", "updated")

    def __init__(self, tokens: float, now: float) -> None:
        self.tokens = tokens
        self.updated = now

    def level(self, now: float, burst: float, every_s: float) -> float:
        self.tokens = min(burst, self.tokens + (now - self.updated) / every_s)
        self.updated = now
        return self.tokens


@dataclass(frozen=True, slots=True)
class _Rule:
    burst: float
    every_s: float


class GuessThrottle:
    """Wrong guesses per source address and in all (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._source_rule = _Rule(PER_SOURCE_BURST, PER_SOURCE_EVERY_S)
        self._global_rule = _Rule(GLOBAL_BURST, GLOBAL_EVERY_S)
        self._sources: BoundedMap[str, _Bucket] = BoundedMap(10_000, touch=True)
        self._global = _Bucket(GLOBAL_BURST, clock())
        self._trusted: BoundedMap[str, float] = BoundedMap(1_000, touch=True)
        self.refused = 0  # guesses answered 429 unchecked

    def wait(self, source: str) -> float | None:
        """None: a guess from `source` may be checked now; else the seconds to wait."""
        now = self._clock()
        bucket = self._sources.get(source)
        waits = []
        if bucket is not None and (level := bucket.level(now, *self._rule(self._source_rule))) < 1:
            waits.append((1 - level) * self._source_rule.every_s)
        if not self._is_trusted(source, now) and (level := self._global.level(now, *self._rule(self._global_rule))) < 1:
            waits.append((1 - level) * self._global_rule.every_s)
        if not waits:
            return None
        self.refused += 1
        return float(math.ceil(max(waits)))

    def failed(self, source: str) -> None:
        now = self._clock()
        bucket = self._sources.get(source)
        if bucket is None:
            bucket = self._sources[source] = _Bucket(self._source_rule.burst, now)
        bucket.level(now, *self._rule(self._source_rule))
        bucket.tokens -= 1
        if not self._is_trusted(source, now):
            self._global.level(now, *self._rule(self._global_rule))
            self._global.tokens -= 1

    def succeeded(self, source: str) -> None:
        self._trusted[source] = self._clock()

    def _is_trusted(self, source: str, now: float) -> bool:
        since = self._trusted.get(source)
        return since is not None and now - since < TRUSTED_FOR_S

    @staticmethod
    def _rule(rule: _Rule) -> tuple[float, float]:
        return rule.burst, rule.every_s
