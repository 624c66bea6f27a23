"""Who may talk to the bot on each chat platform: pairing (default), an allowlist, or open.

Pairing: an unknown user gets a one-time 8-character code and nothing else; the operator runs
`switchboard pairing approve CODE`. Codes expire after an hour, at most three are pending per
platform, and a user is sent their code at most once a minute however often they write.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.messages import InboundMessage
from gateway.core.ports import Store

log = logging.getLogger(__name__)

AccessMode = Literal["pairing", "allowlist", "open"]
CODE_TTL_S = 3600.0
MAX_PENDING = 3
NOTICE_EVERY_S = 60.0
# No 0/O or 1/I/L: codes are read off a phone and typed into a terminal.
_ALPHABET = "23456789ABCDEFGHJKMNPQRSTUVWXYZ"


def new_code() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(8))


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    mode: AccessMode = "pairing"
    allowlist: frozenset[str] = field(default_factory=frozenset)


class AccessControl:
    def __init__(self, store: Store, policies: dict[str, AccessPolicy]) -> None:
        self.store = store
        self.policies = policies
        self._paired: set[tuple[str, str]] = set()
        self._last_notice: OrderedDict[tuple[str, str], float] = OrderedDict()  # oldest first

    def set_policies(self, policies: dict[str, AccessPolicy]) -> None:
        """A reload: new lists apply to the next message."""
        self.policies = policies

    async def check(self, msg: InboundMessage) -> tuple[bool, str | None]:
        """(allowed, what to tell the user if not — None means say nothing this time)."""
        policy = self.policies.get(msg.platform)
        if policy is None or policy.mode == "open":
            return True, None
        ids = {msg.user_id, f"@{msg.user_handle}".lower() if msg.user_handle else ""}
        if ids & policy.allowlist:
            return True, None
        who = (msg.platform, msg.user_id)
        if policy.mode == "allowlist":
            return False, self._throttled(who, "Sorry, this bot only talks to people on its allowlist.")
        if who in self._paired or await self.store.is_paired(*who):  # asked every time: approval acts at once
            self._paired.add(who)
            return True, None
        if self._told_recently(who):  # a flood from a stranger costs a read, not a pairing write each
            return False, None
        code = await self.store.pairing_code(msg.platform, msg.user_id, msg.user_name, code=new_code(),
                                             ttl_s=CODE_TTL_S, max_pending=MAX_PENDING)
        if code is None:
            log.warning("pairing request from %s:%s refused: %d codes already pending", *who, MAX_PENDING)
            return False, self._throttled(who, "This bot is not taking new users right now. Please try later.")
        log.info("pairing code issued for %s user %s (%s): approve with `switchboard pairing approve %s`",
                 msg.platform, msg.user_id, msg.user_name, code)
        return False, self._throttled(who, f"Hi! To use this bot, ask its operator to approve your pairing code: "
                                           f"{code}")

    def _told_recently(self, who: tuple[str, str]) -> bool:
        return time.monotonic() - self._last_notice.get(who, -NOTICE_EVERY_S) < NOTICE_EVERY_S

    def _throttled(self, who: tuple[str, str], text: str) -> str | None:
        if self._told_recently(who):
            return None
        now = time.monotonic()
        self._last_notice[who] = now
        self._last_notice.move_to_end(who)
        while now - next(iter(self._last_notice.values())) >= NOTICE_EVERY_S:  # strangers told long ago
            self._last_notice.popitem(last=False)
        return text
