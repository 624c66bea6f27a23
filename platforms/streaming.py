"""The streaming engine: a run's token stream becomes throttled edits of one message, split into
parts when it grows past the platform's limit.

Every call goes through the adapter's outbox (`platforms/outbox.py`): intermediate states queue
as STREAM jobs, which the reply withdraws when it ends; final states and stop marks queue as
URGENT jobs, ahead of anything else waiting for the chat. Nothing is dropped silently on the way
out: a refused part is resent as plain text (by the adapter), then split smaller; a deleted
message is continued in a new one; a part that still cannot be sent is replaced by a notice.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from gateway.core.cancellation import Run, ToolReason, still_ours, stop_notice
from gateway.core.messages import Capabilities, ChatRef
from gateway.core.ports import NoticeKind, Reply
from gateway.core.transcript import ToolCall
from platforms.errors import MessageGone, OutboundError, RateLimited, Refused, explain
from platforms.outbox import Job, Outbox, Priority, Withdrawn
from platforms.pacing import ReplyPacer
from platforms.reply_parts import Change, ReplyParts, ShownMessage, change_for
from platforms.splitting import Part
from platforms.stop_button import StopButton
from platforms.tool_progress import ToolProgress

log = logging.getLogger(__name__)

UNDELIVERED = "⚠️ part of this answer could not be delivered: {reason}"


class ReplyPlatform(Protocol):
    """What the streaming engine needs of a platform: its outbox, how it counts length, and the
    outbound calls its outbox jobs make. `platforms.base.Adapter` is one; the engine depends on
    this much of it only (and never imports it)."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def outbox(self) -> Outbox: ...

    def outbox_key(self, chat: ChatRef) -> str: ...

    def measure(self, text: str) -> int: ...

    def measure_bound(self) -> Callable[[str], int] | None: ...

    def count(self, kind: str) -> None: ...

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str: ...

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None: ...

    async def send_part(self, chat: ChatRef, text: str, *, reply_to: str | None, stop: str | None) -> str: ...

    async def edit_part(self, chat: ChatRef, message_id: str, text: str, *, stop: str | None) -> None: ...

    async def typing(self, chat: ChatRef) -> None: ...

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None: ...


class EditStreamReply(Reply):
    """Streams by editing one message at most every `edit_interval_s`; splits long answers.

    Its pacer (`platforms/pacing.py`) coalesces deltas, so a slow platform skips intermediate
    states rather than slowing the agent; unchanged text is never re-sent; the final text is
    always sent. Its parts (`platforms/reply_parts.py`) are measured as the platform counts them
    (`ReplyPlatform.measure`).
    """

    TYPING_AFTER_S = 0.2
    FINAL_ATTEMPTS = 10  # a final state is retried through this many 429s
    SETTLE_S = 2.0  # how long finish/failed/interrupted wait for delivery; it carries on after
    MIN_LIMIT = 256  # refused parts are split down to this size before they are given up
    MAX_LOSS_NOTICES = 3
    STATUS_LINE = True  # running tool calls show as a line below the text (the web chat has rows instead)

    def __init__(self, adapter: ReplyPlatform, chat: ChatRef, run: Run, *, reply_to: str | None,
                 stop: StopButton | None = None) -> None:
        self._adapter = adapter
        self._button = stop
        self._stop = stop.data if stop is not None else None  # while it streams, its messages show this button
        self._chat = chat
        self._run = run
        self._reply_to = reply_to
        self._caps = adapter.capabilities
        self._outbox = adapter.outbox
        self._key = adapter.outbox_key(chat)
        self._parts = ReplyParts(self._caps.max_message_len, adapter.measure, adapter.measure_bound(),
                                 min_limit=self.MIN_LIMIT)
        self._pacer = ReplyPacer(adapter, chat, run)
        self._sent_any = False
        self._dead: str | None = None  # the chat refuses everything we send: why
        self._losses = 0
        self._jobs: list[Job[None]] = []
        self._final: asyncio.Task[None] | None = None  # delivery of the final state or stop mark
        self._final_shown = False  # the final state reached the chat
        self._ended = False
        self._notice_shown = False
        self._after_stop = False  # sending what a stopped turn showed: the run's cancel does not hold it back
        self._progress = ToolProgress()  # tool calls running: a status line below the text
        # Typing starts after a moment, so a quick answer costs no extra call.
        self._pacer.after(self.TYPING_AFTER_S, self._start_indicator)

    # --- the Reply port -------------------------------------------------------------------

    async def delta(self, text: str) -> None:
        if self._ended or not self._run.may_send():
            return
        self._parts.text += text
        if self._caps.can_edit and self._caps.can_stream:
            self._pacer.wake(self._render_intermediate, self.pace)

    async def finish(self, text: str) -> None:
        if self._ended or not self._run.may_send():
            return
        await self._end()
        self._parts.text = self._parts.final(text)
        await self._settle(self._deliver_final())

    async def tool_started(self, call: ToolCall) -> None:
        if self._ended or not self._run.may_send():
            return
        self._progress.start(call)
        self._show_progress()

    async def tool_ended(self, call_id: str, result: str) -> None:
        if self._progress.end(call_id) is not None and not self._ended:
            self._show_progress()

    async def interrupted(self, reason: ToolReason) -> None:
        if self._notice_shown:
            return
        self._notice_shown = True
        cut = self._progress.cut_short(reason)  # before `_end` forgets the calls
        await self._end()  # what the chat shows is settled from here on
        if not await still_ours(self._run.guard):
            return  # the session belongs to another worker now: it speaks for it
        notice = stop_notice(reason)
        target = self._parts.last()
        if target is not None and not target.body.strip() and cut:  # it showed a tool running, no text yet
            notice = cut  # what became of the tool says how the turn ended
        if target is not None and not target.gone and self._caps.can_edit:
            await self._settle(self._mark(target, notice, reason))
        elif reason.kind == "system":
            # Nothing visible to mark, and the user did not ask for this: say so.
            await self._settle(self._adapter.notify(self._chat, notice, reply_to=self._reply_to,
                                                    kind=NoticeKind.INTERRUPTED, reason=reason))

    async def failed(self, text: str, *, retry_after_s: float | None = None) -> None:
        if self._ended or not await self._run.may_send_now():
            return
        await self._end()
        shown = self._parts.text
        self._parts.text = f"{shown}\n\n⚠️ {text}" if shown.strip() else f"⚠️ {text}"
        await self._settle(self._deliver_final())

    async def settled(self, problem: str | None = None) -> None:
        if self._button is not None:
            self._button.close()  # the answer has settled: its button stops nothing any more
        if problem and await still_ours(self._run.guard):
            await self._adapter.notify(self._chat, f"⚠️ {problem}", reply_to=self._reply_to, kind=NoticeKind.ERROR)

    def shown_text(self) -> str | None:
        """The reply's text up to what its messages show (deleted ones included: they were seen)."""
        return self._parts.shown()

    # --- ending ---------------------------------------------------------------------------

    async def _end(self) -> None:
        """Stop streaming: withdraw queued intermediate states, let a call on the wire land (so
        what the chat shows is known), and stop typing and the status line."""
        self._ended = True
        await self._progress.close()
        final = self._final if self._final is not None and not self._final.done() else None
        if final is not None:
            final.cancel()
        await self._pacer.stop()
        if final is not None:
            await asyncio.wait({final})  # (not `await final`: see `ReplyPacer.stop`)
        self._outbox.withdraw(self._key, self)  # queued edits: never sent now
        for job in self._jobs:
            if job.running:
                await job.landed()
        self._jobs = []

    async def _settle(self, delivery: Coroutine[Any, Any, None]) -> None:
        """Deliver in the background; wait for it only so long (a 429 must not hold up the turn)."""
        self._final = task = self._outbox.adopt(delivery)
        await asyncio.wait({task}, timeout=self.SETTLE_S)

    async def delivered(self, within_s: float | None = None) -> bool:
        """Wait (up to `within_s`, or as long as it takes) until the final state or stop mark has
        been delivered; whether the final state was."""
        final = self._final
        if final is not None and not final.done():
            await asyncio.wait({final}, timeout=within_s)  # (not `await final`: its cancel is not ours)
        return self._final_shown

    async def _deliver_final(self) -> None:
        try:
            await self._render(final=True)
            self._final_shown = True
        except RateLimited:
            log.warning("%s: gave up on the final text of a reply in chat %s: still rate limited",
                        self._adapter.name, self._chat.chat_id)
        except Exception:
            log.exception("%s: delivering the final text of a reply failed", self._adapter.name)
        await self._strip_buttons()

    async def _strip_buttons(self) -> None:
        """The turn is over: no message of it keeps a Stop button (the final render removed the
        window's; this catches messages frozen earlier, and any left by a failed edit)."""
        for message in self._parts.messages():
            if message.stop is None or message.gone:
                continue

            async def call(m: ShownMessage = message) -> None:
                await self._adapter.edit_part(self._chat, m.mid, m.text, stop=None)
                m.stop = None

            job: Job[None] = self._outbox.put(self._key, call, priority=Priority.URGENT, kind="edit",
                                              attempts=self.FINAL_ATTEMPTS, owner=self)
            try:
                await job.wait()
            except MessageGone:
                message.gone = True
            except Exception as exc:
                log.info("%s: could not remove a Stop button in chat %s: %s", self._adapter.name,
                         self._chat.chat_id, exc)

    async def _mark(self, target: ShownMessage, notice: str, reason: ToolReason) -> None:
        """Mark the last message stopped (the notice goes in a message of its own if it does not
        fit, or if the message has been deleted meanwhile)."""
        body = target.body  # a status line it showed goes: the mark says how the turn ended
        marked = f"{body}\n\n{notice}" if body.strip() else notice

        async def call() -> None:
            if not await still_ours(self._run.guard):  # decided when it runs: a pause may fall in its wait
                return
            if self._adapter.measure(marked) <= self._caps.max_message_len:
                try:
                    await self._edit_marked(target.mid, marked, body, reason)
                    target.stop = None  # an edit without a button removes it
                    self._adapter.count("edit")
                    return
                except (MessageGone, Refused) as exc:
                    log.info("%s: could not mark a reply stopped (%s); saying so below", self._adapter.name,
                             explain(exc))
            await self._adapter.send(self._chat, notice)
            self._adapter.count("send")

        job: Job[None] = self._outbox.put(self._key, call, priority=Priority.URGENT, kind="edit",
                                          attempts=self.FINAL_ATTEMPTS, owner=self)
        try:
            await job.wait()
        except (OutboundError, RateLimited) as exc:
            log.warning("%s: could not mark a reply stopped: %s", self._adapter.name, explain(exc))
        await self._strip_buttons()

    async def _edit_marked(self, message_id: str, text: str, body: str, reason: ToolReason) -> None:
        """Edit a message to `text`: its `body` with the stop notice for `reason` appended."""
        await self._adapter.edit(self._chat, message_id, text)

    # --- streaming ------------------------------------------------------------------------

    def _start_indicator(self) -> None:
        if not self._ended and not self._sent_any:
            self._pacer.indicate(self._indicator())

    def _indicator(self) -> Coroutine[Any, Any, None]:
        """What shows the answer is coming until its first message: typing."""
        return self._pacer.keep_typing(lambda: self._sent_any)

    def pace(self) -> float:
        """The least time between two intermediate states (text arriving faster is shown joined)."""
        return self._caps.edit_interval_s

    async def _render_intermediate(self) -> None:
        await self._render(final=False)

    # --- tool progress --------------------------------------------------------------------

    def _show_progress(self) -> None:
        """Show the status line now, and keep its elapsed time current while a call runs."""
        if not (self.STATUS_LINE and self._caps.can_edit and self._caps.can_stream):
            return  # the final text only (or rows of their own): no status line
        wake = functools.partial(self._pacer.wake, self._render_intermediate, self.pace)
        wake()
        self._progress.keep_current(wake, self.pace)

    # --- rendering ------------------------------------------------------------------------

    async def _render(self, *, final: bool) -> None:
        """Bring the chat up to date with the text: edit the parts that changed, send new ones."""
        while self._dead is None:
            at, part = 0, None
            status = self._progress.line(has_text=bool(self._parts.text.strip())) if self.STATUS_LINE else ""
            status = "" if final else status
            try:
                for at, (part, shown) in enumerate(self._parts.with_status(status)):
                    await self._put(at, shown, part.end, final=final, status=shown[len(part.text):])
                    await asyncio.sleep(0)  # measuring a long answer's parts must not hold up the loop
                return
            except Withdrawn:
                return
            except MessageGone:
                log.info("%s: a reply's message in chat %s was deleted; continuing in a new message",
                         self._adapter.name, self._chat.chat_id)
                self._parts.deleted(at)
            except Refused as exc:
                assert part is not None
                self._refused(part, at, str(exc))
            except OutboundError as exc:  # about the chat (blocked, no rights…): nothing more will get through
                self._dead = str(exc)
                log.warning("%s: %s failed: %s (chat %s; the rest of this reply is not sent)", self._adapter.name,
                            "edit" if self._parts.message(at) is not None else "send", exc, self._chat.chat_id)

    async def _put(self, index: int, text: str, end: int, *, final: bool, status: str = "") -> None:
        """Bring message `index` to `text` (its last `status` characters a status line)."""
        stop = None if final else self._stop
        shown = self._parts.message(index)
        change = change_for(shown, text, stop, can_edit=self._caps.can_edit)
        if change is Change.SAME:
            assert shown is not None
            shown.end = end  # (a button still shown at the end goes in `_strip_buttons`)
            return
        if change is Change.STUCK:
            return
        job: Job[None] = self._outbox.put(
            self._key, lambda: self._call(index, text, end, stop, status), kind=change.value, owner=self,
            priority=Priority.URGENT if final else Priority.STREAM, attempts=self.FINAL_ATTEMPTS if final else 1)
        self._jobs = [j for j in self._jobs if not j.done]
        self._jobs.append(job)
        await job.wait()

    async def _call(self, index: int, text: str, end: int, stop: str | None = None, status: str = "") -> None:
        """One send or edit, made by the chat's outbox worker (so its outcome is recorded even if
        the reply stops waiting for it). Where our own clock cannot prove the lease any more (a
        pause just ended), the lease store decides: not sent only if the session is not ours."""
        # After a stop the run's cancel does not hold back what it showed, but ownership still does.
        allowed = still_ours(self._run.guard) if self._after_stop else self._run.may_send_now()
        if not await allowed:
            return
        message = self._parts.message(index)
        if message is not None:
            await self._adapter.edit_part(self._chat, message.mid, text, stop=stop)
            message.text, message.end, message.stop, message.status = text, end, stop, status
            self._adapter.count("edit")
        else:
            mid = await self._adapter.send_part(self._chat, text, stop=stop,
                                                reply_to=None if self._sent_any else self._reply_to)
            self._sent_any = True
            self._parts.add(ShownMessage(mid, text, end, stop=stop, status=status))
            self._adapter.count("send")

    def _refused(self, part: Part, index: int, reason: str) -> None:
        """The platform refused a part even as plain text: split it smaller, and at the smallest
        size give it up — with a notice in the chat and the reason in the log."""
        if self._parts.split_smaller(part, index):
            log.info("%s: a part of %d was refused (%s); splitting at %d", self._adapter.name,
                     self._adapter.measure(part.text), reason, self._parts.limit)
            return
        log.warning("%s: part of an answer could not be delivered to chat %s: %s", self._adapter.name,
                    self._chat.chat_id, reason)
        if self._losses < self.MAX_LOSS_NOTICES:
            self._losses += 1
            self._outbox.adopt(self._adapter.notify(self._chat, UNDELIVERED.format(reason=reason),
                                                    kind=NoticeKind.ERROR))
        self._parts.give_up(part, index)
