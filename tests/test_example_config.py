"""deploy/switchboard.example.toml: valid, truthful about defaults, and complete."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

from gateway.ops.config import Config, load_config
from tests.conftest import console_script

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "deploy" / "switchboard.example.toml"
_KEY = re.compile(r"^(?:# )?(\w+) = ")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("SWITCHBOARD_") and k != "CREDENTIALS_DIRECTORY"}


def test_switchboard_check_accepts_the_example() -> None:
    r = subprocess.run([console_script("switchboard"), "check", "--config", str(EXAMPLE)], capture_output=True,
                       text=True, timeout=60, env=_clean_env())
    assert r.returncode == 0, r.stderr
    assert "[telegram]" in r.stdout


def test_active_lines_are_the_defaults() -> None:
    assert load_config(EXAMPLE, env={}) == Config()


def _documented_keys(text: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    section = None
    for line in text.splitlines():
        if header := re.fullmatch(r"\[(\w+)\]", line.strip()):
            section = header[1]
            found[section] = set()
        elif section and (key := _KEY.match(line)):
            found[section].add(key[1])
    return found


def test_every_section_and_key_is_documented() -> None:
    config = Config()
    expected = {s.name: {f.name for f in dataclasses.fields(getattr(config, s.name))}
                for s in dataclasses.fields(config)}
    documented = _documented_keys(EXAMPLE.read_text())
    assert set(documented) == set(expected), "sections missing or unknown"
    for section, keys in expected.items():
        assert documented[section] == keys, (
            f"[{section}] in deploy/switchboard.example.toml: missing {sorted(keys - documented[section])}, "
            f"unknown {sorted(documented[section] - keys)}")


def test_commented_examples_are_valid_values(tmp_path: Path) -> None:
    uncommented = "\n".join(line[2:] if _KEY.match(line) and line.startswith("# ") else line
                            for line in EXAMPLE.read_text().splitlines())
    path = tmp_path / "all.toml"
    path.write_text(uncommented)
    config = load_config(path, env={})
    assert config.telegram.token is not None and config.agent.system_prompt is not None
