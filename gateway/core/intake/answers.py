"""How intake answers a message it does not take: a reason to the user, a line in the log."""

from __future__ import annotations

import logging
import time

from gateway.core.bounded import BoundedMap
from gateway.core.intake.gates import Refusal
from gateway.core.messages import ChatRef, InboundMessage
from gateway.core.ports import UNAVAILABLE_RETRY_S, NoticeKind, Outcome, Outlet, Submitted

log = logging.getLogger(__name__)

UNAVAILABLE_NOTICE_EVERY_S = 60.0


async def reject(outlet: Outlet, msg: InboundMessage, key: str, text: str | None, *,
                 kind: NoticeKind = NoticeKind.ERROR, detail: str = "",
                 retry_after_s: float | None = None) -> Submitted:
    """Tell the user why (unless `text` is None: already told recently) and say so in the log.
    `retry_after_s`: the same message would be taken after this long (a rate limit).
    Said by whichever worker received the message: it answers the message, not the session (so it
    goes straight to the outlet, not through a session's speaker). With `retry_after_s` the message
    was over a rate limit or quota: `Outcome.LIMITED`, and when trying again makes sense."""
    log.info("rejected a message: %s", text or detail, extra={"session": key})
    if text:
        await outlet.notify(msg.chat, text, reply_to=msg.message_id, kind=kind)
    if retry_after_s is not None:  # a client answered each time (the HTTP API) hears why each time
        return Submitted(Outcome.LIMITED, text or detail, retry_after_s=retry_after_s)
    return Submitted(Outcome.REJECTED, text or detail)


class Answers:
    """Answers that keep state: "unavailable" is told to a chat once a minute at most."""

    def __init__(self) -> None:
        self._unavailable_told: BoundedMap[ChatRef, float] = BoundedMap(10_000)

    reject = staticmethod(reject)

    async def refuse(self, outlet: Outlet, msg: InboundMessage, key: str, refusal: Refusal) -> Submitted:
        """A gate's refusal: the message's own (rejected; with a retry time when rate limited), or
        "not now" when the gateway cannot take anything (restarting) — never a rejection then."""
        if refusal.outcome is not Outcome.UNAVAILABLE:
            return await reject(outlet, msg, key, refusal.text, kind=refusal.kind, detail=refusal.detail,
                                retry_after_s=refusal.retry_after_s)
        log.info("not taken now: %s", refusal.text or refusal.detail, extra={"session": key})
        if refusal.text:
            await outlet.notify(msg.chat, refusal.text, reply_to=msg.message_id, kind=refusal.kind)
        return Submitted(Outcome.UNAVAILABLE, refusal.text or refusal.detail, retry_after_s=refusal.retry_after_s)

    async def unavailable(self, outlet: Outlet, msg: InboundMessage, key: str, text: str) -> Submitted:
        """Not taken because storage or Redis is down. The platform may deliver it again (a webhook
        answered non-2xx, a client told to retry); the chat is told once a minute at most."""
        log.warning("could not take a message now: %s", text, extra={"session": key})
        now = time.monotonic()
        told = self._unavailable_told.get(msg.chat)
        if told is None or now - told >= UNAVAILABLE_NOTICE_EVERY_S:
            self._unavailable_told[msg.chat] = now
            await outlet.notify(msg.chat, text, reply_to=msg.message_id, kind=NoticeKind.ERROR)
        return Submitted(Outcome.UNAVAILABLE, text, retry_after_s=UNAVAILABLE_RETRY_S)
