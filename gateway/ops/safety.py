"""What a configuration exposes, judged before the daemon runs it: `switchboard check` prints every
finding, and both `check` and `run` refuse a configuration with an unsafe one (exit status 2).

Unsafe (refused):
- the main listener off loopback with the web chat on by default: it has no sign-in, so anyone who
  reaches the address can chat and spend the provider's tokens (`webchat.enabled = true` says it
  is meant: then it is a warning);
- the main listener off loopback with the shell tool on and no sandbox to run it in.

Warnings:
- the shell tool on without a sandbox (every user can run commands as the daemon's user);
- the sandbox given the network while the admin listener has no token (commands could call it);
- the data directory readable by others.

And the daemon's own files: `private_data_dir` makes the data directory 0700 (the process runs
with umask 077 under `switchboard run`, as the units set it, so what it creates is 0600/0700).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gateway.agents.sandbox import sandbox_problem
from gateway.ops.config import Config, is_loopback

log = logging.getLogger(__name__)

UMASK = 0o077


@dataclass
class Findings:
    unsafe: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def findings(config: Config) -> Findings:
    found = Findings()
    public = not is_loopback(config.http.host)
    host = config.http.host
    if public and config.webchat_enabled:
        what = (f"the web chat is on and http.host is not loopback ({host}): it has no sign-in, so anyone who "
                "reaches this address can chat and spend the provider's tokens")
        if config.webchat.enabled is None:  # on by default, not by choice
            found.unsafe.append(f"webchat.enabled: {what}; set webchat.enabled = false, or bind to loopback behind "
                                "an authenticating proxy (webchat.enabled = true says it is meant)")
        else:
            found.warnings.append(what)
    tools = config.tools
    problem = sandbox_problem(tools.sandbox) if tools.shell else None
    if tools.shell and problem is not None:
        unsandboxed = (f"the shell tool runs without a sandbox ({problem}): every user who can reach the bot can "
                       "run commands as the daemon's user, read its data directory and call its listeners")
        if public:
            found.unsafe.append(f"tools.shell: {unsandboxed}, and http.host is not loopback ({host}); install "
                                "bubblewrap (tools.sandbox), or turn the shell off")
        else:
            found.warnings.append(unsandboxed)
    if tools.shell and problem is None and tools.sandbox_network and config.admin.enabled and not config.admin.token:
        found.warnings.append("tools.sandbox_network: sandboxed commands share the host's network and the admin "
                              "listener has no token: a command can call it (set admin.token)")
    loose = _loose(Path(config.store.data_dir))
    if loose:
        found.warnings.append(f"store.data_dir: {config.store.data_dir} is {loose} (it holds the conversations "
                              "and the web chat secret): chmod 700 it; the daemon does at start")
    return found


def _loose(path: Path) -> str | None:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    return f"mode {mode:04o}, open to others" if mode & 0o077 else None


def private_data_dir(path: Path) -> None:
    """The data directory, 0700: made so, or narrowed (with a line in the log) if others could enter it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077 and path.stat().st_uid == os.geteuid():
            path.chmod(0o700)
            log.warning("the data directory %s was mode %04o; made it 0700", path, mode)
    except OSError as exc:  # the store's own start says what is wrong with it
        log.debug("could not make %s private: %s", path, exc)
