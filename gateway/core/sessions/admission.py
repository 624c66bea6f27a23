"""What happens to a message that arrives for a session: a pure decision, policy × lane state.

Tested as a table (tests/test_admission.py); the lane and the busy policy are its only inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gateway.core.messages import InboundMessage
from gateway.core.sessions.lanes import Lane
from gateway.core.settings import BusyPolicy
from gateway.core.transcript import is_automatic


class Admission(Enum):
    RUN = "run"  # nothing else is running: it runs now
    QUEUE = "queue"  # it waits for the turns ahead of it
    STEER = "steer"  # it is handed to the running answer at its next boundary
    INTERRUPT = "interrupt"  # the running answer (and anything queued) is stopped; it runs next


@dataclass(frozen=True, slots=True)
class LaneState:
    """What the decision needs to know of a session's lane."""

    busy: bool = False  # a turn is running or queued
    steerable: bool = False  # exactly one turn, running and not stopped, nothing queued behind it
    newer_waiting: bool = False  # a message the user sent after this one is already in the lane

    @classmethod
    def of(cls, lane: Lane | None, msg: InboundMessage) -> LaneState:
        if lane is None or not lane.busy:
            return cls()
        current = lane.current
        steerable = current is not None and not lane.pending and not current.run.is_cancelled()
        return cls(busy=True, steerable=steerable, newer_waiting=_newer_in(lane, msg))


def admit(policy: BusyPolicy, lane: LaneState, *, can_steer: bool) -> Admission:
    """`can_steer`: the platform takes steered messages and the message is text only (a message
    with images or files is a turn of its own: steering hands the model text only)."""
    if not lane.busy:
        return Admission.RUN
    if lane.newer_waiting:
        # A message that arrives late (held up in a forward while its owner was paused) must not
        # cut off the answer to one the user sent after it: it waits its turn instead.
        return Admission.QUEUE
    if policy == "interrupt":
        return Admission.INTERRUPT
    if policy == "steer" and can_steer and lane.steerable:
        return Admission.STEER
    return Admission.QUEUE


def _order(msg: InboundMessage) -> tuple[float, int]:
    """When the user sent it: the platform's time, then its message number (Telegram's grow per chat)."""
    return msg.timestamp, int(msg.message_id) if msg.message_id.isdigit() else 0


def _newer_in(lane: Lane, msg: InboundMessage) -> bool:
    newest = lane.newest()
    if newest is None or is_automatic(newest.msg.message_id):
        return False
    return _order(newest.msg) > _order(msg)
