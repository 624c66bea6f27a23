"""The session router: one lane per session, one turn at a time, commands outside the lane.

Every inbound message ends processed, queued (with an ack) or rejected with a reason. A turn's
`Run` exists from the moment its message is accepted, so `/stop` finds it whether it is queued,
starting or streaming; commands never wait on the lane or on anything a turn holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from agent_cache import AgentCache, CacheSettings
from gateway.core.access import AccessControl
from gateway.core.attachments import MediaSettings, refusal_sentence, screen
from gateway.core.background import KILLED_BY_USER, BackgroundJobs
from gateway.core.cancellation import (
    EVICTED,
    LEASE_LOST,
    NEW_MESSAGE,
    SESSION_RESET,
    STOPPED_BY_USER,
    Run,
    ToolReason,
)
from gateway.core.cluster import ClusterEvents, ClusterUnavailable, FenceGuard, Ownership, Route
from gateway.core.commands import STOPPED, Command, parse_command
from gateway.core.fencing import Fence
from gateway.core.messages import ChatRef, InboundMessage, session_key
from gateway.core.metrics import Metrics
from gateway.core.ports import (
    UNAVAILABLE_RETRY_S,
    Agent,
    MediaLoader,
    NoticeKind,
    Outcome,
    Outlet,
    Outlets,
    SessionStatus,
    Store,
    StoreError,
    Submitted,
)
from gateway.core.ratelimit import UserRateLimit
from gateway.core.recovery import RESUME_PREFIX, Recovery
from gateway.core.transcript import ChatMessage
from gateway.core.turns import Interruptions, LiveConversation, Speaker, Turn, TurnRunner

log = logging.getLogger(__name__)

BusyPolicy = Literal["interrupt", "queue", "steer"]
BUSY_POLICIES: tuple[BusyPolicy, ...] = ("interrupt", "queue", "steer")
MAX_HOPS = 3  # forwards between cluster workers before a message is refused
MEDIA_ONLY = "I can only read text, images and text files; that kind of message is not supported."
STEERED = "↪ added to the current answer"
UNAVAILABLE_NOTICE_EVERY_S = 60.0
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")  # binary, not text


@dataclass
class RouterSettings:
    """The `[router]` section of the config."""

    busy: BusyPolicy = "interrupt"
    per_user_in_groups: bool = False
    max_message_chars: int = 16_000
    turn_timeout_s: float = 600.0
    messages_per_minute: int = 20  # per user; excess gets one notice, then silence; 0 = off


@dataclass(slots=True)
class Lane:
    key: str
    pending: deque[Turn] = field(default_factory=deque)
    current: Turn | None = None
    worker: asyncio.Task[None] | None = None


def _order(msg: InboundMessage) -> tuple[float, int]:
    """When the user sent it: the platform's time, then its message number (Telegram's grow per chat)."""
    return msg.timestamp, int(msg.message_id) if msg.message_id.isdigit() else 0


def _newer_in(lane: Lane, msg: InboundMessage) -> bool:
    """Is a message the user sent after `msg` already in the lane?"""
    newest = lane.pending[-1] if lane.pending else lane.current
    if newest is None or newest.msg.message_id.startswith(RESUME_PREFIX):
        return False
    return _order(newest.msg) > _order(msg)


def _encodable(*texts: str | None) -> bool:
    """Can every text be written as UTF-8 (no lone surrogates)?"""
    for text in texts:
        if text and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return False
    return True


class Router:
    """The core's `Gateway`: platforms submit here; the router owns lanes, turns and recovery."""

    def __init__(self, settings: RouterSettings, *, store: Store, agent: Agent, outlets: Outlets,
                 cache: CacheSettings | None = None, metrics: Metrics | None = None,
                 access: AccessControl | None = None, cluster: Ownership | None = None,
                 resume_max_age_s: float = 600.0, cancel_grace_s: float = 2.0,
                 media: MediaSettings | None = None, vision: bool = True,
                 media_loader: MediaLoader | None = None,
                 jobs: BackgroundJobs | None = None) -> None:
        self.settings = settings
        self.jobs = jobs  # shell commands moved to the background (None: off)
        self._origins: OrderedDict[str, InboundMessage] = OrderedDict()  # a session's last message: where
        # a background job's end is reported
        # How long a cancelled turn's task may take to end before its lane moves on without it.
        self.cancel_grace_s = cancel_grace_s
        self.store = store
        self.metrics = metrics or Metrics()
        self._agent = agent
        self._outlets = outlets
        self._access = access
        self._cluster = cluster
        self.media = media or MediaSettings()
        self.vision = vision  # may images go to the model (`[agent] vision`)
        cache = cache or CacheSettings()
        self.cache: AgentCache[LiveConversation] = AgentCache(
            max_agents=cache.max_agents, idle_ttl_s=cache.idle_ttl_s, when_full=cache.when_full,
            on_evict=self._on_evict)
        self.interruptions = Interruptions()
        # More lines for /status (e.g. the MCP servers' state), each asked for the session's key.
        self.status_extras: list[Callable[[str], str | None]] = []
        self._lanes: dict[str, Lane] = {}
        self._recent: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._closing = False
        self._unavailable_told: dict[ChatRef, float] = {}
        self._busy: dict[str, BusyPolicy] = {}  # per-session overrides (/busy), kept while this process runs
        self._tasks: list[asyncio.Task[None]] = []
        self._rate_limit = UserRateLimit(settings.messages_per_minute)
        self._turns = TurnRunner(store=store, metrics=self.metrics, cache=self.cache,
                                 interruptions=self.interruptions, agent=lambda: self._agent,
                                 timeout_s=lambda: self.settings.turn_timeout_s,
                                 check_lease=cluster.check_lease if cluster else None,
                                 cancel_grace_s=lambda: self.cancel_grace_s, media=media_loader)
        self._recovery = Recovery(store, outlets, requeue=self.resume, remember=self._remember,
                                  fence=self._fence, speaker=self._speaker, resume_max_age_s=resume_max_age_s)
        self.metrics.watch_cache(lambda: (len(self.cache), self.cache.hits, self.cache.misses, self.cache.evictions))

    @property
    def agent(self) -> Agent:
        return self._agent

    @property
    def worker_id(self) -> str | None:
        return self._cluster.worker_id if self._cluster else None

    def use_agent(self, agent: Agent) -> None:
        """A reload: new turns use `agent`; running ones finish on the agent they started with."""
        self._agent = agent

    def apply_settings(self, settings: RouterSettings) -> None:
        self.settings = settings
        self._rate_limit.per_minute = settings.messages_per_minute

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Recover what a previous process left unfinished, then start the sweepers."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._sweep()), loop.create_task(self._turns.watch_timeouts())]
        await self._recovery.recover_all()

    def cluster_events(self) -> ClusterEvents:
        """What the cluster coordinator reports to (given to it when it starts)."""
        return _ClusterEvents(self)

    async def shutdown(self, reason: ToolReason, *, drain_s: float = 0.0, grace_s: float = 10.0) -> None:
        """Stop intake, let running turns finish for up to `drain_s`, hard_cancel the rest for
        `reason`, and wait (up to `grace_s`) for their outcomes to be recorded.

        Queued turns stay accepted in the store and are replayed on the next start.
        """
        self._closing = True
        for task in self._tasks:
            task.cancel()
        running = [lane.worker for lane in self._lanes.values() if lane.worker and lane.current]
        if drain_s > 0 and running:
            log.info("draining %d running turn(s) for up to %.0f s", len(running), drain_s)
            await asyncio.wait(running, timeout=drain_s)
        if self.jobs is not None:  # no job outlives the daemon; each is told at the next start
            for key, message_id, text in self.jobs.kill_all(reason):
                await self._leave_automatic(key, message_id, text)
        queued: list[Turn] = []
        for lane in list(self._lanes.values()):
            if lane.current is not None:
                lane.current.run.cancel(reason)
                queued += lane.current.steered  # not handed over yet: they wait like queued ones
                lane.current.steered = []
            queued += lane.pending
            lane.pending.clear()
        storing: list[asyncio.Task[None]] = []
        for turn in queued:  # stays accepted in the store, replayed on the next start; its reply ends now
            turn.run.cancel(reason)
            if not turn.accepted.done():  # its intake is still storing it: its reply ends once it is stored
                storing.append(asyncio.ensure_future(self._settle_once_stored(turn)))
            elif turn.accepted.result():
                await self._turns.settle(turn)
            turn.run.end()
        workers = [lane.worker for lane in self._lanes.values() if lane.worker] + storing
        if workers:
            _done, late = await asyncio.wait(workers, timeout=grace_s)
            for task in late:
                task.cancel()

    async def _settle_once_stored(self, turn: Turn) -> None:
        if await turn.accepted:
            await self._turns.settle(turn)

    # --- the Gateway port -----------------------------------------------------------------

    async def submit(self, msg: InboundMessage, outlet: Outlet, *,
                     ephemeral: Sequence[ChatMessage] | None = None, key: str | None = None) -> Submitted:
        """Route one inbound message. Never raises for bad input: the user gets a reason."""
        return await self._intake(msg, outlet, ephemeral, key, hops=0)

    async def history(self, key: str) -> list[ChatMessage]:
        return (await self.store.conversation(key))[1]

    def count_outbound(self, platform: str, kind: str) -> None:
        if kind == "429":
            self.metrics.platform_429s.labels(platform).inc()
        else:
            self.metrics.messages_out.labels(platform, kind).inc()

    def status(self, key: str) -> SessionStatus:
        lane = self._lanes.get(key)
        current = lane.current if lane else None
        running = current is not None and current.run.started_at is not None
        since = current.run.started_at if running and current else None
        queued = len(lane.pending) if lane else 0
        return SessionStatus(key, running, since, queued, self._agent.description)

    def sessions(self) -> list[SessionStatus]:
        return [self.status(key) for key in list(self._lanes)]

    # --- intake ---------------------------------------------------------------------------

    async def _intake(self, msg: InboundMessage, outlet: Outlet, ephemeral: Sequence[ChatMessage] | None,
                      key: str | None, hops: int) -> Submitted:
        """`hops` counts forwards between cluster workers (a forwarded message arrives with 1)."""
        result = await self._route(msg, outlet, ephemeral, key, hops)
        self.metrics.messages_in.labels(msg.platform, result.outcome.value).inc()
        return result

    async def _route(self, msg: InboundMessage, outlet: Outlet, ephemeral: Sequence[ChatMessage] | None,
                     key: str | None, hops: int) -> Submitted:
        key = key or session_key(msg, per_user_in_groups=self.settings.per_user_in_groups)
        if msg.attachments:  # each gets its verdict now, before the message is stored
            msg = dataclasses.replace(msg, attachments=screen(msg.attachments, self.media, vision=self.vision))
        readable = any(a.refused is None for a in msg.attachments)
        refused = refusal_sentence(msg.attachments)
        media_only = (msg.media or bool(msg.attachments)) and not msg.text.strip() and not readable
        if not _encodable(key, msg.text, msg.chat_id, msg.user_id, msg.user_name, msg.message_id,
                          msg.thread_id, msg.user_handle, msg.reply_to,
                          *(a.name for a in msg.attachments), *(a.mime for a in msg.attachments)):
            # Lone surrogates (e.g. "\ud800" in JSON) cannot be stored or sent on: refuse them now,
            # before anything is acknowledged, rather than poison the store.
            return await self._reject(outlet, msg, key, "That message contains characters that are not valid "
                                      "text; please send it again.")
        if not media_only and not (readable and not msg.text.strip()) and (problem := self._validate(msg.text)):
            return await self._reject(outlet, msg, key, problem)
        cmd = parse_command(msg.text, outlet.bot_username)
        if self._closing and cmd is None:  # commands still work while turns drain: /stop must stop
            return await self._reject(outlet, msg, key, "The gateway is restarting; please send that again in a "
                                      "moment.", kind=NoticeKind.RESTART)
        if self._access is not None:
            allowed, notice = await self._access.check(msg)
            if not allowed:
                return await self._reject(outlet, msg, key, notice, kind=NoticeKind.INFO,
                                          detail="not allowed (notice throttled)")
        if media_only:
            return await self._reject(outlet, msg, key, refused or MEDIA_ONLY)
        if cmd is None and ephemeral is None:  # commands always get through: /stop must work
            allowed, notice = self._rate_limit.check(msg.platform, msg.user_id)
            if not allowed:
                return await self._reject(outlet, msg, key, notice, detail="rate limited (notice already sent)")
        fence = Fence.local(key)
        if self._cluster is not None and ephemeral is None:
            route = await self._owner(key)
            if route is None:
                return await self._unavailable(outlet, msg, key, "I can't take messages right now (shared "
                                               "storage is unavailable). Please try again shortly.")
            if route.fence is None:
                if self._seen(msg, hops):
                    return Submitted(Outcome.DUPLICATE)
                assert route.owner is not None
                return await self._forward(route.owner, cmd, msg, key, outlet, hops)
            fence = route.fence
        # From here on the core speaks for the session only through its speaker (guarded by the fence).
        speaker = self._speaker(outlet, fence)
        if cmd is not None:
            if self._seen(msg, hops):
                return Submitted(Outcome.DUPLICATE)
            return await self._command(cmd, key, msg, speaker)
        if ephemeral is None and self._seen(msg, hops):
            return Submitted(Outcome.DUPLICATE)

        if refused:  # the rest of the message is answered; the user learns why this part is not read
            await speaker.notify(msg.chat, refused, reply_to=msg.message_id, kind=NoticeKind.INFO)
        turn = Turn(msg, key, speaker, fence, ephemeral)
        if ephemeral is None:
            self._remember_origin(key, msg)
        lane = self._lanes.get(key)
        busy = lane is not None and (lane.current is not None or bool(lane.pending))
        policy = self.busy_policy(key)
        # A message that arrives late (held up in a forward while its owner was paused) must not
        # cut off the answer to one the user sent after it: it waits its turn instead.
        late = busy and lane is not None and _newer_in(lane, msg)
        # A message with images or files is a turn of its own: steering hands the model text only.
        steer = (policy == "steer" and busy and not late and ephemeral is None and outlet.can_steer and not readable
                 and lane is not None and lane.current is not None and not lane.pending
                 and not lane.current.run.is_cancelled())
        queue = policy != "interrupt" or late
        if busy and not queue:
            if self.jobs is not None:  # long commands move to the background before the cancel reaches them
                self.jobs.yield_foreground(key, now=True)
            self._cancel_lane(key, NEW_MESSAGE)
        if steer and lane is not None and lane.current is not None:
            lane.current.steered.append(turn)  # handed to the running turn at its next boundary
            ahead = 0
        else:
            ahead = self._enqueue(turn)  # registered before any await: a /stop from now on finds it
        if ephemeral is not None:
            turn.accepted.set_result(True)
            return Submitted(Outcome.ACCEPTED, run=turn.run)
        try:
            if self._cluster is not None:  # before the message is stored: then someone always finishes it
                await self._cluster.watch(key)
            turn.inbound_id = await self.store.accept_inbound(fence, msg)
        except (StoreError, ClusterUnavailable) as exc:
            turn.accepted.set_result(False)
            self._forget(msg)
            log.error("could not store an inbound message: %s", exc, extra={"session": key})
            return await self._unavailable(outlet, msg, key, "Sorry, I could not save your message (storage "
                                           "error). Please send it again.")
        if turn.inbound_id is None:
            turn.accepted.set_result(False)
            return Submitted(Outcome.DUPLICATE)
        turn.accepted.set_result(True)
        if steer:
            if self.jobs is not None:  # the turn's long commands move to the background: it can take this now
                self.jobs.yield_foreground(key, now=False)
            await speaker.notify(msg.chat, STEERED, reply_to=msg.message_id, kind=NoticeKind.INFO)
            return Submitted(Outcome.STEERED, STEERED, turn.run)
        if busy and queue and ahead and not turn.run.is_cancelled():  # (stopped meanwhile: its reply says so)
            await speaker.notify(msg.chat, f"Queued — {ahead} ahead of this message. /stop clears the queue.",
                                 reply_to=msg.message_id, kind=NoticeKind.QUEUED)
            return Submitted(Outcome.QUEUED, f"{ahead} ahead", turn.run)
        return Submitted(Outcome.ACCEPTED, run=turn.run)

    def _speaker(self, outlet: Outlet, fence: Fence) -> Speaker:
        if self._cluster is None or fence.is_local:
            return Speaker(outlet)
        return Speaker(outlet, FenceGuard(self._cluster, fence))

    async def _reject(self, outlet: Outlet, msg: InboundMessage, key: str, text: str | None, *,
                      kind: NoticeKind = NoticeKind.ERROR, detail: str = "") -> Submitted:
        """Tell the user why (unless `text` is None: already told recently) and say so in the log.
        Said by whichever worker received the message: it answers the message, not the session."""
        log.info("rejected a message: %s", text or detail, extra={"session": key})
        if text:
            await outlet.notify(msg.chat, text, reply_to=msg.message_id, kind=kind)
        return Submitted(Outcome.REJECTED, text or detail)

    async def _unavailable(self, outlet: Outlet, msg: InboundMessage, key: str, text: str) -> Submitted:
        """Not taken because storage or Redis is down. The platform may deliver it again (a webhook
        answered non-2xx, a client told to retry); the chat is told once a minute at most."""
        log.warning("could not take a message now: %s", text, extra={"session": key})
        now = time.monotonic()
        told = self._unavailable_told.get(msg.chat)
        if told is None or now - told >= UNAVAILABLE_NOTICE_EVERY_S:
            self._unavailable_told[msg.chat] = now
            if len(self._unavailable_told) > 10_000:
                self._unavailable_told.clear()
            await outlet.notify(msg.chat, text, reply_to=msg.message_id, kind=NoticeKind.ERROR)
        return Submitted(Outcome.UNAVAILABLE, text, retry_after_s=UNAVAILABLE_RETRY_S)

    def _validate(self, text: str) -> str | None:
        if not text.strip():
            return "That message was empty — send some text."
        if len(text) > self.settings.max_message_chars:
            return (f"That message is too long ({len(text)} characters; the limit is "
                    f"{self.settings.max_message_chars}). Please shorten it.")
        if _CONTROL_CHARS.search(text):
            return "That message contains binary data; I can only read text."
        return None

    async def resume(self, msg: InboundMessage, outlet: Outlet, key: str, *,
                     inbound_id: int | None = None) -> Run | None:
        """Queue a turn after a restart without the intake checks a user message gets: a message
        already stored (`inbound_id`), or an automatic one whose message id makes it happen once."""
        fence = self._fence(key)
        if fence is None:  # the session is not ours (any more): its owner recovers it
            return None
        turn = Turn(msg, key, self._speaker(outlet, fence), fence)
        self._remember_origin(key, msg)  # a job started by a replayed turn reports to its chat too
        self._enqueue(turn)
        try:
            if self._cluster is not None:
                await self._cluster.watch(key)
            turn.inbound_id = inbound_id or await self.store.accept_inbound(fence, msg)
        except (StoreError, ClusterUnavailable):  # it stays open in the store: recovered with the session later
            turn.inbound_id = None
        turn.accepted.set_result(turn.inbound_id is not None)
        return turn.run if turn.inbound_id is not None else None

    def _fence(self, key: str) -> Fence | None:
        """This worker's proof of ownership of `key` now: local, or a lease it provably holds."""
        if self._cluster is None:
            return Fence.local(key)
        return self._cluster.fence_of(key)

    def _seen(self, msg: InboundMessage, hops: int) -> bool:
        """In-memory de-duplication, for messages straight from a platform. A forwarded message
        may well have passed through here before (we forwarded it); the store decides for it."""
        if hops:
            self._remember(msg)
            return False
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
        turns = ([lane.current, *lane.current.steered] if lane.current else []) + list(lane.pending)
        runs = [t.run for t in turns if t.run.cancel(reason)]
        if runs:
            log.info("cancelled %d turn(s): %s", len(runs), reason.marker, extra={"session": session})
        return runs

    def _on_evict(self, key: str, _agent: LiveConversation, running: bool) -> None:
        if running:
            self.hard_cancel(key, EVICTED)

    # --- cluster mode ---------------------------------------------------------------------

    async def _owner(self, key: str) -> Route | None:
        """Ours (with the fence) or someone else's; None if that cannot be known now."""
        assert self._cluster is not None
        try:
            return await self._cluster.route(key)
        except ClusterUnavailable as exc:
            log.warning("cannot route %s: %s", key, exc)
            return None

    async def _forward(self, owner: str, cmd: Command | None, msg: InboundMessage, key: str, outlet: Outlet,
                       hops: int) -> Submitted:
        assert self._cluster is not None
        if hops >= MAX_HOPS and cmd is None and outlet.pushes_anywhere:
            # Ownership is moving (a takeover under way): the platform was already answered, so
            # the message stays in this worker's inbox and is handled again once idle for a TTL.
            log.info("ownership moving; the message waits in the inbox", extra={"session": key})
            return Submitted(Outcome.UNAVAILABLE, "ownership moving", retry_after_s=UNAVAILABLE_RETRY_S)
        if hops >= MAX_HOPS or (cmd is None and not outlet.pushes_anywhere):
            # A web chat or API client waits on this worker's connection, and only the owner may
            # answer: say so rather than answer twice or not at all.
            return await self._reject(outlet, msg, key, "This conversation is busy on another worker right "
                                      "now; please try again in a moment.")
        log.debug("forwarding to %s (hop %d)", owner, hops + 1, extra={"session": key})
        # The owner answers push platforms itself; only a client connected here needs the result.
        want_reply = cmd is not None and not outlet.pushes_anywhere
        try:
            result = await self._cluster.forward(owner, msg, key, hops=hops, want_reply=want_reply)
        except ClusterUnavailable as exc:
            self._forget(msg)
            log.warning("forwarding to %s failed: %s", owner, exc, extra={"session": key})
            return await self._unavailable(outlet, msg, key, "I could not pass that on (shared storage is "
                                           "unavailable). Please try again shortly.")
        if not want_reply:
            return Submitted(Outcome.FORWARDED, owner)
        if result is None:
            return await self._reject(outlet, msg, key, "The worker running this conversation did not answer "
                                      "in time; please try again.")
        kind = (NoticeKind.STOPPED if result.detail == STOPPED else
                NoticeKind.ERROR if result.outcome is Outcome.REJECTED else NoticeKind.INFO)
        await outlet.notify(msg.chat, result.detail, reply_to=msg.message_id, kind=kind)  # the owner can't reach it
        return result

    def lease_lost(self, session: str) -> None:
        """Another worker owns `session` now: stop its turn and drop everything local, silently.

        Queued messages stay open in the shared store; the new owner replays them."""
        lane = self._lanes.get(session)
        if lane is not None:
            for turn in ([lane.current] if lane.current else []) + list(lane.pending):
                turn.run.cancel(LEASE_LOST)
        if self.jobs is not None:
            self.jobs.kill_session(session, LEASE_LOST)
        self.cache.discard(session)

    def in_use(self, session: str) -> bool:
        """Does this worker still need `session` (a cached agent or work in its lane)?"""
        lane = self._lanes.get(session)
        return session in self.cache or (lane is not None and (lane.current is not None or bool(lane.pending)))

    def running(self, session: str) -> bool:
        """Is a turn of `session` running (not yet ended, or not yet started)? Not while it is recorded."""
        lane = self._lanes.get(session)
        return lane is not None and lane.current is not None and not lane.current.run.finished

    # --- commands (never behind the lane) -------------------------------------------------

    async def _command(self, cmd: Command, key: str, msg: InboundMessage, speaker: Speaker) -> Submitted:
        if cmd.spec is None:
            return await self._reject(speaker.outlet, msg, key, f"Unknown command /{cmd.name} — try /help.")
        result = await cmd.spec.handler(self, key, cmd.args)
        await speaker.notify(msg.chat, result.text, reply_to=msg.message_id, kind=result.kind)
        return Submitted(Outcome.COMMAND, result.text)

    def stop(self, key: str) -> int:
        return len(self._cancel_lane(key, STOPPED_BY_USER))

    def stop_run(self, key: str, token: str) -> int:
        lane = self._lanes.get(key)
        current = lane.current if lane is not None else None
        if current is None or current.run.token != token or current.run.is_cancelled():
            return 0  # that answer has ended (or never ran here): a later one is not stopped for it
        return self.stop(key)

    async def reset(self, key: str) -> bool:
        self._cancel_lane(key, SESSION_RESET)
        if self.jobs is not None:
            self.jobs.kill_session(key, SESSION_RESET)
        self.cache.discard(key)
        fence = self._fence(key)
        try:
            if fence is None:
                raise StoreError("this worker no longer owns the session")
            await self.store.reset(fence)
            return True
        except StoreError as exc:
            log.error("reset failed: %s", exc, extra={"session": key})
            return False

    def busy_policy(self, key: str, policy: str | None = None) -> str:
        """The session's busy policy, after setting it to `policy` if given (a /busy command)."""
        if policy is not None:
            if policy not in BUSY_POLICIES:
                raise ValueError(f"busy policy must be one of {', '.join(BUSY_POLICIES)}")
            self._busy[key] = policy
            if len(self._busy) > 100_000:
                self._busy.pop(next(iter(self._busy)))
        return self._busy.get(key, self.settings.busy)

    def jobs_text(self, key: str) -> str:
        if self.jobs is None:
            return "Background jobs are off here (they need the shell tool)."
        lines = self.jobs.describe(key)
        return "Background jobs:\n" + "\n".join(lines) if lines else "No background jobs in this chat."

    def kill_job(self, key: str, job_id: str) -> str | None:
        return self.jobs.kill_job(key, job_id, KILLED_BY_USER) if self.jobs is not None else None

    def _remember_origin(self, key: str, msg: InboundMessage) -> None:
        if msg.attachments or msg.extra or len(msg.text) > 200:  # only where to answer is needed: not MBs of it
            msg = dataclasses.replace(msg, text="", attachments=(), reply_to=None, extra={})
        self._origins[key] = msg
        self._origins.move_to_end(key)
        if len(self._origins) > 50_000:
            self._origins.popitem(last=False)

    async def deliver_automatic(self, key: str, message_id: str, text: str) -> bool:
        """An automatic message into `key` (a background job ended): queued like a message, in the
        chat the session last heard from, once (the store de-duplicates `message_id`). False if
        there is no chat to tell."""
        found = None if self._closing else self._automatic(key, message_id, text)
        if found is not None:
            await self.resume(*found, key)
        return found is not None

    async def _leave_automatic(self, key: str, message_id: str, text: str) -> None:
        """The same, stopping: stored as accepted, so the next start replays it."""
        found = self._automatic(key, message_id, text)
        fence = self._fence(key)
        if found is None or fence is None:
            return
        try:
            await self.store.accept_inbound(fence, found[0])
        except StoreError as exc:
            log.warning("could not store a job's end for the next start: %s", exc, extra={"session": key})

    def _automatic(self, key: str, message_id: str, text: str) -> tuple[InboundMessage, Outlet] | None:
        origin = self._origins.get(key)
        outlet = self._outlets.get(origin.platform) if origin is not None else None
        if origin is None or outlet is None or not outlet.can_steer:
            # The HTTP API has no chat to answer in (each request waits for its own answer): the
            # job's end stays visible to the model through job_status.
            log.info("not told (no chat to answer in): %s", text.split("\n", 1)[0], extra={"session": key})
            return None
        return InboundMessage(platform=origin.platform, chat_id=origin.chat_id, chat_type=origin.chat_type,
                              user_id=origin.user_id, user_name=origin.user_name, message_id=message_id, text=text,
                              thread_id=origin.thread_id, user_handle=origin.user_handle, tenant=origin.tenant), outlet

    def status_text(self, key: str) -> str:
        s = self.status(key)
        if s.running and s.since is not None:
            clock = time.strftime("%H:%M:%S", time.localtime(s.since))
            state = f"Running since {clock} ({time.time() - s.since:.0f} s)"
        else:
            state = "Idle"
        text = f"{state} · queued: {s.queued} · busy: {self.busy_policy(key)} · agent: {s.agent}"
        if self.jobs is not None and (jobs := self.jobs.count_running(key)):
            text += f" · background jobs running: {jobs} (/jobs)"
        conversation = self.cache.peek(key)
        if conversation is not None and conversation.prompt_tokens:
            prompt, completion = conversation.tokens_used
            text += (f"\ncontext: {conversation.prompt_tokens:,} tokens in the last request"
                     f" · used so far: {prompt:,} prompt, {completion:,} completion")
        for extra in self.status_extras:
            if line := extra(key):
                text += "\n" + line
        return text

    # --- turns ----------------------------------------------------------------------------

    async def _drain(self, lane: Lane) -> None:
        try:
            while lane.pending and not self._closing:
                turn = lane.current = lane.pending.popleft()
                try:
                    await self._run_turn(turn, lane)
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
                if self._cluster is not None and not self._closing:  # stopping: left for adoption
                    self._cluster.unwatch(lane.key)

    async def _run_turn(self, turn: Turn, lane: Lane) -> None:
        try:
            await self._turns.execute(turn)
        finally:
            turn.run.end()
            for joined in turn.absorbed:
                joined.run.end()
            # Messages sent too late to join the turn start the next one, in order.
            lane.pending.extendleft(reversed(turn.steered))
            turn.steered = []

    async def _sweep(self) -> None:
        every = max(1.0, min(30.0, self.cache.idle_ttl_s / 2))
        while True:
            await asyncio.sleep(every)
            self._rate_limit.prune()
            if expired := self.cache.expire_idle():
                log.debug("released %d idle agents", expired)


class _ClusterEvents(ClusterEvents):
    """What the cluster coordinator tells the router (passed to it at start, never patched on)."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def lease_lost(self, session: str) -> None:
        self._router.lease_lost(session)

    def in_use(self, session: str) -> bool:
        return self._router.in_use(session)

    def running(self, session: str) -> bool:
        return self._router.running(session)

    async def deliver(self, msg: InboundMessage, session: str, hops: int) -> Submitted | None:
        outlet = self._router._outlets.get(msg.platform)
        if outlet is None:
            log.error("forwarded message for platform %s, which this worker does not run", msg.platform)
            return None
        return await self._router._intake(msg, outlet, None, session, hops)

    async def adopted(self, session: str) -> None:
        await self._router._recovery.recover_taken_over(session)

