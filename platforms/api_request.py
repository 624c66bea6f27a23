"""Reading a chat completion request: OpenAI's message model, the parameters, the session.

Every way a request can be wrong is a `BadRequest` naming the field, so the client hears what to fix
(a 400, or 404 for a model that is not served) instead of a provider's error later or, worse, a
parameter dropped without a word.

- **Messages**: `system`, `developer` (sent as `system`: what it means, and the role every
  OpenAI-compatible provider knows), `user`, `assistant` (with `tool_calls`, `content` null or
  absent) and `tool`. The leading system messages are the client's instructions, always sent; the
  last user message is the turn's new input; what follows it (the client's tool calls and their
  results) is the turn's continuation.
- **Parameters**: the provider's sampling and output parameters are passed as given, after a check
  of their type; what the gateway cannot honour (`n` > 1, log probabilities, audio, the legacy
  `functions`) is refused; an unknown one is refused as OpenAI refuses it.
- **The session**: the `X-Session-Id` header, else `metadata.session_id`. `user` (or
  `safety_identifier`) names the end user, for the rate limit and the logs: never a session.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.core.attachments import Attachment
from gateway.core.transcript import ChatMessage, ToolCall
from gateway.core.turn_options import TurnOptions
from platforms.content_parts import BadContent, parse_content

MAX_ID = 256  # characters of a session id or an end user's id
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


class BadRequest(Exception):
    """What is wrong with a request, for the client: OpenAI's error fields."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class ChatRequest:
    history: tuple[ChatMessage, ...]  # the rows before the new user message, the instructions left out
    text: str  # the new user message
    attachments: tuple[Attachment, ...]  # its images and files
    options: TurnOptions
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    session: str | None  # server-kept history asked for
    end_user: str | None
    model: str


def read_request(body: Any, *, session_header: str | None, models: Collection[str], max_bytes: int) -> ChatRequest:
    """The request, or BadRequest. `models`: the names served (the first is the default)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = _model(body.get("model"), models)
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean.", param="stream")
    instructions, history, new, continuation = read_messages(body.get("messages"), max_bytes)
    params = read_params(body)
    tools = _tools(body.get("tools"))
    if tools is None and ("tool_choice" in params or "parallel_tool_calls" in params):
        raise BadRequest("'tool_choice' and 'parallel_tool_calls' are only allowed when 'tools' are given.",
                         param="tool_choice" if "tool_choice" in params else "parallel_tool_calls")
    session = _session(session_header, body.get("metadata"))
    if session is not None and (tools is not None or continuation):
        raise BadRequest("Client tools need the client's own history: send this request without a session "
                         "(no X-Session-Id or metadata.session_id), with the tool results in 'messages'.",
                         param="tools" if tools is not None else "messages")
    options = TurnOptions(instructions=instructions, continuation=continuation, tools=tools, params=params,
                          model=None if model == next(iter(models)) else model)
    return ChatRequest(history, new.text, new.attachments, options, stream, _include_usage(body, stream), session,
                       _end_user(body), model)


# --- messages ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NewMessage:
    text: str
    attachments: tuple[Attachment, ...]


Conversation = tuple[tuple[ChatMessage, ...], tuple[ChatMessage, ...], NewMessage, tuple[ChatMessage, ...]]


def read_messages(messages: Any, max_bytes: int) -> Conversation:
    """(instructions, history, the new user message, continuation) of `messages`."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array.", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}]: role must be system, developer, user, assistant or tool.",
                             param="messages")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise BadRequest("'messages' must contain a user message.", param="messages")
    last_user = users[-1]
    rows: list[ChatMessage] = []
    new = NewMessage("", ())
    calls: set[str] = set()  # ids of the tool calls asked for so far: a tool message answers one of them
    for i, m in enumerate(messages):
        try:
            row, attachments = _row(m, latest=i == last_user, max_bytes=max_bytes, calls=calls)
        except BadContent as exc:
            raise BadRequest(f"messages[{i}].content {exc}.", param="messages") from None
        except BadRequest as exc:
            raise BadRequest(f"messages[{i}]: {exc.message}", param="messages") from None
        rows.append(row)
        if i == last_user:
            new = NewMessage(row.content, attachments)
    lead = next((i for i, row in enumerate(rows) if row.role != "system"), len(rows))
    return tuple(rows[:lead]), tuple(rows[lead:last_user]), new, tuple(rows[last_user + 1:])


def _row(m: dict[str, Any], *, latest: bool, max_bytes: int,
         calls: set[str]) -> tuple[ChatMessage, tuple[Attachment, ...]]:
    """One message as a transcript row, and its attachments (only the new user message's are read)."""
    role = m["role"]
    content = m.get("content")
    if role == "user":
        parsed = parse_content(content, latest=latest, max_bytes=max_bytes)
        return ChatMessage("user", parsed.text), parsed.attachments
    if role == "assistant":
        tool_calls = _tool_calls(m.get("tool_calls"))
        calls.update(call.id for call in tool_calls)
        text = "" if content is None and tool_calls else _text(content)
        return ChatMessage("assistant", text, tool_calls=tool_calls), ()
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or call_id not in calls:
            raise BadRequest("a tool message must have the 'tool_call_id' of a tool call an earlier assistant "
                             "message made.")
        return ChatMessage("tool", _text(content), tool_call_id=call_id), ()
    return ChatMessage("system", _text(content)), ()  # system, or developer: the same instructions


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any) -> str:
    """The text of a message that is not the user's: a string, or text (and refusal) parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        content = [{"type": "text", "text": p["refusal"]} if isinstance(p, dict) and p.get("type") == "refusal"
                   and isinstance(p.get("refusal"), str) else p for p in content]
    return parse_content(content, latest=False, max_bytes=0).text


def _tool_calls(value: Any) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise BadRequest("'tool_calls' must be an array.")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise BadRequest(f"tool_calls[{j}] must be a function call.")
        if not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            raise BadRequest(f"tool_calls[{j}] needs an 'id', a 'function.name' and 'function.arguments' (a string).")
        calls.append(ToolCall(call["id"], fn["name"], fn["arguments"]))
    return tuple(calls)


# --- parameters ----------------------------------------------------------------------------------


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(v: Any) -> bool:
    return _integer(v) and v > 0


def _stop(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and len(v) <= 4 and all(isinstance(s, str) for s in v))


def _response_format(v: Any) -> bool:
    return isinstance(v, dict) and v.get("type") in ("text", "json_object", "json_schema")


def _tool_choice(v: Any) -> bool:
    return v in ("none", "auto", "required") or (isinstance(v, dict) and isinstance(v.get("type"), str))


# Passed to the provider as given (each checked for its type: a wrong one is the client's 400 here,
# not the provider's failure later); what each needs to be, for the error message.
PASSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (_number, "a number"), "top_p": (_number, "a number"),
    "presence_penalty": (_number, "a number"), "frequency_penalty": (_number, "a number"),
    "max_tokens": (_positive, "a positive integer"), "max_completion_tokens": (_positive, "a positive integer"),
    "seed": (_integer, "an integer"), "stop": (_stop, "a string or an array of up to 4 strings"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object"),
    "response_format": (_response_format, "an object with 'type' text, json_object or json_schema"),
    "tool_choice": (_tool_choice, "'none', 'auto', 'required' or an object naming a tool"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean"),
    "reasoning_effort": (lambda v: isinstance(v, str), "a string"),
    "verbosity": (lambda v: isinstance(v, str), "a string"),
}
# Read by the gateway itself (each where it is used), with what a value must be to be accepted.
READ: dict[str, Callable[[Any], str | None]] = {
    "model": lambda v: None, "messages": lambda v: None, "stream": lambda v: None, "stream_options": lambda v: None,
    "user": lambda v: None, "safety_identifier": lambda v: None, "metadata": lambda v: None,
    "tools": lambda v: None,
    "n": lambda v: None if v == 1 else "Only n=1 is supported: one answer per request.",
    "logprobs": lambda v: None if v is False else "Log probabilities are not available through this gateway.",
    "top_logprobs": lambda v: "Log probabilities are not available through this gateway.",
    "store": lambda v: None if isinstance(v, bool) else "'store' must be a boolean.",  # nothing is kept for OpenAI
    "modalities": lambda v: None if v == ["text"] else "Only text output is supported ('modalities': ['text']).",
    "audio": lambda v: "Audio output is not supported.",
    "functions": lambda v: "The legacy 'functions' parameter is not supported: use 'tools'.",
    "function_call": lambda v: "The legacy 'function_call' parameter is not supported: use 'tool_choice'.",
    "prediction": lambda v: "Predicted outputs are not supported.",
    "web_search_options": lambda v: "Web search is not available through this gateway.",
}


def read_params(body: dict[str, Any]) -> dict[str, Any]:
    """The parameters for the provider; BadRequest for one that is refused, unknown or of the wrong
    type. A null value counts as absent."""
    params: dict[str, Any] = {}
    for name, value in body.items():
        if value is None:
            continue
        if name in PASSED:
            valid, what = PASSED[name]
            if not valid(value):
                raise BadRequest(f"'{name}' must be {what}.", param=name)
            params[name] = value
        elif name in READ:
            if (problem := READ[name](value)) is not None:
                raise BadRequest(problem, param=name)
        else:
            raise BadRequest(f"Unrecognized request argument supplied: {name}", param=name)
    return params


def _tools(value: Any) -> tuple[Mapping[str, Any], ...] | None:
    """The client's function tools (None: it gave none, and the gateway's own are offered)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRequest("'tools' must be an array.", param="tools")
    for j, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(f"tools[{j}] must be a function tool ({{\"type\": \"function\", \"function\": …}}).",
                             param="tools")
        if not isinstance(fn.get("name"), str) or not _TOOL_NAME.fullmatch(fn["name"]):
            raise BadRequest(f"tools[{j}].function.name must be letters, digits, '_' or '-'.", param="tools")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"tools[{j}].function.parameters must be a JSON schema object.", param="tools")
    return tuple(value)


def _model(value: Any, models: Collection[str]) -> str:
    default = next(iter(models))
    if value is None:
        return default
    if not isinstance(value, str):
        raise BadRequest("'model' must be a string.", param="model")
    if value not in models:
        raise BadRequest(f"The model `{value}` does not exist or you do not have access to it.", status=404,
                         code="model_not_found", param="model")
    return value


def _session(header: str | None, metadata: Any) -> str | None:
    """The session the client asked for: the header, else `metadata.session_id`; None: stateless."""
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("'metadata' must be an object.", param="metadata")
    session = header or (metadata or {}).get("session_id")
    if session is None or session == "":
        return None
    if not isinstance(session, str):
        raise BadRequest("'metadata.session_id' must be a string.", param="metadata")
    if len(session) > MAX_ID:
        raise BadRequest(f"The session id is longer than {MAX_ID} characters.",
                         param="metadata" if not header else None)
    return session


def _end_user(body: dict[str, Any]) -> str | None:
    for name in ("safety_identifier", "user"):
        value = body.get(name)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise BadRequest(f"'{name}' must be a string.", param=name)
        if len(value) > MAX_ID:
            raise BadRequest(f"'{name}' is longer than {MAX_ID} characters.", param=name)
        return value
    return None


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean.", param="stream_options")
    return include and stream
