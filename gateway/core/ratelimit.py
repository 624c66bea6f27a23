"""Per-user inbound rate limit: over the limit, one polite notice, then silence for the window."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.core.live import Reads


class UserRateLimit:
    """`per_minute` is read at each message (a reload changes it in place); 0 turns the limit off."""

    def __init__(self, per_minute: Reads[int], *, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_minute = per_minute
        self._clock = clock
        self._windows: dict[tuple[str, str], list[float]] = {}  # user -> [window start, count, told]

    def check(self, platform: str, user_id: str) -> tuple[bool, str | None]:
        """(allowed, notice to send — only the first time a window is exceeded)."""
        per_minute = self._per_minute.value
        if per_minute <= 0:
            return True, None
        now = self._clock()
        window = self._windows.get((platform, user_id))
        if window is None or now - window[0] >= 60.0:
            window = self._windows[(platform, user_id)] = [now, 0.0, 0.0]
        window[1] += 1
        if window[1] <= per_minute:
            return True, None
        if window[2]:
            return False, None
        window[2] = 1.0
        wait = 60.0 - (now - window[0])
        return False, (f"You're sending messages faster than I can take them ({per_minute} a minute). "
                       f"I'll ignore new ones for about {wait:.0f} s.")

    def retry_after(self, platform: str, user_id: str) -> float:
        """Seconds until the user's current window ends (0: not limited now)."""
        window = self._windows.get((platform, user_id))
        return 0.0 if window is None else max(0.0, 60.0 - (self._clock() - window[0]))

    def prune(self) -> None:
        """Forget windows that have ended (called by the router's sweeper)."""
        now = self._clock()
        for user in [u for u, w in self._windows.items() if now - w[0] >= 60.0]:
            del self._windows[user]
