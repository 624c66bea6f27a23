"""Turning an accepted message into a turn in its session's lane: the admission decision applied,
the message stored, the user told what became of it. Also the way back in for messages the
gateway itself queues (replays after a restart, resumes, a background job's end)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from gateway.core.background import BackgroundJobs
from gateway.core.backoff import Backoff
from gateway.core.cancellation import NEW_MESSAGE, Run
from gateway.core.cluster import ClusterUnavailable
from gateway.core.fencing import Fence
from gateway.core.intake.answers import Answers
from gateway.core.intake.gates import Arrival
from gateway.core.intake.ownership import Owners
from gateway.core.messages import InboundMessage
from gateway.core.ports import DiskFull, InboundStatus, NoticeKind, Outcome, Outlet, Store, StoreError, Submitted
from gateway.core.sessions.admission import Admission, LaneState, admit
from gateway.core.sessions.control import BusyPolicies
from gateway.core.sessions.lanes import Lanes, Scope
from gateway.core.sessions.origins import Origins
from gateway.core.transcript import ChatMessage
from gateway.core.turns import Speaker, Turn

log = logging.getLogger(__name__)

STEERED = "↪ added to the current answer"
NOT_SAVED = "Sorry, I could not save your message (storage error). Please send it again."
ACCEPT_RETRY_S = 5.0  # a message is held (not yet acknowledged) this long through a store outage


class TurnQueue:
    def __init__(self, *, lanes: Lanes, owners: Owners, store: Store, busy: BusyPolicies, origins: Origins,
                 answers: Answers, jobs: BackgroundJobs | None = None,
                 begin: Callable[[Turn], Awaitable[None]] | None = None) -> None:
        self._lanes = lanes
        self._begin = begin  # `TurnRunner.begin`: a turn that starts at once is stored with its start
        self._owners = owners
        self._store = store
        self._busy = busy
        self._origins = origins
        self._answers = answers
        self._jobs = jobs

    async def admit(self, a: Arrival, fence: Fence, *, verify_first: bool = False) -> Submitted:
        """A user's message for a session this worker owns (`fence`). `verify_first`: it may be a
        duplicate only the store can recognise (a forwarded message seen here before), so it is
        stored before it may interrupt anything: a repeat never cuts off the turn it started."""
        with self._lanes.admitting(a.key):  # from here until it is queued, the session is not idle
            return await self._admit(a, fence, verify_first=verify_first)

    async def _admit(self, a: Arrival, fence: Fence, *, verify_first: bool) -> Submitted:
        msg, key = a.msg, a.key
        speaker = self._owners.speaker(a.outlet, fence)
        turn = Turn(msg, key, speaker, fence)
        if verify_first and (stored := await self._store_inbound(turn, a)) is not None:
            return stored
        if a.refused:  # the rest of the message is answered; the user learns why this part is not read
            await speaker.notify(msg.chat, a.refused, reply_to=msg.message_id, kind=NoticeKind.INFO)
        self._origins.remember(key, msg)
        decision = admit(self._busy.get(key), LaneState.of(self._lanes.get(key), msg),
                         can_steer=a.outlet.can_steer and not a.readable)
        decision, ahead = self._apply(decision, turn)  # before any await: a /stop from now on finds the turn
        if not verify_first and not ahead and decision is not Admission.STEER and self._begin is not None:
            await self._begin(turn)  # it runs next: its acceptance and its start are one write
        if not verify_first and (stored := await self._store_inbound(turn, a)) is not None:
            return stored
        return await self._acknowledge(decision, turn, speaker, ahead)

    async def admit_stateless(self, a: Arrival, history: Sequence[ChatMessage]) -> Submitted:
        """A request that carries its own history: a session of its own, nothing stored."""
        speaker = Speaker(a.outlet)
        if a.refused:
            await speaker.notify(a.msg.chat, a.refused, reply_to=a.msg.message_id, kind=NoticeKind.INFO)
        turn = Turn.stateless(a.msg, a.key, speaker, history)
        self._lanes.enqueue(turn)
        return Submitted(Outcome.ACCEPTED, run=turn.run)

    async def resume(self, msg: InboundMessage, outlet: Outlet, key: str, *,
                     inbound_id: int | None = None) -> Run | None:
        """Queue a turn without the intake checks a user message gets: a message already stored
        (`inbound_id`), or an automatic one whose message id makes it happen once."""
        fence = self._owners.fence(key)
        if fence is None:  # the session is not ours (any more): its owner recovers it
            return None
        turn = Turn(msg, key, self._owners.speaker(outlet, fence), fence)
        self._origins.remember(key, msg)  # a job started by a replayed turn reports to its chat too
        self._lanes.enqueue(turn)
        try:
            await self._owners.watch(key)
            turn.inbound_id = inbound_id or await self._store.accept_inbound(fence, msg)
        except (StoreError, ClusterUnavailable):  # it stays open in the store: recovered with the session later
            turn.inbound_id = None
        turn.accepted.set_result(turn.inbound_id is not None)
        return turn.run if turn.inbound_id is not None else None

    def _apply(self, decision: Admission, turn: Turn) -> tuple[Admission, int]:
        """Carry the decision out; returns it (a steer with nothing left to steer into queues) and
        how many turns are ahead of this one."""
        if decision is Admission.INTERRUPT:
            if self._jobs is not None:  # long commands move to the background before the cancel reaches them
                self._jobs.yield_foreground(turn.key, now=True)
            self._lanes.cancel(turn.key, NEW_MESSAGE, Scope.SESSION)
        if decision is Admission.STEER:
            if self._lanes.steer(turn):  # handed to the running turn at its next boundary
                return decision, 0
            decision = Admission.QUEUE
        return decision, self._lanes.enqueue(turn)

    async def _store_inbound(self, turn: Turn, a: Arrival) -> Submitted | None:
        """Store the message (acknowledged means stored); what to answer if it was not stored."""
        try:
            await self._owners.watch(turn.key)  # before the message is stored: then someone always finishes it
            turn.inbound_id = await self._accept(turn)
        except (StoreError, ClusterUnavailable) as exc:
            turn.accepted.set_result(False)
            log.error("could not store an inbound message: %s", exc, extra={"session": turn.key})
            return await self._answers.unavailable(a.outlet, a.msg, a.key, NOT_SAVED)
        if turn.inbound_id is None:
            turn.accepted.set_result(False)
            return Submitted(Outcome.DUPLICATE)
        turn.accepted.set_result(True)
        return None

    async def _accept(self, turn: Turn) -> int | None:
        """The message's inbound record: written now, or — through a short store outage — once
        the store is back. A write whose answer was lost may have landed: the retry is idempotent
        (the store returns our own record), and a message the store already holds open, unrun,
        is joined rather than refused as a duplicate (its first delivery was told "send again")."""
        backoff = Backoff(0.05, 0.5, jitter=0.0)
        deadline = time.monotonic() + ACCEPT_RETRY_S
        while True:
            try:
                inbound_id = await self._store.accept_inbound(turn.fence, turn.msg, started=turn.started)
                break
            except DiskFull:
                raise  # not a blip: refused now, retried by the platform or the client later
            except StoreError:
                if time.monotonic() + backoff.peek() > deadline:
                    raise
            await asyncio.sleep(backoff.step())
        return inbound_id if inbound_id is not None else await self._join(turn)

    async def _join(self, turn: Turn) -> int | None:
        """The open record of this very message, if the store holds one no lane is running."""
        msg = turn.msg
        lane = self._lanes.get(turn.key)
        if lane is not None and any(t is not turn and t.msg.message_id == msg.message_id for t in lane.turns()):
            return None  # a true duplicate: it is queued or running here
        for rec in await self._store.unfinished_inbound(turn.key):
            m = rec.message
            if (m.platform, m.chat_id, m.message_id) != (msg.platform, msg.chat_id, msg.message_id):
                continue
            if rec.status is InboundStatus.ACCEPTED:
                log.info("a message stored earlier but never run is taken again", extra={"session": turn.key})
                turn.started = None  # its start (the user's row) is written when it runs
                return rec.id
            if rec.status is InboundStatus.RUNNING and turn.started is not None:
                return rec.id  # this very write, started with it, landed: its answer was lost
        return None

    async def _acknowledge(self, decision: Admission, turn: Turn, speaker: Speaker, ahead: int) -> Submitted:
        msg = turn.msg
        if decision is Admission.STEER:
            if self._jobs is not None:  # the turn's long commands move to the background: it can take this now
                self._jobs.yield_foreground(turn.key, now=False)
            await speaker.notify(msg.chat, STEERED, reply_to=msg.message_id, kind=NoticeKind.INFO)
            return Submitted(Outcome.STEERED, STEERED, turn.run)
        if decision is Admission.QUEUE and ahead and not turn.run.is_cancelled():  # (stopped: its reply says so)
            await speaker.notify(msg.chat, f"Queued — {ahead} ahead of this message. /stop clears the queue.",
                                 reply_to=msg.message_id, kind=NoticeKind.QUEUED)
            return Submitted(Outcome.QUEUED, f"{ahead} ahead", turn.run)
        return Submitted(Outcome.ACCEPTED, run=turn.run)
