"""A real PostgreSQL server for tests: `initdb` into its own directory, `pg_ctl` on a free loopback
port, restartable on the same port and data. Never the machine's shared server.

PostgreSQL refuses to run as root, so when the tests run as root the server runs as the `postgres`
system user (else `nobody`), with a data directory it owns under the system temp dir (pytest's
temp dirs are private to root, and a Unix socket path must stay short).

Tests that need PostgreSQL must never be skipped silently: if the binaries are missing they are
installed (when running as root) or the test fails with a message that says how to get them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.support.procs import argv, children
from tests.support.spawn import READY_DEADLINE_S


class PgServerMissing(RuntimeError):
    """No initdb/pg_ctl, and they could not be installed."""


def _bindir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres: PATH first, then Debian's versioned dirs."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    return next((Path(p) for p in versions if os.access(f"{p}/pg_ctl", os.X_OK)), None)


def pg_bindir() -> Path:
    """Where the server binaries are, installing Debian's `postgresql` when we are root and they are missing."""
    if found := _bindir():
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"]
        if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
            subprocess.run(install, env=env, capture_output=True, timeout=900)
        if found := _bindir():
            return found
    raise PgServerMissing(
        "the PostgreSQL tests need the server binaries `initdb` and `pg_ctl` (PostgreSQL >= 13) and they "
        "could not be installed: run `apt-get install -y postgresql` (or `brew install postgresql`) and "
        "run the tests again")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _server_user() -> pwd.struct_passwd | None:
    """Who the server runs as: ourselves, unless we are root (which PostgreSQL refuses)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PgServerMissing("running as root, and neither a `postgres` nor a `nobody` user exists to run "
                          "PostgreSQL as (it refuses to run as root)")


class PgServer:
    """One PostgreSQL server. `start()` after `stop()`/`kill()` reuses the port and the data.

    `durable` keeps fsync on (benchmarks); tests turn it off: a killed server still keeps every
    committed transaction (its WAL is in the page cache; only an OS crash would lose it), which is
    what a restart test needs. `synchronous_commit` stays on either way.
    """

    def __init__(self, *, durable: bool = False, startup_timeout_s: float = READY_DEADLINE_S) -> None:
        self.durable = durable
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.user = _server_user()
        self.dir = Path(tempfile.mkdtemp(prefix="sb-pg-"))
        self._initialised = False

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def log_path(self) -> Path:
        return self.dir / "server.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [str(pg_bindir() / args[0]), *args[1:]]
        if self.user is not None:
            cmd = ["setpriv", f"--reuid={self.user.pw_uid}", f"--regid={self.user.pw_gid}", "--clear-groups", "--",
                   *cmd]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", HOME=str(self.dir))
        return subprocess.run(cmd, cwd=self.dir, env=env, capture_output=True, text=True, timeout=timeout)

    def _init(self) -> None:
        if self.user is not None:
            os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        done = self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                         "--locale=C", "--no-sync", "--no-instructions")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.strip() or done.stdout.strip()}")
        self._initialised = True

    def start(self) -> PgServer:
        """Start the server (`pg_ctl -w`: until it accepts connections). A start that fails ends
        whatever it started (a postmaster still starting up when pg_ctl gave up) before it raises."""
        if self.running():
            raise RuntimeError("postgres is already running")
        try:
            return self._start()
        except BaseException:
            self.kill()
            raise

    def _start(self) -> PgServer:
        if not self._initialised:
            self._init()
        fixed = self.port != 0
        deadline = time.monotonic() + self.startup_timeout_s
        attempt = 0
        while True:
            attempt += 1
            if not fixed:
                self.port = _free_port()
            opts = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=200"
                    " -c shared_buffers=64MB -c log_min_messages=warning")
            if not self.durable:
                opts += " -c fsync=off -c full_page_writes=off"
            left = max(1, int(deadline - time.monotonic()))
            done = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-w", "-t", str(left),
                             "-o", opts, "start", timeout=left + 10)
            if done.returncode == 0:
                return self
            self.kill()  # a postmaster pg_ctl stopped waiting for, if any
            # Another process may have taken the port between _free_port() and the bind; after a
            # kill, the old server's processes may still be letting go of its shared memory.
            if time.monotonic() > deadline or (not fixed and attempt >= 5):
                raise RuntimeError(f"postgres did not start on port {self.port}: {done.stdout.strip()}\n"
                                   f"log tail:\n{self._log_tail()}")
            time.sleep(0.2)

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        return self._initialised and pid is not None and _alive(pid)

    def stop(self) -> None:
        """Fast shutdown: sessions are ended, the server exits cleanly (killed if it has not
        within 60 s)."""
        if self.running():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop", timeout=70)
        if self.running():
            self.kill()

    def kill(self) -> None:
        """SIGKILL to the postmaster and every backend: what a crash looks like to clients."""
        pid = self.pid()
        if pid is None or not _alive(pid):
            return
        if str(self.data) not in " ".join(argv(pid)):  # a stale pid file, its PID since reused by another
            self._remove_stale_files()
            return
        pids = [pid, *(p.pid for p in children(pid))]  # its backends, by parent PID from /proc
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.02)
        # Nobody may have reaped the dead postmaster yet (it is not our child), and a zombie still
        # "exists" to the next server's check of the lock files: they are stale, remove them.
        self._remove_stale_files()

    def _remove_stale_files(self) -> None:
        for stale in (self.data / "postmaster.pid", self.dir / f".s.PGSQL.{self.port}.lock"):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()

    def destroy(self) -> None:
        """Stop the server and delete its directory."""
        try:
            self.stop()
        finally:
            if self.running():
                self.kill()
            shutil.rmtree(self.dir, ignore_errors=True)

    def execute(self, sql: str, database: str = "postgres") -> None:
        """Run one statement as the superuser (synchronous: usable from any fixture or thread)."""
        async def run() -> None:
            conn = await asyncpg.connect(self.url(database))
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, run()).result(timeout=60)

    def create_database(self, name: str) -> str:
        """A fresh, empty database; its URL."""
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def create_database_in(self, name: str, directory: Path) -> str:
        """A fresh, empty database kept in `directory` (a tablespace of its own there); its URL."""
        directory.mkdir(exist_ok=True)
        if self.user is not None:
            os.chown(directory, self.user.pw_uid, self.user.pw_gid)
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.execute(f'DROP TABLESPACE IF EXISTS "{name}_space"')
        self.execute(f"CREATE TABLESPACE \"{name}_space\" LOCATION '{directory}'")
        self.execute(f'CREATE DATABASE "{name}" TABLESPACE "{name}_space"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        if self.running():
            self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def pg_server_of_our_own(**kwargs: Any) -> Iterator[PgServer]:
    """A started `PgServer(**kwargs)`, destroyed on leaving, on every path (a failed start included).
    Fails the test (never skips it) when the binaries are missing and cannot be installed."""
    server: PgServer | None = None
    try:
        try:
            server = PgServer(**kwargs)
            server.start()
        except PgServerMissing as exc:
            pytest.fail(str(exc), pytrace=False)
        yield server
    finally:
        if server is not None:
            server.destroy()
