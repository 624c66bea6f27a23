"""A real `redis-server` for tests: its own loopback port and directory, restartable on both.

Tests that need Redis must never be skipped silently: if the binary is missing it is installed
(when running as root) or the test fails with a message that says how to get it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.ports import free_port
from tests.support.spawn import READY_DEADLINE_S, Group

BINARY = "redis-server"


class RedisServerMissing(RuntimeError):
    """No redis-server binary, and it could not be installed."""


def _which() -> str | None:
    # sbin dirs are often missing from a non-root PATH
    return shutil.which(BINARY) or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server", "/usr/sbin/redis-server")
         if os.access(p, os.X_OK)), None)


def redis_server_binary() -> str:
    """The path of redis-server, installing it with apt when we are root and it is missing."""
    if found := _which():
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "redis-server"]
        if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
            subprocess.run(install, env=env, capture_output=True, timeout=600)
        if found := _which():
            return found
    raise RedisServerMissing(
        "the Redis tests need the `redis-server` binary (Redis >= 7) and it could not be installed: "
        "run `apt-get install -y redis-server` (or `brew install redis`) and run the tests again")


class RedisServer:
    """One redis-server process. `start()` after `stop()`/`kill()` reuses the port and the dir.

    `persistence` turns on an fsync-always append-only file (restart tests); otherwise nothing
    is written to disk. `cluster` runs a one-node Redis Cluster owning every slot: it refuses a
    command or script whose declared keys span slots (CROSSSLOT), as a real cluster would.
    """

    def __init__(self, directory: Path, *, persistence: bool = False, cluster: bool = False,
                 startup_timeout_s: float = READY_DEADLINE_S) -> None:
        self.dir = directory
        self.persistence = persistence
        self.cluster = cluster
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.proc: Group | None = None

    @property
    def url(self) -> str:
        if self.cluster:
            return f"redis+cluster://127.0.0.1:{self.port}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    def client(self) -> redis.Redis:
        """A synchronous client for test set-up and inspection (cluster: the one node), without
        redis-py's retries, which would hide a stopped server for seconds."""
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, socket_timeout=5,
                           retry=Retry(NoBackoff(), 0))

    def start(self) -> RedisServer:
        """Start the server and wait until it answers (a cluster node: until it owns every slot).
        A start that fails ends the process it started before it raises."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("redis-server is already running")
        binary = redis_server_binary()
        self.dir.mkdir(parents=True, exist_ok=True)
        fixed = self.port != 0
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            for _attempt in range(1 if fixed else 5):
                if not fixed:
                    self.port = free_port()
                self.proc = Group([binary, *self._args()], cwd=self.dir, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
                if self._wait_ready(deadline):
                    return self
                # Another process may have taken the port between free_port() and the bind.
                self._reap(signal.SIGKILL)
        except BaseException:
            self._reap(signal.SIGKILL)
            raise
        raise RuntimeError(f"redis-server did not start on port {self.port} within {self.startup_timeout_s:.0f} s; "
                           f"log tail:\n{self._log_tail()}")

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM): with persistence the append-only file is complete."""
        self._reap(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: what a crash looks like to clients."""
        self._reap(signal.SIGKILL)

    def forget(self) -> None:
        """Delete what a stopped server would load at its next start (its append-only files and
        any snapshot), so that it comes back empty: a restart without persistence."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("redis-server is running: stop or kill it first")
        shutil.rmtree(self.dir / "appendonlydir", ignore_errors=True)
        for stale in ("appendonly.aof", "dump.rdb"):
            (self.dir / stale).unlink(missing_ok=True)

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def _args(self) -> list[str]:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--logfile", str(self.log_path), "--daemonize", "no"]
        if self.persistence:
            args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        else:
            args += ["--save", "", "--appendonly", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        return args

    def _wait_ready(self, deadline: float) -> bool:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with self.client() as c:
                    if c.ping() and (not self.cluster or self._cluster_ready(c)):
                        return True
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                pass  # not listening yet, or still loading its data (LOADING)
            time.sleep(0.02)
        return False

    @staticmethod
    def _cluster_ready(c: redis.Redis) -> bool:
        if not c.execute_command("CLUSTER", "SLOTS"):  # first start: take every slot
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        return "cluster_state:ok" in str(c.execute_command("CLUSTER", "INFO"))

    def _reap(self, sig: signal.Signals) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        proc.end()  # whatever is left of its process group (a SIGTERM not acted on; a forked child)

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"
