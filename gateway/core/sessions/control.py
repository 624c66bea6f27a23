"""Session commands (`/stop`, `/new`, `/status`, `/busy`, `/jobs`, `/kill`): the `SessionControl`
the command handlers in `gateway/core/commands.py` act through. Commands never wait on a lane."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from agent_cache import AgentCache
from gateway.core.background import KILLED_BY_USER, BackgroundJobs
from gateway.core.bounded import BoundedMap
from gateway.core.cancellation import SESSION_RESET, STOPPED_BY_USER
from gateway.core.commands import Command
from gateway.core.intake.answers import reject
from gateway.core.intake.ownership import Owners
from gateway.core.live import Reads
from gateway.core.messages import InboundMessage
from gateway.core.ports import Outcome, Store, StoreError, Submitted
from gateway.core.sessions.lanes import Lanes, Scope
from gateway.core.settings import BUSY_POLICIES, BusyPolicy, CoreSettings
from gateway.core.turns import LiveConversation, Speaker

log = logging.getLogger(__name__)

StatusLine = Callable[[str], str | None]  # more for /status (e.g. the MCP servers' state), per session key


class BusyPolicies:
    """Per-session overrides of the busy policy (/busy), kept while this process runs."""

    def __init__(self, settings: Reads[CoreSettings]) -> None:
        self._settings = settings
        self._chosen: BoundedMap[str, BusyPolicy] = BoundedMap(100_000)

    def get(self, key: str) -> BusyPolicy:
        return self._chosen.get(key, self._settings.value.router.busy)

    def choose(self, key: str, policy: str) -> None:
        for known in BUSY_POLICIES:
            if policy == known:
                self._chosen[key] = known
                return
        raise ValueError(f"busy policy must be one of {', '.join(BUSY_POLICIES)}")


class SessionCommands:
    """Implements `SessionControl` over the lanes, the store and the jobs."""

    def __init__(self, *, lanes: Lanes, store: Store, owners: Owners, cache: AgentCache[LiveConversation],
                 busy: BusyPolicies, settings: Reads[CoreSettings],
                 jobs: BackgroundJobs | None = None, status_lines: Sequence[StatusLine] = ()) -> None:
        self._lanes = lanes
        self._store = store
        self._owners = owners
        self._cache = cache
        self._busy = busy
        self._settings = settings
        self._jobs = jobs
        self._status_lines = tuple(status_lines)

    async def dispatch(self, cmd: Command, key: str, msg: InboundMessage, speaker: Speaker) -> Submitted:
        if cmd.spec is None:
            return await reject(speaker.outlet, msg, key, f"Unknown command /{cmd.name} — try /help.")
        result = await cmd.spec.handler(self, key, cmd.args)
        await speaker.notify(msg.chat, result.text, reply_to=msg.message_id, kind=result.kind)
        return Submitted(Outcome.COMMAND, result.text)

    # --- SessionControl ----------------------------------------------------------------------

    def stop(self, key: str) -> int:
        return len(self._lanes.cancel(key, STOPPED_BY_USER, Scope.SESSION))

    def stop_run(self, key: str, token: str) -> int:
        run = self._lanes.live_run(key)
        if run is None or run.token != token:
            return 0  # that answer has ended (or never ran here): a later one is not stopped for it
        return self.stop(key)

    async def reset(self, key: str) -> bool:
        self._lanes.cancel(key, SESSION_RESET, Scope.SESSION)
        if self._jobs is not None:
            self._jobs.kill_session(key, SESSION_RESET)
        self._cache.discard(key)
        fence = self._owners.fence(key)
        try:
            if fence is None:
                raise StoreError("this worker no longer owns the session")
            await self._store.reset(fence)
            return True
        except StoreError as exc:
            log.error("reset failed: %s", exc, extra={"session": key})
            return False

    def busy_policy(self, key: str, policy: str | None = None) -> str:
        if policy is not None:
            self._busy.choose(key, policy)
        return self._busy.get(key)

    def jobs_text(self, key: str) -> str:
        if self._jobs is None:
            return "Background jobs are off here (they need the shell tool)."
        lines = self._jobs.describe(key)
        return "Background jobs:\n" + "\n".join(lines) if lines else "No background jobs in this chat."

    def kill_job(self, key: str, job_id: str) -> str | None:
        return self._jobs.kill_job(key, job_id, KILLED_BY_USER) if self._jobs is not None else None

    def status_text(self, key: str) -> str:
        s = self._lanes.status(key, self._settings.value.agent.description)
        if s.running and s.since is not None:
            clock = time.strftime("%H:%M:%S", time.localtime(s.since))
            state = f"Running since {clock} ({time.time() - s.since:.0f} s)"
        else:
            state = "Idle"
        text = f"{state} · queued: {s.queued} · busy: {self.busy_policy(key)} · agent: {s.agent}"
        if self._jobs is not None and (jobs := self._jobs.count_running(key)):
            text += f" · background jobs running: {jobs} (/jobs)"
        conversation = self._cache.peek(key)
        if conversation is not None and conversation.prompt_tokens:
            prompt, completion = conversation.tokens_used
            text += (f"\ncontext: {conversation.prompt_tokens:,} tokens in the last request"
                     f" · used so far: {prompt:,} prompt, {completion:,} completion")
        for line in self._status_lines:
            if extra := line(key):
                text += "\n" + extra
        return text
