"""One Discord gateway shard, as this worker runs it.

In one process every shard is connected, each by a client of its own. In cluster mode each shard
is an ingress lease: the worker holding it connects it, the others stand by. While connected the
holder checks the lease every `WATCH_S` (once it cannot prove it any more, the connection ends at
once — before another worker can take the lease, which Redis keeps a margin longer) and hands
the session's progress on through the lease's state (`Handoff`, fenced: only the holder writes
it). Whoever takes the shard next RESUMEs the session from there, so messages sent while nobody
held the shard are replayed by Discord, not lost. On a clean stop the holder hands on at once:
the connection closed resumably, the messages in hand looked at (or let go), where the session
stands saved, the lease released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import ClassVar

import discord

from gateway.core.backoff import Backoff
from gateway.core.cancellation import cancel_and_wait
from gateway.core.ports import Health
from platforms.discord_client import TRANSIENT, BotClient, Fatal, Handoff, describe, log_in
from platforms.ingress import IngressLeader

log = logging.getLogger("platforms.discord_bot")  # the Discord adapter logs under one name

HANDOFF = "resume"  # the field of the lease's state that holds the session's `Handoff`
NewClient = Callable[..., BotClient]  # (shard_id=, shard_count=, handoff=, may_connect=, connected=)
# Spreading the shards over the workers: before each try at a free shard a worker waits a little
# for each shard it holds already, so one holding fewer gets there first; at start shard i waits
# i such steps, so workers starting together do not each try for every shard at the same moment.
STAGGER_S = 0.1
STAGGER_MAX_S = 1.0
SETTLE_S = 2.0  # how long a holder handing on waits for the messages in hand (handed to the router in ms)
ASIDE_S = 3.0  # a shard handed on to spread the load is not tried for again before this (others try every second)


class DiscordShard:
    """Shard `shard_id` of `shard_count` of one bot (see the module's text)."""

    WATCH_S: ClassVar[float] = 0.25  # how often the holder checks its lease (no I/O)
    SAVE_EVERY_S: ClassVar[float] = 1.0  # how often, at most, it hands the session's progress on

    def __init__(self, shard_id: int, shard_count: int, *, token: str, new_client: NewClient,
                 leader: IngressLeader | None, retry: Backoff, held_here: Callable[[], int]) -> None:
        self.shard_id = shard_id
        self.shard_count = shard_count
        self._token = token
        self._new_client = new_client
        self._leader = leader
        self._retry = retry
        self._held_here = held_here  # how many shards of this bot this worker holds now
        self._first_wait = min(STAGGER_MAX_S, STAGGER_S * shard_id)
        self.client: BotClient | None = None  # the current one (a new one each time the shard is taken)
        self._task: asyncio.Task[None] | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._saved: Handoff | None = None
        self._saved_at = 0.0
        self.standby = leader is not None
        self.connected = False
        self.problem: str | None = None
        self._aside = False  # asked to hand the shard on (see `step_aside`)

    @property
    def name(self) -> str:
        return f"shard {self.shard_id}/{self.shard_count}" if self.shard_count > 1 else "the gateway"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"discord-shard-{self.shard_id}")

    def health(self) -> Health | None:
        """None while another worker holds the shard; else whether it is connected, or why not."""
        if self.problem is not None:
            return Health(False, self.problem)
        if self.standby:
            return None
        return Health(self.connected, "connected" if self.connected else "connecting")

    # --- holding the shard ----------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                await self._lead()
                handoff = Handoff.loads(await self._leader.load(HANDOFF)) if self._leader is not None else None
                self.client = client = self._new_client(
                    shard_id=self.shard_id, shard_count=self.shard_count, handoff=handoff,
                    may_connect=self._may_connect, connected=self._set_connected)
                if not await log_in(client, self._token):
                    await asyncio.sleep(self._retry.step())
                    continue
                self._retry.reset()
                if handoff is not None:
                    log.info("discord: %s: resuming the session handed on (from event %d)", self.name, handoff.seq)
                await self._hold(client)
                if self._aside:
                    self._aside, self._first_wait = False, ASIDE_S
        except Fatal as exc:
            self._fail(str(exc))
        except discord.PrivilegedIntentsRequired:
            self._fail("the Message Content intent is not enabled for this bot in the Discord developer portal")
        except (discord.DiscordException, *TRANSIENT) as exc:
            self._fail(f"the gateway connection ended: {describe(exc)}")
        except Exception:
            log.exception("discord: %s: the gateway task crashed", self.name)
            self.problem = "the gateway task crashed (see the log)"
        if self._leader is not None:  # broken here: let another worker try
            await self._leader.release()

    @property
    def held(self) -> bool:
        """Cluster mode: does this worker hold the shard (as far as it knows)?"""
        return self._leader is not None and self._task is not None and not self.standby

    async def _lead(self) -> None:
        """Cluster mode: stand by until this worker holds the shard's lease."""
        if self._leader is None:
            return
        self.standby = True
        again_in: float | None = self._first_wait
        self._first_wait = 0.0
        while again_in is not None:
            await asyncio.sleep(again_in + min(STAGGER_MAX_S, STAGGER_S * self._held_here()))
            again_in = await self._leader.attempt()
        self.standby = False

    def _may_connect(self) -> bool:
        return self._leader is None or self._leader.held()

    async def _hold(self, client: BotClient) -> None:
        """Connected while the shard is ours; returns once it is not (the connection ended, and
        the client closed), raises why the connection ended if it did on its own."""
        self._connecting = connecting = asyncio.get_running_loop().create_task(client.connect())
        try:
            while True:
                done, _ = await asyncio.wait({connecting}, timeout=self.WATCH_S)
                if done:
                    connecting.result()
                    return
                if self._leader is None:
                    continue
                if not self._leader.held():
                    log.warning("discord: %s: this worker cannot prove its lease any more; disconnecting "
                                "(the worker that takes it over resumes the session)", self.name)
                    break
                if self._aside:
                    log.info("discord: %s: handing the shard on to a worker holding fewer", self.name)
                    break
                await self._hand_on(client, every=self.SAVE_EVERY_S)
        finally:
            self._connecting = None
            await client.disconnect(connecting)
        if self._aside:
            await self._give_up(client)
        await client.close()

    async def _hand_on(self, client: BotClient, *, every: float) -> None:
        """Save where the session stands (if it moved, and `every` seconds have passed)."""
        progress = client.progress
        if self._leader is None or progress is None or progress == self._saved:
            return
        if time.monotonic() - self._saved_at < every:
            return
        self._saved, self._saved_at = progress, time.monotonic()
        await self._leader.save(HANDOFF, progress.dumps())

    def _set_connected(self, connected: bool) -> None:
        was, self.connected = self.connected, connected
        client = self.client
        user = client.user if client is not None else None
        if connected and not was and user is not None:
            log.info("discord: %s connected as %s (%s)", self.name, user.name, user.id)
        elif was and not connected and client is not None and not client.is_closed() and self._connecting:
            log.info("discord: %s disconnected; reconnecting", self.name)

    def _fail(self, problem: str) -> None:
        self.problem = problem
        log.error("discord: %s: %s", self.name, problem)

    async def _give_up(self, client: BotClient | None) -> None:
        """Save where the session stands (while the lease is still ours), then release the lease."""
        if self._leader is None:
            return
        if client is not None and self._leader.held():
            with contextlib.suppress(TimeoutError):  # what is in hand now is not replayed to the next holder
                async with asyncio.timeout(SETTLE_S):
                    await client.settled()
            await self._hand_on(client, every=0.0)
        await self._leader.release()

    def step_aside(self) -> None:
        """Cluster mode: hand the shard on to another worker — the connection ends (resumable), the
        session's progress is saved and the lease released — and try for it again only after
        `ASIDE_S` (if nobody else took it)."""
        self._aside = True

    # --- stopping -------------------------------------------------------------------------

    async def hand_on(self) -> None:
        """Cluster mode, a clean stop: end the connection (resumable), save where the session
        stands and release the lease, so another worker takes the shard over now. The client
        stays open for REST calls (interactions being answered) until `close`."""
        if self._leader is None:
            return
        await self._end()
        await self._give_up(self.client)

    async def _end(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])  # discord.py's reads sit in `wait_for`: see agent_cache.tasks

    async def close(self) -> None:
        """End the connection and close the client."""
        await self._end()
        if self.client is not None:
            await self.client.close()
        self.connected = False
