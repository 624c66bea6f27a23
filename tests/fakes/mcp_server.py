"""A small MCP server written with the official SDK's high-level server, for the tests (stdio or
streamable HTTP): `FastMCP` in SDK 1.x, `MCPServer` (its new name) in 2.x.

    python -m tests.fakes.mcp_server --record FILE [--http PORT] [--fail-if FILE]

Tools: `echo`, `add` (a typed schema), `slow` (sleeps; records when it starts and when it is
cancelled), `crash` (the process exits at once), `spawn_child` (starts a `sleep` in the same process
group and returns its PID), `getenv`, `header`, `secret` (for the filter tests). Every event is one JSON line appended
to the record file, so a test can await it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

V2 = int(importlib.metadata.version("mcp").split(".")[0]) >= 2
_high_level: Any = importlib.import_module("mcp.server.mcpserver" if V2 else "mcp.server.fastmcp")
Handler = TypeVar("Handler", bound=Callable[..., Any])
Context = _high_level.Context  # the SDK finds the parameter that gets the call's context by this class


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", required=True)
    parser.add_argument("--http", type=int, default=0, help="serve streamable HTTP on this port (else stdio)")
    parser.add_argument("--name", default="fake")
    parser.add_argument("--fail-if", help="exit at once (status 1) while this file exists")
    args = parser.parse_args()
    if args.fail_if and os.path.exists(args.fail_if):
        print("refusing to start: the test blocked it", file=sys.stderr, flush=True)
        sys.exit(1)

    def record(event: str, **fields: object) -> None:
        with open(args.record, "a") as fh:
            fh.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")

    server: Any
    if V2:  # the address moved from the constructor to run()
        server = _high_level.MCPServer(args.name, log_level="WARNING")
    else:
        server = _high_level.FastMCP(args.name, host="127.0.0.1", port=args.http or 8000, log_level="WARNING")

    def tool() -> Callable[[Handler], Handler]:
        decorator: Callable[[Handler], Handler] = server.tool()
        return decorator

    @tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        record("echo", text=text)
        return text

    @tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool()
    async def slow(seconds: float, tag: str = "") -> str:
        """Sleep for a number of seconds, then say so."""
        record("slow_started", tag=tag)
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            record("slow_cancelled", tag=tag)
            raise
        record("slow_finished", tag=tag)
        return f"slept {seconds:g} s"

    @tool()
    def crash() -> str:
        """Exit the server process at once."""
        record("crash")
        os._exit(3)

    @tool()
    def spawn_child() -> int:
        """Start a long sleep in this server's process group and return its PID."""
        child = subprocess.Popen(["sleep", "300"])
        record("child", child=child.pid)
        return child.pid

    @tool()
    def getenv(name: str) -> str:
        """The value of an environment variable of the server ("" if unset)."""
        return os.environ.get(name, "")

    @tool()
    def header(name: str, ctx: Context) -> str:  # type: ignore[valid-type]
        """A header of the HTTP request that carried this call ("" over stdio)."""
        request = ctx.request_context.request  # type: ignore[attr-defined]
        return str(request.headers.get(name, "")) if request is not None else ""

    @tool()
    def secret() -> str:
        """A tool the filter tests hide."""
        return "hidden"

    record("started", transport="http" if args.http else "stdio")
    if args.http:
        server.run("streamable-http", **({"host": "127.0.0.1", "port": args.http} if V2 else {}))
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
