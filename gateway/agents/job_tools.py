"""The model's hold on its background jobs: what `job_status`, `job_read`, `job_wait` and `job_kill`
do, always within the current run's session (a session sees and kills only its own jobs)."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.agents.jobs import Job, JobRegistry
from gateway.core.cancellation import ToolReason, get_run

KILLED_BY_AGENT = ToolReason.system("killed by the agent (job_kill)")


def _session() -> str:
    run = get_run()
    return run.session_key if run is not None else "-"


class JobTools:
    """The job tools over one registry. A tool that shows the model a job's end marks it seen, so
    no automatic notice repeats it."""

    def __init__(self, registry: JobRegistry) -> None:
        self.registry = registry

    def _find(self, job_id: object) -> Job | str:
        """The current session's job, or an error text for the model."""
        job = self.registry.find(_session(), str(job_id))
        if job is None:
            return f"error: no job {job_id!r} in this chat (job_status lists them)"
        return job

    def status(self, job_id: object | None) -> str:
        if job_id is None or job_id == "":
            listed = self.registry.jobs(_session())
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
        limit = self.registry.settings.read_chars
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
        limit = self.registry.settings.wait_max_s
        timeout = min(limit, float(str(timeout_s))) if timeout_s is not None else limit
        if timeout < 0:
            raise ValueError("timeout_s must not be negative")
        job.waiters += 1  # while it waits, the end is this call's to report: no notice
        try:
            with self.registry.user_wake(job.session) as woken:
                await _first(job.ended, woken, timeout)
        finally:
            job.waiters -= 1
        if job.state != "running" and job.ended.is_set():
            job.seen_end = True
            out = self.read(job.id, None)  # ends with the end line once nothing is left unread
            return out if out.endswith(job.end_line()) else f"{job.end_line()}\n{out}"
        if woken.is_set():
            return f"[wait ended: the user sent a new message; job {job.id} still running]"
        return f"[job {job.id} still running after {timeout:g} s]"

    async def kill(self, job_id: object) -> str:
        job = self._find(job_id)
        if isinstance(job, str):
            return job
        if job.state != "running":
            job.seen_end = True
            return f"job {job.id} had already ended: {job.end_line()}"
        job.kill(KILLED_BY_AGENT)
        with contextlib.suppress(TimeoutError):  # TERM now, KILL after the grace: then its output ends
            await asyncio.wait_for(job.ended.wait(), self.registry.reaper.grace_s + 5)
        job.seen_end = True
        if not job.ended.is_set():
            return f"job {job.id} is being killed (its processes are still ending)"
        return f"job {job.id} killed ({job.reason.marker if job.reason else 'killed'})"


async def _first(a: asyncio.Event, b: asyncio.Event, within_s: float) -> None:
    """Until either event is set, or `within_s` has passed."""
    waits = {asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())}
    try:
        await asyncio.wait(waits, timeout=within_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
