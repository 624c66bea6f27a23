"""The OpenAI agent's parts on their own: the retry policy against a provider that answers 5xx/429,
the stream decoder (a batch of chunks into events, tool calls from their pieces), and a stream
read at the pace its chat can show."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp import web

from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.openai_stream import Round, StreamDecoder, sse_batches
from gateway.agents.tools import ToolRegistry
from gateway.core.cancellation import GATEWAY_RESTART, Run, ToolReason, current_run
from gateway.core.ports import AgentError
from gateway.core.transcript import AgentEvent, ChatMessage, TextDelta, ToolCall, Usage
from gateway.store.sqlite import SqliteStore
from platforms.streaming import EditStreamReply
from tests.fakes.memory_chat import MemoryChat
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.ports import free_port
from tests.support.routers import start_router

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


class _PacedContext:
    """A turn whose chat shows a new state at most every `pace_s`."""

    def __init__(self, pace_s: float) -> None:
        self.pace_s = pace_s
        self.options = None
        self.token_ratio = 1.0
        self.history_memo = None

    def take_interjection(self) -> str | None:
        return None

    def note_result(self, call_id: str, text: str) -> None:
        pass


async def test_a_paced_stream_joins_what_arrives_between_reads_and_does_not_hold_its_end() -> None:
    words = [f"w{i}" for i in range(40)]
    async with FakeProvider(delay_s=0.01) as provider:
        provider.then(Script(text=" ".join(words)))
        agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="m"), ToolRegistry())
        try:
            events = [e async for e in agent.run_turn([], ChatMessage("user", "hi"), _PacedContext(0.15))]
            ended = time.perf_counter()
        finally:
            await agent.close()
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert "".join(deltas).split() == words
    assert len(deltas) <= 6  # about 0.4 s of words at one read per 0.15 s, not one read per word
    completed = provider.connections[0].completed_at
    assert completed is not None and ended - completed < 0.1  # the end is read when it comes, not a pace later


class _CountedReader(aiohttp.StreamReader):
    """A provider's response body fed by the test, counting the reads made of it."""

    def __init__(self) -> None:
        super().__init__(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
        self.reads = 0

    async def readany(self) -> bytes:
        self.reads += 1
        return await super().readany()


async def _read_paced(reader: _CountedReader, run: Run, pace_s: float, got: list[list[bytes]]) -> None:
    current_run.set(run)
    async for batch in sse_batches(reader, lambda: pace_s):
        got.append(batch)


async def test_lines_that_arrive_within_one_pace_are_read_as_one_batch() -> None:
    reader, got = _CountedReader(), list[list[bytes]]()
    task = asyncio.ensure_future(_read_paced(reader, Run("k"), 0.2, got))
    reader.feed_data(b"data: a\n\n")
    await asyncio.sleep(0.02)
    for word in (b"b", b"c", b"d"):  # within the pause after the first batch
        reader.feed_data(b"data: " + word + b"\n\n")
        await asyncio.sleep(0.02)
    assert got == [[b"a"]] and reader.reads == 1
    await asyncio.sleep(0.25)
    assert got == [[b"a"], [b"b", b"c", b"d"]]
    reader.feed_eof()
    await asyncio.wait_for(task, 0.1)  # the end is read as it comes, not a pace later


@pytest.mark.parametrize("delivered", [True, False])
async def test_a_cancel_during_a_paced_wait_ends_the_read_at_once_with_no_further_read(delivered: bool) -> None:
    """`delivered`: the task is cancelled, or the cancel never reaches it (swallowed on the way):
    either way the pause ends now and nothing more is read."""
    reader, got, run = _CountedReader(), list[list[bytes]](), Run("k")
    task = asyncio.ensure_future(_read_paced(reader, run, 5.0, got))
    if delivered:
        run.attach(task)
    reader.feed_data(b"data: a\n\n")
    await asyncio.sleep(0.02)
    reader.feed_data(b"data: b\n\n")  # waits for the next read, 5 s on
    await asyncio.sleep(0.02)
    run.cancel(ToolReason.user("stopped by user (/stop)"))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 0.1)
    assert got == [[b"a"]] and reader.reads == 1


async def test_a_paced_answer_reaches_the_reply_in_a_delta_per_pace_and_only_its_last_word_waits(
        store: SqliteStore, provider: FakeProvider, tools: ToolRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat that shows a new state every 0.2 s gets the answer's words in a delta per 0.2 s, not
    one per word, and each delta at once but its last word (held until the turn is recorded)."""
    shown: list[str] = []
    original = EditStreamReply.delta

    async def delta(self: EditStreamReply, text: str) -> None:
        shown.append(text)
        await original(self, text)

    monkeypatch.setattr(EditStreamReply, "delta", delta)
    words = [f"w{i}" for i in range(40)]
    provider.then(Script(text=" ".join(words), delay_s=0.01))
    chat = MemoryChat(edit_interval_s=0.2)
    agent = OpenAIAgent(OpenAISettings(base_url=provider.base_url, model="m"), tools)
    router = await start_router(store, agent, chat)
    try:
        run = (await router.submit(chat.message("c1", "hi"), chat)).run
        assert run is not None
        await run.wait()
    finally:
        await router.shutdown(GATEWAY_RESTART, grace_s=5)
        await agent.close()
    assert 3 <= len(shown) <= 7, shown  # about 0.4 s of words at a read per 0.2 s, not 40 deltas
    assert "".join(shown).split() == words
    assert shown[-1].split() == words[-1:]  # only the last word waited for the record (and its end)
    assert chat.texts("c1")[-1].split() == words
