"""API tenants: which client an API key belongs to.

Every key has a non-secret name: the one configured in `[api] tenants` (name -> key), or, for a
key of the plain `[api] keys` list, `key-` and a short hash of it. The name namespaces the
sessions the key opens (`api:dm:<tenant>/<session id>`), so two clients that pick the same
session id never share a conversation, and a command (`/stop`, `/new`, `/status`) only ever
reaches the caller's own sessions. The key itself is never an identifier.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence

# Names are a session key's first component: no "/" (the separator), nothing a log could misread.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def key_id(key: str) -> str:
    """The name of a key from the plain list: stable, short, and no way back to the key."""
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def as_bytes(text: str) -> bytes:
    """Bytes to compare a credential with; never raises (header bytes that are not UTF-8 come
    back as surrogate escapes, JSON may carry lone surrogates)."""
    return text.encode("utf-8", "surrogatepass")


def problem(keys: Sequence[str], named: Mapping[str, str]) -> str | None:
    """What is wrong with a tenant configuration, if anything (for the config check)."""
    for name in named:
        if not NAME.fullmatch(name):
            return (f"api.tenants: {name!r} is not a valid tenant name (letters, digits, '_', '.', '-'; "
                    "at most 64; starting with a letter or digit)")
        if name.startswith("key-"):  # else a named key could share a plain key's namespace
            return f"api.tenants: {name!r}: names starting with 'key-' are kept for the keys of api.keys"
    seen: set[str] = set()
    for key in [*keys, *named.values()]:
        if key != key.strip():  # HTTP drops a header value's surrounding whitespace: it could never match
            return "api: a key starts or ends with whitespace, so no request could ever present it"
        if key in seen:
            return "api.tenants: the same key is configured twice (every key belongs to one tenant)"
        seen.add(key)
    return None


class ApiKeys:
    """The accepted bearer keys and the tenant each one names."""

    def __init__(self, keys: Sequence[str] = (), named: Mapping[str, str] | None = None) -> None:
        entries = [(as_bytes(k), key_id(k)) for k in keys]
        entries += [(as_bytes(k), name) for name, k in (named or {}).items()]
        # Found by the SHA-256 of the key, not by the key: a lookup costs the same with 10,000 keys
        # as with one, and its timing depends on a digest, which tells nothing about how close a
        # guess came to a key (a dict keyed by the keys themselves would compare their bytes).
        self._by_digest = {hashlib.sha256(key).digest(): (key, name) for key, name in entries}

    @property
    def required(self) -> bool:
        """False: no key is configured and every caller is the one anonymous tenant."""
        return bool(self._by_digest)

    def tenant(self, authorization: str) -> str | None:
        """The tenant an `Authorization` header names: "" when no keys are required, None when
        the header carries no configured key."""
        if not self._by_digest:
            return ""
        token = as_bytes(authorization[7:]) if authorization[:7].lower() == "bearer " else b""
        key, name = self._by_digest.get(hashlib.sha256(token).digest(), (b"", None))
        return name if hmac.compare_digest(token, key) else None
