"""Any OpenAI-compatible Chat Completions endpoint, streamed, with a bounded tool-calling loop.

The provider connection is registered with the run: a hard_cancel closes the socket at once, so
the provider stops generating instead of finishing an answer nobody will read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.agents.tools import ToolRegistry
from gateway.core.cancellation import get_run
from gateway.core.logs import redactor
from gateway.core.ports import AgentError
from gateway.core.transcript import AgentEvent, ChatMessage, TextDelta, ToolCall, ToolCallsRequested, ToolResult

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str) -> str:
    """Model output as storable text: a lone surrogate (valid JSON escape, invalid UTF-8) becomes U+FFFD."""
    return value if value.isascii() else _LONE_SURROGATE.sub("\ufffd", value)


@dataclass(frozen=True, slots=True)
class OpenAISettings:
    base_url: str
    model: str
    api_key: str | None = None
    system_prompt: str | None = None
    max_tool_rounds: int = 8
    retries: int = 3
    backoff_s: float = 0.5
    read_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0


class _Round:
    """What one streamed completion produced."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}

    def add_tool_delta(self, delta: dict[str, Any]) -> None:
        slot = self.calls.setdefault(int(delta.get("index", len(self.calls))),
                                     {"id": "", "name": "", "arguments": ""})
        if delta.get("id"):
            slot["id"] = _text(str(delta["id"]))
        fn = delta.get("function") or {}
        if fn.get("name"):
            slot["name"] += _text(str(fn["name"]))
        if fn.get("arguments"):
            slot["arguments"] += _text(str(fn["arguments"]))

    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(c["id"] or f"call_{i}", c["name"], c["arguments"] or "{}")
                     for i, c in sorted(self.calls.items()))


class OpenAIAgent:
    def __init__(self, settings: OpenAISettings, tools: ToolRegistry) -> None:
        self.settings = settings
        self.tools = tools
        self._session: aiohttp.ClientSession | None = None

    @property
    def description(self) -> str:
        return f"openai:{self.settings.model}"

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            s = self.settings
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s,
                                              sock_read=s.read_timeout_s),
                connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def run_turn(self, history: Sequence[ChatMessage], message: ChatMessage) -> AsyncIterator[AgentEvent]:
        messages: list[dict[str, Any]] = []
        if self.settings.system_prompt:
            messages.append({"role": "system", "content": self.settings.system_prompt})
        messages += [m.to_openai() for m in history]
        messages.append(message.to_openai())
        for _round in range(self.settings.max_tool_rounds + 1):
            rnd = _Round()
            async for event in self._complete(messages, rnd):
                yield event
            calls = rnd.tool_calls()
            if not calls:
                return
            text = "".join(rnd.text)
            yield ToolCallsRequested(text, calls)
            messages.append(ChatMessage("assistant", text, tool_calls=calls).to_openai())
            for call in calls:
                result = await self.tools.call(call.name, call.arguments)
                yield ToolResult(call.id, result)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        yield TextDelta(f"\n[stopped after {self.settings.max_tool_rounds} tool rounds]")

    async def _complete(self, messages: list[dict[str, Any]], rnd: _Round) -> AsyncIterator[TextDelta]:
        s = self.settings
        body: dict[str, Any] = {"model": s.model, "messages": messages, "stream": True}
        if self.tools.tools:
            body["tools"] = self.tools.schemas()
        headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
        url = s.base_url.rstrip("/") + "/chat/completions"
        for attempt in range(s.retries + 1):
            try:
                resp = await self._http().post(url, json=body, headers=headers)
            except aiohttp.ClientError as exc:
                if attempt < s.retries:
                    await asyncio.sleep(s.backoff_s * 2 ** attempt)
                    continue
                raise AgentError(f"the model provider is unreachable ({type(exc).__name__})") from exc
            if resp.status in RETRY_STATUSES and attempt < s.retries:
                delay = _retry_after(resp) or s.backoff_s * 2 ** attempt
                resp.close()
                log.warning("provider answered HTTP %d; retrying in %.1f s", resp.status, delay)
                await asyncio.sleep(delay)
                continue
            break
        run = get_run()
        async with resp:
            with run.on_cancel(resp.close) if run else contextlib.nullcontext():
                if resp.status != 200:
                    detail = (await resp.text())[:300]
                    raise AgentError(f"the model provider failed: HTTP {resp.status} {_error_text(detail)}")
                if resp.content_type == "application/json":  # a provider that ignores stream=true
                    payload = _json(await resp.text())
                    async for ev in _from_message(payload, rnd):
                        yield ev
                    return
                try:
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            return
                        chunk = _json(data.decode("utf-8", "replace"))
                        if "error" in chunk:
                            raise AgentError(f"the model provider failed: {_error_text(json.dumps(chunk))}")
                        for choice in chunk.get("choices") or []:
                            delta = choice.get("delta") or {}
                            for tc in delta.get("tool_calls") or []:
                                rnd.add_tool_delta(tc)
                            if content := delta.get("content"):
                                content = _text(str(content))
                                rnd.text.append(content)
                                yield TextDelta(content)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise AgentError(f"the model provider connection broke ({type(exc).__name__})") from exc


async def _from_message(payload: dict[str, Any], rnd: _Round) -> AsyncIterator[TextDelta]:
    try:
        msg = payload["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise AgentError("the model provider returned an unexpected response") from exc
    for i, tc in enumerate(msg.get("tool_calls") or []):
        rnd.add_tool_delta({"index": i, **tc})
    if content := msg.get("content"):
        content = _text(str(content))
        rnd.text.append(content)
        yield TextDelta(content)


def _json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise AgentError("the model provider returned malformed data") from exc
    if not isinstance(value, dict):
        raise AgentError("the model provider returned malformed data")
    return value


def _error_text(detail: str) -> str:
    """The provider's own words, short — with any secret it echoed (e.g. our key) masked."""
    try:
        err = json.loads(detail).get("error")
        if isinstance(err, dict) and err.get("message"):
            return redactor(str(err["message"]))[:200]
    except (ValueError, AttributeError):
        pass
    return redactor(detail)[:200]


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    try:
        return min(float(resp.headers.get("Retry-After", "")), 30.0)
    except ValueError:
        return None
