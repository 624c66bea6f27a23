"""The gates every message passes before anything is acknowledged, declared as data.

The order is the policy: a message that cannot even be stored is refused before anyone is asked
whether its sender may write; a stranger is refused before their attachments are looked at; the
rate limits count only messages that would otherwise be taken. Commands pass the `open` and
`rate limit` gates, so `/stop` works while the gateway drains and for a user who is throttled;
the tenant's rate counts commands too, all but `/stop`, which always gets through. The `turns`
gate comes last because it reserves one of the tenant's turns in flight (`TenantLoad`), which
`Intake` then gives back or hands to the turn's run: a gate after it could strand the slot.
De-duplication and ownership come after the gates (`Intake`): they need a message worth keeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.core.access import AccessControl
from gateway.core.attachments import refusal_sentence, screen
from gateway.core.commands import Command, parse_command
from gateway.core.live import Reads
from gateway.core.messages import InboundMessage
from gateway.core.ports import UNAVAILABLE_RETRY_S, NoticeKind, Outcome, Outlet
from gateway.core.quotas import TURNS_RETRY_S, TenantLoad, message_tenant, who
from gateway.core.ratelimit import Limited, TenantRateLimit, UserRateLimit
from gateway.core.settings import CoreSettings

MEDIA_ONLY = "I can only read text, images and text files; that kind of message is not supported."
RESTARTING = "The gateway is restarting; please send that again in a moment."
NOT_TEXT = "That message contains characters that are not valid text; please send it again."
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")  # binary, not text


@dataclass(frozen=True, slots=True)
class Arrival:
    """One inbound message on its way in, with what the gates learned of it."""

    msg: InboundMessage  # its attachments screened: each carries its verdict
    key: str
    outlet: Outlet
    cmd: Command | None
    hops: int = 0  # forwards between cluster workers so far (a forwarded message arrives with 1)

    @property
    def tenant(self) -> str:
        """Whom the message is accounted to (`gateway.core.quotas`)."""
        return message_tenant(self.msg)

    @property
    def takes_a_turn(self) -> bool:
        """Does it start (or join) a turn, and so hold one of its tenant's turns in flight? Every
        message but a command."""
        return self.cmd is None

    @property
    def readable(self) -> bool:
        """Does it carry an attachment the model will read?"""
        return any(a.refused is None for a in self.msg.attachments)

    @property
    def media_only(self) -> bool:
        """Nothing in it can be read: no text, and every attachment refused (or none understood)."""
        msg = self.msg
        return (msg.media or bool(msg.attachments)) and not msg.text.strip() and not self.readable

    @property
    def refused(self) -> str | None:
        """Why some of its attachments are not read, if any are not."""
        return refusal_sentence(self.msg.attachments)


@dataclass(frozen=True, slots=True)
class Refusal:
    text: str | None  # what the user is told (None: they were told recently)
    kind: NoticeKind = NoticeKind.ERROR
    detail: str = ""  # for the log when nothing is said
    retry_after_s: float | None = None  # a quota or rate limit: trying again after this long makes sense
    # REJECTED: the message is refused (LIMITED with a retry time: a quota or rate limit);
    # UNAVAILABLE: not the message's fault — the gateway cannot take anything now (restarting).
    outcome: Outcome = Outcome.REJECTED

    @classmethod
    def limited(cls, limit: Limited) -> Refusal:
        return cls(limit.notice, detail=limit.reason, retry_after_s=limit.retry_after_s)


Gate = Callable[[Arrival], Awaitable[Refusal | None]]


@dataclass(frozen=True, slots=True)
class Limits:
    """What the rate and quota gates count with (the router keeps them, and prunes the windows)."""

    user_rate: UserRateLimit
    tenant_rate: TenantRateLimit
    load: TenantLoad


class Gates:
    """The checks, in order. `stateless` requests (the HTTP API without a session) skip the per-user
    rate limit (each is a session of its own); the tenant's limits count them like any message."""

    def __init__(self, settings: Reads[CoreSettings], access: AccessControl | None, limits: Limits,
                 closing: asyncio.Event) -> None:
        self._settings = settings
        self._access = access
        self._rate_limit = limits.user_rate
        self._tenant_rate = limits.tenant_rate
        self.load = limits.load
        self._closing = closing
        self.order: tuple[tuple[str, Gate], ...] = (
            ("encodable", self._encodable),
            ("valid", self._valid),
            ("open", self._open),
            ("access", self._allowed),
            ("media", self._media),
            ("rate limit", self._within_rate),
            ("tenant rate", self._within_tenant_rate),
            ("turns", self._turn_free),
        )
        self.stateless_order = tuple((name, gate) for name, gate in self.order if name != "rate limit")

    def arrive(self, msg: InboundMessage, key: str, outlet: Outlet, hops: int = 0) -> Arrival:
        """The message as the gates see it: attachments screened (each gets its verdict now,
        before the message is stored) and its command parsed."""
        if msg.attachments:
            s = self._settings.value
            msg = dataclasses.replace(msg, attachments=screen(msg.attachments, s.media, vision=s.vision))
        return Arrival(msg, key, outlet, parse_command(msg.text, outlet.bot_username), hops)

    async def screen(self, arrival: Arrival, *, stateless: bool = False) -> Refusal | None:
        """The first gate that refuses the message, or None if all let it through."""
        for _name, gate in self.stateless_order if stateless else self.order:
            refusal = await gate(arrival)
            if refusal is not None:
                return refusal
        return None

    async def _encodable(self, a: Arrival) -> Refusal | None:
        # Lone surrogates (e.g. "\ud800" in JSON) cannot be stored or sent on: refused now, before
        # anything is acknowledged, rather than poison the store.
        m = a.msg
        texts = (a.key, m.text, m.chat_id, m.user_id, m.user_name, m.message_id, m.thread_id, m.user_handle,
                 m.reply_to, *(x.name for x in m.attachments), *(x.mime for x in m.attachments))
        return None if all(encodable(t) for t in texts) else Refusal(NOT_TEXT)

    async def _valid(self, a: Arrival) -> Refusal | None:
        text = a.msg.text
        if a.media_only or (a.readable and not text.strip()):  # the attachments speak for it
            return None
        limit = self._settings.value.router.max_message_chars
        if not text.strip():
            return Refusal("That message was empty — send some text.")
        if len(text) > limit:
            return Refusal(f"That message is too long ({len(text)} characters; the limit is {limit}). "
                           "Please shorten it.")
        if _CONTROL_CHARS.search(text):
            return Refusal("That message contains binary data; I can only read text.")
        return None

    async def _open(self, a: Arrival) -> Refusal | None:
        if self._closing.is_set() and a.cmd is None:  # commands still work while turns drain: /stop must stop
            return Refusal(RESTARTING, NoticeKind.RESTART, retry_after_s=UNAVAILABLE_RETRY_S,
                           outcome=Outcome.UNAVAILABLE)
        return None

    async def _allowed(self, a: Arrival) -> Refusal | None:
        if self._access is None:
            return None
        allowed, notice = await self._access.check(a.msg)
        return None if allowed else Refusal(notice, NoticeKind.INFO, "not allowed (notice throttled)")

    async def _media(self, a: Arrival) -> Refusal | None:
        return Refusal(a.refused or MEDIA_ONLY) if a.media_only else None

    async def _within_rate(self, a: Arrival) -> Refusal | None:
        if a.cmd is not None:  # commands always get through: /stop must work
            return None
        limited = self._rate_limit.check(a.msg.platform, a.msg.user_id)
        return None if limited is None else Refusal.limited(limited)

    async def _within_tenant_rate(self, a: Arrival) -> Refusal | None:
        if (a.cmd is not None and a.cmd.name == "stop") or a.hops:  # /stop always gets through; a message
            return None  # forwarded to its session's owner was counted where it arrived
        limited = self._tenant_rate.check(a.tenant, f"{a.msg.platform}\0{a.msg.user_id}")
        return None if limited is None else Refusal.limited(limited)

    async def _turn_free(self, a: Arrival) -> Refusal | None:
        """Reserves one of the tenant's turns in flight (given back by `Intake`) — last, for that."""
        if not a.takes_a_turn:
            return None
        tenant = a.tenant
        limit = int(self._settings.value.quotas.limit(tenant, "running_turns"))
        if limit > 0 and self.load.in_flight(tenant) >= limit:
            text = (f"Too many answers are being written for {who(tenant)} at once ({limit}). Please wait for one "
                    "to finish, or stop one, and try again.")
            return Refusal(text, detail=text, retry_after_s=TURNS_RETRY_S)
        self.load.reserve(tenant)
        return None


def encodable(text: str | None) -> bool:
    """Can `text` be written as UTF-8 (no lone surrogates)?"""
    if not text or text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
