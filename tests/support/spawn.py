"""Processes a test starts: each the leader of a process group of its own, ended as a group.

`Group` starts a command in a new session (so a new process group, with the command's PID as its
number) and remembers the leader's start time; `Group.end()` SIGKILLs the whole group and reaps
the leader, on every path: whatever the command started in its group goes with it, and a group
number is never signalled once it may name someone else's processes.

`wait_ready` waits for a process to answer over HTTP. Its deadline exists only so that a start that
went wrong fails instead of hanging: it is generous (a Python daemon's imports take tens of seconds
on a machine whose cores are busy), and when it is hit it reports the process's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.procs import running_in_group, stat

# How long a process may take to become ready before the test gives up on it. Only there to avoid a
# hang (a start normally takes 1-3 s; tens of seconds beside two CPU hogs), and below the suite's
# 120 s per-test timeout, so the log tail is what the failure shows.
READY_DEADLINE_S = 90.0


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"(no log at {path})"


class Group(subprocess.Popen[bytes]):
    """`subprocess.Popen` in a session (and process group) of its own; `end()` kills the group."""

    def __init__(self, args: Sequence[str], *, log: Path | None = None, **kwargs: Any) -> None:
        if log is not None:
            with log.open("ab") as out:
                super().__init__(args, stdout=out, stderr=out, start_new_session=True, **kwargs)
        else:
            super().__init__(args, start_new_session=True, **kwargs)
        self.log = log
        found = stat(self.pid)  # not reaped yet, so still there (maybe a zombie)
        self.leader_start = found.start if found is not None else 0

    def log_tail(self, chars: int = 3000) -> str:
        return log_tail(self.log, chars) if self.log is not None else "(no log file)"

    def end(self, timeout: float = 30.0) -> int | None:
        """SIGKILL the process group and reap the leader; safe to call again, or after the process
        exited or was reaped. Returns the leader's exit status."""
        if self.returncode is None:  # not reaped: the PID, and so the group number, are still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self.kill()  # (SIGKILL ends a stopped process too)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(timeout)
        # Reaped: members left in the group are ours as long as they started after the leader (the
        # kernel does not reuse a PID as a process group's number while that group has members).
        for member in running_in_group(self.pid):
            if member.start >= self.leader_start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(member.pid, signal.SIGKILL)
        return self.returncode


async def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, log: Path | None = None,
                     deadline_s: float = READY_DEADLINE_S) -> float:
    """Until GET `url` answers 200: fails with the log's tail if `proc` exits first or `deadline_s`
    pass. Returns the seconds it took."""
    start = time.monotonic()
    tail = (lambda: log_tail(log)) if log is not None else (lambda: "(no log file)")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"{what} exited ({proc.returncode}) before it was ready; log tail:\n{tail()}")
            try:
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (aiohttp.ClientError, TimeoutError):
                pass  # not listening yet, or too busy to answer within 5 s: ask again
            if time.monotonic() - start > deadline_s:
                raise AssertionError(f"{what} was not ready after {deadline_s:.0f} s ({url}); log tail:\n{tail()}")
            await asyncio.sleep(0.05)
