"""Ids unique across processes and restarts, unguessable, without a system call each.

A keyed hash (BLAKE2b, under a key drawn once per process) of a counter: unique like `uuid4`
(distinct inputs, 128 bits out), and — unlike a prefix and a counter — it tells whoever sees two
ids nothing of how many were made between them: a response id or a job's notice id is no window
on other tenants' traffic. About 3 µs each.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets

_KEY = secrets.token_bytes(32)
_count = itertools.count(1)


def unique_id() -> str:
    """32 hex digits, never repeated, unguessable."""
    return hashlib.blake2b(next(_count).to_bytes(8, "big"), key=_KEY, digest_size=16).hexdigest()
