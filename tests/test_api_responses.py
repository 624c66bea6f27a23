"""The Responses API (`POST /v1/responses`) against a real daemon and the fake provider: the official
Python SDK (its stream helper checks the events' order and identities), raw HTTP for the details,
and LangChain's chat model in its Responses mode. The Node SDK's run is in
`test_openai_conformance.py`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from platforms.tenants import key_id
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.procs import until

KEY = "sk-test-0123456789"
OTHER = "sk-test-other-0123456789"
API = {"enabled": True, "keys": [KEY, OTHER]}
MODEL = "switchboard"
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _base(daemon: Any) -> str:
    return f"http://127.0.0.1:{daemon.config.http.port}/v1"


async def _sdk(make_daemon: DaemonFactory, **sections: Any) -> openai.AsyncOpenAI:
    daemon = await make_daemon(api=API, **sections)
    return openai.AsyncOpenAI(base_url=_base(daemon), api_key=KEY, max_retries=0)


async def test_a_response_whole_and_streamed_through_the_sdk(make_daemon: DaemonFactory,
                                                             provider: FakeProvider) -> None:
    provider.words = 3
    sdk = await _sdk(make_daemon)
    async with sdk:
        whole = await sdk.responses.create(model=MODEL, input="hello", instructions="Be brief.")
        async with sdk.responses.stream(model=MODEL, input=[{"role": "user", "content": "streamed"}]) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
    assert (whole.status, whole.output_text) == ("completed", "reply to: hello w0 w1 w2 ")
    assert whole.id.startswith("resp_") and whole.model == MODEL
    assert whole.usage is not None and whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0
    assert provider.connections[0].body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "".join(deltas) == final.output_text == "reply to: streamed w0 w1 w2 "
    assert final.status == "completed" and final.usage is not None and final.usage.total_tokens > 6


async def test_previous_response_id_continues_the_chain_and_only_for_its_tenant(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api=API)
    async with openai.AsyncOpenAI(base_url=_base(daemon), api_key=KEY, max_retries=0) as sdk, \
            openai.AsyncOpenAI(base_url=_base(daemon), api_key=OTHER, max_retries=0) as stranger:
        first = await sdk.responses.create(model=MODEL, input="my pin is 4711", instructions="CLIENT-INSTRUCTIONS")
        second = await sdk.responses.create(model=MODEL, input="what is my pin?", previous_response_id=first.id,
                                            instructions="CLIENT-INSTRUCTIONS")
        with pytest.raises(openai.NotFoundError) as foreign:
            await stranger.responses.create(model=MODEL, input="and mine?", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError) as unknown:
            await sdk.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
        with pytest.raises(openai.BadRequestError) as two:
            await sdk.responses.create(model=MODEL, input=[{"role": "user", "content": "a"},
                                                           {"role": "user", "content": "b"}],
                                       previous_response_id=second.id)
        with pytest.raises(openai.BadRequestError) as tools:
            await sdk.responses.create(model=MODEL, input="weather?", previous_response_id=second.id, tools=[WEATHER])
        stateless = await sdk.responses.create(model=MODEL, input="no chain", store=False)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.create(model=MODEL, input="hi", previous_response_id=stateless.id)
    sent = provider.connections[1].body["messages"]
    assert sent == [{"role": "system", "content": "CLIENT-INSTRUCTIONS"}, {"role": "user", "content": "my pin is 4711"},
                    {"role": "assistant", "content": "reply to: my pin is 4711 w0 "},
                    {"role": "user", "content": "what is my pin?"}]
    assert second.previous_response_id == first.id
    assert foreign.value.code == "previous_response_not_found" and unknown.value.code == "previous_response_not_found"
    assert two.value.param == "input" and tools.value.param == "tools"
    chain = first.id.split("_")[1]
    _conversation, rows = await daemon.store.conversation(f"api:dm:{key_id(KEY)}/resp-{chain}")
    assert [r.content for r in rows if r.role == "user"] == ["my pin is 4711", "what is my pin?"]
    assert len(provider.connections) == 3  # the refused ones never reached the provider


async def test_client_function_tools_round_trip(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    provider.then(Script(tool_calls=[("get_weather", {"city": "Oslo"})]))
    sdk = await _sdk(make_daemon, tools={"shell": True})
    async with sdk:
        items: list[Any] = [{"role": "user", "content": "weather in Oslo?"}]
        first = await sdk.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="auto")
        calls = [o for o in first.output if o.type == "function_call"]
        items += [c.model_dump(exclude_none=True) for c in calls]  # as agent loops do: the calls, then the results
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "rain, 7 C"} for c in calls]
        async with sdk.responses.stream(model=MODEL, input=items, tools=[WEATHER]) as stream:
            second = await stream.get_final_response()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert first.status == "completed" and first.output_text == ""
    sent = provider.connections[0].body
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather"] and sent["tool_choice"] == "auto"
    assert [m["role"] for m in provider.connections[1].body["messages"]] == ["user", "assistant", "tool"]
    assert provider.connections[1].body["messages"][1]["tool_calls"][0]["id"] == calls[0].call_id
    assert second.output_text == "reply to: weather in Oslo? w0 "


async def test_streamed_tool_calls_and_parameters(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.then(Script(tool_calls=[("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]))
    sdk = await _sdk(make_daemon)
    async with sdk:
        async with sdk.responses.stream(model=MODEL, input="weather?", tools=[WEATHER], temperature=0.3,
                                        max_output_tokens=99, parallel_tool_calls=True,
                                        text={"format": {"type": "json_object"}}) as stream:
            events = [e.type async for e in stream]
            final = await stream.get_final_response()
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.responses.create(model=MODEL, input="hi", background=True)
    assert [json.loads(o.arguments)["city"] for o in final.output if o.type == "function_call"] == ["Oslo", "Bergen"]
    assert events.count("response.function_call_arguments.done") == 2 and events[-1] == "response.completed"
    sent = provider.connections[0].body
    assert (sent["temperature"], sent["max_completion_tokens"], sent["parallel_tool_calls"]) == (0.3, 99, True)
    assert sent["response_format"] == {"type": "json_object"}
    assert refused.value.param == "background"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_stopped_response_is_incomplete(make_daemon: DaemonFactory, provider: FakeProvider,
                                                stream: bool) -> None:
    provider.delay_s, provider.words = 0.05, 400
    provider.by_text["hello"] = Script(text="hi there")
    daemon = await make_daemon(api=API)
    async with openai.AsyncOpenAI(base_url=_base(daemon), api_key=KEY, max_retries=0) as sdk:
        first = await sdk.responses.create(model=MODEL, input="hello")  # a chain to run in
        pending = asyncio.ensure_future(_long(sdk, first.id, stream))
        try:
            await until(lambda: bool(provider.requests_for("long")) and provider.requests_for("long")[0].words > 3,
                        10, "the answer never streamed")
            stop = await sdk.responses.create(model=MODEL, input="/stop", previous_response_id=first.id)
            status, text, extra = await asyncio.wait_for(pending, 10)
        finally:
            pending.cancel()
    assert stop.output_text == "Stopped."
    assert status == "incomplete" and text.startswith("reply to: long")
    assert extra["interrupted_by"] == "user" and extra["reason"] == "stopped by user (/stop)"


async def _long(sdk: openai.AsyncOpenAI, previous: str, stream: bool) -> tuple[str, str, dict[str, Any]]:
    """(status, text, the switchboard field) of a long answer, whole or from its last event."""
    if not stream:
        response = await sdk.responses.create(model=MODEL, input="long", previous_response_id=previous)
        return response.status or "", response.output_text, (response.model_extra or {})["switchboard"]
    events = await sdk.responses.create(model=MODEL, input="long", previous_response_id=previous, stream=True)
    async for event in events:
        last = event
    assert last.type == "response.incomplete"
    return last.response.status or "", last.response.output_text, (last.response.model_extra or {})["switchboard"]


async def test_raw_events_errors_and_a_failure(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    provider.by_text["fail"] = Script(status=500)
    daemon = await make_daemon(api=API)
    url = _base(daemon) + "/responses"
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json={"model": MODEL, "input": "raw", "stream": True}, headers=headers) as resp:
            raw = (await resp.read()).decode()
        async with http.post(url, json={"model": MODEL, "input": "fail", "stream": True}, headers=headers) as resp:
            failed = [json.loads(line[6:]) for line in (await resp.read()).decode().splitlines()
                      if line.startswith("data: ")]
        async with http.post(url, json={"model": MODEL, "input": "fail"}, headers=headers) as resp:
            whole = (resp.status, await resp.json())
        async with http.post(url, json={"model": "gpt-4o", "input": "x"}, headers=headers) as resp:
            missing = (resp.status, await resp.json())
        async with http.post(url, json={"input": []}, headers=headers) as resp:
            empty = (resp.status, await resp.json())
    kinds = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert [k for k in kinds if k != "response.output_text.delta"] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert kinds[4:kinds.index("response.output_text.done")] == ["response.output_text.delta"] * (
        kinds.count("response.output_text.delta"))
    numbers = [json.loads(line[6:])["sequence_number"] for line in raw.splitlines() if line.startswith("data: ")]
    assert numbers == list(range(len(kinds)))
    assert failed[-1]["type"] == "response.failed" and "fake failure 500" in failed[-1]["response"]["error"]["message"]
    assert whole[0] == 502 and whole[1]["error"]["type"] == "provider_error"
    assert missing[0] == 404 and missing[1]["error"]["code"] == "model_not_found"
    assert empty[0] == 400 and empty[1]["error"]["param"] == "input"


async def test_langchain_in_responses_mode(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    provider.then(Script(tool_calls=[("get_weather", {"city": "Oslo"})]))
    daemon = await make_daemon(api=API)
    llm = ChatOpenAI(model=MODEL, base_url=_base(daemon), api_key=KEY, max_retries=0,  # type: ignore[arg-type]
                     use_responses_api=True).bind_tools([WEATHER])
    question = HumanMessage("weather in Oslo?")
    asked = await llm.ainvoke([question])
    assert isinstance(asked, AIMessage) and [c["name"] for c in asked.tool_calls] == ["get_weather"]
    answer = await llm.ainvoke([question, asked, ToolMessage("rain, 7 C", tool_call_id=asked.tool_calls[0]["id"])])
    assert answer.text == "reply to: weather in Oslo? w0 "
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] > 0


async def test_closing_a_streamed_response_stops_the_provider(make_daemon: DaemonFactory,
                                                              provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.05, 400
    sdk = await _sdk(make_daemon)
    async with sdk:
        events = await sdk.responses.create(model=MODEL, input="abort", stream=True)
        async for event in events:
            if event.type == "response.output_text.delta" and "w2" in event.delta:
                break
        await events.close()
    conn = provider.requests_for("abort")[0]
    await provider.wait_closed(conn, timeout=5)
    assert not conn.completed
