"""Fences: the proof of ownership every session-scoped write carries.

In cluster mode a fence is minted only from a session lease (its fencing number grows with every
acquisition), and the shared stores refuse a write whose fence is stale or missing — so a worker
that lost a session, or a previous incarnation of this one, cannot change it. A single process
owns every session: its writes carry `Fence.local`, which only a store that is not shared accepts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Fence:
    session_key: str
    number: int  # 0: single-process ownership, never accepted by a shared store

    @classmethod
    def local(cls, session_key: str) -> Fence:
        return cls(session_key, 0)

    @property
    def is_local(self) -> bool:
        return self.number == 0
