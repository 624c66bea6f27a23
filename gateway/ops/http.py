"""The daemon's one aiohttp listener: health, readiness, and whatever routes adapters add."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

ReadinessCheck = Callable[[], Awaitable[dict[str, tuple[bool, str]]]]


def build_app(readiness: ReadinessCheck, *, max_body: int = 1 << 20) -> web.Application:
    app = web.Application(client_max_size=max_body)

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        checks = await readiness()
        ready = all(ok for ok, _ in checks.values())
        body = {"ready": ready, "checks": {name: {"ok": ok, "detail": detail}
                                           for name, (ok, detail) in checks.items()}}
        return web.json_response(body, status=200 if ready else 503)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
