"""Inbound rate limits, in one-minute windows: per user (per session id on the API) and per tenant
(over all of a tenant's sessions). Over a limit, a message is refused with the time left in the
window; the user is told once per window, then the refusals are silent."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.live import Reads
from gateway.core.quotas import who

WINDOW_S = 60.0
TOLD_PER_WINDOW = 10_000  # users told in one tenant window, at most (the rest are refused silently)


@dataclass(frozen=True, slots=True)
class Limited:
    """A message over a limit: what the user is told (None: told already this window), and when
    trying again makes sense."""

    notice: str | None
    retry_after_s: float
    reason: str  # for the log, and for a client that gets an answer each time (the HTTP API)


class _Window:
    __slots__ = ("count", "start", "told")

    def __init__(self, start: float) -> None:
        self.start = start
        self.count = 0
        self.told: set[str] = set()

    def retry_after(self, now: float) -> float:
        return max(1.0, math.ceil(WINDOW_S - (now - self.start)))


class _Windows:
    """One window per name; `take` counts a message and says whether it is over `per_minute`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def take(self, name: str, per_minute: int) -> tuple[_Window, float] | None:
        """None: within the limit; else the window and the time now."""
        now = self._clock()
        window = self._windows.get(name)
        if window is None or now - window.start >= WINDOW_S:
            window = self._windows[name] = _Window(now)
        window.count += 1
        return None if window.count <= per_minute else (window, now)

    def prune(self) -> None:
        now = self._clock()
        for name in [n for n, w in self._windows.items() if now - w.start >= WINDOW_S]:
            del self._windows[name]


class UserRateLimit:
    """`per_minute` is read at each message (a reload changes it in place); 0 turns the limit off."""

    def __init__(self, per_minute: Reads[int], *, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_minute = per_minute
        self._windows = _Windows(clock)

    def check(self, platform: str, user_id: str) -> Limited | None:
        """None: allowed; else the refusal (with a notice only the first time a window is exceeded)."""
        per_minute = self._per_minute.value
        if per_minute <= 0:
            return None
        over = self._windows.take(f"{platform}\0{user_id}", per_minute)
        if over is None:
            return None
        window, now = over
        wait = window.retry_after(now)
        reason = f"over the limit of {per_minute} messages a minute for this conversation"
        if window.told:
            return Limited(None, wait, reason)
        window.told.add("")
        return Limited(f"You're sending messages faster than I can take them ({per_minute} a minute). "
                       f"I'll ignore new ones for about {wait:.0f} s.", wait, reason)

    def prune(self) -> None:
        """Forget windows that have ended (called by the router's sweeper)."""
        self._windows.prune()


class TenantRateLimit:
    """Messages per minute over every session of a tenant (stateless requests and commands too;
    the caller lets `/stop` through). Each user over it is told once per window."""

    def __init__(self, per_minute: Callable[[str], float], *, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_minute = per_minute  # the tenant's limit, read at each message (a reload may change it)
        self._windows = _Windows(clock)

    def check(self, tenant: str, user: str) -> Limited | None:
        per_minute = int(self._per_minute(tenant))
        if per_minute <= 0:
            return None
        over = self._windows.take(tenant, per_minute)
        if over is None:
            return None
        window, now = over
        wait = window.retry_after(now)
        reason = f"over the limit of {per_minute} messages a minute for {who(tenant)}, across all its conversations"
        if user in window.told or len(window.told) >= TOLD_PER_WINDOW:
            return Limited(None, wait, reason)
        window.told.add(user)
        return Limited(f"Too many messages right now: {who(tenant)} may send {per_minute} a minute across all "
                       f"its conversations. Please try again in about {wait:.0f} s.", wait, reason)

    def prune(self) -> None:
        self._windows.prune()
