"""The HTTP API as OpenAI's clients expect it (issue #34): usage, the whole message model, client
tools and parameters, sessions asked for explicitly, interruptions a client can see, OpenAI-shaped
errors everywhere, a silent stream that notices its client has gone. Raw HTTP against a real daemon
and the fake provider; `test_openai_conformance.py` runs the official clients."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from platforms.api import api_errors
from platforms.tenants import key_id
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.ports import free_port
from tests.support.procs import until

KEY = "sk-test-0123456789"
API = {"enabled": True, "keys": [KEY]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def _url(daemon: Any, path: str = "/v1/chat/completions") -> str:
    return f"http://127.0.0.1:{daemon.config.http.port}{path}"


def _auth(**extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", **extra}


async def _post(http: aiohttp.ClientSession, daemon: Any, body: dict[str, Any],
                **headers: str) -> tuple[int, dict[str, Any]]:
    async with http.post(_url(daemon), json=body, headers=_auth(**headers)) as resp:
        return resp.status, dict(await resp.json())


async def _events(http: aiohttp.ClientSession, daemon: Any, body: dict[str, Any],
                  **headers: str) -> tuple[list[dict[str, Any]], bool]:
    """A streamed answer's events, and whether it ended with [DONE]."""
    events, done = [], False
    async with http.post(_url(daemon), json={**body, "stream": True}, headers=_auth(**headers)) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.strip() == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    return events, done


def _choice(events: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(the streamed text, the finish reason)."""
    chunks = [e for e in events if e.get("choices")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"]


# --- 1. usage ------------------------------------------------------------------------------------


async def test_usage_is_the_providers_count_whole_and_as_the_last_chunk(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 3
    daemon = await make_daemon(api=API)
    body = {"messages": [{"role": "user", "content": "count me"}]}
    async with aiohttp.ClientSession() as http:
        status, out = await _post(http, daemon, body)
        events, done = await _events(http, daemon, {**body, "stream_options": {"include_usage": True}})
        async with http.get(f"http://127.0.0.1:{daemon.config.admin.port}/metrics") as resp:
            metrics = await resp.text()
    prompt = int(sum(len(json.dumps(m)) for m in provider.connections[0].body["messages"]) / 4)
    expected = {"prompt_tokens": prompt, "completion_tokens": 6, "total_tokens": prompt + 6}
    assert status == 200 and out["usage"] == expected and "switchboard" not in out
    # The usage chunk comes last, with no choices; every chunk before it says "usage": null.
    assert done and events[-1]["choices"] == [] and events[-1]["usage"] == expected
    assert all(e["usage"] is None for e in events[:-1])
    assert _choice(events) == ("reply to: count me w0 w1 w2 ", "stop")
    # The same figures as the metrics.
    assert f'switchboard_tokens_total{{kind="prompt",tenant="{key_id(KEY)}"}} {2.0 * prompt}' in metrics


async def test_usage_is_estimated_and_marked_when_the_provider_gives_none(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 30
    daemon = await make_daemon(api=API, agent={"include_usage": False})
    async with aiohttp.ClientSession() as http:
        status, out = await _post(http, daemon, {"messages": [{"role": "user", "content": "estimate me " * 20}]})
    assert "stream_options" not in provider.connections[0].body
    usage = out["usage"]
    assert status == 200 and usage["prompt_tokens"] > 40 and usage["completion_tokens"] > 30
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert out["switchboard"] == {"usage_estimated": True}


# --- 2. the whole message model ------------------------------------------------------------------

TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "developer", "content": "CLIENT-DEVELOPER-PROMPT"},
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "rain, 7 C"},
    {"role": "assistant", "content": "Rain and 7 C in Oslo."},
    {"role": "user", "content": "and tomorrow?"},
]


async def test_tool_call_history_and_the_developer_role_reach_the_provider_as_sent(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api=API)
    async with aiohttp.ClientSession() as http:
        status, out = await _post(http, daemon, {"messages": TOOL_HISTORY})
    assert status == 200, out
    sent = provider.connections[0].body["messages"]
    assert sent[0] == {"role": "system", "content": "CLIENT-DEVELOPER-PROMPT"}
    assert sent[1] == {"role": "user", "content": "weather in Oslo?"}
    assert sent[2]["role"] == "assistant" and sent[2]["tool_calls"] == TOOL_HISTORY[2]["tool_calls"]
    assert sent[3] == {"role": "tool", "tool_call_id": "call_1", "content": "rain, 7 C"}
    assert [m["content"] for m in sent[4:]] == ["Rain and 7 C in Oslo.", "and tomorrow?"]


async def test_a_request_ending_with_tool_results_continues_from_them(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api=API)
    async with aiohttp.ClientSession() as http:
        status, out = await _post(http, daemon, {"messages": TOOL_HISTORY[:4], "tools": [WEATHER]})
        bad, refused = await _post(http, daemon, {"messages": [
            {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]})
    assert status == 200, out
    sent = provider.connections[0].body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    assert out["choices"][0]["message"]["content"] == "reply to: weather in Oslo? w0 "
    # A tool result that answers no call is the client's mistake: said at once, not by the provider.
    assert bad == 400 and "tool_call_id" in refused["error"]["message"]


# --- 3. client tools, parameters, the model ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_client_tools_are_offered_instead_of_the_gateways_and_their_calls_end_the_answer(
        make_daemon: DaemonFactory, provider: FakeProvider, stream: bool) -> None:
    provider.then(Script(tool_calls=[("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]))
    daemon = await make_daemon(api=API, tools={"shell": True})
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], "tool_choice": "auto",
            "parallel_tool_calls": True}
    async with aiohttp.ClientSession() as http:
        if stream:
            events, done = await _events(http, daemon, body)
            assert done
            calls = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls") or []]
            finish = _choice(events)[1]
        else:
            status, out = await _post(http, daemon, body)
            assert status == 200, out
            message = out["choices"][0]["message"]
            assert message["content"] is None
            calls, finish = message["tool_calls"], out["choices"][0]["finish_reason"]
    sent = provider.connections[0].body
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather"]  # not the gateway's shell
    assert (sent["tool_choice"], sent["parallel_tool_calls"]) == ("auto", True)
    assert finish == "tool_calls"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo"}), ("function", "get_weather", {"city": "Bergen"})]
    assert len(provider.connections) == 1  # the gateway ran nothing and asked nothing more


async def test_parameters_reach_the_provider_or_are_refused_and_unknown_models_are_404(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api=API)
    params = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 50, "max_completion_tokens": 60, "stop": ["\n\n"],
              "seed": 7, "response_format": {"type": "json_object"}, "presence_penalty": 0.1,
              "frequency_penalty": 0.1, "n": 1}
    base = {"model": "switchboard", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        status, out = await _post(http, daemon, {**base, **params})
        assert status == 200, out
        sent = provider.connections[0].body
        assert {k: sent.get(k) for k in params if k != "n"} == {k: v for k, v in params.items() if k != "n"}
        assert "n" not in sent and sent["model"] != "switchboard"  # the provider's own model name
        for extra, param, needle in (({"n": 2}, "n", "n=1"), ({"logprobs": True}, "logprobs", "Log probabilities"),
                                     ({"temperature": "hot"}, "temperature", "a number"),
                                     ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
                                     ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
                                     ({"functions": []}, "functions", "use 'tools'")):
            status, out = await _post(http, daemon, {**base, **extra})
            assert (status, out["error"]["param"]) == (400, param), out
            assert needle in out["error"]["message"]
        status, out = await _post(http, daemon, {**base, "model": "gpt-4o"})
        assert status == 404 and out["error"] == {
            "message": "The model `gpt-4o` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert len(provider.connections) == 1


async def test_several_models_behind_one_gateway(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    models = [{"name": "fast", "model": "tiny-1b"},
              {"name": "other", "model": "big-70b", "base_url": f"http://127.0.0.1:{provider.port}/elsewhere/v1",
               "api_key": "sk-elsewhere"}]
    daemon = await make_daemon(api=API, agent={"models": models, "model": "own-8b", "api_key": "sk-own"})
    async with aiohttp.ClientSession() as http:
        async with http.get(_url(daemon, "/v1/models"), headers=_auth()) as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["switchboard", "fast", "other"]
        async with http.get(_url(daemon, "/v1/models/other"), headers=_auth()) as resp:
            assert resp.status == 200
        for name in ("switchboard", "fast", "other", None):
            body = {"messages": [{"role": "user", "content": f"to {name}"}], **({"model": name} if name else {})}
            status, out = await _post(http, daemon, body)
            assert status == 200 and out["model"] == (name or "switchboard"), out
    seen = [(c.body["model"], c.via, c.authorization) for c in provider.connections]
    assert seen == [("own-8b", None, "Bearer sk-own"), ("tiny-1b", None, "Bearer sk-own"),
                    ("big-70b", "elsewhere", "Bearer sk-elsewhere"), ("own-8b", None, "Bearer sk-own")]


# --- 4. sessions are asked for; `user` names the end user ------------------------------------------


async def test_user_is_an_end_user_id_and_the_clients_history_reaches_the_provider(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api=API)
    messages = [{"role": "system", "content": "CLIENT-SYSTEM-PROMPT"}, {"role": "user", "content": "first"},
                {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second"}]
    async with aiohttp.ClientSession() as http:
        status, out = await _post(http, daemon, {"messages": messages, "user": "enduser-1"})
    assert status == 200, out
    assert provider.connections[0].body["messages"] == messages
    assert await daemon.store.sessions() == []  # stateless: nothing kept


async def test_a_session_keeps_the_clients_system_prompt_beside_the_stored_history(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api=API)
    system = {"role": "system", "content": "CLIENT-SYSTEM-PROMPT"}
    async with aiohttp.ClientSession() as http:
        for text, via in (("first", {"metadata": {"session_id": "s1"}}), ("second", {})):
            messages = [system, {"role": "user", "content": "the client's copy of the past"},
                        {"role": "user", "content": text}]
            status, out = await _post(http, daemon, {"messages": messages, **via},
                                      **({} if via else {"X-Session-Id": "s1"}))
            assert status == 200, out
    sent = provider.connections[1].body["messages"]
    assert sent == [system, {"role": "user", "content": "first"},
                    {"role": "assistant", "content": "reply to: first w0 "}, {"role": "user", "content": "second"}]
    _conversation, rows = await daemon.store.conversation(f"api:dm:{key_id(KEY)}/s1")
    assert [r.role for r in rows] == ["user", "assistant", "user", "assistant"]  # the prompt is never stored


async def test_the_rate_limit_counts_per_end_user_across_sessions(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api=API, router={"messages_per_minute": 1})
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "user": "enduser-1"}
        first = await _post(http, daemon, body, **{"X-Session-Id": "a"})
        second = await _post(http, daemon, body, **{"X-Session-Id": "b"})
        other = await _post(http, daemon, {**body, "user": "enduser-2"}, **{"X-Session-Id": "c"})
    assert first[0] == 200 and other[0] == 200
    assert second[0] == 429 and "faster than I can take them" in second[1]["error"]["message"]


# --- 5. an interrupted answer says so -------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_interrupted_answer_ends_with_finish_reason_length(
        make_daemon: DaemonFactory, provider: FakeProvider, stream: bool) -> None:
    provider.delay_s, provider.words = 0.05, 400
    provider.by_text["never mind"] = Script(text="fine")
    daemon = await make_daemon(api=API)
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "a long one"}]}
        if stream:
            pending: asyncio.Task[Any] = asyncio.create_task(_events(http, daemon, body, **{"X-Session-Id": "cut"}))
        else:
            pending = asyncio.create_task(_post(http, daemon, body, **{"X-Session-Id": "cut"}))
        await until(lambda: bool(provider.requests_for("a long one")) and provider.connections[0].words > 3, 10,
                    "the answer never streamed")
        status, _ = await _post(http, daemon, {"messages": [{"role": "user", "content": "never mind"}]},
                                **{"X-Session-Id": "cut"})  # busy "interrupt", the default
        assert status == 200
        answer = await asyncio.wait_for(pending, 10)
    if stream:
        events, done = answer
        text, finish = _choice(events)
        extra = [e for e in events if e.get("switchboard")][-1]["switchboard"]
        assert done
    else:
        _status, out = answer
        text, finish, extra = out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"], \
            out["switchboard"]
        assert out["usage"]["prompt_tokens"] > 0 and out["usage"]["completion_tokens"] > 0
    assert finish == "length" and text.startswith("reply to:")
    # The round cut short was never counted by the provider: its tokens are our estimate, and say so.
    assert extra == {"interrupted_by": "user", "reason": "user sent a new message", "usage_estimated": True}


# --- 6. OpenAI-shaped errors on every path ---------------------------------------------------------


async def test_errors_are_openai_shaped_on_every_path(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    daemon = await make_daemon(api=API)
    async with aiohttp.ClientSession() as http:
        async with http.get(_url(daemon, "/v1/models/switchboard"), headers=_auth()) as resp:
            assert resp.status == 200
            assert await resp.json() == {"id": "switchboard", "object": "model", "created": 0,
                                         "owned_by": "switchboard"}
        async with http.get(_url(daemon, "/v1/models/gpt-4o"), headers=_auth()) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
        async with http.get(_url(daemon, "/v1/models/switchboard")) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        async with http.post(_url(daemon, "/v1/embeddings"), json={}, headers=_auth()) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"] == {"message": "Unknown request URL: POST /v1/embeddings.",
                                                    "type": "invalid_request_error", "param": None, "code": None}
        async with http.get(_url(daemon, "/v1/chat/completions"), headers=_auth()) as resp:
            assert resp.status == 405 and "POST" in resp.headers["Allow"]
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
        async with http.post(_url(daemon), data=b'{"x": "' + b"a" * (32 << 20) + b'"}',
                             headers=_auth(**{"Content-Type": "application/json"})) as resp:
            assert resp.status == 413 and (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_a_crash_is_a_500_with_an_openai_error_body() -> None:
    async def crash(_request: web.Request) -> web.Response:
        raise ValueError("a bug")

    app = web.Application(middlewares=[api_errors])
    app.router.add_get("/v1/crash", crash)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/v1/crash") as resp:
            assert resp.status == 500
            assert (await resp.json())["error"]["type"] == "server_error"
    finally:
        await runner.cleanup()


async def test_a_provider_failure_mid_stream_is_an_error_event(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.then(Script(status=500))
    daemon = await make_daemon(api=API)
    async with aiohttp.ClientSession() as http:
        events, done = await _events(http, daemon, {"messages": [{"role": "user", "content": "hi"}]})
    assert not done and events[-1]["error"]["type"] == "provider_error"
    assert "fake failure 500" in events[-1]["error"]["message"]


# --- 8. a silent stream notices a closed client within a second ------------------------------------


async def test_a_silent_stream_writes_a_keepalive_within_a_second(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.then(Script(think_s=3, text="late"))
    daemon = await make_daemon(api=API)
    async with aiohttp.ClientSession() as http, http.post(
            _url(daemon), json={"messages": [{"role": "user", "content": "think"}], "stream": True},
            headers=_auth()) as resp:
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        started = time.monotonic()
        while (line := await asyncio.wait_for(resp.content.readline(), 5)) != b": keepalive\n":
            assert line.strip() == b"", line
        assert time.monotonic() - started < 1.0
