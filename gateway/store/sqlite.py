"""SQLite store (WAL). One writer thread commits queued operations in groups.

Group commit keeps the event loop free of disk waits and makes thousands of small writes a
second cheap: every operation waiting when the thread wakes shares one transaction and one commit
(no savepoint per operation). When one of them fails, the group is rolled back and run again one
operation per transaction, so a failing write fails alone and the others land.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gateway.core import jsonfast
from gateway.core.fencing import Fence
from gateway.core.messages import InboundMessage
from gateway.core.outage import OutageLog
from gateway.core.ports import OPEN_STATUSES, DiskFull, InboundRecord, InboundStatus, SessionInfo, StoreError
from gateway.core.transcript import ChatMessage

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    key TEXT PRIMARY KEY,
    conversation INTEGER NOT NULL DEFAULT 1,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_key TEXT NOT NULL,
    conversation INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    tool_calls TEXT,
    tool_call_id TEXT,
    interrupted_by TEXT,
    reason TEXT,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_session ON messages (session_key, conversation, id);
CREATE TABLE IF NOT EXISTS inbound (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    platform TEXT NOT NULL,
    chat_id TEXT NOT NULL,
    message_id TEXT NOT NULL,
    session_key TEXT NOT NULL,
    payload TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'accepted',
    detail TEXT,
    received_at REAL NOT NULL,
    UNIQUE (platform, chat_id, message_id)
);
CREATE TABLE IF NOT EXISTS pairing_codes (
    code TEXT PRIMARY KEY,
    platform TEXT NOT NULL,
    user_id TEXT NOT NULL,
    user_name TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS paired_users (
    platform TEXT NOT NULL,
    user_id TEXT NOT NULL,
    user_name TEXT NOT NULL,
    approved_at REAL NOT NULL,
    PRIMARY KEY (platform, user_id)
);
CREATE INDEX IF NOT EXISTS inbound_open ON inbound (status) WHERE status IN ('accepted', 'running', 'restart');
CREATE INDEX IF NOT EXISTS inbound_finished ON inbound (received_at)
    WHERE status NOT IN ('accepted', 'running', 'restart');
CREATE INDEX IF NOT EXISTS sessions_by_update ON sessions (updated_at);
"""
RESERVE_BYTES = 16 << 20  # kept free for the WAL's checkpoint and the records already promised
WAL_LIMIT_BYTES = 4 << 20  # the WAL is truncated to this after a checkpoint (it never keeps a full disk)
SPACE_CHECK_S = 1.0  # free space is read at most this often
PRUNE_EVERY_S = 3600.0  # finished inbound rows past the dedup window are deleted this often
PRUNE_SLICE = 5000  # rows per transaction: writes queued meanwhile wait for one slice at most

Op = Callable[[sqlite3.Connection], Any]
_Item = tuple[Op, "asyncio.Future[Any]"] | None  # None asks the writer to stop
_Result = tuple["asyncio.Future[Any]", Any, BaseException | None]


class SqliteStore:
    """A full disk is a state, not a crash. The daemon's store keeps a reserve file
    (`<db>.reserve`, `reserve_bytes`, made at open; a CLI command's store keeps none and never
    touches it). On the first write that finds the disk full, the reserve is given up, so the WAL's
    checkpoint and the records of turns already running still have room; new messages are refused
    (retryable) while the disk stays full, and `ping` — readiness — says so. Each `ping` tries a
    write: once one lands, the reserve is made again and messages are taken again."""

    def __init__(self, path: Path, *, dedup_ttl_s: float = 7 * 86400, prune_every_s: float = PRUNE_EVERY_S,
                 reserve_bytes: int = 0) -> None:
        self.path = path
        self.dedup_ttl_s = dedup_ttl_s
        self.prune_every_s = prune_every_s
        self.reserve_bytes = reserve_bytes
        self.reserve = path.with_name(path.name + ".reserve")
        self._full = False  # a write found the disk full and none has landed since
        # Whether the reserve file is there: kept by the store as it makes and gives it up, and
        # looked at again with the free space (not on every message: a stat each costs).
        self._reserve_held = False
        self._space_checked = -SPACE_CHECK_S
        self._low = False  # free space under the threshold, at the last look
        self._outage = OutageLog(log, "store")
        self._ops: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- plumbing -------------------------------------------------------------------------

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._writer, args=(ready,), name="sqlite-store",
                                        daemon=True)
        self._thread.start()
        await ready
        await self._call(self._prune_all)
        await asyncio.to_thread(self._make_reserve)

    async def close(self) -> None:
        if self._thread is None:
            return
        self._ops.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        if self.reserve_bytes > 0:
            self._reserve_held = False
            self.reserve.unlink(missing_ok=True)  # held only while the daemon runs; made again at open

    async def _call(self, op: Callable[[sqlite3.Connection], T]) -> T:
        if self._thread is None or self._loop is None:
            raise StoreError("store is not open")
        fut: asyncio.Future[T] = self._loop.create_future()
        self._ops.put((op, fut))
        return await fut

    def _writer(self, ready: asyncio.Future[None]) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=5000")
            conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
            conn.executescript(SCHEMA)
        except sqlite3.Error as exc:
            failure: list[_Result] = [(ready, None, StoreError(f"cannot open {self.path}: {exc}"))]
            loop.call_soon_threadsafe(_settle, failure)
            return
        opened: list[_Result] = [(ready, None, None)]
        loop.call_soon_threadsafe(_settle, opened)
        stopping = False
        next_prune = time.monotonic() + self.prune_every_s
        while not stopping:
            if time.monotonic() >= next_prune and not self._prune_slice(conn):  # between groups, a slice at a time
                next_prune = time.monotonic() + self.prune_every_s
            batch: list[_Item] = [self._ops.get()]
            while len(batch) < 1024:
                try:
                    batch.append(self._ops.get_nowait())
                except queue.Empty:
                    break
            ops: list[tuple[Op, asyncio.Future[Any]]] = []
            for item in batch:
                if item is None:
                    stopping = True
                else:
                    ops.append(item)
            results = _run_group(conn, ops) if ops else []
            if any(isinstance(exc, DiskFull) for _fut, _value, exc in results):
                self._disk_full(conn)
            if results:
                loop.call_soon_threadsafe(_settle, results)
        conn.close()

    def _reserve_size(self) -> int:
        stat = os.statvfs(self.path.parent)
        return min(self.reserve_bytes, stat.f_blocks * stat.f_frsize // 20)

    def _make_reserve(self) -> None:
        """Hold `reserve_bytes` of the disk (at most a twentieth of it) for when it fills up — only
        when twice that is free, so making it never fills the disk itself."""
        if self.reserve_bytes <= 0:
            return
        if self.reserve.exists():
            self._reserve_held = True
            return
        size = self._reserve_size()
        if shutil.disk_usage(self.path.parent).free < 2 * size:
            return
        try:
            fd = os.open(self.reserve, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            self._reserve_held = True
        except OSError as exc:  # no room for it now: made at the next recovery
            self._reserve_held = False
            self.reserve.unlink(missing_ok=True)
            log.warning("store: no room for the disk reserve (%s)", exc.strerror)

    def _disk_full(self, conn: sqlite3.Connection) -> None:
        """(The writer thread.) The disk is full: give up the reserve and checkpoint the WAL into
        the room it leaves, so the records already promised can still land."""
        if not self._full:
            self._full = True
            self._outage.failed("full", f"the data disk is full ({self.path.parent}); new messages are "
                                "refused until there is room", level=logging.ERROR)
        if self.reserve_bytes > 0:
            self._reserve_held = False
            self.reserve.unlink(missing_ok=True)
        with contextlib.suppress(sqlite3.Error):
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def problem(self, *, fresh: bool = False) -> str | None:
        now = time.monotonic()
        if fresh or now - self._space_checked >= SPACE_CHECK_S:
            self._space_checked = now
            usage = shutil.disk_usage(self.path.parent)
            self._low = usage.free < min(WAL_LIMIT_BYTES, usage.total // 20)
            if self.reserve_bytes > 0:  # (someone else may have removed it)
                self._reserve_held = self.reserve.exists()
        if self._full or (self.reserve_bytes > 0 and not self._reserve_held):
            return "the data disk is full"  # (or was, and has no room for its reserve again yet)
        return "the data disk is nearly full" if self._low else None

    def _room_for_new(self) -> None:
        """Refuse a new message (retryable) while the disk is full or nearly so."""
        if (problem := self.problem()) is not None:
            raise DiskFull(problem)

    # --- operations -----------------------------------------------------------------------

    async def ping(self) -> bool:
        """Readable and — after the disk was full — writable again (each ping tries one write)."""
        try:
            if self._full:
                await self._call(_probe_write)
                self._full = False  # a write landed: SQLite has room again
            elif not await self._call(lambda c: c.execute("SELECT 1").fetchone()):
                return False
        except StoreError:
            return False
        await asyncio.to_thread(self._make_reserve)  # (when it is missing and there is room for it)
        if self.problem(fresh=True) is not None:
            return False
        self._outage.recovered("the data disk has room again; messages are taken again")
        return True

    async def accept_inbound(self, fence: Fence, msg: InboundMessage, *,
                             started: tuple[int, ChatMessage] | None = None) -> int | None:
        self._room_for_new()
        session_key, payload, now = fence.session_key, jsonfast.dumps_text(msg.to_dict()), time.time()
        status = "accepted" if started is None else "running"
        rows = [] if started is None else [_row(session_key, started[0], started[1])]

        def op(c: sqlite3.Connection) -> int | None:
            cur = c.execute(
                "INSERT OR IGNORE INTO inbound (platform, chat_id, message_id, session_key, payload, status,"
                " received_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (msg.platform, msg.chat_id, msg.message_id, session_key, payload, status, now))
            if not cur.rowcount:
                return None
            if started is not None:  # the turn's start, in the same transaction
                _add_rows(c, session_key, started[0], rows, now)
            return cur.lastrowid

        return await self._call(op)

    async def finish_inbound(self, fence: Fence, inbound_id: int, status: InboundStatus,
                             detail: str | None = None) -> None:
        await self._call(lambda c: c.execute(
            "UPDATE inbound SET status = ?, detail = ? WHERE id = ?", (status.value, detail, inbound_id)))

    async def unfinished_inbound(self, session_key: str | None = None) -> list[InboundRecord]:
        def op(c: sqlite3.Connection) -> list[InboundRecord]:
            where = f"status IN {OPEN_STATUSES!r}"
            args: tuple[str, ...] = ()
            if session_key is not None:
                where += " AND session_key = ?"
                args = (session_key,)
            rows = c.execute("SELECT id, session_key, payload, status, received_at FROM inbound"
                             f" WHERE {where} ORDER BY id", args).fetchall()
            return [InboundRecord(r[0], r[1], InboundMessage.from_dict(json.loads(r[2])), InboundStatus(r[3]), r[4])
                    for r in rows]

        return await self._call(op)

    async def conversation(self, session_key: str) -> tuple[int, list[ChatMessage]]:
        def op(c: sqlite3.Connection) -> tuple[int, list[ChatMessage]]:
            row = c.execute("SELECT conversation FROM sessions WHERE key = ?", (session_key,)).fetchone()
            conv = row[0] if row else 1
            rows = c.execute(
                "SELECT role, content, tool_calls, tool_call_id, interrupted_by, reason, created_at"
                " FROM messages WHERE session_key = ? AND conversation = ? ORDER BY id",
                (session_key, conv)).fetchall()
            return conv, [ChatMessage(r[0], r[1], ChatMessage.tool_calls_from_json(r[2]), r[3], r[4], r[5], r[6])
                          for r in rows]

        return await self._call(op)

    async def append(self, fence: Fence, conversation: int, rows: Sequence[ChatMessage], *,
                     inbound: tuple[int, InboundStatus, str | None] | None = None) -> None:
        session_key, now = fence.session_key, time.time()
        values = [_row(session_key, conversation, m) for m in rows]

        def op(c: sqlite3.Connection) -> None:
            _add_rows(c, session_key, conversation, values, now)
            if inbound is not None:
                inbound_id, status, detail = inbound
                c.execute("UPDATE inbound SET status = ?, detail = ? WHERE id = ?", (status.value, detail, inbound_id))

        await self._call(op)

    async def reset(self, fence: Fence) -> int:
        session_key = fence.session_key

        def op(c: sqlite3.Connection) -> int:
            now = time.time()
            row = c.execute(
                "INSERT INTO sessions (key, conversation, created_at, updated_at) VALUES (?, 2, ?, ?)"
                " ON CONFLICT (key) DO UPDATE SET conversation = conversation + 1, updated_at = ?"
                " RETURNING conversation", (session_key, now, now, now)).fetchone()
            return int(row[0])

        return await self._call(op)

    async def sessions(self, limit: int = 100) -> list[SessionInfo]:
        def op(c: sqlite3.Connection) -> list[SessionInfo]:
            rows = c.execute(
                "SELECT s.key, s.conversation, s.updated_at,"
                " (SELECT count(*) FROM messages m WHERE m.session_key = s.key"
                "  AND m.conversation = s.conversation)"
                " FROM sessions s ORDER BY s.updated_at DESC LIMIT ?", (limit,)).fetchall()
            return [SessionInfo(*r) for r in rows]

        return await self._call(op)

    # --- pairing --------------------------------------------------------------------------

    async def is_paired(self, platform: str, user_id: str) -> bool:
        return bool(await self._call(lambda c: c.execute(
            "SELECT 1 FROM paired_users WHERE platform = ? AND user_id = ?", (platform, user_id)).fetchone()))

    async def pairing_code(self, platform: str, user_id: str, user_name: str, *, code: str,
                           ttl_s: float, max_pending: int) -> str | None:
        def op(c: sqlite3.Connection) -> str | None:
            now = time.time()
            c.execute("DELETE FROM pairing_codes WHERE created_at < ?", (now - ttl_s,))
            row = c.execute("SELECT code FROM pairing_codes WHERE platform = ? AND user_id = ?",
                            (platform, user_id)).fetchone()
            if row:
                return str(row[0])
            pending = c.execute("SELECT count(*) FROM pairing_codes WHERE platform = ?", (platform,)).fetchone()[0]
            if pending >= max_pending:
                return None
            c.execute("INSERT INTO pairing_codes VALUES (?, ?, ?, ?, ?)", (code, platform, user_id, user_name, now))
            return code

        return await self._call(op)

    async def approve_pairing(self, code: str, *, ttl_s: float) -> tuple[str, str, str] | None:
        def op(c: sqlite3.Connection) -> tuple[str, str, str] | None:
            row = c.execute("SELECT platform, user_id, user_name FROM pairing_codes WHERE code = ? AND created_at >= ?",
                            (code, time.time() - ttl_s)).fetchone()
            c.execute("DELETE FROM pairing_codes WHERE code = ?", (code,))
            if row is None:
                return None
            c.execute("INSERT OR REPLACE INTO paired_users VALUES (?, ?, ?, ?)", (*row, time.time()))
            return (str(row[0]), str(row[1]), str(row[2]))

        return await self._call(op)

    async def pairing_state(self) -> tuple[list[tuple[str, str, str, str, float]], list[tuple[str, str, str]]]:
        """(pending codes, paired users) for `switchboard pairing list`."""
        def op(c: sqlite3.Connection) -> tuple[list[tuple[str, str, str, str, float]], list[tuple[str, str, str]]]:
            return (c.execute("SELECT code, platform, user_id, user_name, created_at FROM pairing_codes").fetchall(),
                    c.execute("SELECT platform, user_id, user_name FROM paired_users").fetchall())

        return await self._call(op)

    def _prune(self, c: sqlite3.Connection) -> int:
        """Forget finished inbound rows past the dedup window (transcripts are kept), `PRUNE_SLICE`
        at most; how many went. The condition matches the partial index `inbound_finished`."""
        return c.execute(f"DELETE FROM inbound WHERE id IN (SELECT id FROM inbound WHERE status NOT IN"
                         f" {OPEN_STATUSES!r} AND received_at < ? LIMIT {PRUNE_SLICE})",
                         (time.time() - self.dedup_ttl_s,)).rowcount

    def _prune_all(self, c: sqlite3.Connection) -> None:
        while self._prune(c) >= PRUNE_SLICE:
            pass

    def _prune_slice(self, conn: sqlite3.Connection) -> bool:
        """One slice of the periodic prune, in a transaction of its own; True if more is due."""
        try:
            conn.execute("BEGIN IMMEDIATE")
            deleted = self._prune(conn)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            _rollback(conn)
            log.warning("pruning old inbound records failed: %s", exc)
            return False
        return deleted >= PRUNE_SLICE


_Row = tuple[str, int, str, str, str | None, str | None, str | None, str | None, float]


def _row(session_key: str, conversation: int, m: ChatMessage) -> _Row:
    return (session_key, conversation, m.role, m.content, m.tool_calls_json(), m.tool_call_id,
            m.interrupted_by, m.reason, m.created_at)


def _add_rows(c: sqlite3.Connection, session_key: str, conversation: int, values: list[_Row], now: float) -> None:
    """Rows added to a session's conversation (the session made if new, its last write noted)."""
    c.execute("INSERT INTO sessions (key, conversation, created_at, updated_at) VALUES (?, ?, ?, ?)"
              " ON CONFLICT (key) DO UPDATE SET updated_at = excluded.updated_at",
              (session_key, conversation, now, now))
    c.executemany(
        "INSERT INTO messages (session_key, conversation, role, content, tool_calls, tool_call_id,"
        " interrupted_by, reason, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", values)


def _run_group(conn: sqlite3.Connection, ops: list[tuple[Op, asyncio.Future[Any]]]) -> list[_Result]:
    """Every operation in one transaction (one commit for the group). If any of them fails, the
    group is rolled back and each runs again in a transaction of its own, so a failing write
    fails alone and the others still land."""
    if len(ops) > 1:
        try:
            conn.execute("BEGIN IMMEDIATE")
            results: list[_Result] = [(fut, op(conn), None) for op, fut in ops]
            conn.execute("COMMIT")
            return results
        except Exception:  # told apart below, one operation at a time
            _rollback(conn)
    return [_run_alone(conn, op, fut) for op, fut in ops]


def _run_alone(conn: sqlite3.Connection, op: Op, fut: asyncio.Future[Any]) -> _Result:
    try:
        conn.execute("BEGIN IMMEDIATE")
        value = op(conn)
        conn.execute("COMMIT")
        return fut, value, None
    except Exception as exc:
        _rollback(conn)
        if isinstance(exc, sqlite3.OperationalError) and exc.sqlite_errorcode == sqlite3.SQLITE_FULL:
            return fut, None, DiskFull(str(exc))  # logged once per outage by the store
        if isinstance(exc, sqlite3.OperationalError):  # the database itself (locked, gone), not this write
            log.error("store write failed: %s", exc)
        return fut, None, StoreError(str(exc))


def _probe_write(conn: sqlite3.Connection) -> None:
    """A write that needs room (a page's worth), undone at once: does the disk take writes again?"""
    conn.execute("CREATE TABLE IF NOT EXISTS space_probe (data BLOB)")
    conn.execute("INSERT INTO space_probe VALUES (zeroblob(8192))")
    conn.execute("DELETE FROM space_probe")


def _rollback(conn: sqlite3.Connection) -> None:
    """Undo the open transaction, if SQLite has not already (a failed rollback must not end the writer)."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.error("store rollback failed: %s", exc)


def _settle(results: list[_Result]) -> None:
    for fut, value, exc in results:
        if fut.done():  # the awaiting task was cancelled; the write still happened
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
