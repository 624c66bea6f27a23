"""Real `switchboard run` worker processes for cluster tests, talking to one Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.ports import free_port
from tests.support.spawn import Group, log_tail, wait_ready


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
        self.proc: Group | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Worker:
        """Start the worker and wait until it is ready. A start that fails (the process exits, the
        deadline passes, the wait is cancelled) ends what it started before it raises."""
        self.proc = Group([sys.executable, "-m", "gateway", "run"], env=self.env, log=self.log)
        await self.until_ready()
        return self

    async def until_ready(self) -> None:
        assert self.proc is not None
        try:
            await wait_ready(self.url + "/readyz", self.proc, f"worker {self.worker_id}", self.log)
        except BaseException:
            self.end()
            raise

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, and the exit status once it has exited (ended as a group, with its log in the
        failure, if it has not within `timeout`)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            self.end()
            raise AssertionError(f"worker {self.worker_id} did not exit within {timeout:.0f} s of SIGTERM; "
                                 f"log tail:\n{log_tail(self.log)}") from None

    def kill(self) -> None:
        """`kill -9` of the worker process alone (what a crash looks like): the scenario, not the
        clean-up, which is `end()`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a stopped process too, without letting it run first
            self.proc.wait()

    def end(self) -> None:
        """Kill the worker's process group and reap it, whatever state it is in: the clean-up
        every path ends with (safe to call again, or for a worker never started)."""
        if self.proc is not None:
            self.proc.end()

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


async def start_all(*workers: Worker) -> None:
    """Start `workers` side by side. If one fails, the others' starts are cancelled and every one of
    them is ended before the failure is raised: nothing is left running for the caller to find."""
    tasks = [asyncio.ensure_future(w.start()) for w in workers]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in workers:
            w.end()
        raise


def end_all(*workers: Worker) -> None:
    for w in workers:
        w.end()
