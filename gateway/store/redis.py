"""Redis store for cluster mode: workers share transcripts, inbound state and pairing.

Every key is named in agent_cache.keys. Each Lua script touches the keys of one session (or,
for pairing, of one platform), which share a hash tag, so the same code runs on Redis Cluster
(`redis+cluster://host:port` or `?cluster=true`). One exception: on a single Redis the accept
script also takes the message's id from the global counter, so accepting a message is one round
trip; in a Redis Cluster the id is taken by a command before it. What else spans slots (the
sessions index, the pairing code index) is done by separate, non-atomic commands around the
scripts; a session's own state always changes in one script. The sessions index, which only
orders listings, is written by the write's own script on a single Redis, and in batches in a Redis
Cluster (one ZADD for all the sessions written in the last 0.2 s).

A command that meets a dropped connection is retried (after a Redis restart every pooled
connection is dead). A write whose reply was lost may have happened, so each write carries a
one-off token and a retry finds it already applied instead of applying it twice. Timeouts are
not retried: the StoreError comes sooner, and the router handles it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from agent_cache import keys
from gateway.core.fencing import Fence
from gateway.core.messages import InboundMessage
from gateway.core.outage import OutageLog
from gateway.core.ports import FencedOut, InboundRecord, InboundStatus, SessionInfo, StoreError
from gateway.core.transcript import ChatMessage
from gateway.store.redis_batch import ScriptBatch

log = logging.getLogger(__name__)

INDEX_EVERY_S = 0.2  # the sessions index is written in batches, at most this late
INDEX_SLICE = 1000  # members per ZADD
INDEX_CLOSE_S = 1.0

# Dropped connections only; the cluster client keeps redis-py's own policy, which follows failovers.
_RETRY = Retry(ExponentialBackoff(cap=0.2, base=0.02), 2, supported_errors=(RedisConnectionError,))

# Every session-scoped write is fenced: it applies only while the writer's lease (KEYS[1], a hash
# with the lease's `fence`) is live and carries the writer's fence. A worker whose lease lapsed or
# was taken over — a zombie, or a previous incarnation of this process — cannot change the session.
_FENCED_LUA = """
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[1] then
  return redis.error_reply('FENCED session lease lost or taken over')
end
"""

# Only status and detail change; the rest of the record is spliced on as stored text, because
# cjson would re-encode its floats with 14 significant digits. The first `,"received_at":` is the
# real key: a quote inside a JSON string is always escaped.
_FINISH_LUA = """
local function finish(key, id, keep, head)
  if keep == '1' then
    local rec = redis.call('HGET', key, id)
    if rec then
      local at = string.find(rec, ',"received_at":', 1, true)
      redis.call('HSET', key, id, head .. string.sub(rec, at))
    end
  else
    redis.call('HDEL', key, id)
  end
end
"""

# The message's claim and record (KEYS: lease, inbound, seen; ARGV: fence, id, record, token, seen
# ttl ms), after `local counter = <the id counter's key>`. Returns from the script if the message
# was claimed before: its id to our own retried call (same token), 0 to anyone else.
_CLAIM_LUA = """
local claim = redis.call('GET', KEYS[3])
if claim then
  local at = string.find(claim, ':', 1, true)
  if at and string.sub(claim, 1, at - 1) == ARGV[4] then return tonumber(string.sub(claim, at + 1)) end
  return 0
end
local id = ARGV[2]
if id == '' then id = redis.call('INCR', counter) end
redis.call('SET', KEYS[3], ARGV[4] .. ':' .. id, 'PX', ARGV[5])
redis.call('HSET', KEYS[2], id, ARGV[3])
"""

# KEYS: lease, inbound, seen[, inbound id counter].  ARGV: fence, id ('' = take the next from the
# counter), record, token, seen ttl ms.
# Returns the record's id, or 0 for a duplicate. The claim and the record are one step: a worker
# killed in between cannot leave a claim that makes every later delivery of the message a
# "duplicate". The claim holds `<token>:<id>`, so a retry of our own call whose reply was lost
# (same token) finds its claim and gets the id it was given. With the counter among the keys (a
# single Redis), a message costs one round trip; in a Redis Cluster the counter lives in another
# slot, so the id is taken first and passed in.
ACCEPT = _FENCED_LUA + "local counter = KEYS[4]" + _CLAIM_LUA + "return tonumber(id)"

# A message whose turn starts at once, accepted with that start in one step: the record as
# `running` and the user's row (one round trip where ACCEPT then APPEND took two).
# KEYS: lease, inbound, seen, meta, messages[, inbound id counter, sessions index] (the last two on
# a single Redis only: in a Redis Cluster they live in other slots).
# ARGV: fence, id ('' = take the next from the counter), record, token, seen ttl ms, now,
# conversation, session key, row.
# Returns as ACCEPT. A retry whose reply was lost finds its claim: the whole step happened.
ACCEPT_STARTED = _FENCED_LUA + "local counter = KEYS[6]" + _CLAIM_LUA + """
redis.call('RPUSH', KEYS[5], ARGV[9])
redis.call('HSET', KEYS[4], 'updated_at', ARGV[6], 'op', ARGV[4])
redis.call('HSETNX', KEYS[4], 'created_at', ARGV[6])
redis.call('HSETNX', KEYS[4], 'conversation', ARGV[7])
if KEYS[7] then redis.call('ZADD', KEYS[7], ARGV[6], ARGV[8]) end
return tonumber(id)
"""

# KEYS: lease, inbound.  ARGV: fence, id, keep (1/0), head.
FINISH = _FENCED_LUA + _FINISH_LUA + "finish(KEYS[2], ARGV[2], ARGV[3], ARGV[4]) return 0"

# KEYS: lease, meta, messages, inbound[, sessions index].
# ARGV: fence, now, conversation, token, inbound id ('' = none), keep, head, session key, rows...
# A write whose reply was lost is retried with the same token and found already applied. With the
# sessions index among the keys (a single Redis), the session is listed there in the same step.
APPEND = _FINISH_LUA + """
if redis.call('HGET', KEYS[2], 'op') == ARGV[4] then return 0 end
""" + _FENCED_LUA + """
for i = 9, #ARGV, 1000 do  -- unpack() has a stack limit
  redis.call('RPUSH', KEYS[3], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('HSET', KEYS[2], 'updated_at', ARGV[2], 'op', ARGV[4])
redis.call('HSETNX', KEYS[2], 'created_at', ARGV[2])
redis.call('HSETNX', KEYS[2], 'conversation', ARGV[3])
if ARGV[5] ~= '' then finish(KEYS[4], ARGV[5], ARGV[6], ARGV[7]) end
if KEYS[5] then redis.call('ZADD', KEYS[5], ARGV[2], ARGV[8]) end
return 0
"""

# KEYS: lease, meta[, sessions index].  ARGV: fence, now, token, session key.  A session without
# meta is on conversation 1, so its first reset gives 2.
RESET = """
if redis.call('HGET', KEYS[2], 'op') == ARGV[3] then return tonumber(redis.call('HGET', KEYS[2], 'conversation')) end
""" + _FENCED_LUA + """
redis.call('HSETNX', KEYS[2], 'conversation', 1)
local conversation = redis.call('HINCRBY', KEYS[2], 'conversation', 1)
redis.call('HSET', KEYS[2], 'updated_at', ARGV[2], 'op', ARGV[3])
redis.call('HSETNX', KEYS[2], 'created_at', ARGV[2])
if KEYS[3] then redis.call('ZADD', KEYS[3], ARGV[2], ARGV[4]) end
return conversation
"""

# Pairing times are Redis server time, so workers with skewed clocks agree on expiry.
_NOW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: codes(platform).  ARGV: user id, user name, new code, ttl, max pending.
# Returns {code or '', expired codes (for the code index)}.
PAIRING_CODE = _NOW_LUA + """
local expired, mine, pending = {}, '', 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local rec = cjson.decode(all[i + 1])
  if rec.created_at < now - tonumber(ARGV[4]) then
    redis.call('HDEL', KEYS[1], all[i])
    table.insert(expired, all[i])
  else
    pending = pending + 1
    if rec.user_id == ARGV[1] then mine = all[i] end
  end
end
if mine == '' and pending < tonumber(ARGV[5]) then
  redis.call('HSET', KEYS[1], ARGV[3], cjson.encode({user_id = ARGV[1], user_name = ARGV[2], created_at = now}))
  mine = ARGV[3]
end
return {mine, expired}
"""

# KEYS: codes(platform), users(platform).  ARGV: code, ttl.  The code goes even if expired.
APPROVE = _NOW_LUA + """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
local rec = cjson.decode(raw)
if rec.created_at < now - tonumber(ARGV[2]) then return false end
redis.call('HSET', KEYS[2], rec.user_id, cjson.encode({user_name = rec.user_name, approved_at = now}))
return {rec.user_id, rec.user_name}
"""


def connect(url: str, **opts: Any) -> aioredis.Redis | RedisCluster:
    """A client for `url`: a single Redis (blocking pool), or Redis Cluster for `redis+cluster://`
    and `?cluster=true` URLs. Every script Switchboard runs touches one slot, so both work."""
    plain, cluster = _parse(url)
    if cluster:
        return RedisCluster.from_url(plain, **opts)
    # Pooled connections die with a Redis restart: the first use of each is retried once.
    return aioredis.Redis.from_pool(blocking_pool(plain, **{"retry": _RETRY, **opts}))


def blocking_pool(url: str, **opts: Any) -> aioredis.BlockingConnectionPool:
    """A pool that makes a burst wait for a free connection instead of failing with
    "Too many connections" (redis-py's default pool raises at 100)."""
    return aioredis.BlockingConnectionPool.from_url(url, max_connections=128, timeout=10, **opts)


class RedisStore:
    """The Store protocol (and pairing) on a shared Redis; see the module docstring."""

    def __init__(self, url: str, *, dedup_ttl_s: float = 7 * 86400) -> None:
        self.dedup_ttl_s = dedup_ttl_s
        self._secrets = _secrets(url)
        self._url = self._redact(url)
        try:
            plain, cluster = _parse(url)
            # URL query options (e.g. ?socket_timeout=2) override these.
            opts: dict[str, Any] = {"decode_responses": True, "socket_timeout": 5.0, "socket_connect_timeout": 5.0}
            r: aioredis.Redis | RedisCluster = (
                RedisCluster.from_url(plain, **opts) if cluster
                else aioredis.Redis.from_pool(blocking_pool(plain, retry=_RETRY, **opts)))
        except (ValueError, TypeError, RedisError) as exc:  # connects lazily: only the URL can be wrong here
            raise StoreError(f"invalid redis url: {self._redact(str(exc))}") from None
        self._r = r
        self._cluster = isinstance(r, RedisCluster)  # scripts may declare keys of one slot only
        # Session writes called together go to Redis in one pipeline (a single Redis only: a
        # cluster's pipelines are split by node anyway).
        self._batch = None if isinstance(r, RedisCluster) else ScriptBatch(r)
        self._accept = r.register_script(ACCEPT)
        self._accept_started = r.register_script(ACCEPT_STARTED)
        self._finish = r.register_script(FINISH)
        self._append = r.register_script(APPEND)
        self._reset = r.register_script(RESET)
        self._pairing_code = r.register_script(PAIRING_CODE)
        self._approve = r.register_script(APPROVE)
        self._touched: dict[str, float] = {}  # session -> last write, for the next index batch
        self._index_timer: asyncio.TimerHandle | None = None
        self._index_lock = asyncio.Lock()  # one batch at a time: a later score never lands first
        self._index_outage = OutageLog(log, "sessions index")
        self._index_tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"RedisStore({self._url!r})"

    # --- plumbing -------------------------------------------------------------------------

    async def open(self) -> None:
        """Check that Redis answers, so a wrong URL or password fails at start, not at the first message."""
        with self._errors("connect"):
            await self._r.ping()

    async def close(self) -> None:
        with contextlib.suppress(TimeoutError):  # best effort: Redis being down must not hold up a stop
            await asyncio.wait_for(self._write_index(), INDEX_CLOSE_S)
        for task in self._index_tasks:  # a batch still queued behind the lock: written above, or given up
            task.cancel()
        if self._batch is not None:
            await self._batch.close()
        await self._r.aclose()

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Redis failures become StoreError, without the URL's password and without a cause chain."""
        try:
            yield
        except ResponseError as exc:
            if str(exc).startswith("FENCED"):
                raise FencedOut(f"redis {what} refused: this worker no longer holds the session's lease") from None
            raise StoreError(f"redis {what} failed: ResponseError: {self._redact(str(exc))[:200]}") from None
        except (RedisError, OSError) as exc:
            text = self._redact(str(exc))[:200]
            raise StoreError(f"redis {what} failed: {type(exc).__name__}: {text}") from None

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    # --- operations -----------------------------------------------------------------------

    async def ping(self) -> bool:
        try:
            return bool(await self._r.ping())
        except Exception:
            return False

    def problem(self) -> str | None:
        return None

    async def accept_inbound(self, fence: Fence, msg: InboundMessage, *,
                             started: tuple[int, ChatMessage] | None = None) -> int | None:
        """One fenced script, with `started` too: the record as `running` and the user's row."""
        key = _fenced(fence)
        names = [keys.lease(key), keys.inbound(key), keys.seen(key, msg.platform, msg.chat_id, msg.message_id)]
        status = InboundStatus.ACCEPTED if started is None else InboundStatus.RUNNING
        now = time.time()
        record = {"status": status.value, "detail": None, "received_at": now, "message": msg.to_dict()}
        with self._errors("accept_inbound"):
            # In a Redis Cluster the id is taken first (an id wasted on a duplicate costs nothing).
            inbound_id = str(await self._r.incr(keys.inbound_ids())) if self._cluster else ""
            args: list[str | float | int] = [fence.number, inbound_id, _json(record), _token(),
                                             max(1, int(self.dedup_ttl_s * 1000))]
            if started is None:
                recorded = await self._script(self._accept, names + ([] if self._cluster else [keys.inbound_ids()]),
                                              args)
            else:
                conversation, row = started
                names += [keys.meta(key), keys.messages(key, conversation),
                          *([] if self._cluster else [keys.inbound_ids(), keys.sessions_index()])]
                recorded = await self._script(self._accept_started, names,
                                              [*args, now, conversation, key, _encode_row(row)])
        if started is not None and recorded:
            self._touch(key, now)
        return int(recorded) or None

    async def finish_inbound(self, fence: Fence, inbound_id: int, status: InboundStatus,
                             detail: str | None = None) -> None:
        key = _fenced(fence)
        with self._errors("finish_inbound"):
            await self._script(self._finish, [keys.lease(key), keys.inbound(key)],
                               [fence.number, *_finish_args(inbound_id, status, detail)])

    async def unfinished_inbound(self, session_key: str | None = None) -> list[InboundRecord]:
        """Open inbound messages of one session, oldest first.

        Without a session this returns []: a shared store cannot tell which sessions this worker
        should recover, so recovery runs per session when a worker acquires the session's lease.
        """
        if session_key is None:
            return []
        with self._errors("unfinished_inbound"):
            raw = cast(dict[str, str], await self._r.hgetall(keys.inbound(session_key)))
        out = []
        for inbound_id, text in sorted(raw.items(), key=lambda kv: int(kv[0])):
            rec = json.loads(text)
            out.append(InboundRecord(int(inbound_id), session_key, InboundMessage.from_dict(rec["message"]),
                                     InboundStatus(rec["status"]), rec["received_at"]))
        return out

    async def conversation(self, session_key: str) -> tuple[int, list[ChatMessage]]:
        # Two reads, not one script: the rows are always those of the number returned.
        r = self._r
        with self._errors("conversation"):
            conversation = int(await r.hget(keys.meta(session_key), "conversation") or 1)
            rows = cast(list[str], await r.lrange(keys.messages(session_key, conversation), 0, -1))
        return conversation, [_decode_row(row) for row in rows]

    async def append(self, fence: Fence, conversation: int, rows: Sequence[ChatMessage], *,
                     inbound: tuple[int, InboundStatus, str | None] | None = None) -> None:
        key, now = _fenced(fence), time.time()
        finish = _finish_args(*inbound) if inbound is not None else ["", "", ""]
        encoded = [_encode_row(m) for m in rows]
        # The token names this write by what it writes (rows carry their times; an inbound status
        # moves once), so a caller retrying after a lost reply — a Redis restart mid-call — sends
        # the same token, and the script finds it applied instead of storing the rows twice.
        token = hashlib.blake2b("\x1f".join([str(fence.number), str(conversation), *finish, *encoded]).encode(
            "utf-8", "surrogatepass"), digest_size=12).hexdigest()
        args: list[str | float | int] = [fence.number, now, conversation, token, *finish, key, *encoded]
        with self._errors("append"):
            await self._script(self._append, [keys.lease(key), keys.meta(key), keys.messages(key, conversation),
                                              keys.inbound(key), *self._index_key()], args)
        self._touch(key, now)

    async def reset(self, fence: Fence) -> int:
        key, now = _fenced(fence), time.time()
        with self._errors("reset"):
            conversation = int(await self._script(self._reset, [keys.lease(key), keys.meta(key), *self._index_key()],
                                                  [fence.number, now, _token(), key]))
        self._touch(key, now)
        return conversation

    async def _script(self, script: AsyncScript, names: list[str], args: Sequence[Any]) -> Any:
        """A session write's script, in the pipeline of this turn of the event loop (see ScriptBatch)."""
        if self._batch is None:
            return await script(keys=names, args=args)
        return await self._batch.run(script, names, args)

    def _index_key(self) -> list[str]:
        """The sessions index, for a write's script to list its session in: on a single Redis
        only (in a Redis Cluster it lives in another slot than the session's keys)."""
        return [] if self._cluster else [keys.sessions_index()]

    def _touch(self, session_key: str, now: float) -> None:
        """In a Redis Cluster, list the session in the index by its last write. Best effort (the
        write itself has succeeded; the index only orders listings) and batched: one ZADD for every
        session written in the last INDEX_EVERY_S, instead of a round trip after each write. (On a
        single Redis the write's own script has listed it.)"""
        if not self._cluster:
            return
        self._touched[session_key] = now
        if self._index_timer is None:
            self._index_timer = asyncio.get_running_loop().call_later(INDEX_EVERY_S, self._index_due)

    def _index_due(self) -> None:
        self._index_timer = None
        task = asyncio.get_running_loop().create_task(self._write_index())
        self._index_tasks.add(task)
        task.add_done_callback(self._index_tasks.discard)

    async def _write_index(self) -> None:
        if self._index_timer is not None:
            self._index_timer.cancel()
            self._index_timer = None
        async with self._index_lock:
            touched, self._touched = self._touched, {}
            items = list(touched.items())
            try:
                for start in range(0, len(items), INDEX_SLICE):
                    await self._r.zadd(keys.sessions_index(), dict(items[start:start + INDEX_SLICE]))
            except (RedisError, OSError) as exc:
                for key, at in touched.items():  # kept for the next batch (a newer write wins)
                    self._touched.setdefault(key, at)
                self._index_outage.failed("unwritable", f"could not update it: {self._redact(str(exc))}")
            else:
                self._index_outage.recovered("updated again")

    async def sessions(self, limit: int = 100) -> list[SessionInfo]:
        r = self._r
        await self._write_index()  # this worker's latest writes are listed
        with self._errors("sessions"):
            index = cast(list[tuple[str, float]],
                         await r.zrevrange(keys.sessions_index(), 0, limit - 1, withscores=True))
            pipe = r.pipeline(transaction=False)
            for key, _ in index:
                pipe.hmget(keys.meta(key), ["conversation", "updated_at"])
            metas = await pipe.execute()
            pipe = r.pipeline(transaction=False)
            convs = [int(meta[0] or 1) for meta in metas]
            for (key, _), conv in zip(index, convs, strict=True):
                pipe.llen(keys.messages(key, conv))
            counts = await pipe.execute()
        return [SessionInfo(key, conv, float(meta[1] or score), int(count))
                for (key, score), meta, conv, count in zip(index, metas, convs, counts, strict=True)]

    # --- pairing --------------------------------------------------------------------------

    async def is_paired(self, platform: str, user_id: str) -> bool:
        with self._errors("is_paired"):
            return bool(await self._r.hexists(keys.paired_users(platform), user_id))

    async def pairing_code(self, platform: str, user_id: str, user_name: str, *, code: str,
                           ttl_s: float, max_pending: int) -> str | None:
        r = self._r
        with self._errors("pairing_code"):
            await r.sadd(keys.pairing_platforms(), platform)
            issued, expired = await self._pairing_code(keys=[keys.pairing_codes(platform)],
                                                       args=[user_id, user_name, code, ttl_s, max_pending])
            pipe = r.pipeline(transaction=False)
            if expired:
                pipe.hdel(keys.pairing_code_index(), *expired)
            if issued == code:
                pipe.hset(keys.pairing_code_index(), code, platform)
            await pipe.execute()
        return str(issued) or None

    async def approve_pairing(self, code: str, *, ttl_s: float) -> tuple[str, str, str] | None:
        r = self._r
        with self._errors("approve_pairing"):
            platform = cast(str | None, await r.hget(keys.pairing_code_index(), code))
            if platform is None:
                return None
            approved = await self._approve(keys=[keys.pairing_codes(platform), keys.paired_users(platform)],
                                           args=[code, ttl_s])
            await r.hdel(keys.pairing_code_index(), code)
        if not approved:
            return None
        return platform, str(approved[0]), str(approved[1])

    async def pairing_state(self) -> tuple[list[tuple[str, str, str, str, float]], list[tuple[str, str, str]]]:
        """(pending codes, paired users) for `switchboard pairing list`."""
        r = self._r
        with self._errors("pairing_state"):
            platforms = sorted(cast(set[str], await r.smembers(keys.pairing_platforms())))
            pipe = r.pipeline(transaction=False)
            for platform in platforms:
                pipe.hgetall(keys.pairing_codes(platform))
                pipe.hgetall(keys.paired_users(platform))
            found = await pipe.execute()
        pending: list[tuple[str, str, str, str, float]] = []
        paired: list[tuple[str, str, str]] = []
        for platform, codes, users in zip(platforms, found[::2], found[1::2], strict=True):
            for code, raw in codes.items():
                rec = json.loads(raw)
                pending.append((code, platform, rec["user_id"], rec["user_name"], float(rec["created_at"])))
            for user_id, raw in users.items():
                paired.append((platform, user_id, json.loads(raw)["user_name"]))
        return pending, paired


# --- encoding -----------------------------------------------------------------------------

def _token() -> str:
    return secrets.token_hex(8)


def _json(value: Any) -> str:
    """Compact, and text as text: no \\uXXXX for every non-ASCII character (a quarter of the size)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _fenced(fence: Fence) -> str:
    """The session key of a write the shared store may apply: never one without a lease's fence."""
    if fence.is_local:
        raise StoreError("refused a write without a lease's fence (the Redis store is shared)")
    return fence.session_key


def _finish_args(inbound_id: int, status: InboundStatus, detail: str | None) -> list[str]:
    keep = status.is_open
    # The record's text up to (not including) `,"received_at":`, which the script splices on.
    head = _json({"status": status.value, "detail": detail})[:-1] if keep else ""
    return [str(inbound_id), "1" if keep else "0", head]


def _encode_row(m: ChatMessage) -> str:
    return _json({"role": m.role, "content": m.content, "tool_calls": m.tool_calls_json(),
                  "tool_call_id": m.tool_call_id, "interrupted_by": m.interrupted_by, "reason": m.reason,
                  "created_at": m.created_at})


def _decode_row(text: str) -> ChatMessage:
    d = json.loads(text)
    return ChatMessage(d["role"], d["content"], ChatMessage.tool_calls_from_json(d["tool_calls"]),
                       d["tool_call_id"], d["interrupted_by"], d["reason"], d["created_at"])


def _parse(url: str) -> tuple[str, bool]:
    """(URL for redis-py, whether it names a cluster): `redis+cluster://` or `?cluster=true`."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    cluster = parts.scheme.endswith("+cluster") or any(
        k == "cluster" and v.lower() in ("1", "true", "yes") for k, v in query)
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit((parts.scheme.removesuffix("+cluster"), parts.netloc, parts.path, rest, "")), cluster


def _secrets(url: str) -> list[str]:
    try:
        password = urlsplit(url).password
    except ValueError:
        return []
    return [s for s in {password, unquote(password)} if s] if password else []
