"""Ids unique across processes and restarts, without a system call each.

A random prefix drawn once per process, then a counter: what `uuid4` gives a message id or a
completion id (never repeated), for a fraction of its cost on the hot path. Not secrets: where an
id must not be guessable, use `secrets`.
"""

from __future__ import annotations

import itertools
import secrets

_PREFIX = secrets.token_hex(8)
_count = itertools.count(1)


def unique_id() -> str:
    """32 hex digits, unique for this process' life and (by its random half) across processes."""
    return f"{_PREFIX}{next(_count):016x}"
