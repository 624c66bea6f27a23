"""The OpenAI agent's parts on their own: the retry policy against a provider that answers 5xx/429,
and the stream decoder (a batch of chunks into events, tool calls from their pieces)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.openai_stream import Round, StreamDecoder
from gateway.agents.tools import ToolRegistry
from gateway.core.ports import AgentError
from gateway.core.transcript import AgentEvent, ChatMessage, TextDelta, ToolCall, Usage
from tests.support.ports import free_port

ANSWER = {"choices": [{"message": {"role": "assistant", "content": "fine"}}]}


class Flaky:
    """A provider that refuses the first `failures` requests with `status` (and `retry_after`)."""

    def __init__(self, failures: int, status: int = 503, retry_after: str | None = None) -> None:
        self.failures, self.status, self.retry_after = failures, status, retry_after
        self.times: list[float] = []
        self.port = free_port()

    async def handle(self, _request: web.Request) -> web.Response:
        self.times.append(time.monotonic())
        if len(self.times) <= self.failures:
            headers = {"Retry-After": self.retry_after} if self.retry_after else {}
            return web.json_response({"error": {"message": "busy"}}, status=self.status, headers=headers)
        return web.json_response(ANSWER)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(provider: Flaky) -> OpenAIAgent:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", provider.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", provider.port).start()
        runners.append(runner)
        return OpenAIAgent(OpenAISettings(base_url=f"http://127.0.0.1:{provider.port}/v1", model="m", retries=2,
                                          backoff_s=0.1), ToolRegistry())

    yield start
    for runner in runners:
        await runner.cleanup()


async def _events(agent: OpenAIAgent) -> list[AgentEvent]:
    try:
        return [e async for e in agent.run_turn([], ChatMessage("user", "hi"))]
    finally:
        await agent.close()


async def test_a_refused_request_is_retried_after_backoff_s_doubling(serve: Any) -> None:
    provider = Flaky(failures=2)
    assert await _events(await serve(provider)) == [TextDelta("fine")]
    gaps = provider.gaps()
    assert len(gaps) == 2 and gaps[0] >= 0.1 and gaps[1] >= 0.2  # 0.1 s, then 0.2 s (no jitter)


async def test_retry_after_sets_the_delay_and_still_counts_as_an_attempt(serve: Any) -> None:
    provider = Flaky(failures=10, status=429, retry_after="0.3")
    with pytest.raises(AgentError, match="HTTP 429"):
        await _events(await serve(provider))
    assert len(provider.times) == 3  # the first try and `retries` more: then the refusal is the answer
    assert all(gap >= 0.3 for gap in provider.gaps())


async def test_a_status_not_worth_retrying_is_the_answer_at_once(serve: Any) -> None:
    provider = Flaky(failures=10, status=401)
    with pytest.raises(AgentError, match="HTTP 401 busy"):
        await _events(await serve(provider))
    assert len(provider.times) == 1


def _chunk(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def test_a_batch_is_one_delta_and_token_counts_follow_the_words_they_count() -> None:
    rnd = Round()
    decoder = StreamDecoder(rnd, estimated=7)
    words = [_chunk(choices=[{"delta": {"content": w}}]) for w in ("a", "b", "c")]
    usage = _chunk(choices=[], usage={"prompt_tokens": 5, "completion_tokens": 3})
    assert list(decoder.batch([words[0], words[1]])) == [TextDelta("ab")]
    assert list(decoder.batch([words[2], usage, words[0]])) == [TextDelta("c"), Usage(5, 3, 7), TextDelta("a")]
    done_before = decoder.done
    assert list(decoder.batch([words[1], b"[DONE]", words[2]])) == [TextDelta("b")]  # nothing after [DONE]
    assert not done_before and decoder.done and "".join(rnd.text) == "abcab"


def test_tool_calls_are_assembled_from_their_pieces() -> None:
    rnd = Round()
    decoder = StreamDecoder(rnd, estimated=0)
    pieces = [
        {"index": 0, "id": "c1", "function": {"name": "sh", "arguments": '{"cmd"'}},
        {"index": 1, "function": {"name": "job_status"}},  # no id, no arguments: made up
        {"index": 0, "function": {"name": "ell", "arguments": ': "ls"}'}},
    ]
    chunks = [_chunk(choices=[{"delta": {"tool_calls": [p]}}]) for p in pieces]
    assert list(decoder.batch(chunks)) == []
    assert rnd.tool_calls() == (ToolCall("c1", "shell", '{"cmd": "ls"}'), ToolCall("call_1", "job_status", "{}"))


def test_an_error_in_the_stream_is_the_providers_failure() -> None:
    decoder = StreamDecoder(Round(), estimated=0)
    with pytest.raises(AgentError, match="the model provider failed: overloaded"):
        list(decoder.batch([_chunk(error={"message": "overloaded"})]))
    with pytest.raises(AgentError, match="malformed"):
        list(decoder.batch([b"{not json"]))
