"""OpenAI's Responses API (`POST /v1/responses`) over the chat completion machinery: a request is
rewritten as the chat completion request it means (its `input` items as messages, its parameters
by their chat names), read by `api_request`, answered by the same turn — the same stop, disconnect
and tenancy — and shaped as a `response` object or its stream of events.

`previous_response_id` is the session. A response that can be continued has an id naming its
chain (`resp_<chain>_<unique>`): the chain is a server-kept session of the caller's tenant
(`resp-<chain>`), so a continuation is one new user message, and a `/stop` sent as one stops the
chain's running answer. A request that starts a chain is one user message (and instructions), with
`store` not false and no client tools; any other request — its own history in `input`, function
tools and their results — is stateless, as a chat completion without a session, and its response
cannot be continued (a client sends the whole input again, as the SDKs' agent loops do).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.core.ids import unique_id
from gateway.core.transcript import ToolCall
from gateway.core.turn_options import TurnReport
from platforms.api_reply import ApiReply, End, SseResponse, failure_response, json_response, switchboard
from platforms.api_request import BadRequest, ChatRequest

SESSION_PREFIX = "resp-"  # a chain's session id: `resp-<chain>`
_CHAINED = re.compile(r"resp_([0-9a-f]{32})_[0-9a-f]{32}")

# Responses parameters and the chat completion parameter each one is (a copy, or a conversion).
_SAME = ("model", "stream", "temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier")
# Accepted and answered for by the gateway itself, or with nothing to do here.
_READ_HERE = ("input", "instructions", "previous_response_id", "store", "metadata", "tools", "tool_choice",
              "max_output_tokens", "text", "reasoning", "truncation", "include", "stream_options")
_REFUSED = {
    "background": "Background responses are not supported: the answer streams or waits on the connection.",
    "conversation": "Conversations are not supported: use previous_response_id.",
    "prompt": "Stored prompts are not supported: send the instructions.",
    "max_tool_calls": "'max_tool_calls' is not supported.",
    "top_logprobs": "Log probabilities are not available through this gateway.",
}


def chain_of(response_id: str) -> str | None:
    """The chain a response id names, if it names one."""
    match = _CHAINED.fullmatch(response_id)
    return match[1] if match else None


@dataclass(frozen=True, slots=True)
class ResponsesAsk:
    chat: dict[str, Any]  # the same request as a chat completion
    previous: str | None  # previous_response_id
    chain: str | None  # the chain this response belongs to (None: it cannot be continued)
    echo: dict[str, Any]  # what the response object repeats of the request


def read_responses(body: Any) -> ResponsesAsk:
    """The request as a chat completion request, or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    for name, value in body.items():
        if value is None:
            continue
        if name in _REFUSED:
            raise BadRequest(_REFUSED[name], param=name)
        if name not in _SAME and name not in _READ_HERE:
            raise BadRequest(f"Unrecognized request argument supplied: {name}", param=name)
    chat: dict[str, Any] = {k: body[k] for k in _SAME if body.get(k) is not None}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string.", param="instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + \
        input_messages(body.get("input"))
    chat.update(_parameters(body))
    previous, chain = _chain(body, chat)
    if chain is not None:
        chat["metadata"] = {"session_id": SESSION_PREFIX + chain}
    return ResponsesAsk(chat, previous, chain, _echo(body, previous))


def _echo(body: dict[str, Any], previous: str | None) -> dict[str, Any]:
    """What a response object repeats of its request (OpenAI's defaults where it gave none)."""
    return {"instructions": body.get("instructions"), "previous_response_id": previous,
            "store": body.get("store") is not False, "metadata": body.get("metadata") or {},
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "truncation": body.get("truncation") or "disabled", "user": body.get("user")}


def _chain(body: dict[str, Any], chat: dict[str, Any]) -> tuple[str | None, str | None]:
    """(previous_response_id, the chain): the previous response's, a new one, or none."""
    previous = body.get("previous_response_id")
    one_message = [m["role"] for m in chat["messages"] if m["role"] != "system"] == ["user"]
    if previous is not None:
        if not isinstance(previous, str):
            raise BadRequest("'previous_response_id' must be a string.", param="previous_response_id")
        chain = chain_of(previous)
        if chain is None:
            raise BadRequest(f"Previous response with id '{previous}' not found.", status=404,
                             param="previous_response_id", code="previous_response_not_found")
        if not one_message or body.get("tools") is not None:
            raise BadRequest("With previous_response_id, 'input' is one user message (and instructions): the "
                             "conversation is kept here. Client tools and their results need the whole "
                             "conversation as input, without previous_response_id.",
                             param="input" if not one_message else "tools")
        return previous, chain
    if body.get("store") is False or not one_message or body.get("tools") is not None:
        return None, None
    return None, secrets.token_hex(16)


# --- input items -----------------------------------------------------------------------------------

_PARTS = {"input_text": "text", "output_text": "text", "text": "text"}


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` (a string, or items: messages, function calls and their outputs) as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' must be a string or a non-empty array of items.", param="input")
    out: list[dict[str, Any]] = []
    for j, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{j}] must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"input[{j}].role must be user, system, developer or assistant.", param="input")
            out.append({"role": role, "content": _content(j, item.get("content"))})
        elif kind == "function_call":
            _function_call(j, item, out)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _content(j, output)})
        elif kind != "reasoning":  # another model's reasoning: nothing a provider here can read
            raise BadRequest(f"input[{j}]: items of type {kind!r} are not supported.", param="input")
    return out


def _content(j: int, content: Any) -> Any:
    """Message content: a string, or Responses parts as chat completion parts."""
    if isinstance(content, str) or not isinstance(content, list):
        return content  # (anything else is refused with the message it is in)
    parts: list[Any] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _PARTS:
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "refusal":
            parts.append(part)
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        elif kind == "input_file":
            parts.append({"type": "file", "file": {"file_data": part.get("file_data"),
                                                   "filename": part.get("filename")}})
        else:
            raise BadRequest(f"input[{j}]: content parts of type {kind!r} are not supported.", param="input")
    return parts


def _function_call(j: int, item: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """A call the model made: on the assistant message just before it (the Responses API gives an
    answer's text and its calls as items of their own; a chat message holds both), else on one of its own."""
    call = {"id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


# --- parameters ------------------------------------------------------------------------------------


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    """The Responses parameters that have another name or shape in a chat completion request."""
    chat: dict[str, Any] = {}
    if (tools := body.get("tools")) is not None:
        chat["tools"] = _tools(tools)
    if (choice := body.get("tool_choice")) is not None:
        named = isinstance(choice, dict) and choice.get("type") == "function"
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} if named else choice
    if (limit := body.get("max_output_tokens")) is not None:
        chat["max_completion_tokens"] = limit
    chat.update(_text_parameters(body.get("text")))
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _text_parameters(text: Any) -> dict[str, Any]:
    """The Responses `text` object (its format and verbosity) as chat completion parameters."""
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object.", param="text")
    chat: dict[str, Any] = {}
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt is not None:
        chat["response_format"] = fmt
    if text.get("verbosity") is not None:
        chat["verbosity"] = text["verbosity"]
    return chat


def _tools(tools: Any) -> list[Any]:
    """Responses function tools (flat) as chat completion tools (nested under `function`)."""
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array.", param="tools")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadRequest(f"tools[{j}]: only function tools are supported.", param="tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                           "strict") if tool.get(k) is not None}})
    return out


# --- the response ----------------------------------------------------------------------------------


def response_usage(report: TurnReport) -> dict[str, Any]:
    return {"input_tokens": report.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": report.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": report.prompt_tokens + report.completion_tokens}


def text_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


class ResponsesShape:
    """Answers as a `response` object, or its events: `response.created`, the output items with
    their text deltas, then `response.completed` (or `.incomplete`: cut short, or `.failed`)."""

    def __init__(self, asked: ResponsesAsk, req: ChatRequest) -> None:
        self.id = f"resp_{asked.chain}_{unique_id()}" if asked.chain else f"resp_{unique_id()}"
        self.created = int(time.time())
        self._model = req.model
        self._echo = asked.echo
        self._streamed = req.stream
        self.message_id = f"msg_{unique_id()}"

    def response(self, status: str, output: list[dict[str, Any]], report: TurnReport,
                 end: End | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self._model,
            "output": output, "usage": response_usage(report) if status != "in_progress" else None,
            "error": None, "incomplete_details": None, **self._echo}
        if end is not None and end.interrupted_by is not None:
            # The standard reason for an answer that ended before the model ended it (see api_reply).
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if end is not None and end.error is not None:
            out["error"] = {"code": "server_error", "message": end.error}
        if end is not None and (extra := switchboard(end, report, streamed=self._streamed)):
            out["switchboard"] = extra
        return out

    def output(self, text: str, end: End, report: TurnReport) -> list[dict[str, Any]]:
        status = "incomplete" if end.interrupted_by is not None else "completed"
        items = [text_item(self.message_id, text, status)] if text else []
        if end.finish_reason == "tool_calls":
            items += [call_item(f"fc_{unique_id()}", call) for call in report.tool_calls]
        return items

    async def whole(self, reply: ApiReply) -> web.StreamResponse:
        end = await reply.outcome()
        if end.error is not None:
            return failure_response(end)
        status = "incomplete" if end.interrupted_by is not None else "completed"
        return json_response(self.response(status, self.output(reply.text, end, reply.report), reply.report, end))

    async def stream(self, request: web.Request, reply: ApiReply, gone: Callable[[], object]) -> web.StreamResponse:
        events = await ResponseEvents.open(request, self)
        try:
            end = await reply.outcome(events.text)
            await events.end(end, reply.report)
        except (ConnectionError, RuntimeError):
            gone()
        finally:
            events.stop_pinging()
        await events.close()
        return events.response

    async def command(self, request: web.Request, text: str) -> web.StreamResponse:
        end, report = End("stop"), TurnReport()
        if not self._streamed:
            return json_response(self.response("completed", self.output(text, end, report), report, end))
        events = await ResponseEvents.open(request, self)
        try:
            await events.text(text)
            await events.end(end, report)
        except (ConnectionError, RuntimeError):
            pass  # nothing runs for it: the client has gone
        finally:
            events.stop_pinging()
        await events.close()
        return events.response


class ResponseEvents(SseResponse):
    """A streamed response: each event an SSE `event:` line naming its type, and its JSON with a
    `sequence_number`. The message item is opened at the first text."""

    def __init__(self, resp: web.StreamResponse, shape: ResponsesShape) -> None:
        super().__init__(resp)
        self._shape = shape
        self._sequence = 0
        self._text = ""  # streamed so far
        self._opened = False

    @classmethod
    async def open(cls, request: web.Request, shape: ResponsesShape) -> ResponseEvents:
        events = cls(await cls.prepared(request), shape)
        events.start_pinging()
        started = shape.response("in_progress", [], TurnReport())
        await events.event("response.created", response=started)
        await events.event("response.in_progress", response=started)
        return events

    async def event(self, kind: str, **fields: Any) -> None:
        await self.write({"type": kind, "sequence_number": self._sequence, **fields}, event=kind)
        self._sequence += 1

    async def text(self, delta: str) -> None:
        where = {"item_id": self._shape.message_id, "output_index": 0, "content_index": 0}
        if not self._opened:
            self._opened = True
            item = text_item(self._shape.message_id, "", "in_progress")
            await self.event("response.output_item.added", output_index=0, item={**item, "content": []})
            await self.event("response.content_part.added", **where, part=item["content"][0])
        self._text += delta
        await self.event("response.output_text.delta", **where, delta=delta, logprobs=[])

    async def end(self, end: End, report: TurnReport) -> None:
        """The output items' ends, then how the response ended, with all of it."""
        self.stop_pinging()
        shape = self._shape
        status = "failed" if end.error is not None else "incomplete" if end.interrupted_by is not None else "completed"
        output: list[dict[str, Any]] = []
        if self._opened:
            item = text_item(shape.message_id, self._text, "incomplete" if status != "completed" else "completed")
            where = {"item_id": shape.message_id, "output_index": 0, "content_index": 0}
            await self.event("response.output_text.done", **where, text=self._text, logprobs=[])
            await self.event("response.content_part.done", **where, part=item["content"][0])
            await self.event("response.output_item.done", output_index=0, item=item)
            output.append(item)
        if end.finish_reason == "tool_calls":
            for call in report.tool_calls:
                output.append(await self._call(f"fc_{unique_id()}", call, len(output)))
        await self.event(f"response.{status}", response=shape.response(status, output, report, end))

    async def _call(self, item_id: str, call: ToolCall, index: int) -> dict[str, Any]:
        await self.event("response.output_item.added", output_index=index,
                         item=call_item(item_id, call, "in_progress", arguments=""))
        await self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                         delta=call.arguments)
        await self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                         name=call.name, arguments=call.arguments)
        item = call_item(item_id, call)
        await self.event("response.output_item.done", output_index=index, item=item)
        return item
