"""The session router: one lane per session, one turn at a time, commands outside the lane.

Every inbound message ends processed, queued (with an ack) or rejected with a reason. A turn's
`Run` exists from the moment its message is accepted, so `/stop` finds it whether it is queued,
starting or streaming; commands never wait on the lane or on anything a turn holds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from redis.exceptions import RedisError

from agent_cache import AgentCache
from gateway.agents import Agent
from gateway.core.access import AccessControl
from gateway.core.cancellation import (
    EVICTED,
    LEASE_LOST,
    NEW_MESSAGE,
    SESSION_RESET,
    STOPPED_BY_USER,
    Run,
    ToolReason,
)
from gateway.core.commands import HELP, Command, parse_command
from gateway.core.messages import InboundMessage, session_key
from gateway.core.metrics import Metrics
from gateway.core.ratelimit import UserRateLimit
from gateway.core.transcript import ChatMessage
from gateway.core.turns import SessionAgent, Turn, TurnRunner
from gateway.store import Store, StoreError

if TYPE_CHECKING:
    from gateway.cluster.coordinator import Cluster
    from platforms.base import Adapter, NoticeKind

log = logging.getLogger(__name__)

BusyPolicy = Literal["interrupt", "queue"]
STOPPED = "Stopped."
MAX_HOPS = 3  # forwards between cluster workers before a message is refused
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")  # binary, not text


@dataclass(frozen=True, slots=True)
class RouterSettings:
    busy: BusyPolicy = "interrupt"
    per_user_in_groups: bool = False
    max_message_chars: int = 16_000
    turn_timeout_s: float = 600.0
    max_agents: int = 256
    idle_ttl_s: float = 3600.0
    when_full: Literal["evict_oldest", "reject"] = "evict_oldest"
    messages_per_minute: int = 0  # per user; 0 = no limit


class Outcome(StrEnum):
    ACCEPTED = "accepted"
    QUEUED = "queued"
    DUPLICATE = "duplicate"
    REJECTED = "rejected"
    COMMAND = "command"
    FORWARDED = "forwarded"  # cluster mode: handed to the worker that owns the session


@dataclass(frozen=True, slots=True)
class Submitted:
    outcome: Outcome
    detail: str = ""
    run: Run | None = None


@dataclass(slots=True)
class Lane:
    key: str
    pending: deque[Turn] = field(default_factory=deque)
    current: Turn | None = None
    worker: asyncio.Task[None] | None = None


@dataclass(frozen=True, slots=True)
class SessionStatus:
    key: str
    running: bool
    since: float | None
    queued: int
    agent: str


class Router:
    def __init__(self, settings: RouterSettings, store: Store, agent: Agent, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.store = store
        self.agent = agent
        self.metrics = metrics or Metrics()
        self.cache: AgentCache[SessionAgent] = AgentCache(
            max_agents=settings.max_agents, idle_ttl_s=settings.idle_ttl_s,
            when_full=settings.when_full, on_evict=self._on_evict)
        self._lanes: dict[str, Lane] = {}
        self._recent: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._closing = False
        self._sweeper: asyncio.Task[None] | None = None
        self._timeouts: asyncio.Task[None] | None = None
        self._turns = TurnRunner(self)
        self.metrics.watch_cache(lambda: (len(self.cache), self.cache.hits, self.cache.misses, self.cache.evictions))
        # The last interruption per session (kind, reason, when), for /status and the console.
        self.interruptions: OrderedDict[str, tuple[str, str, float]] = OrderedDict()
        self.bot_usernames: dict[str, str] = {}  # platform -> bot username, for /cmd@Bot
        self.worker_id: str | None = None  # set in cluster mode
        self.cluster: Cluster | None = None
        self.access: AccessControl | None = None
        self.rate_limit = UserRateLimit(settings.messages_per_minute)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, adapters: dict[str, Adapter], *, resume_max_age_s: float = 600.0) -> None:
        """Recover what a previous process left unfinished, then start the idle sweeper."""
        from gateway.core.recovery import recover

        loop = asyncio.get_running_loop()
        self._sweeper = loop.create_task(self._sweep())
        self._timeouts = loop.create_task(self._turns.watch_timeouts())
        await recover(self, adapters, resume_max_age_s=resume_max_age_s)

    async def shutdown(self, reason: ToolReason, *, drain_s: float = 0.0, grace_s: float = 10.0) -> None:
        """Stop intake, let running turns finish for up to `drain_s`, hard_cancel the rest for
        `reason`, and wait (up to `grace_s`) for their outcomes to be recorded.

        Queued turns stay accepted in the store and are replayed on the next start.
        """
        self._closing = True
        for task in (self._sweeper, self._timeouts):
            if task is not None:
                task.cancel()
        running = [lane.worker for lane in self._lanes.values() if lane.worker and lane.current]
        if drain_s > 0 and running:
            log.info("draining %d running turn(s) for up to %.0f s", len(running), drain_s)
            await asyncio.wait(running, timeout=drain_s)
        for lane in list(self._lanes.values()):
            if lane.current is not None:
                lane.current.run.cancel(reason)
            for turn in lane.pending:  # stays accepted in the store; replayed on the next start
                turn.run.end()
        workers = [lane.worker for lane in self._lanes.values() if lane.worker]
        if workers:
            _done, late = await asyncio.wait(workers, timeout=grace_s)
            for task in late:
                task.cancel()

    # --- intake ---------------------------------------------------------------------------

    async def submit(self, msg: InboundMessage, adapter: Adapter, *,
                     ephemeral: Sequence[ChatMessage] | None = None, key: str | None = None,
                     hops: int = 0) -> Submitted:
        """Route one inbound message. Never raises for bad input: the user gets a reason.

        `hops` counts forwards between cluster workers (a forwarded message arrives with 1)."""
        result = await self._submit(msg, adapter, ephemeral, key, hops)
        self.metrics.messages_in.labels(msg.platform, result.outcome.value).inc()
        return result

    async def _submit(self, msg: InboundMessage, adapter: Adapter, ephemeral: Sequence[ChatMessage] | None,
                      key: str | None, hops: int) -> Submitted:
        key = key or session_key(msg, per_user_in_groups=self.settings.per_user_in_groups)
        if (problem := self._validate(msg.text)) is not None:
            return await self._reject(adapter, msg, key, problem)
        cmd = parse_command(msg.text, self.bot_usernames.get(msg.platform))
        if self._closing and cmd is None:  # commands still work while turns drain: /stop must stop
            return await self._reject(adapter, msg, key, "The gateway is restarting; please send that again in a "
                                      "moment.", kind="restart")
        if self.access is not None:
            allowed, notice = await self.access.check(msg)
            if not allowed:
                return await self._reject(adapter, msg, key, notice, kind="info",
                                          detail="not allowed (notice throttled)")
        if cmd is None and ephemeral is None:  # commands always get through: /stop must work
            allowed, notice = self.rate_limit.check(msg.platform, msg.user_id)
            if not allowed:
                return await self._reject(adapter, msg, key, notice, detail="rate limited (notice already sent)")
        if self.cluster is not None and ephemeral is None:
            owner = await self._owner(key)
            if owner is None:
                return await self._reject(adapter, msg, key, "I can't take messages right now (shared storage "
                                          "is unavailable). Please try again shortly.")
            if owner != self.worker_id:
                if self._seen(msg, hops):
                    return Submitted(Outcome.DUPLICATE)
                return await self._forward(owner, cmd, msg, key, adapter, hops)
        if cmd is not None:
            if self._seen(msg, hops):
                return Submitted(Outcome.DUPLICATE)
            return await self._command(cmd, key, msg, adapter)
        if ephemeral is None and self._seen(msg, hops):
            return Submitted(Outcome.DUPLICATE)

        turn = Turn(msg, key, adapter, ephemeral)
        lane = self._lanes.get(key)
        busy = lane is not None and (lane.current is not None or bool(lane.pending))
        if busy and self.settings.busy == "interrupt":
            self._cancel_lane(key, NEW_MESSAGE)
        ahead = self._enqueue(turn)  # registered before any await: a /stop from now on finds it
        if ephemeral is not None:
            turn.accepted.set_result(True)
            return Submitted(Outcome.ACCEPTED, run=turn.run)
        try:
            turn.inbound_id = await self.store.accept_inbound(key, msg)
        except StoreError as exc:
            turn.accepted.set_result(False)
            self._forget(msg)
            log.error("could not store an inbound message: %s", exc, extra={"session": key})
            return await self._reject(adapter, msg, key, "Sorry, I could not save your message (storage error). "
                                      "Please send it again.")
        if turn.inbound_id is None:
            turn.accepted.set_result(False)
            return Submitted(Outcome.DUPLICATE)
        turn.accepted.set_result(True)
        if busy and self.settings.busy == "queue" and ahead:
            await adapter.notify(msg.chat, f"Queued — {ahead} ahead of this message. /stop clears the queue.",
                                 reply_to=msg.message_id, kind="queued")
            return Submitted(Outcome.QUEUED, f"{ahead} ahead", turn.run)
        return Submitted(Outcome.ACCEPTED, run=turn.run)

    async def _reject(self, adapter: Adapter, msg: InboundMessage, key: str, text: str | None, *,
                      kind: NoticeKind = "error", detail: str = "") -> Submitted:
        """Tell the user why (unless `text` is None: already told recently) and say so in the log."""
        log.info("rejected a message: %s", text or detail, extra={"session": key})
        if text:
            await adapter.notify(msg.chat, text, reply_to=msg.message_id, kind=kind)
        return Submitted(Outcome.REJECTED, text or detail)

    def _validate(self, text: str) -> str | None:
        if not text.strip():
            return "That message was empty — send some text."
        if len(text) > self.settings.max_message_chars:
            return (f"That message is too long ({len(text)} characters; the limit is "
                    f"{self.settings.max_message_chars}). Please shorten it.")
        if _CONTROL_CHARS.search(text):
            return "That message contains binary data; I can only read text."
        return None

    async def resume(self, msg: InboundMessage, adapter: Adapter, key: str, *,
                     inbound_id: int | None = None) -> Run | None:
        """Queue a turn after a restart without the intake checks a user message gets: a message
        already stored (`inbound_id`), or an automatic one whose message id makes it happen once."""
        turn = Turn(msg, key, adapter)
        self._enqueue(turn)
        try:
            turn.inbound_id = inbound_id or await self.store.accept_inbound(key, msg)
        except StoreError:
            turn.inbound_id = None
        turn.accepted.set_result(turn.inbound_id is not None)
        return turn.run if turn.inbound_id is not None else None

    def _seen(self, msg: InboundMessage, hops: int) -> bool:
        """In-memory de-duplication, for messages straight from a platform. A forwarded message
        may well have passed through here before (we forwarded it); the store decides for it."""
        if hops:
            self._remember(msg)
            return False
        return self._remember(msg)

    def remember(self, msg: InboundMessage) -> bool:
        """Record a message id as seen (True if it already was)."""
        return self._remember(msg)

    def _remember(self, msg: InboundMessage) -> bool:
        """In-memory first line of de-duplication; True if this message was seen recently."""
        dk = (msg.platform, msg.chat_id, msg.message_id)
        if dk in self._recent:
            return True
        self._recent[dk] = None
        if len(self._recent) > 50_000:
            self._recent.popitem(last=False)
        return False

    def _forget(self, msg: InboundMessage) -> None:
        self._recent.pop((msg.platform, msg.chat_id, msg.message_id), None)

    def _enqueue(self, turn: Turn) -> int:
        """Put a turn in its lane; returns how many turns are ahead of it."""
        if self.cluster is not None and (lease := self.cluster.leases.held.get(turn.key)) is not None:
            turn.run.fence = lease.fence
            turn.run.guard = functools.partial(self.cluster.guard, turn.key, lease.fence)
        lane = self._lanes.get(turn.key)
        if lane is None:
            lane = self._lanes[turn.key] = Lane(turn.key)
        ahead = len(lane.pending) + (lane.current is not None)
        lane.pending.append(turn)
        if lane.worker is None:
            lane.worker = asyncio.get_running_loop().create_task(self._drain(lane))
        return ahead

    # --- cancellation ---------------------------------------------------------------------

    def hard_cancel(self, session: str, tool_reason: ToolReason) -> Run | None:
        """Stop the turn running (or about to run) in `session` only; returns its run, or None.

        Returns at once; `await run.wait()` to know when it has ended. A call with nothing
        running changes nothing, so it cannot swallow the next message.
        """
        if not isinstance(tool_reason, ToolReason):
            raise TypeError("hard_cancel needs a ToolReason; there is no default reason")
        lane = self._lanes.get(session)
        if lane is None:
            return None
        turn = lane.current or (lane.pending[0] if lane.pending else None)
        if turn is None or not turn.run.cancel(tool_reason):
            return None
        log.info("hard_cancel: %s", tool_reason.marker, extra={"session": session, "run": turn.run.run_id})
        return turn.run

    def cancel_all(self, reason: ToolReason) -> None:
        """Stop every running turn now (a forced exit); queued ones stay for the next start."""
        for lane in list(self._lanes.values()):
            if lane.current is not None:
                lane.current.run.cancel(reason)

    def _cancel_lane(self, session: str, reason: ToolReason) -> list[Run]:
        """Cancel the running turn and every queued one of `session`."""
        lane = self._lanes.get(session)
        if lane is None:
            return []
        turns = ([lane.current] if lane.current else []) + list(lane.pending)
        runs = [t.run for t in turns if t.run.cancel(reason)]
        if runs:
            log.info("cancelled %d turn(s): %s", len(runs), reason.marker, extra={"session": session})
        return runs

    def _on_evict(self, key: str, _agent: SessionAgent, running: bool) -> None:
        if running:
            self.hard_cancel(key, EVICTED)

    # --- cluster mode ---------------------------------------------------------------------

    async def _owner(self, key: str) -> str | None:
        """The worker that owns `key` (this one if it was free); None if that cannot be known."""
        assert self.cluster is not None
        if not self.cluster.healthy()[0] and key not in self.cluster.leases.held:
            return None
        try:
            route = await self.cluster.route(key)
        except (RedisError, OSError) as exc:
            log.warning("cannot route %s: %s", key, type(exc).__name__)
            return None
        return self.worker_id if route.fence is not None else route.owner

    async def _forward(self, owner: str, cmd: Command | None, msg: InboundMessage, key: str, adapter: Adapter,
                       hops: int) -> Submitted:
        assert self.cluster is not None
        if hops >= MAX_HOPS or (cmd is None and not adapter.pushes_anywhere):
            # A web chat or API client waits on this worker's connection, and only the owner may
            # answer: say so rather than answer twice or not at all.
            return await self._reject(adapter, msg, key, "This conversation is busy on another worker right "
                                      "now; please try again in a moment.")
        log.debug("forwarding to %s (hop %d)", owner, hops + 1, extra={"session": key})
        # The owner answers push platforms itself; only a client connected here needs the result.
        want_reply = cmd is not None and not adapter.pushes_anywhere
        try:
            result = await self.cluster.forward(owner, msg, key, hops=hops, want_reply=want_reply)
        except (RedisError, OSError) as exc:
            self._forget(msg)
            log.warning("forwarding to %s failed: %s", owner, type(exc).__name__, extra={"session": key})
            return await self._reject(adapter, msg, key, "I could not pass that on (shared storage is "
                                      "unavailable). Please try again shortly.")
        if not want_reply:
            return Submitted(Outcome.FORWARDED, owner)
        if result is None:
            return await self._reject(adapter, msg, key, "The worker running this conversation did not answer "
                                      "in time; please try again.")
        detail, outcome = result["detail"], Outcome(result["outcome"])
        kind: NoticeKind = "stopped" if detail == STOPPED else "error" if outcome is Outcome.REJECTED else "info"
        await adapter.notify(msg.chat, detail, reply_to=msg.message_id, kind=kind)  # the owner can't reach it
        return Submitted(outcome, detail)

    def lease_lost(self, session: str) -> None:
        """Another worker owns `session` now: stop its turn and drop everything local, silently.

        Queued messages stay open in the shared store; the new owner replays them."""
        lane = self._lanes.get(session)
        if lane is not None:
            for turn in ([lane.current] if lane.current else []) + list(lane.pending):
                turn.run.cancel(LEASE_LOST)
        self.cache.discard(session)

    def busy(self, session: str) -> bool:
        lane = self._lanes.get(session)
        return lane is not None and (lane.current is not None or bool(lane.pending))

    # --- commands (never behind the lane) -------------------------------------------------

    async def _command(self, cmd: Command, key: str, msg: InboundMessage, adapter: Adapter) -> Submitted:
        kind: NoticeKind = "info"
        if cmd.name == "stop":
            runs = self._cancel_lane(key, STOPPED_BY_USER)
            text, kind = (STOPPED, "stopped") if runs else ("Nothing is running.", "info")
        elif cmd.name in ("new", "reset"):
            self._cancel_lane(key, SESSION_RESET)
            self.cache.discard(key)
            try:
                await self.store.reset(key)
                text = "Started a new conversation. The old one is archived."
            except StoreError as exc:
                log.error("reset failed: %s", exc, extra={"session": key})
                text, kind = "Could not start a new conversation (storage error); please try again.", "error"
        elif cmd.name == "status":
            text = self._status_text(self.status(key))
        elif cmd.name in ("help", "start"):
            text = HELP
        else:
            return await self._reject(adapter, msg, key, f"Unknown command /{cmd.name} — try /help.")
        await adapter.notify(msg.chat, text, reply_to=msg.message_id, kind=kind)
        return Submitted(Outcome.COMMAND, text)

    def status(self, key: str) -> SessionStatus:
        lane = self._lanes.get(key)
        current = lane.current if lane else None
        running = current is not None and current.run.started_at is not None
        since = current.run.started_at if running and current else None
        queued = len(lane.pending) if lane else 0
        return SessionStatus(key, running, since, queued, self.agent.description)

    @staticmethod
    def _status_text(s: SessionStatus) -> str:
        if s.running and s.since is not None:
            clock = time.strftime("%H:%M:%S", time.localtime(s.since))
            state = f"Running since {clock} ({time.time() - s.since:.0f} s)"
        else:
            state = "Idle"
        return f"{state} · queued: {s.queued} · agent: {s.agent}"

    def sessions(self) -> list[SessionStatus]:
        return [self.status(key) for key in list(self._lanes)]

    # --- turns ----------------------------------------------------------------------------

    async def _drain(self, lane: Lane) -> None:
        try:
            while lane.pending and not self._closing:
                turn = lane.current = lane.pending.popleft()
                try:
                    await self._run_turn(turn)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("turn failed outside the agent", extra={"session": lane.key})
                finally:
                    lane.current = None
        finally:
            lane.worker = None
            if not lane.pending and self._lanes.get(lane.key) is lane:
                del self._lanes[lane.key]

    async def _run_turn(self, turn: Turn) -> None:
        try:
            await self._turns.execute(turn)
        finally:
            turn.run.end()

    async def _sweep(self) -> None:
        every = max(1.0, min(30.0, self.settings.idle_ttl_s / 2))
        while True:
            await asyncio.sleep(every)
            self.rate_limit.prune()
            if expired := self.cache.expire_idle():
                log.debug("released %d idle agents", expired)
