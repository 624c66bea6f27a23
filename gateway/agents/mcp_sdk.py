"""The official MCP SDK, 1.x or 2.x: the places where the two differ, in one module.

2.x renamed the protocol types' fields to snake_case (`inputSchema` is `input_schema`), `McpError`
to `MCPError`, replaced httpx with httpx2, made the message unions plain unions (no `.root`), took
`cursor=` off the list methods, parses a JSON-RPC message with a TypeAdapter, yields two streams
from `streamable_http_client` (not three), and runs `ClientSession` on a dispatcher that itself tells
the server about a request it stops waiting for (1.x did not: see `mcp_session.CancellingSession`).
What the daemon uses beyond that is the same in both. The version-specific names are looked up at
import time, so the rest of the code (and its type checking) reads the same under either.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from collections.abc import AsyncIterator, Mapping
from typing import Any

import mcp
from mcp import types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, create_mcp_http_client

VERSION = importlib.metadata.version("mcp")
V2 = int(VERSION.split(".")[0]) >= 2

MCPError: Any = vars(mcp).get("MCPError") or vars(mcp)["McpError"]  # the protocol error; `.error`: code, message
http: Any = importlib.import_module("httpx2" if V2 else "httpx")  # the HTTP client library the SDK's transport uses
# The protocol types, for the names that exist in one version only (type checking runs under either).
sdk_types: Any = types


def attr(obj: Any, name: str) -> Any:
    """A protocol type's field by its snake_case (2.x) name, under either version."""
    if V2:
        return getattr(obj, name)
    head, *rest = name.split("_")
    return getattr(obj, head + "".join(word.title() for word in rest))


def inner(message: Any) -> Any:
    """The message a 1.x union wrapper (`RootModel`) holds; a 2.x message is itself."""
    return getattr(message, "root", message)


def parse_message(line: bytes) -> Any:
    """One JSON-RPC message from its JSON text (ValueError if it is not one)."""
    if V2:
        return sdk_types.jsonrpc_message_adapter.validate_json(line)
    return sdk_types.JSONRPCMessage.model_validate_json(line)


async def list_tools(session: Any, cursor: str | None) -> Any:
    """One page of a server's tools (the first for `cursor` None)."""
    if cursor is None:
        return await session.list_tools()
    if V2:
        return await session.list_tools(params=sdk_types.PaginatedRequestParams(cursor=cursor))
    return await session.list_tools(cursor=cursor)


@contextlib.asynccontextmanager
async def http_streams(url: str, headers: Mapping[str, str], timeout_s: float) -> AsyncIterator[tuple[Any, Any]]:
    """The SDK's streamable HTTP transport (the session is ended with a DELETE when it closes). Reads
    may wait long (a call's result streams when it is ready): calls have their own deadline."""
    timeout = http.Timeout(timeout_s, read=MCP_DEFAULT_SSE_READ_TIMEOUT)
    async with create_mcp_http_client(headers=dict(headers), timeout=timeout) as client, \
            streamable_http_client(url, http_client=client) as streams:
        yield streams[0], streams[1]  # 1.x adds a third: the session id's getter
