"""The seeded fault schedule, and running it against a ChaosCluster.

`plan(seed)` is a pure function of the seed: which faults, in which order, on which worker, for
how long, with which pauses between them. The first five are the five kinds in a seeded order,
so every run that lasts long enough has each kind at least once; after that kinds repeat at
random. Faults run one after another (one fault at a time keeps every finding attributable).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.store.postgres import FULL_HOLD_S
from tests.chaos.cluster import ChaosCluster, process_alive
from tests.chaos.records import FaultRecord

KINDS = ("kill", "kill_restart", "pause_short", "pause_long", "redis_restart")
# With the history in PostgreSQL: it crashes and comes back, and its disk fills up and gets room again.
PG_KINDS = (*KINDS, "pg_restart", "disk_full")
# Redis crashing and coming back empty (no persistence): with the history in PostgreSQL only
# coordination is lost, and nothing acknowledged may be (`python -m tests.bench.chaos --wipe`).
WIPE_KINDS = (*PG_KINDS, "redis_wipe")
RESTART_S = 3.0  # about how long a worker takes to start (for planning only)


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    worker: int  # index into the cluster's worker ids (ignored for redis_restart and pg_restart)
    duration: float  # pause length, time dead before the restart, or Redis down time
    gap_before: float  # quiet time before it starts

    def estimate(self) -> float:
        """Seconds the fault takes from its start until the cluster is whole again."""
        if self.kind == "kill":
            return self.duration + RESTART_S
        if self.kind == "kill_restart":
            return RESTART_S
        if self.kind == "disk_full":  # a write that found it full holds new messages off this long more
            return self.duration + FULL_HOLD_S
        return self.duration + 0.5


def plan(seed: int, *, ttl_s: float, workers: int, count: int = 40,
         kinds_allowed: tuple[str, ...] = KINDS) -> list[PlannedFault]:
    """The schedule for `seed` (only `kinds_allowed`; none: a control run without faults)."""
    if not kinds_allowed:
        return []
    rng = random.Random(seed)
    kinds = list(kinds_allowed)
    rng.shuffle(kinds)
    kinds += [rng.choice(kinds_allowed) for _ in range(max(0, count - len(kinds)))]
    out = []
    for kind in kinds[:count]:
        if kind == "kill":
            duration = rng.uniform(2.2, 3.0) * ttl_s  # long enough for the others to adopt its sessions
        elif kind == "kill_restart":
            duration = 0.0
        elif kind == "pause_short":
            duration = rng.uniform(0.6, 0.95) * ttl_s  # shorter than the TTL
        elif kind == "pause_long":
            duration = rng.uniform(1.5, 2.6) * ttl_s  # its leases expire while it sleeps
        elif kind == "disk_full":
            duration = rng.uniform(1.0, 4.0)  # writes that need room fail meanwhile
        else:
            duration = rng.uniform(0.5, 2.0)
        out.append(PlannedFault(kind, rng.randrange(workers), duration, rng.uniform(1.0, 3.0)))
    return out


Poke = Callable[[list[str]], None]


async def execute(cluster: ChaosCluster, faults: list[PlannedFault], *, start_at: float, deadline: float,
                  log: list[FaultRecord], poke: Poke | None = None) -> None:
    """Run `faults` in order from `start_at`; stop before one that would not be over by `deadline`.

    `poke(sessions)` makes those sessions' users write now (see Traffic.poke): after a restart with
    the same worker id, the sessions its previous life owned get a message as soon as the new
    process is up (while the old leases live) and another just after those leases expired."""
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    for i, fault in enumerate(faults):
        if i:
            await asyncio.sleep(fault.gap_before)
        if time.monotonic() + fault.estimate() > deadline:
            return
        await run_one(cluster, fault, log, poke)


async def _orphans(rec: FaultRecord, after_s: float = 0.5) -> None:
    """Which tool processes of a killed worker are still running half a second later? (Then end
    them: they are our workers' children.)"""
    await asyncio.sleep(after_s)
    rec.orphans = [pid for pid in rec.tools_at_kill if process_alive(pid)]
    for pid in rec.orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def run_one(cluster: ChaosCluster, fault: PlannedFault, log: list[FaultRecord], poke: Poke | None = None) -> None:
    if fault.kind in ("redis_restart", "redis_wipe"):
        rec = FaultRecord(fault.kind, "redis", time.monotonic(), duration=fault.duration)
        log.append(rec)
        await asyncio.to_thread(cluster.redis.kill)  # a crash: SIGKILL (the append-only file is fsynced)
        if fault.kind == "redis_wipe":
            await asyncio.to_thread(cluster.redis.forget)
        await asyncio.sleep(fault.duration)
        await asyncio.to_thread(cluster.redis.start)
        rec.ended_at = time.monotonic()
        return
    if fault.kind == "disk_full":
        rec = FaultRecord(fault.kind, "postgres", time.monotonic(), duration=fault.duration)
        log.append(rec)
        await asyncio.to_thread(cluster.fill_disk)
        try:
            await asyncio.sleep(fault.duration)
        finally:
            cluster.empty_disk()
        rec.ended_at = time.monotonic()
        return
    if fault.kind == "pg_restart":
        assert cluster.pg is not None
        rec = FaultRecord(fault.kind, "postgres", time.monotonic(), duration=fault.duration)
        log.append(rec)
        await asyncio.to_thread(cluster.pg.kill)  # a crash; it recovers from its log on start
        await asyncio.sleep(fault.duration)
        await asyncio.to_thread(cluster.pg.start)
        rec.ended_at = time.monotonic()
        return
    live = [inc.worker_id for _w, inc in cluster.live()]
    if not live:
        cluster.errors.append(f"no live worker for {fault.kind}")
        return
    ids = cluster.worker_ids
    worker_id = ids[fault.worker % len(ids)]
    if worker_id not in live:  # e.g. its restart failed: take the next live one
        worker_id = live[fault.worker % len(live)]
    target = cluster.current[worker_id][1]
    rec = FaultRecord(fault.kind, target.name, time.monotonic(), duration=fault.duration)
    log.append(rec)
    if fault.kind in ("pause_short", "pause_long"):
        cluster.pause(worker_id)
        try:
            await asyncio.sleep(fault.duration)
        finally:
            cluster.resume(worker_id)
        rec.ended_at = time.monotonic()
        return
    rec.tools_at_kill = cluster.tool_pids(target.name)
    cluster.kill(worker_id)
    rec.started_at = cluster.current[worker_id][1].ended_at or rec.started_at  # just before the signal
    if rec.tools_at_kill:
        cluster.background.append(asyncio.create_task(_orphans(rec)))
    if fault.kind == "kill":
        await asyncio.sleep(fault.duration)
    try:
        new = await cluster.spawn(worker_id)
        rec.replacement = new.name
    except AssertionError:
        rec.note = "restart failed"
    rec.ended_at = time.monotonic()
    if poke is not None and fault.kind == "kill_restart":
        owned = cluster.owned_by(target.name, rec.started_at)
        poke(owned)
        cluster.background.append(asyncio.create_task(_poke_later(poke, owned, rec.started_at + cluster.ttl_s + 0.3)))


async def _poke_later(poke: Poke, sessions: list[str], at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    poke(sessions)
