"""Tool subprocesses in their own process group, stopped with the run that started them — and
with the daemon, however it ends.

- **With the run.** A stopped run's group gets SIGTERM at once, then SIGKILL after the grace
  period if anything in it is still alive; the reaper owns those follow-ups, so the turn itself
  ends at once, and the daemon awaits the reaper at shutdown. The spawn runs in a task of its
  own that a cancel cannot interrupt half-way, and the run's closer is registered before it
  starts: a stop landing at any instant of the spawn terminates the whole group the moment it
  exists (cancelling `create_subprocess_exec` itself would SIGKILL the leader only, leaving the
  children it had already started).
- **With the daemon, dying without a word** (`kill -9`, the OOM killer): the group leader has
  `PR_SET_PDEATHSIG(SIGKILL)`, so the kernel kills it when the thread that forked it ends — the
  event-loop thread, which forks every tool and lives as long as the daemon. Its descendants do not
  inherit that; for them a *sentinel* process (`gateway.agents.sentinel`, in a session of its
  own, started before the first tool) waits on a pipe only the daemon holds, and when the daemon
  is gone kills every group the daemon had recorded and every process carrying the daemon's tag
  (`SWITCHBOARD_TOOL_OF` in the tool's environment, inherited by whatever it starts: this also
  finds a descendant that left the group with `setsid`, and a tool forked an instant before its
  group was recorded).
- **At the next start.** Live groups are recorded in the data dir, one file per group (pgid and
  the leader's start time, /proc/PID/stat field 22) in a directory named after the daemon (PID,
  start time: its tag). A start kills what daemons that no longer exist left running, for when the
  sentinel died too. A group is killed only while its leader's start time still matches, so a PID
  reused by an unrelated process is never hit; a tag names one daemon of one boot.

- **While the daemon runs** (`ProcessReaper.reap_orphans`, swept every few seconds): a tool's
  descendant that left its group (`setsid`, a double fork) escapes the group's TERM and KILL, and
  one re-parented to the daemon (a subreaper) that exits stays a zombie nobody waits for. Every
  tool carries, besides the daemon's tag, the id of its spawn (`SWITCHBOARD_TOOL_SPAWN`); a process
  whose spawn's group is no longer live (its run, job or MCP server has ended) is an orphan, and one
  seen in two sweeps in a row is killed with its group (SIGKILL: its group had its TERM already).
  A zombie re-parented to the daemon and seen twice is reaped (asyncio reaps its own children at
  once, so one still there a sweep later is nobody's).

Limits: a descendant that leaves the group *and* clears its environment (`setsid env -i …`) is
found by neither; while the daemon lives it is re-parented to the daemon (a subreaper) and reaped
when it exits, but only the daemon's end kills a descendant that left its group. Under systemd the
unit's cgroup catches everything (`KillMode=mixed`). The leader gets PDEATHSIG from `setpriv`
(util-linux) when it works, else from a `preexec_fn`; with `setpriv`, a daemon dying in the ~1 ms
between the fork and `setpriv`'s prctl leaves that leader to the sentinel's tag sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gateway.core.cancellation import get_run

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

PdeathsigMethod = Literal["setpriv", "preexec", "none"]


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


# --- /proc ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of /proc/PID/stat that tell a process apart: its state, parent, group, start."""

    pid: int
    state: str
    ppid: int
    pgid: int
    start: int  # field 22: clock ticks after boot; with the pid, unique for the life of the boot


def proc_stat(pid: int) -> ProcStat | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw.rsplit(b")", 1)[1].split()  # the name (field 2) may hold spaces and parentheses
    return ProcStat(pid, fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))


def start_time(pid: int) -> int | None:
    stat = proc_stat(pid)
    return stat.start if stat else None


def group_members(pgid: int) -> list[ProcStat]:
    """Every process of group `pgid` that has not exited (zombies left out)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            stat = proc_stat(int(entry.name)) if entry.name.isdigit() else None
            if stat is not None and stat.pgid == pgid and stat.state != "Z":
                found.append(stat)
    return found


@functools.cache
def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


# --- the record of live groups, and its sweep ---------------------------------------------------

# Every tool is started with this variable naming its daemon's ledger; the tool's descendants
# inherit it, wherever they go (another group, another session), unless they clear their environment.
TOOL_TAG = "SWITCHBOARD_TOOL_OF"
TOOL_SPAWN = "SWITCHBOARD_TOOL_SPAWN"  # which spawn a tool process descends from (see `reap_orphans`)
_ledger_ids = itertools.count(1)


def kill_recorded_group(pgid: int, leader_start: int) -> bool:
    """SIGKILL group `pgid` if it is still the one recorded; True if anything was signalled.

    The leader alive with the recorded start time: the group is ours. The leader alive with another
    start time: the PID was reused, so the group is not ours — untouched. The leader gone: members
    left in the group can only be ours (the kernel does not reuse a PID while a group bears its
    number), provided they started after our leader did.
    """
    leader = proc_stat(pgid)
    if leader is not None:
        if leader.start != leader_start:
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            return True
        return False
    hit = False
    for member in group_members(pgid):
        if member.start >= leader_start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member.pid, signal.SIGKILL)
                hit = True
    return hit


def kill_tagged(tag: str) -> list[int]:
    """SIGKILL every process whose environment carries `TOOL_TAG=tag`: the tools of one daemon
    (identified by its PID and start time, so no unrelated process carries it) and whatever they
    started. Repeated until none is left, for one that forked meanwhile. Returns the PIDs killed."""
    needle = f"{TOOL_TAG}={tag}".encode()
    me, killed = os.getpid(), []
    for _ in range(10):
        found = []
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc"):
                if entry.name.isdigit() and int(entry.name) != me:
                    try:
                        environ = Path(f"/proc/{entry.name}/environ").read_bytes()
                    except OSError:  # gone, or not ours to read (then not ours to kill either)
                        continue
                    if needle in environ.split(b"\0"):
                        stat = proc_stat(int(entry.name))
                        if stat is not None and stat.state != "Z":
                            found.append(stat.pid)
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not found:
            break
        killed += found
        time.sleep(0.01)  # let the kills land before looking again
    return killed


def sweep_records(directory: Path) -> list[int]:
    """Kill what one daemon that is gone left running — the groups recorded in `directory`, and
    every process carrying its tag (the directory's name) — then remove the records. Returns the
    groups and processes that were signalled."""
    killed: list[int] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        entries = []
    boot = boot_id()
    for path in entries:
        with contextlib.suppress(ValueError, OSError):
            if path.name.isdigit():
                start, recorded_boot = path.read_text().split()
                if recorded_boot == boot and kill_recorded_group(int(path.name), int(start)):
                    killed.append(int(path.name))
    killed += [pid for pid in kill_tagged(directory.name) if pid not in killed]
    for path in entries:
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        directory.rmdir()
    return killed


class GroupLedger:
    """This daemon's live tool process groups, on disk, and the sentinel that acts on them.

    `root/<pid>-<start>-<n>/` is this ledger's directory (the daemon's PID and start time, and a
    counter for a process that builds several daemons, as tests do); its name is also the tag in
    every tool's environment. Each `<pgid>` file in it holds the leader's start time and the boot
    id. Several daemons may share one data dir (cluster workers on one host): each sweeps only what
    daemons that no longer exist left. The sentinel is started before the first tool.
    """

    def __init__(self, root: Path, *, owner: tuple[int, int] | None = None) -> None:
        self.root = root
        if owner is None:
            owner = (os.getpid(), start_time(os.getpid()) or 0)
        self.tag = f"{owner[0]}-{owner[1]}-{next(_ledger_ids)}"
        self.dir = root / self.tag
        self._sentinel: subprocess.Popen[bytes] | None = None
        self._pipe: int | None = None  # write end; its only holder is this process
        self._failed = False

    def sweep_stale(self) -> list[int]:
        """At start: kill what daemons that are gone left running; returns what was killed. Also
        creates this daemon's own directory, so that its tag is known even if it dies early."""
        killed: list[int] = []
        with contextlib.suppress(OSError):
            for sub in self.root.iterdir():
                pid, start, *_ = [*sub.name.split("-"), ""]
                if sub == self.dir or not (pid.isdigit() and start.isdigit()):
                    continue
                if start_time(int(pid)) == int(start):
                    continue  # its daemon is alive (another worker sharing the data dir)
                killed += sweep_records(sub)
        if killed:
            log.warning("killed %d tool process group(s) or process(es) left running by a daemon that died: %s",
                        len(killed), ", ".join(map(str, killed)))
        with contextlib.suppress(OSError):
            self.dir.mkdir(parents=True, exist_ok=True)
        return killed

    def prepare(self) -> dict[str, str]:
        """Before a tool is spawned: make sure the sentinel runs; returns the tool's environment."""
        self._ready()
        return {**os.environ, TOOL_TAG: self.tag}

    def add(self, pgid: int, leader_start: int) -> None:
        if self._ready():
            try:
                (self.dir / str(pgid)).write_text(f"{leader_start} {boot_id()}\n")
            except OSError as exc:
                self._fail(exc)

    def remove(self, pgid: int) -> None:
        with contextlib.suppress(OSError):
            (self.dir / str(pgid)).unlink()

    def _ready(self) -> bool:
        """This ledger's directory exists and its sentinel runs (started again if it died)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._watch()
        except OSError as exc:
            self._fail(exc)
            return False
        return True

    def _fail(self, exc: OSError) -> None:
        if not self._failed:
            self._failed = True
            log.warning("cannot record tool process groups in %s (%s); they still die with the daemon's thread "
                        "(PDEATHSIG), but their children may not", self.dir, exc)

    def _watch(self) -> None:
        if self._sentinel is not None and self._sentinel.poll() is None:
            return
        if self._sentinel is not None:
            log.warning("the tool sentinel exited (%s); starting another", self._sentinel.returncode)
            self._close_pipe()
        read, write = os.pipe()  # both close-on-exec: no tool inherits the write end
        try:
            self._sentinel = subprocess.Popen(
                [sys.executable, "-m", "gateway.agents.sentinel", str(self.dir)], stdin=read,
                stdout=subprocess.DEVNULL, start_new_session=True)  # a group kill of the daemon misses it
        except OSError:
            os.close(write)
            raise
        finally:
            os.close(read)
        self._pipe = write

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None

    @property
    def sentinel_pid(self) -> int | None:
        return self._sentinel.pid if self._sentinel is not None else None

    async def close(self, timeout_s: float = 5.0) -> None:
        """At the daemon's stop, after the tools were drained: the sentinel kills what is left
        (nothing, normally; a descendant that left its group, say), removes this daemon's
        directory and exits."""
        self._close_pipe()
        sentinel, self._sentinel = self._sentinel, None
        if sentinel is not None:
            try:
                await asyncio.to_thread(sentinel.wait, timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("the tool sentinel did not exit within %.0f s", timeout_s)
        else:
            await asyncio.to_thread(sweep_records, self.dir)


# --- PDEATHSIG for the group leader ------------------------------------------------------------


@functools.cache
def _libc_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


@functools.cache
def _setpriv_works() -> bool:
    """Does this machine's `setpriv` know --pdeathsig (util-linux 2.33 and later)?"""
    if shutil.which("setpriv") is None:
        return False
    try:
        return subprocess.run(["setpriv", "--pdeathsig", "KILL", "--", "true"], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def default_pdeathsig() -> PdeathsigMethod:
    """`setpriv` where it works: an exec, no fork of the whole daemon. Else a `preexec_fn`, which
    makes Python fork rather than vfork: the event loop stalls for a time that grows with the
    daemon's memory. Measured per spawn on a busy 2-core machine: plain 2-5 ms, setpriv 2.5-5 ms,
    preexec_fn 7.5 ms at 20 MB RSS and 30-55 ms at 500 MB."""
    if _setpriv_works():
        return "setpriv"
    return "preexec" if _libc_prctl() is not None else "none"


def _set_pdeathsig(parent: int, prctl: Callable[..., int]) -> None:
    """Runs in the child between fork and exec: only a system call and two os calls, no lock
    another thread of the daemon could hold. If the daemon died before the prctl took effect, the
    child ends itself — it would never get the signal."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


# --- the reaper ---------------------------------------------------------------------------------


def _spawn_of(pid: int, needle: bytes) -> int | None:
    """The spawn id in a process's environment if it carries `needle` (this daemon's tag)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read (then not ours to kill either)
        return None
    if needle not in environ:
        return None
    prefix = f"{TOOL_SPAWN}=".encode()
    spawn = next((v[len(prefix):] for v in environ if v.startswith(prefix)), b"")
    return int(spawn) if spawn.isdigit() else -1  # tagged without a spawn id: no spawn of ours is live


def orphans(tag: str | None, live_spawns: set[int], live_groups: set[int], keep: set[int]) -> list[ProcStat]:
    """Processes of this daemon's no live tool holds: alive ones carrying `tag` whose spawn has
    ended, and zombies re-parented to this process outside every live group. `keep`: never these."""
    me = os.getpid()
    needle = f"{TOOL_TAG}={tag}".encode() if tag else None
    found: list[ProcStat] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            stat = proc_stat(int(entry.name)) if entry.name.isdigit() else None
            if stat is None or stat.pid == me or stat.pid in keep or stat.pgid in live_groups:
                continue
            if stat.state == "Z":
                if stat.ppid == me:
                    found.append(stat)
            elif needle is not None and (spawn := _spawn_of(stat.pid, needle)) is not None \
                    and spawn not in live_spawns:
                found.append(stat)
    return found


class ProcessReaper:
    """Knows every tool process group alive; terminates them: TERM now, KILL after `grace_s`.

    With a `ledger`, every group is recorded on disk while it lives (see the module docstring).
    """

    def __init__(self, grace_s: float = 2.0, *, ledger: GroupLedger | None = None,
                 pdeathsig: PdeathsigMethod | None = None) -> None:
        self.grace_s = grace_s
        self.ledger = ledger
        self.pdeathsig: PdeathsigMethod = pdeathsig or default_pdeathsig()
        self._pending: dict[int, asyncio.Task[None]] = {}
        self._live: set[int] = set()  # process groups started and not yet known to be gone
        self._spawning: set[asyncio.Task[asyncio.subprocess.Process | None]] = set()
        self._spawn_ids = itertools.count(1)
        self._spawn_of: dict[int, int] = {}  # live group -> the id of the spawn that started it
        self._suspects: set[tuple[int, int]] = set()  # (pid, start) of orphans seen in the last sweep
        become_subreaper()

    @property
    def live_groups(self) -> frozenset[int]:
        """Process groups started and not yet known to be gone."""
        return frozenset(self._live)

    def spawn(self, argv: Sequence[str], *, cwd: str | None = None, pipes: bool = False,
              env: Mapping[str, str] | None = None) -> Spawn:
        """Start `argv` in a new session (its own process group) with PDEATHSIG set; see `Spawn`.

        `pipes`: stdin, stdout and stderr are separate pipes (a server spoken to over stdio) instead
        of no input and one merged output. `env`: the whole environment (else the daemon's)."""
        return Spawn(self, argv, cwd, pipes=pipes, env=env)

    async def _create(self, argv: Sequence[str], cwd: str | None, *, pipes: bool = False,
                      env: Mapping[str, str] | None = None, spawn_id: int = 0) -> asyncio.subprocess.Process:
        kwargs: dict[str, object] = {}
        if env is not None:
            kwargs["env"] = dict(env)
        if self.ledger is not None:  # the sentinel runs before the fork; the tool carries the tag
            tagged = self.ledger.prepare()
            kwargs["env"] = {**(tagged if env is None else env), TOOL_TAG: tagged[TOOL_TAG],
                             TOOL_SPAWN: str(spawn_id)}
        if self.pdeathsig == "setpriv":
            if shutil.which(argv[0]) is None and "/" not in argv[0]:  # as exec would have said
                raise FileNotFoundError(f"No such file or directory: {argv[0]!r}")
            argv = ["setpriv", "--pdeathsig", "KILL", "--", *argv]
        elif self.pdeathsig == "preexec" and (prctl := _libc_prctl()) is not None:
            kwargs["preexec_fn"] = functools.partial(_set_pdeathsig, os.getpid(), prctl)
        pipe = asyncio.subprocess.PIPE
        return await asyncio.create_subprocess_exec(
            *argv, stdin=pipe if pipes else asyncio.subprocess.DEVNULL, stdout=pipe,
            stderr=pipe if pipes else asyncio.subprocess.STDOUT, start_new_session=True, cwd=cwd,
            **kwargs)  # type: ignore[arg-type]

    def track(self, proc: asyncio.subprocess.Process, spawn_id: int = 0) -> None:
        self._live.add(proc.pid)
        self._spawn_of[proc.pid] = spawn_id
        if self.ledger is not None and (start := start_time(proc.pid)) is not None:
            self.ledger.add(proc.pid, start)

    def _forget(self, pgid: int) -> None:
        self._live.discard(pgid)
        self._spawn_of.pop(pgid, None)
        if self.ledger is not None:
            self.ledger.remove(pgid)

    def terminate(self, proc: asyncio.subprocess.Process) -> None:
        """Synchronous first step (SIGTERM to the group); the rest runs in the background."""
        pgid = proc.pid
        if pgid in self._pending:
            return
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            self._forget(pgid)
            return
        task = asyncio.get_running_loop().create_task(self._finish(proc, pgid))
        self._pending[pgid] = task

        def done(_task: object) -> None:
            self._pending.pop(pgid, None)
            self._forget(pgid)

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

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def drain(self) -> None:
        """Wait for every group being started or terminated (shutdown calls this). A task that has
        ended is dropped here, not only by its done callback: that callback may never run (its
        event loop closed first), and waiting on it would never end."""
        while True:
            for pgid, task in list(self._pending.items()):
                if task.done():
                    self._pending.pop(pgid, None)
                    self._forget(pgid)
            self._spawning.difference_update([task for task in self._spawning if task.done()])
            if not self._pending and not self._spawning:
                return
            await asyncio.gather(*list(self._pending.values()), *list(self._spawning), return_exceptions=True)

    async def sweep_orphans(self, every_s: float) -> None:
        """`reap_orphans` every `every_s`, for as long as the daemon runs."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.reap_orphans()
            except Exception:  # never let the sweep die quietly
                log.exception("the sweep for orphaned tool processes failed; retrying")

    async def reap_orphans(self) -> list[int]:
        """One sweep (see the module docstring): kill the orphans, and reap the zombies, seen in the
        previous sweep too — by PID and start time, so a reused PID is a new process. Returns the
        PIDs acted on. The /proc scan runs in a thread, over a snapshot of what is live taken here;
        a tool started during the scan may look orphaned once, never twice."""
        live_groups = self._live | set(self._pending)
        live_spawns = {self._spawn_of[g] for g in live_groups if g in self._spawn_of}
        keep = {pid} if self.ledger is not None and (pid := self.ledger.sentinel_pid) is not None else set()
        tag = self.ledger.tag if self.ledger is not None else None
        found = await asyncio.to_thread(orphans, tag, live_spawns, live_groups, keep)
        seen = {(stat.pid, stat.start) for stat in found}
        due = [stat for stat in found if (stat.pid, stat.start) in self._suspects]
        self._suspects = seen - {(stat.pid, stat.start) for stat in due}
        for stat in due:
            if stat.state == "Z":
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(stat.pid, os.WNOHANG)  # noqa: ASYNC222 (WNOHANG: never waits)
                continue
            log.warning("killing an orphaned tool process %d (group %d): the tool that started it has ended",
                        stat.pid, stat.pgid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if stat.pgid == stat.pid:  # a group of its own (setsid): the whole group goes
                    os.killpg(stat.pgid, signal.SIGKILL)
                else:
                    os.kill(stat.pid, signal.SIGKILL)
            self._suspects.add((stat.pid, stat.start))  # its zombie, if ours to reap, goes at the next sweep
        return [stat.pid for stat in due]

    def kill_all_now(self) -> None:
        """Last resort at a forced exit: SIGKILL every tool process group still alive."""
        for pgid in self._live | set(self._pending):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


class Spawn:
    """One tool process being started, in a task of its own that no cancel interrupts.

    `stop()` may come at any time: before the process exists (it is then never started, or
    terminated the moment it is), or after (its group is terminated now).
    """

    def __init__(self, reaper: ProcessReaper, argv: Sequence[str], cwd: str | None, *, pipes: bool = False,
                 env: Mapping[str, str] | None = None) -> None:
        self._reaper = reaper
        self.proc: asyncio.subprocess.Process | None = None
        self.stopped = False
        self._pipes, self._env = pipes, env
        self.id = next(reaper._spawn_ids)
        self.task = asyncio.get_running_loop().create_task(self._start(list(argv), cwd))
        reaper._spawning.add(self.task)
        self.task.add_done_callback(reaper._spawning.discard)

    async def _start(self, argv: list[str], cwd: str | None) -> asyncio.subprocess.Process | None:
        if self.stopped:
            return None
        proc = self.proc = await self._reaper._create(argv, cwd, pipes=self._pipes, env=self._env,
                                                      spawn_id=self.id)
        self._reaper.track(proc, self.id)
        if self._stopped_meanwhile():
            self._reaper.terminate(proc)
        return proc

    def _stopped_meanwhile(self) -> bool:
        return self.stopped

    def stop(self) -> None:
        self.stopped = True
        if self.proc is not None:
            self._reaper.terminate(self.proc)


async def run_in_process_group(
    argv: Sequence[str], *, reaper: ProcessReaper, timeout_s: float, max_output: int,
    cwd: str | None = None, env: Mapping[str, str] | None = None,
) -> ProcessResult:
    """Run `argv` in a new session/process group, bound to the current run's cancellation. `env`:
    the whole environment (else the daemon's)."""
    run = get_run()
    if run is not None and run.reason is not None:
        raise asyncio.CancelledError(run.reason.marker)  # stopped already: start nothing
    chunks: list[bytes] = []
    size = 0
    truncated = timed_out = False
    spawn = reaper.spawn(argv, cwd=cwd, env=env)

    async def read_output(proc: asyncio.subprocess.Process) -> None:
        nonlocal size, truncated
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            if size < max_output:
                chunks.append(chunk[: max_output - size])
            size += len(chunk)
            truncated = size > max_output
        await proc.wait()

    try:
        # The closer is in place before the process exists; the spawn is shielded, so a cancel
        # landing mid-spawn leaves it to finish and `spawn.stop()` then takes the whole group.
        with run.on_cancel(spawn.stop) if run else contextlib.nullcontext():
            proc = await asyncio.shield(spawn.task)
            if proc is None:
                raise asyncio.CancelledError("stopped before the process started")
            try:
                await asyncio.wait_for(read_output(proc), timeout_s)
            except TimeoutError:
                timed_out = True
    finally:
        # Stopped, timed out, or finished with children left behind: the whole group goes.
        spawn.stop()
    output = b"".join(chunks).decode("utf-8", "replace")
    return ProcessResult(proc.returncode, output, truncated, timed_out)
