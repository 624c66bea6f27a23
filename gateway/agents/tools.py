"""Tools an agent may call: a small registry plus the built-in `shell` and `sleep`, and the
background-job tools when jobs are on (see gateway.agents.jobs).

Besides its own tools the registry offers those of its sources (the MCP servers that are up),
asked afresh at every model round: a server that went down takes its tools with it."""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.agents.job_tools import JobTools
from gateway.agents.jobs import JobRegistry
from gateway.agents.processes import ProcessReaper, ProcessResult, run_in_process_group
from gateway.agents.sandbox import Sandbox
from gateway.core.cancellation import Run, checkpoint, get_run

log = logging.getLogger(__name__)

ToolFunc = Callable[[dict[str, Any]], Awaitable[str]]
ToolSource = Callable[[], Iterable["Tool"]]  # tools that come and go (an MCP server's)
_SHELL_META = frozenset(";&|`$<>\n\r(){}")


@dataclass(frozen=True, slots=True)
class Access:
    """Who may use a tool: session keys (globs) or API tenant names; both empty: everyone."""

    sessions: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()

    def allows(self, run: Run | None) -> bool:
        if not self.sessions and not self.tenants:
            return True
        if run is None:
            return False
        return (any(fnmatch.fnmatchcase(run.session_key, p) for p in self.sessions)
                or (run.tenant is not None and run.tenant in self.tenants))


EVERYONE = Access()


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    func: ToolFunc
    access: Access = EVERYONE  # a tool another session may not use is not offered to it at all

    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description,
                             "parameters": self.parameters}}


@dataclass(slots=True)
class ToolRegistry:
    tools: dict[str, Tool] = field(default_factory=dict)
    sources: list[ToolSource] = field(default_factory=list)
    # Why a tool the model named is not there now (an MCP server that is down), for its error text.
    unavailable: Callable[[str], str | None] | None = None

    def register(self, tool: Tool) -> None:
        self.tools[tool.name] = tool

    def available(self) -> dict[str, Tool]:
        """The registered tools this run may use, and those the sources offer now (a registered
        name wins)."""
        run = get_run()
        own = {name: t for name, t in self.tools.items() if t.access is EVERYONE or t.access.allows(run)}
        if not self.sources:
            return own
        found = {t.name: t for source in self.sources for t in source()}
        return {**found, **own}

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.available().values()]

    async def call(self, name: str, arguments: str) -> str:
        """Run a tool; bad calls come back as an error text the model can read, never raise."""
        tool = self.available().get(name)
        if tool is None:
            why = self.unavailable(name) if self.unavailable is not None else None
            return f"error: {why}" if why else f"error: unknown tool {name!r}"
        try:
            args = json.loads(arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except ValueError as exc:
            return f"error: invalid arguments for {name}: {exc}"
        checkpoint()  # a stopped run starts no tool
        try:
            return await tool.func(args)
        except (ValueError, TypeError, OSError) as exc:
            return f"error: {name} failed: {exc}"


@dataclass(frozen=True, slots=True)
class ProcessToolSettings:
    reaper: ProcessReaper
    max_output: int = 16_000
    default_timeout_s: float = 60.0
    max_timeout_s: float = 600.0
    allow_prefixes: tuple[str, ...] = ()
    cwd: str | None = None
    sandbox: Sandbox | None = None  # None: commands run as the daemon's user, unconfined
    access: Access = EVERYONE  # who may use the shell (and the job tools)


def _format(result: ProcessResult) -> str:
    text = result.output
    if result.truncated:
        text += "\n[output truncated]"
    if result.timed_out:
        text += "\n[timed out]"
    return f"exit code {result.returncode}\n{text}" if result.returncode else text or "(no output)"


def _timeout(args: dict[str, Any], settings: ProcessToolSettings) -> float:
    value = float(args.get("timeout_s", settings.default_timeout_s))
    if value <= 0:
        raise ValueError("timeout_s must be positive")
    return min(value, settings.max_timeout_s)


def shell_tool(settings: ProcessToolSettings, jobs: JobRegistry | None = None) -> Tool:
    async def shell(args: dict[str, Any]) -> str:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("'command' must be a non-empty string")
        if settings.allow_prefixes:
            # A prefix check means nothing if the rest of the line can chain another command.
            if any(c in command for c in _SHELL_META):
                return "error: shell operators (; & | ` $ < > newlines) are not allowed under the allowlist"
            if not any(command.strip().startswith(p) for p in settings.allow_prefixes):
                return "error: command not allowed by the operator's shell allowlist"
        argv, cwd, env = _launch(["/bin/sh", "-c", command], settings)
        if jobs is not None:
            return await jobs.run_shell(argv, command=command, timeout_s=_timeout(args, settings),
                                        max_output=settings.max_output, cwd=cwd, env=env,
                                        background=args.get("background") is True)
        result = await run_in_process_group(argv, reaper=settings.reaper, timeout_s=_timeout(args, settings),
                                            max_output=settings.max_output, cwd=cwd, env=env)
        return _format(result)

    properties: dict[str, Any] = {"command": {"type": "string"},
                                  "timeout_s": {"type": "number", "description": "default 60"}}
    description = "Run a shell command and return its output."
    if jobs is not None:
        properties["background"] = {"type": "boolean",
                                    "description": "start it as a background job and return at once"}
        description += (" A long command may move to the background (when the user writes meanwhile):"
                        " the result then names a job to manage with the job_* tools.")
    return Tool("shell", description, {"type": "object", "properties": properties, "required": ["command"]}, shell,
                settings.access)


def _launch(argv: list[str], settings: ProcessToolSettings) -> tuple[list[str], str | None, dict[str, str] | None]:
    """(argv, working directory, environment) of a command: in its session's sandbox when there is
    one (a command outside any run gets a folder of its own, "-")."""
    if settings.sandbox is None:
        return argv, settings.cwd, None
    run = get_run()
    wrapped, env = settings.sandbox.wrap(argv, run.session_key if run is not None else "-")
    return wrapped, None, dict(env)


def job_tools(jobs: JobRegistry, access: Access = EVERYONE) -> list[Tool]:
    """job_status, job_read, job_wait and job_kill: the model's hold on its background jobs."""
    job_id = {"type": "string", "description": "the job's id, e.g. j3"}
    hold = JobTools(jobs)

    async def status(args: dict[str, Any]) -> str:
        return hold.status(args.get("job_id"))

    async def read(args: dict[str, Any]) -> str:
        return hold.read(_required(args), args.get("max_chars"))

    async def wait(args: dict[str, Any]) -> str:
        return await hold.wait(_required(args), args.get("timeout_s"))

    async def kill(args: dict[str, Any]) -> str:
        return await hold.kill(_required(args))

    return [
        Tool("job_status", "List this chat's background jobs, or describe one.",
             {"type": "object", "properties": {"job_id": job_id}}, status, access),
        Tool("job_read", "A background job's output since the last read (bounded).",
             {"type": "object", "properties": {"job_id": job_id, "max_chars": {"type": "integer"}},
              "required": ["job_id"]}, read, access),
        Tool("job_wait", "Wait for a background job to end, at most timeout_s seconds; then its new output.",
             {"type": "object", "properties": {"job_id": job_id, "timeout_s": {"type": "number"}},
              "required": ["job_id"]}, wait, access),
        Tool("job_kill", "Kill a background job (its whole process group).",
             {"type": "object", "properties": {"job_id": job_id}, "required": ["job_id"]}, kill, access),
    ]


def _required(args: dict[str, Any]) -> str:
    value = args.get("job_id")
    if not isinstance(value, str) or not value.strip():
        raise ValueError("'job_id' must be a job id such as j3")
    return value


def sleep_tool(settings: ProcessToolSettings) -> Tool:
    async def sleep(args: dict[str, Any]) -> str:
        seconds = float(args.get("seconds", 1))
        if not 0 <= seconds <= settings.max_timeout_s:
            raise ValueError(f"seconds must be between 0 and {settings.max_timeout_s:g}")
        result = await run_in_process_group(
            ["sleep", f"{seconds:g}"], reaper=settings.reaper,
            timeout_s=seconds + 5, max_output=1024)
        return f"slept {seconds:g} s" if result.returncode == 0 else _format(result)

    return Tool("sleep", "Wait for a number of seconds (runs the sleep program).",
                {"type": "object", "properties": {"seconds": {"type": "number"}},
                 "required": ["seconds"]},
                sleep)


def builtin_registry(settings: ProcessToolSettings, *, shell: bool, jobs: JobRegistry | None = None,
                     sources: Iterable[ToolSource] = (),
                     unavailable: Callable[[str], str | None] | None = None) -> ToolRegistry:
    """`jobs`: shell commands may become background jobs (only with the shell tool)."""
    registry = ToolRegistry(sources=list(sources), unavailable=unavailable)
    registry.register(sleep_tool(settings))
    if shell:
        registry.register(shell_tool(settings, jobs))
        for tool in job_tools(jobs, settings.access) if jobs is not None else []:
            registry.register(tool)
    return registry
