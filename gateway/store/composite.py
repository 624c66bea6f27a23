"""Cluster mode with PostgreSQL: history where history belongs, Redis for coordination.

`PostgresClusterStore` is the `Store` a cluster uses when `[store] url` names a PostgreSQL database:

- PostgreSQL (`PostgresStore`, built with `require_fence=True`): transcripts, inbound records,
  sessions, approved pairings — durable, queryable, kept for `keep_days`. Every session-scoped
  write is fenced by the database itself.
- Redis (the cluster's own, through `RedisStore`): pending pairing codes (short-lived, capped,
  expiring on Redis server time) — next to the coordination state it already keeps for leases,
  inboxes and routing. Platform message ids are de-duplicated by PostgreSQL, in the same fenced
  statement that records the message, so no claim can exist without its record.

At a takeover the new owner reads what the session left open (`unfinished_inbound`); that read
first raises PostgreSQL's fence for the session to the live lease's, so from the acquisition on
the previous owner is refused by the database, as the Redis store refuses it.

Delegation rather than inheritance: each half is the unchanged store of its own backend, so the
contract tests of each still describe it. The Redis half's client and error mapping are reused
to read the lease fence at a takeover and a pending code before approving it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import suppress
from typing import cast

from agent_cache import keys
from gateway.core.fencing import Fence
from gateway.core.messages import InboundMessage
from gateway.core.ports import FencedOut, InboundRecord, InboundStatus, SessionInfo
from gateway.core.transcript import ChatMessage
from gateway.store.postgres import PostgresStore
from gateway.store.redis import RedisStore


class PostgresClusterStore:
    """The Store protocol for a cluster: history and de-duplication in PostgreSQL, pairing codes in Redis."""

    def __init__(self, history: PostgresStore, coordination: RedisStore) -> None:
        if not history.require_fence:
            raise ValueError("a cluster's PostgreSQL store must require fences")
        self.history = history
        self.coordination = coordination

    def __repr__(self) -> str:
        return f"PostgresClusterStore({self.history!r}, {self.coordination!r})"

    async def open(self) -> None:
        await self.coordination.open()
        try:
            await self.history.open()
        except BaseException:
            await self.coordination.close()
            raise

    async def close(self) -> None:
        try:
            await self.history.close()
        finally:
            await self.coordination.close()

    async def ping(self) -> bool:
        return await self.history.ping() and await self.coordination.ping()

    def problem(self) -> str | None:
        return self.history.problem() or self.coordination.problem()

    # --- inbound: PostgreSQL ------------------------------------------------------------------

    async def accept_inbound(self, fence: Fence, msg: InboundMessage, *,
                             started: tuple[int, ChatMessage] | None = None) -> int | None:
        """PostgreSQL alone de-duplicates (a unique key, checked in the fenced insert): a claim
        kept elsewhere first could outlive a worker killed before the record was written, and
        turn every redelivery of that message into a 'duplicate' that nobody answers."""
        return await self.history.accept_inbound(fence, msg, started=started)

    async def finish_inbound(self, fence: Fence, inbound_id: int, status: InboundStatus,
                             detail: str | None = None) -> None:
        await self.history.finish_inbound(fence, inbound_id, status, detail)

    async def unfinished_inbound(self, session_key: str | None = None) -> list[InboundRecord]:
        """A worker asks this right after it acquired a session (to finish what was left open):
        first the session's current lease fence, read from Redis, is made the newest PostgreSQL
        has seen, so the previous owner's writes still on their way are refused from now on — not
        only from the new owner's first write. Raising the bar to the live lease's own fence can
        only refuse stale writers, whoever asks."""
        if session_key is not None:
            redis = self.coordination
            with redis._errors("unfinished_inbound"):
                current = await redis._r.hget(keys.lease(session_key), "fence")
            if current is not None:
                with suppress(FencedOut):  # a newer fence was seen already: nothing to raise
                    await self.history.claim(Fence(session_key, int(current)))
        return await self.history.unfinished_inbound(session_key)

    # --- transcripts: PostgreSQL ------------------------------------------------------------

    async def conversation(self, session_key: str) -> tuple[int, list[ChatMessage]]:
        return await self.history.conversation(session_key)

    async def append(self, fence: Fence, conversation: int, rows: Sequence[ChatMessage], *,
                     inbound: tuple[int, InboundStatus, str | None] | None = None) -> None:
        await self.history.append(fence, conversation, rows, inbound=inbound)

    async def reset(self, fence: Fence) -> int:
        return await self.history.reset(fence)

    async def claim(self, fence: Fence) -> None:
        await self.history.claim(fence)

    async def sessions(self, limit: int = 100) -> list[SessionInfo]:
        return await self.history.sessions(limit)

    # --- pairing: pending codes in Redis, approved users in PostgreSQL --------------------------

    async def is_paired(self, platform: str, user_id: str) -> bool:
        return await self.history.is_paired(platform, user_id)

    async def pairing_code(self, platform: str, user_id: str, user_name: str, *, code: str,
                           ttl_s: float, max_pending: int) -> str | None:
        return await self.coordination.pairing_code(platform, user_id, user_name, code=code, ttl_s=ttl_s,
                                                    max_pending=max_pending)

    async def approve_pairing(self, code: str, *, ttl_s: float) -> tuple[str, str, str] | None:
        """The user is recorded in PostgreSQL before the code is used up in Redis: if PostgreSQL is
        down the code stays pending, and the operator can approve it again."""
        redis = self.coordination
        with redis._errors("approve_pairing"):
            platform = cast(str | None, await redis._r.hget(keys.pairing_code_index(), code))
            raw = cast(str | None, await redis._r.hget(keys.pairing_codes(platform), code)) if platform else None
            seconds, micros = await redis._r.time()  # pairing times are Redis server time
        if platform is None or raw is None:
            return await redis.approve_pairing(code, ttl_s=ttl_s)  # unknown: let Redis tidy its index
        rec = json.loads(raw)
        if float(rec["created_at"]) < seconds + micros / 1e6 - ttl_s:
            return await redis.approve_pairing(code, ttl_s=ttl_s)  # expired: Redis drops the code
        await self.history.add_paired(platform, str(rec["user_id"]), str(rec["user_name"]))
        await redis.approve_pairing(code, ttl_s=ttl_s)
        return platform, str(rec["user_id"]), str(rec["user_name"])

    async def pairing_state(self) -> tuple[list[tuple[str, str, str, str, float]], list[tuple[str, str, str]]]:
        pending, _ = await self.coordination.pairing_state()
        return pending, await self.history.paired_users()
