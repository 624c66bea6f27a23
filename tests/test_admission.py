"""The admission decision as a table: busy policy × lane state → run, queue, steer or interrupt."""

from __future__ import annotations

import pytest

from gateway.core.sessions.admission import Admission, LaneState, admit
from gateway.core.settings import BUSY_POLICIES

IDLE = LaneState()
RUNNING = LaneState(busy=True, steerable=True)  # one turn, running, nothing queued
QUEUED = LaneState(busy=True, steerable=False)  # a turn runs and another waits (or the running one was stopped)
LATE = LaneState(busy=True, steerable=True, newer_waiting=True)  # the user's next message is already in

TABLE = [
    # policy      lane     can_steer  ->  decision
    ("interrupt", IDLE, True, Admission.RUN),
    ("queue", IDLE, True, Admission.RUN),
    ("steer", IDLE, True, Admission.RUN),
    ("interrupt", RUNNING, True, Admission.INTERRUPT),
    ("interrupt", QUEUED, True, Admission.INTERRUPT),
    ("queue", RUNNING, True, Admission.QUEUE),
    ("queue", QUEUED, False, Admission.QUEUE),
    ("steer", RUNNING, True, Admission.STEER),
    ("steer", RUNNING, False, Admission.QUEUE),  # images or files, or a platform that cannot steer
    ("steer", QUEUED, True, Admission.QUEUE),  # steering would jump the queue
    ("interrupt", LATE, True, Admission.QUEUE),  # a late message never cuts off the answer to a newer one
    ("steer", LATE, True, Admission.QUEUE),
    ("queue", LATE, True, Admission.QUEUE),
]


@pytest.mark.parametrize(("policy", "lane", "can_steer", "expected"), TABLE)
def test_admission_table(policy: str, lane: LaneState, can_steer: bool, expected: Admission) -> None:
    assert admit(policy, lane, can_steer=can_steer) is expected  # type: ignore[arg-type]


def test_an_idle_lane_is_never_steered_queued_or_interrupted_whatever_else_is_true() -> None:
    for policy in BUSY_POLICIES:
        for can_steer in (True, False):
            assert admit(policy, IDLE, can_steer=can_steer) is Admission.RUN
