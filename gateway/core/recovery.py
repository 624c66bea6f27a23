"""After a restart or a takeover: replay messages that were accepted but never started, and resume
turns that a restart (or a crash) cut off — once each, and only while they are fresh."""

from __future__ import annotations

import itertools
import logging
import time

from gateway.core.attachments import with_placeholders
from gateway.core.cancellation import GATEWAY_RESTART, PROCESS_DIED, TAKEN_OVER, Run, ToolReason, stop_notice
from gateway.core.fencing import Fence
from gateway.core.intake.dedupe import RecentMessages
from gateway.core.intake.ownership import Owners
from gateway.core.live import Reads
from gateway.core.messages import InboundMessage
from gateway.core.outage import OutageLog
from gateway.core.ports import InboundRecord, InboundStatus, NoticeKind, Outlet, Outlets, Store, StoreError
from gateway.core.sessions.queue import TurnQueue
from gateway.core.settings import CoreSettings
from gateway.core.transcript import RESUME_PREFIX, ChatMessage, TurnRecorder, resume_prompt

log = logging.getLogger(__name__)


class Recovery:
    """Takes what it needs: the store's open records, ownership (a fence to write with, a speaker
    to tell the chat), the queue to put turns back in, and the recent-message window (a replayed
    message must not get in a second time through a platform's redelivery)."""

    def __init__(self, *, store: Store, outlets: Outlets, owners: Owners, queue: TurnQueue,
                 recent: RecentMessages, settings: Reads[CoreSettings]) -> None:
        self._store = store
        self._outlets = outlets
        self._owners = owners
        self._queue = queue
        self._recent = recent
        self._settings = settings
        # Adoption is retried every scan while the store is down: one line per outage, not per try.
        self._outage = OutageLog(log, "recovering sessions taken over")

    async def recover_all(self) -> None:
        """At start-up: everything the store can enumerate (a shared store leaves this to takeovers)."""
        await self.recover(await self._store.unfinished_inbound(), cut_off=PROCESS_DIED)

    async def recover_taken_over(self, session: str) -> bool:
        """This worker just took `session` over: close and resume what its previous owner left open.
        False if the store failed meanwhile: what is still open stays so, and the caller lets the
        session go so that it is adopted (and this run again) once the store answers."""
        try:
            records = await self._store.unfinished_inbound(session)
        except StoreError as exc:
            self._outage.failed(type(exc).__name__, f"could not read what {session} left open "
                                f"(retried while the store fails): {exc}")
            return False
        if not records:
            self._outage.recovered("the store answers again")
            return True
        log.info("took over %s with %d open message(s)", session, len(records), extra={"session": session})
        try:
            left = await self.recover(records, cut_off=TAKEN_OVER)
        except StoreError as exc:
            # Adoption runs inside whatever routed a message here (an HTTP request, a forward):
            # its failure is this worker's to log, never that client's 5xx.
            self._outage.failed(type(exc).__name__, f"could not finish what {session} left open "
                                f"(retried while the store fails): {exc}")
            return False
        if left:
            # The lease could not be proven before every record was closed (a slow loop, a lost
            # renewal): success here would let the session be released as idle with them open,
            # unlisted, and never adopted again. A failure lists it for another try.
            log.warning("lost the lease of %s while recovering it; %d open message(s) left for the next owner",
                        session, left, extra={"session": session})
            return False
        self._outage.recovered("the store answers again")
        return True

    async def recover(self, records: list[InboundRecord], *, cut_off: ToolReason) -> int:
        """`cut_off` names what stopped turns that were still running (a crash, a dead worker).
        Returns how many records were left open because their session is not (or no longer
        provably) this worker's: their owner recovers them."""
        left = 0
        for rec in records:
            fence = self._owners.fence(rec.session_key)
            if fence is None:
                left += 1
                continue
            self._recent.remember(rec.message)
            outlet = self._outlets.get(rec.message.platform)
            if rec.status is InboundStatus.ACCEPTED:
                left += not await self._replay(rec, fence, outlet, cut_off)
                continue
            if rec.status is InboundStatus.RUNNING and (answer := await self._unconfirmed(rec)) is not None:
                await self._show_again(rec, fence, outlet, answer)
                continue
            if rec.status is InboundStatus.RUNNING:  # the process died mid-turn: nobody told the user
                await self._close_transcript(fence, cut_off)
                if outlet is not None:
                    await self._owners.speaker(outlet, fence).notify(
                        rec.message.chat, stop_notice(cut_off), reply_to=rec.message.reply_target,
                        kind=NoticeKind.INTERRUPTED, reason=cut_off)
            await self._resume(rec, fence, outlet, cut_off)
        return left

    async def _replay(self, rec: InboundRecord, fence: Fence, outlet: Outlet | None, cut_off: ToolReason) -> bool:
        """A message accepted but never started: run it now — unless nobody can hear the answer.
        False if it could not be queued (the session is no longer provably ours): it stays open."""
        if outlet is None:
            await self._store.finish_inbound(fence, rec.id, InboundStatus.REJECTED, "platform no longer configured")
            return True
        if not outlet.answers_later:
            # Its client waited on the connection of the process that took it, and heard how it
            # ended (interrupted) when that process let go or went away. An answer now would
            # reach nobody and put into the history an answer that client never saw: it is
            # recorded as cut off instead, where the history shows it.
            conversation, _ = await self._store.conversation(rec.session_key)
            m = rec.message
            user = ChatMessage("user", with_placeholders(m.text, m.attachments), created_at=m.timestamp)
            await self._store.append(fence, conversation, [user, *TurnRecorder().interrupted(cut_off)],
                                     inbound=(rec.id, InboundStatus.CANCELLED, "not replayed: its client had gone"))
            return True
        log.info("replaying a message accepted but never answered", extra={"session": rec.session_key})
        return await self._queue.resume(rec.message, outlet, rec.session_key, inbound_id=rec.id) is not None

    async def _unconfirmed(self, rec: InboundRecord) -> str | None:
        """The answer recorded for this message whose showing was never confirmed (its process died
        between recording it and the chat showing its end), if that is what the record left open."""
        _, history = await self._store.conversation(rec.session_key)
        asked = with_placeholders(rec.message.text, rec.message.attachments)
        starts = [i for i, row in enumerate(history) if row.role == "user" and row.content == asked]
        if not starts:
            return None
        turn = list(itertools.takewhile(lambda row: row.role != "user", history[starts[-1] + 1:]))
        last = turn[-1] if turn else None
        if last is None or last.role != "assistant" or last.tool_calls or last.interrupted_by is not None:
            return None
        return last.content

    async def _show_again(self, rec: InboundRecord, fence: Fence, outlet: Outlet | None, answer: str) -> None:
        """Show a recorded answer whose end the chat may never have got: whole, as a new message."""
        if outlet is not None and outlet.answers_later:
            log.info("showing again an answer recorded but never confirmed shown", extra={"session": rec.session_key})
            speaker = self._owners.speaker(outlet, fence)
            run = Run(rec.session_key, guard=speaker.guard, tenant=rec.message.tenant)
            reply = speaker.open_reply(rec.message, run)
            await reply.finish(answer)
            await reply.delivered()
            await reply.settled()
            run.end()
        await self._store.finish_inbound(fence, rec.id, InboundStatus.DONE, "shown again after recovery")

    async def _resume(self, rec: InboundRecord, fence: Fence, outlet: Outlet | None, cut_off: ToolReason) -> None:
        fresh = time.time() - rec.received_at <= self._settings.value.resume_max_age_s
        # At most one automatic resume per user message: a resume that is itself cut off stays so.
        resumable = (outlet is not None and outlet.answers_later and fresh
                     and not rec.message.message_id.startswith(RESUME_PREFIX))
        await self._store.finish_inbound(fence, rec.id, InboundStatus.RESUMED if resumable else InboundStatus.CANCELLED,
                                         "resumed after restart" if resumable else "not resumed")
        if resumable and outlet is not None:
            log.info("resuming a turn that was cut off", extra={"session": rec.session_key})
            reason = GATEWAY_RESTART if rec.status is InboundStatus.RESTART else cut_off
            await self._queue.resume(_resume_message(rec, reason), outlet, rec.session_key)

    async def _close_transcript(self, fence: Fence, reason: ToolReason) -> None:
        conversation, history = await self._store.conversation(fence.session_key)
        if history and history[-1].role == "user":
            await self._store.append(fence, conversation, TurnRecorder().interrupted(reason))


def _resume_message(rec: InboundRecord, reason: ToolReason) -> InboundMessage:
    m = rec.message
    return InboundMessage(platform=m.platform, chat_id=m.chat_id, chat_type=m.chat_type, user_id=m.user_id,
                          user_name=m.user_name, message_id=f"{RESUME_PREFIX}{rec.id}",
                          text=resume_prompt(reason),
                          thread_id=m.thread_id, reply_to=m.message_id, user_handle=m.user_handle,
                          # The images and files go again (from their local copies): the model
                          # continues with what it was looking at, not just its placeholder.
                          attachments=tuple(a for a in m.attachments if a.refused is None))
