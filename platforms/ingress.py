"""Ingress singletons as the platforms see them: in cluster mode one worker polls Telegram (or holds
the Discord gateway) per bot token; gateway.cluster.ingress provides the lease behind it."""

from __future__ import annotations

from typing import Protocol


class IngressLeader(Protocol):
    def held(self) -> bool:
        """Is this worker the leader now (provably, no I/O)?"""

    async def wait(self) -> None:
        """Return once this worker is the leader (standing by meanwhile)."""

    async def load(self, field: str) -> str | None:
        """State the previous leader handed on (e.g. the Telegram offset)."""

    async def save(self, field: str, value: str) -> None:
        """Hand state on to the next leader; only the leader may write it."""
