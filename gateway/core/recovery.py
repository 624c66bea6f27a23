"""After a restart or a takeover: replay messages that were accepted but never started, and resume
turns that a restart (or a crash) cut off — once each, and only while they are fresh."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from gateway.core.cancellation import GATEWAY_RESTART, PROCESS_DIED, TAKEN_OVER, Run, ToolReason, stop_notice
from gateway.core.fencing import Fence
from gateway.core.messages import InboundMessage
from gateway.core.ports import InboundRecord, InboundStatus, NoticeKind, Outlet, Outlets, Store, StoreError
from gateway.core.transcript import TurnRecorder
from gateway.core.turns import Speaker

log = logging.getLogger(__name__)

RESUME_PREFIX = "resume:"
RESUME_PROMPT = (f"{GATEWAY_RESTART.marker} The gateway restarted while you were answering. "
                 "Continue from where you stopped, without repeating what you already said.")

Requeue = Callable[..., Awaitable[Run | None]]  # Router.resume(msg, outlet, key, *, inbound_id=None)


def resume_prompt(reason: ToolReason) -> str:
    """The automatic message that asks the model to continue, naming what cut it off."""
    if reason == GATEWAY_RESTART:
        return RESUME_PROMPT
    return (f"{reason.marker} Your answer was cut off. "
            "Continue from where you stopped, without repeating what you already said.")


def is_resume_prompt(text: str) -> bool:
    return text.startswith("[interrupted by system: ") and "Continue from where you stopped" in text


class Recovery:
    def __init__(self, store: Store, outlets: Outlets, *, requeue: Requeue,
                 remember: Callable[[InboundMessage], object], fence: Callable[[str], Fence | None],
                 speaker: Callable[[Outlet, Fence], Speaker], resume_max_age_s: float) -> None:
        self._store = store
        self._speaker = speaker
        self._outlets = outlets
        self._requeue = requeue
        self._remember = remember
        self._fence = fence
        self.resume_max_age_s = resume_max_age_s

    async def recover_all(self) -> None:
        """At start-up: everything the store can enumerate (a shared store leaves this to takeovers)."""
        await self.recover(await self._store.unfinished_inbound(), cut_off=PROCESS_DIED)

    async def recover_taken_over(self, session: str) -> None:
        """This worker just took `session` over: close and resume what its previous owner left open."""
        try:
            records = await self._store.unfinished_inbound(session)
        except StoreError as exc:
            log.warning("could not read what %s left open: %s", session, exc, extra={"session": session})
            return
        if records:
            log.info("took over %s with %d open message(s)", session, len(records), extra={"session": session})
            await self.recover(records, cut_off=TAKEN_OVER)

    async def recover(self, records: list[InboundRecord], *, cut_off: ToolReason) -> None:
        """`cut_off` names what stopped turns that were still running (a crash, a dead worker)."""
        for rec in records:
            fence = self._fence(rec.session_key)
            if fence is None:
                continue  # not ours (any more): its owner recovers it
            self._remember(rec.message)
            outlet = self._outlets.get(rec.message.platform)
            if rec.status is InboundStatus.ACCEPTED:
                if outlet is None:
                    await self._store.finish_inbound(fence, rec.id, InboundStatus.REJECTED,
                                                     "platform no longer configured")
                    continue
                log.info("replaying a message accepted but never answered", extra={"session": rec.session_key})
                await self._requeue(rec.message, outlet, rec.session_key, inbound_id=rec.id)
                continue
            if rec.status is InboundStatus.RUNNING:  # the process died mid-turn: nobody told the user
                await self._close_transcript(fence, cut_off)
                if outlet is not None:
                    await self._speaker(outlet, fence).notify(
                        rec.message.chat, stop_notice(cut_off), reply_to=rec.message.message_id,
                        kind=NoticeKind.INTERRUPTED, reason=cut_off)
            await self._resume(rec, fence, outlet, cut_off)

    async def _resume(self, rec: InboundRecord, fence: Fence, outlet: Outlet | None, cut_off: ToolReason) -> None:
        fresh = time.time() - rec.received_at <= self.resume_max_age_s
        # At most one automatic resume per user message: a resume that is itself cut off stays so.
        resumable = (outlet is not None and rec.message.platform != "api" and fresh
                     and not rec.message.message_id.startswith(RESUME_PREFIX))
        await self._store.finish_inbound(fence, rec.id, InboundStatus.RESUMED if resumable else InboundStatus.CANCELLED,
                                         "resumed after restart" if resumable else "not resumed")
        if resumable and outlet is not None:
            log.info("resuming a turn that was cut off", extra={"session": rec.session_key})
            reason = GATEWAY_RESTART if rec.status is InboundStatus.RESTART else cut_off
            await self._requeue(_resume_message(rec, reason), outlet, rec.session_key)

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
