"""LRU cache of live per-session agents.

Idle and running entries live in two insertion-ordered dicts, so every operation is O(1):
eviction takes the least recently used idle agent first and only touches a running one when
every slot is busy (and `when_full = "evict_oldest"`). The owner decides what evicting a
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
    """Every slot holds a running agent and the policy is `reject`."""


class _Entry(Generic[A]):
    __slots__ = ("agent", "last_used")

    def __init__(self, agent: A, now: float) -> None:
        self.agent = agent
        self.last_used = now


class AgentCache(Generic[A]):
    def __init__(self, *, max_agents: int = 256, idle_ttl_s: float = 3600.0,
                 when_full: WhenFull = "evict_oldest",
                 on_evict: Callable[[str, A, bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_agents < 1:
            raise ValueError("max_agents must be at least 1")
        self.max_agents = max_agents
        self.idle_ttl_s = idle_ttl_s
        self.when_full = when_full
        self._on_evict = on_evict
        self._clock = clock
        self._idle: dict[str, _Entry[A]] = {}
        self._running: dict[str, _Entry[A]] = {}
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

    def put(self, key: str, agent: A) -> None:
        """Insert (idle), evicting to make room; raises CacheFull under the `reject` policy."""
        if key in self:
            self.discard(key)
        while len(self) >= self.max_agents:
            self._evict_one()
        self._idle[key] = _Entry(agent, self._clock())

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
        return entry.agent if entry else None

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

    def _evict_one(self) -> None:
        if self._idle:
            key = next(iter(self._idle))
            self._evicted(key, self._idle.pop(key), False)
        elif self.when_full == "reject":
            raise CacheFull(f"all {self.max_agents} agent slots are running a turn")
        else:
            key = next(iter(self._running))
            self._evicted(key, self._running.pop(key), True)

    def _evicted(self, key: str, entry: _Entry[A], running: bool) -> None:
        self.evictions += 1
        if self._on_evict is not None:
            self._on_evict(key, entry.agent, running)
