"""Tool subprocesses in their own process group, stopped with the run that started them.

A stopped run's group gets SIGTERM at once, then SIGKILL after the grace period if anything in
the group is still alive. The reaper owns those follow-ups so the turn itself can end at once,
and the daemon awaits the reaper at shutdown so no child outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.core.cancellation import get_run

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True, slots=True)
class ProcessResult:
    returncode: int | None
    output: str
    truncated: bool
    timed_out: bool


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux), so a tool's grandchildren are reaped by us, not left
    as zombies under an init that may never reap them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def reap_group(pgid: int) -> None:
    """Collect exited members of a process group that were re-parented to us."""
    while True:
        try:
            if os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG) is None:
                return
        except ChildProcessError:
            return


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProcessReaper:
    """Knows every tool process group alive; terminates them: TERM now, KILL after `grace_s`."""

    def __init__(self, grace_s: float = 2.0) -> None:
        self.grace_s = grace_s
        self._pending: dict[int, asyncio.Task[None]] = {}
        self._live: set[int] = set()  # process groups started and not yet known to be gone
        become_subreaper()

    def track(self, proc: asyncio.subprocess.Process) -> None:
        self._live.add(proc.pid)

    def terminate(self, proc: asyncio.subprocess.Process) -> None:
        """Synchronous first step (SIGTERM to the group); the rest runs in the background."""
        pgid = proc.pid
        if pgid in self._pending:
            return
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            self._live.discard(pgid)
            return
        task = asyncio.get_running_loop().create_task(self._finish(proc, pgid))
        self._pending[pgid] = task

        def done(_task: object) -> None:
            self._pending.pop(pgid, None)
            self._live.discard(pgid)

        task.add_done_callback(done)

    async def _finish(self, proc: asyncio.subprocess.Process, pgid: int) -> None:
        deadline = time.monotonic() + self.grace_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), self.grace_s)
        # Other members have no exit notification we can await: reap and poll briefly. (Only
        # once asyncio has reaped the leader, so we never steal its exit status.)
        while proc.returncode is not None and time.monotonic() < deadline:
            reap_group(pgid)
            if not group_alive(pgid):
                return
            await asyncio.sleep(0.005)
        if group_alive(pgid):
            log.warning("process group %d ignored SIGTERM for %.1f s; sending SIGKILL", pgid, self.grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        await proc.wait()
        for _ in range(200):  # SIGKILL cannot be ignored; collect what it left behind
            reap_group(pgid)
            if not group_alive(pgid):
                return
            await asyncio.sleep(0.005)

    def live_groups(self) -> int:
        """How many tool process groups are alive now."""
        return sum(1 for pgid in self._live if group_alive(pgid))

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def drain(self) -> None:
        """Wait for every group being terminated (shutdown calls this)."""
        while self._pending:
            await asyncio.gather(*list(self._pending.values()), return_exceptions=True)

    def kill_all_now(self) -> None:
        """Last resort at a forced exit: SIGKILL every tool process group still alive."""
        for pgid in self._live | set(self._pending):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


async def run_in_process_group(
    argv: Sequence[str], *, reaper: ProcessReaper, timeout_s: float, max_output: int,
    cwd: str | None = None,
) -> ProcessResult:
    """Run `argv` in a new session/process group, bound to the current run's cancellation."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, start_new_session=True, cwd=cwd)
    reaper.track(proc)
    run = get_run()
    chunks: list[bytes] = []
    size = 0
    truncated = timed_out = False

    async def read_output() -> None:
        nonlocal size, truncated
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            if size < max_output:
                chunks.append(chunk[: max_output - size])
            size += len(chunk)
            truncated = size > max_output
        await proc.wait()

    try:
        with run.on_cancel(lambda: reaper.terminate(proc)) if run else contextlib.nullcontext():
            try:
                await asyncio.wait_for(read_output(), timeout_s)
            except TimeoutError:
                timed_out = True
    finally:
        # Stopped, timed out, or finished with children left behind: the whole group goes.
        reaper.terminate(proc)
    output = b"".join(chunks).decode("utf-8", "replace")
    return ProcessResult(proc.returncode, output, truncated, timed_out)
