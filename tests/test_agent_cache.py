"""The LRU agent cache: idle agents go first, running ones only when every slot is busy."""

from __future__ import annotations

import pytest

from agent_cache import AgentCache, CacheFull


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(max_agents: int = 3, **kw: object) -> tuple[AgentCache[str], list[tuple[str, bool]], Clock]:
    evicted: list[tuple[str, bool]] = []
    clock = Clock()
    cache: AgentCache[str] = AgentCache(max_agents=max_agents, on_evict=lambda k, _a, r: evicted.append((k, r)),
                                        clock=clock, **kw)  # type: ignore[arg-type]
    return cache, evicted, clock


def test_least_recently_used_idle_agent_goes_first() -> None:
    cache, evicted, _ = make()
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == "A"  # a is now the most recently used
    cache.put("d", "D")
    assert evicted == [("b", False)]
    assert sorted(cache.keys()) == ["a", "c", "d"]
    assert (cache.hits, cache.misses) == (1, 0)
    assert cache.get("b") is None and cache.misses == 1


def test_running_agents_are_spared_while_any_idle_one_exists() -> None:
    cache, evicted, _ = make()
    for key in "abc":
        cache.put(key, key)
    cache.mark_running("a", True)
    cache.mark_running("b", True)
    cache.put("d", "d")
    assert evicted == [("c", False)]
    cache.mark_running("d", True)
    cache.put("e", "e")  # everything runs: the oldest running one goes, flagged as running
    assert evicted[-1] == ("a", True)
    cache.mark_running("b", False)
    cache.put("f", "f")  # idle ones go first, least recently used first: e, then b
    cache.put("g", "g")
    assert evicted[-2:] == [("e", False), ("b", False)] and "d" in cache


def test_reject_policy_raises_instead_of_evicting_a_running_agent() -> None:
    cache, evicted, _ = make(max_agents=2, when_full="reject")
    cache.put("a", "a")
    cache.put("b", "b")
    cache.mark_running("a", True)
    cache.mark_running("b", True)
    with pytest.raises(CacheFull):
        cache.put("c", "c")
    assert evicted == [] and len(cache) == 2


def test_idle_agents_expire_after_the_ttl_but_running_ones_do_not() -> None:
    cache, evicted, clock = make(max_agents=10, idle_ttl_s=60)
    cache.put("old", "x")
    cache.put("busy", "y")
    cache.mark_running("busy", True)
    clock.now = 30
    cache.put("young", "z")
    clock.now = 61
    assert cache.expire_idle() == 1
    assert evicted == [("old", False)]
    assert sorted(cache.keys()) == ["busy", "young"]


def test_discard_is_silent() -> None:
    cache, evicted, _ = make()
    cache.put("a", "a")
    assert cache.discard("a") == "a" and evicted == [] and "a" not in cache
    assert cache.discard("a") is None
