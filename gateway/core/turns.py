"""Running one turn: the agent streams in the run's own task; the lane worker records the outcome.

The run's task can be cancelled at any point; this code never is (hard_cancel only cancels the
run), so every turn ends with a true record: answered, interrupted (with who and why), failed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agent_cache import CacheFull
from gateway.agents import AgentError
from gateway.core.cancellation import GATEWAY_RESTART, LEASE_LOST, SESSION_RESET, Run, current_run, timed_out
from gateway.core.logs import log_context
from gateway.core.messages import InboundMessage
from gateway.core.transcript import ChatMessage, TextDelta, TurnRecorder
from gateway.store import StoreError

if TYPE_CHECKING:
    from gateway.core.router import Router
    from platforms.base import Adapter, Reply

log = logging.getLogger(__name__)


class SessionAgent:
    """What the agent cache holds per session: the live conversation, rebuilt from the store."""

    __slots__ = ("conversation", "history", "key")

    def __init__(self, key: str, conversation: int, history: list[ChatMessage]) -> None:
        self.key = key
        self.conversation = conversation
        self.history = history


class Turn:
    __slots__ = ("accepted", "adapter", "ephemeral", "inbound_id", "key", "msg", "run")

    def __init__(self, msg: InboundMessage, key: str, adapter: Adapter,
                 ephemeral: Sequence[ChatMessage] | None = None) -> None:
        self.msg = msg
        self.key = key
        self.adapter = adapter
        self.run = Run(key)
        self.ephemeral = ephemeral
        self.inbound_id: int | None = None
        # Resolves True once the message is durable (False: duplicate or not stored).
        self.accepted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()


class TurnRunner:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.running: dict[Run, float] = {}  # run -> monotonic start

    async def watch_timeouts(self) -> None:
        """Stop turns that outlive `turn_timeout_s` (one sweep for all, instead of a timer each)."""
        while True:
            timeout = self.router.settings.turn_timeout_s
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
            await self._finish(turn, "rejected", str(exc))
            self.router.metrics.turns.labels("rejected").inc()
            await turn.adapter.notify(msg.chat, "I'm at capacity right now (every agent slot is busy). "
                                      "Please try again shortly." if isinstance(exc, CacheFull) else
                                      "Sorry, I could not load this conversation (storage error).",
                                      reply_to=msg.message_id, kind="error")
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
                                    status=("cancelled", run.reason.marker))
            else:
                await self._finish(turn, "cancelled", run.reason.marker)
            return
        history = list(turn.ephemeral if turn.ephemeral is not None else agent.history if agent else [])
        conversation = agent.conversation if agent else 0
        if agent is not None:
            await self._persist(turn, agent, conversation, [user], remember=False, status=("running", None))
        reply = turn.adapter.open_reply(msg, run)
        ctx = contextvars.copy_context()
        ctx.run(current_run.set, run)
        ctx.run(log_context.set, {"session": turn.key, "platform": msg.platform, "run": run.run_id})
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._stream(run, history, user, reply, recorder), context=ctx)
        run.attach(task)  # a cancel that landed during the awaits above cancels it right here
        self.running[run] = time.monotonic()  # watched by `watch_timeouts`
        self.router.cache.mark_running(turn.key, True)
        self.router.metrics.turns_running.inc()
        try:
            await task
        except BaseException:
            if not task.done():  # this lane worker itself is being cancelled (forced shutdown)
                raise
        finally:
            self.running.pop(run, None)
            self.router.cache.mark_running(turn.key, False)
            self.router.metrics.turns_running.dec()
        rows, status, detail = await self._outcome(task, run, recorder, reply)
        self.router.metrics.turns.labels(status).inc()
        try:
            await self._record(turn, agent, conversation, user, rows, status, detail)
        finally:
            try:
                await reply.settled()
            except Exception:
                log.exception("the platform failed after a turn ended")

    async def _record(self, turn: Turn, agent: SessionAgent | None, conversation: int, user: ChatMessage,
                      rows: list[ChatMessage], status: str, detail: str | None) -> None:
        run = turn.run
        if run.reason == LEASE_LOST:  # fenced out: the new owner closes this turn's record
            self._count_cancel(turn.key, run)
            return
        if status == "cancelled":
            self._count_cancel(turn.key, run)
            if run.reason == GATEWAY_RESTART:
                status = "restart"  # resumed on the next start
        if agent is not None:
            await self._persist(turn, agent, conversation, rows, prepend=user, status=(status, detail))
        else:
            await self._finish(turn, status, detail)

    async def _stream(self, run: Run, history: list[ChatMessage], user: ChatMessage, reply: Reply,
                      recorder: TurnRecorder) -> None:
        async for event in self.router.agent.run_turn(history, user):
            recorder.feed(event)
            if isinstance(event, TextDelta) and run.may_send():
                await reply.delta(event.text)
        if run.may_send():
            await reply.finish(recorder.text)

    async def _outcome(self, task: asyncio.Task[None], run: Run, recorder: TurnRecorder,
                       reply: Reply) -> tuple[list[ChatMessage], str, str | None]:
        # Cancelled — or stopped so late that the task still returned: its output was held back
        # from the chat by then (Run.may_send), so the record says interrupted either way.
        if task.cancelled() or run.reason is not None:
            if run.reason is None:  # only Run.cancel holds the task, so this is a bug: say so
                log.error("turn task cancelled without a tool_reason")
                return recorder.failed("cancelled without a reason"), "failed", "no reason"
            await reply.interrupted(run.reason)
            return recorder.interrupted(run.reason), "cancelled", run.reason.marker
        exc = task.exception()
        if exc is None:
            return recorder.complete(), "done", None
        if isinstance(exc, AgentError):
            log.warning("agent failed: %s", exc)
            self.router.metrics.provider_errors.inc()
            await reply.failed(f"The agent failed: {exc}.")
            return recorder.failed(str(exc)), "failed", str(exc)
        log.error("turn crashed", exc_info=exc)
        await reply.failed("Something went wrong on our side; it has been logged.")
        return recorder.failed("internal error"), "failed", type(exc).__name__

    def _count_cancel(self, key: str, run: Run) -> None:
        reason = run.reason
        if reason is None:
            return
        self.router.metrics.cancels.labels(reason.kind, reason.text).inc()
        if run.cancelled_at is not None and run.done_at is not None:
            self.router.metrics.stop_latency.observe(run.done_at - run.cancelled_at)
        self.router.interruptions[key] = (reason.kind, reason.text, time.time())
        self.router.interruptions.move_to_end(key)
        if len(self.router.interruptions) > 10_000:
            self.router.interruptions.popitem(last=False)

    async def _session_agent(self, key: str) -> SessionAgent:
        agent = self.router.cache.get(key)
        if agent is None:
            conversation, history = await self.router.store.conversation(key)
            agent = self.router.cache.get(key)
            if agent is None:
                agent = SessionAgent(key, conversation, history)
                self.router.cache.put(key, agent)
        return agent

    async def _persist(self, turn: Turn, agent: SessionAgent, conversation: int, rows: list[ChatMessage],
                       *, status: tuple[str, str | None], prepend: ChatMessage | None = None,
                       remember: bool = True) -> None:
        """Write rows to the turn's own conversation (a /new meanwhile does not move them), and the
        inbound message's new status in the same transaction."""
        inbound = (turn.inbound_id, *status) if turn.inbound_id is not None else None
        try:
            await self.router.store.append(turn.key, conversation, rows, fence=turn.run.fence, inbound=inbound)
        except StoreError as exc:
            log.error("could not store a turn's transcript: %s", exc, extra={"session": turn.key})
            return
        if remember and agent.conversation == conversation:
            agent.history.extend([prepend, *rows] if prepend else rows)

    async def _finish(self, turn: Turn, status: str, detail: str | None) -> None:
        if turn.inbound_id is None:
            return
        try:
            await self.router.store.finish_inbound(turn.key, turn.inbound_id, status, detail)
        except StoreError as exc:
            log.error("could not mark a message %s: %s", status, exc, extra={"session": turn.key})
