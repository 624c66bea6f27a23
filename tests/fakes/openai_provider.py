"""A fake OpenAI-compatible provider (aiohttp) for tests and benchmarks.

It streams tokens slowly, can answer with tool calls, fail or send garbage, and records every
request body and the exact moment each client connection closed (hooked on the protocol's
`connection_lost`, so a close is seen even while the handler is asleep between tokens). With a
`HangupWatch`, also the moment the kernel reported the client's hangup, whatever the provider's
own event loop was busy with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Script:
    """One scripted answer. Without tool calls it streams `text` word by word."""

    text: str | None = None  # None: echo "reply to: <last user text>"
    delay_s: float | None = None
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status: int = 200
    garbage: bool = False
    json_only: bool = False  # answer with a plain JSON completion despite stream=true
    echo_key: bool = False  # answer 401 quoting the API key it was sent, as some providers do
    think_s: float = 0.0  # silence before the first token (a model thinking)
    fragments: int = 0  # send the whole stream, CRLF lines, in pieces of this many bytes, one per write


@dataclass
class Connection:
    opened_at: float
    body: dict[str, Any]
    closed_at: float | None = None
    hangup_at: float | None = None  # the kernel reported the client's hangup (only with a HangupWatch)
    completed: bool = False  # the provider sent the whole answer
    completed_at: float | None = None
    words: int = 0  # words of a text answer written so far
    via: str | None = None  # the path prefix the client used (`/<via>/v1/...`): which client it was
    authorization: str | None = None  # the request's Authorization header

    @property
    def ended_at(self) -> float | None:
        """When this request stopped streaming: its answer was complete or its connection closed."""
        ends = [t for t in (self.completed_at, self.closed_at) if t is not None]
        return min(ends) if ends else None

    @property
    def last_user(self) -> str:
        users = [m for m in self.body.get("messages", []) if m.get("role") == "user"]
        if not users:
            return ""
        content = users[-1]["content"]
        if isinstance(content, list):  # content parts: the text of the first, the message itself
            return str(content[0].get("text", "")) if content and isinstance(content[0], dict) else ""
        return str(content)

    @property
    def last_user_parts(self) -> list[dict[str, Any]]:
        """The content parts of the last user message (empty when its content is a plain string)."""
        users = [m for m in self.body.get("messages", []) if m.get("role") == "user"]
        content = users[-1]["content"] if users else None
        return [p for p in content if isinstance(p, dict)] if isinstance(content, list) else []


class FakeProvider:
    def __init__(self, *, delay_s: float = 0.02, words: int = 20) -> None:
        self.delay_s = delay_s
        self.words = words
        self.scripts: deque[Script] = deque()
        self.by_text: dict[str, Script] = {}
        self.connections: list[Connection] = []
        # Optional: the default streamed text for a connection (instead of "reply to: ..."), e.g.
        # to put a tag in every answer that names the request it came from.
        self.text_for: Callable[[Connection], str] | None = None
        # Token counting as a provider would report it (stream_options.include_usage): characters
        # of the request's messages per token; and a context window that refuses longer requests.
        self.chars_per_token = 4.0
        self.max_context_tokens: int | None = None
        # Optional: the script for a request that has no queued or by-text script (None: the default).
        self.script_for: Callable[[Connection], Script | None] | None = None
        self.record = True  # keep every request in `connections` (a long benchmark turns it off)
        self.count_body = False  # count prompt tokens from the body's length (cheap: for benchmarks)
        self._runner: web.AppRunner | None = None
        self._closed = asyncio.Condition()
        self.port = 0
        self.hangups: HangupWatch | None = None  # set before `start`: see HangupWatch

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> FakeProvider:
        return await self.start_on(0)

    async def start_on(self, port: int) -> FakeProvider:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        # The same endpoint under a per-client prefix (base URL `.../<via>/v1`), recorded as `via`.
        app.router.add_post("/{via}/v1/chat/completions", self._completions)
        app.router.add_get("/_connections", self._stats)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port, backlog=4096).start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeProvider:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def then(self, script: Script) -> None:
        """Use `script` for the next request (FIFO); otherwise `by_text` or the default."""
        self.scripts.append(script)

    def for_text(self, last_user_text: str) -> Script:
        return self.by_text.get(last_user_text) or Script()

    async def wait_closed(self, conn: Connection, timeout: float = 5.0) -> float:
        async with self._closed:
            await asyncio.wait_for(self._closed.wait_for(lambda: conn.closed_at is not None), timeout)
        assert conn.closed_at is not None
        return conn.closed_at

    def requests_for(self, text: str) -> list[Connection]:
        return [c for c in self.connections if c.last_user == text]

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        conn = Connection(time.perf_counter(), body, via=request.match_info.get("via"),
                          authorization=request.headers.get("Authorization"))
        if self.record:
            self.connections.append(conn)
            self._hook_close(request, conn)
        script = self.scripts.popleft() if self.scripts else self.by_text.get(conn.last_user) or (
            self.script_for(conn) if self.script_for is not None else None) or Script()
        if script.echo_key:
            conn.completed = True
            key = request.headers.get("Authorization", "").removeprefix("Bearer ")
            return web.json_response({"error": {"message": f"Incorrect API key provided: {key}",
                                                "type": "invalid_request_error"}}, status=401)
        if script.status != 200:
            conn.completed = True
            return web.json_response({"error": {"message": f"fake failure {script.status}",
                                                "type": "server_error"}}, status=script.status)
        prompt_tokens = int((len(raw) if self.count_body else sum(
            len(json.dumps(m, ensure_ascii=False)) for m in body.get("messages", []))) / self.chars_per_token)
        if self.max_context_tokens is not None and prompt_tokens > self.max_context_tokens:
            conn.completed = True
            return web.json_response({"error": {
                "message": f"This model's maximum context length is {self.max_context_tokens} tokens. However, "
                           f"your messages resulted in {prompt_tokens} tokens.",
                "type": "invalid_request_error", "code": "context_length_exceeded"}}, status=400)
        if script.json_only:
            conn.completed = True
            return web.json_response({"choices": [{"index": 0, "message": {
                "role": "assistant", "content": script.text or f"reply to: {conn.last_user}"},
                "finish_reason": "stop"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(request)
        except ConnectionError:  # the client is gone already (e.g. killed right after asking)
            return resp
        delay = self.delay_s if script.delay_s is None else script.delay_s
        try:
            if script.think_s > 0:
                await asyncio.sleep(script.think_s)
            if script.fragments:
                text = script.text if script.text is not None else self._default_text(conn.last_user)
                events = [{"choices": [{"index": 0, "delta": {"content": word + " "}}]} for word in text.split(" ")]
                raw = b"".join(_sse(e).replace(b"\n", b"\r\n") for e in events) + b"data: [DONE]"  # no last newline
                for at in range(0, len(raw), script.fragments):
                    await resp.write(raw[at:at + script.fragments])
                    await asyncio.sleep(0.002)  # a read of its own
                conn.completed = True
                conn.completed_at = time.perf_counter()
                await resp.write_eof()
                return resp
            if script.garbage:
                await resp.write(b"data: {this is not json\n\n")
            elif script.tool_calls:
                for i, (name, args) in enumerate(script.tool_calls):
                    delta = {"tool_calls": [{"index": i, "id": f"call_{len(self.connections)}_{i}",
                                             "type": "function",
                                             "function": {"name": name, "arguments": json.dumps(args)}}]}
                    await resp.write(_sse({"choices": [{"index": 0, "delta": delta}]}))
                await resp.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}))
            else:
                for word in self._words(script, conn):
                    await asyncio.sleep(delay)
                    await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": word + " "}}]}))
                    conn.words += 1
                await resp.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
            if (body.get("stream_options") or {}).get("include_usage"):
                completion = len(script.tool_calls) * 10 if script.tool_calls else self.words + 3
                await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                                "completion_tokens": completion}}))
            await resp.write(b"data: [DONE]\n\n")
            conn.completed = True
            conn.completed_at = time.perf_counter()
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client went away: that is what the tests look for
        return resp

    def _words(self, script: Script, conn: Connection) -> Iterator[str]:
        """A streamed answer's words. The default answer's are made one at a time: a benchmark's
        hundreds of 20,000-word streams held as lists would be millions of live objects, and this
        process's garbage collector pausing over them would show up as stop latency."""
        if script.text is not None:
            return iter(script.text.split(" "))
        if self.text_for is not None:
            return iter(self.text_for(conn).split(" "))
        return self._default_words(conn.last_user)

    def _default_words(self, user: str) -> Iterator[str]:
        yield from f"reply to: {user}".split(" ")
        yield from (f"w{i}" for i in range(self.words))

    def _default_text(self, user: str) -> str:
        return " ".join(self._default_words(user))

    async def _stats(self, _request: web.Request) -> web.Response:
        """For a provider in another process: what each connection saw (perf_counter is system-wide)."""
        return web.json_response([{"last_user": c.last_user, "opened_at": c.opened_at, "closed_at": c.closed_at,
                                   "hangup_at": c.hangup_at,
                                   "completed": c.completed, "words": c.words} for c in self.connections])

    def _hook_close(self, request: web.Request, conn: Connection) -> None:
        transport = request.transport
        assert transport is not None

        def lost() -> None:
            if conn.closed_at is None:
                conn.closed_at = time.perf_counter()
                if conn.hangup_at is None:  # the loop got there first (and closes the socket the watch had)
                    conn.hangup_at = conn.closed_at
                asyncio.get_running_loop().create_task(self._notify())

        spy = transport.get_protocol()
        if not isinstance(spy, _CloseSpy):  # keep-alive: one spy per connection, many requests
            spy = _CloseSpy(spy)
            transport.set_protocol(spy)
        spy.callbacks.append(lost)
        sock = transport.get_extra_info("socket")
        if self.hangups is not None and sock is not None:
            self.hangups.watch(sock, conn)

    async def _notify(self) -> None:
        async with self._closed:
            self._closed.notify_all()


class _CloseSpy(asyncio.Protocol):
    """Sits in front of aiohttp's protocol and reports the moment the connection is lost."""

    def __init__(self, inner: asyncio.BaseProtocol) -> None:
        self.inner = inner
        self.callbacks: list[Callable[[], None]] = []

    def connection_lost(self, exc: Exception | None) -> None:
        for callback in self.callbacks:
            callback()
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[attr-defined, no-any-return]

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class HangupWatch:
    """A thread that notes each connection's hangup when the kernel reports it (epoll, EPOLLRDHUP).

    For benchmarks of how fast the gateway closes a stream: the provider's own event loop, busy
    writing a thousand streams, reaches a close (`closed_at`) only behind its backlog, and that wait
    is the fake's, not the gateway's. A real provider sees the close in its kernel the same way. The
    thread needs the interpreter's lock to read the clock: the provider run on its own with
    `--watch-hangups` bounds that wait at 0.5 ms (`sys.setswitchinterval`)."""

    EVENTS = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._conns: dict[int, Connection] = {}
        threading.Thread(target=self._run, name="hangup-watch", daemon=True).start()

    def watch(self, sock: socket.socket, conn: Connection) -> None:
        fd = sock.fileno()
        self._conns[fd] = conn  # keep-alive: the socket's latest request
        try:
            self._epoll.register(fd, self.EVENTS)
        except FileExistsError:
            self._epoll.modify(fd, self.EVENTS)

    def _run(self) -> None:
        while True:
            for fd, _events in self._epoll.poll():
                at = time.perf_counter()
                conn = self._conns.pop(fd, None)
                if conn is not None and conn.hangup_at is None:
                    conn.hangup_at = at
                with contextlib.suppress(OSError):
                    self._epoll.unregister(fd)


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _serve(port: int, delay_s: float, words: int, text: str | None, record: bool, hangups: bool) -> None:
    provider = FakeProvider(delay_s=delay_s, words=words)
    provider.record = record
    if hangups:
        sys.setswitchinterval(0.0005)  # the watch thread's wait for the interpreter's lock
        provider.hangups = HangupWatch()
    provider.count_body = not record
    if text is not None:
        provider.text_for = lambda _conn: text
    await provider.start_on(port)
    print(f"fake provider on {provider.base_url}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Run the fake OpenAI-compatible provider on its own.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--words", type=int, default=200)
    parser.add_argument("--text", help="the same answer to every request (default: 'reply to: ...' and --words words)")
    parser.add_argument("--no-record", action="store_true",
                        help="keep no request bodies; count tokens from the body length (benchmarks)")
    parser.add_argument("--watch-hangups", action="store_true",
                        help="note each client's hangup as the kernel reports it (see HangupWatch)")
    args = parser.parse_args()
    asyncio.run(_serve(args.port, args.delay, args.words, args.text, not args.no_record, args.watch_hangups))
