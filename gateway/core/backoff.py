"""One backoff: how long to wait before the next attempt after a run of failures."""

from __future__ import annotations

import math
import random


class Backoff:
    """Exponential backoff: `first`, then doubling, capped at `cap`, each step jittered by ±`jitter`.

    `step()` after a failure, `reset()` after a success. `attempt` counts the steps since the last
    reset (what a log line or a give-up rule reads).
    """

    __slots__ = ("_to_cap", "attempt", "cap", "factor", "first", "jitter")

    def __init__(self, first: float = 0.5, cap: float = 60.0, *, factor: float = 2.0, jitter: float = 0.1) -> None:
        if first <= 0 or cap < first or factor < 1 or not 0 <= jitter < 1:
            raise ValueError("a backoff needs 0 < first <= cap, factor >= 1 and 0 <= jitter < 1")
        self.first, self.cap, self.factor, self.jitter = first, cap, factor, jitter
        self.attempt = 0
        # Steps after which the delay is the cap: the exponent stops there, so a dependency down
        # for days never overflows a float.
        self._to_cap = math.ceil(math.log(cap / first, factor)) if factor > 1 and cap > first else 0

    def peek(self) -> float:
        """The next delay without jitter, and without taking the step."""
        return min(self.cap, self.first * self.factor ** min(self.attempt, self._to_cap))

    def step(self) -> float:
        """The delay before the next attempt; the one after it is longer, up to the cap."""
        delay = self.peek()
        self.attempt += 1
        if self.jitter:
            delay *= random.uniform(1 - self.jitter, 1 + self.jitter)
        return delay

    def reset(self) -> None:
        self.attempt = 0
