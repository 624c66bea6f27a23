"""Wires config, store, agent, router, adapters and the HTTP listener; owns start and stop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import socket
from pathlib import Path

from aiohttp import web

from agent_cache import keys
from gateway.agents import Agent
from gateway.agents.echo import EchoAgent
from gateway.agents.openai import OpenAIAgent, OpenAISettings
from gateway.agents.processes import ProcessReaper
from gateway.agents.tools import ProcessToolSettings, builtin_registry
from gateway.cluster.coordinator import Cluster
from gateway.core.access import AccessControl, AccessPolicy
from gateway.core.cancellation import GATEWAY_RESTART, ToolReason
from gateway.core.logs import redactor
from gateway.core.router import Router, RouterSettings
from gateway.ops.admin import build_admin_app
from gateway.ops.config import Config, ConfigError, load_config
from gateway.ops.http import build_app, serve
from gateway.ops.sdnotify import Notifier, Watchdog
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


def _router_settings(config: Config) -> RouterSettings:
    r, c = config.router, config.agent_cache
    return RouterSettings(busy=r.busy, per_user_in_groups=r.per_user_in_groups, max_message_chars=r.max_message_chars,
                          turn_timeout_s=r.turn_timeout_s, max_agents=c.max_agents, idle_ttl_s=c.idle_ttl_s,
                          when_full=c.when_full, messages_per_minute=r.messages_per_minute)


def _access_policies(config: Config) -> dict[str, AccessPolicy]:
    return {"telegram": AccessPolicy(config.telegram.access, frozenset(a.lower() for a in config.telegram.allowlist)),
            "discord": AccessPolicy(config.discord.access, frozenset(config.discord.allowlist))}


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


# What SIGHUP can change in place; everything else is reported as needing a restart.
RELOADABLE = frozenset({"agent", "tools", "router", "log", "daemon"})


class Daemon:
    def __init__(self, config: Config, *, config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.notifier = Notifier.from_env()
        self.watchdog = Watchdog(self.notifier)
        self._old_agents: list[Agent] = []
        for secret in config.secrets():
            redactor.add(secret)
        self.reaper = ProcessReaper(config.tools.tool_kill_grace_s)
        self.store: Store = build_store(config)
        self.cluster: Cluster | None = None
        self.agent = build_agent(config, self.reaper)
        self.router = Router(_router_settings(config), self.store, self.agent)
        self.adapters = build_adapters(config)
        self.router.access = AccessControl(self.store, _access_policies(config))
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
        self.notifier.status("opening the store")
        await self.store.open()
        if self.config.redis.url is not None:
            await self._start_cluster(self.config.redis.url.reveal())
        app = build_app(self.readiness)
        for adapter in self.adapters.values():
            adapter.routes(app)
        for name, adapter in self.adapters.items():
            self.notifier.status(f"starting {name}")
            await adapter.start(self.router)
        await self.router.start(self.adapters, resume_max_age_s=self.config.daemon.resume_max_age_s)
        self._runner = await serve(app, self.config.http.host, self.config.http.port)
        admin = self.config.admin
        if admin.enabled:
            admin_app = build_admin_app(self.router, self.readiness,
                                        token=admin.token.reveal() if admin.token else None,
                                        extra_stats=self._cluster_stats)
            self._admin_runner = await serve(admin_app, admin.host, admin.port)
        tune_gc()
        log.info("switchboard listening on http://%s:%d (agent %s, platforms: %s)",
                 self.config.http.host, self.config.http.port, self.agent.description,
                 ", ".join(self.adapters) or "none")

    def _cluster_stats(self) -> dict[str, object]:
        if self.cluster is None:
            return {}
        leases = self.cluster.leases
        return {"cluster": {"worker": self.cluster.worker_id, "leases_held": len(leases.held),
                            "lease_acquisitions": leases.acquisitions, "lease_losses": leases.losses,
                            "ingress": dict(self.cluster.ingress), "healthy": self.cluster.healthy()[0]}}

    async def _start_cluster(self, url: str) -> None:
        from gateway.store.redis import connect

        c = self.config.cluster
        worker_id = c.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.cluster = Cluster(
            connect(url, decode_responses=True, health_check_interval=10), worker_id,
            ttl_s=c.lease_ttl_s, router=self.router, adapters=self.adapters,
            info={"http": f"{self.config.http.host}:{self.config.http.port}",
                  "admin": f"{self.config.admin.host}:{self.config.admin.port}"},
            resume_max_age_s=self.config.daemon.resume_max_age_s)
        self.router.cluster = self.cluster
        self.router.worker_id = worker_id
        await self.cluster.start()
        from gateway.cluster.ingress import IngressLeader
        from platforms.discord_bot import DiscordAdapter
        from platforms.telegram_bot import TelegramAdapter

        telegram = self.adapters.get("telegram")
        if telegram is not None and self.config.telegram.mode == "polling" and self.config.telegram.token:
            assert isinstance(telegram, TelegramAdapter)
            name = f"telegram:{keys.token_id(self.config.telegram.token.reveal())}"
            telegram.leader = IngressLeader(self.cluster, name)
        discord = self.adapters.get("discord")
        if discord is not None and self.config.discord.token:
            assert isinstance(discord, DiscordAdapter)
            discord.leader = IngressLeader(self.cluster, f"discord:{keys.token_id(self.config.discord.token.reveal())}")

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
        for agent in (*self._old_agents, self.agent):
            close = getattr(agent, "close", None)
            if close is not None:
                await close()
        for runner in (self._runner, self._admin_runner):
            if runner is not None:
                await runner.cleanup()
        await self.store.close()
        self._stopped.set()

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
            self.reaper.kill_all_now()  # no tool outlives us, drained or not
            await asyncio.wait({stopping}, timeout=1.0)
            stopping.cancel()
        second.cancel()
        await self.watchdog.stop()
        self.notifier.close()

    async def _announce_ready(self) -> None:
        while True:
            waiting = [(name, detail) for name, (ok, detail) in (await self.readiness()).items() if not ok]
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
        if "agent" in changed or "tools" in changed:
            self._old_agents.append(self.agent)  # running turns finish on the agent they started with
            self.agent = self.router.agent = build_agent(new, self.reaper)
        if "router" in changed:
            self.router.settings = _router_settings(new)
            self.router.rate_limit.per_minute = new.router.messages_per_minute
        if "log" in changed:
            logging.getLogger().setLevel(new.log.level.upper())
        if self.router.access is not None:
            self.router.access.policies = _access_policies(new)
        applied = [n for n in changed if n in RELOADABLE]
        self.config = dataclasses.replace(self.config, **{n: getattr(new, n) for n in applied})
        log.info("config reloaded: applied %s; needs a restart: %s", ", ".join(applied) or "nothing",
                 ", ".join(needs_restart) or "nothing")
        self.notifier.ready("ready (reloaded" + (f"; restart needed for {', '.join(needs_restart)})"
                                                if needs_restart else ")"))
