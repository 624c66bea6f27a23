"""The store interface the router depends on; SQLite now, Redis for clusters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.core.messages import InboundMessage
from gateway.core.transcript import ChatMessage


class StoreError(Exception):
    """The store could not do what was asked (disk full, Redis down, fenced out...)."""


@dataclass(frozen=True, slots=True)
class InboundRecord:
    id: int
    session_key: str
    message: InboundMessage
    # "accepted": never started; "running": the process died mid-turn; "restart": a graceful
    # restart cancelled it (to be resumed)
    status: str
    received_at: float


@dataclass(frozen=True, slots=True)
class SessionInfo:
    key: str
    conversation: int
    updated_at: float
    messages: int


class Store(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def ping(self) -> bool: ...

    async def accept_inbound(self, session_key: str, msg: InboundMessage) -> int | None:
        """Durably record an inbound message; None if (platform, message id) was seen before."""

    async def finish_inbound(self, session_key: str, inbound_id: int, status: str,
                             detail: str | None = None) -> None:
        """Mark an accepted message done, cancelled or rejected, so it is not replayed."""

    async def unfinished_inbound(self, session_key: str | None = None) -> list[InboundRecord]:
        """Messages whose turn never ended (the process stopped first), oldest first — of one
        session, or of all sessions this store can enumerate cheaply (a shared store: none)."""

    async def conversation(self, session_key: str) -> tuple[int, list[ChatMessage]]:
        """The session's current conversation number and its history."""

    async def append(self, session_key: str, conversation: int, rows: Sequence[ChatMessage],
                     *, fence: int | None = None, inbound: tuple[int, str, str | None] | None = None) -> None:
        """Add rows to one conversation of a session (`fence` guards cluster ownership), and set
        `inbound` = (id, status, detail) of the message being answered in the same transaction."""

    async def reset(self, session_key: str) -> int:
        """Archive the current conversation and start a new one; returns its number."""

    async def sessions(self, limit: int = 100) -> list[SessionInfo]: ...

    async def is_paired(self, platform: str, user_id: str) -> bool: ...

    async def pairing_code(self, platform: str, user_id: str, user_name: str, *, code: str,
                           ttl_s: float, max_pending: int) -> str | None:
        """The user's pending code (reusing an unexpired one, else `code`); None if too many pend."""

    async def approve_pairing(self, code: str, *, ttl_s: float) -> tuple[str, str, str] | None:
        """Approve a pending code: (platform, user id, name), or None if unknown or expired."""

    async def pairing_state(self) -> tuple[list[tuple[str, str, str, str, float]], list[tuple[str, str, str]]]: ...
