"""One chaos run end to end: start the cluster, run traffic and the seeded faults, heal, let it
settle, collect the records, check them.

Timeline (defaults, TTL 3 s): ~4 s start-up, `chaos_s` of traffic with faults from `warmup_s` on
(the last one over `quiet_s` before the traffic stops), then at least TTL + 3 s and at most
`settle_max_s` for the last answers, adoptions and replays, then collection and teardown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_cache import keys
from platforms.telegram_draft import STATUS_TEXT
from tests.chaos import faults, lease_log
from tests.chaos.checker import Report, check
from tests.chaos.cluster import ChaosCluster
from tests.chaos.records import (
    ApiMessage,
    Attempt,
    BotMessage,
    FaultRecord,
    Incarnation,
    LeaseEvent,
    OpenInbound,
    Records,
    Row,
    Stream,
    TgCall,
    TgMessage,
    chat_of,
    message_tag,
)
from tests.chaos.traffic import Traffic
from tests.support.redis_server import RedisServer

OPEN_STATUSES = ("accepted", "running", "restart")


@dataclass(frozen=True)
class Settings:
    seed: int
    workers: int = 3
    ttl_s: float = 3.0
    chaos_s: float = 45.0
    warmup_s: float = 3.0
    quiet_s: float = 2.0
    settle_max_s: float = 16.0
    telegram_chats: int = 8
    api_sessions: int = 4  # hundreds are fine: their users think longer in proportion (traffic.api_load)
    api_balance: str = "random"  # each API request to a random live worker; "pinned": a worker per session
    words: int = 36
    delay_s: float = 0.09
    patience_s: float = 40.0
    early_p: float = 0.15
    kinds: tuple[str, ...] = faults.KINDS  # () for a control run without faults
    store: str = "redis"  # or "postgres": history in PostgreSQL, coordination in Redis
    tools: bool = True  # some turns run a shell tool first (to see whether a killed worker's tools outlive it)


def seed_from_env(default: int) -> int:
    value = os.environ.get("CHAOS_SEED", "").strip()
    return int(value) if value else default


def session_key(session: str) -> str:
    return f"telegram:group:{chat_of(session)}" if session.startswith("g") else f"api:dm:{session}"


async def run_scenario(settings: Settings, tmp: Path) -> tuple[Records, Report]:
    cluster = ChaosCluster(tmp, seed=settings.seed, workers=settings.workers, ttl_s=settings.ttl_s,
                           words=settings.words, delay_s=settings.delay_s, tools=settings.tools, store=settings.store,
                           small_disk="disk_full" in settings.kinds)
    fault_log: list[FaultRecord] = []
    try:
        await cluster.start()
        t0 = time.monotonic()
        stop_at = t0 + settings.chaos_s
        traffic = Traffic(cluster, settings.seed, telegram_chats=settings.telegram_chats,
                          api_sessions=settings.api_sessions, stop_at=stop_at,
                          hard_stop=stop_at + settings.settle_max_s, faults=fault_log, patience_s=settings.patience_s,
                          early_p=settings.early_p, api_balance=settings.api_balance)
        traffic_task = asyncio.create_task(traffic.run())
        schedule = faults.plan(settings.seed, ttl_s=settings.ttl_s, workers=settings.workers,
                               kinds_allowed=settings.kinds)
        try:
            await faults.execute(cluster, schedule, start_at=t0 + settings.warmup_s,
                                 deadline=stop_at - settings.quiet_s, log=fault_log, poke=traffic.poke)
        except BaseException:
            traffic_task.cancel()
            await asyncio.wait({traffic_task})
            raise
        finally:
            crashed = cluster.crashed()  # before heal() replaces them
            await cluster.heal()
        try:
            await asyncio.wait_for(traffic_task, max(1.0, stop_at + settings.settle_max_s - time.monotonic()) + 5)
        except TimeoutError:
            cluster.errors.append("traffic did not finish in time (a client hung)")
        traffic_end = time.monotonic()
        if cluster.background:
            await asyncio.wait(cluster.background, timeout=10)
        await settle(cluster, traffic, min_s=settings.ttl_s + 3, max_s=settings.settle_max_s)
        records = await collect(cluster, traffic, fault_log, seed=settings.seed, t0=t0, traffic_end=traffic_end)
        records.crashed = {**crashed, **cluster.crashed()}
    finally:
        await cluster.close()
    return records, check(records)


async def settle(cluster: ChaosCluster, traffic: Traffic, *, min_s: float, max_s: float) -> None:
    """Wait until nothing is streaming, no inbound record is open and every accepted message has
    an outcome (at least `min_s`, at most `max_s`)."""
    start = time.monotonic()
    sessions = [session_key(s) for s in traffic.sessions]
    while time.monotonic() - start < max_s:
        if time.monotonic() - start >= min_s:
            streaming = any(c.ended_at is None for c in cluster.provider.connections)
            waiting = any(m.accepted_at is not None and m.next_sent_at is None and not traffic.has_outcome(m)
                          for m in traffic.telegram)
            if not streaming and not waiting and not await asyncio.to_thread(_any_open, cluster.redis, sessions):
                return
        await asyncio.sleep(0.5)


def _any_open(redis: RedisServer, sessions: list[str]) -> bool:
    try:
        with redis.client() as c:
            for key in sessions:
                for text in c.hvals(keys.inbound(key)):
                    if json.loads(text).get("status") in OPEN_STATUSES:
                        return True
    except Exception:  # Redis hiccup: not settled yet
        return True
    return False


async def collect(cluster: ChaosCluster, traffic: Traffic, fault_log: list[FaultRecord], *, seed: int, t0: float,
                  traffic_end: float) -> Records:
    offset = time.perf_counter() - time.monotonic()  # the fake provider's clock -> ours (0 on Linux)
    streams = []
    for number, conn in enumerate(cluster.provider.connections, 1):
        users = [m for m in conn.body.get("messages", []) if m.get("role") == "user"]
        tag = next((t for m in reversed(users) if (t := message_tag(str(m.get("content")))) is not None), None)
        last = str(users[-1].get("content")) if users else ""
        ended = conn.ended_at
        messages = conn.body.get("messages", [])
        streams.append(Stream(number, conn.via, conn.opened_at - offset, None if ended is None else ended - offset,
                              conn.completed, tag, resume=message_tag(last) is None,
                              tool_call=number in cluster.tool_streams,
                              tool_ended_at=cluster.tool_ended_at(number) if number in cluster.tool_streams else None,
                              after_tool=bool(messages) and messages[-1].get("role") == "tool"))
    calls: list[TgCall] = []
    for rec in cluster.telegram.sent:
        if rec.method not in ("sendMessage", "editMessageText", "sendChatAction") or rec.chat_id is None:
            continue
        if rec.text == STATUS_TEXT:  # a draft's "writing…" line (it carries the Stop button): not an answer
            continue
        reply = rec.params.get("reply_parameters")
        reply_to = int(reply["message_id"]) if isinstance(reply, dict) and "message_id" in reply else None
        calls.append(TgCall(rec.time, rec.via, rec.method, int(rec.chat_id), rec.message_id, str(rec.text or ""),
                            reply_to))
    bots: dict[tuple[int, int], BotMessage] = {}
    for call in calls:
        if call.message_id is None:
            continue
        if call.method == "sendMessage":
            bots[(call.chat_id, call.message_id)] = BotMessage(call.chat_id, call.message_id, call.via, call.at, "",
                                                               call.reply_to, call.at)
        elif call.method == "editMessageText" and (call.chat_id, call.message_id) in bots:
            bots[(call.chat_id, call.message_id)].changed_at = call.at
    for (chat, mid), bm in bots.items():
        bm.text = cluster.telegram.messages(chat).get(mid, "")
    transcripts, open_inbound, inbox = await asyncio.to_thread(
        _read_store, cluster.redis, traffic.sessions, cluster.worker_ids)
    if cluster.pg_url is not None:  # the history is in PostgreSQL: read it there
        transcripts, open_inbound = await _read_postgres(cluster.pg_url, cluster.redis, traffic.sessions)
    leases, lease_gaps = _read_leases(cluster)
    return Records(seed=seed, ttl_s=cluster.ttl_s, answer_s=cluster.answer_s, t0=t0, traffic_end=traffic_end,
                   collected_at=time.monotonic(), incarnations=dict(cluster.incarnations), faults=fault_log,
                   telegram=traffic.telegram, api=traffic.api, streams=streams, calls=calls,
                   bot_messages=list(bots.values()), transcripts=transcripts, open_inbound=open_inbound, inbox=inbox,
                   harness_errors=list(cluster.errors), log_tails=cluster.log_errors(), leases=leases,
                   lease_gaps=lease_gaps, leases_monitored=cluster.lease_monitor is not None)


def _read_leases(cluster: ChaosCluster) -> tuple[list[LeaseEvent], list[tuple[float, float | None]]]:
    """The lease writes Redis ran, from the MONITOR log (stopped first: no half-written last line)."""
    monitor = cluster.lease_monitor
    if monitor is None:
        return [], []
    monitor.stop()
    try:
        text = monitor.path.read_text(errors="replace")
    except OSError:
        cluster.errors.append("no lease monitor log")
        return [], []
    return lease_log.parse(text, clock_offset=time.time() - time.monotonic(), incarnations=cluster.incarnations,
                           ttl_s=cluster.ttl_s)


def _read_store(redis: RedisServer, sessions: list[str], worker_ids: list[str]
                ) -> tuple[dict[str, list[Row]], list[OpenInbound], dict[str, str]]:
    transcripts: dict[str, list[Row]] = {}
    open_inbound: list[OpenInbound] = []
    inbox: dict[str, str] = {}
    with redis.client() as c:
        for session in sessions:
            key = session_key(session)
            conversation = int(c.hget(keys.meta(key), "conversation") or 1)
            rows = [json.loads(text) for text in c.lrange(keys.messages(key, conversation), 0, -1)]
            if rows:
                transcripts[session] = [Row(r["role"], str(r["content"]), r.get("interrupted_by"), r.get("reason"),
                                            bool(r.get("tool_calls"))) for r in rows]
            for inbound_id, text in c.hgetall(keys.inbound(key)).items():
                rec = json.loads(text)
                if rec.get("status") in OPEN_STATUSES:
                    holder = c.hget(keys.lease(key), "worker")
                    open_inbound.append(OpenInbound(key, inbound_id, rec["status"],
                                                    str(rec.get("message", {}).get("text", "")), holder,
                                                    int(c.pttl(keys.lease(key)))))
        for worker_id in worker_ids:
            stream = keys.worker_inbox(worker_id)
            try:
                groups = c.xinfo_groups(stream)
            except Exception:  # no inbox
                continue
            last = next((str(g["last-delivered-id"]) for g in groups if g["name"] == keys.GROUP), "0-0")
            pending = {str(p["message_id"]): str(p["consumer"])
                       for p in c.xpending_range(stream, keys.GROUP, min="-", max="+", count=10_000)}
            for entry_id, fields in c.xrange(stream):
                try:
                    text = str(json.loads(fields["data"])["msg"]["text"])
                except (KeyError, ValueError, TypeError):
                    continue
                tag = message_tag(text)
                if tag is None:
                    continue
                if entry_id in pending:
                    inbox[tag] = (f"forwarded to {worker_id}'s inbox, delivered to consumer {pending[entry_id]} "
                                  "and never acknowledged")
                elif _stream_id(entry_id) > _stream_id(last):
                    inbox[tag] = f"forwarded to {worker_id}'s inbox and never read"
    return transcripts, open_inbound, inbox


async def _read_postgres(url: str, redis: RedisServer, sessions: list[str]
                         ) -> tuple[dict[str, list[Row]], list[OpenInbound]]:
    from gateway.store.postgres import PostgresStore

    store = PostgresStore(url, require_fence=False)
    await store.open()
    transcripts: dict[str, list[Row]] = {}
    open_inbound: list[OpenInbound] = []
    try:
        with redis.client() as c:
            for session in sessions:
                key = session_key(session)
                _conv, rows = await store.conversation(key)
                if rows:
                    transcripts[session] = [Row(r.role, r.content, r.interrupted_by, r.reason, bool(r.tool_calls))
                                            for r in rows]
                for rec in await store.unfinished_inbound(key):
                    open_inbound.append(OpenInbound(key, str(rec.id), rec.status.value, rec.message.text,
                                                    c.hget(keys.lease(key), "worker"), int(c.pttl(keys.lease(key)))))
    finally:
        await store.close()
    return transcripts, open_inbound


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def load(path: Path) -> Records:
    """Records written by `save` (to run the checker again, e.g. after changing it)."""
    d = json.loads(path.read_text())

    def with_attempts(m: dict[str, Any]) -> dict[str, Any]:
        return {**m, "attempts": [Attempt(**a) for a in m["attempts"]]}

    return Records(
        **{k: d[k] for k in ("seed", "ttl_s", "answer_s", "t0", "traffic_end", "collected_at", "inbox",
                             "harness_errors", "log_tails", "crashed")},
        incarnations={k: Incarnation(**{**v, "stopped": [tuple(s) for s in v["stopped"]]})
                      for k, v in d["incarnations"].items()},
        faults=[FaultRecord(**f) for f in d["faults"]],
        telegram=[TgMessage(**with_attempts(m)) for m in d["telegram"]],
        api=[ApiMessage(**with_attempts(m)) for m in d["api"]],
        streams=[Stream(**s) for s in d["streams"]], calls=[TgCall(**c) for c in d["calls"]],
        bot_messages=[BotMessage(**b) for b in d["bot_messages"]],
        transcripts={k: [Row(**r) for r in v] for k, v in d["transcripts"].items()},
        open_inbound=[OpenInbound(**o) for o in d["open_inbound"]],
        leases=[LeaseEvent(**e) for e in d.get("leases", [])],
        lease_gaps=[(a, b) for a, b in d.get("lease_gaps", [])], leases_monitored=d.get("leases_monitored", False))


def save(records: Records, report: Report, directory: Path, variant: str = "redis") -> Path:
    """Write the records and the report next to each other (for a look at a failed run), named
    by seed and store variant so that the runs of one seed do not overwrite each other."""
    directory.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = dataclasses.asdict(records)
    (directory / f"chaos-{records.seed}-{variant}.json").write_text(json.dumps(data, indent=1, default=str))
    path = directory / f"chaos-{records.seed}-{variant}.txt"
    path.write_text(report.text(limit=10_000) + "\n")
    return path
