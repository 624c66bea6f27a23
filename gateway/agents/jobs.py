"""Background jobs: a shell command that outlives the tool call that started it.

A `shell` call runs in the foreground like any tool, but it can *move to the background*: when
the user writes while it runs (busy "steer" or "interrupt", once it is `yield_after_s` old), when
it runs past `foreground_max_s`, or when the model asks for it (`background: true`). Its process
group is then adopted by this registry as it is — same group, same reaper, same ledger record, so
it still dies with the daemon however that ends — and the call returns at once with the job's id
and the output so far. The model manages jobs with `job_status`, `job_read`, `job_wait` and
`job_kill` (`gateway.agents.job_tools`); when a job ends on its own (or past `job_max_s`) the
session gets one automatic message saying so, unless the model already saw the end through one of
those tools.

Jobs belong to a session: a session sees and kills only its own. `/new` (and lease loss, and the
daemon's stop) kills a session's jobs with the reason named; a `/stop` stops the turn, not them.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import contextvars
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.agents.processes import ProcessReaper, Spawn
from gateway.core.background import JOB_PREFIX, JobNotice
from gateway.core.bounded import BoundedMap
from gateway.core.cancellation import ToolReason, get_run
from gateway.core.ids import unique_id

log = logging.getLogger(__name__)

KEEP_FINISHED_PER_SESSION = 8  # ended jobs a session still lists (job_status, /jobs)
KEEP_FINISHED = 1_000  # and in all
JobState = Literal["running", "exited", "killed"]

# Set by the agent around each tool call: a way to say what became of the call if its turn is
# stopped before the call returns (a job moved to the background by an interrupting message).
call_note: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("call_note", default=None)



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
    """A foreground command adopted by the registry: the same group, process, output and reader."""

    __slots__ = ("command", "ended", "ended_at", "id", "notice_id", "out", "proc", "pump", "read_pos", "reason",
                 "returncode", "seen_end", "session", "spawn", "started", "state", "waiters")

    def __init__(self, job_id: str, fg: Foreground) -> None:
        assert fg.proc is not None and fg.out is not None and fg.pump is not None, "only a started command moves"
        self.id = job_id
        # The message id of the notice of its end: unique across sessions, workers and restarts, and
        # unguessable (a keyed hash), so it says nothing of how many jobs others ran.
        self.notice_id = f"{JOB_PREFIX}{unique_id()}"
        self.session = fg.session
        self.command = fg.command
        self.spawn = fg.spawn
        self.proc = fg.proc
        self.out = fg.out
        self.pump = fg.pump
        self.started = fg.started  # monotonic, when the command started (in the foreground)
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

    def person_line(self) -> str:
        """The job as `/jobs` shows it to a person: how long it has run and how much it printed."""
        took = _duration(self.runtime())
        if self.state == "running":
            state = f"running for {took}"
        elif self.state == "killed":
            state = f"stopped after {took}"
        else:
            state = f"exited with code {self.returncode} after {took}"
        printed = f"{self.out.total:,} characters of output" if self.out.total else "no output yet"
        return f"{self.id} · {state} · {printed} · $ {_short(self.command, 60)}"

    def end_line(self) -> str:
        if self.state == "killed" and self.reason is not None:
            return f"[background job {self.id} stopped: {self.reason.marker}]"
        return f"[background job {self.id} finished: exit {self.returncode}]"

    def kill(self, reason: ToolReason) -> None:
        """TERM to the group now, KILL after the grace (the reaper); the first reason stays."""
        if self.state != "running":
            return
        self.state, self.reason = "killed", reason
        self.spawn.stop()

    async def run_to_end(self, max_s: float, grace_s: float) -> None:
        """Until the job ends: its output is read by its pump; past `max_s` it is killed. Then its
        end is recorded and `ended` set."""
        try:
            await asyncio.wait_for(asyncio.shield(self.pump), max(0.0, max_s - self.runtime()))
        except TimeoutError:
            self.kill(ToolReason.system(f"ran past tools.job_max_s ({max_s:g} s)"))
        except Exception:
            log.exception("reading a job's output failed")
        if not self.pump.done():  # killed: the output ends when the group is gone
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(self.pump), grace_s + 5)
            self.pump.cancel()
        self.returncode = self.proc.returncode
        self.ended_at = time.monotonic()
        if self.state == "running":
            self.state = "exited"
        self.spawn.stop()  # anything it left running in its group goes too
        self.ended.set()

    def notice(self, limit: int) -> tuple[str, int]:
        """The automatic message that tells the session the job ended — how, the command, and the
        last `limit` characters of the output the model has not read — and where reading it leaves off."""
        unread_from = max(self.read_pos, self.out.start)
        skipped = max(0, self.out.total - unread_from - limit)
        tail, read_to, _ = self.out.since(unread_from + skipped, limit)
        return (f"{self.end_line()}\n$ {_short(self.command)}\n"
                + (f"[{skipped} characters of new output before these left out]\n" if skipped else "")
                + (tail.rstrip() or "(no new output)")), read_to


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

    async def start(self, buffer_chars: int) -> None:
        """Wait for the process (a cancel meanwhile stops it), then read its output."""
        proc = await asyncio.shield(self.spawn.task)
        if proc is None:
            raise asyncio.CancelledError("stopped before the process started")
        self.proc, self.out = proc, OutputBuffer(buffer_chars)
        self.pump = asyncio.get_running_loop().create_task(_pump(proc, self.out), context=contextvars.Context())

    async def until_moved(self, timeout_s: float, settings: JobSettings,
                          adopt: Callable[[Foreground], Job | None]) -> tuple[Job, str] | None:
        """Wait until the command ends or times out (None), or moves to the background: (its job,
        why) — once the user wrote and it is `yield_after_s` old, or at `foreground_max_s`.
        `adopt` refusing (no room) leaves it running here until it ends or times out."""
        pump = self.pump
        assert pump is not None, "started first"
        deadline = self.started + timeout_s
        auto = self.started + settings.foreground_max_s if settings.foreground_max_s > 0 else None
        while not pump.done():
            now = time.monotonic()
            moment = self.started + settings.yield_after_s if self.requested else None
            if (why := _why_move(now, moment, auto, settings)) is not None:
                if (job := adopt(self)) is not None:
                    return job, why
                self.requested, auto = False, None  # no room: it runs on in the foreground
                continue
            if now >= deadline:
                return None
            await self._sleep(pump, min(t for t in (deadline, moment, auto) if t is not None) - now)
        return None

    async def _sleep(self, pump: asyncio.Task[None], delay: float) -> None:
        """Until the command ends, `wake` is set (the user wrote), or `delay` has passed."""
        self.wake.clear()
        waker = asyncio.ensure_future(self.wake.wait())
        try:
            await asyncio.wait({pump, waker}, timeout=max(0.0, delay), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waker.cancel()

    def stop(self) -> None:
        """The run's closer: its group is stopped — unless it is a job now, no longer the turn's to kill."""
        if self.job is None:
            self.spawn.stop()

    def end(self) -> None:
        """The tool call returns: stopped, timed out, or finished with children left behind, the
        group goes (and its output is read no more) — unless it is a job now."""
        self.stop()
        if self.job is None and self.pump is not None and not self.pump.done():
            self.pump.cancel()


def _why_move(now: float, moment: float | None, auto: float | None, settings: JobSettings) -> str | None:
    """Why a foreground command moves to the background now, if it does."""
    if moment is not None and now >= moment:
        return "the user sent a new message"
    if auto is not None and now >= auto:
        return f"it ran past tools.foreground_max_s ({settings.foreground_max_s:g} s)"
    return None


class JobRegistry:
    """Every background job of this daemon, by session; and the foreground commands that may
    become one. A job's end its session should hear of is a `JobNotice` the core waits for
    (`next_notice`): the registry never calls into the core."""

    def __init__(self, reaper: ProcessReaper, settings: JobSettings | None = None) -> None:
        self.reaper = reaper
        self.settings = settings or JobSettings()
        self._notices: asyncio.Queue[JobNotice] = asyncio.Queue()
        self.notices_sent: deque[tuple[str, str]] = deque(maxlen=100)  # (message id, text), newest last
        self._jobs: dict[str, dict[str, Job]] = {}  # session -> job id -> job (finished ones too, a few)
        self._foreground: dict[str, set[Foreground]] = {}
        self._waits: dict[str, set[asyncio.Event]] = {}  # job_wait calls, by session
        # Job ids count per session (j1, j2, … in each chat): an id says nothing of other sessions' jobs.
        self._numbers: BoundedMap[str, int] = BoundedMap(100_000)
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

    def find(self, session: str, job_id: str) -> Job | None:
        """A job of `session` by its id as a user or the model writes it ("j3", "3", " J3 ")."""
        return self._jobs.get(session, {}).get(_job_id(job_id))

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
            job.kill(reason)
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
        return [(job.session, self._message_id(job), job.notice(self.settings.read_chars)[0]) for job in jobs]

    def count_running(self, session: str) -> int:
        return len(self.running(session))

    def describe(self, session: str) -> list[str]:
        return [job.person_line() for job in self.jobs(session)]

    def kill_job(self, session: str, job_id: str, reason: ToolReason) -> str | None:
        job = self.find(session, job_id)
        if job is None:
            return None
        if job.state != "running":
            return f"Job {job.id} had already ended."
        job.kill(reason)
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
                        cwd: str | None, background: bool, env: Mapping[str, str] | None = None) -> str:
        """Run a command in its own process group, bound to the current run — until it ends, times
        out, or moves to the background (then the group belongs to the registry)."""
        run = get_run()
        if run is not None and run.reason is not None:
            raise asyncio.CancelledError(run.reason.marker)  # stopped already: start nothing
        session = run.session_key if run is not None else "-"
        if background and (full := self.room(session)) is not None:
            return f"error: not started: {full}; end one with job_kill or wait for it"
        fg = Foreground(session, command, self.reaper.spawn(argv, cwd=cwd, env=env), call_note.get())
        with run.on_cancel(fg.stop) if run is not None else contextlib.nullcontext(), self._listening(fg):
            try:
                await fg.start(max(self.settings.buffer_chars, max_output))
                if background:
                    return self._started_in_background(fg)
                moved = await fg.until_moved(timeout_s, self.settings, self._adopt)
                timed_out = moved is None and fg.pump is not None and not fg.pump.done()
            finally:
                fg.end()
        if moved is not None:
            return _handover(*moved, max_output)
        return _format(fg.proc, fg.out, max_output, timed_out)

    def _started_in_background(self, fg: Foreground) -> str:
        """`background: true`: the call's result, a job at once (or why not: the last slot went to a
        call beside this one)."""
        if (job := self._adopt(fg)) is None:
            return f"error: not started: {self.room(fg.session) or 'the gateway is stopping'}"
        return f"[started in background: job {job.id}] use job_read, job_wait or job_kill"

    @contextlib.contextmanager
    def _listening(self, fg: Foreground) -> Iterator[None]:
        """While the call runs, a message from the user in its session is seen (`yield_foreground`)."""
        self._foreground.setdefault(fg.session, set()).add(fg)
        try:
            yield
        finally:
            self._foreground.get(fg.session, set()).discard(fg)
            if not self._foreground.get(fg.session, True):
                self._foreground.pop(fg.session, None)

    @contextlib.contextmanager
    def user_wake(self, session: str) -> Iterator[asyncio.Event]:
        """An event set when the user writes in `session` (busy "steer"): a job_wait ends at once."""
        woken = asyncio.Event()
        waits = self._waits.setdefault(session, set())
        waits.add(woken)
        try:
            yield woken
        finally:
            waits.discard(woken)
            if not waits:
                self._waits.pop(session, None)

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
        jobs = self._jobs.setdefault(fg.session, {})
        job = Job(self._new_id(fg.session, jobs), fg)
        fg.job = job
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

    async def _watch(self, job: Job) -> None:
        """Until the job ends (see `Job.run_to_end`); then its session is told, unless it knows."""
        await job.run_to_end(self.settings.job_max_s, self.reaper.grace_s)
        self._forget_old(job)
        log.info("job %s ended: %s", job.id, job.end_line(), extra={"session": job.session})
        await asyncio.sleep(0)  # a job_wait woken by the end marks it seen first
        if self._tells(job):
            self._tell(job)

    async def next_notice(self) -> JobNotice:
        return await self._notices.get()

    def _tell(self, job: Job) -> None:
        text, read_to = job.notice(self.settings.read_chars)

        def told() -> None:
            job.read_pos = max(job.read_pos, read_to)  # the model reads it there

        message_id = self._message_id(job)
        self.notices_sent.append((message_id, text))
        self._notices.put_nowait(JobNotice(job.session, message_id, text, told))

    def _new_id(self, session: str, jobs: dict[str, Job]) -> str:
        number = self._numbers.get(session, 0) + 1
        while f"j{number}" in jobs:  # (a session whose count was forgotten still lists its jobs)
            number += 1
        self._numbers[session] = number
        return f"j{number}"

    def _message_id(self, job: Job) -> str:
        return job.notice_id

    def _tells(self, job: Job) -> bool:
        """Does the session get a notice? Not if the model saw the end itself, nor when the job
        was killed by the session's end, the daemon's, or on purpose (the killer knows)."""
        if self.closing or job.seen_end or job.waiters:
            return False
        return job.reason is None or job.reason.text.startswith("ran past")


def _handover(job: Job, why: str, max_output: int) -> str:
    """The call's result when its command moves: what it printed so far, which counts as read."""
    so_far, job.read_pos, _ = job.out.since(max(0, job.out.total - max_output), max_output)
    return moved_text(job, reason=why) + (f"\noutput so far:\n{so_far}" if so_far else "\n(no output yet)")


def moved_text(job: Job, *, reason: str) -> str:
    """The tool call's result once its command is a job (the output so far follows it)."""
    return (f"[moved to background: job {job.id} ({reason})] it keeps running; "
            "use job_read, job_wait or job_kill, or wait for the notice when it ends")


def _job_id(text: str) -> str:
    text = text.strip().lower()
    return text if text.startswith("j") else f"j{text}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes} min {seconds} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


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
