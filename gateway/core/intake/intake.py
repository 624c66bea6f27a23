"""The way in, in order: the gates, then ownership (ours, or forwarded to the owner), then
de-duplication, then a command (outside the lane) or the turn queue. Every message ends
processed, queued (with an ack) or rejected with a reason, and is counted. The turn in flight the
`turns` gate reserved for a message is held by the run it got, or given back (`_settled`)."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence

from gateway.core.intake.answers import Answers
from gateway.core.intake.dedupe import RecentMessages
from gateway.core.intake.gates import NOT_TEXT, Arrival, Gates, Refusal, encodable
from gateway.core.intake.ownership import Owners
from gateway.core.live import Reads
from gateway.core.messages import InboundMessage, session_key
from gateway.core.metrics import Metrics
from gateway.core.ports import Outcome, Outlet, Submitted
from gateway.core.sessions.control import SessionCommands
from gateway.core.sessions.queue import TurnQueue
from gateway.core.settings import CoreSettings
from gateway.core.transcript import ChatMessage
from gateway.core.turns import Speaker


class Intake:
    def __init__(self, *, gates: Gates, owners: Owners, recent: RecentMessages, answers: Answers,
                 commands: SessionCommands, queue: TurnQueue, metrics: Metrics,
                 settings: Reads[CoreSettings]) -> None:
        self._gates = gates
        self._owners = owners
        self._recent = recent
        self._answers = answers
        self._commands = commands
        self._queue = queue
        self._metrics = metrics
        self._settings = settings

    def key(self, msg: InboundMessage) -> str:
        return session_key(msg, per_user_in_groups=self._settings.value.router.per_user_in_groups)

    async def submit(self, msg: InboundMessage, outlet: Outlet, *, key: str | None = None, hops: int = 0) -> Submitted:
        """A message for a session (`key`, or the one its chat maps to). `hops` counts forwards
        between cluster workers (a forwarded message arrives with 1)."""
        arrival = self._gates.arrive(msg, key or self.key(msg), outlet, hops)
        return self._count(arrival, await self._take(arrival))

    async def submit_stateless(self, msg: InboundMessage, outlet: Outlet,
                               history: Sequence[ChatMessage]) -> Submitted:
        """A request that carries its own history (the HTTP API without a session): a session of
        its own, on this worker, with nothing stored and no rate limit."""
        arrival = self._gates.arrive(msg, self.key(msg), outlet)
        refusal = (Refusal(NOT_TEXT) if not all(encodable(m.content) for m in history)  # every text is sent on
                   else await self._gates.screen(arrival, stateless=True))
        if refusal is not None:
            result = await self._refuse(arrival, refusal)
        elif arrival.cmd is not None:
            result = (Submitted(Outcome.DUPLICATE) if self._recent.seen(arrival.msg, 0) else
                      await self._commands.dispatch(arrival.cmd, arrival.key, arrival.msg, Speaker(outlet)))
        else:
            result = await self._settled(arrival, self._queue.admit_stateless(arrival, history))
        return self._count(arrival, result)

    async def _take(self, a: Arrival) -> Submitted:
        refusal = await self._gates.screen(a)
        if refusal is not None:
            return await self._refuse(a, refusal)
        return await self._untaken_forgotten(a, self._settled(a, self._taken(a)) if a.takes_a_turn else self._taken(a))

    async def _untaken_forgotten(self, a: Arrival, taking: Awaitable[Submitted]) -> Submitted:
        """Invariant: a message remembered as seen was taken (stored, forwarded and confirmed, or
        answered). One that was not — unavailable, or an error on the way — is forgotten, so the
        platform's redelivery gets in instead of being answered "duplicate": acknowledged, and
        stored nowhere."""
        try:
            result = await taking
        except BaseException:
            self._recent.forget(a.msg)
            raise
        if result.outcome in (Outcome.UNAVAILABLE, Outcome.MOVED):
            self._recent.forget(a.msg)
        return result

    async def _refuse(self, a: Arrival, refusal: Refusal) -> Submitted:
        return await self._answers.refuse(a.outlet, a.msg, a.key, refusal)

    async def _settled(self, a: Arrival, taking: Awaitable[Submitted]) -> Submitted:
        """Take a message the gates reserved a turn in flight for: the slot goes to the run it got,
        or back (no run: forwarded, a duplicate, not stored, or an error on the way)."""
        result: Submitted | None = None
        try:
            result = await taking
        finally:
            self._gates.load.settle(a.tenant, result.run if result is not None else None)
        return result

    async def _taken(self, a: Arrival) -> Submitted:
        placed = await self._owners.place(a)
        if isinstance(placed, Submitted):  # not ours: forwarded, or refused with a reason
            return placed
        seen = self._recent.check(a.msg, a.hops)
        if seen == "duplicate":
            return Submitted(Outcome.DUPLICATE)
        if a.cmd is not None:  # from here on the core speaks for the session only through its speaker
            return await self._commands.dispatch(a.cmd, a.key, a.msg, self._owners.speaker(a.outlet, placed))
        return await self._queue.admit(a, placed, verify_first=seen == "known")

    def _count(self, a: Arrival, result: Submitted) -> Submitted:
        self._metrics.messages_in.labels(a.msg.platform, result.outcome.value).inc()
        return result
