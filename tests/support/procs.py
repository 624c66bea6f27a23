"""Processes the tests started, found by PID, parent PID or process group — never by a name
matched across the machine (another `sleep 30` on the host is not ours)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    pid: int
    state: str
    ppid: int
    pgid: int
    start: int  # /proc/PID/stat field 22: with the pid, names one process for the life of the boot


def stat(pid: int) -> Proc | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw.rsplit(b")", 1)[1].split()
    return Proc(pid, fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))


def argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _all() -> list[Proc]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (p := stat(int(entry.name))) is not None:
            found.append(p)
    return found


def running(p: Proc) -> bool:
    """Is this very process (same PID *and* start time) still running (not a zombie)?"""
    now = stat(p.pid)
    return now is not None and now.start == p.start and now.state != "Z"


def running_in_group(pgid: int) -> list[Proc]:
    """Members of process group `pgid` that are alive (not zombies waiting to be reaped)."""
    return [p for p in _all() if p.pgid == pgid and p.state != "Z"]


def children(ppid: int) -> list[Proc]:
    return [p for p in _all() if p.ppid == ppid and p.state != "Z"]


async def until(predicate: Callable[[], bool], timeout: float, what: str, every: float = 0.01) -> float:
    """Wait until `predicate()` holds; fail with `what` after `timeout` s. Returns the time taken."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"after {timeout} s: {what}")
        await asyncio.sleep(every)
    return time.monotonic() - start


async def child_running(ppid: int, command: list[str], timeout: float = 30) -> Proc:
    """The child of `ppid` running exactly `command`, once it has started."""
    found: list[Proc] = []

    def started() -> bool:
        found[:] = [p for p in children(ppid) if argv(p.pid) == command]
        return bool(found)

    await until(started, timeout, f"no child of {ppid} runs {command}")
    return found[0]


async def pids_from(path: Path, count: int, timeout: float = 30) -> list[int]:
    """The first `count` PIDs a tool wrote to `path`, one a line, once it has written them."""
    pids: list[int] = []

    def written() -> bool:
        try:
            lines = path.read_text().split("\n")
        except OSError:
            return False
        pids[:] = [int(line) for line in lines[:-1] if line.strip()]  # complete lines only
        return len(pids) >= count

    await until(written, timeout, f"{path} never held {count} PIDs")
    return pids[:count]
