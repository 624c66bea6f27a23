"""Ingress singletons as the platforms see them: in cluster mode one worker polls Telegram per bot
token, and one holds each Discord shard; gateway.cluster.ingress provides the lease behind it."""

from __future__ import annotations

from typing import Protocol


class IngressLeader(Protocol):
    def held(self) -> bool:
        """Is this worker the leader now (provably, no I/O)?"""

    async def wait(self) -> None:
        """Return once this worker is the leader (standing by meanwhile)."""

    async def attempt(self) -> float | None:
        """One try at leading: None once this worker is the leader, else the seconds to wait
        before the next try."""

    async def release(self) -> None:
        """Stop leading now, so that another worker takes over at once (a clean stop)."""

    async def live_workers(self) -> int:
        """How many workers are alive (what a fair share of several leases is counted against;
        0 if it cannot be known now)."""

    async def load(self, field: str) -> str | None:
        """State the previous leader handed on (e.g. the Telegram offset)."""

    async def save(self, field: str, value: str) -> None:
        """Hand state on to the next leader; only the leader may write it."""
