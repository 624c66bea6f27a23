"""The suite's own check (tests/support/leaks.py): a test that leaves a process running fails, and
so does a run that ends with one; the process is killed either way. Proved on small pytest runs in
subprocesses, each in a directory of its own with nothing but the plugin."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.procs import argv, stat

ROOT = Path(__file__).resolve().parent.parent

INNER = '''
import os
import subprocess
import time
from pathlib import Path

import pytest

PIDS = Path(os.environ["LEAK_CHECK_PIDS"])


def note(name, proc):
    with PIDS.open("a") as out:
        out.write(f"{name} {proc.pid}\\n")


def test_leaves_a_sleep_running():
    note("test", subprocess.Popen(["sleep", "60"]))


@pytest.fixture(scope="session")
def session_sleep():
    proc = subprocess.Popen(["sleep", "61"])
    note("session", proc)
    yield proc  # and never ended


def test_uses_a_session_fixtures_process(session_sleep):
    assert session_sleep.poll() is None


def test_ends_what_it_starts_and_leaves_a_zombie():
    proc = subprocess.Popen(["sleep", "60"])
    proc.kill()
    proc.wait()
    zombie = subprocess.Popen(["true"])  # exits; never reaped by the test: not running
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    note("zombie", zombie)
'''


def _run(tmp_path: Path, *select: str) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the rootdir: not this repository's configuration
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    pids = tmp_path / "pids"
    pids.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LEAK_CHECK_PIDS": str(pids), "SWITCHBOARD_TEST_LEAK_GRACE_S": "0.5"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.leaks", "-p", "no:cacheprovider",
                           "-q", "test_inner.py", *select], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=90)
    lines = pids.read_text().splitlines() if pids.exists() else []
    return done, {name: int(pid) for name, pid in (line.split() for line in lines)}


def _running_sleep(pid: int) -> bool:
    """Is `pid` a running `sleep` (not a zombie, not a reused PID running something else)?"""
    p = stat(pid)
    return p is not None and p.state != "Z" and argv(pid)[:1] == ["sleep"]


def _kill_if_running(pids: dict[str, int]) -> None:
    for pid in pids.values():
        if _running_sleep(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_leaked_child_fails_its_test_and_a_leftover_fails_the_run_and_both_are_killed(tmp_path: Path) -> None:
    done, pids = _run(tmp_path)
    try:
        out = done.stdout + done.stderr
        assert done.returncode != 0, out
        assert set(pids) == {"test", "session", "zombie"}, out
        # The test that left `sleep 60` running fails (in its teardown), naming the process...
        assert "ERROR at teardown of test_leaves_a_sleep_running" in out, out
        assert f"pid {pids['test']} " in out and "sleep 60" in out, out
        # ...the session fixture's process is not blamed on the test that set it up, nor a zombie...
        assert "ERROR at teardown of test_uses_a_session_fixtures_process" not in out, out
        assert "ERROR at teardown of test_ends_what_it_starts_and_leaves_a_zombie" not in out, out
        assert "3 passed, 1 error" in out, out
        # ...but it is still running at the end of the session: the run fails, naming it.
        assert "processes left running" in out and f"pid {pids['session']} " in out and "sleep 61" in out, out
        assert f"pid {pids['zombie']} " not in out, out
        # And nothing outlived the run.
        assert not _running_sleep(pids["test"]) and not _running_sleep(pids["session"])
    finally:
        _kill_if_running(pids)


def test_a_run_that_leaves_nothing_behind_passes(tmp_path: Path) -> None:
    done, pids = _run(tmp_path, "-k", "zombie")
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "processes left running" not in done.stdout
    finally:
        _kill_if_running(pids)
