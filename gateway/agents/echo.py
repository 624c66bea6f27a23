"""The offline default agent: echoes the user's words back, one at a time.

`!sleep N` runs the `sleep N` program as a tool subprocess, so /stop can be tried without a model.
The gateway's own messages are answered as a person would want, never echoed: asked to continue
after a restart, it echoes the rest of the words it was cut off in; told a background job ended,
it says so in a sentence.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import AsyncIterator, Sequence

from gateway.agents.tools import ToolRegistry
from gateway.core.ports import TurnContext
from gateway.core.transcript import AgentEvent, ChatMessage, TextDelta, ToolCall, ToolCallsRequested, ToolResult

_SLEEP = re.compile(r"^!sleep\s+(\d+(?:\.\d+)?)\s*$")
_call_ids = itertools.count(1)


class EchoAgent:
    def __init__(self, tools: ToolRegistry, *, delay_s: float = 0.05) -> None:
        self.tools = tools
        self.delay_s = delay_s

    @property
    def description(self) -> str:
        return "echo"

    async def run_turn(self, history: Sequence[ChatMessage], message: ChatMessage,
                       context: TurnContext | None = None) -> AsyncIterator[AgentEvent]:
        if match := _SLEEP.match(message.content.strip()):
            call = ToolCall(f"call_echo_{next(_call_ids)}", "sleep", json.dumps({"seconds": float(match[1])}))
            yield ToolCallsRequested("", (call,))
            result = await self.tools.call(call.name, call.arguments)
            yield ToolResult(call.id, result)
            yield TextDelta(f"Done: {result}.")
            return
        words = re.findall(r"\S+\s*", _answerable(history, message))
        for i, word in enumerate(words):
            if self.delay_s and i:
                await asyncio.sleep(self.delay_s)
            yield TextDelta(word)


def _answerable(history: Sequence[ChatMessage], message: ChatMessage) -> str:
    """The words to echo: the user's own, or — for the gateway's own message — what a person expects."""
    if message.kind == "job":  # "[background job 3 finished: exit 0]" and its output
        first = message.content.split("\n", 1)[0].strip("[]")
        return f"{first[0].upper()}{first[1:]}." if first else "A background job ended."
    if message.kind != "resume":
        return message.content
    # Continue the cut-off echo: the rest of the last words the user sent, after what was shown.
    said = ""
    for row in reversed(history):
        if row.role == "assistant" and not row.tool_calls:
            said = said or row.content
        elif row.role == "user" and row.kind == "message":
            rest = row.content[len(said):] if row.content.startswith(said) else row.content
            return rest.lstrip() or "(that was all)"
    return "(nothing to continue)"
