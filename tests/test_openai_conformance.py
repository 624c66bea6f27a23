"""The clients people use, unchanged, against a real daemon and the fake provider: the official Python
SDK (`openai`), `langchain-openai`, and the official Node SDK (installed with npm into the run's
temporary directory). Each runs the same ground: a plain answer, a streamed one, a tool round trip
with the client's own tools, usage, an interrupted answer, errors, and an abort."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import Connection, FakeProvider, Script
from tests.support.procs import until
from tests.support.spawn import Group

KEY = "sk-test-0123456789"
API = {"enabled": True, "keys": [KEY]}
MODEL = "switchboard"
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
NODE_SCRIPT = Path(__file__).parent / "clients" / "openai_node.mjs"
NPM_DEADLINE_S = 90.0  # below the suite's 120 s per test: the install runs in the first test's setup
NODE_DEADLINE_S = 60.0


def _base(daemon: Any) -> str:
    return f"http://127.0.0.1:{daemon.config.http.port}/v1"


def _prompt_tokens(conn: Connection) -> int:
    """What the fake provider counted for a request's prompt."""
    return int(sum(len(json.dumps(m, ensure_ascii=False)) for m in conn.body["messages"]) / 4)


def _usage(*conns: Connection, completion: int) -> dict[str, int]:
    prompt = sum(_prompt_tokens(c) for c in conns)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --- the official Python SDK ------------------------------------------------------------------------


@pytest.fixture
def client(make_daemon: DaemonFactory) -> Any:
    async def make(**sections: Any) -> openai.AsyncOpenAI:
        daemon = await make_daemon(api=API, **sections)
        return openai.AsyncOpenAI(base_url=_base(daemon), api_key=KEY, max_retries=0)

    return make


async def test_python_sdk_plain_and_streamed_answers_with_usage(client: Any, provider: FakeProvider) -> None:
    provider.words = 3
    sdk: openai.AsyncOpenAI = await client()
    async with sdk:
        plain = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "plain"}])
        stream = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "streamed"}],
                                                   stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        async with sdk.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "helper"}]) as s:
            final = await s.get_final_completion()
        model = await sdk.models.retrieve(MODEL)
        listed = [m.id async for m in sdk.models.list()]
    assert plain.choices[0].message.content == "reply to: plain w0 w1 w2 "
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage is not None and plain.usage.model_dump(exclude_none=True) == _usage(
        provider.connections[0], completion=6)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "reply to: streamed w0 w1 w2 "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == _usage(provider.connections[1], completion=6)["total_tokens"]
    assert final.choices[0].message.content == "reply to: helper w0 w1 w2 "
    assert (model.id, listed) == (MODEL, [MODEL])


async def test_python_sdk_tool_round_trip_with_the_clients_tools(client: Any, provider: FakeProvider) -> None:
    provider.words = 1
    provider.then(Script(tool_calls=[("get_weather", {"city": "Oslo"})]))
    sdk: openai.AsyncOpenAI = await client(tools={"shell": True})
    messages: list[Any] = [{"role": "developer", "content": "Answer briefly."},
                           {"role": "user", "content": "weather in Oslo?"}]
    async with sdk:
        first = await sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                  tool_choice="auto")
        message = first.choices[0].message
        messages.append(message)  # as agent loops do: the SDK's own object, content None
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "rain, 7 C"})
        second = await sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    calls = message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls  # type: ignore[union-attr]
            ] == [("get_weather", {"city": "Oslo"})]
    assert second.choices[0].finish_reason == "stop"
    assert [t["function"]["name"] for t in provider.connections[0].body["tools"]] == ["get_weather"]
    sent = provider.connections[1].body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    assert sent[3] == {"role": "tool", "tool_call_id": calls[0].id, "content": "rain, 7 C"}


async def test_python_sdk_sees_an_interrupted_answer(client: Any, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 400
    sdk: openai.AsyncOpenAI = await client()
    async with sdk:
        stream = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long"}],
                                                   stream=True, extra_headers={"X-Session-Id": "cut"})
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 4:
                await _stopped_from(sdk, "cut")
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "length"
    assert (last.model_extra or {})["switchboard"]["reason"] == "stopped by user (/stop)"


async def _stopped_from(sdk: openai.AsyncOpenAI, session: str) -> None:
    stop = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "/stop"}],
                                             extra_headers={"X-Session-Id": session})
    assert stop.choices[0].message.content == "Stopped."


async def test_python_sdk_errors(client: Any, provider: FakeProvider) -> None:
    provider.by_text["fail"] = Script(status=500)
    sdk: openai.AsyncOpenAI = await client()
    async with sdk:
        with pytest.raises(openai.NotFoundError) as missing:
            await sdk.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
        with pytest.raises(openai.NotFoundError) as unknown:
            await sdk.embeddings.create(model=MODEL, input="hi")
        stream = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fail"}],
                                                   stream=True)
        with pytest.raises(openai.APIError) as failed:
            async for _chunk in stream:
                pass
    async with openai.AsyncOpenAI(base_url=sdk.base_url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError) as denied:
            await stranger.models.list()
    assert (missing.value.code, missing.value.status_code) == ("model_not_found", 404)
    assert "gpt-4o" in missing.value.message
    assert (refused.value.param, refused.value.code) == ("n", None) and "n=1" in refused.value.message
    assert "Unknown request URL: POST /v1/embeddings" in unknown.value.message
    assert "fake failure 500" in failed.value.message and failed.value.type == "provider_error"
    assert denied.value.code == "invalid_api_key"


async def test_python_sdk_closing_a_stream_stops_the_provider(client: Any, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 400
    sdk: openai.AsyncOpenAI = await client()
    async with sdk:
        stream = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abort"}],
                                                   stream=True)
        async for chunk in stream:
            if chunk.choices and "w2" in (chunk.choices[0].delta.content or ""):
                break
        await stream.close()
        closed_at = time.perf_counter()
    conn = provider.requests_for("abort")[0]
    assert await provider.wait_closed(conn, timeout=5) - closed_at < 1.0 and not conn.completed


async def test_a_sync_client_closing_a_silent_stream_from_another_thread_stops_it_within_a_second(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """The model is thinking (nothing streams); the reading thread sleeps in recv; another thread
    closes the stream. The socket closes only once the reader wakes: the keepalive wakes it."""
    provider.then(Script(think_s=30, text="late"))
    daemon = await make_daemon(api=API)
    sdk = openai.OpenAI(base_url=_base(daemon), api_key=KEY, max_retries=0)
    streams: list[Any] = []
    first = threading.Event()

    def read() -> None:
        stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "think"}],
                                             stream=True)
        streams.append(stream)
        chunks = iter(stream)
        next(chunks)  # the role chunk, at once
        first.set()
        with contextlib.suppress(Exception):  # however the closed stream ends
            for _chunk in chunks:
                pass

    reader = asyncio.ensure_future(asyncio.to_thread(read))
    try:
        await until(first.is_set, 10, "the stream never started")
        await until(lambda: bool(provider.connections), 10, "the provider was never asked")
        closed_at = time.perf_counter()
        await asyncio.wait_for(asyncio.to_thread(streams[0].close), 5)
        gone = await provider.wait_closed(provider.connections[0], timeout=5)
        assert gone - closed_at < 1.0, f"noticed after {gone - closed_at:.2f} s"
    finally:
        await asyncio.wait_for(reader, 10)
        sdk.close()


# --- langchain-openai -----------------------------------------------------------------------------


@pytest.fixture
def chat_model(make_daemon: DaemonFactory) -> Any:
    async def make(**options: Any) -> ChatOpenAI:
        daemon = await make_daemon(api=API, tools={"shell": True})
        return ChatOpenAI(model=MODEL, base_url=_base(daemon), api_key=KEY, max_retries=0,  # type: ignore[arg-type]
                          **options)

    return make


async def test_langchain_plain_and_streamed_with_usage_metadata(chat_model: Any, provider: FakeProvider) -> None:
    provider.words = 3
    llm: ChatOpenAI = await chat_model(stream_usage=True)
    answer = await llm.ainvoke("plain")
    streamed: Any = None
    async for chunk in llm.astream("streamed"):
        streamed = chunk if streamed is None else streamed + chunk
    assert answer.content == "reply to: plain w0 w1 w2 "
    assert answer.response_metadata["finish_reason"] == "stop"
    expected = _usage(provider.connections[0], completion=6)
    assert answer.usage_metadata is not None
    assert (answer.usage_metadata["input_tokens"], answer.usage_metadata["output_tokens"]) == (
        expected["prompt_tokens"], expected["completion_tokens"])
    assert streamed.content == "reply to: streamed w0 w1 w2 "
    assert streamed.usage_metadata["total_tokens"] == _usage(provider.connections[1], completion=6)["total_tokens"]


async def test_langchain_bound_tools_round_trip_and_structured_output(chat_model: Any, provider: FakeProvider) -> None:
    provider.words = 1
    provider.then(Script(tool_calls=[("get_weather", {"city": "Oslo"})]))
    llm: ChatOpenAI = await chat_model()
    with_tools = llm.bind_tools([WEATHER])
    question = HumanMessage("weather in Oslo?")
    asked = await with_tools.ainvoke([question])
    assert isinstance(asked, AIMessage)
    assert [(c["name"], c["args"]) for c in asked.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert asked.response_metadata["finish_reason"] == "tool_calls"
    result = ToolMessage("rain, 7 C", tool_call_id=asked.tool_calls[0]["id"])
    answer = await with_tools.ainvoke([question, asked, result])
    assert answer.content == "reply to: weather in Oslo? w0 "
    assert [m["role"] for m in provider.connections[1].body["messages"]] == ["user", "assistant", "tool"]

    class City(BaseModel):
        city: str

    provider.then(Script(text='{"city": "Oslo"}'))
    structured = await llm.with_structured_output(City, method="json_schema").ainvoke("which city?")
    assert structured == City(city="Oslo")
    assert provider.connections[-1].body["response_format"]["type"] == "json_schema"


async def test_langchain_sees_an_interrupted_answer_and_errors(chat_model: Any, provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 400
    llm: ChatOpenAI = await chat_model(default_headers={"X-Session-Id": "lc"})
    pending = asyncio.ensure_future(llm.ainvoke("long"))
    try:
        await until(lambda: bool(provider.requests_for("long")) and provider.requests_for("long")[0].words > 3, 10,
                    "the answer never streamed")
        async with openai.AsyncOpenAI(base_url=str(llm.openai_api_base), api_key=KEY, max_retries=0) as sdk:
            await _stopped_from(sdk, "lc")
        answer = await asyncio.wait_for(pending, 10)
    finally:
        pending.cancel()
    assert answer.response_metadata["finish_reason"] == "length"
    assert str(answer.content).startswith("reply to: long")
    with pytest.raises(openai.NotFoundError):
        await ChatOpenAI(model="gpt-4o", base_url=llm.openai_api_base, api_key=KEY,  # type: ignore[arg-type]
                         max_retries=0).ainvoke("hi")


# --- the official Node SDK ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def node_sdk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory with the Node SDK installed (`npm install openai@6`, once per run, cached under
    the run's temporary directory) and the scenarios script."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("the Node SDK tests need node and npm on PATH (apt-get install nodejs npm)")
    where = tmp_path_factory.mktemp("node-openai")
    log = where / "npm.log"
    proc = Group([npm, "install", "--no-audit", "--no-fund", "--no-save", "--cache", str(where / "npm-cache"),
                  "openai@6"], cwd=where, log=log)
    try:
        proc.wait(NPM_DEADLINE_S)
    except Exception:
        raise AssertionError(f"npm install openai did not finish within {NPM_DEADLINE_S:.0f} s (is the npm "
                             f"registry reachable?); log tail:\n{proc.log_tail()}") from None
    finally:
        proc.end()
    if proc.returncode != 0 or not (where / "node_modules" / "openai").is_dir():
        raise AssertionError(f"npm install openai failed ({proc.returncode}); log tail:\n{proc.log_tail()}")
    shutil.copy(NODE_SCRIPT, where / NODE_SCRIPT.name)
    yield where


async def _node(sdk_dir: Path, daemon: Any, scenario: str, key: str = KEY) -> dict[str, Any]:
    """Run one scenario of the Node script against the daemon; its JSON result."""
    out = sdk_dir / f"{scenario}-{time.monotonic_ns()}.out"
    proc = Group([str(shutil.which("node")), NODE_SCRIPT.name, _base(daemon), key, scenario], cwd=sdk_dir, log=out)
    try:
        deadline = time.monotonic() + NODE_DEADLINE_S
        while proc.poll() is None:  # the daemon runs in this loop: never block it
            assert time.monotonic() < deadline, f"node {scenario} still running; output:\n{proc.log_tail()}"
            await asyncio.sleep(0.02)
    finally:
        proc.end()
    lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"node {scenario} failed ({proc.returncode}):\n{proc.log_tail()}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


async def test_node_sdk_plain_and_streamed_answers_with_usage(
        make_daemon: DaemonFactory, provider: FakeProvider, node_sdk: Path) -> None:
    provider.words = 3
    daemon = await make_daemon(api=API)
    plain = await _node(node_sdk, daemon, "plain")
    assert plain == {"content": "reply to: node plain w0 w1 w2 ", "finish": "stop",
                     "usage": _usage(provider.connections[0], completion=6)}
    streamed = await _node(node_sdk, daemon, "streamed")
    assert streamed == {"text": "reply to: node streamed w0 w1 w2 ", "finish": "stop",
                        "usage": _usage(provider.connections[1], completion=6),
                        "helper": "reply to: node helper w0 w1 w2 ", "helperFinish": "stop"}


async def test_node_sdk_tool_round_trip(make_daemon: DaemonFactory, provider: FakeProvider, node_sdk: Path) -> None:
    provider.words = 1
    provider.then(Script(tool_calls=[("get_weather", {"city": "Oslo"})]))
    daemon = await make_daemon(api=API)
    result = await _node(node_sdk, daemon, "tools")
    assert result == {"finish": "tool_calls", "content": None, "calls": [["get_weather", {"city": "Oslo"}]],
                      "answer": "reply to: node weather? w0 ", "answerFinish": "stop"}
    assert provider.connections[1].body["messages"][-1]["content"] == "rain, 7 C"


async def test_node_sdk_interruption_errors_and_abort(
        make_daemon: DaemonFactory, provider: FakeProvider, node_sdk: Path) -> None:
    provider.delay_s, provider.words = 0.05, 400
    provider.by_text["node fail"] = Script(status=500)
    daemon = await make_daemon(api=API)
    cut = await _node(node_sdk, daemon, "interrupted")
    assert (cut["finish"], cut["stop"]) == ("length", "Stopped.")
    assert cut["extra"]["reason"] == "stopped by user (/stop)" and cut["text"].startswith("reply to: node long")
    errors = await _node(node_sdk, daemon, "errors")
    assert errors["model"]["name"] == "NotFoundError" and errors["model"]["code"] == "model_not_found"
    assert errors["auth"]["name"] == "AuthenticationError" and errors["auth"]["code"] == "invalid_api_key"
    assert (errors["param"]["name"], errors["param"]["param"]) == ("BadRequestError", "n")
    assert errors["stream"]["name"] == "APIError" and "fake failure 500" in errors["stream"]["message"]
    assert (errors["retrieved"], errors["listed"]) == (MODEL, [MODEL])
    aborted = await _node(node_sdk, daemon, "abort")
    assert aborted["aborted"]
    (conn,) = provider.requests_for("node abort")
    await provider.wait_closed(conn, timeout=5)
    assert not conn.completed


async def test_node_sdk_responses_api(make_daemon: DaemonFactory, provider: FakeProvider, node_sdk: Path) -> None:
    provider.words = 1
    provider.script_for = lambda conn: Script(tool_calls=[("get_weather", {"city": "Oslo"})]) if (
        conn.last_user == "node weather?" and not any(m["role"] == "tool" for m in conn.body["messages"])) else None
    daemon = await make_daemon(api=API)
    result = await _node(node_sdk, daemon, "responses")
    assert result == {"first": ["completed", "reply to: node first w0 ", 4], "second": "reply to: node second w0 ",
                      "chained": True, "streamed": ["completed", "reply to: node stream w0 "],
                      "calls": [["get_weather", {"city": "Oslo"}]], "answered": "reply to: node weather? w0 "}
    # The continuation had the chain's history; the tool round trip was stateless.
    assert [m["content"] for m in provider.connections[1].body["messages"]][-3:] == [
        "node first", "reply to: node first w0 ", "node second"]
