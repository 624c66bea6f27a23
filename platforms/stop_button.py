"""One-tap Stop: the tokens behind the Stop buttons of streaming answers, and what a press does.

A button carries a random token (`stop:<token>`), never a run id: run ids restart with the
process, so an old button could otherwise name a new turn. A press is exactly `/stop` for the
button's session — submitted through the router like a typed one, so access rules, metrics and
the stop itself are the same — but only while the button's own run is still running: a press on
an answer that has ended (or on a button from before a restart) stops nothing and says so.
In a group only the person who asked, or an admin of the chat, may press it.

The router's "Stopped." notice for a press is not sent to the chat: the platform shows it as
the press's own answer (a Telegram toast, a Discord interaction), and the answer's message is
marked "⏹ stopped" as for a typed /stop.
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from gateway.core.cancellation import Run
from gateway.core.commands import STOPPED
from gateway.core.messages import ChatRef, ChatType, InboundMessage
from gateway.core.ports import Gateway, Outcome, Outlet

log = logging.getLogger(__name__)

PREFIX = "stop:"
LABEL = "⏹ Stop"
ENDED = "This answer has already ended."
MAX_LIVE = 10_000  # tokens of answers still streaming; older ones are forgotten (their presses: ENDED)


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


def custom_id(token: str) -> str:
    """The button's payload (Telegram callback_data, Discord custom_id): 17 bytes."""
    return PREFIX + token


def token_of(data: str | None) -> str | None:
    """The token in a button payload, or None if it is not a Stop button's."""
    if data is None or not data.startswith(PREFIX):
        return None
    return data[len(PREFIX):] or None


class StopButtons:
    """The live Stop buttons of one adapter."""

    def __init__(self, platform: str) -> None:
        self.platform = platform
        self._live: OrderedDict[str, StopTarget] = OrderedDict()
        self._absorbing: dict[str, list[str]] = {}  # press id -> notices the router sent for it

    def open(self, msg: InboundMessage, run: Run) -> str:
        """A token for the answer to `msg`, live until `close`."""
        token = secrets.token_urlsafe(9)
        self._live[token] = StopTarget(run, msg.chat, msg.user_id, msg.user_name or "the person who asked")
        while len(self._live) > MAX_LIVE:
            self._live.popitem(last=False)
        return token

    def close(self, token: str | None) -> None:
        if token is not None:
            self._live.pop(token, None)

    def target(self, token: str) -> StopTarget | None:
        return self._live.get(token)

    def absorb(self, reply_to: str | None, text: str) -> bool:
        """A notice the router sends about a press: kept for the press's answer, not sent. True if taken."""
        notices = self._absorbing.get(reply_to) if reply_to is not None else None
        if notices is None:
            return False
        notices.append(text)
        return True

    async def press(self, gateway: Gateway, outlet: Outlet, token: str | None, *, user_id: str, user_name: str,
                    press_id: str, is_admin: Callable[[], Awaitable[bool]]) -> Press:
        """Handle a press of the button for `token` by `user_id`; returns once the cancel is issued."""
        target = self._live.get(token) if token is not None else None
        if target is None or not target.live():
            return Press(PressOutcome.ENDED, ENDED)
        if target.chat.chat_type is not ChatType.DM and user_id != target.asker_id and not await is_admin():
            return Press(PressOutcome.REFUSED, f"Only {target.asker_name} or an admin can stop this answer.")
        if not target.live():  # it ended while the admin check ran
            return Press(PressOutcome.ENDED, ENDED)
        chat = target.chat
        msg = InboundMessage(platform=chat.platform, chat_id=chat.chat_id, chat_type=chat.chat_type,
                             thread_id=chat.thread_id, user_id=user_id, user_name=user_name,
                             message_id=press_id, text="/stop")
        notices: list[str] = []
        self._absorbing[press_id] = notices
        try:
            result = await gateway.submit(msg, outlet, key=target.run.session_key)
        finally:
            self._absorbing.pop(press_id, None)
        log.info("%s: Stop button pressed: %s", self.platform, result.outcome.value,
                 extra={"session": target.run.session_key, "run": target.run.run_id})
        if result.outcome is Outcome.COMMAND:
            return Press(PressOutcome.STOPPED if result.detail == STOPPED else PressOutcome.ENDED,
                         result.detail or ENDED)
        if result.outcome is Outcome.FORWARDED:  # cluster mode: the session's owner stops it
            return Press(PressOutcome.STOPPED, "Stopping…")
        if result.outcome is Outcome.UNAVAILABLE:
            return Press(PressOutcome.FAILED, "Could not stop it right now; please try /stop.")
        return Press(PressOutcome.REFUSED, notices[0] if notices else "Sorry, you cannot use this bot.")
