"""The daemon's HTTP listener: health, readiness and the routes the platforms declare."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.core.ports import Health
from gateway.ops.client_faults import client_faults
from gateway.ops.hosts import HostPolicy, host_guard

ReadinessCheck = Callable[[], Awaitable[dict[str, Health]]]


def build_app(readiness: ReadinessCheck, routes: Sequence[web.AbstractRouteDef] = (), *,
              max_body: int = 1 << 20, hosts: HostPolicy | None = None,
              middlewares: Sequence[Middleware] = ()) -> web.Application:
    # Outermost first: a foreign Host is refused before anything else runs; the platforms'
    # `middlewares` see what the handlers raise once client faults are answered.
    app = web.Application(client_max_size=max_body,
                          middlewares=[host_guard(hosts or HostPolicy("127.0.0.1")), *middlewares, client_faults])

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        checks = await readiness()
        ready = all(h.ok for h in checks.values() if h.required)  # advisory checks are shown, not counted
        body = {"ready": ready, "checks": {name: health_json(h) for name, h in checks.items()}}
        return web.json_response(body, status=200 if ready else 503)

    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz), *routes])
    return app


def health_json(health: Health) -> dict[str, object]:
    """A check as `/readyz` and the console's stats show it (`required: false`: advisory)."""
    shown: dict[str, object] = {"ok": health.ok, "detail": health.detail}
    if not health.required:
        shown["required"] = False
    return shown


async def start_sites(runner: web.AppRunner, host: str, port: int) -> None:
    """Start listening on a runner that is already set up (its cleanup stops the sites too)."""
    await web.TCPSite(runner, host, port).start()

