"""Host and Origin checks on the daemon's listeners (against DNS rebinding and cross-site requests).

A page on a name the attacker controls can have that name resolve to 127.0.0.1 and then talk to a
loopback listener as if it were its own site: the browser sends the attacker's name in `Host`. So
every request must name this daemon in `Host`: an IP address literal (rebinding needs a name),
`localhost` (and `*.localhost`), the listener's own bind name, or a configured name
(`allowed_hosts`; `*.example.org` matches its subdomains, `*` turns the check off). Anything else
is answered 421.

A state-changing request (not GET, HEAD, OPTIONS) or a websocket that carries `Origin` must come
from this very site: the Origin's host and port equal `Host`, or its name is a configured one.
Otherwise 403. `/healthz` and `/readyz` are exempt (probes, no data).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web
from aiohttp.typedefs import Middleware
from yarl import URL

from gateway.ops.client_faults import note

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
EXEMPT = frozenset({"/healthz", "/readyz"})


def _hostname(netloc: str) -> str | None:
    """The name in a Host header or an Origin's authority, lowercased; None if it is not one."""
    try:
        host = URL(f"http://{netloc}").raw_host
    except (ValueError, TypeError):
        return None
    return host.lower().rstrip(".") if host else None


@functools.lru_cache(maxsize=256)  # asked for every request's Host, nearly always the same few names
def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which names a listener answers to."""

    def __init__(self, bind_host: str, allowed: Iterable[str] = ()) -> None:
        names = {a.strip().lower().rstrip(".") for a in allowed if a.strip()}
        self.any = "*" in names
        self.exact = {n for n in names if not n.startswith("*.")}
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))
        bind = bind_host.lower()
        if bind and not _is_ip(bind):
            self.exact.add(bind)

    def configured(self, name: str) -> bool:
        return self.any or name in self.exact or name.endswith(self.suffixes)

    def host_ok(self, name: str) -> bool:
        return _is_ip(name) or name == "localhost" or name.endswith(".localhost") or self.configured(name)

    def origin_ok(self, origin: str, host: str | None) -> bool:
        if self.any:
            return True
        try:
            url = URL(origin)
        except (ValueError, TypeError):
            return False
        if url.scheme not in ("http", "https") or not url.raw_host:
            return False  # "null" (sandboxed frames, files) and other schemes
        authority = url.raw_authority.lower()
        if host is not None and authority == host.lower():
            return True
        name = url.raw_host.lower().rstrip(".")
        return name in self.exact or name.endswith(self.suffixes)


def host_guard(policy: HostPolicy) -> Middleware:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in EXEMPT:
            return await handler(request)
        host = request.headers.get("Host")  # absent: not a browser (they always send it)
        if host is not None:
            name = _hostname(host)
            if name is None or not policy.host_ok(name):
                # The name, so the operator can tell a misconfiguration (add it to allowed_hosts) from an attack.
                note(f"{request.method} {request.path} from {request.remote}: Host {host[:100]!r} is not served here")
                return web.json_response({"error": "this host name is not served here (allowed_hosts)"}, status=421)
        origin = request.headers.get("Origin")
        changing = request.method not in SAFE_METHODS or request.headers.get("Upgrade", "").lower() == "websocket"
        if origin is not None and changing and not policy.origin_ok(origin, host):
            note(f"{request.method} {request.path} from {request.remote}: cross-origin request")
            return web.json_response({"error": "cross-origin request refused"}, status=403)
        return await handler(request)

    return guard
