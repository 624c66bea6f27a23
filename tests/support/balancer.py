"""A plain round-robin HTTP load balancer, as nginx with no stickiness would be: each request goes
to the next worker, the response (streamed or not) is passed back as it comes, and a client that
hangs up has its upstream request closed."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from tests.support.ports import free_port

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


@asynccontextmanager
async def round_robin(upstreams: Sequence[str]) -> AsyncIterator[str]:
    """Serve a balancer over `upstreams` (base URLs) on a free loopback port; yields its URL."""
    turn = itertools.cycle(upstreams)
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=120))

    async def proxy(request: web.Request) -> web.StreamResponse:
        target = next(turn) + request.rel_url.path_qs
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with client.request(request.method, target, headers=headers, data=await request.read()) as up:
            resp = web.StreamResponse(status=up.status,
                                      headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    # handler_cancellation: a client that hangs up cancels the handler, which closes the upstream request.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await client.close()
