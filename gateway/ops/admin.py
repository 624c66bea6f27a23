"""The operator listener: Prometheus `/metrics`, the console (`/admin`, and `/` leads there), its JSON
API, operator stops.

It binds loopback by default; bound anywhere else it requires `admin.token`, as a bearer token or
as the `switchboard_admin` cookie the console's login sets (`/admin?token=...` once, or the form):
an HMAC of the token, never the token itself. Wrong guesses are throttled per source and in all
(`gateway/ops/signin.py`). The console page and its static files are public: they hold no data,
the API behind them does.
"""

from __future__ import annotations

import functools
import hmac
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.core.cancellation import STOPPED_BY_OPERATOR
from gateway.core.cluster import ClusterUnavailable
from gateway.core.metrics import Metrics
from gateway.core.ports import Store
from gateway.core.router import Router
from gateway.ops.client_faults import client_faults
from gateway.ops.edge import EdgeSettings
from gateway.ops.hosts import HostPolicy, host_guard
from gateway.ops.http import ReadinessCheck, health_json
from gateway.ops.signin import GuessThrottle, bearer, session_cookie
from platforms.assets import favicon, static_response
from platforms.http_input import BODY_LIMITS, BodyLimits, read_json, served_over_https
from platforms.tenants import as_bytes

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

COOKIE = "switchboard_admin"
_PUBLIC = {("GET", "/admin"), ("HEAD", "/admin"), ("POST", "/admin/login"), ("GET", "/"), ("HEAD", "/"),
           ("GET", "/favicon.ico"), ("HEAD", "/favicon.ico")}
# Strict JSON: the console parses it with JSON.parse, which has no Infinity.
_json = functools.partial(web.json_response, dumps=functools.partial(json.dumps, allow_nan=False, ensure_ascii=False))


def build_admin_app(router: Router, metrics: Metrics, store: Store, readiness: ReadinessCheck, *, token: str | None,
                    extra_stats: Callable[[], dict[str, Any]] | None = None,
                    hosts: HostPolicy | None = None, edge: EdgeSettings | None = None) -> web.Application:
    console = AdminConsole(router, metrics, store, readiness, token=token, extra_stats=extra_stats)
    # Host and Origin first (another site's page must not drive a loopback console through the
    # operator's browser, by rebinding its name or by posting across sites), then client faults.
    app = web.Application(middlewares=[host_guard(hosts or HostPolicy("127.0.0.1")), client_faults, console.auth])
    app[BODY_LIMITS] = BodyLimits(64 * 1024, (edge or EdgeSettings()).body_timeout_s)  # a token, a session key
    app.router.add_get("/metrics", console.prometheus)
    app.router.add_get("/admin/api/sessions", console.sessions)
    app.router.add_post("/admin/api/sessions/stop", console.stop)
    app.router.add_get("/admin/api/stats", console.stats)
    app.router.add_get("/admin", console.page)
    app.router.add_post("/admin/login", console.login)
    app.router.add_get("/admin/static/{name}", console.asset)
    app.router.add_get("/", console.home)
    app.router.add_get("/favicon.ico", favicon)
    return app


class AdminConsole:
    """The admin listener's handlers, and who may call them."""

    def __init__(self, router: Router, metrics: Metrics, store: Store, readiness: ReadinessCheck, *,
                 token: str | None, extra_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self._router = router
        self._metrics = metrics
        self._store = store
        self._readiness = readiness
        self._token = token
        self._cookie = session_cookie(token) if token is not None else None
        self._extra_stats = extra_stats
        self.guesses = GuessThrottle()

    def _check(self, request: web.Request, given: str, expected: str | None) -> web.Response | None:
        """None if `given` is right; else the answer: 401, or 429 while the source (or everyone)
        guesses too fast — then `given` is not even compared."""
        source = request.remote or ""
        wait = self.guesses.wait(source)
        if wait is not None:
            return web.json_response({"error": "too many wrong tokens; try again later"}, status=429,
                                     headers={"Retry-After": f"{wait:.0f}"})
        # as_bytes: a header that is not UTF-8 is a wrong token, not a 500.
        if expected is not None and hmac.compare_digest(as_bytes(given), as_bytes(expected)):
            self.guesses.succeeded(source)
            return None
        self.guesses.failed(source)
        return web.json_response({"error": "admin token required"}, status=401)

    @web.middleware
    async def auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        public = (request.method, request.path) in _PUBLIC or request.path.startswith("/admin/static/")
        if self._token is not None and not public:
            token = bearer(request.headers.get("Authorization", ""))
            cookie = request.cookies.get(COOKIE)
            if token is None and not cookie:  # no credential at all: not a guess
                return web.json_response({"error": "admin token required"}, status=401)
            refused = self._check(request, token, self._token) if token is not None else \
                self._check(request, cookie or "", self._cookie)
            if refused is not None:
                return refused
        return await handler(request)

    def _signed_in(self, request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        assert self._cookie is not None
        response.set_cookie(COOKIE, self._cookie, httponly=True, samesite="Strict", path="/",
                            secure=served_over_https(request))
        return response

    async def page(self, request: web.Request) -> web.StreamResponse:
        given = request.query.get("token")
        if given is not None and self._token is not None:  # a link with the token: set the cookie, then drop it
            refused = self._check(request, given, self._token)
            if refused is None:
                return self._signed_in(request, web.Response(status=303, headers={"Location": request.path}))
            if refused.status == 429:
                return refused
        return static_response(request, "admin.html", page=True)

    async def home(self, _request: web.Request) -> web.StreamResponse:
        """The listener's root leads to the console (the URL people type first)."""
        raise web.HTTPFound("/admin")

    async def login(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        given = body.get("token") if isinstance(body, dict) else None
        if not isinstance(given, str):
            return web.json_response({"error": 'body must be {"token": "..."}'}, status=400)
        if self._token is None:
            return web.json_response({"ok": True, "auth": "none"})
        refused = self._check(request, given, self._token)
        if refused is not None:
            return refused if refused.status == 429 else web.json_response({"error": "wrong token"}, status=401)
        return self._signed_in(request, web.json_response({"ok": True, "auth": "token"}))

    async def asset(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if not name.startswith("admin"):
            raise web.HTTPNotFound()
        return static_response(request, name)

    async def prometheus(self, _request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def sessions(self, _request: web.Request) -> web.Response:
        try:
            return _json({"sessions": await session_table(self._router, self._store)})
        except ClusterUnavailable as exc:
            return web.json_response({"error": f"cannot reach the other workers: {exc}"}, status=503,
                                     headers={"Retry-After": "5"})

    async def stop(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if isinstance(body, web.Response):
            return body
        key = body.get("key") if isinstance(body, dict) else None
        if not isinstance(key, str):
            return web.json_response({"error": "body must be {\"key\": \"<session key>\"}"}, status=400)
        try:  # wherever it runs: this worker, or the owner another worker's lease names
            worker, stopped = await self._router.stop_anywhere(key, STOPPED_BY_OPERATOR)
        except ClusterUnavailable as exc:
            return web.json_response({"error": f"cannot reach the other workers: {exc}"}, status=503,
                                     headers={"Retry-After": "5"})
        return web.json_response({"key": key, "stopped": stopped, "worker": worker})

    async def stats(self, _request: web.Request) -> web.Response:
        cache = self._router.cache
        checks = await self._readiness()
        body: dict[str, Any] = {
            "agent_cache": {"size": len(cache), "max": cache.max_agents, "hits": cache.hits,
                            "misses": cache.misses, "evictions": cache.evictions},
            # The last bucket's bound is +Inf, sent as null (JSON has no infinity).
            "stop_latency_buckets": [(le if math.isfinite(le) else None, n)
                                     for le, n in self._metrics.stop_histogram()],
            "health": {name: health_json(h) for name, h in checks.items()},
            "agent": self._router.agent.description,
        }
        if self._extra_stats is not None:
            body.update(self._extra_stats())
        return _json(body)


async def session_table(router: Router, store: Store) -> list[dict[str, Any]]:
    """Sessions with work first (running or queued, on whichever worker runs them), then recently
    active idle ones from the store, each with the worker holding it (from its lease) — the same
    table from every worker."""
    now = time.time()
    rows: dict[str, dict[str, Any]] = {}
    for worker, status in await router.everywhere():
        state = "running" if status.running else "queued" if status.queued else "idle"
        rows[status.key] = _row(status.key, state, status.since, status.queued, router, now, worker)
    idle = [info.key for info in await store.sessions(limit=200) if info.key not in rows]
    for key, worker in (await router.owners(idle)).items():
        rows[key] = _row(key, "idle", None, 0, router, now, worker)
    return list(rows.values())


def _row(key: str, state: str, since: float | None, queued: int, router: Router, now: float,
         worker: str | None) -> dict[str, Any]:
    platform, _, rest = key.partition(":")
    chat_type, _, chat = rest.partition(":")
    last = router.interruptions.get(key)
    live = router.cache.peek(key)
    return {"key": key, "platform": platform, "chat_type": chat_type, "chat": chat, "state": state,
            "turn_age_s": round(now - since, 1) if since else None, "queued": queued,
            "worker": worker,
            "tokens": {"prompt": live.tokens_used[0], "completion": live.tokens_used[1],
                       "context": live.prompt_tokens} if live is not None else None,
            "last_interruption": {"kind": last[0], "reason": last[1], "at": last[2]} if last else None}
