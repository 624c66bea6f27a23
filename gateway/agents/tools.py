"""Tools an agent may call: a small registry plus the built-in `shell` and `sleep`, and the
background-job tools when jobs are on (see gateway.agents.jobs).

Besides its own tools the registry offers those of its sources (the MCP servers that are up),
asked afresh at every model round: a server that went down takes its tools with it."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.agents.job_tools import JobTools
from gateway.agents.jobs import JobRegistry
from gateway.agents.processes import ProcessReaper, ProcessResult, run_in_process_group
from gateway.core.cancellation import checkpoint

log = logging.getLogger(__name__)

ToolFunc = Callable[[dict[str, Any]], Awaitable[str]]
ToolSource = Callable[[], Iterable["Tool"]]  # tools that come and go (an MCP server's)
_SHELL_META = frozenset(";&|`$<>\n\r(){}")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    func: ToolFunc

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
        """The registered tools and those the sources offer now (a registered name wins)."""
        if not self.sources:
            return self.tools
        found = {t.name: t for source in self.sources for t in source()}
        return {**found, **self.tools}

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.available().values()]

    async def call(self, name: str, arguments: str) -> str:
        """Run a tool; bad calls come back as an error text the model can read, never raise."""
        tool = self.tools.get(name) or self.available().get(name)
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
        if jobs is not None:
            return await jobs.run_shell(["/bin/sh", "-c", command], command=command, timeout_s=_timeout(args, settings),
                                        max_output=settings.max_output, cwd=settings.cwd,
                                        background=args.get("background") is True)
        result = await run_in_process_group(
            ["/bin/sh", "-c", command], reaper=settings.reaper, timeout_s=_timeout(args, settings),
            max_output=settings.max_output, cwd=settings.cwd)
        return _format(result)

    properties: dict[str, Any] = {"command": {"type": "string"},
                                  "timeout_s": {"type": "number", "description": "default 60"}}
    description = "Run a shell command and return its output."
    if jobs is not None:
        properties["background"] = {"type": "boolean",
                                    "description": "start it as a background job and return at once"}
        description += (" A long command may move to the background (when the user writes meanwhile):"
                        " the result then names a job to manage with the job_* tools.")
    return Tool("shell", description, {"type": "object", "properties": properties, "required": ["command"]}, shell)


def job_tools(jobs: JobRegistry) -> list[Tool]:
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
             {"type": "object", "properties": {"job_id": job_id}}, status),
        Tool("job_read", "A background job's output since the last read (bounded).",
             {"type": "object", "properties": {"job_id": job_id, "max_chars": {"type": "integer"}},
              "required": ["job_id"]}, read),
        Tool("job_wait", "Wait for a background job to end, at most timeout_s seconds; then its new output.",
             {"type": "object", "properties": {"job_id": job_id, "timeout_s": {"type": "number"}},
              "required": ["job_id"]}, wait),
        Tool("job_kill", "Kill a background job (its whole process group).",
             {"type": "object", "properties": {"job_id": job_id}, "required": ["job_id"]}, kill),
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
        for tool in job_tools(jobs) if jobs is not None else []:
            registry.register(tool)
    return registry
