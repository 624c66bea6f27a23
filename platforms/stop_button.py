"""One-tap Stop: the tokens behind the Stop buttons of streaming answers, and what a press does.

A button carries its run's token and the asker's id (`stop:<run token>:<user id>`), never a
run id: run ids restart with the process, so an old button could otherwise name a new turn. A
press is exactly `/stop` for the button's session — submitted through the router as
`/stop run:<token>`, so access rules, metrics, cluster forwarding and the stop itself are those of
a typed /stop — except that it stops only while the button's own run is the one running: a press
on an answer that has ended (or on a button from before a restart) stops nothing and says so. In a
group only the person who asked, or an admin of the chat, may press it; the payload says who asked,
so any worker can tell.

The router's "Stopped." notice for a press is not sent to the chat: the platform shows it as the
press's own answer (a Telegram toast, a Discord interaction), and the answer's message is marked
"⏹ stopped" as for a typed /stop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from gateway.core.bounded import BoundedMap
from gateway.core.cancellation import Run
from gateway.core.commands import ENDED, RUN_ARG, STOPPED
from gateway.core.messages import ChatRef, ChatType, InboundMessage
from gateway.core.ports import Outcome, Submitted

log = logging.getLogger(__name__)

PREFIX = "stop:"
PRESS_PREFIX = "stop-press:"  # message ids of the `/stop` a press submits
LABEL = "⏹ Stop"
MAX_LIVE = 10_000  # answers still streaming here; older ones are forgotten (their presses: forwarded)
# Hands a message to the router on the adapter's behalf, with its session key if known.
Submit = Callable[[InboundMessage, str | None], Awaitable[Submitted]]
__all__ = ["ENDED", "LABEL", "PREFIX", "Press", "PressOutcome", "StopButton", "StopButtons", "Submit"]


class PressOutcome(StrEnum):
    STOPPED = "stopped"
    ENDED = "ended"  # the button's run is not running any more
    REFUSED = "refused"  # not this user's to stop (or not allowed to use the bot)
    FAILED = "failed"  # the stop could not be taken now (storage down)


@dataclass(frozen=True, slots=True)
class Press:
    outcome: PressOutcome
    text: str  # what the presser is told (a toast, an ephemeral message)


@dataclass(slots=True)
class StopTarget:
    """What a live button stops: its run, its chat and who asked."""

    run: Run
    chat: ChatRef
    asker_id: str
    asker_name: str

    def live(self) -> bool:
        return not self.run.finished and not self.run.is_cancelled()


def custom_id(run: Run, asker_id: str) -> str:
    """The button's payload (Telegram callback_data: at most 64 bytes; Discord custom_id: 100)."""
    return f"{PREFIX}{run.token}:{asker_id}"


def parse(data: str | None) -> tuple[str, str] | None:
    """(run token, asker id) from a button payload, or None if it is not a Stop button's."""
    if data is None or not data.startswith(PREFIX):
        return None
    token, _, asker = data[len(PREFIX):].partition(":")
    return (token, asker) if token and asker else None


def is_press(reply_to: str | None) -> bool:
    """Is this notice about a press (answered by the press itself, never sent to the chat)?"""
    return reply_to is not None and reply_to.startswith(PRESS_PREFIX)


@dataclass(frozen=True, slots=True)
class StopButton:
    """One answer's Stop button: the payload its messages carry, and the registry that forgets it
    when the answer settles (a press after that stops nothing and says so)."""

    data: str
    registry: StopButtons

    def close(self) -> None:
        self.registry.close(self.data)


class StopButtons:
    """The live Stop buttons of one adapter."""

    def __init__(self, platform: str) -> None:
        self.platform = platform
        self._live: BoundedMap[str, StopTarget] = BoundedMap(MAX_LIVE)
        self._absorbing: dict[str, list[str]] = {}  # press id -> notices the router sent for it

    def open(self, msg: InboundMessage, run: Run) -> StopButton:
        """The Stop button of the answer to `msg`; the run is known here until the button is closed."""
        self._live[run.token] = StopTarget(run, msg.chat, msg.user_id, msg.user_name or "the person who asked")
        return StopButton(custom_id(run, msg.user_id), self)

    def close(self, data: str | None) -> None:
        parsed = parse(data)
        if parsed is not None:
            self._live.pop(parsed[0], None)

    def absorb(self, reply_to: str | None, text: str) -> bool:
        """A notice the router sends about a press: kept for the press's answer (or, for a press
        another worker received, dropped: that worker answers it). True if taken."""
        if not is_press(reply_to):
            return False
        notices = self._absorbing.get(reply_to or "")
        if notices is not None:
            notices.append(text)
        return True

    async def press(self, submit: Submit, chat: ChatRef | None, data: str | None, *, user_id: str, user_name: str,
                    press_id: str, is_admin: Callable[[], Awaitable[bool]]) -> Press:
        """Handle a press of the button with payload `data` in `chat` by `user_id`; returns once the
        cancel is issued (or handed to the worker that runs the answer)."""
        parsed = parse(data)
        target = self._live.get(parsed[0]) if parsed is not None else None
        if parsed is None or chat is None or (target is not None and not target.live()):
            return Press(PressOutcome.ENDED, ENDED)
        token, asker = parsed
        if not await may_press(chat, user_id, asker, is_admin):
            who = target.asker_name if target is not None else "the person who asked"
            return Press(PressOutcome.REFUSED, f"Only {who} or an admin can stop this answer.")
        # Where the answer streams (its topic or thread included), if it streams here.
        msg = _stop_message(target.chat if target is not None else chat, token, user_id, user_name, press_id)
        notices: list[str] = []
        self._absorbing[msg.message_id] = notices
        try:
            # The session: known here if the answer streams here; else the chat's, as for a typed /stop.
            result = await submit(msg, target.run.session_key if target is not None else None)
        finally:
            self._absorbing.pop(msg.message_id, None)
        log.info("%s: Stop button pressed: %s %s", self.platform, result.outcome.value, result.detail)
        return press_answer(result, notices)


async def may_press(chat: ChatRef, user_id: str, asker_id: str, is_admin: Callable[[], Awaitable[bool]]) -> bool:
    """In a private chat anyone there may; in a group the asker, or an admin (asked only then)."""
    return chat.chat_type is ChatType.DM or user_id == asker_id or await is_admin()


def _stop_message(chat: ChatRef, token: str, user_id: str, user_name: str, press_id: str) -> InboundMessage:
    """The `/stop` a press submits: for the button's run only."""
    return InboundMessage(platform=chat.platform, chat_id=chat.chat_id, chat_type=chat.chat_type,
                          thread_id=chat.thread_id, user_id=user_id, user_name=user_name,
                          message_id=PRESS_PREFIX + press_id, text=f"/stop {RUN_ARG}{token}")


# What a press's /stop came to, where it needs no more than its outcome.
_ANSWERS = {
    Outcome.FORWARDED: Press(PressOutcome.STOPPED, "Stopping…"),  # cluster mode: the session's owner stops it
    Outcome.UNAVAILABLE: Press(PressOutcome.FAILED, "Could not stop it right now; please try /stop."),
}


def press_answer(result: Submitted, notices: list[str]) -> Press:
    """What the presser is told, from what the router did with the press's `/stop` (and the
    notices it sent about it: a refusal says why)."""
    if result.outcome is Outcome.COMMAND:
        return Press(PressOutcome.STOPPED if result.detail == STOPPED else PressOutcome.ENDED, result.detail or ENDED)
    answer = _ANSWERS.get(result.outcome)
    if answer is not None:
        return answer
    return Press(PressOutcome.REFUSED, notices[0] if notices else "Sorry, you cannot use this bot.")
