"""Static files of the web chat and the operator console, served from the package (no build step).

Only plain file names from `platforms/static` are served, so a request can never walk out of it.
Responses carry an ETag and `no-cache`: a browser revalidates, so an upgrade shows at once.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources

from aiohttp import web

_TYPES = {"html": "text/html", "js": "text/javascript", "css": "text/css", "svg": "image/svg+xml",
          "png": "image/png"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*\.(html|js|css|svg|png)$")

# Scripts and styles only from our own files: model text that slipped into markup would not run.
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")


def read_static(name: str) -> tuple[bytes, str] | None:
    """The bytes and content type of `static/<name>`, or None if there is no such file."""
    m = _NAME.match(name)
    if m is None:
        return None
    path = resources.files("platforms").joinpath("static", name)
    if not path.is_file():
        return None
    return path.read_bytes(), _TYPES[m.group(1)]


def static_response(request: web.Request, name: str, *, page: bool = False) -> web.StreamResponse:
    """`static/<name>` as a response (404 if missing); `page` adds the CSP and framing headers."""
    found = read_static(name)
    if found is None:
        raise web.HTTPNotFound()
    body, content_type = found
    etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
    headers = {"Cache-Control": "no-cache", "ETag": etag, "X-Content-Type-Options": "nosniff"}
    if page:
        headers.update({"Content-Security-Policy": PAGE_CSP, "X-Frame-Options": "DENY",
                        "Referrer-Policy": "no-referrer"})
    if etag in request.headers.get("If-None-Match", ""):
        return web.Response(status=304, headers=headers)
    charset = "utf-8" if content_type.startswith("text/") or content_type.endswith("+xml") else None
    return web.Response(body=body, content_type=content_type, charset=charset, headers=headers)


async def favicon(request: web.Request) -> web.StreamResponse:
    """`/favicon.ico` on both listeners (browsers ask for it on every page): the SVG icon."""
    return static_response(request, "favicon.svg")
