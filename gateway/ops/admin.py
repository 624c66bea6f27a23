"""The operator listener: Prometheus `/metrics`, the console (`/admin`), its JSON API, operator stops.

It binds loopback by default; bound anywhere else it requires `admin.token`, as a bearer token or
as the `switchboard_admin` cookie the console's login sets (`/admin?token=...` once, or the form).
The console page and its static files are public: they hold no data, the API behind them does.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.core.cancellation import STOPPED_BY_OPERATOR
from gateway.core.metrics import Metrics
from gateway.core.ports import Store
from gateway.core.router import Router
from gateway.ops.client_faults import client_faults
from gateway.ops.hosts import HostPolicy, host_guard
from gateway.ops.http import ReadinessCheck
from platforms.assets import static_response
from platforms.http_input import read_json, served_over_https
from platforms.tenants import as_bytes

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

COOKIE = "switchboard_admin"
_PUBLIC = {("GET", "/admin"), ("HEAD", "/admin"), ("POST", "/admin/login")}
# Strict JSON: the console parses it with JSON.parse, which has no Infinity.
_json = functools.partial(web.json_response, dumps=functools.partial(json.dumps, allow_nan=False, ensure_ascii=False))


def build_admin_app(router: Router, metrics: Metrics, store: Store, readiness: ReadinessCheck, *, token: str | None,
                    extra_stats: Callable[[], dict[str, Any]] | None = None,
                    hosts: HostPolicy | None = None) -> web.Application:
    def valid(given: str) -> bool:
        # as_bytes: a header that is not UTF-8, or a lone surrogate in JSON, is a wrong token, not a 500.
        return token is not None and hmac.compare_digest(as_bytes(given), as_bytes(token))

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        public = (request.method, request.path) in _PUBLIC or request.path.startswith("/admin/static/")
        if token is not None and not public:
            header = request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else request.cookies.get(COOKIE, "")
            if not valid(given):
                return web.json_response({"error": "admin token required"}, status=401)
        return await handler(request)

    # Host and Origin first (another site's page must not drive a loopback console through the
    # operator's browser, by rebinding its name or by posting across sites), then client faults.
    app = web.Application(middlewares=[host_guard(hosts or HostPolicy("127.0.0.1")), client_faults, auth])

    def signed_in(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        assert token is not None
        response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/",
                            secure=served_over_https(request))
        return response

    async def console(request: web.Request) -> web.StreamResponse:
        given = request.query.get("token")
        if given is not None:  # a link with the token: set the cookie, then drop the token from the URL
            if valid(given):
                return signed_in(request, web.Response(status=303, headers={"Location": request.path}))
            await asyncio.sleep(0.5)  # slows guessing
        return static_response(request, "admin.html", page=True)

    async def login(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        given = body.get("token") if isinstance(body, dict) else None
        if not isinstance(given, str):
            return web.json_response({"error": 'body must be {"token": "..."}'}, status=400)
        if token is None:
            return web.json_response({"ok": True, "auth": "none"})
        if not valid(given):
            await asyncio.sleep(0.5)
            return web.json_response({"error": "wrong token"}, status=401)
        return signed_in(request, web.json_response({"ok": True, "auth": "token"}))

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if not name.startswith("admin"):
            raise web.HTTPNotFound()
        return static_response(request, name)

    async def prometheus(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def sessions(_request: web.Request) -> web.Response:
        return _json({"sessions": await session_table(router, store)})

    async def stop(request: web.Request) -> web.Response:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        key = body.get("key") if isinstance(body, dict) else None
        if not isinstance(key, str):
            return web.json_response({"error": "body must be {\"key\": \"<session key>\"}"}, status=400)
        run = router.hard_cancel(key, STOPPED_BY_OPERATOR)
        return web.json_response({"key": key, "stopped": run is not None})

    async def stats(_request: web.Request) -> web.Response:
        cache = router.cache
        checks = await readiness()
        body: dict[str, Any] = {
            "agent_cache": {"size": len(cache), "max": cache.max_agents, "hits": cache.hits,
                            "misses": cache.misses, "evictions": cache.evictions},
            # The last bucket's bound is +Inf, sent as null (JSON has no infinity).
            "stop_latency_buckets": [(le if math.isfinite(le) else None, n)
                                     for le, n in metrics.stop_histogram()],
            "health": {name: {"ok": h.ok, "detail": h.detail} for name, h in checks.items()},
            "agent": router.agent.description,
        }
        if extra_stats is not None:
            body.update(extra_stats())
        return _json(body)

    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/admin/api/sessions", sessions)
    app.router.add_post("/admin/api/sessions/stop", stop)
    app.router.add_get("/admin/api/stats", stats)
    app.router.add_get("/admin", console)
    app.router.add_post("/admin/login", login)
    app.router.add_get("/admin/static/{name}", asset)
    return app


async def session_table(router: Router, store: Store) -> list[dict[str, Any]]:
    """Live sessions first (running or queued), then recently active idle ones from the store."""
    now = time.time()
    rows: dict[str, dict[str, Any]] = {}
    for status in router.sessions():
        rows[status.key] = _row(status.key, "running" if status.running else "queued" if status.queued else "idle",
                                status.since, status.queued, router, now)
    for info in await store.sessions(limit=200):
        if info.key not in rows:
            rows[info.key] = _row(info.key, "idle", None, 0, router, now)
    return list(rows.values())


def _row(key: str, state: str, since: float | None, queued: int, router: Router, now: float) -> dict[str, Any]:
    platform, _, rest = key.partition(":")
    chat_type, _, chat = rest.partition(":")
    last = router.interruptions.get(key)
    live = router.cache.peek(key)
    return {"key": key, "platform": platform, "chat_type": chat_type, "chat": chat, "state": state,
            "turn_age_s": round(now - since, 1) if since else None, "queued": queued,
            "worker": router.worker_id,
            "tokens": {"prompt": live.tokens_used[0], "completion": live.tokens_used[1],
                       "context": live.prompt_tokens} if live is not None else None,
            "last_interruption": {"kind": last[0], "reason": last[1], "at": last[2]} if last else None}
