"""After a restart: replay messages that were accepted but never started, and resume turns that
a restart (or a crash) cut off — once each, and only while they are fresh."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from gateway.core.cancellation import GATEWAY_RESTART, PROCESS_DIED, ToolReason
from gateway.core.messages import InboundMessage
from gateway.core.transcript import TurnRecorder
from gateway.store import InboundRecord
from platforms.base import stop_notice

if TYPE_CHECKING:
    from gateway.core.router import Router
    from platforms.base import Adapter

log = logging.getLogger(__name__)

RESUME_PREFIX = "resume:"
RESUME_PROMPT = (f"{GATEWAY_RESTART.marker} The gateway restarted while you were answering. "
                 "Continue from where you stopped, without repeating what you already said.")


def resume_prompt(reason: ToolReason) -> str:
    """The automatic message that asks the model to continue, naming what cut it off."""
    if reason == GATEWAY_RESTART:
        return RESUME_PROMPT
    return (f"{reason.marker} Your answer was cut off. "
            "Continue from where you stopped, without repeating what you already said.")


def is_resume_prompt(text: str) -> bool:
    return text.startswith("[interrupted by system: ") and "Continue from where you stopped" in text


async def recover(router: Router, adapters: dict[str, Adapter], *, resume_max_age_s: float) -> None:
    """At start-up: everything the store can enumerate (a shared store leaves this to takeovers)."""
    await recover_records(router, adapters, await router.store.unfinished_inbound(),
                          resume_max_age_s=resume_max_age_s)


async def recover_records(router: Router, adapters: dict[str, Adapter], records: list[InboundRecord], *,
                          resume_max_age_s: float, cut_off: ToolReason = PROCESS_DIED) -> None:
    """`cut_off` names what stopped turns that were still running (a crash, a dead worker)."""
    for rec in records:
        router.remember(rec.message)
        adapter = adapters.get(rec.message.platform)
        if rec.status == "accepted":
            if adapter is None:
                await router.store.finish_inbound(rec.session_key, rec.id, "rejected",
                                                  "platform no longer configured")
                continue
            log.info("replaying a message accepted but never answered", extra={"session": rec.session_key})
            await router.resume(rec.message, adapter, rec.session_key, inbound_id=rec.id)
            continue
        if rec.status == "running":  # the process died mid-turn: nobody told the user
            await _close_transcript(router, rec, cut_off)
            if adapter is not None:
                await adapter.notify(rec.message.chat, stop_notice(cut_off), reply_to=rec.message.message_id,
                                     kind="interrupted")
        fresh = time.time() - rec.received_at <= resume_max_age_s
        # At most one automatic resume per user message: a resume that is itself cut off stays so.
        resumable = (adapter is not None and rec.message.platform != "api" and fresh
                     and not rec.message.message_id.startswith(RESUME_PREFIX))
        await router.store.finish_inbound(rec.session_key, rec.id, "resumed" if resumable else "cancelled",
                                          "resumed after restart" if resumable else "not resumed")
        if resumable and adapter is not None:
            log.info("resuming a turn that was cut off", extra={"session": rec.session_key})
            reason = GATEWAY_RESTART if rec.status == "restart" else cut_off
            await router.resume(_resume_message(rec, reason), adapter, rec.session_key)


async def _close_transcript(router: Router, rec: InboundRecord, reason: ToolReason) -> None:
    conversation, history = await router.store.conversation(rec.session_key)
    if history and history[-1].role == "user":
        fence = router.cluster.leases.held[rec.session_key].fence if router.cluster else None
        await router.store.append(rec.session_key, conversation, TurnRecorder().interrupted(reason), fence=fence)


def _resume_message(rec: InboundRecord, reason: ToolReason) -> InboundMessage:
    m = rec.message
    return InboundMessage(platform=m.platform, chat_id=m.chat_id, chat_type=m.chat_type, user_id=m.user_id,
                          user_name=m.user_name, message_id=f"{RESUME_PREFIX}{rec.id}",
                          text=resume_prompt(reason),
                          thread_id=m.thread_id, reply_to=m.message_id, user_handle=m.user_handle)
