"""sd_notify over a real AF_UNIX datagram socket (a path and an abstract name), and the loop-health watchdog."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.ops.sdnotify import Notifier, Watchdog, monotonic_usec, socket_address, watchdog_interval
from tests.fakes.notify_socket import FakeSystemd
from tests.support.procs import until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def path_systemd() -> Iterator[FakeSystemd]:
    # AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer than that.
    with tempfile.TemporaryDirectory(prefix="sbn-", dir="/tmp") as d:
        fake = FakeSystemd(os.path.join(d, "notify"))
        yield fake
        fake.close()


@pytest.fixture
def abstract_systemd() -> Iterator[FakeSystemd]:
    fake = FakeSystemd(f"@switchboard-test/{uuid.uuid4().hex}")
    yield fake
    fake.close()


@pytest.fixture(params=["path_systemd", "abstract_systemd"])
def fake_systemd(request: pytest.FixtureRequest) -> FakeSystemd:
    fake: FakeSystemd = request.getfixturevalue(request.param)
    return fake


def test_socket_address_forms() -> None:
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@sd/notify") == "\0sd/notify"
    assert socket_address("@") is None
    assert socket_address("vsock:2:1234") is None
    assert socket_address("relative/path") is None


def test_without_notify_socket_everything_is_a_quiet_no_op() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.ready("up") is False
    assert n.status("x") is False
    assert n.watchdog_ping() is False
    assert n.watchdog_interval() is None
    n.close()


def test_messages_reach_the_socket(fake_systemd: FakeSystemd) -> None:
    n = Notifier(fake_systemd.notify_socket)
    before = monotonic_usec()
    assert n.status("starting: store open")
    assert n.ready("ready: webchat")
    assert n.watchdog_ping()
    assert n.reloading("reloading config")
    assert n.ready()
    assert n.stopping("stopping: draining 2 turns")
    assert n.extend_timeout(5)
    after = monotonic_usec()
    n.close()
    got = fake_systemd.wait_for(7)
    assert got[:3] == ["STATUS=starting: store open", "READY=1\nSTATUS=ready: webchat", "WATCHDOG=1"]
    reload_lines = got[3].split("\n")
    assert reload_lines[0] == "RELOADING=1"
    assert reload_lines[1].startswith("MONOTONIC_USEC=")
    assert before <= int(reload_lines[1].split("=", 1)[1]) <= after  # CLOCK_MONOTONIC, in µs
    assert reload_lines[2] == "STATUS=reloading config"
    assert got[4:] == ["READY=1", "STOPPING=1\nSTATUS=stopping: draining 2 turns", "EXTEND_TIMEOUT_USEC=5000000"]


def test_status_stays_on_one_line(path_systemd: FakeSystemd) -> None:
    n = Notifier(path_systemd.notify_socket)
    n.status("telegram:\n  connecting\n  (retry 2)")
    assert path_systemd.wait_for(1) == ["STATUS=telegram: connecting (retry 2)"]
    n.close()


def test_monotonic_usec_is_clock_monotonic() -> None:
    assert abs(monotonic_usec() - time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6) < 1e5


def test_from_env_takes_the_variables_away_from_child_processes(path_systemd: FakeSystemd) -> None:
    env = {"NOTIFY_SOCKET": path_systemd.notify_socket, "WATCHDOG_USEC": "30000000",
           "WATCHDOG_PID": str(os.getpid()), "PATH": "/bin"}
    n = Notifier.from_env(env)
    assert env == {"PATH": "/bin"}
    assert n.enabled and n.watchdog_interval() == 30.0
    kept = {"NOTIFY_SOCKET": path_systemd.notify_socket}
    Notifier.from_env(kept, unset=False)
    assert kept == {"NOTIFY_SOCKET": path_systemd.notify_socket}


def test_watchdog_interval_checks_the_pid() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval({}) is None


def test_send_failures_do_not_raise(tmp_path: Path) -> None:
    n = Notifier(str(tmp_path / "nobody-listens"))
    assert n.enabled
    assert n.ready() is False
    regular = tmp_path / "file"
    regular.write_text("")
    assert Notifier(str(regular)).ready() is False


def test_sends_never_block_when_systemd_is_not_reading() -> None:
    with tempfile.TemporaryDirectory(prefix="sbn-", dir="/tmp") as d:
        path = os.path.join(d, "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as deaf:
            deaf.bind(path)
            n = Notifier(path)
            start = time.monotonic()
            results = [n.status(f"update {i}") for i in range(5000)]
            assert time.monotonic() - start < 5
            assert results[0] is True and results[-1] is False  # the queue filled up: dropped, not blocked
            n.close()


async def test_watchdog_pings_at_half_the_interval(path_systemd: FakeSystemd) -> None:
    # max_lag is generous: this is about the period, not about a busy machine starving the loop
    dog = Watchdog(Notifier(path_systemd.notify_socket), interval=0.2, max_lag=30.0)
    assert dog.period == pytest.approx(0.1)
    dog.start()
    await until(lambda: len(path_systemd.ping_times()) >= 5, 30, "five watchdog pings")
    await dog.stop()
    assert not dog.active
    pings = path_systemd.ping_times()
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    # a ping every period (0.1 s), not every heartbeat tick (0.025 s); the margin absorbs the
    # receiving thread's jitter on a busy machine
    assert min(gaps) >= 0.05, gaps
    assert dog.skipped == 0


async def test_watchdog_takes_its_interval_from_the_environment(path_systemd: FakeSystemd) -> None:
    n = Notifier(path_systemd.notify_socket, watchdog_usec="200000")
    dog = Watchdog(n)
    assert dog.interval == pytest.approx(0.2)
    dog.start()
    await asyncio.sleep(0.3)
    await dog.stop()
    assert len(path_systemd.ping_times()) >= 2


async def test_no_watchdog_no_task(path_systemd: FakeSystemd) -> None:
    dog = Watchdog(Notifier(path_systemd.notify_socket))  # no WATCHDOG_USEC
    dog.start()
    assert not dog.active
    await dog.stop()
    dog = Watchdog(Notifier(None), interval=1.0)
    dog.start()
    assert not dog.active


async def test_a_blocked_loop_gets_no_watchdog_pings(path_systemd: FakeSystemd) -> None:
    interval = 0.4
    dog = Watchdog(Notifier(path_systemd.notify_socket), interval=interval)
    dog.start()
    await asyncio.sleep(0.5)
    assert len(path_systemd.ping_times()) >= 2  # healthy: pinging

    block_start = time.monotonic()
    time.sleep(interval * 2.5)  # the loop thread is stuck longer than WatchdogSec
    block_end = time.monotonic()
    await asyncio.sleep(interval * 2)
    await dog.stop()

    pings = path_systemd.ping_times()
    during = [t for t in pings if block_start <= t <= block_end]
    assert during == []
    # Nor right after it: the loop has to stay healthy for a whole ping period before pings resume,
    # so systemd sees a gap of more than the watchdog interval.
    before = [t for t in pings if t < block_start]
    after = [t for t in pings if t > block_end]
    assert after, "pings resume once the loop is healthy again"
    assert after[0] - block_end >= dog.period * 0.9
    assert after[0] - before[-1] > interval
    assert dog.skipped >= 1
    assert dog.worst_lag >= interval * 2


async def test_a_starved_loop_gets_no_watchdog_pings(path_systemd: FakeSystemd) -> None:
    """Short, frequent stalls: the loop still runs the ping task now and then, but never on time."""
    interval = 0.4
    dog = Watchdog(Notifier(path_systemd.notify_socket), interval=interval)
    dog.start()
    await asyncio.sleep(0.3)
    start = time.monotonic()
    while time.monotonic() - start < 1.2:
        time.sleep(0.15)  # each stall is longer than max_lag (interval / 4)
        await asyncio.sleep(0)
    end = time.monotonic()
    await dog.stop()
    assert [t for t in path_systemd.ping_times() if start + 0.05 < t <= end] == []
    assert dog.skipped >= 2


def test_a_real_process_notifies_through_the_environment(path_systemd: FakeSystemd) -> None:
    script = (
        "import asyncio\n"
        "from gateway.ops.sdnotify import Notifier, Watchdog\n"
        "async def main():\n"
        "    n = Notifier.from_env()\n"
        "    import os; assert 'NOTIFY_SOCKET' not in os.environ\n"
        "    dog = Watchdog(n)\n"
        "    n.ready('ready')\n"
        "    dog.start()\n"
        "    await asyncio.sleep(0.5)\n"
        "    n.stopping()\n"
        "    await dog.stop()\n"
        "asyncio.run(main())\n")
    env = {**os.environ, "NOTIFY_SOCKET": path_systemd.notify_socket, "WATCHDOG_USEC": "200000"}
    subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, check=True, timeout=30)
    got = path_systemd.wait_until_stopping()
    assert got[0] == "READY=1\nSTATUS=ready"
    assert got.count("WATCHDOG=1") >= 3
    assert got[-1] == "STOPPING=1"

    # WATCHDOG_PID names another process: this one must not ping.
    path_systemd.clear()
    env["WATCHDOG_PID"] = "1"
    subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, check=True, timeout=30)
    got = path_systemd.wait_until_stopping()
    assert got == ["READY=1\nSTATUS=ready", "STOPPING=1"]
