"""The operator listener: Prometheus `/metrics`, the console's JSON API, operator stops.

It binds loopback by default; bound anywhere else it requires `admin.token` as a bearer token.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.cancellation import STOPPED_BY_OPERATOR
from gateway.router import Router

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ReadinessCheck = Callable[[], Awaitable[dict[str, tuple[bool, str]]]]


def build_admin_app(router: Router, readiness: ReadinessCheck, *, token: str | None,
                    extra_stats: Callable[[], dict[str, Any]] | None = None) -> web.Application:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None and not request.path.startswith("/admin/static"):
            header = request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else request.cookies.get("switchboard_admin", "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                return web.json_response({"error": "admin token required"}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[auth])

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=router.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def sessions(_request: web.Request) -> web.Response:
        return web.json_response({"sessions": await session_table(router)})

    async def stop(request: web.Request) -> web.Response:
        try:
            key = (await request.json())["key"]
            if not isinstance(key, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "body must be {\"key\": \"<session key>\"}"}, status=400)
        run = router.hard_cancel(key, STOPPED_BY_OPERATOR)
        return web.json_response({"key": key, "stopped": run is not None})

    async def stats(_request: web.Request) -> web.Response:
        cache = router.cache
        checks = await readiness()
        body: dict[str, Any] = {
            "agent_cache": {"size": len(cache), "max": cache.max_agents, "hits": cache.hits,
                            "misses": cache.misses, "evictions": cache.evictions},
            "stop_latency_buckets": router.metrics.stop_histogram(),
            "health": {name: {"ok": ok, "detail": detail} for name, (ok, detail) in checks.items()},
            "agent": router.agent.description,
        }
        if extra_stats is not None:
            body.update(extra_stats())
        return web.json_response(body)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/api/sessions", sessions)
    app.router.add_post("/admin/api/sessions/stop", stop)
    app.router.add_get("/admin/api/stats", stats)
    return app


async def session_table(router: Router) -> list[dict[str, Any]]:
    """Live sessions first (running or queued), then recently active idle ones from the store."""
    now = time.time()
    rows: dict[str, dict[str, Any]] = {}
    for status in router.sessions():
        rows[status.key] = _row(status.key, "running" if status.running else "queued" if status.queued else "idle",
                                status.since, status.queued, router, now)
    for info in await router.store.sessions(limit=200):
        if info.key not in rows:
            rows[info.key] = _row(info.key, "idle", None, 0, router, now)
    return list(rows.values())


def _row(key: str, state: str, since: float | None, queued: int, router: Router, now: float) -> dict[str, Any]:
    platform, _, rest = key.partition(":")
    chat_type, _, chat = rest.partition(":")
    last = router.interruptions.get(key)
    return {"key": key, "platform": platform, "chat_type": chat_type, "chat": chat, "state": state,
            "turn_age_s": round(now - since, 1) if since else None, "queued": queued,
            "worker": router.worker_id,
            "last_interruption": {"kind": last[0], "reason": last[1], "at": last[2]} if last else None}
