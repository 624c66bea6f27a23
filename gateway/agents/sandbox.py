"""The shell tool's sandbox: each session's commands run under bubblewrap (`bwrap`, Debian's
`bubblewrap` package), in namespaces of their own.

What a sandboxed command sees:
- **files**: the system read-only (`/usr` and the `/bin`, `/lib` … links to it, and a few files of
  `/etc` a program needs: not the rest of `/etc`, which may hold the daemon's configuration), a
  working folder `/work` and a `/tmp` of its session's own (under `<data_dir>/sandbox/<hash of the
  session key>/`, kept between commands of the session), and nothing else: not the data
  directory (the store, the web chat secret, media, other sessions' folders), not `/home`, `/root`,
  `/run`, `/var`;
- **processes**: its own only (a PID namespace with a fresh `/proc`): not the daemon's, not
  another session's, not an MCP server's (nor their environments);
- **network**: none (a network namespace with only its own loopback), unless
  `tools.sandbox_network`: then the host's, listeners included;
- **environment**: a minimal one (`PATH`, `HOME=/work`, `TMPDIR`, `LANG`), never the daemon's.

Every user namespace maps the daemon's user to itself without capabilities outside. The command
stays in the process group the reaper made (bwrap is not told to start a session of its own), so
a stop's TERM then KILL reaches every process in the sandbox as before, as do PDEATHSIG (on bwrap,
the group leader; `--die-with-parent` passes it on) and the sentinel's tag sweep (the tag is in the
minimal environment). What a start costs is measured in docs/performance.md.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SandboxMode = Literal["auto", "bwrap", "off"]

# What of /etc a program may need (names, certificates, time zone, the alternatives links):
# never the whole of it (the daemon's configuration may be there).
ETC = ("alternatives", "ca-certificates", "ca-certificates.conf", "ssl", "ld.so.cache", "ld.so.conf",
       "ld.so.conf.d", "nsswitch.conf", "passwd", "group", "hosts", "resolv.conf", "localtime", "timezone",
       "mime.types", "os-release", "debian_version", "protocols", "services", "gai.conf", "host.conf")
TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


@functools.cache
def _system_binds() -> tuple[str, ...]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in TOP_LEVEL:
        top = Path("/") / name
        if top.is_symlink():
            args += ["--symlink", os.readlink(top), f"/{name}"]
        elif top.is_dir():
            args += ["--ro-bind", str(top), f"/{name}"]
    for name in ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return tuple(args)


def namespaces(network: bool) -> list[str]:
    flags = ["--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
    return flags if network else [*flags, "--unshare-net"]


@functools.cache
def bwrap_problem() -> str | None:
    """None when bubblewrap is installed and can make a sandbox on this machine; else why not.
    Asked once per process (it runs bwrap once)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    argv = [bwrap, "--die-with-parent", *namespaces(False), *_system_binds(), "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--", "/bin/sh", "-c", "exit 0"]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=20, env={"PATH": PATH})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap does not run here ({type(exc).__name__})"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return f"bubblewrap cannot make a sandbox here ({why[-1] if why else f'exit {done.returncode}'})"
    return None


def sandbox_problem(mode: SandboxMode) -> str | None:
    """Why commands would run without a sandbox under `mode`, or None (they run in one)."""
    return "tools.sandbox is off" if mode == "off" else bwrap_problem()


@dataclass(frozen=True, slots=True)
class Sandbox:
    """Where sessions' folders live (`root`, under the data directory) and what the sandbox allows."""

    root: Path
    network: bool = False
    shared_cwd: str | None = None  # tools.shell_cwd: one folder for every session, the operator's choice

    def folder(self, session_key: str) -> Path:
        return self.root / hashlib.sha256(session_key.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    def wrap(self, argv: Sequence[str], session_key: str) -> tuple[list[str], Mapping[str, str]]:
        """`argv` as run inside the session's sandbox, and the environment to start bwrap with."""
        folder = self.folder(session_key)
        for sub in ("work", "tmp"):
            (folder / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        cwd = self.shared_cwd or "/work"
        binds = ["--bind", str(folder / "work"), "/work", "--bind", str(folder / "tmp"), "/tmp"]
        if self.shared_cwd:
            binds += ["--bind", self.shared_cwd, self.shared_cwd]
        wrapped = ["bwrap", "--die-with-parent", *namespaces(self.network), *_system_binds(), "--proc", "/proc",
                   "--dev", "/dev", *binds, "--chdir", cwd, "--", *argv]  # (no --hostname: ProtectHostname= forbids it)
        env = {"PATH": PATH, "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb"}
        return wrapped, env
