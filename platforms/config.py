"""The config sections of the platforms (`[telegram]`, `[discord]`, `[webchat]`, `[api]`).

They live beside the adapters that read them; gateway.ops.config assembles the whole file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.core.secrets import Secret


@dataclass
class WebchatConfig:
    enabled: bool | None = None  # None: on when no chat platform is configured
    session_secret: Secret | None = None  # keys the cookie -> session id hash; unset: made in data_dir


@dataclass
class ApiConfig:
    enabled: bool = False
    keys: list[Secret] = field(default_factory=list)  # each its own tenant, named by a short hash
    tenants: dict[str, Secret] = field(default_factory=dict)  # tenant name -> key
    model_name: str = "switchboard"


@dataclass
class TelegramConfig:
    token: Secret | None = None  # the platform is on when a token is set
    mode: Literal["polling", "webhook"] = "polling"
    base_url: str = "https://api.telegram.org/bot"
    base_file_url: str = "https://api.telegram.org/file/bot"
    webhook_url: str | None = None  # public URL Telegram posts to (webhook mode)
    webhook_path: str = "/telegram/webhook"
    secret_token: Secret | None = None
    groups: Literal["mention", "all"] = "mention"
    access: Literal["pairing", "allowlist", "open"] = "pairing"
    allowlist: list[str] = field(default_factory=list)  # user ids and @usernames
    edit_interval_s: float = 1.0
    poll_timeout_s: int = 30
    # Private chats stream through sendMessageDraft ("draft"), else by editing a message ("edit"),
    # or only the final text is sent ("off"); groups, and chats that refuse drafts, use "edit".
    streaming: Literal["draft", "edit", "off"] = "draft"
    draft_interval_s: float = 0.3  # how often a draft is updated while text arrives
    draft_refresh_s: float = 20.0  # a draft is re-sent this long after its last update (it lives ~30 s)
    stop_button: bool = True  # an inline "⏹ Stop" button on streaming answers


@dataclass
class DiscordConfig:
    token: Secret | None = None  # the platform is on when a token is set
    guild_mode: Literal["mention", "all"] = "mention"
    allowed_channels: list[str] = field(default_factory=list)  # with guild_mode "all"
    access: Literal["pairing", "allowlist", "open"] = "pairing"
    allowlist: list[str] = field(default_factory=list)  # user ids
    edit_interval_s: float = 1.0
    register_commands: bool = True
    stop_button: bool = True  # a "⏹ Stop" button on streaming answers
    # Gateway connections (shards); each guild's events come through shard (guild_id >> 22) % N, DMs
    # through shard 0. One process runs them all; in cluster mode each is a lease, held by one worker.
    shard_count: int = 1
