"""MCP servers as tools: each configured server kept connected (restarted with backoff when it
fails), its tools offered to the model as `<server>__<tool>` while it is up.

A server that fails to start or dies is logged once per outage (a warning, and one more line when
it is back), shown in `/readyz` and `/status`, and retried after 1, 2, 4 … up to `max_backoff_s`
seconds; its tools leave the offer until it is back. Nothing here can stop the daemon: every
failure of a server stays inside its supervisor task.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp import types
from mcp.client.stdio import get_default_environment
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.agents.mcp_config import McpServerConfig
from gateway.agents.mcp_sdk import MCPError, attr, http_streams, inner, list_tools
from gateway.agents.mcp_session import CancellingSession, ProcessPipes, call_deadline, is_transport_error, stdio_streams
from gateway.agents.processes import ProcessReaper
from gateway.agents.tools import Tool
from gateway.core.backoff import Backoff
from gateway.core.cancellation import Run, get_run
from gateway.core.logs import redactor
from gateway.core.outage import OutageLog
from gateway.core.ports import Health
from gateway.core.quotas import api_tenant

log = logging.getLogger(__name__)

NAME_MAX = 64  # what OpenAI-compatible providers accept for a function name
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def read_pairs(path: str, sep: str) -> dict[str, str]:
    """`KEY<sep>VALUE` lines of a secret file (blank lines and # comments skipped); every value
    is added to the log redactor. Raises ValueError naming the bad line's number, never its text."""
    pairs: dict[str, str] = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, found, value = line.partition(sep)
        if not found or not key.strip():
            raise ValueError(f"{path}: line {number} is not KEY{sep}VALUE")
        pairs[key.strip()] = value.strip()
        if value.strip():
            redactor.add(value.strip())
    return pairs


def tool_name(server: str, tool: str, taken: Iterable[str] = ()) -> str:
    """`<server>__<tool>` in the characters providers accept, at most 64 long; a name that had to
    be shortened or would collide gets a short hash of the original."""
    name = f"{server}__{_UNSAFE.sub('_', tool)}"
    if len(name) > NAME_MAX or name in set(taken):
        digest = hashlib.sha256(f"{server}/{tool}".encode()).hexdigest()[:8]
        name = f"{name[:NAME_MAX - 9]}_{digest}"
    return name


def _wanted(tool: str, settings: McpServerConfig) -> bool:
    if settings.enabled_tools and not any(fnmatch.fnmatchcase(tool, p) for p in settings.enabled_tools):
        return False
    return not any(fnmatch.fnmatchcase(tool, p) for p in settings.disabled_tools)


def _schema(tool: types.Tool) -> dict[str, Any]:
    schema = dict(attr(tool, "input_schema") or {})
    schema.setdefault("type", "object")
    if schema.get("type") == "object":
        schema.setdefault("properties", {})
    return schema


def format_result(result: types.CallToolResult, max_output: int) -> str:
    """A tool result as the text the model reads: text parts as they are, other parts named."""
    parts: list[str] = []
    for item in result.content:
        if isinstance(item, types.TextContent):
            parts.append(item.text)
        elif isinstance(item, (types.ImageContent, types.AudioContent)):
            parts.append(f"[{item.type}: {attr(item, 'mime_type')}, {len(item.data) * 3 // 4} bytes, not shown]")
        elif isinstance(item, types.EmbeddedResource):
            res = item.resource
            parts.append(res.text if isinstance(res, types.TextResourceContents) else f"[resource {res.uri}]")
        elif isinstance(item, types.ResourceLink):
            parts.append(f"[resource {item.uri}]")
    structured = attr(result, "structured_content")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    text = "\n".join(parts) or "(no output)"
    if len(text) > max_output:
        text = text[:max_output] + "\n[output truncated]"
    return f"error: {text}" if attr(result, "is_error") else text


class McpServer:
    """One server: its supervisor task, its live session, its tools while it is up."""

    def __init__(self, settings: McpServerConfig, reaper: ProcessReaper, *, max_output: int = 16_000) -> None:
        self.settings = settings
        self.reaper = reaper
        self.max_output = max_output
        self.session: CancellingSession | None = None
        self.tools: dict[str, Tool] = {}  # offered name -> tool, while up
        self.state = "starting"
        self.detail = "starting"
        # Restarts wait 1, 2, 4 … up to max_backoff_s seconds (max_backoff_s at once if it is below 1).
        self._backoff = Backoff(min(1.0, settings.max_backoff_s), settings.max_backoff_s, jitter=0.0)
        self._outage = OutageLog(log, f"MCP server {settings.name}")
        self.restarts = 0
        self.late_results = 0  # answers that came after their call was stopped, dropped
        self.calls: Counter[str] = Counter()  # by outcome: ok, tool_error, error, timeout, cancelled, unavailable
        self.pid: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._lost = asyncio.Event()
        self._lost_reason = ""
        self._listed = asyncio.Event()  # the tool list changed: list again

    @property
    def up(self) -> bool:
        return self.state == "up"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name=f"mcp:{self.settings.name}")

    async def close(self, timeout_s: float = 5.0) -> None:
        """Disconnect (a stdio server's group gets SIGTERM, then SIGKILL from the reaper). An HTTP
        server that does not answer the session's closing DELETE holds the shutdown up `timeout_s` at most."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                log.warning("MCP server %s did not disconnect within %.0f s", self.settings.name, timeout_s)

    def health(self) -> Health:
        return Health(self.up or not self.settings.required, f"{self.settings.name}: {self.detail}")

    def allows(self, run: Run | None) -> bool:
        """May this run's session use the server? (Outside any run, only an unrestricted one.)"""
        s = self.settings
        if not s.allow_sessions and not s.allow_tenants:
            return True
        if run is None:
            return False
        return (any(fnmatch.fnmatchcase(run.session_key, p) for p in s.allow_sessions)
                or (run.tenant is not None and run.tenant in s.allow_tenants))

    # --- supervision --------------------------------------------------------------------------

    async def _supervise(self) -> None:
        s = self.settings
        while True:
            started = time.monotonic()
            try:
                reason = await self._connected_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure of one server stays here
                reason = _describe(exc)
                if reason == "timed out":  # the connect deadline (a ping's is reported by _serve)
                    reason = f"not ready within {s.connect_timeout_s:g} s (connect_timeout_s)"
            self._set_down(reason)
            if time.monotonic() - started > max(60.0, s.max_backoff_s):
                self._backoff.reset()  # it had been up a good while: a fresh outage starts from 1 s
            delay = self._backoff.step()
            self.detail = f"down: {reason}; retry in {delay:g} s"
            await asyncio.sleep(delay)
            self.restarts += 1

    async def _connected_once(self) -> str:
        """Connect, list, serve until the connection is lost; returns why it ended."""
        s = self.settings
        self._lost.clear()
        pipes: ProcessPipes | None = None
        async with contextlib.AsyncExitStack() as stack:
            async with asyncio.timeout(s.connect_timeout_s):
                if s.command is not None:
                    env = {**get_default_environment(), **s.env}
                    if s.env_file:
                        env.update(read_pairs(s.env_file, "="))
                    read, write, started = await stack.enter_async_context(
                        stdio_streams(self.reaper, [s.command, *s.args], env, s.cwd, s.name))
                    pipes, self.pid = started, started.pid
                    watch = asyncio.ensure_future(self._watch_process(started))
                    stack.callback(watch.cancel)
                else:
                    assert s.url is not None
                    headers = read_pairs(s.headers_file, ":") if s.headers_file else {}
                    read, write = await stack.enter_async_context(http_streams(s.url, headers, s.connect_timeout_s))
                session = await stack.enter_async_context(
                    CancellingSession(read, write, message_handler=self._on_message, on_late_result=self._late))
                stack.push_async_callback(session.settle)
                try:
                    await session.initialize()
                    await self._list(session)
                except MCPError:
                    if pipes is not None and pipes.ended.is_set():  # it exited: say how, not "connection closed"
                        return await pipes.exit_reason()
                    raise
            self.session = session
            self._set_up()
            try:
                reason = await self._serve(session)
                if pipes is not None and pipes.ended.is_set():  # the process's own account beats "connection closed"
                    reason = await pipes.exit_reason()
                return reason
            finally:
                self.session = None
                self.tools = {}

    async def _serve(self, session: CancellingSession) -> str:
        """Ping every `ping_interval_s` and list again when the server says its tools changed,
        until the connection is lost; returns why."""
        s = self.settings
        lost = asyncio.ensure_future(self._lost.wait())
        relist: asyncio.Future[Any] | None = None
        try:
            while True:
                relist = asyncio.ensure_future(self._listed.wait())
                done, _ = await asyncio.wait({lost, relist}, timeout=s.ping_interval_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if lost in done:
                    return self._lost_reason or "connection lost"
                if relist in done:
                    self._listed.clear()
                    await asyncio.wait_for(self._list(session), s.connect_timeout_s)
                    continue
                try:
                    await asyncio.wait_for(session.send_ping(), s.connect_timeout_s)
                except TimeoutError:
                    return f"did not answer a ping within {s.connect_timeout_s:g} s"
                except MCPError as exc:
                    return _describe(exc)
        finally:
            lost.cancel()
            if relist is not None:
                relist.cancel()

    async def _watch_process(self, pipes: ProcessPipes) -> None:
        await pipes.ended.wait()
        self.mark_lost(await pipes.exit_reason())

    def mark_lost(self, reason: str) -> None:
        if not self._lost.is_set():
            self._lost_reason = reason
            self._lost.set()

    async def _on_message(self, message: Any) -> None:
        if isinstance(inner(message), types.ToolListChangedNotification):
            self._listed.set()

    def _late(self) -> None:
        """The answer to a call that was stopped or timed out: nobody waits for it any more."""
        self.late_results += 1
        log.debug("MCP server %s: a late result was dropped", self.settings.name)

    async def _list(self, session: CancellingSession) -> None:
        listed: list[types.Tool] = []
        cursor: str | None = None
        while True:
            page = await list_tools(session, cursor)
            listed += page.tools
            cursor = attr(page, "next_cursor")
            if not cursor:
                break
        tools: dict[str, Tool] = {}
        for t in listed:
            if _wanted(t.name, self.settings):
                name = tool_name(self.settings.name, t.name, tools)
                tools[name] = Tool(name, (t.description or t.title or t.name)[:1024], _schema(t), self._caller(t.name))
        self.tools = tools
        if self.up:
            self.detail = f"up, {len(tools)} tool(s)"

    def _set_up(self) -> None:
        if not self._outage.recovered(f"is back ({len(self.tools)} tool(s))", level=logging.WARNING):
            log.info("MCP server %s is up (%d tool(s))", self.settings.name, len(self.tools))
        self.state = "up"
        self.detail = f"up, {len(self.tools)} tool(s)"

    def _set_down(self, reason: str) -> None:
        # One kind of failure: logged once per outage, whatever the reason; the retries say nothing more.
        self._outage.failed("down", f"is down: {reason}; its tools are withdrawn, retrying with backoff")
        self.state = "down"

    # --- calls ----------------------------------------------------------------------------------

    def _caller(self, remote: str) -> Any:
        async def call(args: dict[str, Any]) -> str:
            return await self.call(remote, args)

        return call

    async def call(self, remote: str, args: dict[str, Any]) -> str:
        """Call tool `remote` under the per-call deadline. A failure is an error text for the model;
        the run's cancel propagates (and the server is told, see `CancellingSession`)."""
        try:
            outcome, text = await self._call(remote, args)
        except asyncio.CancelledError:
            self.calls["cancelled"] += 1
            raise
        self.calls[outcome] += 1
        return text

    async def _call(self, remote: str, args: dict[str, Any]) -> tuple[str, str]:
        s = self.settings
        session = self.session
        if session is None:
            return "unavailable", f"error: MCP server {s.name} is not available ({self.detail})"
        token = call_deadline.set((time.monotonic() + s.timeout_s, f"timed out after {s.timeout_s:g} s"))
        try:
            async with asyncio.timeout(s.timeout_s):
                result = await session.call_tool(remote, args)
        except TimeoutError:
            return "timeout", (f"error: {s.name}__{remote} timed out after {s.timeout_s:g} s "
                               "(the server was told to stop)")
        except MCPError as exc:
            if exc.error.code == types.CONNECTION_CLOSED:
                self.mark_lost("connection closed")
                return "error", f"error: MCP server {s.name} closed the connection during the call"
            return "error", f"error: {s.name}: {redactor(exc.error.message)[:300]}"
        except Exception as exc:
            if is_transport_error(exc):
                self.mark_lost(_describe(exc))
                return "error", f"error: MCP server {s.name} failed during the call ({_describe(exc)})"
            return "error", f"error: {s.name}__{remote} failed: {_describe(exc)}"
        finally:
            call_deadline.reset(token)
        return ("tool_error" if attr(result, "is_error") else "ok"), format_result(result, self.max_output)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, MCPError):
        return redactor(exc.error.message)[:200]
    if isinstance(exc, ExceptionGroup):
        inner = exc.exceptions[0] if exc.exceptions else exc
        return _describe(inner)
    text = str(exc)
    return redactor(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:200]


@dataclass(slots=True)
class McpHub:
    """Every configured server; a tool source for the registry; one readiness check."""

    servers: list[McpServer] = field(default_factory=list)

    @classmethod
    def build(cls, settings: Sequence[McpServerConfig], reaper: ProcessReaper, *, max_output: int) -> McpHub:
        return cls([McpServer(s, reaper, max_output=max_output) for s in settings])

    def start(self) -> None:
        for server in self.servers:
            server.start()

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.servers))

    def tools(self) -> list[Tool]:
        """The tools of the servers that are up now and open to the current run's session."""
        run = get_run()
        return [t for s in self.servers if s.up and s.allows(run) for t in s.tools.values()]

    def unavailable(self, name: str) -> str | None:
        """Why tool `name` of a server this session may use is not offered now (None: not ours)."""
        run = get_run()
        for s in self.servers:
            if name.startswith(f"{s.settings.name}__") and not s.up and s.allows(run):
                return f"{name} is not available now: MCP server {s.settings.name} is {s.detail}"
        return None

    def health(self) -> Health:
        parts = [s.health() for s in self.servers]
        return Health(all(p.ok for p in parts), "; ".join(p.detail for p in parts))

    def status_line(self, session_key: str) -> str | None:
        """For /status: the servers this session may use, and their state. (An API session's key
        names its tenant: a server limited to that tenant is listed too.)"""
        tenant = api_tenant(session_key)
        shown = [s for s in self.servers if not (s.settings.allow_sessions or s.settings.allow_tenants)
                 or any(fnmatch.fnmatchcase(session_key, p) for p in s.settings.allow_sessions)
                 or (tenant is not None and tenant in s.settings.allow_tenants)]
        if not shown:
            return None
        return "MCP: " + ", ".join(f"{s.settings.name} {'up' if s.up else s.state}"
                                   + (f" ({len(s.tools)} tools)" if s.up else "") for s in shown)


class McpCollector(Collector):
    """The servers' state for /metrics, read at scrape time."""

    def __init__(self, hub: McpHub) -> None:
        self._hub = hub

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("switchboard_mcp_server_up", "MCP server connected (1) or not (0)", labels=["server"])
        tools = GaugeMetricFamily("switchboard_mcp_tools", "Tools an MCP server offers now", labels=["server"])
        restarts = CounterMetricFamily("switchboard_mcp_server_restarts", "MCP server (re)connection attempts after "
                                       "a failure", labels=["server"])
        calls = CounterMetricFamily("switchboard_mcp_calls", "MCP tool calls by outcome", labels=["server", "outcome"])
        for server in self._hub.servers:
            name = server.settings.name
            up.add_metric([name], 1.0 if server.up else 0.0)
            tools.add_metric([name], len(server.tools) if server.up else 0)
            restarts.add_metric([name], server.restarts)
            for outcome, count in sorted(server.calls.items()):
                calls.add_metric([name, outcome], count)
        yield from (up, tools, restarts, calls)
