"""LRU cache of live per-session agents.

Idle and running entries live in two insertion-ordered dicts, so every operation is O(1):
eviction takes the least recently used idle agent first. Every entry belongs to a *group* (the
router's groups are tenants), and a running agent is evicted only to make room for another
session of its own group (with `when_full = "evict_oldest"`), never for another group's: a
tenant that fills the cache with running turns can cut its own oldest one, never another
tenant's. A group may also be capped (`max_per_group`): at its cap, a new session of the group
takes the place of the group's least recently used idle one. The owner decides what evicting a
running agent means — the router hard_cancels exactly that session.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

A = TypeVar("A")
WhenFull = Literal["evict_oldest", "reject"]


@dataclass
class CacheSettings:
    """The `[agent_cache]` section of the config."""

    max_agents: int = 256
    idle_ttl_s: float = 3600.0
    when_full: WhenFull = "evict_oldest"


class CacheFull(Exception):
    """No slot can be freed: every one holds a running agent (of another group, or the policy is
    `reject`), or the group is at its cap with all its agents running."""


class _Entry(Generic[A]):
    __slots__ = ("agent", "group", "last_used")

    def __init__(self, agent: A, now: float, group: str) -> None:
        self.agent = agent
        self.last_used = now
        self.group = group


class AgentCache(Generic[A]):
    def __init__(self, *, max_agents: int = 256, idle_ttl_s: float = 3600.0,
                 when_full: WhenFull = "evict_oldest",
                 on_evict: Callable[[str, A, bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 max_per_group: Callable[[str], float] | None = None) -> None:
        """`max_per_group(group)`: read at each insert (a reload may change it); 0 or None: no cap."""
        if max_agents < 1:
            raise ValueError("max_agents must be at least 1")
        self.max_agents = max_agents
        self.idle_ttl_s = idle_ttl_s
        self.when_full = when_full
        self._on_evict = on_evict
        self._clock = clock
        self._max_per_group = max_per_group
        self._idle: dict[str, _Entry[A]] = {}
        self._running: dict[str, _Entry[A]] = {}
        self._groups: dict[str, int] = {}  # group -> entries it holds
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._idle) + len(self._running)

    def __contains__(self, key: str) -> bool:
        return key in self._idle or key in self._running

    def keys(self) -> Iterator[str]:
        yield from self._idle
        yield from self._running

    def get(self, key: str) -> A | None:
        """The agent for `key`, marked most recently used; None on a miss."""
        now = self._clock()
        entry = self._idle.pop(key, None)
        if entry is not None:
            self._idle[key] = entry
        else:
            entry = self._running.pop(key, None)
            if entry is None:
                self.misses += 1
                return None
            self._running[key] = entry
        entry.last_used = now
        self.hits += 1
        return entry.agent

    def peek(self, key: str) -> A | None:
        """The agent for `key` without marking it used or counting a hit."""
        entry = self._idle.get(key) or self._running.get(key)
        return entry.agent if entry is not None else None

    def group_size(self, group: str) -> int:
        return self._groups.get(group, 0)

    def put(self, key: str, agent: A, group: str = "") -> None:
        """Insert (idle) into `group`, evicting to make room; raises CacheFull when no entry may go."""
        if key in self:
            self.discard(key)
        cap = self._max_per_group(group) if self._max_per_group is not None else 0
        if cap > 0 and self._groups.get(group, 0) >= cap:
            self._evict_from(group)
        while len(self) >= self.max_agents:
            self._evict_one(group)
        self._idle[key] = _Entry(agent, self._clock(), group)
        self._groups[group] = self._groups.get(group, 0) + 1

    def mark_running(self, key: str, running: bool) -> None:
        """Move an entry between idle and running (most recently used end of either)."""
        src, dst = (self._idle, self._running) if running else (self._running, self._idle)
        entry = src.pop(key, None)
        if entry is not None:
            entry.last_used = self._clock()
            dst[key] = entry

    def discard(self, key: str) -> A | None:
        """Remove without eviction callbacks (the owner is dropping it on purpose)."""
        entry = self._idle.pop(key, None) or self._running.pop(key, None)
        if entry is None:
            return None
        self._left(entry)
        return entry.agent

    def expire_idle(self) -> int:
        """Evict idle agents unused for `idle_ttl_s`; returns how many went."""
        cutoff = self._clock() - self.idle_ttl_s
        count = 0
        while self._idle:
            key, entry = next(iter(self._idle.items()))
            if entry.last_used > cutoff:
                break
            del self._idle[key]
            self._evicted(key, entry, False)
            count += 1
        return count

    def _evict_one(self, group: str) -> None:
        """Room for an entry of `group`: the least recently used idle entry of any group goes, else
        (evict_oldest) the oldest running entry of `group` itself — never another group's."""
        if self._idle:
            key = next(iter(self._idle))
            self._evicted(key, self._idle.pop(key), False)
            return
        if self.when_full == "evict_oldest" and self._evict_running(group):
            return
        raise CacheFull(f"all {self.max_agents} agent slots are running a turn")

    def _evict_from(self, group: str) -> None:
        """`group` is at its cap: its least recently used idle entry goes, else (evict_oldest) its
        oldest running one."""
        key = next((k for k, e in self._idle.items() if e.group == group), None)
        if key is not None:
            self._evicted(key, self._idle.pop(key), False)
            return
        if self.when_full == "evict_oldest" and self._evict_running(group):
            return
        raise CacheFull(f"each of the {self._groups.get(group, 0)} sessions its tenant may keep is running a turn")

    def _evict_running(self, group: str) -> bool:
        key = next((k for k, e in self._running.items() if e.group == group), None)
        if key is None:
            return False
        self._evicted(key, self._running.pop(key), True)
        return True

    def _left(self, entry: _Entry[A]) -> None:
        left = self._groups[entry.group] - 1
        if left:
            self._groups[entry.group] = left
        else:
            del self._groups[entry.group]

    def _evicted(self, key: str, entry: _Entry[A], running: bool) -> None:
        self._left(entry)
        self.evictions += 1
        if self._on_evict is not None:
            self._on_evict(key, entry.agent, running)
