"""What the core needs from background jobs (shell commands moved out of their tool call; the
agents layer keeps them): to move a session's running commands there when the user writes, to end
a session's jobs, to list and kill them for `/jobs` and `/kill`, and to hear when one ended."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.core.cancellation import ToolReason
from gateway.core.transcript import JOB_PREFIX as JOB_PREFIX  # message ids of the messages reporting a job's end

KILLED_BY_USER = ToolReason.user("killed by user (/kill)")


@dataclass(frozen=True, slots=True)
class JobNotice:
    """A job ended and its session should be told: an automatic message, once (its id)."""

    session: str
    message_id: str
    text: str
    told: Callable[[], None]  # call once the message is queued: the model reads the output there


class BackgroundJobs(Protocol):
    async def next_notice(self) -> JobNotice:
        """Wait for the next job end a session should be told of (the core asks; the registry
        never calls into the core)."""

    def yield_foreground(self, session: str, *, now: bool) -> list[str]:
        """The user wrote while a turn of `session` runs: its long commands move to the background —
        at once (`now`: the turn is about to be cancelled) or as soon as they are old enough."""

    def kill_session(self, session: str, reason: ToolReason) -> int:
        """Kill every running job of `session`; how many."""

    def kill_all(self, reason: ToolReason) -> list[tuple[str, str, str]]:
        """Kill every job (the daemon stops). Returns what to tell each session on the next start:
        (session key, message id, text) per job killed."""

    def count_running(self, session: str) -> int: ...

    def describe(self, session: str) -> list[str]:
        """One line per job of `session` (running, and the last few that ended)."""

    def kill_job(self, session: str, job_id: str, reason: ToolReason) -> str | None:
        """Kill one job of `session`; what became of it, or None if it has no such job."""
