"""Configuration: one TOML file, every key overridable by `SWITCHBOARD_<SECTION>__<KEY>`.

Secrets may also come from `<key>_file` (a path) or systemd's `$CREDENTIALS_DIRECTORY`
(a file named `<section>.<key>`). Any problem is a `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent_cache import CacheSettings
from gateway.agents.mcp_config import McpConfig, check_mcp
from gateway.agents.sandbox import sandbox_problem
from gateway.core.attachments import MediaSettings
from gateway.core.quotas import QuotaSettings
from gateway.core.router import RouterSettings
from gateway.core.secrets import Secret
from gateway.ops.coercion import ConfigError as ConfigError  # raised here, and by the coercers
from gateway.ops.coercion import coerce, is_secret, unknown
from gateway.ops.edge import EdgeSettings
from platforms import tenants
from platforms.config import ApiConfig, DiscordConfig, TelegramConfig, WebchatConfig

ENV_PREFIX = "SWITCHBOARD_"


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
    # The edge (both listeners): a request's head within header_timeout_s of the connection opening or
    # of its previous answer (idle keep-alive connections close then), its body within body_timeout_s.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    max_body_bytes: int = 4 * 1024 * 1024  # an API request without attachments (media adds room for them)
    max_connections_per_address: int = 64  # 0: no cap
    uncapped_addresses: list[str] = field(default_factory=lambda: ["127.0.0.1", "::1"])  # a proxy on this host

    def edge(self) -> EdgeSettings:
        return EdgeSettings(self.header_timeout_s, self.body_timeout_s, self.max_connections_per_address,
                            tuple(self.uncapped_addresses))


@dataclass
class AdminConfig:
    """The operator listener: /metrics, the console and its API. Loopback unless a token is set."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8766
    token: Secret | None = None
    allowed_hosts: list[str] = field(default_factory=list)  # names besides IPs and localhost; "*" = any


@dataclass
class AgentModel:
    """A further model clients may name (`[[agent.models]]`): the name they send as `model` and see
    in /v1/models, the provider's name for it, and the provider, if not the agent's own."""

    name: str = ""
    model: str = ""
    base_url: str | None = None  # default: agent.base_url (and agent.api_key)
    api_key: Secret | None = None  # for base_url's provider


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
    probe_interval_s: float = 30.0  # "openai": how often the provider's reachability is checked (0: never)
    models: list[AgentModel] = field(default_factory=list)  # more models behind the HTTP API ("openai")


@dataclass
class ToolsConfig:
    shell: bool = False
    shell_timeout_s: float = 60.0
    shell_max_output: int = 16_000
    shell_allow_prefixes: list[str] = field(default_factory=list)
    shell_cwd: str | None = None
    # Who may use the shell (and the job tools): session-key globs or API tenant names; both empty: all.
    shell_allow_sessions: list[str] = field(default_factory=list)
    shell_allow_tenants: list[str] = field(default_factory=list)
    # Each session's commands in a sandbox of their own (gateway/agents/sandbox.py): "auto" where
    # bubblewrap works, "bwrap" (refuse to start without it) or "off".
    sandbox: Literal["auto", "bwrap", "off"] = "auto"
    sandbox_network: bool = False  # sandboxed commands share the host's network (its listeners too)
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
    format: Literal["auto", "json", "text"] = "auto"  # auto: text on a terminal, json elsewhere (systemd)


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
    quotas: QuotaSettings = field(default_factory=QuotaSettings)
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
                items = list(value) if isinstance(value, list) else list(value.values()) if isinstance(value, dict) \
                    else [value]
                items += [v for item in items if dataclasses.is_dataclass(item) for v in vars(item).values()]
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
    text = ""
    if path is not None:
        try:
            with open(path, "rb") as fh:
                text = fh.read().decode("utf-8", "replace")
            raw = tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    overrides = _env_overrides(env)
    try:
        return _build(raw, overrides, env)
    except ConfigError as exc:
        raise _located(exc, path, text, overrides) from None


def _build(raw: dict[str, Any], overrides: dict[str, dict[str, str]], env: Mapping[str, str]) -> Config:
    config = Config()
    sections = {f.name for f in dataclasses.fields(config)}
    for section, values in {**overrides, **raw}.items():
        if section not in sections:
            raise unknown(section, section, sections, "section")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a table ([{section}])")
    for section in sections:
        _fill(section, getattr(config, section), raw.get(section, {}), overrides.get(section, {}), env)
    _validate(config)
    return config


_TABLE = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-.\"' ]+?)\s*=")


def key_line(text: str, dotted: str) -> int | None:
    """The line (from 1) of the TOML file that sets `dotted` (`section.key`), or opens its table
    (`section`); None if the file does not say it (a default, the environment)."""
    table = ""
    for number, line in enumerate(text.splitlines(), 1):
        if (m := _TABLE.match(line)) is not None:
            table = re.sub(r"[\"'\s]", "", m[1])
            if table == dotted:
                return number
        elif (m := _KEY.match(line)) is not None:
            name = re.sub(r"[\"'\s]", "", m[1])
            if (f"{table}.{name}" if table else name) == dotted:
                return number
    return None


def _located(exc: ConfigError, path: str | os.PathLike[str] | None, text: str,
             overrides: dict[str, dict[str, str]]) -> ConfigError:
    """The error with where to look: `file:line:` when the key it names is set in the file (and not
    overridden by the environment), `$SWITCHBOARD_…:` when the environment set it."""
    message = str(exc)
    where = message.split(":", 1)[0]
    section, _, key = where.partition(".")
    key = key.split(".")[0].split("[")[0]
    if key and key in overrides.get(section, {}):
        return ConfigError(f"{ENV_PREFIX}{section.upper()}__{key.upper()}: {message}")
    line = key_line(text, where) or (key_line(text, f"{section}.{key}") if key else None)
    return ConfigError(f"{path}:{line}: {message}") if path is not None and line is not None else exc


def _env_overrides(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and "__" in name:
            section, key = name[len(ENV_PREFIX):].lower().split("__", 1)
            out.setdefault(section, {})[key] = value
    return out


def _fill(section: str, target: Any, values: dict[str, Any], env_values: dict[str, str],
          env: Mapping[str, str]) -> None:
    """Set `target`'s fields: from the file, then the environment (which wins), then — for secrets
    still unset — systemd's credentials directory. `<key>_file` names a file holding a secret."""
    hints = typing.get_type_hints(type(target))
    names = {f.name for f in dataclasses.fields(target)}
    file_keys = {f"{n}_file": n for n in names if is_secret(hints[n])}
    for items, from_env in ((values, False), (env_values, True)):
        for key, value in items.items():
            where = f"{section}.{key}"
            if key in file_keys:
                key = file_keys[key]
                value, from_text = _secret_lines(where, str(value)), True
            elif key in names:
                from_text = from_env
            else:
                raise unknown(where, key, [*names, *file_keys])
            setattr(target, key, coerce(where, value, hints[key], from_env=from_text))
    if creds := env.get("CREDENTIALS_DIRECTORY"):
        _fill_credentials(section, target, hints, Path(creds))


def _fill_credentials(section: str, target: Any, hints: dict[str, Any], creds: Path) -> None:
    """systemd's LoadCredential=: a file named `<section>.<key>` sets a secret nothing else set."""
    for name, hint in hints.items():
        cred = creds / f"{section}.{name}"
        if is_secret(hint) and getattr(target, name) in (None, [], {}) and cred.is_file():
            where = f"{section}.{name}"
            setattr(target, name, coerce(where, _secret_lines(where, str(cred)), hint, from_env=True))


def _secret_lines(where: str, path: str) -> str:
    """A secret file's text, one value a line, as the comma-separated list the environment would give."""
    try:
        return Path(path).read_text().strip().replace("\n", ",")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror}") from None


# --- validation: named rules, checked in order; the first broken one is the error ---------------

Check = Callable[[Config], str | None]  # the problem, naming the key; None when the rule holds


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    check: Check


def _get(c: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(c, section), name)


def _positive(*keys: str) -> Check:
    def check(c: Config) -> str | None:
        return next((f"{k}: must be greater than 0 (got {_get(c, k)})" for k in keys if _get(c, k) <= 0), None)
    return check


def _not_negative(*keys: str) -> Check:
    def check(c: Config) -> str | None:
        return next((f"{k}: must not be negative" for k in keys if _get(c, k) < 0), None)
    return check


def _port(key: str) -> Check:
    def check(c: Config) -> str | None:
        port = _get(c, key)
        return None if 0 < port < 65536 else f"{key}: must be between 1 and 65535 (got {port})"
    return check


def _unless(holds: Callable[[Config], bool], problem: Callable[[Config], str]) -> Check:
    return lambda c: None if holds(c) else problem(c)


def _tenants(c: Config) -> str | None:
    return tenants.problem([k.reveal() for k in c.api.keys], {n: k.reveal() for n, k in c.api.tenants.items()})


def _sandbox(c: Config) -> str | None:
    if not c.tools.shell or c.tools.sandbox != "bwrap":
        return None
    problem = sandbox_problem("bwrap")
    return None if problem is None else f"tools.sandbox: \"bwrap\" is required, but {problem}"


def _addresses(c: Config) -> str | None:
    for address in c.http.uncapped_addresses:
        try:
            ipaddress.ip_network(address, strict=False)
        except ValueError:
            return f"http.uncapped_addresses: {address!r} is not an IP address or network"
    return None


def _tenant_quotas(c: Config) -> str | None:
    return next((f"quotas.tenants.{name}.{key}: must not be negative" for name, quota in c.quotas.tenants.items()
                 for key, value in vars(quota).items() if value is not None and value < 0), None)


def _mime_types(c: Config) -> str | None:
    return next((f"media.{key}: {mime!r} is not a MIME type (like image/png or text/*)"
                 for key in ("image_types", "file_types") for mime in getattr(c.media, key) if "/" not in mime), None)


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")


def _models(c: Config) -> str | None:
    """`[[agent.models]]`: named, each name once (and not `api.model_name`), each with a provider model."""
    seen = {c.api.model_name}
    for i, m in enumerate(c.agent.models):
        where = f"agent.models[{i}]"
        if not MODEL_NAME.fullmatch(m.name):
            return f"{where}.name: letters, digits and . _ : / - (got {m.name!r})"
        if m.name in seen:
            return f"{where}.name: {m.name!r} is named twice (api.model_name included)"
        seen.add(m.name)
        if not m.model:
            return f"{where}.model: the provider's name for the model is required"
        if m.base_url is not None and not m.base_url.startswith(("http://", "https://")):
            return f"{where}.base_url: must be an http(s) URL (got {m.base_url!r})"
    return None


def _mcp(c: Config) -> str | None:
    try:
        check_mcp(c.mcp)
    except ValueError as exc:
        return str(exc)
    return None


def _webhook_needs(key: str) -> Rule:
    return Rule(f"a Telegram webhook needs telegram.{key}", _unless(
        lambda c: not (c.telegram.token and c.telegram.mode == "webhook") or bool(getattr(c.telegram, key)),
        lambda c: f"telegram.{key}: required when telegram.mode is \"webhook\""))


REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")

RULES: tuple[Rule, ...] = (
    Rule("sizes and limits are positive", _positive(
        "http.port", "router.max_message_chars", "router.turn_timeout_s", "agent_cache.max_agents",
        "agent_cache.idle_ttl_s", "tools.shell_timeout_s", "agent.max_tool_rounds", "agent.context_tokens",
        "agent.reply_tokens", "tools.max_parallel")),
    Rule("the HTTP port is a port", _port("http.port")),
    Rule("the edge's deadlines and sizes are positive", _positive(
        "http.header_timeout_s", "http.body_timeout_s", "http.max_body_bytes")),
    Rule("the connection cap is not negative", _not_negative("http.max_connections_per_address")),
    Rule("uncapped addresses are addresses", _addresses),
    Rule("daemon timings are not negative", _not_negative(
        "daemon.drain_timeout_s", "daemon.resume_max_age_s", "daemon.shutdown_grace_s")),
    Rule("a lease lives at least 3 s", _unless(
        lambda c: c.cluster.lease_ttl_s >= 3,
        lambda c: f"cluster.lease_ttl_s: must be at least 3 seconds (got {c.cluster.lease_ttl_s:g})")),
    Rule("the Redis URL is a Redis URL", _unless(
        lambda c: c.redis.url is None or c.redis.url.reveal().startswith(REDIS_SCHEMES),
        lambda c: "redis.url: must start with redis://, rediss://, unix:// or redis+cluster://")),
    Rule("the store URL is a PostgreSQL URL", _unless(
        lambda c: c.store.url is None or c.store.url.reveal().startswith(("postgresql://", "postgres://")),
        lambda c: "store.url: must start with postgresql:// or postgres:// (SQLite needs no url: "
                  "it lives in store.data_dir)")),
    Rule("retention is not negative", _unless(
        lambda c: c.store.keep_days >= 0,
        lambda c: f"store.keep_days: must not be negative (got {c.store.keep_days}; 0 keeps everything)")),
    Rule("retention needs PostgreSQL", _unless(
        lambda c: not c.store.keep_days or c.store.url is not None,
        lambda c: "store.keep_days: needs the PostgreSQL store (store.url); "
                  "the SQLite and Redis stores keep everything")),
    Rule("the rate limit is not negative", _unless(
        lambda c: c.router.messages_per_minute >= 0,
        lambda c: "router.messages_per_minute: must not be negative (0 turns the limit off)")),
    Rule("quotas are not negative", _not_negative(
        "quotas.messages_per_minute", "quotas.running_turns", "quotas.live_sessions", "quotas.media_mb")),
    Rule("tenant quotas are not negative", _tenant_quotas),
    Rule("the answer fits the context", _unless(
        lambda c: c.agent.reply_tokens < c.agent.context_tokens,
        lambda c: "agent.reply_tokens: must be less than agent.context_tokens")),
    Rule("the kill grace is not negative", _not_negative("tools.tool_kill_grace_s")),
    Rule("job limits are positive", _positive(
        "tools.jobs_per_session", "tools.jobs_total", "tools.job_max_s", "tools.job_buffer_chars",
        "tools.job_read_chars")),
    Rule("job timings are not negative", _not_negative("tools.yield_after_s", "tools.foreground_max_s")),
    Rule("the echo delay is not negative", _not_negative("agent.echo_delay_s")),
    Rule("the admin port is a port", _port("admin.port")),
    Rule("the admin listener off loopback needs a token", _unless(
        lambda c: not c.admin.enabled or bool(c.admin.token) or is_loopback(c.admin.host),
        lambda c: f"admin.token: required when admin.host is not loopback ({c.admin.host})")),
    Rule("API keys and tenants are well formed", _tenants),
    Rule("the API off loopback needs keys", _unless(
        lambda c: not c.api.enabled or bool(c.api.keys) or bool(c.api.tenants) or is_loopback(c.http.host),
        lambda c: f"api.keys: required when http.host is not loopback ({c.http.host})")),
    _webhook_needs("webhook_url"),
    _webhook_needs("secret_token"),
    Rule("Discord has a shard", _positive("discord.shard_count")),
    Rule("edit intervals are not negative", _not_negative(
        "telegram.edit_interval_s", "discord.edit_interval_s", "telegram.draft_interval_s")),
    Rule("media limits are positive", _positive(
        "media.max_image_bytes", "media.max_file_bytes", "media.max_message_bytes", "media.max_per_message",
        "media.download_timeout_s", "media.inline_chars")),
    Rule("media budgets are not negative", _not_negative("media.image_tokens", "media.retention_hours")),
    Rule("media types are MIME types", _mime_types),
    Rule("a draft is refreshed before it lapses", _unless(
        lambda c: 0 < c.telegram.draft_refresh_s < 30,
        lambda c: "telegram.draft_refresh_s: must be between 0 and 30 (a draft lives about 30 s)")),
    Rule("MCP servers are well formed", _mcp),
    Rule("further models are well formed", _models),
    Rule("a required sandbox is available", _sandbox),
    Rule("the OpenAI agent has an http(s) URL", _unless(
        lambda c: c.agent.kind != "openai" or c.agent.base_url.startswith(("http://", "https://")),
        lambda c: f"agent.base_url: must be an http(s) URL (got {c.agent.base_url!r})")),
)


def _validate(c: Config) -> None:
    for rule in RULES:
        if (problem := rule.check(c)) is not None:
            raise ConfigError(problem)


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
