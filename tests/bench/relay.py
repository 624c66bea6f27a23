"""The floor under the API benchmark: an aiohttp relay that does only the HTTP work the daemon does.

One request in (JSON body parsed, a bearer key checked), one streamed request to the provider
(its server-sent events read and joined), one JSON completion out; on uvloop where installed, as
the daemon. No store, no sessions, no router, no metrics: whatever a gateway built on aiohttp adds
per message comes on top of this relay's CPU.

    python -m tests.bench.relay --port P --provider http://127.0.0.1:Q/v1
"""

from __future__ import annotations

import argparse
import json
import time

import aiohttp
from aiohttp import web

from gateway.ops.loop import loop_factory

KEY = "bench-key"


def app(provider: str) -> web.Application:
    async def start(app: web.Application) -> None:
        app["http"] = aiohttp.ClientSession()

    async def stop(app: web.Application) -> None:
        await app["http"].close()

    async def completions(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": "unauthorized"}, status=401)
        body = await request.json()
        ask = {"model": "bench", "messages": body["messages"], "stream": True,
               "stream_options": {"include_usage": True}}
        text = []
        async with request.app["http"].post(f"{provider}/chat/completions", json=ask) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    text.append(choices[0].get("delta", {}).get("content") or "")
        return web.json_response({"id": "relay", "object": "chat.completion", "created": int(time.time()),
                                  "model": "switchboard", "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                      "role": "assistant", "content": "".join(text)}}]})

    application = web.Application()
    application.router.add_post("/v1/chat/completions", completions)
    application.router.add_get("/readyz", lambda request: web.Response(text="ok"))  # type: ignore[arg-type,return-value]
    application.on_startup.append(start)
    application.on_cleanup.append(stop)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--provider", required=True)
    args = parser.parse_args()
    loop = loop_factory("auto")()  # as the daemon: uvloop where installed
    web.run_app(app(args.provider), host="127.0.0.1", port=args.port, print=None, access_log=None, loop=loop)


if __name__ == "__main__":
    main()
