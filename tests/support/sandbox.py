"""bubblewrap for the sandbox tests: Debian's `bubblewrap`, installed with apt-get when missing
(as root), as the browser tests get Chromium. Never a skip: without it, the tests that need it fail
saying how to get it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from gateway.agents.sandbox import bwrap_problem


def ensure_bwrap() -> None:
    """bwrap works here, installing the package first if it is missing; else the test fails."""
    if shutil.which("bwrap") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            pytest.fail("bubblewrap is missing and this is not a root Debian shell: run "
                        "`apt-get install -y bubblewrap` as root", pytrace=False)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "bubblewrap"]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, check=False)
            if done.returncode != 0:
                pytest.fail(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stderr[-2000:]}", pytrace=False)
        bwrap_problem.cache_clear()
    problem = bwrap_problem()
    if problem is not None:
        pytest.fail(f"the sandbox cannot work here: {problem}", pytrace=False)
