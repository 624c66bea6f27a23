"""What outbound calls raise, whatever the platform: the streaming engine acts on these."""

from __future__ import annotations


def explain(exc: BaseException) -> str:
    """An exception as a log line's reason: its text, or its type where it has none (a
    `TimeoutError()` says nothing by itself), so no line ends in an empty "failed: "."""
    return str(exc) or type(exc).__name__


class RateLimited(Exception):
    """The platform asked us to wait `retry_after` seconds before the next call."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"rate limited for {retry_after:g} s")
        self.retry_after = retry_after


class OutboundError(Exception):
    """A send or edit failed for a reason retrying will not fix (the bot was blocked, no rights…)."""


class Refused(OutboundError):
    """The platform refused this content (its length, its markup, an empty text…): the same text
    will be refused again, a smaller or plainer one may not."""


class MessageGone(OutboundError):
    """The message to edit no longer exists (deleted by a user or a moderator) or can no longer
    be edited: continue in a new message."""
