"""One bot's connections to Discord: log in, register the application commands, run the gateway
shards, report health.

A client for REST calls (sends, edits, typing, the command registration) is logged in at start,
with a retry on a fresh client after a failure that may pass; every worker has one. The gateway
is `shard_count` shards (`platforms/discord_shards.py`), each with a client of its own: all of
them in one process; in cluster mode each one wherever its lease is held. discord.py owns each
connection itself (heartbeats, RESUME, re-IDENTIFY); this module and the shards decide when to
connect, and turn what happened into the adapter's health.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import discord

from gateway.core.backoff import Backoff
from gateway.core.cancellation import cancel_and_wait
from gateway.core.ports import Health
from platforms.discord_client import TRANSIENT, BotClient, ClientEvents, Fatal, IdentifyGate, describe, log_in
from platforms.discord_shards import ASIDE_S, STAGGER_MAX_S, DiscordShard
from platforms.ingress import IngressLeader

log = logging.getLogger("platforms.discord_bot")  # the Discord adapter logs under one name

CLOSE_WAIT_S = 5.0  # how long the start task may take to end after the client is closed


class DiscordConnection:
    """`client` is the REST client (a login retry replaces it); `shards` the gateway's shards.
    `leaders` (cluster mode): one ingress lease per shard, in shard order."""

    BALANCE_EVERY_S: ClassVar[float] = 5.0  # how often a worker compares its shards with its fair share

    def __init__(self, token: str, events: ClientEvents, *, register_commands: bool, shard_count: int,
                 leaders: Sequence[IngressLeader] | None, retry: Backoff, reidentify_delay_s: float,
                 client_options: dict[str, Any]) -> None:
        if leaders is not None and len(leaders) != shard_count:
            raise ValueError(f"one ingress leader per shard: {shard_count} shard(s), {len(leaders)} leader(s)")
        self._token = token
        self._events = events
        self._register_commands = register_commands
        self._retry = retry
        self._gate = IdentifyGate(reidentify_delay_s)  # shared by this process's shards
        self._client_options = client_options
        self.client = self._new_client()
        self.shards = [
            DiscordShard(i, shard_count, token=token, new_client=self._new_client,
                         leader=leaders[i] if leaders is not None else None,
                         retry=Backoff(retry.first, retry.cap, jitter=retry.jitter), held_here=self._held_here)
            for i in range(shard_count)]
        self._leaders = leaders
        self._clustered = leaders is not None
        self._task: asyncio.Task[None] | None = None
        self._balancer: asyncio.Task[None] | None = None
        self._problem: str | None = None

    def _new_client(self, **shard: Any) -> BotClient:
        return BotClient(self._events, gate=self._gate, **shard, **self._client_options)

    def _held_here(self) -> int:
        return sum(shard.held for shard in self.shards)

    async def start(self) -> None:
        """Log in (a rejected token leaves the adapter unhealthy, not the daemon down), then
        register the commands and run the shards in the background."""
        try:
            logged_in = await self._login()
        except Fatal as exc:
            self._fail(str(exc))
            return
        self._task = asyncio.get_running_loop().create_task(self._run(logged_in), name="discord-start")

    async def _login(self) -> bool:
        """True once logged in, False on a transient failure; raises Fatal for a rejected token."""
        if await log_in(self.client, self._token):
            return True
        self.client = self._new_client()  # a retry logs in on a fresh client (fresh HTTP session)
        return False

    async def _run(self, logged_in: bool) -> None:
        try:
            while not logged_in:
                await asyncio.sleep(self._retry.step())
                logged_in = await self._login()
        except Fatal as exc:
            self._fail(str(exc))
            return
        if self._register_commands:
            await self._sync_commands()
        for shard in self.shards:
            shard.start()
        if self._leaders is not None and len(self.shards) > 1:
            self._balancer = asyncio.get_running_loop().create_task(self._balance(self._leaders[0]))

    async def _balance(self, leader: IngressLeader) -> None:
        """Cluster mode: shards go to whichever worker takes them first (one holding fewer has a
        head start), so a worker that was up alone, or outlived the others, may hold more than its
        share. Holding more than ceil(shards / live workers) twice in a row, it hands one on. If
        nobody took it (it is back here), it waits twice as long before the next time."""
        patience, handed = 1, None
        while True:
            wait = self.BALANCE_EVERY_S * patience
            await asyncio.sleep(wait if handed is None else max(wait, ASIDE_S + STAGGER_MAX_S))
            if handed is not None:
                patience = min(16, patience * 2) if handed.held else 1
                handed = None
            if not await self._over_share(leader):
                continue
            await asyncio.sleep(self.BALANCE_EVERY_S)  # twice in a row: not a moment while workers start
            if over := await self._over_share(leader):
                handed = over[-1]
                handed.step_aside()

    async def _over_share(self, leader: IngressLeader) -> list[DiscordShard]:
        """The connected shards held here, if this worker holds more than its share; else none."""
        workers = await leader.live_workers()
        share = math.ceil(len(self.shards) / workers) if workers else len(self.shards)
        if sum(shard.held for shard in self.shards) <= share:
            return []
        return [shard for shard in self.shards if shard.held and shard.connected]

    async def _sync_commands(self) -> None:
        try:
            synced = await self.client.tree.sync()
            log.info("discord: registered %d application commands", len(synced))
        except (discord.DiscordException, *TRANSIENT) as exc:  # text commands still work without them
            log.warning("discord: could not register application commands: %s", describe(exc))

    def _fail(self, problem: str) -> None:
        self._problem = problem
        log.error("discord: %s", problem)

    def health(self) -> Health:
        if self._problem is not None:
            return Health(False, self._problem)
        if self.client.is_closed():
            return Health(False, "stopped")
        states = [(shard, health) for shard in self.shards if (health := shard.health()) is not None]
        if not states and self._standing_by():
            return Health(True, "standing by: another worker holds the Discord gateway"
                          if len(self.shards) == 1 else "standing by: other workers hold the Discord shards")
        if not states or not all(h.ok for _, h in states):
            return Health(False, _first_problem([h for _, h in states]))
        return Health(True, f"connected as {self.client.user}{self._shards_held([s for s, _ in states])}")

    def _standing_by(self) -> bool:
        """In a cluster, started and holding no shard: another worker holds them."""
        return self._clustered and self._task is not None and self._task.done()

    def _shards_held(self, held: list[Any]) -> str:
        if len(self.shards) <= 1:
            return ""
        ids = ", ".join(str(s.shard_id) for s in held)
        return f" (shard{'s' if len(held) > 1 else ''} {ids} of {len(self.shards)})"

    # --- stopping -------------------------------------------------------------------------

    async def hand_on(self) -> None:
        """A clean stop in cluster mode: every shard held here goes to another worker now."""
        await self._stop_balancing()
        await asyncio.gather(*(shard.hand_on() for shard in self.shards))

    async def _stop_balancing(self) -> None:
        balancer, self._balancer = self._balancer, None
        if balancer is not None:
            await cancel_and_wait([balancer])  # it renews leases in Redis: see agent_cache.tasks

    async def close(self) -> None:
        """End the shards' connections, close every client and end the start task."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # still logging in or registering: nothing to wind down
        await self._stop_balancing()
        await asyncio.gather(*(shard.close() for shard in self.shards))
        await self.client.close()
        if task is not None:
            _done, late = await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
            for stuck in late:
                log.warning("discord: the start task did not end after close")
                stuck.cancel()


def _first_problem(states: list[Health]) -> str:
    """What a Discord connection not (yet) up says: the first shard's problem, else that it connects."""
    down = [h.detail for h in states if not h.ok and h.detail != "connecting"]
    return down[0] if down else "connecting to the Discord gateway"
