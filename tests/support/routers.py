"""Routers built from real parts for tests and benchmarks (no rate limit unless asked for)."""

from __future__ import annotations

import dataclasses
from typing import Any

from agent_cache import CacheSettings
from gateway.core.ports import Agent, Store
from gateway.core.router import Router, RouterSettings
from platforms.base import Adapter

_CACHE_KEYS = {f.name for f in dataclasses.fields(CacheSettings)}


def build_router(store: Store, agent: Agent, *outlets: Adapter, resume_max_age_s: float = 600.0,
                 cancel_grace_s: float = 2.0, **settings: Any) -> Router:
    """A router over `store` and `agent` serving `outlets`; `settings` are [router] and [agent_cache] keys."""
    cache = CacheSettings(**{k: v for k, v in settings.items() if k in _CACHE_KEYS})
    router_settings = RouterSettings(**{"messages_per_minute": 0,
                                        **{k: v for k, v in settings.items() if k not in _CACHE_KEYS}})
    return Router(router_settings, store=store, agent=agent, outlets={o.name: o for o in outlets}, cache=cache,
                  resume_max_age_s=resume_max_age_s, cancel_grace_s=cancel_grace_s)


async def start_router(store: Store, agent: Agent, *outlets: Adapter, **settings: Any) -> Router:
    router = build_router(store, agent, *outlets, **settings)
    for outlet in outlets:
        await outlet.start(router)
    await router.start()
    return router
