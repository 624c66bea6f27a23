"""The `[mcp]` config section: `[[mcp.servers]]` entries, and their checks."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


@dataclass
class McpServerConfig:
    """One MCP server: `command` (+ `args`, `env`) for stdio, or `url` for streamable HTTP."""

    name: str = ""
    command: str | None = None  # stdio: the program, started by the daemon in a process group of its own
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of a minimal environment (PATH, HOME, ...)
    env_file: str | None = None  # stdio: KEY=VALUE lines (secrets: kept out of logs and `check`)
    cwd: str | None = None
    url: str | None = None  # streamable HTTP endpoint, e.g. http://127.0.0.1:8000/mcp
    headers_file: str | None = None  # HTTP: "Name: value" lines (e.g. Authorization), kept out of logs
    enabled_tools: list[str] = field(default_factory=list)  # names or globs; empty: every tool
    disabled_tools: list[str] = field(default_factory=list)
    timeout_s: float = 60.0  # per call; past it the call is cancelled and the model gets an error
    connect_timeout_s: float = 30.0  # start, initialize and list tools
    ping_interval_s: float = 15.0  # a server that stops answering pings is restarted
    max_backoff_s: float = 60.0  # restarts wait 1, 2, 4 ... up to this many seconds
    required: bool = False  # while down, /readyz fails (else it is only reported there)
    # Who may use it: session keys (globs, e.g. "telegram:dm:12345", "discord:*") or tenants (API key
    # names). Both empty: every session.
    allow_sessions: list[str] = field(default_factory=list)
    allow_tenants: list[str] = field(default_factory=list)


@dataclass
class McpConfig:
    servers: list[McpServerConfig] = field(default_factory=list)


# (where, server) -> the problem, naming the key; None when the rule holds
ServerRule = Callable[[str, McpServerConfig], str | None]


def _one_transport(where: str, s: McpServerConfig) -> str | None:
    if (s.command is None) == (s.url is None):
        return f"{where}: set either command (stdio) or url (streamable HTTP)"
    return None


def _http_url(where: str, s: McpServerConfig) -> str | None:
    if s.url is not None and (urlsplit(s.url).scheme not in ("http", "https") or not urlsplit(s.url).netloc):
        return f"{where}.url: must be an http(s) URL"
    return None


def _command(where: str, s: McpServerConfig) -> str | None:
    if s.command is not None and not s.command.strip():
        return f"{where}.command: must not be empty"
    return None


def _stdio_keys_only_for_stdio(where: str, s: McpServerConfig) -> str | None:
    if s.url is not None and (s.args or s.env or s.env_file or s.cwd):
        return f"{where}: args, env, env_file and cwd are for stdio servers (command)"
    return None


def _http_keys_only_for_http(where: str, s: McpServerConfig) -> str | None:
    if s.command is not None and s.headers_file:
        return f"{where}.headers_file: is for HTTP servers (url)"
    return None


def _timings_positive(where: str, s: McpServerConfig) -> str | None:
    return next((f"{where}.{key}: must be greater than 0"
                 for key in ("timeout_s", "connect_timeout_s", "ping_interval_s", "max_backoff_s")
                 if getattr(s, key) <= 0), None)


def _files_readable(where: str, s: McpServerConfig) -> str | None:
    return next((f"{where}.{key}: cannot read {path}" for key in ("env_file", "headers_file")
                 if (path := getattr(s, key)) is not None and not Path(path).is_file()), None)


SERVER_RULES: tuple[ServerRule, ...] = (
    _one_transport, _http_url, _command, _stdio_keys_only_for_stdio, _http_keys_only_for_http, _timings_positive,
    _files_readable)


def check_mcp(config: McpConfig) -> None:
    """Raise ValueError naming the key of the first bad entry: its name first (by position, as
    the name may be the problem), then `SERVER_RULES` in order (by name)."""
    seen: set[str] = set()
    for i, s in enumerate(config.servers):
        if not SERVER_NAME.match(s.name):
            raise ValueError(f"mcp.servers[{i}].name: 1-32 letters, digits, '_' or '-' (got {s.name!r})")
        if s.name in seen:
            raise ValueError(f"mcp.servers[{i}].name: {s.name!r} is used twice")
        seen.add(s.name)
        for rule in SERVER_RULES:
            if (problem := rule(f"mcp.servers.{s.name}", s)) is not None:
                raise ValueError(problem)
