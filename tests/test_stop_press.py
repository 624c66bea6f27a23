"""A Stop button press decided without a platform: who may press, and what the presser is told."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gateway.core.commands import ENDED, STOPPED
from gateway.core.messages import ChatRef, ChatType
from gateway.core.ports import Outcome, Submitted
from platforms.stop_button import PressOutcome, may_press, press_answer

DM = ChatRef("telegram", "1", ChatType.DM)
GROUP = ChatRef("telegram", "-100", ChatType.GROUP)


async def test_in_a_group_only_the_asker_or_an_admin_may_press_and_admins_are_asked_only_then() -> None:
    asked: list[bool] = []

    def admin(answer: bool) -> Callable[[], Awaitable[bool]]:
        async def is_admin() -> bool:
            asked.append(answer)
            return answer
        return is_admin

    assert await may_press(DM, "bob", "alice", admin(False))
    assert await may_press(GROUP, "alice", "alice", admin(False))
    assert asked == []  # no member lookup where none is needed
    assert not await may_press(GROUP, "bob", "alice", admin(False))
    assert await may_press(GROUP, "bob", "alice", admin(True))


def test_the_presser_is_told_what_the_stop_came_to() -> None:
    def told(outcome: Outcome, detail: str = "", notices: tuple[str, ...] = ()) -> tuple[PressOutcome, str]:
        press = press_answer(Submitted(outcome, detail), list(notices))
        return press.outcome, press.text

    assert told(Outcome.COMMAND, STOPPED) == (PressOutcome.STOPPED, STOPPED)
    assert told(Outcome.COMMAND, ENDED) == (PressOutcome.ENDED, ENDED)
    assert told(Outcome.COMMAND) == (PressOutcome.ENDED, ENDED)
    assert told(Outcome.FORWARDED) == (PressOutcome.STOPPED, "Stopping…")  # the session's owner stops it
    assert told(Outcome.UNAVAILABLE)[0] is PressOutcome.FAILED
    assert told(Outcome.REJECTED, notices=("You are not on the allowlist.",)) == (
        PressOutcome.REFUSED, "You are not on the allowlist.")
    assert told(Outcome.REJECTED) == (PressOutcome.REFUSED, "Sorry, you cannot use this bot.")
