"""Configuration: one TOML file, every key overridable by `SWITCHBOARD_<SECTION>__<KEY>`.

Secrets may also come from `<key>_file` (a path) or systemd's `$CREDENTIALS_DIRECTORY`
(a file named `<section>.<key>`). Any problem is a `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent_cache import CacheSettings
from gateway.agents.mcp_config import McpConfig, check_mcp
from gateway.core.attachments import MediaSettings
from gateway.core.router import RouterSettings
from gateway.core.secrets import Secret
from platforms import tenants
from platforms.config import ApiConfig, DiscordConfig, TelegramConfig, WebchatConfig

ENV_PREFIX = "SWITCHBOARD_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(Exception):
    """A bad configuration value; the message names the key."""


@dataclass
class DaemonConfig:
    drain_timeout_s: float = 0.0  # on SIGTERM, let running turns finish for this long first
    resume_max_age_s: float = 600.0  # turns cut off by a restart are resumed if this fresh
    shutdown_grace_s: float = 10.0  # after cancelling, wait this long for outcomes to be recorded
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"  # auto: uvloop where installed (needs a restart)


@dataclass
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    allowed_hosts: list[str] = field(default_factory=list)  # names besides IPs and localhost; "*" = any


@dataclass
class AdminConfig:
    """The operator listener: /metrics, the console and its API. Loopback unless a token is set."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8766
    token: Secret | None = None
    allowed_hosts: list[str] = field(default_factory=list)  # names besides IPs and localhost; "*" = any


@dataclass
class AgentConfig:
    kind: Literal["echo", "openai"] = "echo"
    base_url: str = "http://127.0.0.1:11434/v1"
    model: str = "llama3.2"
    api_key: Secret | None = None
    system_prompt: str | None = None
    echo_delay_s: float = 0.05
    max_tool_rounds: int = 8
    retries: int = 3
    read_timeout_s: float = 120.0
    context_tokens: int = 32_000  # the model's context window
    reply_tokens: int = 4_000  # of it, kept free for the answer
    include_usage: bool = True  # ask the provider for token counts (stream_options.include_usage)
    vision: bool = False  # the model reads images: photos go to it as image_url parts


@dataclass
class ToolsConfig:
    shell: bool = False
    shell_timeout_s: float = 60.0
    shell_max_output: int = 16_000
    shell_allow_prefixes: list[str] = field(default_factory=list)
    shell_cwd: str | None = None
    tool_kill_grace_s: float = 2.0
    parallel: bool = True  # several tool calls of one model round run side by side
    max_parallel: int = 4
    # Background jobs (with the shell tool): a long command moves out of its tool call instead of
    # being killed when the user writes, or once it runs past foreground_max_s.
    jobs: bool = True
    yield_after_s: float = 5.0  # a command at least this old moves when the user writes
    foreground_max_s: float = 0.0  # a command this old moves on its own; 0: never (shell_timeout_s applies)
    jobs_per_session: int = 4  # running jobs per chat...
    jobs_total: int = 16  # ...and in the whole daemon
    job_max_s: float = 3600.0  # a job running longer is killed, and its chat told
    job_buffer_chars: int = 65_536  # output kept per job (the newest)
    job_read_chars: int = 4_000  # at most this much per job_read and per completion notice


@dataclass
class StoreConfig:
    data_dir: str = "./.switchboard"
    # PostgreSQL for history: postgresql://user[:password]@host:5432/db. Unset: SQLite in data_dir,
    # or Redis in cluster mode. With [redis] url too: history in PostgreSQL, coordination in Redis.
    url: Secret | None = None
    keep_days: int = 0  # PostgreSQL: archived conversations and finished inbound records older go; 0 = keep all


@dataclass
class RedisConfig:
    # Set: cluster mode. redis://[:password@]host:6379/0, or redis+cluster://host:7000 for Redis Cluster
    url: Secret | None = None


@dataclass
class ClusterConfig:
    worker_id: str | None = None  # default host:pid; systemd template units pass their instance name
    lease_ttl_s: float = 30.0


@dataclass
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "text"] = "json"


@dataclass
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    webchat: WebchatConfig = field(default_factory=WebchatConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    telegram: TelegramConfig = field(default_factory=TelegramConfig)
    discord: DiscordConfig = field(default_factory=DiscordConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    media: MediaSettings = field(default_factory=MediaSettings)
    mcp: McpConfig = field(default_factory=McpConfig)
    router: RouterSettings = field(default_factory=RouterSettings)
    agent_cache: CacheSettings = field(default_factory=CacheSettings)
    store: StoreConfig = field(default_factory=StoreConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def secrets(self) -> list[str]:
        """Every secret value, for the log redactor."""
        found: list[str] = []
        for section in dataclasses.fields(self):
            for value in vars(getattr(self, section.name)).values():
                items = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) \
                    else [value]
                found += [v.reveal() for v in items if isinstance(v, Secret)]
        return found

    @property
    def webchat_enabled(self) -> bool:
        """Explicit setting, else on unless a chat platform (Telegram, Discord) is configured."""
        if self.webchat.enabled is not None:
            return self.webchat.enabled
        return self.telegram.token is None and self.discord.token is None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None) -> Config:
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    overrides = _env_overrides(env)
    config = Config()
    sections = {f.name for f in dataclasses.fields(config)}
    for section, values in {**overrides, **raw}.items():
        if section not in sections:
            raise ConfigError(f"{section}: unknown section")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a table ([{section}])")
    for section in sections:
        _fill(section, getattr(config, section), raw.get(section, {}), overrides.get(section, {}), env)
    _validate(config)
    return config


def _env_overrides(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and "__" in name:
            section, key = name[len(ENV_PREFIX):].lower().split("__", 1)
            out.setdefault(section, {})[key] = value
    return out


def _fill(section: str, target: Any, values: dict[str, Any], env_values: dict[str, str],
          env: Mapping[str, str]) -> None:
    hints = typing.get_type_hints(type(target))
    names = {f.name for f in dataclasses.fields(target)}
    file_keys = {f"{n}_file": n for n in names if _is_secret(hints[n])}
    creds = env.get("CREDENTIALS_DIRECTORY")
    for source, items in (("file", values), ("env", env_values)):
        for key, value in items.items():
            where = f"{section}.{key}"
            from_text = source == "env"
            if key in file_keys:
                key = file_keys[key]
                value = _read_secret_file(where, str(value)).replace("\n", ",")  # one secret a line
                from_text = True
            elif key not in names:
                raise ConfigError(f"{where}: unknown key")
            setattr(target, key, _coerce(where, value, hints[key], from_env=from_text))
    if creds:  # systemd LoadCredential=: a file named "<section>.<key>"
        for name in names:
            cred = Path(creds) / f"{section}.{name}"
            if _is_secret(hints[name]) and getattr(target, name) in (None, [], {}) and cred.is_file():
                setattr(target, name, _coerce(f"{section}.{name}", _read_secret_file(
                    f"{section}.{name}", str(cred)).replace("\n", ","), hints[name], from_env=True))


def _read_secret_file(where: str, path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror}") from None


def _is_secret(hint: Any) -> bool:
    return Secret in (typing.get_args(hint) or (hint,)) or any(
        Secret in typing.get_args(a) for a in typing.get_args(hint))


def _coerce(where: str, value: Any, hint: Any, *, from_env: bool) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if from_env and value == "":
            return None
        return _coerce(where, value, inner[0], from_env=from_env)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{where}: must be one of {choices} (got {value!r})")
        return value
    if origin is list:
        if from_env and isinstance(value, str):
            try:
                value = json.loads(value) if value.startswith("[") else [
                    v.strip() for v in value.split(",") if v.strip()]
            except ValueError:
                raise ConfigError(f"{where}: must be a JSON list or comma-separated values") from None
        if not isinstance(value, list):
            raise ConfigError(f"{where}: must be a list")
        return [_coerce(f"{where}[{i}]", v, args[0], from_env=from_env) for i, v in enumerate(value)]
    if origin is dict:
        return _coerce_table(where, value, args[1], from_env=from_env)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):  # a table in a list ([[mcp.servers]])
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: must be a table")
        item = hint()
        hints = typing.get_type_hints(hint)
        for key, v in value.items():
            if key not in hints:
                raise ConfigError(f"{where}.{key}: unknown key")
            setattr(item, key, _coerce(f"{where}.{key}", v, hints[key], from_env=False))
        return item
    if hint is bool:
        if from_env and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false (got {value!r})")
        return value
    if hint in (int, float):
        if from_env and isinstance(value, str):
            try:
                value = hint(value)
            except ValueError:
                raise ConfigError(f"{where}: must be a number (got {value!r})") from None
        if isinstance(value, bool) or not isinstance(value, int if hint is int else (int, float)):
            raise ConfigError(f"{where}: must be {'an integer' if hint is int else 'a number'} (got {value!r})")
        return hint(value)
    if hint is Secret:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: must be a non-empty string")
        return Secret(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: must be a string (got {value!r})")
        return value
    raise ConfigError(f"{where}: unsupported type")  # pragma: no cover - a bug in the schema


def _coerce_table(where: str, value: Any, inner: Any, *, from_env: bool) -> dict[str, Any]:
    """A TOML table of names to values; from the environment or a file, a JSON object or
    comma-separated `name=value` pairs."""
    if from_env and isinstance(value, str):
        try:
            value = json.loads(value) if value.startswith("{") else dict(
                (name.strip(), v.strip()) for name, _, v in (p.partition("=") for p in value.split(",") if p.strip()))
        except ValueError:
            raise ConfigError(f"{where}: must be a JSON object or comma-separated name=value pairs") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a table of names")
    return {str(k): _coerce(f"{where}.{k}", v, inner, from_env=from_env) for k, v in value.items()}


def _validate_tenants(c: Config) -> None:
    found = tenants.problem([k.reveal() for k in c.api.keys], {n: k.reveal() for n, k in c.api.tenants.items()})
    if found is not None:
        raise ConfigError(found)


def _validate(c: Config) -> None:
    positive = {"http.port": c.http.port, "router.max_message_chars": c.router.max_message_chars,
                "router.turn_timeout_s": c.router.turn_timeout_s, "agent_cache.max_agents": c.agent_cache.max_agents,
                "agent_cache.idle_ttl_s": c.agent_cache.idle_ttl_s, "tools.shell_timeout_s": c.tools.shell_timeout_s,
                "agent.max_tool_rounds": c.agent.max_tool_rounds, "agent.context_tokens": c.agent.context_tokens,
                "agent.reply_tokens": c.agent.reply_tokens, "tools.max_parallel": c.tools.max_parallel}
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be greater than 0 (got {value})")
    if not 0 < c.http.port < 65536:
        raise ConfigError(f"http.port: must be between 1 and 65535 (got {c.http.port})")
    for key, value in (("daemon.drain_timeout_s", c.daemon.drain_timeout_s),
                       ("daemon.resume_max_age_s", c.daemon.resume_max_age_s),
                       ("daemon.shutdown_grace_s", c.daemon.shutdown_grace_s)):
        if value < 0:
            raise ConfigError(f"{key}: must not be negative")
    if c.cluster.lease_ttl_s < 3:
        raise ConfigError(f"cluster.lease_ttl_s: must be at least 3 seconds (got {c.cluster.lease_ttl_s:g})")
    if c.redis.url is not None and not c.redis.url.reveal().startswith(
            ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
        raise ConfigError("redis.url: must start with redis://, rediss://, unix:// or redis+cluster://")
    if c.store.url is not None and not c.store.url.reveal().startswith(("postgresql://", "postgres://")):
        raise ConfigError("store.url: must start with postgresql:// or postgres:// (SQLite needs no url: "
                          "it lives in store.data_dir)")
    if c.store.keep_days < 0:
        raise ConfigError(f"store.keep_days: must not be negative (got {c.store.keep_days}; 0 keeps everything)")
    if c.store.keep_days and c.store.url is None:
        raise ConfigError("store.keep_days: needs the PostgreSQL store (store.url); "
                          "the SQLite and Redis stores keep everything")
    if c.router.messages_per_minute < 0:
        raise ConfigError("router.messages_per_minute: must not be negative (0 turns the limit off)")
    if c.agent.reply_tokens >= c.agent.context_tokens:
        raise ConfigError("agent.reply_tokens: must be less than agent.context_tokens")
    if c.tools.tool_kill_grace_s < 0:
        raise ConfigError("tools.tool_kill_grace_s: must not be negative")
    for key, value in (("tools.jobs_per_session", c.tools.jobs_per_session), ("tools.jobs_total", c.tools.jobs_total),
                       ("tools.job_max_s", c.tools.job_max_s), ("tools.job_buffer_chars", c.tools.job_buffer_chars),
                       ("tools.job_read_chars", c.tools.job_read_chars)):
        if value <= 0:
            raise ConfigError(f"{key}: must be greater than 0 (got {value})")
    for key, value in (("tools.yield_after_s", c.tools.yield_after_s),
                       ("tools.foreground_max_s", c.tools.foreground_max_s)):
        if value < 0:
            raise ConfigError(f"{key}: must not be negative")
    if c.agent.echo_delay_s < 0:
        raise ConfigError("agent.echo_delay_s: must not be negative")
    if not 0 < c.admin.port < 65536:
        raise ConfigError(f"admin.port: must be between 1 and 65535 (got {c.admin.port})")
    if c.admin.enabled and not c.admin.token and not is_loopback(c.admin.host):
        raise ConfigError(f"admin.token: required when admin.host is not loopback ({c.admin.host})")
    _validate_tenants(c)
    if c.api.enabled and not c.api.keys and not c.api.tenants and not is_loopback(c.http.host):
        raise ConfigError(f"api.keys: required when http.host is not loopback ({c.http.host})")
    if c.telegram.token and c.telegram.mode == "webhook" and not c.telegram.webhook_url:
        raise ConfigError("telegram.webhook_url: required when telegram.mode is \"webhook\"")
    if c.telegram.token and c.telegram.mode == "webhook" and not c.telegram.secret_token:
        raise ConfigError("telegram.secret_token: required when telegram.mode is \"webhook\"")
    for key, value in (("telegram.edit_interval_s", c.telegram.edit_interval_s),
                       ("discord.edit_interval_s", c.discord.edit_interval_s),
                       ("telegram.draft_interval_s", c.telegram.draft_interval_s)):
        if value < 0:
            raise ConfigError(f"{key}: must not be negative")
    _validate_media(c.media)
    if not 0 < c.telegram.draft_refresh_s < 30:
        raise ConfigError("telegram.draft_refresh_s: must be between 0 and 30 (a draft lives about 30 s)")
    try:
        check_mcp(c.mcp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if c.agent.kind == "openai" and not c.agent.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"agent.base_url: must be an http(s) URL (got {c.agent.base_url!r})")


def _validate_media(m: MediaSettings) -> None:
    for key in ("max_image_bytes", "max_file_bytes", "max_message_bytes", "max_per_message", "download_timeout_s",
                "inline_chars"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"media.{key}: must be greater than 0 (got {getattr(m, key)})")
    for key in ("image_tokens", "retention_hours"):
        if getattr(m, key) < 0:
            raise ConfigError(f"media.{key}: must not be negative")
    for key in ("image_types", "file_types"):
        for mime in getattr(m, key):
            if "/" not in mime:
                raise ConfigError(f"media.{key}: {mime!r} is not a MIME type (like image/png or text/*)")


def render(config: Config) -> str:
    """The effective configuration as TOML, secrets shown as "***"."""
    lines: list[str] = []
    for section in dataclasses.fields(config):
        lines.append(f"[{section.name}]")
        for key, value in vars(getattr(config, section.name)).items():
            lines.append(f"{key} = {_toml(value)}" if value is not None else f"# {key} = (unset)")
        lines.append("")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, Secret):
        return '"***"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return _toml({k: v for k, v in vars(value).items() if v is not None})
    return json.dumps(value, ensure_ascii=False)
