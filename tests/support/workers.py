"""Real `switchboard run` worker processes for cluster tests, talking to one Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.ports import free_port


class Worker:
    def __init__(self, worker_id: str, redis_url: str, provider_url: str, tmp: Path, *, ttl_s: float = 3.0,
                 **env: str) -> None:
        self.worker_id = worker_id
        self.port, self.admin_port = free_port(), free_port()
        self.log = tmp / f"{worker_id}.log"
        self.env = {**os.environ, "SWITCHBOARD_REDIS__URL": redis_url, "SWITCHBOARD_CLUSTER__WORKER_ID": worker_id,
                    "SWITCHBOARD_CLUSTER__LEASE_TTL_S": str(ttl_s), "SWITCHBOARD_HTTP__PORT": str(self.port),
                    "SWITCHBOARD_ADMIN__PORT": str(self.admin_port), "SWITCHBOARD_API__ENABLED": "true",
                    "SWITCHBOARD_WEBCHAT__ENABLED": "false", "SWITCHBOARD_AGENT__KIND": "openai",
                    "SWITCHBOARD_AGENT__BASE_URL": provider_url, "SWITCHBOARD_AGENT__RETRIES": "0",
                    "SWITCHBOARD_ROUTER__MESSAGES_PER_MINUTE": "0",
                    "SWITCHBOARD_STORE__DATA_DIR": str(tmp / worker_id), **env}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Worker:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "run"], env=self.env,
                                         stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"worker {self.worker_id} exited:\n{self.log.read_text()[-3000:]}")
                try:
                    async with http.get(self.url + "/readyz") as resp:
                        if resp.status == 200:
                            return self
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"worker {self.worker_id} never became ready:\n{self.log.read_text()[-3000:]}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.proc.wait, 20)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a stopped process too, without letting it run first
            self.proc.wait()

    async def ask(self, http: aiohttp.ClientSession, session: str, text: str,
                  **extra: Any) -> tuple[int, dict[str, Any]]:
        """A non-streaming chat completion in `session`; (HTTP status, JSON body)."""
        body = {"messages": [{"role": "user", "content": text}], **extra}
        async with http.post(self.url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(60),
                             headers={"X-Session-Id": session}) as resp:
            return resp.status, await resp.json()


def content(body: dict[str, Any]) -> str:
    if "choices" not in body:
        return f"<error: {body.get('error', {}).get('message')}>"
    return str(body["choices"][0]["message"]["content"])
