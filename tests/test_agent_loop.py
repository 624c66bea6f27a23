"""The agent loop, end to end through a daemon and the fake provider: steering a turn with new
messages, tool calls side by side, the context budget on a long conversation, token usage."""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from gateway.agents.processes import group_alive
from gateway.core.fencing import Fence
from gateway.core.transcript import ChatMessage, ToolCall
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import Connection, FakeProvider, Script


async def until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


class Page:
    """A browser on the web chat: one session, its frames as they come."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http, self.base = http, base
        self.frames: list[dict[str, Any]] = []
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None

    async def open(self) -> Page:
        async with self.http.get(self.base + "/"):
            pass
        self.ws = await self.http.ws_connect(self.base + "/ws", origin=self.base)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        await until(lambda: any(f["type"] == "hello" for f in self.frames))
        return self

    async def _read(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                self.frames.append(msg.json())

    async def say(self, mid: str, text: str) -> None:
        assert self.ws is not None
        await self.ws.send_json({"type": "message", "id": mid, "text": text})

    def ack(self, mid: str) -> str | None:
        return next((f["outcome"] for f in self.frames if f["type"] == "ack" and f["id"] == mid), None)

    def idle(self) -> int:
        return sum(1 for f in self.frames if f == {"type": "state", "running": False})

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            await asyncio.wait({self._reader}, timeout=2)


def roles(conn: Connection) -> list[tuple[str, str]]:
    return [(m["role"], str(m.get("content") or "")[:40]) for m in conn.body["messages"]]


async def test_a_message_sent_mid_answer_is_steered_into_it(make_daemon: DaemonFactory, provider: FakeProvider,
                                                            tmp_path: Path) -> None:
    provider.delay_s, provider.words = 0.03, 20
    daemon = await make_daemon(router={"busy": "steer"})
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        page = await Page(http, f"http://127.0.0.1:{daemon.config.http.port}").open()
        try:
            await page.say("m1", "tell me about cats")
            await until(lambda: any(f["type"] in ("message", "edit") for f in page.frames))
            sent = time.perf_counter()
            await page.say("m2", "and dogs too")
            await until(lambda: page.ack("m2") is not None)
            assert page.ack("m2") == "steered"
            assert any(f["type"] == "notice" and f["text"] == "↪ added to the current answer" for f in page.frames)
            await until(lambda: len(provider.connections) >= 2)
            delivered = provider.connections[1].opened_at - sent
            await until(lambda: page.idle() >= 1)
        finally:
            await page.close()
    # The same turn went on: the model saw its own answer so far, then what the user added.
    assert roles(provider.connections[1])[-3:] == [("user", "tell me about cats"),
                                                   ("assistant", "reply to: tell me about cats w0 w1 w2 w3"),
                                                   ("user", "and dogs too")]
    assert len(provider.connections) == 2 and delivered < 2.0
    key = next(s.key for s in await daemon.store.sessions())
    _, rows = await daemon.store.conversation(key)
    assert [(r.role, r.content.split(" w")[0]) for r in rows] == [
        ("user", "tell me about cats"), ("assistant", "reply to: tell me about cats"),
        ("user", "and dogs too"), ("assistant", "reply to: and dogs too")]
    assert await daemon.store.unfinished_inbound() == []
    last = [f for f in page.frames if f["type"] in ("message", "edit")][-1]["text"]
    assert last.startswith("reply to: tell me about cats") and "\n\nreply to: and dogs too" in last


async def test_a_message_sent_while_a_tool_runs_skips_the_calls_not_started(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.then(Script(tool_calls=[("sleep", {"seconds": 0.6}), ("sleep", {"seconds": 30})]))
    provider.words = 2
    daemon = await make_daemon(router={"busy": "steer"}, tools={"parallel": False})
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        page = await Page(http, f"http://127.0.0.1:{daemon.config.http.port}").open()
        try:
            await page.say("m1", "nap twice")
            await until(lambda: len(provider.connections) == 1 and provider.connections[0].completed)
            await page.say("m2", "never mind, just say hi")
            await until(lambda: page.ack("m2") == "steered")
            await until(lambda: page.idle() >= 1, timeout=10)
        finally:
            await page.close()
    sent = provider.connections[1].body["messages"]
    tools = [m for m in sent if m["role"] == "tool"]
    assert tools[0]["content"] == "slept 0.6 s"
    assert tools[1]["content"].startswith("[not run: the user sent a new message")
    assert sent[-1] == {"role": "user", "content": "never mind, just say hi"}


async def test_tool_calls_of_one_round_run_side_by_side_and_a_stop_reaches_each(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.then(Script(tool_calls=[("sleep", {"seconds": 30}), ("sleep", {"seconds": 30}),
                                     ("sleep", {"seconds": 30})]))
    daemon = await make_daemon(api={"enabled": True})
    url = f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "three naps"}]}
        pending = asyncio.create_task(http.post(url, json=body, headers={"X-Session-Id": "par"}))
        # all three at once, not one after another
        await until(lambda: sum(map(group_alive, daemon.reaper.live_groups)) >= 3)
        async with http.post(url, json={"messages": [{"role": "user", "content": "/stop"}]},
                             headers={"X-Session-Id": "par"}) as resp:
            assert resp.status == 200
        answer = await (await asyncio.wait_for(pending, 5)).json()
        await until(lambda: not any(map(group_alive, daemon.reaper.live_groups)))
    assert answer["switchboard"]["interrupted_by"] == "user"
    _, rows = await daemon.store.conversation("api:dm:par")
    tools = [r for r in rows if r.role == "tool"]
    assert len(tools) == 3 and all(t.content == "[interrupted by user: stopped by user (/stop)]" for t in tools)
    calls = [c.id for r in rows for c in r.tool_calls]
    assert [t.tool_call_id for t in tools] == calls  # in the order the model asked


async def test_every_stream_a_turn_opens_is_closed_by_the_turn_not_left_to_the_garbage_collector(
        make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    """An async generator dropped before its end is closed later, in a task of the event loop's,
    by its finalizer hook: the provider stream, the tool tasks, on no run's clock. Answered turns,
    a tool round and a stopped round of tools leave none of ours to it."""
    finalized: list[str] = []
    hooks = sys.get_asyncgen_hooks()

    def finalizer(agen: Any) -> None:
        if "/gateway/" in agen.ag_code.co_filename or "/platforms/" in agen.ag_code.co_filename:
            finalized.append(agen.ag_code.co_qualname)
        if hooks.finalizer is not None:
            hooks.finalizer(agen)

    sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=finalizer)
    try:
        provider.words = 3
        daemon = await make_daemon(api={"enabled": True})
        url = f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            async def ask(text: str, session: str = "gen") -> dict[str, Any]:
                body = {"messages": [{"role": "user", "content": text}]}
                async with http.post(url, json=body, headers={"X-Session-Id": session}) as resp:
                    assert resp.status == 200
                    return dict(await resp.json())

            for i in range(3):
                await ask(f"hello {i}")
            provider.then(Script(tool_calls=[("sleep", {"seconds": 0.01})]))
            await ask("a short nap")
            provider.then(Script(tool_calls=[("sleep", {"seconds": 30}), ("sleep", {"seconds": 30})]))
            pending = asyncio.create_task(ask("two long naps", "stopped"))
            await until(lambda: sum(map(group_alive, daemon.reaper.live_groups)) >= 2)
            await ask("/stop", "stopped")
            assert (await asyncio.wait_for(pending, 5))["switchboard"]["interrupted_by"] == "user"
        gc.collect()
        assert len(provider.connections) == 6
        assert finalized == []
    finally:
        sys.set_asyncgen_hooks(*hooks)


async def test_a_long_conversation_is_sent_within_the_budget(make_daemon: DaemonFactory,
                                                            provider: FakeProvider) -> None:
    provider.words = 2
    daemon = await make_daemon(api={"enabled": True}, agent={"context_tokens": 3000, "reply_tokens": 500})
    key = "api:dm:long"
    fence = Fence.local(key)
    rows: list[ChatMessage] = []
    for i in range(500):
        call = ToolCall(f"c{i}", "shell", '{"command": "ls"}')
        rows += [ChatMessage("user", f"question {i}"), ChatMessage("assistant", "", tool_calls=(call,)),
                 ChatMessage("tool", "file\n" * 100, tool_call_id=call.id), ChatMessage("assistant", f"answer {i}")]
    await daemon.store.append(fence, 1, rows)
    url = f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "what was the last question?"}]}
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers={"X-Session-Id": "long"}) as resp:
        assert resp.status == 200
    sent = provider.connections[-1].body["messages"]
    assert 4 < len(sent) < 200  # the newest turns, not 2,000 messages
    assert sent[0]["role"] == "user" and sent[-1]["content"] == "what was the last question?"
    assert sent[-5]["content"] == "question 499"  # the most recent turn is always there, whole
    ids = [m.get("tool_call_id") for m in sent if m["role"] == "tool"]
    assert ids == [c["id"] for m in sent for c in m.get("tool_calls", [])]  # no half pairs


async def test_a_context_too_long_error_is_retried_once_with_less(make_daemon: DaemonFactory,
                                                                 provider: FakeProvider) -> None:
    provider.words = 2
    provider.chars_per_token = 1.0  # the provider counts four times what the daemon estimates
    provider.max_context_tokens = 6000
    daemon = await make_daemon(api={"enabled": True}, agent={"context_tokens": 8000, "reply_tokens": 500})
    fence = Fence.local("api:dm:tight")
    await daemon.store.append(fence, 1, [ChatMessage("user" if i % 2 == 0 else "assistant", f"row {i} " + "z" * 100)
                                         for i in range(200)])
    url = f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "still there?"}]}
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers={"X-Session-Id": "tight"}) as resp:
        out = await resp.json()
    assert resp.status == 200, out
    assert len(provider.connections) == 2  # refused once for its length, then sent shorter
    assert len(provider.connections[1].body["messages"]) < len(provider.connections[0].body["messages"])


async def test_token_usage_is_counted_per_session_and_shown(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    provider.words = 3
    daemon = await make_daemon(api={"enabled": True})
    url = f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        for text in ("hello", "/status"):
            async with http.post(url, json={"messages": [{"role": "user", "content": text}]},
                                 headers={"X-Session-Id": "tok"}) as resp:
                out = await resp.json()
        async with http.get(f"http://127.0.0.1:{daemon.config.admin.port}/metrics") as resp:
            metrics = await resp.text()
    assert provider.connections[0].body["stream_options"] == {"include_usage": True}
    status = out["choices"][0]["message"]["content"]
    assert "context:" in status and "tokens in the last request" in status
    assert 'switchboard_tokens_total{kind="completion",tenant="-"} 6.0' in metrics
