"""Wires config, store, agent, cluster, router, platforms and the HTTP listeners; owns start and stop.

Everything is built in `__init__` with its collaborators passed in; `start` brings the parts up
on an `AsyncExitStack`, so `stop` takes them down in reverse order — each step logged if it
fails, none skipped because an earlier one did.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web
from prometheus_client import Gauge
from yarl import URL

from gateway.agents.echo import EchoAgent
from gateway.agents.jobs import JobRegistry, JobSettings
from gateway.agents.mcp_servers import McpCollector, McpHub
from gateway.agents.openai import ModelRoute, OpenAIAgent, OpenAISettings
from gateway.agents.probe import ProbeTarget, ProviderProbe
from gateway.agents.processes import GroupLedger, ProcessReaper
from gateway.agents.sandbox import Sandbox, sandbox_problem
from gateway.agents.tools import Access, ProcessToolSettings, builtin_registry
from gateway.cluster.coordinator import Cluster
from gateway.core.access import AccessControl
from gateway.core.cancellation import GATEWAY_RESTART, ToolReason, cancel_and_wait
from gateway.core.live import Live
from gateway.core.logs import redactor
from gateway.core.metrics import Metrics
from gateway.core.ports import Agent, Health
from gateway.core.router import Router, RouterParts
from gateway.core.settings import CoreSettings
from gateway.ops.admin import build_admin_app
from gateway.ops.client_faults import install_parser_filter
from gateway.ops.config import Config, ConfigError, load_config
from gateway.ops.hosts import HostPolicy
from gateway.ops.http import ConnectionGuard, build_app, edge_runner, start_sites
from gateway.ops.loop import loop_name
from gateway.ops.platforms import access_policies, build_adapters
from gateway.ops.safety import findings, private_data_dir
from gateway.ops.sdnotify import Notifier, Watchdog
from gateway.ops.stores import build_store, store_kind
from platforms.assets import favicon
from platforms.media import MediaStore

log = logging.getLogger(__name__)


def job_settings(config: Config) -> JobSettings:
    t = config.tools
    return JobSettings(yield_after_s=t.yield_after_s, foreground_max_s=t.foreground_max_s,
                       max_per_session=t.jobs_per_session, max_total=t.jobs_total, job_max_s=t.job_max_s,
                       buffer_chars=t.job_buffer_chars, read_chars=t.job_read_chars)


def shell_sandbox(config: Config) -> Sandbox | None:
    """Where the shell's commands run: each session's sandbox, or None (unconfined: tools.sandbox
    is off, or "auto" on a machine where bubblewrap cannot make one; `switchboard check` says so)."""
    t = config.tools
    if not t.shell or sandbox_problem(t.sandbox) is not None:
        return None
    return Sandbox(Path(config.store.data_dir).absolute() / "sandbox", network=t.sandbox_network,
                   shared_cwd=str(Path(t.shell_cwd).absolute()) if t.shell_cwd else None)


def build_agent(config: Config, reaper: ProcessReaper, mcp: McpHub | None = None,
                jobs: JobRegistry | None = None) -> Agent:
    """The one place config sections become agent settings."""
    t = config.tools
    tools = builtin_registry(
        ProcessToolSettings(reaper=reaper, max_output=t.shell_max_output, default_timeout_s=t.shell_timeout_s,
                            allow_prefixes=tuple(t.shell_allow_prefixes), cwd=t.shell_cwd,
                            sandbox=shell_sandbox(config),
                            access=Access(tuple(t.shell_allow_sessions), tuple(t.shell_allow_tenants))),
        shell=t.shell, jobs=jobs if t.jobs else None,
        sources=[mcp.tools] if mcp is not None and mcp.servers else [],
        unavailable=mcp.unavailable if mcp is not None and mcp.servers else None)
    a = config.agent
    if a.kind == "openai":
        return OpenAIAgent(OpenAISettings(
            base_url=a.base_url, model=a.model, api_key=a.api_key.reveal() if a.api_key else None,
            system_prompt=a.system_prompt, max_tool_rounds=a.max_tool_rounds, retries=a.retries,
            read_timeout_s=a.read_timeout_s, context_tokens=a.context_tokens, reply_tokens=a.reply_tokens,
            include_usage=a.include_usage, parallel_tools=t.parallel, max_parallel_tools=t.max_parallel,
            models=tuple(ModelRoute(m.name, m.model, m.base_url, m.api_key.reveal() if m.api_key else None)
                         for m in a.models)), tools)
    return EchoAgent(tools, delay_s=a.echo_delay_s)


def core_settings(config: Config, agent: Agent) -> CoreSettings:
    """What the core reads live: replaced whole on a reload."""
    return CoreSettings(agent=agent, router=config.router, media=config.media, quotas=config.quotas,
                        vision=config.agent.vision,
                        cancel_grace_s=config.tools.tool_kill_grace_s,
                        resume_max_age_s=config.daemon.resume_max_age_s)


def probe_target(agent: Agent) -> ProbeTarget | None:
    """The provider the live agent talks to (a reload may change it); None for the echo agent."""
    if not isinstance(agent, OpenAIAgent):
        return None
    return ProbeTarget(agent.settings.base_url, agent.settings.api_key)


def _url(host: str, port: int, path: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"


def started_line(config: Config, agent: str, platforms: list[str], loop: str) -> str:
    """The start-up line a person reads: where the web chat (or the HTTP listener) and the console
    are, and what answers."""
    http = "web chat" if config.webchat_enabled else "http"
    where = [f"{http} {_url(config.http.host, config.http.port, '/')}"]
    if config.admin.enabled:
        where.append(f"console {_url(config.admin.host, config.admin.port, '/admin')}")
    return (f"switchboard ready: {' · '.join(where)} · agent {agent} · platforms {', '.join(platforms) or 'none'}"
            f" · event loop {loop}")


def build_cluster(config: Config, metrics: Metrics) -> Cluster | None:
    if config.redis.url is None:
        return None
    from gateway.store.redis import connect

    c = config.cluster
    return Cluster(connect(config.redis.url.reveal(), decode_responses=True, health_check_interval=10),
                   c.worker_id or f"{socket.gethostname()}:{os.getpid()}", ttl_s=c.lease_ttl_s, metrics=metrics,
                   info={"http": f"{config.http.host}:{config.http.port}",
                         "admin": f"{config.admin.host}:{config.admin.port}"})


def http_hosts(config: Config) -> HostPolicy:
    """The names the http listener answers to: configured ones and Telegram's webhook host."""
    names = list(config.http.allowed_hosts)
    t = config.telegram
    if t.token is not None and t.mode == "webhook" and t.webhook_url:
        names.append(URL(t.webhook_url).host or "")
    return HostPolicy(config.http.host, names)


def tune_gc() -> None:
    """Fewer, cheaper garbage collections: a busy gateway allocates many short-lived objects per
    message, and the default gen-0 threshold (700) made collections a third of the router's time.
    Objects alive after startup are frozen out of collection altogether. (A middle generation
    collected every 50 young collections instead of 10 halves the collector's CPU with 10,000
    turns in flight, but its longer pauses put /stop's p99 at 1,000 streams from ~27 to ~41 ms.)"""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def tune_malloc() -> None:
    """Large buffers (request bodies, images) from their own mappings, so their memory goes back to
    the system once freed. glibc raises its mmap threshold after a large block is freed (up to
    32 MB), and later blocks that size then come from the heap and stay: ten 24 MB bodies at once
    left the daemon at 1.2 GB while idle. A fixed threshold keeps it from moving."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 20)


_M_MMAP_THRESHOLD = -3

# What SIGHUP can change in place; everything else is reported as needing a restart.
ORPHAN_SWEEP_S = 5.0  # how often tool processes that outlived their tool are looked for (two sweeps to act)
RELOADABLE = frozenset({"agent", "tools", "router", "quotas", "log", "daemon"})


class Daemon:
    def __init__(self, config: Config, *, config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path
        for secret in config.secrets():
            redactor.add(secret)
        self.notifier = Notifier.from_env()
        self.watchdog = Watchdog(self.notifier)
        self.metrics = Metrics()
        # Tool process groups are recorded in the data dir while they live, so none outlives the
        # daemon: its sentinel, or the next start, kills what a daemon that died left behind.
        self.ledger = GroupLedger(Path(config.store.data_dir) / "tool-groups")
        self.reaper = ProcessReaper(config.tools.tool_kill_grace_s, ledger=self.ledger)
        self.store = build_store(config, retention=True)
        self.cluster = build_cluster(config, self.metrics)
        self.adapters = build_adapters(config, self.cluster)
        self.access = AccessControl(self.store, access_policies(config))
        # MCP servers: stdio ones are tool process groups of the reaper's; restarted with backoff.
        self.mcp = McpHub.build(config.mcp.servers, self.reaper, max_output=config.tools.shell_max_output)
        # Background jobs: their groups are the reaper's like any tool's, so they die with the daemon too.
        self.jobs = JobRegistry(self.reaper, job_settings(config))
        Gauge("switchboard_background_jobs", "Background jobs running now", registry=self.metrics.registry
              ).set_function(lambda: len(self.jobs.running()))
        self.agent = build_agent(config, self.reaper, self.mcp, self.jobs)
        self._agents: list[Agent] = [self.agent]  # every agent built, closed at the end
        # Attachments are fetched in their turn, and a copy kept for replays, under the data dir.
        self.media = MediaStore(config.media, Path(config.store.data_dir) / "media", self.adapters,
                                quota=lambda tenant: self.live.value.quotas.limit(tenant, "media_mb"))
        # What a reload may change, in one holder the core reads (never assigned onto a part).
        self.live = Live(core_settings(config, self.agent))
        self.router = Router(self.live, RouterParts(
            store=self.store, outlets=self.adapters, cache=config.agent_cache, metrics=self.metrics,
            access=self.access, cluster=self.cluster, view=self.cluster.console if self.cluster else None,
            media=self.media, jobs=self.jobs,
            status_lines=(self.mcp.status_line,) if self.mcp.servers else ()))
        if self.mcp.servers:
            self.metrics.registry.register(McpCollector(self.mcp))
        live = self.live
        self.probe = ProviderProbe(lambda: probe_target(live.value.agent),
                                   interval_s=config.agent.probe_interval_s or 30.0)
        self._stack: contextlib.AsyncExitStack | None = None
        self._listeners: list[web.AppRunner] = []
        self._stop_reason: ToolReason = GATEWAY_RESTART
        self.stop_errors: list[str] = []

    async def readiness(self) -> dict[str, Health]:
        ok = await self.store.ping()
        checks = {"store": Health(ok, self.store.problem() or store_kind(self.config))}
        if self.cluster is not None:
            checks["cluster"] = self.cluster.health()
        for name, adapter in self.adapters.items():
            checks[name] = adapter.health()
        if self.mcp.servers:
            checks["mcp"] = self.mcp.health()
        if (provider := self.probe.health()) is not None:
            checks["provider"] = provider  # advisory: shown, never counted against readiness
        return checks

    async def start(self) -> None:
        """Bring everything up; what started is stopped again (in reverse) if a later step fails."""
        async with contextlib.AsyncExitStack() as stack:
            await self._start(stack)
            self._stack = stack.pop_all()
        tune_gc()
        tune_malloc()
        log.info("%s", started_line(self.config, self.agent.description, list(self.adapters),
                                   loop_name(asyncio.get_running_loop())))

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        """Each part of the daemon is one async generator: its start before the `yield`, its stop
        after (aiohttp's `cleanup_ctx`). They start in this order and stop in the reverse: intake
        first, the store last. A part whose start fails stops nothing of its own; the parts
        started before it stop."""
        parts: tuple[Callable[[], AsyncIterator[None]], ...] = (
            self._store_part, self._tools_part, self._mcp_part, self._probe_part, self._cluster_part,
            self._clients_part,
            self._listeners_part, self._router_part, self._intake_part, self._sites_part)
        for part in parts:
            await self._enter(stack, part)

    async def _enter(self, stack: contextlib.AsyncExitStack, part: Callable[[], AsyncIterator[None]]) -> None:
        steps = part()
        await anext(steps)

        async def stop() -> None:
            with contextlib.suppress(StopAsyncIteration):
                await anext(steps)

        stack.push_async_callback(stop)

    async def _stopping(self, what: str, step: Callable[[], Awaitable[object]]) -> None:
        """One stop step: a failure is logged and remembered, and the rest still run."""
        try:
            await step()
        except Exception:
            self.stop_errors.append(what)
            log.exception("stopping %s failed; carrying on with the rest", what)

    async def _store_part(self) -> AsyncIterator[None]:
        private_data_dir(Path(self.config.store.data_dir))
        for line in findings(self.config).warnings:
            log.warning("%s", line)
        self.ledger.sweep_stale()  # before any tool runs: what a daemon that died left behind
        self.notifier.status("opening the store")
        await self.store.open()
        yield
        await self._stopping("the store", self.store.close)

    async def _tools_part(self) -> AsyncIterator[None]:
        # Tool processes that outlived their tool (left its group; zombies nobody waits for) are
        # killed or reaped while the daemon runs, not only at its end.
        sweeping = asyncio.get_running_loop().create_task(self.reaper.sweep_orphans(ORPHAN_SWEEP_S))
        yield
        await cancel_and_wait([sweeping])
        await self._stopping("tool processes", self._drain_tools)
        await self._stopping("attachment downloads", self.media.close)
        await self._stopping("the agents", self._close_agents)
        await self._stopping("the tool sentinel", self.ledger.close)  # after the tools are drained

    async def _mcp_part(self) -> AsyncIterator[None]:
        self.mcp.start()  # in the background: a server that is slow or fails never holds the start up
        yield
        await self._stopping("MCP servers", self.mcp.close)  # once the turns ended; their groups are drained next

    async def _probe_part(self) -> AsyncIterator[None]:
        if self.config.agent.probe_interval_s > 0:
            self.probe.start()  # in the background: a slow provider never holds the start up
        yield
        await self._stopping("the provider probe", self.probe.close)

    async def _cluster_part(self) -> AsyncIterator[None]:
        if self.cluster is None:
            yield
            return
        await self.cluster.start(self.router.cluster_events())
        yield
        await self._stopping("cluster membership", self.cluster.stop)  # releases leases

    async def _clients_part(self) -> AsyncIterator[None]:
        started = []
        try:
            for name, adapter in self.adapters.items():
                self.notifier.status(f"starting {name}")
                await adapter.start(self.router)
                started.append((name, adapter))
        except BaseException:
            for name, adapter in reversed(started):
                await self._stopping(f"the {name} client", adapter.close)
            raise
        yield
        for name, adapter in reversed(started):
            await self._stopping(f"the {name} client", adapter.close)

    async def _listeners_part(self) -> AsyncIterator[None]:
        install_parser_filter()  # requests aiohttp cannot parse: a warning line, not an error traceback
        runners = self._runners()
        for runner in runners:
            await runner.setup()
        self._listeners = runners
        yield
        for runner in reversed(runners):  # after the turns they serve ended
            await self._stopping("an HTTP listener", runner.cleanup)

    async def _router_part(self) -> AsyncIterator[None]:
        await self.router.start()
        if self.cluster is not None:
            await self.cluster.adopt()  # the previous incarnation's sessions, then lapsed leases anywhere
        yield
        await self._stopping("the router", lambda: self.router.shutdown(
            self._stop_reason, drain_s=self.config.daemon.drain_timeout_s,
            grace_s=self.config.daemon.shutdown_grace_s))

    async def _intake_part(self) -> AsyncIterator[None]:
        yield
        for name, adapter in reversed(self.adapters.items()):
            await self._stopping(f"{name} intake", adapter.stop)

    async def _sites_part(self) -> AsyncIterator[None]:
        http, admin = self._listeners[0], self._listeners[1:]
        edge = self.config.http.edge()
        guard = ConnectionGuard(edge.max_connections_per_address, edge.uncapped_addresses)  # per listener
        await start_sites(http, self.config.http.host, self.config.http.port, guard)
        for runner in admin:
            await start_sites(runner, self.config.admin.host, self.config.admin.port,
                              ConnectionGuard(edge.max_connections_per_address, edge.uncapped_addresses))
        yield  # the listeners' runners stop them

    def _runners(self) -> list[web.AppRunner]:
        """The HTTP listener, and the admin one if it is on. Bodies are small (1 MiB) but where a
        route allows more (the HTTP API: `api_body_limit`)."""
        edge = self.config.http.edge()
        routes = [route for a in self.adapters.values() for route in a.routes()]
        app = build_app(self.readiness, [*routes, web.get("/favicon.ico", favicon)], hosts=http_hosts(self.config),
                        edge=edge, middlewares=[m for a in self.adapters.values() for m in a.middlewares()])
        # handler_cancellation: a client's disconnect cancels its request's handler at once, which
        # is how the HTTP API stops a run whose client has gone (streaming or not).
        runners = [edge_runner(app, edge, handler_cancellation=True)]
        admin = self.config.admin
        if admin.enabled:
            runners.append(edge_runner(
                build_admin_app(self.router, self.metrics, self.store, self.readiness,
                                token=admin.token.reveal() if admin.token else None,
                                extra_stats=self._cluster_stats,
                                hosts=HostPolicy(admin.host, admin.allowed_hosts), edge=edge), edge))
        return runners

    async def _drain_tools(self) -> None:
        self.jobs.kill_all(self._stop_reason)  # the router did, unless it never started
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.jobs.close(), self.config.tools.tool_kill_grace_s + 1)
        try:
            await asyncio.wait_for(self.reaper.drain(), self.config.tools.tool_kill_grace_s + 1)
        except TimeoutError:
            self.reaper.kill_all_now()

    async def _close_agents(self) -> None:
        for agent in self._agents:
            close = getattr(agent, "close", None)
            if close is not None:
                await close()

    def _cluster_stats(self) -> dict[str, object]:
        if self.cluster is None:
            return {}
        leases = self.cluster.leases
        return {"cluster": {"worker": self.cluster.worker_id, "leases_held": len(leases.held),
                            "lease_acquisitions": leases.acquisitions, "lease_losses": leases.losses,
                            "ingress": dict(self.cluster.ingress), "healthy": self.cluster.health().ok}}

    async def stop(self, reason: ToolReason = GATEWAY_RESTART) -> None:
        """Stop intake, hard_cancel running turns for `reason`, flush, close — in reverse start order."""
        log.info("shutting down: %s", reason.marker)
        self._stop_reason = reason
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def run(self) -> None:
        """Run until SIGINT/SIGTERM; a second signal skips the wait for running turns.

        Speaks sd_notify: READY=1 once every adapter is connected, WATCHDOG=1 while the loop is
        healthy, RELOADING=1 on SIGHUP, STOPPING=1 on the way out."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload()))
        await self.start()
        ready_wait = loop.create_task(self._announce_ready())
        await stop.wait()
        ready_wait.cancel()
        stop.clear()
        running = sum(1 for s in self.router.sessions() if s.running)
        self.notifier.stopping(f"stopping: interrupting {running} running turn(s)")
        stopping = asyncio.create_task(self.stop())
        second = asyncio.create_task(stop.wait())
        await asyncio.wait({stopping, second}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():
            log.warning("second signal: exiting now")
            self.router.cancel_all(GATEWAY_RESTART)
            self.jobs.kill_all(GATEWAY_RESTART)
            self.reaper.kill_all_now()  # no tool outlives us, drained or not
            await asyncio.wait({stopping}, timeout=1.0)
            stopping.cancel()
        second.cancel()
        await self.watchdog.stop()
        self.notifier.close()

    async def _announce_ready(self) -> None:
        while True:
            waiting = [(name, h.detail) for name, h in (await self.readiness()).items() if not h.ok]
            if not waiting:
                break
            self.notifier.status("waiting for " + ", ".join(f"{n}: {d}" for n, d in waiting))
            await asyncio.sleep(0.5)
        self.notifier.ready(f"ready: {', '.join(self.adapters) or 'no platforms'}")
        self.watchdog.start()

    async def reload(self) -> None:
        """SIGHUP: apply what can change in place; report what needs a restart; keep the old
        config if the new one is bad."""
        self.notifier.reloading("reloading the config")
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload rejected, keeping the running config: %s", exc)
            self.notifier.ready(f"ready (reload rejected: {exc})")
            return
        changed = [f.name for f in dataclasses.fields(new) if getattr(new, f.name) != getattr(self.config, f.name)]
        needs_restart = [name for name in changed if name not in RELOADABLE]
        for secret in new.secrets():
            redactor.add(secret)
        self._apply(new, changed)
        applied = [n for n in changed if n in RELOADABLE]
        self.config = dataclasses.replace(self.config, **{n: getattr(new, n) for n in applied})
        log.info("config reloaded: applied %s; needs a restart: %s", ", ".join(applied) or "nothing",
                 ", ".join(needs_restart) or "nothing")
        self.notifier.ready("ready (reloaded" + (f"; restart needed for {', '.join(needs_restart)})"
                                                if needs_restart else ")"))

    def _apply(self, new: Config, changed: list[str]) -> None:
        """Put a reloaded config in place: the core reads it from the live holder."""
        if "agent" in changed or "tools" in changed:
            # running turns finish on the agent they started with
            self.agent = build_agent(new, self.reaper, self.mcp, self.jobs)
            self._agents.append(self.agent)
            self.jobs.settings = job_settings(new)
            self.reaper.grace_s = new.tools.tool_kill_grace_s
        self.live.replace(core_settings(new, self.agent))
        if "log" in changed:
            logging.getLogger().setLevel(new.log.level.upper())
        self.access.set_policies(access_policies(new))  # access lists apply in place, always
