"""A pytest plugin: no test leaves a process running, and nothing outlives the run.

- **The test process adopts orphans.** At start-up the pytest process makes itself a child
  subreaper (Linux `PR_SET_CHILD_SUBREAPER`): a process whose parent dies (a daemonised
  postmaster, a worker's tool sentinel once the worker is killed) is re-parented to pytest instead
  of init, so it stays a descendant of the run, where the checks below find it by parent PID.
- **Per test.** An autouse fixture notes the descendants alive before the test (it is set up before
  every other function-scoped fixture, and torn down after them). After the test's teardown, any
  new descendant still running `GRACE_S` seconds later is a leak: it is reported with its command
  line, the test fails (an error in its teardown), and the process is killed (its process group,
  if it leads one). Processes started by fixtures wider than a test (session, package, module,
  class: a shared PostgreSQL) belong to that fixture, and so do their descendants; zombies (exited,
  not yet reaped) are not running.
- **At the end of the session**, after every fixture was torn down: any descendant still running
  `GRACE_S` seconds later fails the run (exit status 1), is listed, and is killed.

`SWITCHBOARD_TEST_LEAK_GRACE_S` overrides the grace period (the plugin's own tests shorten it).
Processes are found through /proc by parent PID only, never by name; a process is named by its PID
and start time, so a PID reused meanwhile is never signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Generator, Iterable
from typing import Any

import pytest

from tests.support.procs import Proc, argv, stat

GRACE_S = float(os.environ.get("SWITCHBOARD_TEST_LEAK_GRACE_S", "5"))
_PR_SET_CHILD_SUBREAPER = 36

Key = tuple[int, int]  # (pid, start time): one process for the life of the boot

_owned: set[Key] = set()  # started by fixtures wider than a test
_seen_elsewhere: set[Key] = set()  # descendants once seen under another parent: adopted if they become ours


def _key(p: Proc) -> Key:
    return (p.pid, p.start)


def _table() -> dict[int, Proc]:
    found: dict[int, Proc] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (p := stat(int(entry.name))) is not None:
                found[p.pid] = p
    return found


def descendants(table: dict[int, Proc] | None = None, root: int | None = None) -> list[Proc]:
    """Every process below `root` (default: this one) by parent PID, zombies included."""
    table = _table() if table is None else table
    root = os.getpid() if root is None else root
    below: dict[int, list[Proc]] = {}
    for p in table.values():
        below.setdefault(p.ppid, []).append(p)
    found, todo = [], [root]
    while todo:
        for child in below.get(todo.pop(), []):
            if child.pid != root:
                found.append(child)
                todo.append(child.pid)
    _seen_elsewhere.update(_key(p) for p in found if p.ppid != root and root == os.getpid())
    return found


def _running(p: Proc) -> bool:
    return p.state not in ("Z", "X")


def _exempt(p: Proc, table: dict[int, Proc], exempt: set[Key]) -> bool:
    """`p` or one of its ancestors (below this process) is in `exempt`."""
    me, q = os.getpid(), p
    for _ in range(len(table) + 1):  # (a bound: a table read mid-change could hold a cycle)
        if _key(q) in exempt:
            return True
        parent = table.get(q.ppid)
        if parent is None or parent.pid == me:
            return False
        q = parent
    return False


def _live(exempt: set[Key]) -> list[Proc]:
    table = _table()
    return [p for p in descendants(table) if _running(p) and not _exempt(p, table, exempt)]


def _wait_for_exit(exempt: set[Key], grace_s: float) -> list[Proc]:
    """The non-exempt running descendants left after up to `grace_s` seconds."""
    deadline = time.monotonic() + grace_s
    while True:
        left = _live(exempt)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def describe(procs: Iterable[Proc]) -> str:
    lines = []
    for p in procs:
        command = " ".join(argv(p.pid)) or "(command line unreadable)"
        lines.append(f"  pid {p.pid} (parent {p.ppid}, group {p.pgid}, state {p.state}): {command[:300]}")
    return "\n".join(lines)


def kill(procs: Iterable[Proc]) -> None:
    """SIGKILL each process (its whole group when it leads one other than ours), if it is still the
    same process (PID and start time), then wait a moment for them to go."""
    ours = os.getpgrp()
    procs = list(procs)
    for p in procs:
        now = stat(p.pid)
        if now is None or now.start != p.start:
            continue
        if p.pgid == p.pid and p.pgid != ours:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pgid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any((s := stat(p.pid)) is not None and s.start == p.start and _running(s)
                                              for p in procs):
        time.sleep(0.02)
    reap_adopted()


def reap_adopted() -> None:
    """Reap zombies that became our children by adoption (they were seen under another parent):
    nobody else waits for them. Our own children are left to whoever started them."""
    me = os.getpid()
    for key in list(_seen_elsewhere):
        now = stat(key[0])
        if now is None or now.start != key[1]:
            _seen_elsewhere.discard(key)
        elif now.ppid == me and now.state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(key[0], os.WNOHANG)
            _seen_elsewhere.discard(key)


def _become_subreaper() -> bool:
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


# --- the hooks ----------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    _become_subreaper()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any],
                         request: pytest.FixtureRequest) -> Generator[None, Any, Any]:
    """Processes a fixture wider than a test starts belong to it, not to the test that set it up."""
    if fixturedef.scope == "function":
        return (yield)
    before = {_key(p) for p in descendants()}
    try:
        return (yield)
    finally:
        _owned.update(_key(p) for p in descendants() if _key(p) not in before)


@pytest.fixture(autouse=True)
def _no_process_left_behind() -> Generator[None, None, None]:
    before = {_key(p) for p in descendants()}
    yield
    left = _wait_for_exit(before | _owned, GRACE_S)
    reap_adopted()
    if left:
        text = describe(left)
        kill(left)
        pytest.fail(f"the test left {len(left)} process(es) running {GRACE_S:g} s after its teardown "
                    f"(killed now):\n{text}", pytrace=False)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Generator[None, None, None]:
    """After every fixture's teardown (the innermost wrapper: the other implementations, which
    tear down what is left, have run; the terminal summary comes after this)."""
    result = yield
    left = _wait_for_exit(set(), GRACE_S)
    if left:
        text = (f"{len(left)} process(es) started by the tests still running at the end of the session "
                f"(killed now):\n{describe(left)}")
        kill(left)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_sep("=", "processes left running", red=True, bold=True)
            reporter.write_line(text)
        else:
            print(text, file=sys.stderr)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reap_adopted()
    return result
