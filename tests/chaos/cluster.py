"""The system under test: one redis-server (append-only file, so a restart keeps the data), the
fake provider and the fake Telegram Bot API in this process, and N worker processes taking
Telegram updates by webhook and serving the HTTP API.

Each worker process is an *incarnation* ("w2.1"; restarted with the same worker id: "w2.2") and
talks to both fakes under its own path prefix, so every provider request and every Telegram call
is recorded with the incarnation that made it. Only processes started here are ever signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.chaos.lease_log import LeaseMonitor
from tests.chaos.records import END, Incarnation, answer_tag, message_tag
from tests.fakes.openai_provider import Connection, FakeProvider, Script
from tests.fakes.telegram_api import FakeTelegramAPI
from tests.support.disk import fill, mount_tmpfs, unmount
from tests.support.pg_server import PgServer
from tests.support.redis_server import RedisServer
from tests.support.spawn import Group
from tests.support.workers import Worker

WEBHOOK_PATH = "/telegram/webhook"
SECRET = "chaos-hook-secret"
THINK_P, THINK_S = 0.2, (0.8, 2.0)  # some answers start after a pause (the worker sends "typing" meanwhile)
TOOL_P, TOOL_S = 0.15, (2.0, 4.0)  # some turns first run a shell tool (a process group of the worker)
DISK_SIZE = "64m"  # the database's disk (small_disk): room for a run's history, filled by `disk_full`


# A standby worker process: the slow imports done ahead, then it waits for "go" on stdin and runs
# `python -m gateway run` unchanged. A restart then takes as long as the daemon's own start-up (under
# a second), not the interpreter's (seconds, on a loaded machine), so a restart with the same worker
# id happens while its previous life's leases are still alive, as it would in production.
STANDBY = """
import sys
import aiohttp, prometheus_client, redis.asyncio, telegram  # noqa
if sys.stdin.readline().strip() != "go":
    sys.exit(0)
import runpy
sys.argv = ["gateway", "run"]
runpy.run_module("gateway", run_name="__main__", alter_sys=True)
"""


class WorkerProcess(Worker):
    """tests.support.workers.Worker, started from a standby process (see STANDBY)."""

    def prepare(self) -> None:
        if self.proc is None:
            self.proc = Group([sys.executable, "-c", STANDBY], env=self.env, stdin=subprocess.PIPE, log=self.log)

    async def start(self) -> Worker:
        self.prepare()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        except OSError:
            pass  # it died already: reported below
        await self.until_ready()  # (ends the process if it fails)
        return self


def process_alive(pid: int) -> bool:
    """Is `pid` a running (not zombie) process?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class ChaosCluster:
    def __init__(self, tmp: Path, *, seed: int = 0, workers: int = 3, ttl_s: float = 3.0, words: int = 36,
                 delay_s: float = 0.09, edit_interval_s: float = 0.3, tools: bool = True,
                 store: str = "redis", small_disk: bool = False) -> None:
        self.tmp = tmp
        # History in PostgreSQL (coordination stays in Redis), or everything in Redis.
        self.pg = PgServer() if store == "postgres" else None
        self.pg_url: str | None = None
        # With `small_disk`, the history's database lives on a tmpfs of its own that `fill_disk`
        # fills (PostgreSQL's own log stays on the server's data disk, as on a separate WAL volume).
        self.disk: Path | None = self.pg.dir / "small-disk" if small_disk and self.pg is not None else None
        self.filler: Path | None = None
        self.seed = seed
        self.tools = tools
        self.tool_dir = tmp / "tools"  # <incarnation>.pids: the pid of every tool process (and child) it started
        self.ttl_s = ttl_s
        self.edit_interval_s = edit_interval_s
        self.redis = RedisServer(tmp / "redis", persistence=True)
        self.provider = FakeProvider(delay_s=delay_s, words=words)
        self.telegram = FakeTelegramAPI()
        self.worker_ids = [f"w{i + 1}" for i in range(workers)]
        self.incarnations: dict[str, Incarnation] = {}
        self.current: dict[str, tuple[Worker, Incarnation]] = {}
        self.errors: list[str] = []
        self.background: list[asyncio.Task[None]] = []  # checks still running (see faults._orphans)
        self._processes: list[Worker] = []
        self._standby: dict[str, tuple[WorkerProcess, str]] = {}
        self._generation: dict[str, int] = {}
        self._numbers: dict[int, int] = {}  # id(connection) -> stream number
        self.tool_streams: set[int] = set()  # streams answered with a tool call
        self.lease_monitor: LeaseMonitor | None = None

    @property
    def answer_s(self) -> float:
        """How long one whole turn may take: thinking, a tool, streaming, the last edit."""
        tool = TOOL_S[1] + 0.3 if self.tools else 0.0
        return THINK_S[1] + tool + (self.provider.words + 1) * self.provider.delay_s + self.edit_interval_s + 0.2

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self.redis.start)
        # Every lease write Redis runs, from now on (it reconnects by itself after a Redis restart).
        self.lease_monitor = LeaseMonitor(self.redis.port, self.tmp / "leases.monitor")
        self.lease_monitor.start()
        if self.pg is not None:
            await asyncio.to_thread(self.pg.start)
            self.pg_url = await asyncio.to_thread(self._database, self.pg)
        await self.provider.start()
        self.provider.text_for = self._answer
        self.provider.script_for = self._script
        self.tool_dir.mkdir(parents=True, exist_ok=True)
        await self.telegram.start()
        # Every start runs to its end (a failed one ends its process) before a failure is raised.
        started = await asyncio.gather(*(self.spawn(w) for w in self.worker_ids), return_exceptions=True)
        for result in started:
            if isinstance(result, BaseException):
                raise result

    async def close(self) -> None:
        if self.lease_monitor is not None:
            self.lease_monitor.stop()
        for worker in self._processes:  # every process started here, standbys included
            worker.end()  # SIGKILL to its process group (ends a stopped one too)
        now = time.monotonic()
        for inc in self.incarnations.values():
            self._cont(inc, now)
            if inc.ended_at is None:
                inc.ended_at = now
        for pid in self.tool_pids():  # tools our workers started and left behind (see faults.run_one)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            await self.telegram.stop()
            await self.provider.stop()
        finally:  # the servers' processes end even if a fake failed to stop
            try:
                await asyncio.to_thread(self.redis.stop)
            finally:
                if self.pg is not None:
                    if self.disk is not None:  # stopped first: its tablespace is on the small disk
                        await asyncio.to_thread(self.pg.stop)
                        unmount(self.disk)  # then `destroy` deletes the whole directory, mount point too
                    await asyncio.to_thread(self.pg.destroy)

    def _database(self, pg: PgServer) -> str:
        if self.disk is None:
            return pg.create_database("chaos")
        owner = (pg.user.pw_uid, pg.user.pw_gid) if pg.user is not None else None
        mount_tmpfs(self.disk, size=DISK_SIZE, owner=owner)
        return pg.create_database_in("chaos", self.disk / "pg")

    def fill_disk(self) -> None:
        """The database's disk full: every free byte taken (until `empty_disk`)."""
        assert self.disk is not None, "the cluster has no small disk (small_disk=False)"
        self.filler = fill(self.disk)

    def empty_disk(self) -> None:
        filler, self.filler = self.filler, None
        if filler is not None:
            filler.unlink(missing_ok=True)

    def _process(self, worker_id: str) -> tuple[WorkerProcess, str]:
        """The next incarnation of `worker_id`, not started yet."""
        n = self._generation[worker_id] = self._generation.get(worker_id, 0) + 1
        name = f"{worker_id}.{n}"
        env = {
            "SWITCHBOARD_TELEGRAM__TOKEN": self.telegram.token,
            "SWITCHBOARD_TELEGRAM__BASE_URL": self.telegram.base_url_via(name),
            "SWITCHBOARD_TELEGRAM__BASE_FILE_URL": self.telegram.base_file_url,
            "SWITCHBOARD_TELEGRAM__ACCESS": "open",
            "SWITCHBOARD_TELEGRAM__GROUPS": "all",
            "SWITCHBOARD_TELEGRAM__EDIT_INTERVAL_S": str(self.edit_interval_s),
            "SWITCHBOARD_TELEGRAM__MODE": "webhook",
            "SWITCHBOARD_TELEGRAM__WEBHOOK_URL": "https://example.test/tg",
            "SWITCHBOARD_TELEGRAM__WEBHOOK_PATH": WEBHOOK_PATH,
            "SWITCHBOARD_TELEGRAM__SECRET_TOKEN": SECRET,
            "SWITCHBOARD_TOOLS__SHELL": "true" if self.tools else "false",
            "SWITCHBOARD_TOOLS__SANDBOX": "off",  # the checker follows tools by the PIDs they write to its files
            "SWITCHBOARD_TOOLS__TOOL_KILL_GRACE_S": "0.5",
        }
        if self.pg_url is not None:
            env["SWITCHBOARD_STORE__URL"] = self.pg_url
        worker = WorkerProcess(worker_id, self.redis.url, f"http://127.0.0.1:{self.provider.port}/{name}/v1",
                               self.tmp, ttl_s=self.ttl_s, **env)
        self._processes.append(worker)
        return worker, name

    async def spawn(self, worker_id: str) -> Incarnation:
        """Start the next process for `worker_id` (from its standby: see WorkerProcess) and wait
        until it is ready; then prepare the standby for the one after."""
        standby = self._standby.pop(worker_id, None)
        worker, name = standby if standby is not None else self._process(worker_id)
        inc = Incarnation(name, worker_id, pid=0, started_at=time.monotonic(), url=worker.url)
        self.incarnations[name] = inc
        self.current[worker_id] = (worker, inc)
        try:
            await worker.start()
        except AssertionError as exc:
            self.errors.append(f"{name} did not start: {str(exc)[:300]}")
            worker.end()
            inc.ended_at = time.monotonic()
            raise
        finally:
            if worker.proc is not None:
                inc.pid = worker.proc.pid
        inc.ready_at = time.monotonic()
        self._standby[worker_id] = self._process(worker_id)
        self._standby[worker_id][0].prepare()
        return inc

    def crashed(self) -> dict[str, int]:
        """Incarnations whose process ended although nobody here killed it: name -> exit status."""
        out = {}
        for worker, inc in self.current.values():
            code = worker.proc.poll() if worker.proc is not None else None
            if code is not None and inc.ended_at is None:
                out[inc.name] = code
        return out

    def live(self) -> list[tuple[Worker, Incarnation]]:
        """Workers whose current process has not been killed (a stopped one counts: a client
        cannot tell it from a slow one)."""
        return [(w, inc) for w, inc in self.current.values() if inc.ended_at is None]

    def kill(self, worker_id: str) -> Incarnation:
        worker, inc = self.current[worker_id]
        at = time.monotonic()  # before the signal: its connections close after this
        worker.kill()  # SIGKILL; also ends a stopped process
        inc.ended_at = at
        self._cont(inc, at)
        return inc

    def pause(self, worker_id: str) -> Incarnation:
        worker, inc = self.current[worker_id]
        worker.signal(signal.SIGSTOP)
        inc.stopped.append((time.monotonic(), None))
        return inc

    def resume(self, worker_id: str) -> Incarnation:
        worker, inc = self.current[worker_id]
        if worker.proc is not None and worker.proc.poll() is None:
            worker.signal(signal.SIGCONT)
        self._cont(inc, time.monotonic())
        return inc

    async def heal(self) -> None:
        """After the faults: every worker running again (stopped ones continued, dead ones
        restarted), Redis up."""
        for worker_id, (_worker, inc) in list(self.current.items()):
            if inc.stopped and inc.stopped[-1][1] is None:
                self.resume(worker_id)
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            await asyncio.to_thread(self.redis.start)
        if self.pg is not None and not self.pg.running():
            await asyncio.to_thread(self.pg.start)
        self.empty_disk()
        for worker, inc in self.current.values():
            if worker.proc is not None and worker.proc.poll() is not None and inc.ended_at is None:
                inc.ended_at = time.monotonic()  # it died by itself (see crashed())
        for worker_id, (_worker, inc) in list(self.current.items()):
            if inc.ended_at is not None:
                with contextlib.suppress(AssertionError):
                    await self.spawn(worker_id)

    @staticmethod
    def _cont(inc: Incarnation, at: float) -> None:
        if inc.stopped and inc.stopped[-1][1] is None:
            inc.stopped[-1] = (inc.stopped[-1][0], at)

    def owner_at(self, session: str, at: float) -> str | None:
        """The incarnation that last started a stream for `session` before `at`."""
        owner = None
        for conn in self.provider.connections:
            if conn.opened_at > at:
                break
            users = [m for m in conn.body.get("messages", []) if m.get("role") == "user"]
            tags = [t for m in users if (t := message_tag(str(m.get("content")))) is not None]
            if tags and tags[-1].split()[0] == session:
                owner = conn.via
        return owner

    def owned_by(self, incarnation: str, at: float) -> list[str]:
        """Sessions whose last stream before `at` was started by `incarnation`."""
        owner: dict[str, str | None] = {}
        for conn in self.provider.connections:
            if conn.opened_at > at:
                break
            users = [m for m in conn.body.get("messages", []) if m.get("role") == "user"]
            tags = [t for m in users if (t := message_tag(str(m.get("content")))) is not None]
            if tags:
                owner[tags[-1].split()[0]] = conn.via
        return sorted(s for s, via in owner.items() if via == incarnation)

    def tool_pids(self, incarnation: str | None = None) -> list[int]:
        """Tool processes still running that `incarnation` (default: any) started."""
        files = [self.tool_dir / f"{incarnation}.pids"] if incarnation else list(self.tool_dir.glob("*.pids"))
        pids: set[int] = set()
        for path in files:
            with contextlib.suppress(OSError):
                pids.update(int(word) for word in path.read_text().split() if word.isdigit())
        return sorted(p for p in pids if process_alive(p))

    # --- the provider's answers -----------------------------------------------------------

    def _script(self, conn: Connection) -> Script:
        """Per request, from the seed and the stream number: think first? run a tool first?"""
        rng = random.Random(f"{self.seed}:c{self.stream_number(conn)}")
        messages = conn.body.get("messages", [])
        after_tool = bool(messages) and messages[-1].get("role") == "tool"
        if self.tools and not after_tool and rng.random() < TOOL_P:
            pids = self.tool_dir / f"{conn.via}.pids"
            number = self.stream_number(conn)
            end = self.tool_dir / f"c{number}.end"  # when the tool ended, ran out or stopped (TERM): evidence
            # The shell and its child both: a tool's whole group must go with its worker.
            command = (f"echo $$ >> {pids}; trap 'date +%s.%N >> {end}; exit 143' TERM HUP; "
                       f"sleep {rng.uniform(*TOOL_S):.1f} & echo $! >> {pids}; wait $!; date +%s.%N >> {end}")
            self.tool_streams.add(number)
            return Script(tool_calls=[("shell", {"command": command})])
        return Script(think_s=rng.uniform(*THINK_S) if rng.random() < THINK_P else 0.0)

    def tool_ended_at(self, number: int) -> float | None:
        """When stream `number`'s tool process ended (time.monotonic), if it lived to say so (not
        when it was SIGKILLed)."""
        with contextlib.suppress(OSError, ValueError):
            wall = float((self.tool_dir / f"c{number}.end").read_text().split()[0])
            return wall - (time.time() - time.monotonic())
        return None

    def stream_number(self, conn: Connection) -> int:
        number = self._numbers.get(id(conn))
        if number is None:
            number = next(i for i, c in enumerate(self.provider.connections, 1) if c is conn)
            self._numbers[id(conn)] = number
        return number

    def _answer(self, conn: Connection) -> str:
        """"[g03_m2_c17] w0 w1 … END": the message it answers, the stream, a recognisable end."""
        tag = None
        for m in reversed(conn.body.get("messages", [])):
            if m.get("role") == "user" and (tag := message_tag(str(m.get("content")))):
                break
        words = " ".join(f"w{i}" for i in range(self.provider.words))
        return f"{answer_tag(tag or 'untagged', self.stream_number(conn))} {words} {END}"

    # --- logs -------------------------------------------------------------------------------

    def log_errors(self) -> dict[str, str]:
        """Per worker id: how many error lines its log has, and the first few distinct ones."""
        out: dict[str, str] = {}
        for worker_id in self.worker_ids:
            path = self.tmp / f"{worker_id}.log"
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            errors: list[str] = []
            for line in lines:
                try:
                    entry = json.loads(line)
                except ValueError:
                    if line.startswith("Traceback"):
                        errors.append("traceback on stderr")
                    continue
                if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
                    errors.append(str(entry.get("msg", ""))[:120])
            if errors:
                distinct = list(dict.fromkeys(errors))
                out[worker_id] = f"{len(errors)} error line(s): " + " | ".join(distinct[:4])
        return out
