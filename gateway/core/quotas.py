"""Quotas per tenant, so that no tenant can take what another one needs.

A *tenant* is whoever a message is accounted to: an API key (`api:<tenant name>`, or `api`
for the one anonymous tenant of an API without keys), and each other platform as a whole (`webchat`,
`telegram`, `discord`). Per tenant, over all of its sessions:

- **messages per minute** — every message, stateless API requests and commands included, except
  `/stop`, which always gets through;
- **turns in flight** — turns running or waiting in a queue at once; a message that would start
  one more is refused, not queued;
- **live sessions** — sessions held in memory (the agent cache): at the cap, the tenant's least
  recently used idle session is dropped from memory to make room (its history stays stored);
- **media bytes on disk** — the copies of attachments kept for replays (`platforms/media.py`):
  at the cap, the tenant's oldest copies are deleted.

A message refused by a quota is answered "limited" with the time after which trying again makes
sense: the HTTP API answers 429 with `Retry-After`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.cancellation import Run
from gateway.core.messages import InboundMessage

log = logging.getLogger(__name__)

TURNS_RETRY_S = 5.0  # what a client is told to wait when its tenant has every turn it may have in flight


QuotaName = Literal["messages_per_minute", "running_turns", "live_sessions", "media_mb"]


@dataclass
class TenantQuota:
    """Limits for one tenant, in `[quotas] tenants`; an unset one is the `[quotas]` default."""

    messages_per_minute: int | None = None
    running_turns: int | None = None
    live_sessions: int | None = None
    media_mb: float | None = None


@dataclass
class QuotaSettings:
    """The `[quotas]` section of the config: limits per tenant (0 turns one off), and per-tenant
    exceptions by tenant name (`api:<name>`, `webchat`, `telegram`, `discord`)."""

    messages_per_minute: int = 600
    running_turns: int = 128
    live_sessions: int = 128
    media_mb: float = 512.0
    tenants: dict[str, TenantQuota] = field(default_factory=dict)

    def limit(self, tenant: str, name: QuotaName) -> float:
        """`tenant`'s limit `name`: its own, else the default (0: no limit)."""
        own = self.tenants.get(tenant)
        value = getattr(own, name) if own is not None else None
        return float(getattr(self, name) if value is None else value)


def tenant_of(platform: str, tenant: str | None) -> str:
    """The name a message is accounted to: `api:<name>` for an API key, else the platform."""
    return f"{platform}:{tenant}" if tenant else platform


def api_tenant(session_key: str) -> str | None:
    """The API tenant a session key names (`api:dm:<tenant>/<session id>`: a tenant's name holds no
    `/`), or None. For what a session is shown only: a decision about access reads the run's tenant."""
    prefix = "api:dm:"
    if not session_key.startswith(prefix) or "/" not in session_key:
        return None
    return session_key[len(prefix):].split("/", 1)[0]


def message_tenant(msg: InboundMessage) -> str:
    return tenant_of(msg.platform, msg.tenant)


def who(tenant: str) -> str:
    """The tenant in a sentence a user reads."""
    platform = tenant.partition(":")[0]
    if platform == "api":
        return "this API key"
    return {"webchat": "the web chat"}.get(platform, f"{platform} as a whole")


class TenantLoad:
    """Turns in flight per tenant. A slot is reserved when the gates let a message through (so
    concurrent messages cannot all slip past the count), then either given back (the message
    started no turn) or held by the turn's run until that turn is over."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        return self._count.get(tenant, 0)

    def reserve(self, tenant: str) -> None:
        self._count[tenant] = self._count.get(tenant, 0) + 1

    def release(self, tenant: str) -> None:
        left = self._count.get(tenant, 0) - 1
        if left > 0:
            self._count[tenant] = left
        else:
            self._count.pop(tenant, None)

    def settle(self, tenant: str, run: Run | None) -> None:
        """A reserved slot: held by `run` until its turn is over, or given back now (no run)."""
        if run is None:
            self.release(tenant)
        else:
            run.on_end(lambda: self.release(tenant))
