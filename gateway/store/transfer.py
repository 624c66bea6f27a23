"""Reading a whole store, whatever its backend: `switchboard store copy` and `switchboard export`.

A `Source` yields a store's rows table by table (sessions, transcript messages, inbound records,
approved pairings, fences); SQLite, Redis and PostgreSQL each have one. `copy` moves a SQLite or
Redis store into an empty PostgreSQL database in one transaction and then proves it: it reads the
target back and compares, per table, the row count and a checksum over every row's content (an
order-independent sum of SHA-256 digests; a message's position in its conversation is part of the
row). Pending pairing codes are not copied: they expire within an hour (and in a cluster they stay
in Redis anyway).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast
from urllib.parse import unquote

import asyncpg
from redis.exceptions import RedisError

from agent_cache import keys
from gateway.core.ports import StoreError
from gateway.store.postgres import PostgresSettings, PostgresStore, redact_url

_TEXT_NUL = "\x00"


@dataclass(frozen=True, slots=True)
class SessionRow:
    key: str
    conversation: int
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class MessageRow:
    session_key: str
    conversation: int
    role: str
    content: str
    tool_calls: str | None
    tool_call_id: str | None
    interrupted_by: str | None
    reason: str | None
    created_at: float


@dataclass(frozen=True, slots=True)
class InboundRow:
    session_key: str
    platform: str
    chat_id: str
    message_id: str
    payload: str  # the message as JSON
    status: str
    detail: str | None
    received_at: float


@dataclass(frozen=True, slots=True)
class PairedRow:
    platform: str
    user_id: str
    user_name: str
    approved_at: float


class Source(Protocol):
    """A store read table by table; `key` narrows to one session. Messages come in conversation order."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def sessions(self, key: str | None = None) -> AsyncIterator[SessionRow]: ...

    def messages(self, key: str | None = None) -> AsyncIterator[MessageRow]: ...

    def inbound(self, key: str | None = None) -> AsyncIterator[InboundRow]: ...

    def paired(self) -> AsyncIterator[PairedRow]: ...

    def fences(self) -> AsyncIterator[tuple[str, int]]: ...


class TransferError(Exception):
    """The copy or export cannot go ahead; the text says why (and holds no password)."""


def open_source(url: str) -> Source:
    """`sqlite:///path/to/switchboard.db` (or a plain path), `redis://…`, or `postgresql://…`."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme in ("postgresql", "postgres"):
        return PostgresSource(url)
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        return RedisSource(url)
    if scheme in ("sqlite", ""):
        rest = unquote(url[len("sqlite://"):]) if scheme else url
        path = Path("/" + rest.lstrip("/") if rest.startswith("/") else rest)
        if not path.is_file():
            raise TransferError(f"no SQLite database at {path}")
        return SqliteSource(path)
    raise TransferError(f"unknown store URL scheme {scheme!r}: use sqlite:///PATH, redis://… or postgresql://…")


# --- SQLite ---------------------------------------------------------------------------------

class SqliteSource:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None

    async def open(self) -> None:
        try:
            self._db = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True)
            self._db.execute("SELECT 1 FROM sessions LIMIT 1")
        except sqlite3.Error as exc:
            raise TransferError(f"cannot read {self.path} as a Switchboard SQLite store: {exc}") from None

    async def close(self) -> None:
        if self._db is not None:
            self._db.close()

    def _rows(self, sql: str, key: str | None, column: str, order: str) -> list[Any] | sqlite3.Cursor:
        assert self._db is not None
        if key is None:
            return self._db.execute(f"{sql} ORDER BY {order}")
        return self._db.execute(f"{sql} WHERE {column} = ? ORDER BY {order}", (key,))

    async def sessions(self, key: str | None = None) -> AsyncIterator[SessionRow]:
        for r in self._rows("SELECT key, conversation, created_at, updated_at FROM sessions", key, "key", "key"):
            yield SessionRow(r[0], int(r[1]), float(r[2]), float(r[3]))

    async def messages(self, key: str | None = None) -> AsyncIterator[MessageRow]:
        for r in self._rows("SELECT session_key, conversation, role, content, tool_calls, tool_call_id,"
                            " interrupted_by, reason, created_at FROM messages", key, "session_key",
                            "session_key, conversation, id"):
            yield MessageRow(r[0], int(r[1]), r[2], r[3], r[4], r[5], r[6], r[7], float(r[8]))

    async def inbound(self, key: str | None = None) -> AsyncIterator[InboundRow]:
        for r in self._rows("SELECT session_key, platform, chat_id, message_id, payload, status, detail,"
                            " received_at FROM inbound", key, "session_key", "id"):
            yield InboundRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], float(r[7]))

    async def paired(self) -> AsyncIterator[PairedRow]:
        assert self._db is not None
        for r in self._db.execute("SELECT platform, user_id, user_name, approved_at FROM paired_users"):
            yield PairedRow(r[0], r[1], r[2], float(r[3]))

    async def fences(self) -> AsyncIterator[tuple[str, int]]:
        for _ in ():  # one process: no fences
            yield _


# --- Redis ----------------------------------------------------------------------------------

class RedisSource:
    """Every session of a Redis store: found by the keys tagged with it (and the sessions index,
    which keeps keys whose braces the tag had to replace). Only open inbound records are kept in
    Redis, so only those are read."""

    def __init__(self, url: str) -> None:
        from gateway.store.redis import RedisStore

        self._store = RedisStore(url)
        self._r = self._store._r
        self._keys: list[str] | None = None

    async def open(self) -> None:
        await self._store.open()

    async def close(self) -> None:
        await self._store.close()

    async def _session_keys(self, key: str | None) -> list[str]:
        if key is not None:
            return [key]
        if self._keys is None:
            with self._store._errors("scan"):
                indexed = cast(list[str], await self._r.zrange(keys.sessions_index(), 0, -1))
                by_tag = {_tag(k): k for k in indexed}
                found = set(indexed)
                async for name in self._r.scan_iter(match="sb:{s:*", count=1000):
                    tag = name[len("sb:"):name.index("}", len("sb:")) + 1]
                    found.add(by_tag.get(tag, tag[len("{s:"):-1]))
            self._keys = sorted(found)
        return self._keys

    async def _meta(self, key: str) -> dict[str, str]:
        with self._store._errors("read"):
            return cast(dict[str, str], await self._r.hgetall(keys.meta(key)))

    async def sessions(self, key: str | None = None) -> AsyncIterator[SessionRow]:
        for k in await self._session_keys(key):
            meta = await self._meta(k)
            if meta:
                updated = float(meta.get("updated_at", 0))
                yield SessionRow(k, int(meta.get("conversation", 1)), float(meta.get("created_at", updated)),
                                 updated)

    async def messages(self, key: str | None = None) -> AsyncIterator[MessageRow]:
        from gateway.store.redis import _decode_row

        for k in await self._session_keys(key):
            current = int((await self._meta(k)).get("conversation", 1))
            for conversation in range(1, current + 1):
                with self._store._errors("read"):
                    rows = cast(list[str], await self._r.lrange(keys.messages(k, conversation), 0, -1))
                for raw in rows:
                    m = _decode_row(raw)
                    yield MessageRow(k, conversation, m.role, m.content, m.tool_calls_json(), m.tool_call_id,
                                     m.interrupted_by, m.reason, m.created_at)

    async def inbound(self, key: str | None = None) -> AsyncIterator[InboundRow]:
        """In the order they were received (their ids are one counter): open records are few."""
        found: list[tuple[int, InboundRow]] = []
        for k in await self._session_keys(key):
            with self._store._errors("read"):
                records = cast(dict[str, str], await self._r.hgetall(keys.inbound(k)))
            for inbound_id, raw in records.items():
                rec = json.loads(raw)
                msg = rec["message"]
                payload = json.dumps(msg, ensure_ascii=False)
                found.append((int(inbound_id), InboundRow(k, msg["platform"], msg["chat_id"], msg["message_id"],
                                                          payload, rec["status"], rec["detail"],
                                                          float(rec["received_at"]))))
        for _, row in sorted(found, key=lambda item: item[0]):
            yield row

    async def paired(self) -> AsyncIterator[PairedRow]:
        with self._store._errors("read"):
            platforms = sorted(cast(set[str], await self._r.smembers(keys.pairing_platforms())))
            for platform in platforms:
                users = cast(dict[str, str], await self._r.hgetall(keys.paired_users(platform)))
                for user_id, raw in sorted(users.items()):
                    rec = json.loads(raw)
                    yield PairedRow(platform, user_id, rec["user_name"], float(rec["approved_at"]))

    async def fences(self) -> AsyncIterator[tuple[str, int]]:
        for k in await self._session_keys(None):
            with self._store._errors("read"):
                value = await self._r.get(keys.fence(k))
            if value is not None:
                yield k, int(value)


def _tag(session_key: str) -> str:
    return keys.lease(session_key)[len("sb:"):-len(":lease")]


# --- PostgreSQL -----------------------------------------------------------------------------

class PostgresSource:
    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: asyncpg.Connection[asyncpg.Record] | None = None

    async def open(self) -> None:
        try:
            self._conn = await asyncpg.connect(self.url, timeout=10)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            raise TransferError(f"cannot connect to {redact_url(self.url)}: {type(exc).__name__}") from None

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()

    async def _rows(self, sql: str, *args: Any) -> AsyncIterator[asyncpg.Record]:
        assert self._conn is not None
        async with self._conn.transaction(readonly=True, isolation="repeatable_read"):
            async for r in self._conn.cursor(sql, *args, prefetch=5000):
                yield r

    @staticmethod
    def _where(key: str | None, column: str) -> tuple[str, tuple[str, ...]]:
        return (f" WHERE {column} = $1", (key,)) if key is not None else ("", ())

    async def sessions(self, key: str | None = None) -> AsyncIterator[SessionRow]:
        where, args = self._where(key, "key")
        async for r in self._rows(f"SELECT key, conversation, created_at, updated_at FROM sessions{where}"
                                  " ORDER BY key", *args):
            yield SessionRow(r[0], int(r[1]), float(r[2]), float(r[3]))

    async def messages(self, key: str | None = None) -> AsyncIterator[MessageRow]:
        where, args = self._where(key, "session_key")
        async for r in self._rows("SELECT session_key, conversation, role, content, tool_calls, tool_call_id,"
                                  f" interrupted_by, reason, created_at FROM messages{where}"
                                  " ORDER BY session_key, conversation, id", *args):
            yield MessageRow(r[0], int(r[1]), r[2], r[3], r[4], r[5], r[6], r[7], float(r[8]))

    async def inbound(self, key: str | None = None) -> AsyncIterator[InboundRow]:
        where, args = self._where(key, "session_key")
        async for r in self._rows("SELECT session_key, platform, chat_id, message_id, payload, status, detail,"
                                  f" received_at FROM inbound{where} ORDER BY id", *args):
            yield InboundRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], float(r[7]))

    async def paired(self) -> AsyncIterator[PairedRow]:
        async for r in self._rows("SELECT platform, user_id, user_name, approved_at FROM paired_users"):
            yield PairedRow(r[0], r[1], r[2], float(r[3]))

    async def fences(self) -> AsyncIterator[tuple[str, int]]:
        async for r in self._rows("SELECT session_key, fence FROM fences"):
            yield r[0], int(r[1])


# --- checksums ------------------------------------------------------------------------------

def _clean(value: Any) -> Any:
    return value.replace(_TEXT_NUL, "\ufffd") if isinstance(value, str) and _TEXT_NUL in value else value


@dataclass
class Tally:
    """Per table: how many rows, and an order-independent checksum of their content."""

    counts: Counter[str] = field(default_factory=Counter)
    sums: Counter[str] = field(default_factory=Counter)
    cleaned: int = 0  # values whose NUL characters become U+FFFD in PostgreSQL
    _positions: Counter[tuple[str, int]] = field(default_factory=Counter)

    def add(self, table: str, fields: tuple[Any, ...]) -> tuple[Any, ...]:
        """Count one row (as PostgreSQL will hold it, which is returned)."""
        clean = tuple(_clean(v) for v in fields)
        self.cleaned += sum(1 for a, b in zip(fields, clean, strict=True) if a is not b)
        digest = hashlib.sha256(json.dumps([table, *clean], ensure_ascii=False).encode()).digest()
        self.counts[table] += 1
        self.sums[table] = (self.sums[table] + int.from_bytes(digest, "big")) % (1 << 256)
        return clean

    def message(self, m: MessageRow) -> tuple[Any, ...]:
        position = self._positions[(m.session_key, m.conversation)]
        self._positions[(m.session_key, m.conversation)] += 1
        clean = self.add("messages", (*astuple(m), position))
        return clean[:-1]

    def inbound(self, i: InboundRow) -> tuple[Any, ...]:
        canonical = json.dumps(json.loads(i.payload), sort_keys=True)
        self.add("inbound", (*astuple(i)[:4], canonical, *astuple(i)[5:]))
        return tuple(_clean(v) for v in astuple(i))

    def checksum(self, table: str) -> str:
        return f"{self.sums[table]:064x}"[:16]


TABLES = ("sessions", "messages", "inbound", "paired_users")


async def tally(source: Source) -> Tally:
    t = Tally()
    async for s in source.sessions():
        t.add("sessions", astuple(s))
    async for m in source.messages():
        t.message(m)
    async for i in source.inbound():
        t.inbound(i)
    async for p in source.paired():
        t.add("paired_users", astuple(p))
    return t


# --- copy -----------------------------------------------------------------------------------

@dataclass
class CopyReport:
    source: Tally
    target: Tally
    fences: int
    already: bool  # the target held this very data before: nothing was written

    @property
    def ok(self) -> bool:
        return all(self.source.counts[t] == self.target.counts[t] and self.source.sums[t] == self.target.sums[t]
                   for t in TABLES)

    def lines(self) -> list[str]:
        out = [f"{'table':<13} {'source':>10} {'target':>10}  {'checksum (source / target)':<35}"]
        for t in TABLES:
            mark = "" if (self.source.counts[t], self.source.sums[t]) == (self.target.counts[t],
                                                                          self.target.sums[t]) else "  MISMATCH"
            out.append(f"{t:<13} {self.source.counts[t]:>10} {self.target.counts[t]:>10}  "
                       f"{self.source.checksum(t)} / {self.target.checksum(t)}{mark}")
        if self.fences:
            out.append(f"fences       {self.fences:>10} (the newest lease fence of each session)")
        if self.source.cleaned:
            out.append(f"note: {self.source.cleaned} value(s) held NUL characters, stored as U+FFFD")
        return out


_BATCH = 5000


async def copy(source_url: str, target_url: str, *, progress: Callable[[str], None] | None = None) -> CopyReport:
    """Copy a store into an empty PostgreSQL database, in one transaction, then verify it.

    A target that already holds exactly the source's data is verified and left alone (a re-run
    is harmless); a target holding anything else is refused.
    """
    if not target_url.startswith(("postgresql://", "postgres://")):
        raise TransferError("the target of a copy must be a PostgreSQL URL (postgresql://…)")
    say = progress or (lambda _text: None)
    source = open_source(source_url)
    target = PostgresStore(target_url, require_fence=False, settings=PostgresSettings(pool_size=2))
    await source.open()
    try:
        await target.open()  # creates (migrates) the schema
        await target.close()
        conn = await asyncpg.connect(target_url, timeout=10)
        try:
            held = int(await conn.fetchval(
                "SELECT (SELECT count(*) FROM sessions) + (SELECT count(*) FROM messages)"
                " + (SELECT count(*) FROM inbound) + (SELECT count(*) FROM paired_users)"))
            if held:
                say(f"the target already holds {held} row(s): comparing it with the source")
                report = CopyReport(await tally(source), await tally(_Verify(conn)), 0, already=True)
                if not report.ok:
                    raise TransferError(f"the target database already holds {held} row(s) that are not this "
                                        "source's: copy into an empty database")
                return report
            mine = Tally()
            fences = 0
            async with conn.transaction():
                await _copy_rows(conn, "sessions", ("key", "conversation", "created_at", "updated_at"),
                                 (mine.add("sessions", astuple(s)) async for s in source.sessions()), say)
                await _copy_rows(conn, "messages", ("session_key", "conversation", "role", "content", "tool_calls",
                                                    "tool_call_id", "interrupted_by", "reason", "created_at"),
                                 (mine.message(m) async for m in source.messages()), say)
                await _copy_rows(conn, "inbound", ("session_key", "platform", "chat_id", "message_id", "payload",
                                                   "status", "detail", "received_at"),
                                 (mine.inbound(i) async for i in source.inbound()), say)
                await _copy_rows(conn, "paired_users", ("platform", "user_id", "user_name", "approved_at"),
                                 (mine.add("paired_users", astuple(p)) async for p in source.paired()), say)
                fences = await _copy_rows(conn, "fences", ("session_key", "fence"),
                                          (f async for f in source.fences()), say)
                # Archived conversations date from their last message (retention counts from there).
                await conn.execute(
                    "INSERT INTO archives (session_key, conversation, archived_at)"
                    " SELECT m.session_key, m.conversation, max(m.created_at) FROM messages m"
                    " JOIN sessions s ON s.key = m.session_key AND m.conversation < s.conversation"
                    " GROUP BY m.session_key, m.conversation")
            say("copied; reading the target back to verify")
            return CopyReport(mine, await tally(_Verify(conn)), fences, already=False)
        finally:
            await conn.close()
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
        text = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise TransferError(f"copy failed ({type(exc).__name__}: {text}); nothing was committed") from None
    except (StoreError, RedisError) as exc:
        raise TransferError(str(exc)) from None
    finally:
        await source.close()


async def _copy_rows(conn: asyncpg.Connection[asyncpg.Record], table: str, columns: tuple[str, ...],
                     rows: AsyncIterator[tuple[Any, ...]], say: Callable[[str], None]) -> int:
    batch: list[tuple[Any, ...]] = []
    total = 0
    async for row in rows:
        batch.append(row)
        if len(batch) >= _BATCH:
            await conn.copy_records_to_table(table, records=batch, columns=list(columns))
            total += len(batch)
            batch.clear()
            if total % (_BATCH * 20) == 0:
                say(f"{table}: {total} rows")
    if batch:
        await conn.copy_records_to_table(table, records=batch, columns=list(columns))
        total += len(batch)
    return total


class _Verify(PostgresSource):
    """The copy's target, read on the connection it was written through."""

    def __init__(self, conn: asyncpg.Connection[asyncpg.Record]) -> None:
        super().__init__("")
        self._conn = conn


# --- export ---------------------------------------------------------------------------------

async def export(source: Source, session_key: str) -> AsyncIterator[dict[str, Any]]:
    """Everything stored about one session, as JSON-ready objects: the session, every message of
    every conversation (archived ones too, as long as they are kept), its inbound records."""
    async for s in source.sessions(session_key):
        yield {"type": "session", "session": s.key, "conversation": s.conversation, "created_at": s.created_at,
               "updated_at": s.updated_at}
    async for m in source.messages(session_key):
        yield {"type": "message", "session": m.session_key, "conversation": m.conversation, "role": m.role,
               "content": m.content, "tool_calls": json.loads(m.tool_calls) if m.tool_calls else None,
               "tool_call_id": m.tool_call_id, "interrupted_by": m.interrupted_by, "reason": m.reason,
               "created_at": m.created_at}
    async for i in source.inbound(session_key):
        yield {"type": "inbound", "session": i.session_key, "status": i.status, "detail": i.detail,
               "received_at": i.received_at, "message": json.loads(i.payload)}
