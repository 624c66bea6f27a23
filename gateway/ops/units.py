"""`switchboard install-unit`: put the systemd unit files in place with ExecStart= pointing at us.

The units live in `systemd/` at the repository root; `gateway/ops/systemd` is a link to it, so an
installed wheel ships the same files and can write them too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from importlib import resources
from pathlib import Path
from typing import TextIO

UNIT_NAMES = ("switchboard.service", "switchboard@.service", "switchboard.target")
DEFAULT_DEST = Path("/etc/systemd/system")
DEFAULT_EXEC = "/usr/local/bin/switchboard"
DEFAULT_CONFIG = "/etc/switchboard/switchboard.toml"
# The units' sandbox hides these from the service: ProtectHome=yes the home folders, PrivateTmp=yes
# the machine's temporary folders (the service gets empty ones of its own). A console script or a
# config file there cannot be read when the service starts.
_HIDDEN = (("/home/", "/root/", "/run/user/"), "a home folder", "ProtectHome=yes"), \
    (("/tmp/", "/var/tmp/"), "a temporary folder", "PrivateTmp=yes")
_UNSAFE = re.compile(r"[\s\"'\\;$`]")


def unit_text(name: str) -> str:
    """A unit file as shipped in the package."""
    if name not in UNIT_NAMES:
        raise ValueError(f"unknown unit {name!r}")
    return resources.files("gateway.ops").joinpath("systemd", name).read_text(encoding="utf-8")


def _check_path(what: str, path: str) -> str:
    if not os.path.isabs(path):
        raise ValueError(f"{what} must be an absolute path (got {path!r})")
    if _UNSAFE.search(path):
        raise ValueError(f"{what} must not contain spaces, quotes, '\\', ';', '$' or '`' (got {path!r})")
    return path.replace("%", "%%")  # "%" starts a systemd specifier


def render_unit(text: str, *, exec_path: str, config_path: str = DEFAULT_CONFIG) -> str:
    """The unit with the console script and config path substituted on its ExecStart= line."""
    exe, cfg = _check_path("exec_path", exec_path), _check_path("config_path", config_path)
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith("ExecStart="):
            line = line.replace(DEFAULT_EXEC, exe, 1).replace(f"--config {DEFAULT_CONFIG}", f"--config {cfg}", 1)
        out.append(line)
    return "".join(out)


def install_units(dest: Path, *, exec_path: str, config_path: str = DEFAULT_CONFIG) -> list[Path]:
    """Write every unit into `dest` (created if missing); returns the paths written.

    Existing files are replaced: local changes belong in drop-ins (`systemctl edit`).
    """
    rendered = {name: render_unit(unit_text(name), exec_path=exec_path, config_path=config_path)
                for name in UNIT_NAMES}  # all validated before anything is written
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered.items():
        path = dest / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o644)
        tmp.replace(path)  # a half-written unit must never be what daemon-reload sees
        written.append(path)
    return written


def default_exec_path() -> str | None:
    """The `switchboard` console script of this installation (the venv we run from), else on PATH."""
    beside = Path(sys.executable).parent / "switchboard"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("switchboard")
    return os.path.abspath(found) if found else None


def exec_path_problems(exec_path: str) -> list[str]:
    """Reasons the service would fail to start this executable; empty when none are known."""
    problems = []
    if not os.path.isfile(exec_path) or not os.access(exec_path, os.X_OK):
        problems.append(f"{exec_path} is not an executable file")
    problems += hidden_path_problems(exec_path, "install into a virtualenv such as /opt/switchboard instead")
    if "/.pyenv/shims/" in exec_path:
        problems.append(f"{exec_path} is a pyenv shim, which needs the caller's shell environment")
    return problems


def hidden_path_problems(path: str, fix: str) -> list[str]:
    """Why the service would not see `path` (nor where its symlinks lead): the units' sandbox hides it."""
    found = []
    for shown in dict.fromkeys((path, os.path.realpath(path))):
        for prefixes, folder, setting in _HIDDEN:
            if shown.startswith(prefixes):
                found.append(f"{shown} is under {folder}, which the unit's {setting} hides from the service; {fix}")
    return found[:1]


def next_steps(written: list[Path], *, config_path: str = DEFAULT_CONFIG) -> str:
    lines = ["wrote:", *(f"  {p}" for p in written), "", "next steps:"]
    if not os.path.exists(config_path):
        lines.append(f"  create {config_path} (annotated example: deploy/switchboard.example.toml)")
    lines += [
        "  put secrets in /etc/credstore/switchboard.<section>.<key> (mode 0600), e.g. switchboard.telegram.token",
        "  systemctl daemon-reload && systemctl enable --now switchboard",
        "  systemctl status switchboard; journalctl -u switchboard -f",
    ]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST,
                        help=f"directory to write the units to (default: {DEFAULT_DEST})")
    parser.add_argument("--exec-path", default=None,
                        help="absolute path of the switchboard executable for ExecStart= "
                             "(default: this installation's console script)")
    parser.add_argument("--config-path", default=DEFAULT_CONFIG,
                        help=f"config file the service runs with (default: {DEFAULT_CONFIG})")


def command(args: argparse.Namespace, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """`switchboard install-unit`; returns the exit status."""
    exec_path = args.exec_path or default_exec_path()
    if exec_path is None:
        print("switchboard: cannot find the switchboard executable; pass --exec-path", file=err)
        return 2
    exec_path = os.path.abspath(exec_path)
    problems = exec_path_problems(exec_path) + hidden_path_problems(
        os.path.abspath(args.config_path), f"keep it in {os.path.dirname(DEFAULT_CONFIG)} instead")
    for problem in problems:
        print(f"switchboard: warning: {problem}", file=err)
    try:
        written = install_units(args.dest, exec_path=exec_path, config_path=args.config_path)
    except ValueError as exc:
        print(f"switchboard: {exc}", file=err)
        return 2
    except OSError as exc:
        print(f"switchboard: cannot write units to {args.dest}: {exc.strerror or exc}", file=err)
        return 1
    out.write(next_steps(written, config_path=args.config_path))
    return 0
