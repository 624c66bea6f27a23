"""Every Redis key Switchboard uses, named in one place.

All keys of one session share the hash tag `{s:<session key>}`, so each Lua script touches one
slot and the same code runs on Redis Cluster as on a single Redis.
"""

from __future__ import annotations

import hashlib

PREFIX = "sb"


def _tag(session_key: str) -> str:
    # Braces inside a session key would end the hash tag early; chat ids never contain them,
    # but make sure.
    return "{s:" + session_key.replace("{", "(").replace("}", ")") + "}"


# --- per session (one slot each) ------------------------------------------------------------

def lease(session_key: str) -> str:
    """Hash: token (`<worker>/<incarnation>`), worker, fence. Expires with the lease TTL (Redis
    server time). Shared stores apply a session write only while this carries the writer's fence."""
    return f"{PREFIX}:{_tag(session_key)}:lease"


def fence(session_key: str) -> str:
    """Integer, INCR on every acquisition (never below the server clock in ms); expires one lease TTL
    after the last acquisition, since later fences start from the clock, which has moved on."""
    return f"{PREFIX}:{_tag(session_key)}:fence"


def meta(session_key: str) -> str:
    """Hash: conversation number, created/updated timestamps."""
    return f"{PREFIX}:{_tag(session_key)}:meta"


def messages(session_key: str, conversation: int) -> str:
    """List of JSON transcript rows of one conversation."""
    return f"{PREFIX}:{_tag(session_key)}:msgs:{conversation}"


def inbound(session_key: str) -> str:
    """Hash: inbound id -> JSON {message, status, detail, received_at} for open messages."""
    return f"{PREFIX}:{_tag(session_key)}:inbound"


def seen(session_key: str, platform: str, chat_id: str, message_id: str) -> str:
    """SET NX with a TTL, in the session's slot: claimed in the same script that records the
    message, so a crash can never leave a claim without its record (the Redis store)."""
    return f"{PREFIX}:{_tag(session_key)}:seen:{platform}:{chat_id}:{message_id}"


# --- global -----------------------------------------------------------------------------

def inbound_ids() -> str:
    """Integer counter for inbound ids."""
    return f"{PREFIX}:inbound-ids"


def sessions_index() -> str:
    """Sorted set: session key -> last update time (for listings; written by each session write's
    script on a single Redis, in batches ≤ 0.2 s late in a Redis Cluster)."""
    return f"{PREFIX}:sessions"


def pairing_codes(platform: str) -> str:
    """Hash: code -> JSON {user_id, user_name, created_at}."""
    return f"{PREFIX}:pairing:{{{platform}}}:codes"


def paired_users(platform: str) -> str:
    """Hash: user id -> JSON {user_name, approved_at}."""
    return f"{PREFIX}:pairing:{{{platform}}}:users"


def pairing_code_index() -> str:
    """Hash: code -> platform, so `pairing approve CODE` finds the platform."""
    return f"{PREFIX}:pairing:code-index"


def pairing_platforms() -> str:
    """Set of platforms that ever issued a pairing code, so `pairing list` can enumerate them."""
    return f"{PREFIX}:pairing:platforms"


def leased() -> str:
    """Sorted set: session with work open (a turn queued or running) -> when its owner's lease runs
    out (ms, moved on with every renewal round; removed a moment after the work is done, in
    batches, unless more work came meanwhile). Every live worker
    scans it for leases that lapsed and adopts the turns behind them."""
    return f"{PREFIX}:leased"


def workers() -> str:
    """Hash: worker id -> JSON {seen_at, incarnation, http, sessions (count), ingress} heartbeat."""
    return f"{PREFIX}:workers"


def worker_alive(worker_id: str) -> str:
    """The incarnation of the worker alive under this id (SET PX one lease TTL, refreshed with its
    heartbeat; server-side expiry)."""
    return f"{PREFIX}:alive:{{{worker_id}}}"


def worker_sessions(worker_id: str) -> str:
    """Set of sessions leased to any incarnation of a worker id (SADD on acquisition, SREM on release
    or loss): a restarted worker takes its predecessor's over at start."""
    return f"{PREFIX}:owned:{{{worker_id}}}"


def worker_inbox(worker_id: str) -> str:
    """Stream of messages and commands forwarded to a worker (consumer group `GROUP`)."""
    return f"{PREFIX}:inbox:{{{worker_id}}}"


def relay(worker_id: str) -> str:
    """Stream of the turns other workers run for clients connected to this worker (the HTTP API,
    the web chat): each entry is one event of one relayed turn (its text, its end, a notice)."""
    return f"{PREFIX}:relay:{{{worker_id}}}"


def forward_reply(request_id: str) -> str:
    """List the owner pushes a forwarded command's result to (the sender BLPOPs it)."""
    return f"{PREFIX}:reply:{request_id}"


def ingress(name: str) -> str:
    """Leader lease of an ingress singleton (a Telegram poller, a Discord shard)."""
    return f"{PREFIX}:ingress:{{{name}}}"


def ingress_state(name: str, field: str) -> str:
    """State an ingress leader hands on, e.g. the Telegram update offset."""
    return f"{PREFIX}:ingress:{{{name}}}:{field}"


def sentinel() -> str:
    """A value every worker sets once it joins and checks with its heartbeat: missing, it means
    Redis lost its data (restarted without persistence, flushed, failed over to an empty replica),
    and with it everything created once at start (inbox groups, leases, listings)."""
    return f"{PREFIX}:sentinel"


def token_id(token: str) -> str:
    """A stable, non-secret name for a bot token (never put the token itself in a key)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


GROUP = "workers"
