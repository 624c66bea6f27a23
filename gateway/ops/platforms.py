"""The platform registry: every platform the daemon can run, built from its config section.

Adding a platform means adding one `PlatformEntry` here (plus its adapter and config section);
the daemon, the access policies and readiness all come from this list.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent_cache import keys
from gateway.cluster.coordinator import Cluster
from gateway.cluster.ingress import IngressLeader
from gateway.core.access import AccessPolicy
from gateway.ops.config import Config
from platforms.base import Adapter

WEBCHAT_SECRET_KEY = f"{keys.PREFIX}:webchat-secret"


@dataclass(frozen=True, slots=True)
class PlatformEntry:
    name: str
    enabled: Callable[[Config], bool]
    build: Callable[[Config, Cluster | None], Adapter]
    access: Callable[[Config], AccessPolicy] | None = None  # None: the platform has its own auth


def _leader(cluster: Cluster | None, platform: str, token: str) -> IngressLeader | None:
    """In cluster mode one worker per bot token holds the platform's intake; the others stand by."""
    return IngressLeader(cluster, f"{platform}:{keys.token_id(token)}") if cluster is not None else None


def _telegram(config: Config, cluster: Cluster | None) -> Adapter:
    from platforms.telegram_bot import TelegramAdapter

    c = config.telegram
    assert c.token is not None
    polling = c.mode == "polling"  # with webhooks every worker takes updates
    return TelegramAdapter(c, leader=_leader(cluster, "telegram", c.token.reveal()) if polling else None)


def _discord(config: Config, cluster: Cluster | None) -> Adapter:
    from platforms.discord_bot import DiscordAdapter

    c = config.discord
    assert c.token is not None
    return DiscordAdapter(c, leaders=discord_shard_leaders(cluster, c.token.reveal(), c.shard_count))


def discord_shard_leaders(cluster: Cluster | None, token: str, shard_count: int) -> list[IngressLeader] | None:
    """In cluster mode each Discord shard is an ingress lease, held by one worker. With one shard it
    keeps the name it had before shards were leases (workers of both kinds then agree on it)."""
    if cluster is None:
        return None
    name = f"discord:{keys.token_id(token)}"
    if shard_count == 1:
        return [IngressLeader(cluster, name)]
    return [IngressLeader(cluster, f"{name}:shard:{i}") for i in range(shard_count)]


def _webchat(config: Config, cluster: Cluster | None) -> Adapter:
    from platforms.webchat import WebchatAdapter

    m = config.media
    return WebchatAdapter(secret=functools.partial(webchat_secret, config, cluster),
                          max_attachment_bytes=max(m.max_image_bytes, m.max_file_bytes),
                          max_frame_bytes=max(4 * 1024 * 1024, m.max_message_bytes * 4 // 3 + 1024 * 1024))


async def webchat_secret(config: Config, cluster: Cluster | None) -> bytes:
    """The key of the web chat's cookie hash: configured, else one per cluster (the first worker
    to start makes it in Redis), else one per data dir."""
    from platforms.webchat_sessions import load_or_create

    if config.webchat.session_secret is not None:
        return config.webchat.session_secret.reveal().encode()
    if cluster is not None:
        await cluster.redis.set(WEBCHAT_SECRET_KEY, secrets.token_hex(32), nx=True)
        value = await cluster.redis.get(WEBCHAT_SECRET_KEY)
        if value is None:  # evicted between the two calls: only under memory pressure; never guess
            raise RuntimeError("the web chat secret vanished from Redis while starting; start again")
        return value.encode() if isinstance(value, str) else bytes(value)
    return await asyncio.to_thread(load_or_create, Path(config.store.data_dir))


def _api(config: Config, _cluster: Cluster | None) -> Adapter:
    from platforms.api import ApiAdapter

    m = config.media
    return ApiAdapter(keys=[k.reveal() for k in config.api.keys],
                      tenants={name: k.reveal() for name, k in config.api.tenants.items()},
                      model_name=config.api.model_name,
                      more_models=tuple(m.name for m in config.agent.models) if config.agent.kind == "openai" else (),
                      max_attachment_bytes=max(m.max_image_bytes, m.max_file_bytes),
                      max_body_bytes=api_body_limit(config))


def api_body_limit(config: Config) -> int:
    """The largest API request body: `http.max_body_bytes`, and room for a message's attachments as
    base64 (a third larger than their bytes) only when media is on."""
    media = config.media.max_message_bytes * 4 // 3 if config.media.enabled else 0
    return config.http.max_body_bytes + media


PLATFORMS: tuple[PlatformEntry, ...] = (
    PlatformEntry("telegram", lambda c: c.telegram.token is not None, _telegram,
                  lambda c: AccessPolicy(c.telegram.access, frozenset(a.lower() for a in c.telegram.allowlist))),
    PlatformEntry("discord", lambda c: c.discord.token is not None, _discord,
                  lambda c: AccessPolicy(c.discord.access, frozenset(c.discord.allowlist))),
    PlatformEntry("webchat", lambda c: c.webchat_enabled, _webchat),
    PlatformEntry("api", lambda c: c.api.enabled, _api),
)


def build_adapters(config: Config, cluster: Cluster | None) -> dict[str, Adapter]:
    return {p.name: p.build(config, cluster) for p in PLATFORMS if p.enabled(config)}


def access_policies(config: Config) -> dict[str, AccessPolicy]:
    return {p.name: p.access(config) for p in PLATFORMS if p.access is not None}
