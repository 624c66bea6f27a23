"""What outbound calls raise, whatever the platform: the streaming engine acts on these two."""

from __future__ import annotations


class RateLimited(Exception):
    """The platform asked us to wait `retry_after` seconds before the next call."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"rate limited for {retry_after:g} s")
        self.retry_after = retry_after


class OutboundError(Exception):
    """A send or edit failed for a reason retrying will not fix."""
