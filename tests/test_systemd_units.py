"""The systemd units: `systemd-analyze verify` finds nothing wrong, they match the config, install-unit works.

`systemd-analyze verify` exits 0 for unknown directives and unparsable values and only prints
"<file>:<line>: ..." lines, so the check reads the output: any line about our files fails the test.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import re
import shutil
import subprocess
import typing
from pathlib import Path

import pytest

from gateway.core.secrets import Secret
from gateway.ops import units
from gateway.ops.config import Config

ROOT = Path(__file__).resolve().parent.parent
UNIT_DIR = ROOT / "systemd"


@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    """The tool, installed from the distribution if it is missing (never a skip)."""
    found = shutil.which("systemd-analyze")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail("systemd-analyze is missing and cannot be installed here (needs root and apt-get); "
                    "install the 'systemd' package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log = []
    for argv in (["apt-get", "install", "-y", "--no-install-recommends", "systemd"],
                 ["apt-get", "update"],
                 ["apt-get", "install", "-y", "--no-install-recommends", "systemd"]):
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        log.append(f"$ {' '.join(argv)} -> {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        if argv[1] == "install" and r.returncode == 0:
            break
    found = shutil.which("systemd-analyze")
    if not found:
        pytest.fail("could not install systemd-analyze:\n" + "\n".join(log))
    return found


@pytest.fixture(scope="module")
def exec_path() -> str:
    """An existing executable for ExecStart=: verify refuses units whose command is missing."""
    path = units.default_exec_path()
    assert path is not None, "the switchboard console script is not installed (pip install -e .)"
    return path


def _installed(dest: Path, exec_path: str) -> list[Path]:
    written = units.install_units(dest, exec_path=exec_path)
    (dest / "switchboard@w1.service").symlink_to("switchboard@.service")  # an instance of the template
    return [*written, dest / "switchboard@w1.service"]


def _verify(tool: str, unit_dir: Path, paths: list[Path]) -> list[str]:
    """Problems `systemd-analyze verify` reports about our units (lines about other units are ignored)."""
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": "cat", "SYSTEMD_LOG_LEVEL": "notice"}
    r = subprocess.run([tool, "verify", "--man=no", "--recursive-errors=no", *map(str, paths)],
                       capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    names = tuple(f"{n}:" for n in (*units.UNIT_NAMES, "switchboard@w1.service"))
    ours = [ln for ln in lines if ln.startswith(f"{unit_dir}/") or ln.startswith(names)]
    if r.returncode != 0 and not ours:
        ours = [f"systemd-analyze verify exited {r.returncode}:", *lines]
    return ours


def test_units_verify_cleanly(systemd_analyze: str, exec_path: str, tmp_path: Path) -> None:
    paths = _installed(tmp_path, exec_path)
    assert _verify(systemd_analyze, tmp_path, paths) == []


def test_verify_check_catches_real_unit_errors(systemd_analyze: str, exec_path: str, tmp_path: Path) -> None:
    """The check above is only worth something if bad directives and values make it fail."""
    paths = _installed(tmp_path, exec_path)
    service = tmp_path / "switchboard.service"
    service.write_text(service.read_text().replace("WatchdogSec=30", "WatchdogSec=soon\nNoSuchDirective=yes"))
    problems = _verify(systemd_analyze, tmp_path, paths)
    assert any("NoSuchDirective" in p for p in problems), problems
    assert any("soon" in p for p in problems), problems

    missing = units.install_units(tmp_path / "missing", exec_path="/nonexistent/switchboard")
    assert any("not executable" in p for p in _verify(systemd_analyze, tmp_path / "missing", missing))


def test_hardening_exposure_stays_low(systemd_analyze: str, exec_path: str, tmp_path: Path) -> None:
    _installed(tmp_path, exec_path)
    # --threshold is on the 0-100 scale behind the 0.0-10.0 "exposure level" printed (2.5 today: 1.3
    # before the namespaces, mount calls and /proc the shell's bubblewrap sandbox needs were allowed).
    for name in ("switchboard.service", "switchboard@w1.service"):
        r = subprocess.run([systemd_analyze, "security", "--offline=true", "--threshold=30", "--no-pager",
                            str(tmp_path / name)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_COLORS": "0"})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr


def _directives(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def _seconds(value: str) -> float:
    assert re.fullmatch(r"\d+", value), f"expected plain seconds, got {value!r}"
    return float(value)


@pytest.mark.parametrize("name", ["switchboard.service", "switchboard@.service"])
def test_service_contract(name: str) -> None:
    d = _directives((UNIT_DIR / name).read_text())
    assert d["Type"] == ["notify"]  # systemd 252 here: notify-reload does not parse
    assert d["NotifyAccess"] == ["main"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert d["KillMode"] == ["mixed"]
    assert d["Restart"] == ["on-failure"]
    assert d["ExecStart"] == [f"{units.DEFAULT_EXEC} run --config {units.DEFAULT_CONFIG}"]
    watchdog = _seconds(d["WatchdogSec"][0])
    assert watchdog == 30
    # Stop budget (Daemon.stop): drain + settle grace + tool kill grace + 1 s + 2 s per HTTP listener.
    config = Config()
    budget = (config.daemon.drain_timeout_s + config.daemon.shutdown_grace_s + config.tools.tool_kill_grace_s
              + 1 + 2 * 2)
    assert _seconds(d["TimeoutStopSec"][0]) >= budget + 10
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices", "DynamicUser"):
        assert d[key] == ["yes"], key
    assert d["ProtectSystem"] == ["strict"]
    assert d["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]  # AF_UNIX: the notify socket
    assert "MemoryDenyWriteExecute" not in d  # would break JIT runtimes that tools start


def test_template_is_per_worker() -> None:
    d = _directives((UNIT_DIR / "switchboard@.service").read_text())
    assert "SWITCHBOARD_CLUSTER__WORKER_ID=%i" in d["Environment"]
    assert "SWITCHBOARD_STORE__DATA_DIR=%S/switchboard/%i" in d["Environment"]
    assert d["StateDirectory"] == ["switchboard/%i"]
    assert d["EnvironmentFile"] == ["/etc/switchboard/%i.env"]
    assert d["PartOf"] == ["switchboard.target"]
    assert d["WantedBy"] == ["switchboard.target"]
    single = _directives((UNIT_DIR / "switchboard.service").read_text())
    assert "SWITCHBOARD_STORE__DATA_DIR=%S/switchboard" in single["Environment"]
    assert single["StateDirectory"] == ["switchboard"]


def _secret_keys() -> set[str]:
    config, keys = Config(), set()
    for section in dataclasses.fields(config):
        for name, hint in typing.get_type_hints(type(getattr(config, section.name))).items():
            args = typing.get_args(hint)
            if hint is Secret or Secret in args or any(Secret in typing.get_args(a) for a in args):
                keys.add(f"{section.name}.{name}")
    return keys


@pytest.mark.parametrize("name", ["switchboard.service", "switchboard@.service"])
def test_every_secret_can_come_from_a_credential(name: str) -> None:
    """LoadCredential IDs are exactly the "<section>.<key>" names the config reads from $CREDENTIALS_DIRECTORY."""
    creds = _directives((UNIT_DIR / name).read_text())["LoadCredential"]
    ids = {c.split(":", 1)[0] for c in creds}
    assert ids == _secret_keys()
    for c in creds:  # relative source: looked up in /etc/credstore/ and friends, skipped when missing
        cid, source = c.split(":", 1)
        assert source == f"switchboard.{cid}"


def test_the_package_ships_the_repository_units() -> None:
    """One source: the package's unit directory is a link to `systemd/`, not a copy to keep in step."""
    packaged = ROOT / "gateway" / "ops" / "systemd"
    assert packaged.is_symlink() and packaged.resolve() == UNIT_DIR.resolve()
    for name in units.UNIT_NAMES:
        assert units.unit_text(name) == (UNIT_DIR / name).read_text()
    assert sorted(p.name for p in UNIT_DIR.iterdir()) == sorted(units.UNIT_NAMES)


def test_install_units_rewrites_exec_start(tmp_path: Path) -> None:
    written = units.install_units(tmp_path / "units", exec_path="/opt/switch%board/bin/switchboard",
                                  config_path="/srv/sb.toml")
    assert [p.name for p in written] == list(units.UNIT_NAMES)
    for path in written:
        assert path.stat().st_mode & 0o777 == 0o644
        original = (UNIT_DIR / path.name).read_text()
        text = path.read_text()
        if path.suffix == ".service":
            assert "ExecStart=/opt/switch%%board/bin/switchboard run --config /srv/sb.toml\n" in text
            assert text.replace("/opt/switch%%board/bin/switchboard run --config /srv/sb.toml",
                                f"{units.DEFAULT_EXEC} run --config {units.DEFAULT_CONFIG}") == original
        else:
            assert text == original
    assert not list((tmp_path / "units").glob(".*"))  # no temp files left behind


@pytest.mark.parametrize("bad", ["relative/switchboard", "/opt/my switchboard", "/opt/$HOME/sb", "/opt/a;b"])
def test_install_units_refuses_paths_systemd_would_misread(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        units.install_units(tmp_path, exec_path=bad)
    assert list(tmp_path.iterdir()) == []


def test_install_unit_command(tmp_path: Path, exec_path: str) -> None:
    parser = argparse.ArgumentParser()
    units.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args(["--dest", str(tmp_path), "--exec-path", exec_path,
                              "--config-path", str(tmp_path / "missing.toml")])
    assert units.command(args, out=out, err=err) == 0
    text = out.getvalue()
    assert "systemctl daemon-reload && systemctl enable --now switchboard" in text
    assert f"create {tmp_path / 'missing.toml'}" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(units.UNIT_NAMES)
    assert f"ExecStart={exec_path} run" in (tmp_path / "switchboard.service").read_text()

    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args(["--dest", str(tmp_path / "x"), "--exec-path", "/opt/a b"])
    assert units.command(args, out=out, err=err) == 2
    assert "must not contain spaces" in err.getvalue()


def test_exec_path_problems() -> None:
    # /bin/sh, not sys.executable: CI's interpreter lives in a temporary virtualenv, which the check rightly flags.
    assert units.exec_path_problems("/bin/sh") == []
    assert any("PrivateTmp" in p for p in units.exec_path_problems("/tmp/venv/bin/switchboard"))
    assert any("ProtectHome" in p for p in units.exec_path_problems("/root/.local/bin/switchboard"))
    assert any("not an executable" in p for p in units.exec_path_problems("/nonexistent/switchboard"))
