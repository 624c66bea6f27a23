"""Reading a client's request: its JSON body (every way it can be wrong is a 4xx, never an
exception) and whether it came over https.

The ways: a body over the size limit (413), a charset Python does not know (415), bytes that are
not text in the declared charset, JSON that does not parse, or JSON nested deeper than the parser
goes (400).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

ErrorResponse = Callable[[int, str], web.Response]


def json_error(status: int, problem: str) -> web.Response:
    """The plain error body of the daemon's own endpoints."""
    return web.json_response({"error": problem}, status=status)


async def read_json(request: web.Request, error: ErrorResponse = json_error) -> Any:
    """The parsed body, or `error(status, problem)` as the response to send instead."""
    try:
        text = await request.text()
    except web.HTTPRequestEntityTooLarge:
        return error(413, f"The request body is larger than {request.client_max_size} bytes.")
    except LookupError:  # charset=bogus
        return error(415, f"Unknown charset {request.charset!r}; send UTF-8.")
    except UnicodeDecodeError:
        return error(400, f"The request body is not valid {request.charset or 'utf-8'} text.")
    try:
        return json.loads(text)
    except RecursionError:
        return error(400, "The request body is nested too deeply.")
    except ValueError:
        return error(400, "The request body must be JSON.")


def served_over_https(request: web.Request) -> bool:
    """Did the browser use https (directly, or through a TLS proxy that says so)? Used only to
    mark cookies `Secure`: a client that lies about it only spoils its own cookie, so the proxy
    headers need no trust here."""
    if request.secure or request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower() == "https":
        return True
    first = request.headers.get("Forwarded", "").split(",")[0]
    return any(part.strip().lower() == "proto=https" for part in first.split(";"))
