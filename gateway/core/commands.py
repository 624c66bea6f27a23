"""Chat commands. They are parsed here and executed by the router outside the session lane."""

from __future__ import annotations

import re
from dataclasses import dataclass

KNOWN = frozenset({"stop", "new", "reset", "status", "help", "start"})

# "/stop", "/stop@SwitchboardBot", "!stop" (Discord habit). "!" only counts for known names,
# so "!sleep 5" stays an ordinary message for the echo agent.
_COMMAND = re.compile(r"^([/!])([A-Za-z][A-Za-z0-9_]{0,31})(?:@([A-Za-z0-9_]+))?(?:\s+(.*))?$", re.S)

HELP = (
    "Commands:\n"
    "/stop — stop the current answer (and drop queued messages)\n"
    "/new — start a fresh conversation (/reset does the same)\n"
    "/status — what is running in this chat\n"
    "/help — this text"
)


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    args: str
    known: bool


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
    known = name in KNOWN
    if prefix == "!" and not known:
        return None
    return Command(name, (args or "").strip(), known)
