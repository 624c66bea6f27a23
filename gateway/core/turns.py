"""Running one turn: the agent streams in the run's own task; the lane worker records the outcome.

The run's task can be cancelled at any point; this code never is (hard_cancel only cancels the
run), so every turn ends with a true record: answered, interrupted (with who and why), failed.
A run's task that will not end (it swallows its cancel) is waited for only `cancel_grace_s`
after the cancel: the turn is then recorded as interrupted and the lane moves on.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from agent_cache import AgentCache, CacheFull
from gateway.core.cancellation import GATEWAY_RESTART, LEASE_LOST, SESSION_RESET, Run, current_run, timed_out
from gateway.core.fencing import Fence
from gateway.core.logs import log_context
from gateway.core.messages import InboundMessage
from gateway.core.metrics import Metrics
from gateway.core.ports import Agent, AgentError, InboundStatus, NoticeKind, Outlet, Reply, Store, StoreError
from gateway.core.transcript import ChatMessage, TextDelta, TurnRecorder

log = logging.getLogger(__name__)


class LiveConversation:
    """What the agent cache holds per session: its current conversation, loaded once from the store."""

    __slots__ = ("conversation", "history", "key")

    def __init__(self, key: str, conversation: int, history: list[ChatMessage]) -> None:
        self.key = key
        self.conversation = conversation
        self.history = history


class Interruptions:
    """The last interruption per session (kind, reason, when), for /status and the console; bounded."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._last: OrderedDict[str, tuple[str, str, float]] = OrderedDict()

    def record(self, key: str, kind: str, reason: str) -> None:
        self._last[key] = (kind, reason, time.time())
        self._last.move_to_end(key)
        if len(self._last) > self.LIMIT:
            self._last.popitem(last=False)

    def get(self, key: str) -> tuple[str, str, float] | None:
        return self._last.get(key)


class Turn:
    __slots__ = ("accepted", "ephemeral", "fence", "inbound_id", "key", "msg", "outlet", "run")

    def __init__(self, msg: InboundMessage, key: str, outlet: Outlet, fence: Fence,
                 ephemeral: Sequence[ChatMessage] | None = None) -> None:
        self.msg = msg
        self.key = key
        self.outlet = outlet
        self.fence = fence
        self.run = Run(key)
        self.ephemeral = ephemeral
        self.inbound_id: int | None = None
        # Resolves True once the message is durable (False: duplicate or not stored).
        self.accepted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()


class TurnRunner:
    def __init__(self, *, store: Store, metrics: Metrics, cache: AgentCache[LiveConversation],
                 interruptions: Interruptions, agent: Callable[[], Agent], timeout_s: Callable[[], float],
                 check_lease: Callable[[str], None] | None = None,
                 cancel_grace_s: Callable[[], float] = lambda: 2.0) -> None:
        self._store = store
        self._metrics = metrics
        self._cache = cache
        self._interruptions = interruptions
        self._agent = agent
        self._timeout_s = timeout_s
        self._check_lease = check_lease
        self._cancel_grace_s = cancel_grace_s
        self.running: dict[Run, float] = {}  # run -> monotonic start

    async def watch_timeouts(self) -> None:
        """Stop turns that outlive `turn_timeout_s` (one sweep for all, instead of a timer each)."""
        while True:
            timeout = self._timeout_s()
            await asyncio.sleep(min(1.0, timeout / 5))
            cutoff = time.monotonic() - timeout
            for run, started in list(self.running.items()):
                if started <= cutoff:
                    run.cancel(timed_out(timeout))

    async def execute(self, turn: Turn) -> None:
        """Run one turn to its end. The agent streams in a task of its own (the run's task);
        this lane worker is never cancelled by hard_cancel, so it always records the outcome."""
        if not await turn.accepted:
            return
        run, msg = turn.run, turn.msg
        try:
            agent = await self._session_agent(turn.key) if turn.ephemeral is None else None
        except (CacheFull, StoreError) as exc:
            log.warning("cannot start a turn: %s", exc, extra={"session": turn.key})
            await self._finish(turn, InboundStatus.REJECTED, str(exc))
            self._metrics.turns.labels("rejected").inc()
            await turn.outlet.notify(msg.chat, "I'm at capacity right now (every agent slot is busy). "
                                     "Please try again shortly." if isinstance(exc, CacheFull) else
                                     "Sorry, I could not load this conversation (storage error).",
                                     reply_to=msg.message_id, kind=NoticeKind.ERROR)
            return
        user = ChatMessage("user", msg.text, created_at=msg.timestamp)
        recorder = TurnRecorder()
        if run.reason == LEASE_LOST:  # the new owner replays it: leave the store alone
            return
        if run.is_cancelled():  # stopped while queued or starting: it never runs
            assert run.reason is not None
            self._count_cancel(turn.key, run)
            if agent is not None and run.reason != SESSION_RESET:
                await self._persist(turn, agent, agent.conversation, [user, *recorder.interrupted(run.reason)],
                                    status=(InboundStatus.CANCELLED, run.reason.marker))
            else:
                await self._finish(turn, InboundStatus.CANCELLED, run.reason.marker)
            return
        history = list(turn.ephemeral if turn.ephemeral is not None else agent.history if agent else [])
        conversation = agent.conversation if agent else 0
        if agent is not None:
            await self._persist(turn, agent, conversation, [user], remember=False,
                                status=(InboundStatus.RUNNING, None))
        reply = turn.outlet.open_reply(msg, run)
        ctx = contextvars.copy_context()
        ctx.run(current_run.set, run)
        ctx.run(log_context.set, {"session": turn.key, "platform": msg.platform, "run": run.run_id})
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._stream(run, self._agent(), history, user, reply, recorder), context=ctx)
        run.attach(task)  # a cancel that landed during the awaits above cancels it right here
        self.running[run] = time.monotonic()  # watched by `watch_timeouts`
        self._cache.mark_running(turn.key, True)
        self._metrics.turns_running.inc()
        try:
            # Until the task ends, or `cancel_grace_s` after a cancel it swallows (it is then left
            # behind, still being cancelled, its output held back). A cancel of this lane worker
            # itself (forced shutdown) propagates.
            await run.join(self._cancel_grace_s())
        finally:
            self.running.pop(run, None)
            self._cache.mark_running(turn.key, False)
            self._metrics.turns_running.dec()
        rows, status, detail = await self._outcome(task, run, recorder, reply)
        self._metrics.turns.labels(status.value).inc()
        try:
            await self._record(turn, agent, conversation, user, rows, status, detail)
        finally:
            try:
                await reply.settled()
            except Exception:
                log.exception("the platform failed after a turn ended")

    async def _record(self, turn: Turn, agent: LiveConversation | None, conversation: int, user: ChatMessage,
                      rows: list[ChatMessage], status: InboundStatus, detail: str | None) -> None:
        run = turn.run
        if run.reason == LEASE_LOST:  # fenced out: the new owner closes this turn's record
            self._count_cancel(turn.key, run)
            return
        if status is InboundStatus.CANCELLED:
            self._count_cancel(turn.key, run)
            if run.reason == GATEWAY_RESTART:
                status = InboundStatus.RESTART  # resumed on the next start
        if agent is not None:
            await self._persist(turn, agent, conversation, rows, prepend=user, status=(status, detail))
        else:
            await self._finish(turn, status, detail)

    async def _stream(self, run: Run, agent: Agent, history: list[ChatMessage], user: ChatMessage, reply: Reply,
                      recorder: TurnRecorder) -> None:
        async for event in agent.run_turn(history, user):
            recorder.feed(event)
            if isinstance(event, TextDelta) and self._may_send(run):
                await reply.delta(event.text)
        if self._may_send(run):
            await reply.finish(recorder.text)

    def _may_send(self, run: Run) -> bool:
        if run.may_send():
            return True
        if not run.is_cancelled() and self._check_lease is not None:
            self._check_lease(run.session_key)  # the lease lapsed unnoticed (a pause): drop it now
        return False

    async def _outcome(self, task: asyncio.Task[None], run: Run, recorder: TurnRecorder,
                       reply: Reply) -> tuple[list[ChatMessage], InboundStatus, str | None]:
        # Cancelled — or stopped so late that the task still returned: its output was held back
        # from the chat by then (Run.may_send), so the record says interrupted either way.
        if task.cancelled() or run.reason is not None:
            if run.reason is None:  # only Run.cancel holds the task, so this is a bug: say so
                log.error("turn task cancelled without a tool_reason")
                return recorder.failed("cancelled without a reason"), InboundStatus.FAILED, "no reason"
            await reply.interrupted(run.reason)
            return recorder.interrupted(run.reason), InboundStatus.CANCELLED, run.reason.marker
        exc = task.exception()
        if exc is None:
            return recorder.complete(), InboundStatus.DONE, None
        if isinstance(exc, AgentError):
            log.warning("agent failed: %s", exc)
            self._metrics.provider_errors.inc()
            await reply.failed(f"The agent failed: {exc}.")
            return recorder.failed(str(exc)), InboundStatus.FAILED, str(exc)
        log.error("turn crashed", exc_info=exc)
        await reply.failed("Something went wrong on our side; it has been logged.")
        return recorder.failed("internal error"), InboundStatus.FAILED, type(exc).__name__

    def _count_cancel(self, key: str, run: Run) -> None:
        reason = run.reason
        if reason is None:
            return
        self._metrics.cancels.labels(reason.kind, reason.text).inc()
        if run.cancelled_at is not None and run.done_at is not None:
            self._metrics.stop_latency.observe(run.done_at - run.cancelled_at)
        self._interruptions.record(key, reason.kind, reason.text)

    async def _session_agent(self, key: str) -> LiveConversation:
        agent = self._cache.get(key)
        if agent is None:
            conversation, history = await self._store.conversation(key)
            agent = self._cache.get(key)
            if agent is None:
                agent = LiveConversation(key, conversation, history)
                self._cache.put(key, agent)
        return agent

    async def _persist(self, turn: Turn, agent: LiveConversation, conversation: int, rows: list[ChatMessage],
                       *, status: tuple[InboundStatus, str | None], prepend: ChatMessage | None = None,
                       remember: bool = True) -> None:
        """Write rows to the turn's own conversation (a /new meanwhile does not move them), and the
        inbound message's new status in the same transaction."""
        inbound = (turn.inbound_id, *status) if turn.inbound_id is not None else None
        try:
            await self._store.append(turn.fence, conversation, rows, inbound=inbound)
        except StoreError as exc:
            log.error("could not store a turn's transcript: %s", exc, extra={"session": turn.key})
            return
        if remember and agent.conversation == conversation:
            agent.history.extend([prepend, *rows] if prepend else rows)

    async def _finish(self, turn: Turn, status: InboundStatus, detail: str | None) -> None:
        if turn.inbound_id is None:
            return
        try:
            await self._store.finish_inbound(turn.fence, turn.inbound_id, status, detail)
        except StoreError as exc:
            log.error("could not mark a message %s: %s", status.value, exc, extra={"session": turn.key})
