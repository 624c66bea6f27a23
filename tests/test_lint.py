"""The code base stays ruff- and mypy-clean; this is part of the test command on purpose."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


# mypy over the whole tree takes a minute on a quiet 2-core machine and several beside CPU hogs.
@pytest.mark.timeout(600)
def test_ruff_is_clean() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(600)
def test_mypy_is_clean() -> None:
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


MAX_METHODS = 25  # a class with more has more than one job: split it into owners it composes


def test_no_class_in_the_product_code_has_more_than_25_methods() -> None:
    import ast

    big = []
    for package in ("gateway", "platforms", "agent_cache"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
                    if len(methods) > MAX_METHODS:
                        big.append(f"{path.relative_to(ROOT)}: {node.name} has {len(methods)} methods")
    assert big == []
