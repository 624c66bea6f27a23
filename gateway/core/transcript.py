"""Transcript rows, and how one turn's agent events become rows — including when it is stopped."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.core.attachments import MediaPart
from gateway.core.cancellation import GATEWAY_RESTART, ReasonKind, ToolReason
from gateway.core.messages import RESUME_PREFIX as RESUME_PREFIX

Role = Literal["system", "user", "assistant", "tool"]
RowKind = Literal["message", "resume", "job"]  # what a user row is: the user's words, or the gateway's own

# Message ids of the messages the gateway writes itself, and how their rows read.
JOB_PREFIX = "job:"  # a background job ended
_RESUME_ASK = "Continue from where you stopped, without repeating what you already said."
_JOB_MARK = "[background job "
RESUME_PROMPT = f"{GATEWAY_RESTART.marker} The gateway restarted while you were answering. {_RESUME_ASK}"


def resume_prompt(reason: ToolReason) -> str:
    """The automatic message that asks the model to continue, naming what cut it off."""
    if reason == GATEWAY_RESTART:
        return RESUME_PROMPT
    return f"{reason.marker} Your answer was cut off. {_RESUME_ASK}"


def is_automatic(message_id: str) -> bool:
    """Is this the id of a message the gateway wrote itself (a resume), not one a user sent?"""
    return message_id.startswith(RESUME_PREFIX)


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
    # This turn's images and files as the model gets them; never stored (the content keeps placeholders).
    media: tuple[MediaPart, ...] = field(default=(), compare=False, repr=False)

    @property
    def kind(self) -> RowKind:
        """What this row is. A user row may be the gateway's own words (a resume prompt, a job's
        end): the model reads them like any message, a person is never shown them as theirs."""
        if self.role != "user" or not self.content.startswith("["):
            return "message"
        if self.content.startswith("[interrupted by system: ") and _RESUME_ASK in self.content:
            return "resume"
        if self.content.startswith(_JOB_MARK):
            return "job"
        return "message"

    def model_content(self) -> str:
        """The content as the model should see it: interrupted assistant text carries its marker."""
        if self.role == "assistant" and self.interrupted_by and self.reason:
            marker = ToolReason(self.interrupted_by, self.reason).marker
            return f"{self.content}\n\n{marker}" if self.content else marker
        return self.content

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.model_content()}
        if self.media:  # content parts: the text, then each image or file
            out["content"] = [{"type": "text", "text": out["content"]}, *(p.to_openai() for p in self.media)]
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


@dataclass(frozen=True, slots=True)
class Interjection:
    """The user's messages handed to the model between two rounds of this turn (busy "steer")."""

    text: str


@dataclass(frozen=True, slots=True)
class Usage:
    """What the provider counted for one model round; `estimated_prompt` is our own estimate."""

    prompt_tokens: int
    completion_tokens: int
    estimated_prompt: int


AgentEvent = TextDelta | ToolCallsRequested | ToolResult | Interjection | Usage
ROUND_SEPARATOR = "\n\n"  # shown between an answer and its continuation after an interjection


async def without_prompt(events: AsyncIterator[AgentEvent], prompt: str) -> AsyncIterator[AgentEvent]:
    """The events of a turn that answers the gateway's own words (a resume request, a job's end),
    with those words taken out of its text: they are for the model, and an agent that repeats its
    input (the echo agent, a model quoting it) must not show them to the user. Text that could be
    the start of `prompt` is held until it turns out to be something else (or a boundary comes)."""
    held = ""
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                shown, held = _outside(held + event.text, prompt)
                if shown:
                    yield TextDelta(shown)
                continue
            if held:  # a boundary: what was held is not the prompt
                yield TextDelta(held)
                held = ""
            yield event
        if held:
            yield TextDelta(held)
    finally:
        if isinstance(events, AsyncGenerator):
            await events.aclose()


def _outside(text: str, prompt: str) -> tuple[str, str]:
    """(`text` without copies of `prompt`, its tail that may be the start of one)."""
    text = text.replace(prompt, "")
    for n in range(min(len(text), len(prompt) - 1), 0, -1):
        if prompt.startswith(text[-n:]):
            return text[:-n], text[-n:]
    return text, ""


class TurnRecorder:
    """Accumulates a turn's rows from agent events, so a stop at any point leaves a true record.
    Tool results are recorded in the order the model asked for the calls, whatever order they
    finished in (calls may run in parallel)."""

    __slots__ = ("_calls", "_earlier", "_kept", "_partial", "_results", "rows")

    def __init__(self) -> None:
        self.rows: list[ChatMessage] = []
        self._partial: list[str] = []
        self._earlier = 0  # length of the text streamed in the turn's earlier rounds (separators too)
        self._kept = ""  # what the reply keeps showing above the current round (answers before an interjection)
        self._calls: list[ToolCall] = []  # the current round's calls whose rows are not written yet
        self._results: dict[str, str] = {}

    @property
    def text(self) -> str:
        """Assistant text of the current round so far."""
        return "".join(self._partial)

    @property
    def final_text(self) -> str:
        """The whole answer as the reply should end up showing it."""
        return self._kept + self.text

    @property
    def has_text(self) -> bool:
        """Has this turn streamed any text yet (so a continuation needs a separator)?"""
        return self._earlier > 0 or bool(self._partial)

    def feed(self, event: AgentEvent) -> None:
        if isinstance(event, TextDelta):
            self._partial.append(event.text)
        elif isinstance(event, ToolCallsRequested):
            self.rows.append(ChatMessage("assistant", event.text, tool_calls=event.calls))
            self._earlier += len(self.text)
            self._partial.clear()
            self._calls += event.calls
        elif isinstance(event, ToolResult):
            self._results[event.call_id] = event.content
            while self._calls and self._calls[0].id in self._results:  # in the order asked for
                call = self._calls.pop(0)
                self.rows.append(ChatMessage("tool", self._results.pop(call.id), tool_call_id=call.id))
        elif isinstance(event, Interjection):
            separator = ROUND_SEPARATOR if self.has_text else ""
            if self._partial:  # the answer so far, then what the user added, then its continuation
                self.rows.append(ChatMessage("assistant", self.text))
            self._kept += self.text + separator
            self._earlier += len(self.text) + len(separator)
            self._partial.clear()
            self.rows.append(ChatMessage("user", event.text))

    def complete(self) -> list[ChatMessage]:
        self.rows.append(ChatMessage("assistant", self.text))
        return self.rows

    def interrupted(self, reason: ToolReason, shown: str | None = None,
                    notes: dict[str, str] | None = None) -> list[ChatMessage]:
        """Rows for a stopped turn: in-flight tools get the marker, partial text is kept and marked.
        `shown` (the turn's streamed text the user saw, see `Reply.shown_text`) cuts the partial
        text down to what was shown; None keeps all of it. `notes` (by call id) say what became of
        an in-flight call (its command moved to the background): put before its marker."""
        partial = self.text if shown is None else shown[self._earlier:][:len(self.text)]
        cut_tools = any(call.id not in self._results for call in self._calls)
        for call in self._calls:  # finished ones keep their result; the rest get the marker
            if call.id in self._results:
                self.rows.append(ChatMessage("tool", self._results.pop(call.id), tool_call_id=call.id))
            else:
                note = (notes or {}).get(call.id)
                self.rows.append(ChatMessage("tool", f"{note}\n{reason.marker}" if note else reason.marker,
                                             tool_call_id=call.id, interrupted_by=reason.kind, reason=reason.text))
        self._calls.clear()
        # The turn ends with the marker: on the interrupted tool results, or else on an assistant
        # row (also when a tool round had finished and the next model round never began).
        if self._partial or not cut_tools:
            self.rows.append(ChatMessage("assistant", partial,
                                         interrupted_by=reason.kind, reason=reason.text))
        return self.rows

    def failed(self, error: str) -> list[ChatMessage]:
        """Rows for a turn the provider failed: the model later sees that it errored."""
        for call in self._calls:
            content = self._results.pop(call.id, None)
            self.rows.append(ChatMessage("tool", content if content is not None else f"[error: {error}]",
                                         tool_call_id=call.id))
        self._calls.clear()
        self.rows.append(ChatMessage("assistant", self.text or f"[error: {error}]"))
        return self.rows
