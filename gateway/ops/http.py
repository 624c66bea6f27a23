"""The daemon's HTTP listeners: health, readiness and the routes the platforms declare; and the
edge every listener stands behind.

The edge holds against clients that hold connections instead of using them:

- **A deadline for a request's head**: a connection must deliver a complete request head within
  `header_timeout_s` of opening, and within as long of its previous answer (so an idle keep-alive
  connection closes then too): aiohttp's keep-alive timer, which also runs while a head is only
  partly received.
- **A deadline for its body** (`body_timeout_s`, counted from the head): `read_json`
  (`platforms/http_input.py`); a body no handler reads is drained for `LINGER_S` at most after the
  answer, then the connection is closed.
- **A cap on connections per client address** (`ConnectionGuard`): past it a connection is answered
  503 and closed at once. Addresses in `uncapped` (loopback by default: a reverse proxy on this
  host brings every client through one address) are not capped.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.core.ports import Health
from gateway.ops.client_faults import client_faults, note
from gateway.ops.edge import EdgeSettings
from gateway.ops.hosts import HostPolicy, host_guard
from platforms.http_input import BODY_LIMITS, MB, BodyLimits

ReadinessCheck = Callable[[], Awaitable[dict[str, Health]]]
LINGER_S = 2.0  # after an answer, the unread rest of a body is drained this long at most
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 5\r\n"
            b"Content-Type: text/plain\r\nContent-Length: 40\r\n\r\ntoo many connections from this address\r\n")


def edge_runner(app: web.Application, edge: EdgeSettings, *, handler_cancellation: bool = False) -> web.AppRunner:
    """A listener's `AppRunner`: aiohttp's keep-alive timer is the head's deadline."""
    return web.AppRunner(app, access_log=None, shutdown_timeout=2.0, handler_cancellation=handler_cancellation,
                         keepalive_timeout=edge.header_timeout_s, lingering_time=LINGER_S)


def build_app(readiness: ReadinessCheck, routes: Sequence[web.AbstractRouteDef] = (), *,
              max_body: int = MB, hosts: HostPolicy | None = None, edge: EdgeSettings | None = None,
              middlewares: Sequence[Middleware] = ()) -> web.Application:
    """`max_body`: the largest body a route takes unless it allows more itself (the HTTP API)."""
    # Outermost first: a foreign Host is refused before anything else runs; the platforms'
    # `middlewares` see what the handlers raise once client faults are answered.
    app = web.Application(client_max_size=max_body,
                          middlewares=[host_guard(hosts or HostPolicy("127.0.0.1")), *middlewares, client_faults])
    app[BODY_LIMITS] = BodyLimits(max_body, (edge or EdgeSettings()).body_timeout_s)

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


class ConnectionGuard:
    """Open connections per client address, and the cap on them."""

    def __init__(self, limit: int, uncapped: Sequence[str] = ()) -> None:
        self.limit = limit
        self._uncapped = [ipaddress.ip_network(a, strict=False) for a in uncapped]
        self._open: dict[str, int] = {}

    def open_from(self, address: str) -> int:
        return self._open.get(address, 0)

    def admit(self, address: str) -> bool:
        """Count a new connection from `address`; False (not counted) if it is over the cap."""
        count = self._open.get(address, 0)
        if self.limit > 0 and count >= self.limit and not self._exempt(address):
            return False
        self._open[address] = count + 1
        return True

    def release(self, address: str) -> None:
        left = self._open.get(address, 0) - 1
        if left > 0:
            self._open[address] = left
        else:
            self._open.pop(address, None)

    def wrap(self, inner: asyncio.Protocol) -> asyncio.Protocol:
        return _Guarded(inner, self)

    def _exempt(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return False
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return any((mapped or ip) in net for net in self._uncapped if (mapped or ip).version == net.version)


class _Guarded(asyncio.Protocol):
    """The listener's protocol, behind the guard: a connection over the cap never reaches it."""

    __slots__ = ("_address", "_guard", "_inner")

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._address: str | None = None  # set once admitted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self._guard.admit(address):
            note(f"a connection from {address} refused: it has {self._guard.limit} open already")
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(_REFUSED)
            transport.close()
            return
        self._address = address
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._address is None:
            return
        self._guard.release(self._address)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._address is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._address is not None else None

    def pause_writing(self) -> None:
        if self._address is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._address is not None:
            self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections pass a `ConnectionGuard` first."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner, backlog=1024)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        guard = self._guard
        self._server = await asyncio.get_running_loop().create_server(
            lambda: guard.wrap(server()), self._host, self._port, backlog=self._backlog, reuse_address=True)


async def start_sites(runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard | None = None) -> None:
    """Start listening on a runner that is already set up (its cleanup stops the sites too)."""
    await GuardedSite(runner, host, port, guard or ConnectionGuard(0)).start()
