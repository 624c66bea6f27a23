"""JSON on the hot path: orjson where it can, the standard library where orjson refuses what the
standard library takes (lone surrogates, NaN, integers past 64 bits when encoding, non-string
keys). Results are the standard library's, with one exception: orjson reads an integer past 64
bits as a float. Not for untrusted request bodies: orjson reads any depth of nesting, which the
standard library refuses.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_ASCII = json.JSONEncoder(separators=(",", ":"))


def loads(text: str | bytes) -> Any:
    """As `json.loads` (same values but for integers past 64 bits, same errors)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def dumps(value: Any) -> bytes:
    """Compact JSON as UTF-8. What orjson cannot encode (a lone surrogate, a huge integer) comes
    from the standard library, as ASCII with escapes: valid either way."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return _ASCII.encode(value).encode()


def dumps_text(value: Any) -> str:
    """Compact JSON as a str, text as itself: as `json.dumps(value, ensure_ascii=False)` would
    give it (a lone surrogate included, for the caller's own checks to find)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
