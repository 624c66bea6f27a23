"""The small types every layer shares: one bounded map, one backoff, one outage log, one ownership check."""

from __future__ import annotations

import logging
import random

import pytest

from gateway.core.backoff import Backoff
from gateway.core.bounded import BoundedMap
from gateway.core.cancellation import still_ours
from gateway.core.outage import OutageLog


def test_a_bounded_map_never_passes_its_limit_and_drops_the_oldest_first() -> None:
    seen: BoundedMap[int, str] = BoundedMap(3)
    for i in range(10):
        seen[i] = str(i)
        assert len(seen) <= 3
    assert list(seen) == [7, 8, 9]
    seen[7] = "again"  # an overwrite is news: it goes to the back
    seen[10] = "10"
    assert list(seen) == [9, 7, 10]


def test_a_touching_bounded_map_keeps_what_is_read() -> None:
    lru: BoundedMap[str, int] = BoundedMap(2, touch=True)
    lru["a"], lru["b"] = 1, 2
    assert lru["a"] == 1
    lru["c"] = 3
    assert list(lru) == ["a", "c"]
    plain: BoundedMap[str, int] = BoundedMap(2)
    plain["a"], plain["b"] = 1, 2
    assert plain.get("a") == 1
    plain["c"] = 3
    assert list(plain) == ["b", "c"]


def test_add_says_whether_the_key_was_already_there() -> None:
    recent: BoundedMap[str, None] = BoundedMap(2)
    assert recent.add("m1", None) is False
    assert recent.add("m1", None) is True
    recent.add("m2", None)
    recent.add("m3", None)
    assert recent.add("m1", None) is False  # forgotten: the window is two
    assert recent.pop("nope") is None and recent.pop("m3") is None and "m3" not in recent
    with pytest.raises(ValueError):
        BoundedMap(0)


def test_backoff_doubles_up_to_its_cap_and_starts_again_after_a_success() -> None:
    random.seed(7)
    b = Backoff(0.5, 4.0, jitter=0.0)
    assert [b.step() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.attempt == 6
    b.reset()
    assert b.step() == 0.5
    jittered = Backoff(1.0, 8.0, jitter=0.1)
    delays = [jittered.step() for _ in range(5)]
    for delay, base in zip(delays, [1, 2, 4, 8, 8], strict=True):
        assert base * 0.9 <= delay <= base * 1.1
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)
    down_for_days = Backoff(1.0, 60.0, jitter=0.0)
    for _ in range(5000):  # past what a float exponent holds: still the cap, never an OverflowError
        assert down_for_days.step() <= 60.0
    assert down_for_days.peek() == 60.0


def test_an_outage_is_logged_once_per_kind_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.outage")
    outage = OutageLog(logger, "store")
    with caplog.at_level(logging.DEBUG, logger="test.outage"):
        assert outage.recovered("fine") is False  # nothing was wrong: nothing to say
        assert outage.failed("refused", "connection refused") is True
        for _ in range(50):
            assert outage.failed("refused", "connection refused") is False
        assert outage.failed("disk", "disk full", level=logging.ERROR) is True
        assert outage.failing
        assert outage.recovered("back") is True
        assert outage.recovered("back") is False
    loud = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert loud == [(logging.WARNING, "store: connection refused"), (logging.ERROR, "store: disk full"),
                    (logging.INFO, "store: back")]


class _Guard:
    def __init__(self, clock: bool, store: bool) -> None:
        self.clock, self.store, self.asked = clock, store, 0

    def __call__(self) -> bool:
        return self.clock

    async def confirm(self) -> bool:
        self.asked += 1
        return self.store


async def test_still_ours_asks_the_lease_store_only_when_the_clock_cannot_tell() -> None:
    assert await still_ours(None)
    sure = _Guard(clock=True, store=False)
    assert await still_ours(sure) and sure.asked == 0
    paused = _Guard(clock=False, store=True)
    assert await still_ours(paused) and paused.asked == 1
    lost = _Guard(clock=False, store=False)
    assert not await still_ours(lost) and lost.asked == 1
