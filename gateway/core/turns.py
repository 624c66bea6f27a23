"""Running one turn: the agent streams in the run's own task; the lane worker records the outcome.

The run's task can be cancelled at any point; this code never is (hard_cancel only cancels the
run), so every turn ends with a true record: answered, interrupted (with who and why), failed.
A run's task that will not end (it swallows its cancel) is waited for only `cancel_grace_s`
after the cancel: the turn is then recorded as interrupted and the lane moves on.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

from agent_cache import AgentCache, CacheFull
from gateway.core.attachments import note, refusal_sentence, with_placeholders
from gateway.core.cancellation import (
    GATEWAY_RESTART,
    LEASE_LOST,
    NOT_RECORDED,
    SESSION_RESET,
    Guard,
    Run,
    ToolReason,
    current_run,
    still_ours,
    timed_out,
)
from gateway.core.context import HistoryMemo
from gateway.core.fencing import Fence
from gateway.core.live import Reads
from gateway.core.logs import log_context
from gateway.core.messages import ChatRef, InboundMessage
from gateway.core.metrics import Metrics
from gateway.core.ports import (
    UNAVAILABLE_RETRY_S,
    Agent,
    AgentError,
    FencedOut,
    InboundStatus,
    MediaLoader,
    NoticeKind,
    Outlet,
    Reply,
    Store,
    StoreError,
)
from gateway.core.quotas import message_tenant
from gateway.core.settings import CoreSettings
from gateway.core.transcript import (
    ROUND_SEPARATOR,
    AgentEvent,
    ChatMessage,
    Interjection,
    TextDelta,
    ToolCall,
    ToolCallsRequested,
    ToolResult,
    TurnRecorder,
    Usage,
    without_prompt,
)
from gateway.core.turn_options import TurnOptions, options_of

log = logging.getLogger(__name__)


class LiveConversation:
    """What the agent cache holds per session: its current conversation, loaded once from the store,
    and what the provider said about its size."""

    __slots__ = ("conversation", "history", "key", "memo", "prompt_tokens", "token_ratio", "tokens_used")

    def __init__(self, key: str, conversation: int, history: list[ChatMessage]) -> None:
        self.key = key
        self.conversation = conversation
        self.history = history
        self.token_ratio = 1.0  # the provider's count over our estimate (moving average)
        self.prompt_tokens = 0  # the last request's prompt, as the provider counted it
        self.tokens_used = [0, 0]  # prompt and completion tokens of this conversation so far
        self.memo: HistoryMemo | None = None  # made by the first turn that fits the history to a budget

    def observe(self, usage: Usage) -> None:
        """Learn from the provider's count: the estimate is corrected per session."""
        if usage.estimated_prompt > 0 and usage.prompt_tokens > 0:
            ratio = usage.prompt_tokens / usage.estimated_prompt
            self.token_ratio = min(4.0, max(0.25, 0.7 * self.token_ratio + 0.3 * ratio))
        self.prompt_tokens = usage.prompt_tokens
        self.tokens_used[0] += usage.prompt_tokens
        self.tokens_used[1] += usage.completion_tokens


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


class Speaker:
    """A platform outlet bound to one session's ownership: in cluster mode nothing is said for the
    session — notice or reply — once this worker cannot prove it still owns it. The core speaks for
    a session only through one of these."""

    __slots__ = ("guard", "outlet")

    def __init__(self, outlet: Outlet, guard: Guard | None = None) -> None:
        self.outlet = outlet
        self.guard = guard  # None: a single process, which owns every session

    def may_speak(self) -> bool:
        return self.guard is None or self.guard()

    async def may_speak_now(self) -> bool:
        """`may_speak`, asking the lease store when our own clock can no longer tell."""
        return await still_ours(self.guard)

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        if not await self.may_speak_now():
            log.info("not sent (this worker no longer owns the session): %s", text[:60])
            return
        await self.outlet.notify(chat, text, reply_to=reply_to, kind=kind, reason=reason)

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        """The reply checks `run.may_send()` — which includes this guard — before every send."""
        return self.outlet.open_reply(msg, run)


class Turn:
    """One message's turn in its session: its run (the cancellation scope), who speaks for it, and
    what became of its record. A turn of a session reads and writes the session's stored history;
    a stateless turn (`Turn.stateless`) answers with the history its client sent and stores nothing."""

    __slots__ = ("absorbed", "accepted", "client_history", "fence", "fenced_out", "inbound_id", "key", "live", "msg",
                 "notes", "run", "speaker", "started", "steered", "unconfirmed", "usage")

    def __init__(self, msg: InboundMessage, key: str, speaker: Speaker, fence: Fence) -> None:
        self.msg = msg
        self.key = key
        self.speaker = speaker
        self.fence = fence
        self.run = Run(key, guard=speaker.guard, tenant=msg.tenant)
        self.client_history: tuple[ChatMessage, ...] | None = None  # set only by `stateless`
        self.inbound_id: int | None = None
        # Set by `TurnRunner.begin` for a turn that starts as it is accepted: the session's live
        # conversation, and (its number, the user's row) — stored with the inbound record, once
        # the store has taken it (else None again: the row is written when the turn starts).
        self.live: LiveConversation | None = None
        self.started: tuple[int, ChatMessage] | None = None
        # Resolves True once the message is durable (False: duplicate or not stored).
        self.accepted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.steered: list[Turn] = []  # messages sent while this runs (busy "steer"), not yet handed over
        self.absorbed: list[Turn] = []  # those handed to the model: their answer is this turn's
        self.usage = [0, 0]  # prompt and completion tokens the provider counted for this turn
        self.notes: dict[str, str] = {}  # tool call id -> what became of it if the turn stops first
        self.fenced_out = False  # the store refused a write of its record: another worker owns the session
        self.unconfirmed = False  # recorded as answered, its record done once the end is shown

    @classmethod
    def stateless(cls, msg: InboundMessage, key: str, speaker: Speaker, history: Sequence[ChatMessage]) -> Turn:
        """A turn over `history` as the client sent it: nothing is loaded, nothing is stored."""
        turn = cls(msg, key, speaker, Fence.local(key))
        turn.client_history = tuple(history)
        turn.accepted.set_result(True)  # nothing to store: it is accepted as it arrives
        return turn


class _Context:
    """`TurnContext` for one turn: its steered messages and what the session knows of its size."""

    __slots__ = ("_conversation", "_reply", "_turn")

    def __init__(self, turn: Turn, conversation: LiveConversation | None, reply: Reply | None = None) -> None:
        self._turn = turn
        self._conversation = conversation
        self._reply = reply

    def take_interjection(self) -> str | None:
        turn = self._turn
        ready = [t for t in turn.steered if not t.run.is_cancelled() and t.accepted.done() and t.accepted.result()]
        if not ready:
            return None
        turn.steered = [t for t in turn.steered if t not in ready]
        turn.absorbed += ready
        return "\n\n".join(with_placeholders(t.msg.text, t.msg.attachments) for t in ready)

    @property
    def token_ratio(self) -> float:
        return self._conversation.token_ratio if self._conversation is not None else 1.0

    @property
    def history_memo(self) -> HistoryMemo | None:
        conversation = self._conversation
        if conversation is None:  # a stateless turn: its history is new each time
            return None
        if conversation.memo is None:
            conversation.memo = HistoryMemo()
        return conversation.memo

    def note_result(self, call_id: str, text: str) -> None:
        self._turn.notes[call_id] = text

    @property
    def options(self) -> TurnOptions | None:
        return options_of(self._turn.msg)

    @property
    def pace_s(self) -> float:
        return self._reply.pace() if self._reply is not None else 0.0


class TurnRunner:
    """Runs turns to their recorded end. Reads the agent, the turn timeout and the cancel grace from
    the live settings each time (a reload applies to the next turn; a turn keeps its agent)."""

    def __init__(self, *, store: Store, metrics: Metrics, cache: AgentCache[LiveConversation],
                 interruptions: Interruptions, settings: Reads[CoreSettings],
                 check_lease: Callable[[str], None], media: MediaLoader | None = None) -> None:
        self._store = store
        self._media = media
        self._metrics = metrics
        self._cache = cache
        self._interruptions = interruptions
        self._settings = settings
        self._check_lease = check_lease
        self.running: dict[Run, float] = {}  # run -> monotonic start

    async def begin(self, turn: Turn) -> None:
        """A turn that starts as soon as it is accepted (its lane was idle): its start — the user's
        row in the session's live conversation, the record `running` — is written with its
        acceptance, one write instead of two (`Store.accept_inbound(started=...)`). The session is
        made live first (its history read, as the start would); if it cannot be, the turn's start
        says why, as before."""
        if turn.client_history is not None:
            return
        try:
            live = await self._session_agent(turn)
        except (CacheFull, StoreError):
            return
        if turn.run.is_cancelled():  # stopped meanwhile: it never runs, and a /new made what was read old
            if turn.run.reason == SESSION_RESET:
                self._cache.discard(turn.key)
            return
        turn.live = live
        turn.started = (live.conversation, user_row(turn.msg))

    async def watch_timeouts(self) -> None:
        """Stop turns that outlive `turn_timeout_s` (one sweep for all, instead of a timer each)."""
        while True:
            timeout = self._settings.value.router.turn_timeout_s
            await asyncio.sleep(min(1.0, timeout / 5))
            cutoff = time.monotonic() - timeout
            for run, started in list(self.running.items()):
                if started <= cutoff:
                    run.cancel(timed_out(timeout))

    async def execute(self, turn: Turn) -> None:
        """Run one turn to its end. The agent streams in a task of its own (the run's task);
        this lane worker is never cancelled by hard_cancel, so it always records the outcome — and
        it settles the turn's reply in a `finally`, whatever happened: exactly once."""
        if not await turn.accepted:
            return  # never acknowledged: the intake has already answered the platform
        reply = SettlingReply(turn)
        problem: str | None = None
        try:
            problem = await self._execute(turn, reply)
        finally:
            await self.settle(turn, reply, problem)

    async def settle(self, turn: Turn, reply: SettlingReply | None = None, problem: str | None = None) -> None:
        """End the turn's reply: the stop (or failure) if nothing ended it, then `settled`. Also for a
        turn that never ran (the router calls this for queued turns at shutdown)."""
        reply = reply or SettlingReply(turn)
        if reply.settled_once:
            return
        reply.settled_once = True
        try:
            if not reply.ended:
                reason = turn.run.reason
                if reason is not None:
                    await reply.interrupted(reason)
                else:
                    await reply.failed("Something went wrong on our side; it has been logged.")
            await reply.settled(problem)
        except Exception:
            log.exception("the platform failed after a turn ended", extra={"session": turn.key})

    async def leave_queued(self, turn: Turn, reason: ToolReason) -> asyncio.Future[None] | None:
        """A turn still queued when the gateway stops: it stays accepted in the store (the next
        start replays it) and its reply ends now — once its intake has stored it, so a task to
        wait for is returned while that is under way."""
        turn.run.cancel(reason)
        storing = None
        if not turn.accepted.done():
            storing = asyncio.ensure_future(self._settle_once_stored(turn))
        elif turn.accepted.result():
            await self.settle(turn)
        turn.run.end()
        return storing

    async def _settle_once_stored(self, turn: Turn) -> None:
        if await turn.accepted:
            await self.settle(turn)

    async def _execute(self, turn: Turn, reply: SettlingReply) -> str | None:
        """The turn's life; returns what the user must be told if its outcome could not be saved."""
        opened = await self._open(turn, reply)
        if opened is None:
            return None  # it could not start: the user was told why
        agent, user = opened
        run = turn.run
        if run.reason == LEASE_LOST:  # the new owner replays it: leave the store alone
            return None
        if run.is_cancelled():  # stopped while queued or starting: it never runs
            return await self._never_ran(turn, agent, user)
        conversation = turn.started[0] if turn.started else agent.conversation if agent else 0
        if agent is not None and turn.started is None and not await self._persist(
                turn, agent, conversation, [user], remember=False, status=(InboundStatus.RUNNING, None)):
            await reply.failed("Sorry, I could not save your message (storage error). Please send it again.",
                               retry_after_s=UNAVAILABLE_RETRY_S)
            return None
        recorder = TurnRecorder()
        task = await self._run_agent(turn, agent, user, reply, recorder)
        return await self._conclude(turn, task, (agent, conversation, user), recorder, reply)

    async def _conclude(self, turn: Turn, task: asyncio.Task[None],
                        where: tuple[LiveConversation | None, int, ChatMessage], recorder: TurnRecorder,
                        reply: SettlingReply) -> str | None:
        """Record the outcome in the conversation the turn started in (`where`: a /new meanwhile
        does not move it), then show the answer's end — or, if it could not be recorded, say so."""
        agent, conversation, user = where
        rows, status, detail = await self._outcome(task, turn.run, recorder, reply, turn.notes)
        self._metrics.turns.labels(status.value).inc()
        if turn.usage[0] and log.isEnabledFor(logging.DEBUG):  # per tenant in metrics; a line per turn costs
            log.debug("turn used %d prompt and %d completion tokens", *turn.usage, extra={"session": turn.key})
        recorded = await self._record(turn, agent, conversation, user, rows, status, detail)
        if status is InboundStatus.DONE:
            # Shown whole means recorded: an answer whose record never landed is cut, with the
            # reason, so no client takes it for a complete (and remembered) one.
            await (self._show_end(turn, reply, recorder.final_text) if recorded else reply.interrupted(NOT_RECORDED))
            if recorded and turn.unconfirmed and not turn.fenced_out:
                await self._confirm_shown(turn, reply)
        joined = True
        for absorbed in turn.absorbed:  # messages handed to this turn are answered by it
            joined = await self._finish(absorbed, status, f"answered with message {turn.msg.message_id}") and joined
        told = not recorded and status is InboundStatus.DONE  # the interruption says it already
        return None if (recorded or told) and joined else UNSAVED

    async def _open(self, turn: Turn, reply: SettlingReply) -> tuple[LiveConversation | None, ChatMessage] | None:
        """The session's live conversation (None for a stateless turn) and the user's row; None if
        the turn cannot start (no agent slot, the store down), after telling the user."""
        try:
            agent = turn.live or (await self._session_agent(turn) if turn.client_history is None else None)
        except (CacheFull, StoreError) as exc:
            log.warning("cannot start a turn: %s", exc, extra={"session": turn.key})
            await self._finish(turn, InboundStatus.REJECTED, str(exc))
            self._metrics.turns.labels("rejected").inc()
            await reply.failed("I'm at capacity right now (every agent slot is busy). Please try again shortly."
                               if isinstance(exc, CacheFull) else
                               "Sorry, I could not load this conversation (storage error). Please try again "
                               "shortly.", retry_after_s=UNAVAILABLE_RETRY_S)
            return None
        return agent, turn.started[1] if turn.started else user_row(turn.msg)

    async def _never_ran(self, turn: Turn, agent: LiveConversation | None, user: ChatMessage) -> str | None:
        """Record a turn stopped before it started: the user's row and the interruption."""
        run = turn.run
        assert run.reason is not None
        self._count_cancel(turn.key, run)
        rows = TurnRecorder().interrupted(run.reason)
        if agent is not None and turn.started is not None:  # its row is stored: closed where it is
            saved = await self._persist(turn, agent, turn.started[0], rows, prepend=user,
                                        status=(InboundStatus.CANCELLED, run.reason.marker))
        elif agent is not None and run.reason != SESSION_RESET:
            saved = await self._persist(turn, agent, agent.conversation, [user, *rows],
                                        status=(InboundStatus.CANCELLED, run.reason.marker))
        else:
            saved = await self._finish(turn, InboundStatus.CANCELLED, run.reason.marker)
        return None if saved else UNSAVED

    async def _run_agent(self, turn: Turn, agent: LiveConversation | None, user: ChatMessage,
                         reply: SettlingReply, recorder: TurnRecorder) -> asyncio.Task[None]:
        """Stream the agent in the run's own task (its context names the run, copied into threads)
        and wait for that task to end; returns it, ended or abandoned."""
        run = turn.run
        history = list(agent.history) if agent is not None else list(turn.client_history or ())
        reply.open()
        ctx = contextvars.copy_context()
        ctx.run(current_run.set, run)
        ctx.run(log_context.set, {"session": turn.key, "platform": turn.msg.platform, "run": run.run_id})
        settings = self._settings.value
        stream = self._stream(turn, settings.agent, history, user, reply, recorder, _Context(turn, agent, reply))
        task = asyncio.get_running_loop().create_task(stream, context=ctx)
        run.attach(task)  # a cancel that landed during the awaits before cancels it right here
        self.running[run] = time.monotonic()  # watched by `watch_timeouts`
        self._cache.mark_running(turn.key, True)
        self._metrics.turns_running.inc()
        try:
            # Until the task ends, or `cancel_grace_s` after a cancel it swallows (it is then left
            # behind, still being cancelled, its output held back). A cancel of this lane worker
            # itself (forced shutdown) propagates.
            await run.join(settings.cancel_grace_s)
        finally:
            self.running.pop(run, None)
            self._cache.mark_running(turn.key, False)
            self._metrics.turns_running.dec()
        return task

    async def _record(self, turn: Turn, agent: LiveConversation | None, conversation: int, user: ChatMessage,
                      rows: list[ChatMessage], status: InboundStatus, detail: str | None) -> bool:
        """Store the outcome; False if it could not be saved."""
        run = turn.run
        if run.reason == LEASE_LOST:  # fenced out: the new owner closes this turn's record
            self._count_cancel(turn.key, run)
            return True
        if status is InboundStatus.CANCELLED:
            self._count_cancel(turn.key, run)
            if run.reason == GATEWAY_RESTART:
                status = InboundStatus.RESTART  # resumed on the next start
        if agent is not None:
            if status is InboundStatus.DONE and turn.speaker.outlet.answers_later:
                # Recorded, but done only once its end has reached the chat (`_confirm_shown`): a
                # crash in between leaves it open, with its answer, and recovery shows it again.
                turn.unconfirmed = True
                status, detail = InboundStatus.RUNNING, UNCONFIRMED
            return await self._persist(turn, agent, conversation, rows, prepend=user, status=(status, detail))
        return await self._finish(turn, status, detail)

    async def _confirm_shown(self, turn: Turn, reply: SettlingReply) -> None:
        """The answer's end reached the chat: its message is done."""
        try:
            async with asyncio.timeout(SHOWN_WAIT_S):  # (not wait_for: no task of its own per message)
                shown = await reply.delivered()
        except TimeoutError:
            shown = False
        if shown:
            await self._finish(turn, InboundStatus.DONE, None)
        else:  # left open: if the session is recovered (a restart, a takeover), the answer is shown again
            log.warning("the end of an answer was not confirmed shown", extra={"session": turn.key})

    async def _show_end(self, turn: Turn, reply: SettlingReply, text: str) -> None:
        """The answer's end, shown once the turn is recorded. Not if the store refused the record
        (fenced out): the session's new owner records the turn as cut off and answers it again, so
        the chat must not have seen it whole."""
        if turn.fenced_out:
            await reply.interrupted(LEASE_LOST)  # the guard keeps chats quiet; an HTTP client hears it here
            return
        await turn.run.may_send_now()  # after a pause the lease store decides, not our own clock
        await reply.finish(text)  # each platform's reply checks the run's guard itself

    async def _stream(self, turn: Turn, agent: Agent, history: list[ChatMessage], user: ChatMessage,
                      reply: SettlingReply, recorder: TurnRecorder, context: _Context) -> None:
        run = turn.run
        if any(a.refused is None for a in turn.msg.attachments):
            user = await self._with_media(turn, user)
        events = agent.run_turn(history, user, context)
        if user.kind != "message":  # the gateway's own words: never shown to the user, whatever the agent
            events = without_prompt(events, user.content)
        try:
            async for event in events:
                if isinstance(event, Usage):
                    self._usage(turn, context, event)
                    continue
                if not isinstance(event, TextDelta) and not await run.may_send_now():
                    # A boundary (tool calls asked for, a tool's result, a steered message): a run that
                    # was stopped, or whose lease is gone (it was paused), takes no further step — not
                    # one more tool, not one more provider request. The cancel lands at the sleep.
                    self._may_send(run)  # a lease our clock cannot prove is dropped: cancelled LEASE_LOST
                    await asyncio.sleep(0)
                separate = isinstance(event, Interjection) and recorder.has_text
                recorder.feed(event)
                if isinstance(event, TextDelta):
                    if self._may_send(run):
                        await reply.delta(event.text)
                elif self._may_send(run):
                    await reply.release()  # a boundary: the text so far is not the answer's end
                    if separate:  # the continuation starts below the answer so far
                        await reply.delta(ROUND_SEPARATOR)
                    await reply.show_tools(event)
        finally:
            # A stop that lands out here (not inside the agent) leaves it at a yield: it is closed now,
            # in this task, so its provider response and tool tasks end with the run, not with the GC.
            if isinstance(events, AsyncGenerator):
                await events.aclose()
        # The answer's end is shown by the lane worker once the turn is recorded (SettlingReply).

    async def _with_media(self, turn: Turn, user: ChatMessage) -> ChatMessage:
        """The user's message with its images and files, fetched now — in the run's task, so a stop
        or the turn's timeout cancels a slow download. One that fails is a note to the model, and
        the user is told why."""
        msg = turn.msg
        taken = [a for a in msg.attachments if a.refused is None]
        if self._media is None:
            parts = tuple(note(a, "files cannot be fetched here") for a in taken)
        else:
            parts = await self._media.load(msg.platform, taken, keep=turn.client_history is None)
        failed = [dataclasses.replace(p.attachment, refused=p.problem) for p in parts if p.kind == "note"]
        if failed and (sentence := refusal_sentence(failed)) is not None and turn.speaker.may_speak():
            log.info("attachments not read: %s", sentence, extra={"session": turn.key})
            await turn.speaker.notify(msg.chat, sentence, reply_to=msg.reply_target)
        return dataclasses.replace(user, media=parts)

    def _usage(self, turn: Turn, context: _Context, usage: Usage) -> None:
        turn.usage[0] += usage.prompt_tokens
        turn.usage[1] += usage.completion_tokens
        if context._conversation is not None:
            context._conversation.observe(usage)
        tenant = turn.msg.tenant or "-"
        self._metrics.tokens.labels("prompt", tenant).inc(usage.prompt_tokens)
        self._metrics.tokens.labels("completion", tenant).inc(usage.completion_tokens)

    def _may_send(self, run: Run) -> bool:
        if run.may_send():
            return True
        if not run.is_cancelled():
            self._check_lease(run.session_key)  # the lease lapsed unnoticed (a pause): drop it now
        return False

    async def _outcome(self, task: asyncio.Task[None], run: Run, recorder: TurnRecorder,
                       reply: Reply, notes: dict[str, str]) -> tuple[list[ChatMessage], InboundStatus, str | None]:
        # Cancelled — or stopped so late that the task still returned: its output was held back
        # from the chat by then (Run.may_send), so the record says interrupted either way.
        if task.cancelled() or run.reason is not None:
            if task.done() and not task.cancelled():
                task.exception()  # what the stop made of its I/O (a closed provider socket): not an error
            if run.reason is None:  # only Run.cancel holds the task, so this is a bug: say so
                log.error("turn task cancelled without a tool_reason")
                return recorder.failed("cancelled without a reason"), InboundStatus.FAILED, "no reason"
            await reply.interrupted(run.reason)
            rows = recorder.interrupted(run.reason, reply.shown_text(), notes=notes)
            return rows, InboundStatus.CANCELLED, run.reason.marker
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

    async def _session_agent(self, turn: Turn) -> LiveConversation:
        key = turn.key
        agent = self._cache.get(key)
        if agent is None:
            conversation, history = await self._store.conversation(key)
            agent = self._cache.get(key)
            if agent is None:
                agent = LiveConversation(key, conversation, history)
                self._cache.put(key, agent, message_tenant(turn.msg))  # grouped by tenant: see AgentCache
        return agent

    async def _persist(self, turn: Turn, agent: LiveConversation, conversation: int, rows: list[ChatMessage],
                       *, status: tuple[InboundStatus, str | None], prepend: ChatMessage | None = None,
                       remember: bool = True) -> bool:
        """Write rows to the turn's own conversation (a /new meanwhile does not move them), and the
        inbound message's new status in the same transaction. False if it could not be saved."""
        inbound = (turn.inbound_id, *status) if turn.inbound_id is not None else None
        if not await self._write(turn, "transcript", lambda: self._store.append(turn.fence, conversation, rows,
                                                                                inbound=inbound)):
            return False
        if remember and agent.conversation == conversation:
            agent.history.extend([prepend, *rows] if prepend else rows)
        return True

    async def _finish(self, turn: Turn, status: InboundStatus, detail: str | None) -> bool:
        if turn.inbound_id is None:
            return True
        inbound_id = turn.inbound_id
        return await self._write(turn, f"{status.value} mark",
                                 lambda: self._store.finish_inbound(turn.fence, inbound_id, status, detail))

    async def _write(self, turn: Turn, what: str, write: Callable[[], Awaitable[object]]) -> bool:
        """A write the turn's record needs, retried through a short store outage (a Redis restart).
        Retried even once our own clock can no longer prove the lease (it lapses during an outage):
        the write is fenced, so the store alone decides — it lands if the lease is still ours there,
        and is refused (FencedOut) once another worker holds it. False, and said loudly in the log,
        if it never lands."""
        deadline = time.monotonic() + WRITE_RETRY_S
        delay = 0.05
        while True:
            try:
                await write()
                return True
            except FencedOut as exc:  # not ours any more: its new owner closes the record
                log.warning("not storing a turn's %s: %s", what, exc, extra={"session": turn.key})
                turn.fenced_out = True
                return True
            except StoreError as exc:
                if time.monotonic() + delay > deadline:
                    log.error("could not store a turn's %s: %s", what, exc, extra={"session": turn.key})
                    return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)  # soon after the store is back: before the lease's TTL runs out


def user_row(msg: InboundMessage) -> ChatMessage:
    """The transcript's row for a user's message (its attachments as placeholders)."""
    return ChatMessage("user", with_placeholders(msg.text, msg.attachments), created_at=msg.timestamp)


UNSAVED = "This answer could not be saved (storage error), so the conversation may not remember it."
UNCONFIRMED = "answered; its end not yet confirmed shown"  # the detail of a record in that state
SHOWN_WAIT_S = 30.0  # how long the lane waits for an answer's end to reach the chat before moving on
WRITE_RETRY_S = 10.0


class SettlingReply(Reply):
    """The platform's reply for one turn, opened on first use, that knows whether it has been ended
    (finish, interrupted or failed) — so the turn's owner can settle it exactly once.

    It holds back the last word of what it has been given until more comes, a tool boundary
    (`release`) or `finish`: the end of an answer reaches the chat only once the turn is recorded,
    so an answer shown whole is never also taken over (and answered again) by another worker. Only
    the last word (at most `HOLD_CHARS` characters) is held: a delta may be a whole edit interval's
    worth of text (a stream read at the chat's pace), and the chat must not show it an interval late."""

    HOLD_CHARS = 32

    __slots__ = ("_given", "_held", "_inner", "_turn", "ended", "settled_once")

    def __init__(self, turn: Turn) -> None:
        self._turn = turn
        self._inner: Reply | None = None
        self._held = ""
        self._given: list[str] = []  # what went to the platform's reply, for `shown_text`
        self.ended = False
        self.settled_once = False

    def open(self) -> Reply:
        if self._inner is None:
            self._inner = self._turn.speaker.open_reply(self._turn.msg, self._turn.run)
        return self._inner

    async def delta(self, text: str) -> None:
        if not text:
            return
        text = self._held + text
        cut = _last_word(text, self.HOLD_CHARS)
        self._held = text[cut:]
        if cut:
            self._given.append(text[:cut])
            await self.open().delta(text[:cut])

    async def release(self) -> None:
        """Show the held delta: the answer goes on (a tool runs), so it is not the answer's end."""
        held, self._held = self._held, ""
        if held:
            self._given.append(held)
            await self.open().delta(held)

    async def finish(self, text: str) -> None:
        self.ended = True
        await self.release()
        await self.open().finish(text)

    async def interrupted(self, reason: ToolReason) -> None:
        self.ended = True
        self._held = ""
        await self.open().interrupted(reason)

    async def failed(self, text: str, *, retry_after_s: float | None = None) -> None:
        self.ended = True
        self._held = ""
        await self.open().failed(text, retry_after_s=retry_after_s)

    async def show_tools(self, event: AgentEvent) -> None:
        """Tool calls starting (the agent runs them once this returns) or one returning: progress."""
        if isinstance(event, ToolCallsRequested):
            for call in event.calls:
                await self.open().tool_started(call)
        elif isinstance(event, ToolResult):
            await self.open().tool_ended(event.call_id, event.content)

    async def tool_started(self, call: ToolCall) -> None:
        await self.open().tool_started(call)

    async def tool_ended(self, call_id: str, result: str) -> None:
        await self.open().tool_ended(call_id, result)

    async def settled(self, problem: str | None = None) -> None:
        await self.open().settled(problem)

    async def delivered(self) -> bool:
        return await self.open().delivered()

    def pace(self) -> float:
        return self.open().pace()

    def shown_text(self) -> str | None:
        if self._inner is None:
            return ""
        shown = self._inner.shown_text()
        return "".join(self._given) if shown is None and self._held else shown


def _last_word(text: str, most: int) -> int:
    """Where the last word of `text` (with the blanks after it) begins, but no more than `most`
    characters from its end; 0 for text that is blank or one short word."""
    body = text.rstrip()
    start = max(len(body) - most, 0)
    i = len(body)
    while i > start and not body[i - 1].isspace():
        i -= 1
    return i
