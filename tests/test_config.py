"""Configuration: TOML, environment overrides, secrets, and clear errors (exit 2, key named)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

from gateway.agents.mcp_config import McpServerConfig
from gateway.core.secrets import Secret
from gateway.ops.coercion import coerce
from gateway.ops.config import RULES, Config, ConfigError, load_config


def _check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    return subprocess.run([sys.executable, "-m", "gateway", "check", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=60)


def test_no_config_at_all_gives_the_embedded_defaults() -> None:
    c = load_config(None, {})
    assert (c.http.host, c.http.port, c.agent.kind, c.store.data_dir) == ("127.0.0.1", 8765, "echo", "./.switchboard")
    assert c.webchat_enabled and not c.api.enabled and not c.tools.shell
    assert (c.router.busy, c.agent_cache.max_agents, c.agent_cache.idle_ttl_s) == ("interrupt", 256, 3600.0)


def test_toml_then_environment_then_secret_files(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[agent]\nkind = "openai"\nmodel = "m1"\napi_key_file = "{key_file}"\n'
                   '[router]\nbusy = "queue"\n[api]\nenabled = true\nkeys = ["k1"]\n')
    c = load_config(cfg, {"SWITCHBOARD_AGENT__MODEL": "m2", "SWITCHBOARD_HTTP__PORT": "9000",
                          "SWITCHBOARD_API__KEYS": "a1,a2", "SWITCHBOARD_TOOLS__SHELL": "true"})
    assert (c.agent.model, c.http.port, c.router.busy, c.tools.shell) == ("m2", 9000, "queue", True)
    assert c.agent.api_key == Secret("sk-from-file")
    assert [k.reveal() for k in c.api.keys] == ["a1", "a2"]
    assert "sk-from-file" not in repr(c)


def test_credentials_directory_supplies_unset_secrets(tmp_path: Path) -> None:
    (tmp_path / "agent.api_key").write_text("sk-cred")
    c = load_config(None, {"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert c.agent.api_key == Secret("sk-cred")


@pytest.mark.parametrize(("toml", "env", "message"), [
    ('[agent]\nkind = "gpt"\n', {}, "agent.kind: must be one of 'echo', 'openai' (got 'gpt')"),
    ("", {"SWITCHBOARD_DAEMON__EVENT_LOOP": "trio"},
     "daemon.event_loop: must be one of 'auto', 'uvloop', 'asyncio' (got 'trio')"),
    ('[agent]\nmodle = "x"\n', {}, "agent.modle: unknown key"),
    ('[agnet]\n', {}, "agnet: unknown section"),
    ('[http]\nport = "80"\n', {}, "http.port: must be an integer (got '80')"),
    ('[http]\nport = 70000\n', {}, "http.port: must be between 1 and 65535"),
    ("", {"SWITCHBOARD_ROUTER__TURN_TIMEOUT_S": "soon"}, "router.turn_timeout_s: must be a number"),
    ('[http]\nhost = "0.0.0.0"\n[api]\nenabled = true\n', {}, "api.keys: required when http.host is not loopback"),
    ("[http\n", {}, "is not valid TOML"),
    ('[agent]\napi_key_file = "/nonexistent/key"\n', {}, "agent.api_key_file: cannot read /nonexistent/key"),
    ('[api]\ntenants = { "a/b" = "k1" }\n', {}, "api.tenants: 'a/b' is not a valid tenant name"),
    ('[api]\ntenants = { a = "k1", b = "k1" }\n', {}, "api.tenants: the same key is configured twice"),
    ('[api]\nkeys = ["k1"]\ntenants = { a = "k1" }\n', {}, "api.tenants: the same key is configured twice"),
    ('[api]\ntenants = ["k1"]\n', {}, "api.tenants: must be a table of names"),
    ('[api]\nkeys = ["k1 "]\n', {}, "api: a key starts or ends with whitespace"),
    ('[api]\ntenants = { a = " k1" }\n', {}, "api: a key starts or ends with whitespace"),
    ('[api]\ntenants = { key-1a2b = "k1" }\n', {}, "names starting with 'key-' are kept for the keys of api.keys"),
    ("", {"SWITCHBOARD_API__TENANTS": '{"a": 5}'}, "api.tenants.a: must be a non-empty string"),
    ('[telegram]\nstreaming = "live"\n', {}, "telegram.streaming: must be one of 'draft', 'edit', 'off'"),
    ("[telegram]\ndraft_refresh_s = 45\n", {}, "telegram.draft_refresh_s: must be between 0 and 30"),
])
def test_a_bad_config_is_one_line_naming_the_key_and_exit_2(tmp_path: Path, toml: str, env: dict[str, str],
                                                              message: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError, match=None) as info:
        load_config(cfg, env)
    assert message in str(info.value)
    result = _check("--config", str(cfg), env=env)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_discord_shard_count_from_toml_or_the_environment_and_at_least_one(tmp_path: Path) -> None:
    assert Config().discord.shard_count == 1
    cfg = tmp_path / "c.toml"
    cfg.write_text("[discord]\nshard_count = 4\n")
    assert load_config(cfg, {}).discord.shard_count == 4
    assert load_config(cfg, {"SWITCHBOARD_DISCORD__SHARD_COUNT": "2"}).discord.shard_count == 2
    with pytest.raises(ConfigError, match=r"discord.shard_count: must be greater than 0 \(got 0\)"):
        load_config(None, {"SWITCHBOARD_DISCORD__SHARD_COUNT": "0"})
    with pytest.raises(ConfigError, match=r"discord.shard_count: must be a number"):
        load_config(None, {"SWITCHBOARD_DISCORD__SHARD_COUNT": "two"})


def test_tenants_from_toml_the_environment_a_file_and_credentials(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[api]\nenabled = true\ntenants = { team-a = "sk-a", "team.b" = "sk-b" }\n')
    c = load_config(cfg, {})
    assert {n: k.reveal() for n, k in c.api.tenants.items()} == {"team-a": "sk-a", "team.b": "sk-b"}
    assert "sk-a" in c.secrets() and "sk-b" in c.secrets()  # the log redactor knows them
    c = load_config(None, {"SWITCHBOARD_API__TENANTS": '{"x": "sk-x"}'})
    assert c.api.tenants == {"x": Secret("sk-x")}
    lines = tmp_path / "tenants"
    lines.write_text("ops=sk-ops\nweb = sk-web\n")
    c = load_config(None, {"SWITCHBOARD_API__TENANTS_FILE": str(lines)})
    assert c.api.tenants == {"ops": Secret("sk-ops"), "web": Secret("sk-web")}
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "api.tenants").write_text("bot=sk-bot\n")
    assert load_config(None, {"CREDENTIALS_DIRECTORY": str(creds)}).api.tenants == {"bot": Secret("sk-bot")}
    # Tenants alone satisfy "keys required off loopback".
    assert load_config(None, {"SWITCHBOARD_HTTP__HOST": "0.0.0.0", "SWITCHBOARD_API__ENABLED": "true",
                              "SWITCHBOARD_API__TENANTS": "a=sk-a"}).api.enabled


def test_check_prints_the_effective_config_with_secrets_redacted(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[agent]\napi_key = "sk-very-secret-123"\n[api]\nkeys = ["bearer-secret-456"]\n'
                   'tenants = { team-a = "tenant-secret-789" }\n')
    result = _check("--config", str(cfg), env={"SWITCHBOARD_AGENT__MODEL": "qwen"})
    assert result.returncode == 0, result.stderr
    assert "sk-very-secret" not in result.stdout and "bearer-secret" not in result.stdout
    assert "tenant-secret" not in result.stdout and 'tenants = {"team-a" = "***"}' in result.stdout
    assert 'api_key = "***"' in result.stdout and 'keys = ["***"]' in result.stdout
    assert 'model = "qwen"' in result.stdout
    missing = _check("--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


# --- coercion: one coercer per kind of field type ------------------------------------------------

@pytest.mark.parametrize(("hint", "value", "from_env", "expected"), [
    (str, "x", False, "x"),
    (int, 3, False, 3),
    (int, "3", True, 3),
    (float, 3, False, 3.0),
    (float, "0.5", True, 0.5),
    (bool, True, False, True),
    (bool, "Yes", True, True),
    (bool, "off", True, False),
    (Secret, "s", False, Secret("s")),
    (str | None, "", True, None),  # an empty environment value unsets an optional key
    (str | None, "", False, ""),  # ... but an empty TOML string is a string
    (int | None, "7", True, 7),
    (Literal["a", "b"], "b", False, "b"),
    (list[str], ["a", "b"], False, ["a", "b"]),
    (list[str], "a, b,,", True, ["a", "b"]),
    (list[int], "[1, 2]", True, [1, 2]),
    (dict[str, Secret], "x=1, y = 2", True, {"x": Secret("1"), "y": Secret("2")}),
    (dict[str, int], '{"x": 1}', True, {"x": 1}),
    (McpServerConfig, {"name": "n", "args": ["a"]}, False, McpServerConfig(name="n", args=["a"])),
])
def test_a_value_is_coerced_by_its_fields_type(hint: Any, value: Any, from_env: bool, expected: Any) -> None:
    got = coerce("s.k", value, hint, from_env=from_env)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(("hint", "value", "from_env", "message"), [
    (str, 5, False, "s.k: must be a string (got 5)"),
    (int, True, False, "s.k: must be an integer (got True)"),  # TOML's true is not 1
    (int, 1.5, False, "s.k: must be an integer (got 1.5)"),
    (int, "1.5", True, "s.k: must be a number (got '1.5')"),
    (float, "x", False, "s.k: must be a number (got 'x')"),  # text from TOML is not parsed
    (bool, "maybe", True, "s.k: must be true or false (got 'maybe')"),
    (Secret, "", False, "s.k: must be a non-empty string"),
    (Literal["a", "b"], "c", False, "s.k: must be one of 'a', 'b' (got 'c')"),
    (list[str], "a", False, "s.k: must be a list"),
    (list[int], "[1,", True, "s.k: must be a JSON list or comma-separated values"),
    (list[int], [1, "x"], False, "s.k[1]: must be an integer (got 'x')"),
    (dict[str, str], ["x"], False, "s.k: must be a table of names"),
    (dict[str, str], "{x", True, "s.k: must be a JSON object or comma-separated name=value pairs"),
    (McpServerConfig, "n", False, "s.k: must be a table"),
    (McpServerConfig, {"nmae": "n"}, False, "s.k.nmae: unknown key (did you mean 'name'?)"),
    (McpServerConfig, {"args": "a,b"}, False, "s.k.args: must be a list"),  # a table's values are typed
])
def test_a_value_of_the_wrong_type_is_an_error_naming_the_key(hint: Any, value: Any, from_env: bool,
                                                              message: str) -> None:
    with pytest.raises(ConfigError) as info:
        coerce("s.k", value, hint, from_env=from_env)
    assert str(info.value) == message


# --- validation: named rules, the first broken one is the error ------------------------------------

def test_every_rule_has_its_own_name_and_the_defaults_break_none() -> None:
    assert len({rule.name for rule in RULES}) == len(RULES)
    defaults = Config()
    assert [rule.name for rule in RULES if rule.check(defaults) is not None] == []


@pytest.mark.parametrize(("env", "message"), [
    ({"SWITCHBOARD_HTTP__PORT": "0"}, "http.port: must be greater than 0 (got 0)"),
    ({"SWITCHBOARD_DAEMON__SHUTDOWN_GRACE_S": "-1"}, "daemon.shutdown_grace_s: must not be negative"),
    ({"SWITCHBOARD_CLUSTER__LEASE_TTL_S": "2.5"}, "cluster.lease_ttl_s: must be at least 3 seconds (got 2.5)"),
    ({"SWITCHBOARD_REDIS__URL": "http://x"}, "redis.url: must start with redis://"),
    ({"SWITCHBOARD_STORE__KEEP_DAYS": "3"}, "store.keep_days: needs the PostgreSQL store"),
    ({"SWITCHBOARD_AGENT__REPLY_TOKENS": "9", "SWITCHBOARD_AGENT__CONTEXT_TOKENS": "9"},
     "agent.reply_tokens: must be less than agent.context_tokens"),
    ({"SWITCHBOARD_ADMIN__HOST": "0.0.0.0"}, "admin.token: required when admin.host is not loopback (0.0.0.0)"),
    ({"SWITCHBOARD_ADMIN__HOST": "0.0.0.0", "SWITCHBOARD_ADMIN__ENABLED": "false"}, None),
    ({"SWITCHBOARD_TELEGRAM__TOKEN": "t", "SWITCHBOARD_TELEGRAM__MODE": "webhook",
      "SWITCHBOARD_TELEGRAM__WEBHOOK_URL": "https://x/hook"},
     'telegram.secret_token: required when telegram.mode is "webhook"'),
    ({"SWITCHBOARD_MEDIA__FILE_TYPES": "text/plain,pdf"}, "media.file_types: 'pdf' is not a MIME type"),
    ({"SWITCHBOARD_MEDIA__RETENTION_HOURS": "-1"}, "media.retention_hours: must not be negative"),
    ({"SWITCHBOARD_AGENT__KIND": "openai", "SWITCHBOARD_AGENT__BASE_URL": "ftp://x"},
     "agent.base_url: must be an http(s) URL (got 'ftp://x')"),
    ({"SWITCHBOARD_AGENT__BASE_URL": "ftp://x"}, None),  # only the OpenAI agent uses it
    # Two problems: the earlier rule is the one reported.
    ({"SWITCHBOARD_HTTP__PORT": "70000", "SWITCHBOARD_ADMIN__PORT": "0"},
     "http.port: must be between 1 and 65535 (got 70000)"),
])
def test_a_broken_rule_is_the_config_error(env: dict[str, str], message: str | None) -> None:
    if message is None:
        load_config(None, env)
        return
    with pytest.raises(ConfigError) as info:
        load_config(None, env)
    assert message in str(info.value)


def test_further_models_are_tables_checked_and_their_keys_kept_secret(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[agent]\nkind = "openai"\n[[agent.models]]\nname = "fast"\nmodel = "llama3.2:1b"\n'
                   '[[agent.models]]\nname = "gpt-4o-mini"\nmodel = "gpt-4o-mini"\n'
                   'base_url = "https://api.example.com/v1"\napi_key = "sk-other-provider"\n')
    c = load_config(cfg, {})
    assert [(m.name, m.model, m.base_url) for m in c.agent.models] == [
        ("fast", "llama3.2:1b", None), ("gpt-4o-mini", "gpt-4o-mini", "https://api.example.com/v1")]
    assert "sk-other-provider" in c.secrets()  # masked in the logs
    assert len(c.agent.models) == 2  # (reading them left the config as it was)
    assert "sk-other-provider" not in _check("--config", str(cfg)).stdout
    for models, message in (
            ('[{"name": "switchboard", "model": "m"}]', "agent.models[0].name: 'switchboard' is named twice"),
            ('[{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]', "agent.models[1].name: 'a' is named"),
            ('[{"name": "a b", "model": "m"}]', "agent.models[0].name: letters, digits"),
            ('[{"name": "a"}]', "agent.models[0].model: the provider's name for the model is required"),
            ('[{"name": "a", "model": "m", "base_url": "ftp://x"}]', "agent.models[0].base_url: must be an http(s)"),
            ('[{"name": "a", "model": "m", "colour": "red"}]', "agent.models[0].colour: unknown key")):
        with pytest.raises(ConfigError) as info:
            load_config(None, {"SWITCHBOARD_AGENT__MODELS": models})
        assert message in str(info.value)
