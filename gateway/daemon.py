"""Wires config, store, agent, router, adapters and the HTTP listener; owns start and stop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from pathlib import Path

from aiohttp import web

from gateway.access import AccessControl, AccessPolicy
from gateway.admin import build_admin_app
from gateway.agents import Agent
from gateway.agents.echo import EchoAgent
from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.tools import ProcessToolSettings, builtin_registry
from gateway.cancellation import GATEWAY_RESTART, ToolReason
from gateway.cluster import Cluster
from gateway.config import Config
from gateway.logs import redactor
from gateway.processes import ProcessReaper
from gateway.router import Router, RouterSettings
from gateway.server import build_app, serve
from gateway.store import Store
from gateway.store.sqlite import SqliteStore
from platforms.base import Adapter

log = logging.getLogger(__name__)


def build_agent(config: Config, reaper: ProcessReaper) -> Agent:
    t = config.tools
    tools = builtin_registry(
        ProcessToolSettings(reaper=reaper, max_output=t.shell_max_output, default_timeout_s=t.shell_timeout_s,
                            allow_prefixes=tuple(t.shell_allow_prefixes), cwd=t.shell_cwd),
        shell=t.shell)
    a = config.agent
    if a.kind == "openai":
        return OpenAIAgent(OpenAISettings(
            base_url=a.base_url, model=a.model, api_key=a.api_key.reveal() if a.api_key else None,
            system_prompt=a.system_prompt, max_tool_rounds=a.max_tool_rounds, retries=a.retries,
            read_timeout_s=a.read_timeout_s), tools)
    return EchoAgent(tools, delay_s=a.echo_delay_s)


def build_adapters(config: Config) -> dict[str, Adapter]:
    from platforms.api import ApiAdapter
    from platforms.webchat import WebchatAdapter

    adapters: dict[str, Adapter] = {}
    if config.telegram.token is not None:
        from platforms.telegram_bot import TelegramAdapter
        adapters["telegram"] = TelegramAdapter(config.telegram)
    if config.discord.token is not None:
        from platforms.discord_bot import DiscordAdapter
        adapters["discord"] = DiscordAdapter(config.discord)
    if config.webchat_enabled:
        adapters["webchat"] = WebchatAdapter()
    if config.api.enabled:
        adapters["api"] = ApiAdapter(keys=[k.reveal() for k in config.api.keys],
                                     model_name=config.api.model_name)
    return adapters


def build_store(config: Config) -> Store:
    """SQLite in the data dir, or the shared Redis store in cluster mode."""
    if config.redis.url is not None:
        from gateway.store.redis import RedisStore

        return RedisStore(config.redis.url.reveal())
    return SqliteStore(Path(config.store.data_dir) / "switchboard.db")


def tune_gc() -> None:
    """Fewer, cheaper garbage collections: a busy gateway allocates many short-lived objects per
    message, and the default gen-0 threshold (700) made collections a third of the router's time.
    Objects alive after startup are frozen out of collection altogether."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        for secret in config.secrets():
            redactor.add(secret)
        self.reaper = ProcessReaper(config.tools.tool_kill_grace_s)
        self.store: Store = build_store(config)
        self.cluster: Cluster | None = None
        self.agent = build_agent(config, self.reaper)
        r, c = config.router, config.agent_cache
        self.router = Router(RouterSettings(
            busy=r.busy, per_user_in_groups=r.per_user_in_groups, max_message_chars=r.max_message_chars,
            turn_timeout_s=r.turn_timeout_s, max_agents=c.max_agents, idle_ttl_s=c.idle_ttl_s,
            when_full=c.when_full, messages_per_minute=r.messages_per_minute), self.store, self.agent)
        self.adapters = build_adapters(config)
        self.router.access = AccessControl(self.store, {
            "telegram": AccessPolicy(config.telegram.access, frozenset(a.lower() for a in config.telegram.allowlist)),
            "discord": AccessPolicy(config.discord.access, frozenset(config.discord.allowlist)),
        })
        self._runner: web.AppRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self._stopped = asyncio.Event()

    async def readiness(self) -> dict[str, tuple[bool, str]]:
        checks = {"store": (await self.store.ping(), "redis" if self.config.redis.url else "sqlite")}
        if self.cluster is not None:
            checks["cluster"] = self.cluster.healthy()
        for name, adapter in self.adapters.items():
            checks[name] = adapter.healthy()
        return checks

    async def start(self) -> None:
        await self.store.open()
        if self.config.redis.url is not None:
            await self._start_cluster(self.config.redis.url.reveal())
        app = build_app(self.readiness)
        for adapter in self.adapters.values():
            adapter.routes(app)
        for adapter in self.adapters.values():
            await adapter.start(self.router)
        await self.router.start(self.adapters, resume_max_age_s=self.config.daemon.resume_max_age_s)
        self._runner = await serve(app, self.config.http.host, self.config.http.port)
        admin = self.config.admin
        if admin.enabled:
            admin_app = build_admin_app(self.router, self.readiness,
                                        token=admin.token.reveal() if admin.token else None)
            self._admin_runner = await serve(admin_app, admin.host, admin.port)
        tune_gc()
        log.info("switchboard listening on http://%s:%d (agent %s, platforms: %s)",
                 self.config.http.host, self.config.http.port, self.agent.description,
                 ", ".join(self.adapters) or "none")

    async def _start_cluster(self, url: str) -> None:
        from redis.asyncio import Redis

        c = self.config.cluster
        worker_id = c.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.cluster = Cluster(
            Redis.from_url(url, decode_responses=True, health_check_interval=10), worker_id,
            ttl_s=c.lease_ttl_s, router=self.router, adapters=self.adapters,
            info={"http": f"{self.config.http.host}:{self.config.http.port}",
                  "admin": f"{self.config.admin.host}:{self.config.admin.port}"},
            resume_max_age_s=self.config.daemon.resume_max_age_s)
        self.router.cluster = self.cluster
        self.router.worker_id = worker_id
        await self.cluster.start()

    async def stop(self, reason: ToolReason = GATEWAY_RESTART) -> None:
        """Stop intake, hard_cancel running turns for `reason`, flush, close."""
        log.info("shutting down: %s", reason.marker)
        for adapter in self.adapters.values():
            with contextlib.suppress(Exception):
                await adapter.stop()
        d = self.config.daemon
        await self.router.shutdown(reason, drain_s=d.drain_timeout_s, grace_s=d.shutdown_grace_s)
        if self.cluster is not None:
            await self.cluster.stop()  # releases leases: the next worker to need a session takes it
        try:
            await asyncio.wait_for(self.reaper.drain(), self.config.tools.tool_kill_grace_s + 1)
        except TimeoutError:
            self.reaper.kill_all_now()
        close = getattr(self.agent, "close", None)
        if close is not None:
            await close()
        for runner in (self._runner, self._admin_runner):
            if runner is not None:
                await runner.cleanup()
        await self.store.close()
        self._stopped.set()

    async def run(self) -> None:
        """Run until SIGINT/SIGTERM; a second signal skips the wait for running turns."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        await stop.wait()
        stop.clear()
        stopping = asyncio.create_task(self.stop())
        second = asyncio.create_task(stop.wait())
        await asyncio.wait({stopping, second}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():
            log.warning("second signal: exiting now")
            self.reaper.kill_all_now()
            stopping.cancel()
        second.cancel()
