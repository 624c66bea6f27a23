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


def test_a_running_agent_is_evicted_only_for_a_session_of_its_own_group() -> None:
    """Issue 31, finding 1: tenant B filling the cache with running turns cut tenant A's."""
    evicted: list[tuple[str, bool]] = []
    cache: AgentCache[str] = AgentCache(max_agents=3, on_evict=lambda k, _a, r: evicted.append((k, r)))
    for key, group in (("a1", "A"), ("b1", "B"), ("b2", "B")):
        cache.put(key, key, group)
        cache.mark_running(key, True)
    cache.put("b3", "b3", "B")  # B's own oldest running turn makes room, never A's
    assert evicted == [("b1", True)] and "a1" in cache
    cache.mark_running("b3", True)
    with pytest.raises(CacheFull):  # a tenant with no running turn of its own to give up waits
        cache.put("c1", "c1", "C")
    assert "a1" in cache and len(cache) == 3


def test_a_group_at_its_cap_gives_up_its_own_least_recently_used_idle_agent() -> None:
    evicted: list[tuple[str, bool]] = []
    cache: AgentCache[str] = AgentCache(max_agents=10, on_evict=lambda k, _a, r: evicted.append((k, r)),
                                        max_per_group=lambda group: 2 if group == "B" else 0)
    cache.put("a1", "a1", "A")
    cache.put("b1", "b1", "B")
    cache.put("b2", "b2", "B")
    cache.get("b1")  # b2 is now B's least recently used
    cache.put("b3", "b3", "B")
    assert evicted == [("b2", False)] and cache.group_size("B") == 2 and cache.group_size("A") == 1
    cache.mark_running("b1", True)
    cache.mark_running("b3", True)
    cache.put("b4", "b4", "B")  # all of B's running: its oldest running one goes (evict_oldest)
    assert evicted[-1] == ("b1", True) and "a1" in cache
    strict: AgentCache[str] = AgentCache(max_agents=10, when_full="reject", max_per_group=lambda _g: 1)
    strict.put("x", "x", "X")
    strict.mark_running("x", True)
    with pytest.raises(CacheFull):
        strict.put("y", "y", "X")
    assert cache.discard("b4") == "b4" and cache.group_size("B") == 1
