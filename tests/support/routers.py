"""Routers built from real parts for tests and benchmarks (no rate limit or quota unless asked for)."""

from __future__ import annotations

import dataclasses
from typing import Any

from agent_cache import CacheSettings
from gateway.core.background import BackgroundJobs
from gateway.core.cluster import Ownership
from gateway.core.live import Live
from gateway.core.ports import Agent, Store
from gateway.core.quotas import QuotaSettings
from gateway.core.router import Router, RouterParts
from gateway.core.settings import CoreSettings, RouterSettings
from platforms.base import Adapter

_CACHE_KEYS = {f.name for f in dataclasses.fields(CacheSettings)}
NO_QUOTAS = QuotaSettings(messages_per_minute=0, running_turns=0, live_sessions=0, media_mb=0)


def build_router(store: Store, agent: Agent, *outlets: Adapter, resume_max_age_s: float = 600.0,
                 cancel_grace_s: float = 2.0, jobs: BackgroundJobs | None = None,
                 quotas: QuotaSettings | None = None, cluster: Ownership | None = None, **settings: Any) -> Router:
    """A router over `store` and `agent` serving `outlets` (a cluster worker with `cluster`, started
    by the caller); `settings` are [router] and [agent_cache] keys."""
    cache = CacheSettings(**{k: v for k, v in settings.items() if k in _CACHE_KEYS})
    router_settings = RouterSettings(**{"messages_per_minute": 0,
                                        **{k: v for k, v in settings.items() if k not in _CACHE_KEYS}})
    live = Live(CoreSettings(agent=agent, router=router_settings, cancel_grace_s=cancel_grace_s,
                             resume_max_age_s=resume_max_age_s, quotas=quotas or NO_QUOTAS))
    return Router(live, RouterParts(store=store, outlets={o.name: o for o in outlets}, cache=cache, jobs=jobs,
                                        cluster=cluster))


async def start_router(store: Store, agent: Agent, *outlets: Adapter, **settings: Any) -> Router:
    router = build_router(store, agent, *outlets, **settings)
    for outlet in outlets:
        await outlet.start(router)
    await router.start()
    return router
