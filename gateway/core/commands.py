"""Chat commands: one registry the router dispatches on and the platform menus and `/help` are made from.

Commands run outside the session lane and never wait on a turn. Adding one means adding a
`CommandSpec` here (name, aliases, help text, who may run it, handler); nothing else lists them.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gateway.core.ports import NoticeKind

STOPPED = "Stopped."
ENDED = "This answer has already ended."
RUN_ARG = "run:"  # `/stop run:<token>`: stop only if that run is the one running (a Stop button)

# "/stop", "/stop@SwitchboardBot", "!stop" (Discord habit). "!" only counts for known names,
# so "!sleep 5" stays an ordinary message for the echo agent.
_COMMAND = re.compile(r"^([/!])([A-Za-z][A-Za-z0-9_]{0,31})(?:@([A-Za-z0-9_]+))?(?:\s+(.*))?$", re.S)


class Who(StrEnum):
    """Who may run a command (on top of the platform's access policy, which always applies)."""

    ANYONE = "anyone"


@dataclass(frozen=True, slots=True)
class CommandResult:
    text: str
    kind: NoticeKind = NoticeKind.INFO


class SessionControl(Protocol):
    """What command handlers may do to a session; the router implements it."""

    def stop(self, key: str) -> int:
        """Stop the running turn and drop queued ones; how many were stopped."""

    def stop_run(self, key: str, token: str) -> int:
        """`stop`, but only while the run with `token` is the one running; else nothing (0)."""

    async def reset(self, key: str) -> bool:
        """Stop everything and start a new conversation; False if the store failed."""

    def status_text(self, key: str) -> str: ...

    def busy_policy(self, key: str, policy: str | None = None) -> str:
        """The session's busy policy (interrupt, queue or steer), after setting it if given."""

    def jobs_text(self, key: str) -> str:
        """The session's background jobs, for /jobs."""

    def kill_job(self, key: str, job_id: str) -> str | None:
        """Kill one of the session's background jobs; what happened, or None if there is no such job."""


Handler = Callable[[SessionControl, str, str], Awaitable[CommandResult]]  # (control, session key, args)


@dataclass(frozen=True, slots=True)
class CommandSpec:
    name: str
    summary: str  # one line, for menus and /help
    handler: Handler
    aliases: tuple[str, ...] = ()
    who: Who = Who.ANYONE
    private: bool = False  # answer only the person who asked (Discord: ephemeral)
    in_menu: bool = True  # listed in the platforms' command menus


async def _stop(control: SessionControl, key: str, args: str) -> CommandResult:
    token = args[len(RUN_ARG):] if args.startswith(RUN_ARG) else None
    if control.stop(key) if token is None else control.stop_run(key, token):
        return CommandResult(STOPPED, NoticeKind.STOPPED)
    return CommandResult("Nothing is running." if token is None else ENDED)


async def _new(control: SessionControl, key: str, _args: str) -> CommandResult:
    if await control.reset(key):
        return CommandResult("Started a new conversation. The old one is archived.")
    return CommandResult("Could not start a new conversation (storage error); please try again.", NoticeKind.ERROR)


async def _status(control: SessionControl, key: str, _args: str) -> CommandResult:
    return CommandResult(control.status_text(key))


async def _busy(control: SessionControl, key: str, args: str) -> CommandResult:
    choice = args.strip().lower()
    if not choice:
        return CommandResult(f"While an answer is being written, a new message will {_BUSY[control.busy_policy(key)]}."
                             " Change it with /busy interrupt, /busy queue or /busy steer.")
    try:
        control.busy_policy(key, choice)
    except ValueError:
        return CommandResult("Use /busy interrupt, /busy queue or /busy steer.", NoticeKind.ERROR)
    return CommandResult(f"From now on a new message sent while an answer is being written will {_BUSY[choice]}.")


_BUSY = {"interrupt": "stop it and be answered instead", "queue": "wait for it to finish",
         "steer": "be added to it"}


async def _jobs(control: SessionControl, key: str, _args: str) -> CommandResult:
    return CommandResult(control.jobs_text(key))


async def _kill(control: SessionControl, key: str, args: str) -> CommandResult:
    job_id = args.strip()
    if not job_id:
        return CommandResult("Use /kill <job id>, e.g. /kill j3 (/jobs lists them).", NoticeKind.ERROR)
    done = control.kill_job(key, job_id)
    if done is None:
        return CommandResult(f"No background job {job_id[:20]} in this chat (/jobs lists them).", NoticeKind.ERROR)
    return CommandResult(done)


async def _help(_control: SessionControl, _key: str, _args: str) -> CommandResult:
    return CommandResult(help_text())


COMMANDS: tuple[CommandSpec, ...] = (
    CommandSpec("stop", "Stop the current answer (and drop queued messages)", _stop),
    CommandSpec("new", "Start a fresh conversation (the old one is archived)", _new, aliases=("reset",)),
    CommandSpec("status", "What is running in this chat", _status, private=True),
    CommandSpec("busy", "What a message sent mid-answer does: interrupt, queue or steer", _busy),
    CommandSpec("jobs", "List this chat's background jobs", _jobs, private=True),
    CommandSpec("kill", "End a background job: /kill <id>", _kill),
    CommandSpec("help", "List the commands", _help, aliases=("start",), private=True),
)
_BY_NAME = {name: spec for spec in COMMANDS for name in (spec.name, *spec.aliases)}


def lookup(name: str) -> CommandSpec | None:
    return _BY_NAME.get(name.lower())


def menu() -> list[tuple[str, str]]:
    """(name, summary) of every command a platform should list, aliases included (hidden ones not)."""
    out: list[tuple[str, str]] = []
    for spec in COMMANDS:
        if spec.in_menu:
            out.append((spec.name, spec.summary))
            out += [(alias, f"Same as /{spec.name}") for alias in spec.aliases if alias != "start"]
    return out


def help_text() -> str:
    lines = ["Commands:"]
    for spec in COMMANDS:
        names = " ".join(f"/{n}" for n in (spec.name, *spec.aliases) if n != "start")
        lines.append(f"{names} — {spec.summary}")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    args: str
    spec: CommandSpec | None  # None: not one of ours (answered with "unknown command")

    @property
    def known(self) -> bool:
        return self.spec is not None


def parse_command(text: str, bot_username: str | None = None) -> Command | None:
    """The command in `text`, or None if it is an ordinary message.

    `/cmd@OtherBot` addressed to another bot is not ours and counts as ordinary text.
    """
    m = _COMMAND.match(text.strip())
    if m is None:
        return None
    prefix, name, target, args = m.groups()
    name = name.lower()
    if target and bot_username and target.lower() != bot_username.lower():
        return None
    spec = lookup(name)
    if prefix == "!" and spec is None:
        return None
    return Command(name, (args or "").strip(), spec)
