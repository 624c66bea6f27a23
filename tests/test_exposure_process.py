"""Issue 10's findings 1-5 as black-box probes against a real `python -m gateway run` process, its
log read afterwards as an operator would (debug level, JSON lines): two tenants, a browser's
cookie, a rebinding-shaped admin request, hostile input. The log must hold no traceback, no
error-level line, no key and no cookie."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import free_port
from tests.fakes.openai_provider import FakeProvider
from tests.support.procs import until
from tests.support.sandbox import ensure_bwrap
from tests.support.spawn import Group, wait_ready
from tests.test_exposure import NESTED, _post, _raw

ROOT = Path(__file__).resolve().parent.parent
K1, K2 = "sk-proc-tenant-one-0123456789", "sk-proc-tenant-two-9876543210"
ADMIN_TOKEN = "admin-proc-token-0123456789"


class _Daemon:
    def __init__(self, cwd: Path, provider: FakeProvider, *extra_env: tuple[str, str]) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.log = cwd / "daemon.log"
        # PYTHONPATH: this checkout's code, whichever one the environment has installed.
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SWITCHBOARD_HTTP__PORT": str(self.port),
               "SWITCHBOARD_ADMIN__PORT": str(self.admin_port), "SWITCHBOARD_ADMIN__TOKEN": ADMIN_TOKEN,
               "SWITCHBOARD_API__ENABLED": "true", "SWITCHBOARD_API__TENANTS": json.dumps({"team-a": K1}),
               "SWITCHBOARD_API__KEYS": K2, "SWITCHBOARD_WEBCHAT__ENABLED": "true",
               "SWITCHBOARD_AGENT__KIND": "openai", "SWITCHBOARD_AGENT__BASE_URL": provider.base_url,
               "SWITCHBOARD_AGENT__RETRIES": "0", "SWITCHBOARD_LOG__LEVEL": "debug",
               "SWITCHBOARD_LOG__FORMAT": "json", **dict(extra_env)}
        self.proc = Group([sys.executable, "-m", "gateway", "run"], cwd=cwd, env=env, log=self.log)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    async def ready(self) -> None:
        try:
            await wait_ready(f"http://127.0.0.1:{self.port}/readyz", self.proc, "the daemon", self.log)
        except BaseException:
            self.proc.end()
            raise

    async def stop(self) -> int:
        """SIGTERM; its exit status (ended as a group, and the failure showing its log, if it has
        not exited within 60 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.to_thread(self.proc.wait, 60)
        except BaseException:
            self.proc.end()
            raise AssertionError(f"the daemon did not exit after SIGTERM; log tail:\n{self.proc.log_tail()}") from None


async def _ask(http: aiohttp.ClientSession, port: int, key: str, text: str) -> tuple[int, dict[str, Any]]:
    async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": text}], "metadata": {"session_id": "alice"}},
                         headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, dict(await resp.json())


async def test_the_findings_as_black_box_probes_against_a_daemon_process(
        tmp_path: Path, provider: FakeProvider) -> None:
    provider.words = 2
    daemon = _Daemon(tmp_path, provider)
    port, aport = daemon.port, daemon.admin_port
    base = f"http://127.0.0.1:{port}"
    try:
        await daemon.ready()
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            # 1. Tenants: the same session id under another key is another conversation.
            assert (await _ask(http, port, K1, "my pin is 4711"))[0] == 200
            assert (await _ask(http, port, K2, "what is my pin?"))[0] == 200
            status, answer = await _ask(http, port, K2, "/stop")
            assert (status, answer["choices"][0]["message"]["content"]) == (200, "Nothing is running.")
            (k2_turn,) = provider.requests_for("what is my pin?")
            assert "4711" not in json.dumps(k2_turn.body)
            # 2. The web chat cookie: a turn, a stop, a status, all logged at debug level.
            async with http.get(base + "/"):
                pass
            cookie = next(c.value for c in http.cookie_jar if c.key == "switchboard_chat")
            ws = await http.ws_connect(base + "/ws", origin=base)
            await ws.receive_json()
            await ws.send_json({"type": "message", "id": "w1", "text": "hello from a browser"})
            while (await asyncio.wait_for(ws.receive_json(), 10)) != {"type": "state", "running": False}:
                pass
            await ws.send_json({"type": "command", "name": "status"})
            while (await asyncio.wait_for(ws.receive_json(), 10)).get("type") != "notice":
                pass
            await ws.close()
            admin_auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with http.get(f"http://127.0.0.1:{aport}/admin/api/sessions", headers=admin_auth) as resp:
                table = await resp.text()
            assert "webchat:dm:" in table and cookie not in table
        # 3. Rebinding shape: the attacker's name in Host and Origin, the operator's token and all.
        evil = b"Host: evil.example\r\nOrigin: http://evil.example\r\nAuthorization: Bearer " + ADMIN_TOKEN.encode()
        status, _ = await _raw(aport, b"POST /admin/api/sessions/stop HTTP/1.1\r\n" + evil +
                               b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close"
                               b"\r\n\r\n{}")
        assert status == 421
        # 4 and 5. Poison text and hostile input: each a clean 4xx.
        for what, request, expected in (
                ("a lone surrogate", _post("/v1/chat/completions", port, b'{"messages": [{"role": "user", '
                                           b'"content": "\\ud800"}], "metadata": {"session_id": "p"}}',
                                           auth=K1.encode()), 400),
                ("100,000 nested [", _post("/v1/chat/completions", port, NESTED, auth=K1.encode()), 413),
                ("charset=bogus", _post("/v1/chat/completions", port, b"{}", auth=K1.encode(),
                                        content_type=b"application/json; charset=bogus"), 415),
                ("a non-ASCII bearer", _post("/v1/chat/completions", port, b"{}", auth=b"\xff\xfe"), 401),
                ("admin login with a lone surrogate", _post("/admin/login", aport, b'{"token": "\\ud800"}',
                                                            auth=None), 400),
                ("a NUL in a header", _post("/v1/chat/completions", port, b"{}", headers=b"X-A: \x00\r\n"), 400),
                ("Content-Length: -1", b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400)):
            status, response = await _raw(port if b"/admin" not in request[:40] else aport, request)
            assert status == expected, f"{what}: {response[:200]!r}"
    finally:
        code = await daemon.stop()
    assert code == 0, daemon.logs()[-3000:]
    await until(lambda: "shutting down" in daemon.logs(), 5, "no shutdown line")
    log = daemon.logs()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert lines, "no JSON log lines"
    assert "Traceback" not in log
    assert [x for x in lines if x.get("level") in ("error", "critical")] == []
    faults = [x for x in lines if x["msg"].startswith("client fault")]
    assert faults and all(x["level"] == "warning" for x in faults)
    assert any("webchat:dm:" in json.dumps(x) for x in lines), "nothing about the web chat session was logged"
    for secret, what in ((cookie, "the web chat cookie"), (K1, "a tenant's key"), (K2, "a plain key"),
                         (ADMIN_TOKEN, "the admin token")):
        assert secret not in log, f"{what} appears in the log"


# --- issue 31, finding 10: safe defaults, checked ---------------------------------------------------


def _check(tmp_path: Path, command: str = "check", **settings: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SWITCHBOARD_STORE__DATA_DIR": str(tmp_path / "data"),
           **{f"SWITCHBOARD_{k.upper()}": v for k, v in settings.items()}}
    return subprocess.run([sys.executable, "-m", "gateway", command], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)


def test_check_refuses_a_public_bind_with_an_open_web_chat_or_an_unsandboxed_shell(tmp_path: Path) -> None:
    """Finding 10: `http.host = "0.0.0.0"` with API keys and the shell on passed `switchboard check`
    with exit 0 and no warning (and the web chat, on by default, has no sign-in)."""
    ensure_bwrap()
    public = {"http__host": "0.0.0.0", "api__enabled": "true", "api__keys": "sk-public-0123456789"}
    cases: list[tuple[dict[str, str], int, str]] = [
        ({**public, "tools__shell": "true"}, 2, "unsafe: webchat.enabled: the web chat is on"),
        ({**public, "webchat__enabled": "false", "tools__shell": "true", "tools__sandbox": "off"}, 2,
         "unsafe: tools.shell: the shell tool runs without a sandbox"),
        ({**public, "webchat__enabled": "false", "tools__shell": "true"}, 0, ""),  # sandboxed: fine
        ({**public, "webchat__enabled": "true"}, 0, "warning: the web chat is on and http.host is not loopback"),
        ({"tools__shell": "true", "tools__sandbox": "off"}, 0, "warning: the shell tool runs without a sandbox"),
    ]
    for settings, code, said in cases:
        done = _check(tmp_path, **settings)
        assert done.returncode == code and said in done.stderr, (settings, done.returncode, done.stderr)
    refused = _check(tmp_path, "run", **public)  # and the daemon does not start with it
    assert refused.returncode == 2 and "unsafe: webchat.enabled" in refused.stderr, refused.stderr


async def test_the_daemons_files_are_private(tmp_path: Path, provider: FakeProvider) -> None:
    """Finding 10: outside systemd the database, its WAL and the media copies were created 0644."""
    provider.words = 1
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)  # as an operator's `mkdir` under umask 022 leaves it
    daemon = _Daemon(tmp_path, provider, ("SWITCHBOARD_STORE__DATA_DIR", str(data)),
                     ("SWITCHBOARD_AGENT__VISION", "true"))
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(64)).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, {
        "type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}],
        "metadata": {"session_id": "alice"}}
    try:
        await daemon.ready()
        async with aiohttp.ClientSession() as http, http.post(
                f"http://127.0.0.1:{daemon.port}/v1/chat/completions", json=body,
                headers={"Authorization": f"Bearer {K1}"}) as resp:
            assert resp.status == 200
        modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
                 for p in [data, *data.glob("switchboard.db*"), *data.glob("media/**/*"), data / "webchat-secret"]}
    finally:
        await daemon.stop()
    assert "data/switchboard.db-wal" in modes and any(k.startswith("data/media/") for k in modes), modes
    loose = {path: f"{mode:04o}" for path, mode in modes.items() if mode & 0o077}
    assert loose == {}, f"open to others: {loose}"


def _rss_kb(pid: int) -> tuple[int, int]:
    """(peak, current) resident memory of a process, in kB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmHWM"].split()[0]), int(fields["VmRSS"].split()[0])


async def test_ten_large_bodies_at_once_leave_the_daemon_where_it_was(tmp_path: Path, provider: FakeProvider) -> None:
    """Finding 2: ten concurrent 24 MB bodies took the daemon to 1.67 GB, and it stayed at 1.2 GB idle.
    Now at most four large bodies are read at once, and their memory goes back to the system."""
    from tests.test_exposure_edge import _send_blocking

    provider.words = 1
    daemon = _Daemon(tmp_path, provider)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"padding": "' + b"a" * 24_000_000 + b'"}}'
    try:
        await daemon.ready()
        request = _post("/v1/chat/completions", daemon.port, body, auth=K1.encode())
        await asyncio.to_thread(_send_blocking, daemon.port, request)  # one first: what the daemon holds after
        _, before = _rss_kb(daemon.proc.pid)
        answers = await asyncio.gather(*(asyncio.to_thread(_send_blocking, daemon.port, request) for _ in range(10)))
        peak, after = _rss_kb(daemon.proc.pid)
    finally:
        await daemon.stop()
    print(f"RSS {before} kB before, peak {peak} kB, {after} kB after ten 24 MB bodies at once")
    assert [status for status, _ in answers] == [200] * 10
    assert after - before < 16_000, f"{after - before} kB more after the bodies were answered"
    assert peak - before < 400_000
