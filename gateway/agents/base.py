"""The one protocol every agent implements: run a turn, yield streaming events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from gateway.core.transcript import AgentEvent, ChatMessage


class AgentError(Exception):
    """The agent could not produce an answer; the text is safe to show the user."""


class Agent(Protocol):
    @property
    def description(self) -> str:
        """Agent kind and model, for /status and /v1/models."""

    def run_turn(self, history: Sequence[ChatMessage], message: ChatMessage) -> AsyncIterator[AgentEvent]:
        """Stream one turn. Tool calls run inside; cancellation arrives as CancelledError."""
