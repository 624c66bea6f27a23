"""What a client asked of one turn beyond its message, and what the agent tells it back.

A chat message is words and attachments. A request to the HTTP API carries more: the client's own
system instructions, the tool rounds it ran itself since its last user message, its tools and its
sampling parameters; and its answer reports more: the tokens it used, the tool calls left to the
client. The platform puts a `TurnOptions` on the message (`InboundMessage.extra`, never stored or
forwarded); the core hands it to the agent untouched (`TurnContext.options`); the agent writes
its `report`, which the platform reads once the turn has ended.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.core.messages import InboundMessage
from gateway.core.transcript import ChatMessage, ToolCall

EXTRA_KEY = "turn_options"  # where a message carries its options in `InboundMessage.extra`


@dataclass(slots=True)
class TurnReport:
    """Filled in by the agent while the turn runs: token counts (the provider's, or our estimate
    for a round it gave none for: then `estimated`) and the calls of the client's tools the answer
    ends with."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated: bool = False
    tool_calls: tuple[ToolCall, ...] = ()

    def add(self, prompt_tokens: int, completion_tokens: int, *, estimated: bool = False) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.estimated = self.estimated or estimated


@dataclass(frozen=True, slots=True)
class TurnOptions:
    """`instructions`: the client's system messages, sent after the agent's own system prompt and
    never left out for the context budget. `continuation`: the rows after the new user message (the
    client's tool calls and their results), sent after it. `tools`: the client's tool schemas, offered
    instead of the agent's own (None: the agent's; empty: none at all); a round that calls them ends
    the turn with the calls in the report. `params`: provider parameters (temperature, max_tokens,
    tool_choice...) passed as the client gave them. `model`: a further model the client named (None:
    the agent's own)."""

    instructions: tuple[ChatMessage, ...] = ()
    continuation: tuple[ChatMessage, ...] = ()
    tools: tuple[Mapping[str, Any], ...] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    model: str | None = None
    report: TurnReport = field(default_factory=TurnReport)

    def on(self, msg: InboundMessage) -> InboundMessage:
        """`msg`, carrying these options."""
        msg.extra[EXTRA_KEY] = self
        return msg


def options_of(msg: InboundMessage) -> TurnOptions | None:
    """The options a message carries, if any."""
    options = msg.extra.get(EXTRA_KEY)
    return options if isinstance(options, TurnOptions) else None
