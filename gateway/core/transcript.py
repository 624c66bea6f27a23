"""Transcript rows, and how one turn's agent events become rows — including when it is stopped."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.core.cancellation import ReasonKind, ToolReason

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model produced it

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One transcript row. `interrupted_by`/`reason` mark rows cut short by a hard_cancel."""

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    interrupted_by: ReasonKind | None = None
    reason: str | None = None
    created_at: float = field(default_factory=time.time)

    def model_content(self) -> str:
        """The content as the model should see it: interrupted assistant text carries its marker."""
        if self.role == "assistant" and self.interrupted_by and self.reason:
            marker = ToolReason(self.interrupted_by, self.reason).marker
            return f"{self.content}\n\n{marker}" if self.content else marker
        return self.content

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.model_content()}
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out

    def tool_calls_json(self) -> str | None:
        return json.dumps([c.to_dict() for c in self.tool_calls], ensure_ascii=False) if self.tool_calls else None

    @staticmethod
    def tool_calls_from_json(text: str | None) -> tuple[ToolCall, ...]:
        if not text:
            return ()
        return tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                     for c in json.loads(text))


# --- events an agent yields while it runs a turn -------------------------------------------

@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallsRequested:
    """A model round ended by asking for tools; `text` is what it said before asking."""

    text: str
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class ToolResult:
    call_id: str
    content: str


AgentEvent = TextDelta | ToolCallsRequested | ToolResult


class TurnRecorder:
    """Accumulates a turn's rows from agent events, so a stop at any point leaves a true record."""

    __slots__ = ("_earlier", "_open_calls", "_partial", "rows")

    def __init__(self) -> None:
        self.rows: list[ChatMessage] = []
        self._partial: list[str] = []
        self._earlier = 0  # length of the text streamed in the turn's earlier rounds
        self._open_calls: dict[str, ToolCall] = {}

    @property
    def text(self) -> str:
        """Assistant text of the current round so far."""
        return "".join(self._partial)

    def feed(self, event: AgentEvent) -> None:
        if isinstance(event, TextDelta):
            self._partial.append(event.text)
        elif isinstance(event, ToolCallsRequested):
            self.rows.append(ChatMessage("assistant", event.text, tool_calls=event.calls))
            self._earlier += len(self.text)
            self._partial.clear()
            self._open_calls.update((c.id, c) for c in event.calls)
        else:
            self._open_calls.pop(event.call_id, None)
            self.rows.append(ChatMessage("tool", event.content, tool_call_id=event.call_id))

    def complete(self) -> list[ChatMessage]:
        self.rows.append(ChatMessage("assistant", self.text))
        return self.rows

    def interrupted(self, reason: ToolReason, shown: str | None = None) -> list[ChatMessage]:
        """Rows for a stopped turn: in-flight tools get the marker, partial text is kept and marked.
        `shown` (the turn's streamed text the user saw, see `Reply.shown_text`) cuts the partial
        text down to what was shown; None keeps all of it."""
        partial = self.text if shown is None else shown[self._earlier:][:len(self.text)]
        cut_tools = bool(self._open_calls)
        for call in self._open_calls.values():
            self.rows.append(ChatMessage("tool", reason.marker, tool_call_id=call.id,
                                         interrupted_by=reason.kind, reason=reason.text))
        self._open_calls.clear()
        # The turn ends with the marker: on the interrupted tool results, or else on an assistant
        # row (also when a tool round had finished and the next model round never began).
        if self._partial or not cut_tools:
            self.rows.append(ChatMessage("assistant", partial,
                                         interrupted_by=reason.kind, reason=reason.text))
        return self.rows

    def failed(self, error: str) -> list[ChatMessage]:
        """Rows for a turn the provider failed: the model later sees that it errored."""
        for call in self._open_calls.values():
            self.rows.append(ChatMessage("tool", f"[error: {error}]", tool_call_id=call.id))
        self._open_calls.clear()
        self.rows.append(ChatMessage("assistant", self.text or f"[error: {error}]"))
        return self.rows
