"""The session router: composes the core's owners and is the `Gateway` platforms submit to.

    intake (gates → ownership → de-duplication) ──▶ commands (outside the lane)
                                                └─▶ turn queue (admission) ──▶ lanes ──▶ turn runner

Each owner has one job and is wired here, in the constructor; nothing is assigned onto a part
after it is built, and what a reload changes is read from the `Live` settings holder. Every
inbound message ends processed, queued (with an ack) or rejected with a reason. A turn's `Run`
exists from the moment its message is admitted, so `/stop` finds it whether it is queued,
starting or streaming; commands never wait on a lane or on anything a turn holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent_cache import AgentCache, CacheSettings
from gateway.core.access import AccessControl
from gateway.core.background import BackgroundJobs
from gateway.core.cancellation import EVICTED, Run, ToolReason
from gateway.core.cluster import ClusterEvents, ClusterView, Ownership
from gateway.core.cluster_events import SessionEvents
from gateway.core.intake.answers import Answers
from gateway.core.intake.dedupe import RecentMessages
from gateway.core.intake.gates import MEDIA_ONLY as MEDIA_ONLY
from gateway.core.intake.gates import Gates, Limits
from gateway.core.intake.intake import Intake
from gateway.core.intake.ownership import ClusterNode, Owners, SingleNode
from gateway.core.live import Live
from gateway.core.messages import InboundMessage
from gateway.core.metrics import Metrics
from gateway.core.ports import Agent, MediaLoader, Outlet, Outlets, SessionStatus, Store, Submitted
from gateway.core.quotas import TenantLoad
from gateway.core.ratelimit import TenantRateLimit, UserRateLimit
from gateway.core.recovery import Recovery
from gateway.core.sessions.automatic import AutomaticMessages
from gateway.core.sessions.control import BusyPolicies, SessionCommands, StatusLine
from gateway.core.sessions.lanes import Lanes, Scope
from gateway.core.sessions.origins import Origins
from gateway.core.sessions.queue import TurnQueue
from gateway.core.settings import BUSY_POLICIES as BUSY_POLICIES
from gateway.core.settings import BusyPolicy as BusyPolicy
from gateway.core.settings import CoreSettings
from gateway.core.settings import RouterSettings as RouterSettings
from gateway.core.transcript import ChatMessage
from gateway.core.turns import Interruptions, LiveConversation, TurnRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterParts:
    """What the router is built from besides its settings (the daemon's collaborators)."""

    store: Store
    outlets: Outlets
    cache: CacheSettings = field(default_factory=CacheSettings)
    metrics: Metrics = field(default_factory=Metrics)
    access: AccessControl | None = None
    cluster: Ownership | None = None  # None: one process owns every session
    view: ClusterView | None = None  # cluster mode: the other workers, as operators see them
    media: MediaLoader | None = None
    jobs: BackgroundJobs | None = None  # shell commands moved to the background (None: off)
    status_lines: Sequence[StatusLine] = ()  # more for /status, e.g. the MCP servers' state


class Router:
    """The core's `Gateway`: platforms submit here; the router composes lanes, intake and recovery."""

    def __init__(self, settings: Live[CoreSettings], parts: RouterParts) -> None:
        self._settings = settings
        self._parts = p = parts
        self._closing = asyncio.Event()  # set once at shutdown: intake refuses, lanes start nothing new
        self.metrics = p.metrics
        self.interruptions = Interruptions()
        # Grouped by tenant: a running turn is evicted only for another session of its own tenant.
        quotas = settings.view(lambda s: s.quotas)
        self.cache: AgentCache[LiveConversation] = AgentCache(
            max_agents=p.cache.max_agents, idle_ttl_s=p.cache.idle_ttl_s, when_full=p.cache.when_full,
            on_evict=self._on_evict, max_per_group=lambda tenant: quotas.value.limit(tenant, "live_sessions"))
        recent, answers, origins = RecentMessages(), Answers(), Origins()
        self._owners: Owners = SingleNode() if p.cluster is None else ClusterNode(p.cluster, answers, recent)
        self._turns = TurnRunner(store=p.store, metrics=p.metrics, cache=self.cache, interruptions=self.interruptions,
                                 settings=settings, check_lease=self._owners.check_lease, media=p.media)
        self._lanes = Lanes(self._turns.execute, self._owners.unwatch, self._closing)
        busy = BusyPolicies(settings)
        self._limits = Limits(UserRateLimit(settings.view(lambda s: s.router.messages_per_minute)),
                              TenantRateLimit(lambda tenant: quotas.value.limit(tenant, "messages_per_minute")),
                              TenantLoad())
        self._commands = SessionCommands(lanes=self._lanes, store=p.store, owners=self._owners, cache=self.cache,
                                         busy=busy, settings=settings, jobs=p.jobs,
                                         status_lines=p.status_lines)
        queue = TurnQueue(lanes=self._lanes, owners=self._owners, store=p.store, busy=busy, origins=origins,
                          answers=answers, jobs=p.jobs, begin=self._turns.begin)
        self._automatic = AutomaticMessages(origins=origins, outlets=p.outlets, queue=queue, owners=self._owners,
                                            store=p.store, closing=self._closing)
        self._intake = Intake(gates=Gates(settings, p.access, self._limits, self._closing), owners=self._owners,
                              recent=recent, answers=answers, commands=self._commands, queue=queue,
                              metrics=p.metrics, settings=settings)
        self._recovery = Recovery(store=p.store, outlets=p.outlets, owners=self._owners, queue=queue, recent=recent,
                                  settings=settings)
        self._events = SessionEvents(lanes=self._lanes, intake=self._intake, recovery=self._recovery,
                                     cache=self.cache, outlets=p.outlets, jobs=p.jobs)
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics.watch_cache(lambda: (len(self.cache), self.cache.hits, self.cache.misses, self.cache.evictions))

    @property
    def agent(self) -> Agent:
        """The agent new turns use."""
        return self._settings.value.agent

    @property
    def worker_id(self) -> str | None:
        return self._owners.worker_id

    # --- the Gateway port -----------------------------------------------------------------

    async def submit(self, msg: InboundMessage, outlet: Outlet, *, key: str | None = None) -> Submitted:
        """Route one inbound message. Never raises for bad input: the user gets a reason."""
        return await self._intake.submit(msg, outlet, key=key)

    async def submit_stateless(self, msg: InboundMessage, outlet: Outlet, history: Sequence[ChatMessage]) -> Submitted:
        """A request that brings its own history (the HTTP API without a session); nothing is stored."""
        return await self._intake.submit_stateless(msg, outlet, history)

    async def history(self, key: str) -> list[ChatMessage]:
        return (await self._parts.store.conversation(key))[1]

    def count_outbound(self, platform: str, kind: str) -> None:
        if kind == "429":
            self.metrics.platform_429s.labels(platform).inc()
        else:
            self.metrics.messages_out.labels(platform, kind).inc()

    def status(self, key: str) -> SessionStatus:
        return self._lanes.status(key, self.agent.description)

    def sessions(self) -> list[SessionStatus]:
        return [self.status(key) for key in self._lanes.session_keys()]

    def max_message_chars(self) -> int:
        return self._settings.value.router.max_message_chars

    # --- operators and collaborators ----------------------------------------------------

    def hard_cancel(self, session: str, tool_reason: ToolReason) -> Run | None:
        """Stop the turn running (or about to run) in `session` only; returns its run, or None.
        Returns at once; `await run.wait()` to know when it has ended."""
        runs = self._lanes.cancel(session, tool_reason, Scope.NEXT)
        return runs[0] if runs else None

    async def everywhere(self) -> list[tuple[str | None, SessionStatus]]:
        """Every session with work, on this worker and — in cluster mode — on every other live
        one, each with the worker it runs on (what an operator's console shows)."""
        here = [(self.worker_id, status) for status in self.sessions()]
        view = self._parts.view
        if view is None:
            return here
        return here + [(worker, s) for worker, statuses in await view.sessions_elsewhere() for s in statuses]

    async def stop_anywhere(self, session: str, reason: ToolReason) -> tuple[str | None, bool]:
        """An operator's stop, wherever the session runs: (the worker it ran on, stopped)."""
        if self.hard_cancel(session, reason) is not None:
            return self.worker_id, True
        view = self._parts.view
        return await view.stop_elsewhere(session, reason) if view is not None else (None, False)

    async def owners(self, sessions: list[str]) -> dict[str, str | None]:
        """Who holds each session (this process alone, single node)."""
        view = self._parts.view
        return await view.owners(sessions) if view is not None else dict.fromkeys(sessions)

    def cancel_all(self, reason: ToolReason) -> None:
        """Stop every running turn now (a forced exit); queued ones stay for the next start."""
        self._lanes.cancel_running(reason)

    async def deliver_automatic(self, key: str, message_id: str, text: str) -> bool:
        """A background job ended: its notice is queued into `key` (False: no chat to tell)."""
        return await self._automatic.deliver(key, message_id, text)

    def status_text(self, key: str) -> str:
        return self._commands.status_text(key)

    def kill_job(self, key: str, job_id: str) -> str | None:
        return self._commands.kill_job(key, job_id)

    def lease_lost(self, session: str) -> None:
        self._events.lease_lost(session)

    def cluster_events(self) -> ClusterEvents:
        """What the cluster coordinator reports to (given to it when it starts)."""
        return self._events

    def _on_evict(self, key: str, _agent: LiveConversation, running: bool) -> None:
        if running:
            self.hard_cancel(key, EVICTED)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Recover what a previous process left unfinished, then start the sweepers."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._sweep()), loop.create_task(self._turns.watch_timeouts())]
        if self._parts.jobs is not None:
            self._tasks.append(loop.create_task(self._automatic.relay(self._parts.jobs)))
        await self._recovery.recover_all()

    async def shutdown(self, reason: ToolReason, *, drain_s: float = 0.0, grace_s: float = 10.0) -> None:
        """Stop intake, let running turns finish for up to `drain_s`, cancel the rest for `reason`,
        and wait (up to `grace_s`) for their outcomes to be recorded. Queued turns stay accepted in
        the store and are replayed on the next start."""
        self._closing.set()
        for task in self._tasks:
            task.cancel()
        running = self._lanes.workers(running_only=True)
        if drain_s > 0 and running:
            log.info("draining %d running turn(s) for up to %.0f s", len(running), drain_s)
            await asyncio.wait(running, timeout=drain_s)
        if self._parts.jobs is not None:  # no job outlives the daemon; each is told at the next start
            for key, message_id, text in self._parts.jobs.kill_all(reason):
                await self._automatic.leave(key, message_id, text)
        storing = [f for turn in self._lanes.close(reason) if (f := await self._turns.leave_queued(turn, reason))]
        workers: list[asyncio.Future[None]] = [*self._lanes.workers(), *storing]
        if workers:
            _done, late = await asyncio.wait(workers, timeout=grace_s)
            for late_one in late:
                late_one.cancel()

    async def _sweep(self) -> None:
        every = max(1.0, min(30.0, self.cache.idle_ttl_s / 2))
        while True:
            await asyncio.sleep(every)
            self._limits.user_rate.prune()
            self._limits.tenant_rate.prune()
            if expired := self.cache.expire_idle():
                log.debug("released %d idle agents", expired)
