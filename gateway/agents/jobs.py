"""Background jobs: a shell command that outlives the tool call that started it.

A `shell` call runs in the foreground like any tool, but it can *move to the background*: when
the user writes while it runs (busy "steer" or "interrupt", once it is `yield_after_s` old), when
it runs past `foreground_max_s`, or when the model asks for it (`background: true`). Its process
group is then adopted by this registry as it is — same group, same reaper, same ledger record, so
it still dies with the daemon however that ends — and the call returns at once with the job's id
and the output so far. The model manages jobs with `job_status`, `job_read`, `job_wait` and
`job_kill`; when a job ends on its own (or past `job_max_s`) the session gets one automatic
message saying so, unless the model already saw the end through one of those tools.

Jobs belong to a session: a session sees and kills only its own. `/new` (and lease loss, and the
daemon's stop) kills a session's jobs with the reason named; a `/stop` stops the turn, not them.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import contextvars
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.agents.processes import ProcessReaper, Spawn
from gateway.core.background import JOB_PREFIX
from gateway.core.cancellation import ToolReason, get_run

log = logging.getLogger(__name__)

KEEP_FINISHED_PER_SESSION = 8  # ended jobs a session still lists (job_status, /jobs)
KEEP_FINISHED = 1_000  # and in all
JobState = Literal["running", "exited", "killed"]
Deliver = Callable[[str, str, str], Awaitable[bool]]  # (session key, unique message id, text) -> handed over

# Set by the agent around each tool call: a way to say what became of the call if its turn is
# stopped before the call returns (a job moved to the background by an interrupting message).
call_note: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("call_note", default=None)

KILLED_BY_AGENT = ToolReason.system("killed by the agent (job_kill)")


@dataclass(frozen=True, slots=True)
class JobSettings:
    yield_after_s: float = 5.0  # a command this old moves to the background when the user writes
    foreground_max_s: float = 0.0  # a command this old moves on its own; 0: never
    max_per_session: int = 4  # running jobs
    max_total: int = 16
    job_max_s: float = 3600.0  # a job running longer is killed (its session is told)
    buffer_chars: int = 65_536  # output kept per job (the newest)
    read_chars: int = 4_000  # at most this much per job_read, and in a completion notice
    wait_max_s: float = 300.0  # the longest job_wait


class OutputBuffer:
    """A job's output as text, the newest `cap` characters of it; positions count every
    character ever appended, so a reader knows what it missed."""

    __slots__ = ("_decoder", "cap", "text", "total")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.text = ""
        self.total = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        if text:
            self.total += len(text)
            self.text = (self.text + text)[-self.cap:]

    @property
    def start(self) -> int:
        return self.total - len(self.text)

    def since(self, pos: int, limit: int) -> tuple[str, int, int]:
        """(text, new position, characters lost to the cap before it) from `pos`, at most `limit`."""
        begin = max(pos, self.start)
        chunk = self.text[begin - self.start:][:limit]
        return chunk, begin + len(chunk), begin - pos


class Job:
    __slots__ = ("command", "ended", "ended_at", "id", "out", "proc", "pump", "read_pos", "reason", "returncode",
                 "seen_end", "session", "spawn", "started", "state", "waiters")

    def __init__(self, job_id: str, session: str, command: str, spawn: Spawn, proc: asyncio.subprocess.Process,
                 out: OutputBuffer, pump: asyncio.Task[None], started: float) -> None:
        self.id = job_id
        self.session = session
        self.command = command
        self.spawn = spawn
        self.proc = proc
        self.out = out
        self.pump = pump
        self.started = started  # monotonic, when the command started (in the foreground)
        self.ended_at: float | None = None
        self.state: JobState = "running"
        self.returncode: int | None = None
        self.reason: ToolReason | None = None  # why it was killed
        self.read_pos = 0
        self.ended = asyncio.Event()
        self.waiters = 0  # job_wait calls waiting now: they report the end themselves
        self.seen_end = False  # the model saw the end (job_wait, job_status, job_read): no notice

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def runtime(self) -> float:
        return (self.ended_at or time.monotonic()) - self.started

    def summary(self) -> str:
        if self.state == "running":
            state = f"running for {self.runtime():.0f} s"
        elif self.state == "killed" and self.reason is not None:
            state = f"killed after {self.runtime():.0f} s ({self.reason.marker})"
        else:
            state = f"exited with code {self.returncode} after {self.runtime():.0f} s"
        unread = max(0, self.out.total - max(self.read_pos, self.out.start))
        return f"{self.id}: {state}; {unread} characters unread · $ {_short(self.command)}"

    def end_line(self) -> str:
        if self.state == "killed" and self.reason is not None:
            return f"[background job {self.id} stopped: {self.reason.marker}]"
        return f"[background job {self.id} finished: exit {self.returncode}]"


class Foreground:
    """A shell command running in a tool call now, which may move to the background."""

    __slots__ = ("command", "job", "note", "out", "proc", "pump", "requested", "session", "spawn", "started", "wake")

    def __init__(self, session: str, command: str, spawn: Spawn, note: Callable[[str], None] | None) -> None:
        self.session = session
        self.command = command
        self.spawn = spawn
        self.note = note
        self.started = time.monotonic()
        self.proc: asyncio.subprocess.Process | None = None
        self.out: OutputBuffer | None = None
        self.pump: asyncio.Task[None] | None = None
        self.job: Job | None = None  # set once adopted: from then on the registry owns the group
        self.requested = False  # the user wrote: move once `yield_after_s` old
        self.wake = asyncio.Event()


class JobRegistry:
    """Every background job of this daemon, by session; and the foreground commands that may
    become one. `deliver` (set by the daemon) hands a completion notice to the router."""

    def __init__(self, reaper: ProcessReaper, settings: JobSettings | None = None) -> None:
        self.reaper = reaper
        self.settings = settings or JobSettings()
        self.deliver: Deliver | None = None
        self._jobs: dict[str, dict[str, Job]] = {}  # session -> job id -> job (finished ones too, a few)
        self._foreground: dict[str, set[Foreground]] = {}
        self._waits: dict[str, set[asyncio.Event]] = {}  # job_wait calls, by session
        self._ids = itertools.count(1)
        self._token = os.urandom(4).hex()  # message ids of notices stay unique across restarts
        self._tasks: set[asyncio.Task[None]] = set()
        self._ended: deque[Job] = deque()  # ended jobs still listed, oldest first
        self.closing = False

    # --- what the router asks ------------------------------------------------------------------

    def running(self, session: str | None = None) -> list[Job]:
        jobs = (self._jobs.get(session, {}).values() if session is not None
                else [j for s in self._jobs.values() for j in s.values()])
        return [j for j in jobs if j.state == "running"]

    def jobs(self, session: str) -> list[Job]:
        return list(self._jobs.get(session, {}).values())

    def yield_foreground(self, session: str, *, now: bool) -> list[str]:
        """The user wrote in `session`. `now` (busy "interrupt": the turn is cancelled right after
        this returns): commands old enough move to the background at once, synchronously, so the
        cancel no longer reaches their group; younger ones die with the turn as before. Otherwise
        (busy "steer") each command moves once it is old enough. Returns the jobs made now."""
        moved = []
        for fg in list(self._foreground.get(session, ())):
            fg.requested = True
            old_enough = fg.proc is not None and time.monotonic() - fg.started >= self.settings.yield_after_s
            if now and old_enough and (job := self._adopt(fg)) is not None:
                moved.append(job.id)
                if fg.note is not None:
                    fg.note(moved_text(job, reason="the user sent a new message"))
            fg.wake.set()
        if not now:
            for woken in self._waits.get(session, ()):
                woken.set()
        return moved

    def kill_session(self, session: str, reason: ToolReason) -> int:
        """Kill every running job of `session` (no notices: the reason is the session's end)."""
        jobs = self.running(session)
        for job in jobs:
            self._kill(job, reason)
        if jobs:
            log.info("killed %d background job(s): %s", len(jobs), reason.marker, extra={"session": session})
        return len(jobs)

    def kill_all(self, reason: ToolReason) -> list[tuple[str, str, str]]:
        """The daemon stops: every job dies (through the reaper, which the daemon drains). Returns
        the notices of the jobs it killed (session, message id, text), for the router to leave in
        the store: they are told on the next start."""
        self.closing = True
        jobs = self.running()
        for session in list(self._jobs):
            self.kill_session(session, reason)
        return [(job.session, self._message_id(job), self._notice(job)[0]) for job in jobs]

    def count_running(self, session: str) -> int:
        return len(self.running(session))

    def describe(self, session: str) -> list[str]:
        return [job.summary() for job in self.jobs(session)]

    def kill_job(self, session: str, job_id: str, reason: ToolReason) -> str | None:
        job = self._jobs.get(session, {}).get(_job_id(job_id))
        if job is None:
            return None
        if job.state != "running":
            return f"Job {job.id} had already ended."
        self._kill(job, reason)
        return f"Killed job {job.id}."

    def room(self, session: str) -> str | None:
        """Why another job cannot start in `session` now, or None."""
        s = self.settings
        if len(self.running(session)) >= s.max_per_session:
            return f"this chat already has {s.max_per_session} background jobs running (tools.jobs_per_session)"
        if len(self.running()) >= s.max_total:
            return f"the gateway already runs {s.max_total} background jobs (tools.jobs_total)"
        return None

    async def close(self) -> None:
        """Wait for the jobs' watchers (after `kill_all`)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # --- the shell tool ------------------------------------------------------------------------

    async def run_shell(self, argv: Sequence[str], *, command: str, timeout_s: float, max_output: int,
                        cwd: str | None, background: bool) -> str:
        """Run a command in its own process group, bound to the current run — until it ends, times
        out, or moves to the background (then the group belongs to the registry)."""
        run = get_run()
        if run is not None and run.reason is not None:
            raise asyncio.CancelledError(run.reason.marker)  # stopped already: start nothing
        session = run.session_key if run is not None else "-"
        if background and (full := self.room(session)) is not None:
            return f"error: not started: {full}; end one with job_kill or wait for it"
        fg = Foreground(session, command, self.reaper.spawn(argv, cwd=cwd), call_note.get())

        def close() -> None:  # the run's closer: a job is no longer the turn's to kill
            if fg.job is None:
                fg.spawn.stop()

        waker: asyncio.Task[bool] | None = None
        try:
            with run.on_cancel(close) if run is not None else contextlib.nullcontext():
                self._foreground.setdefault(session, set()).add(fg)  # a message from now on is seen
                proc = await asyncio.shield(fg.spawn.task)
                if proc is None:
                    raise asyncio.CancelledError("stopped before the process started")
                fg.proc, fg.out = proc, OutputBuffer(max(self.settings.buffer_chars, max_output))
                fg.pump = asyncio.get_running_loop().create_task(_pump(proc, fg.out), context=contextvars.Context())
                if background:
                    if (job := self._adopt(fg)) is None:  # the last slot went to a call beside this one
                        return f"error: not started: {self.room(session) or 'the gateway is stopping'}"
                    return f"[started in background: job {job.id}] use job_read, job_wait or job_kill"
                deadline = fg.started + timeout_s
                auto = fg.started + self.settings.foreground_max_s if self.settings.foreground_max_s > 0 else None
                while not fg.pump.done():
                    now = time.monotonic()
                    moment = fg.started + self.settings.yield_after_s if fg.requested else None
                    if (moment is not None and now >= moment) or (auto is not None and now >= auto):
                        why = "the user sent a new message" if moment is not None and now >= moment else \
                            f"it ran past tools.foreground_max_s ({self.settings.foreground_max_s:g} s)"
                        if (job := self._adopt(fg)) is not None:
                            return self._handover(job, why, max_output)
                        fg.requested, auto = False, None  # no room: it runs on in the foreground
                        continue
                    if now >= deadline:
                        break
                    wake_at = min(t for t in (deadline, moment, auto) if t is not None)
                    fg.wake.clear()
                    waker = asyncio.ensure_future(fg.wake.wait())
                    await asyncio.wait({fg.pump, waker}, timeout=max(0.0, wake_at - now),
                                       return_when=asyncio.FIRST_COMPLETED)
                    waker.cancel()
                timed_out = not fg.pump.done()
        finally:
            if waker is not None:
                waker.cancel()
            self._foreground.get(session, set()).discard(fg)
            if not self._foreground.get(session, True):
                self._foreground.pop(session, None)
            if fg.job is None:  # stopped, timed out, or finished with children left behind: the group goes
                fg.spawn.stop()
                if fg.pump is not None and not fg.pump.done():
                    fg.pump.cancel()
        return _format(fg.proc, fg.out, max_output, timed_out)

    def _handover(self, job: Job, why: str, max_output: int) -> str:
        """The call's result when its command moves: what it printed so far, which counts as read."""
        so_far, job.read_pos, _ = job.out.since(max(0, job.out.total - max_output), max_output)
        return moved_text(job, reason=why) + (f"\noutput so far:\n{so_far}" if so_far else "\n(no output yet)")

    # --- the job tools -------------------------------------------------------------------------

    def _find(self, job_id: object) -> Job | str:
        """The current session's job, or an error text for the model."""
        run = get_run()
        session = run.session_key if run is not None else "-"
        job = self._jobs.get(session, {}).get(_job_id(str(job_id)))
        if job is None:
            return f"error: no job {job_id!r} in this chat (job_status lists them)"
        return job

    def status(self, job_id: object | None) -> str:
        if job_id is None or job_id == "":
            run = get_run()
            listed = self.jobs(run.session_key if run is not None else "-")
        else:
            found = self._find(job_id)
            if isinstance(found, str):
                return found
            listed = [found]
        for job in listed:
            job.seen_end = job.seen_end or job.state != "running"
        return "\n".join(j.summary() for j in listed) or "no background jobs"

    def read(self, job_id: object, max_chars: object | None) -> str:
        job = self._find(job_id)
        if isinstance(job, str):
            return job
        limit = self.settings.read_chars
        if max_chars is not None:
            limit = max(1, min(limit, int(str(max_chars))))
        text, job.read_pos, lost = job.out.since(job.read_pos, limit)
        notes = []
        if lost:
            notes.append(f"[{lost} characters lost: only the last {job.out.cap} are kept]")
        if (unread := job.out.total - job.read_pos) > 0:
            notes.append(f"[{unread} more characters: read again]")
        elif job.state != "running":
            notes.append(job.end_line())
            job.seen_end = True
        else:
            notes.append(f"[job {job.id} still running]")
        return "\n".join([text.rstrip("\n") or "(no new output)", *notes])

    async def wait(self, job_id: object, timeout_s: object | None) -> str:
        job = self._find(job_id)
        if isinstance(job, str):
            return job
        limit = self.settings.wait_max_s
        timeout = min(limit, float(str(timeout_s))) if timeout_s is not None else limit
        if timeout < 0:
            raise ValueError("timeout_s must not be negative")
        job.waiters += 1
        woken = asyncio.Event()  # set when the user writes (busy "steer"): the turn goes on at once
        waits = self._waits.setdefault(job.session, set())
        waits.add(woken)
        ended, nudged = asyncio.ensure_future(job.ended.wait()), asyncio.ensure_future(woken.wait())
        try:
            await asyncio.wait({ended, nudged}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            nudged.cancel()
            job.waiters -= 1
            waits.discard(woken)
            if not waits:
                self._waits.pop(job.session, None)
        if job.state != "running" and job.ended.is_set():
            job.seen_end = True
            out = self.read(job.id, None)  # ends with the end line once nothing is left unread
            return out if out.endswith(job.end_line()) else f"{job.end_line()}\n{out}"
        if woken.is_set():
            return f"[wait ended: the user sent a new message; job {job.id} still running]"
        return f"[job {job.id} still running after {timeout:g} s]"

    async def kill_tool(self, job_id: object) -> str:
        job = self._find(job_id)
        if isinstance(job, str):
            return job
        if job.state != "running":
            job.seen_end = True
            return f"job {job.id} had already ended: {job.end_line()}"
        self._kill(job, KILLED_BY_AGENT)
        with contextlib.suppress(TimeoutError):  # TERM now, KILL after the grace: then its output ends
            await asyncio.wait_for(job.ended.wait(), self.reaper.grace_s + 5)
        job.seen_end = True
        if not job.ended.is_set():
            return f"job {job.id} is being killed (its processes are still ending)"
        return f"job {job.id} killed ({job.reason.marker if job.reason else 'killed'})"

    # --- inside ------------------------------------------------------------------------------

    def _adopt(self, fg: Foreground) -> Job | None:
        """Make `fg` a job (synchronously); None if the limits do not allow another."""
        if fg.job is not None:
            return fg.job
        if fg.proc is None or fg.out is None or fg.pump is None or self.closing:
            return None
        if (full := self.room(fg.session)) is not None:
            log.info("a command stays in the foreground: %s", full, extra={"session": fg.session})
            return None
        job = Job(f"j{next(self._ids)}", fg.session, fg.command, fg.spawn, fg.proc, fg.out, fg.pump, fg.started)
        fg.job = job
        jobs = self._jobs.setdefault(fg.session, {})
        jobs[job.id] = job
        self._prune(jobs)
        task = asyncio.get_running_loop().create_task(self._watch(job), context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.info("job %s moved to the background (process group %d)", job.id, job.pgid,
                 extra={"session": fg.session})
        return job

    def _prune(self, jobs: dict[str, Job]) -> None:
        """Keep the running jobs and the last few finished ones of a session."""
        finished = [j for j in jobs.values() if j.state != "running"]
        for job in finished[:-KEEP_FINISHED_PER_SESSION]:
            jobs.pop(job.id, None)

    def _forget_old(self, job: Job) -> None:
        """A job ended: keep at most `KEEP_FINISHED` ended jobs in all (then sessions without jobs go)."""
        self._ended.append(job)
        while len(self._ended) > KEEP_FINISHED:
            old = self._ended.popleft()
            jobs = self._jobs.get(old.session)
            if jobs is not None and jobs.get(old.id) is old:
                del jobs[old.id]
                if not jobs:
                    del self._jobs[old.session]

    def _kill(self, job: Job, reason: ToolReason) -> None:
        if job.state != "running":
            return
        job.state, job.reason = "killed", reason
        job.spawn.stop()  # TERM to the group now, KILL after the grace (the reaper)

    async def _watch(self, job: Job) -> None:
        """Until the job ends: its output is read by its pump; past `job_max_s` it is killed."""
        left = self.settings.job_max_s - job.runtime()
        try:
            await asyncio.wait_for(asyncio.shield(job.pump), max(0.0, left))
        except TimeoutError:
            self._kill(job, ToolReason.system(f"ran past tools.job_max_s ({self.settings.job_max_s:g} s)"))
        except Exception:
            log.exception("reading a job's output failed")
        if not job.pump.done():  # killed: the output ends when the group is gone
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(job.pump), self.reaper.grace_s + 5)
            job.pump.cancel()
        job.returncode = job.proc.returncode
        job.ended_at = time.monotonic()
        if job.state == "running":
            job.state = "exited"
        job.spawn.stop()  # anything it left running in its group goes too
        job.ended.set()
        self._forget_old(job)
        log.info("job %s ended: %s", job.id, job.end_line(), extra={"session": job.session})
        await asyncio.sleep(0)  # a job_wait woken by the end marks it seen first
        if self._tells(job) and self.deliver is not None:
            text, read_to = self._notice(job)
            try:
                if await self.deliver(job.session, self._message_id(job), text):
                    job.read_pos = max(job.read_pos, read_to)  # the model reads it there
            except Exception:
                log.exception("could not deliver the end of job %s", job.id, extra={"session": job.session})

    def _message_id(self, job: Job) -> str:
        return f"{JOB_PREFIX}{self._token}:{job.id}"  # unique to the job, across restarts too

    def _notice(self, job: Job) -> tuple[str, int]:
        """The automatic message that tells the session a job ended — how, the command, and the
        last `read_chars` of the output the model has not read — and where reading it leaves off."""
        limit = self.settings.read_chars
        unread_from = max(job.read_pos, job.out.start)
        skipped = max(0, job.out.total - unread_from - limit)
        tail, read_to, _ = job.out.since(unread_from + skipped, limit)
        return (f"{job.end_line()}\n$ {_short(job.command)}\n"
                + (f"[{skipped} characters of new output before these left out]\n" if skipped else "")
                + (tail.rstrip() or "(no new output)")), read_to

    def _tells(self, job: Job) -> bool:
        """Does the session get a notice? Not if the model saw the end itself, nor when the job
        was killed by the session's end, the daemon's, or on purpose (the killer knows)."""
        if self.closing or job.seen_end or job.waiters:
            return False
        return job.reason is None or job.reason.text.startswith("ran past")


def moved_text(job: Job, *, reason: str) -> str:
    """The tool call's result once its command is a job (the output so far follows it)."""
    return (f"[moved to background: job {job.id} ({reason})] it keeps running; "
            "use job_read, job_wait or job_kill, or wait for the notice when it ends")


def _job_id(text: str) -> str:
    text = text.strip().lower()
    return text if text.startswith("j") else f"j{text}"


def _short(command: str, limit: int = 120) -> str:
    command = " ".join(command.split())
    return command if len(command) <= limit else command[: limit - 1] + "…"


async def _pump(proc: asyncio.subprocess.Process, out: OutputBuffer) -> None:
    """Read a command's output until it closes, then its exit."""
    assert proc.stdout is not None
    while chunk := await proc.stdout.read(65536):
        out.feed(chunk)
    out.feed(b"", final=True)
    await proc.wait()


def _format(proc: asyncio.subprocess.Process | None, out: OutputBuffer | None, max_output: int,
            timed_out: bool) -> str:
    """A foreground command's result: its output (the last `max_output` characters), how it ended."""
    text = out.text[-max_output:] if out is not None else ""
    if out is not None and out.total > len(text):
        text = f"[output truncated: the first {out.total - len(text)} characters left out]\n{text}"
    if timed_out:
        text += "\n[timed out]"
    code = proc.returncode if proc is not None else None
    return f"exit code {code}\n{text}" if code else text or "(no output)"
