"""Cluster benchmarks with real worker processes and a real redis-server.

(1) cross-worker /stop: a session streams on worker A, /stop arrives at worker B; from the /stop
request leaving the client to the provider (a separate process) seeing A's connection close.
(2) takeover: kill -9 the owner of a session; time until another worker answers in it.
(2b) adoption with no user message: the owner of a running turn is killed, restarted with the same
id, or paused for 0.9 × TTL; time until the chat (Telegram by webhook) gets the "interrupted"
notice from the worker that adopted the turn, which then resumes it.
(3) throughput: echo agent at zero delay over the HTTP API, sessions pinned to workers as a load
balancer would, with 1 and with 3 workers.
(4) relayed turns: time to first token of a streamed answer asked of the session's owner and of
another worker (which relays the owner's turn), side by side; and a client of the relaying worker
hanging up: from the hang-up to the provider seeing the owner's connection close.

    python -m tests.bench.cluster            # everything
    python -m tests.bench.cluster --relay    # (4) only
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from tests.bench.stop_latency import row
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker

TTL = 3.0
_chats = itertools.count(1000)


async def cross_worker_stop(n: int, tmp: Path, redis: RedisServer) -> list[str]:
    port = free_port()
    provider = subprocess.Popen([sys.executable, "-m", "tests.fakes.openai_provider", "--port", str(port),
                                 "--delay", "0.05", "--words", "2000"], stdout=subprocess.PIPE)
    assert provider.stdout is not None
    provider.stdout.readline()
    a = Worker("a", redis.url, f"http://127.0.0.1:{port}/v1", tmp, ttl_s=TTL)
    b = Worker("b", redis.url, f"http://127.0.0.1:{port}/v1", tmp, ttl_s=TTL)
    await asyncio.gather(a.start(), b.start())
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def stream(i: int) -> None:
                body = {"messages": [{"role": "user", "content": f"story {i}"}], "stream": True}
                async with http.post(a.url + "/v1/chat/completions", json=body,
                                     headers={"X-Session-Id": f"x{i}"}) as resp:
                    async for _ in resp.content:
                        pass

            streams = [asyncio.create_task(stream(i)) for i in range(n)]
            await asyncio.sleep(2.0)
            sent: dict[int, float] = {}
            for i in random.Random(5).sample(range(n), n // 2):
                sent[i] = time.perf_counter()
                status, _ = await b.ask(http, f"x{i}", "/stop")
                assert status == 200
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)
            async with http.get(f"http://127.0.0.1:{port}/_connections") as resp:
                closed = {c["last_user"]: c["closed_at"] for c in await resp.json()}
            for task in streams:
                task.cancel()
        return [row("cross-worker /stop→close", n, [(closed[f"story {i}"] - t) * 1000 for i, t in sent.items()])]
    finally:
        a.kill()
        b.kill()
        provider.terminate()
        provider.wait()


async def _first_token(http: aiohttp.ClientSession, worker: Worker, session: str, text: str) -> float:
    """Seconds from sending a streamed request to its first non-empty content chunk."""
    body = {"messages": [{"role": "user", "content": text}], "stream": True}
    sent = time.perf_counter()
    async with http.post(worker.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":""' not in line and b'"content"' in line:
                first = time.perf_counter() - sent
                async for _ in resp.content:  # the rest, so the turn ends before the next
                    pass
                return first
    raise AssertionError("no content streamed")


async def relayed(n: int, tmp: Path, redis: RedisServer) -> list[str]:
    from tests.fakes.openai_provider import FakeProvider, Script

    async with FakeProvider(delay_s=0.0, words=5) as provider:
        a = Worker("ra", redis.url, provider.base_url, tmp, ttl_s=TTL)
        b = Worker("rb", redis.url, provider.base_url, tmp, ttl_s=TTL)
        await asyncio.gather(a.start(), b.start())
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                for i in range(n):  # a owns every session
                    assert (await a.ask(http, f"r{i}", "hello"))[0] == 200
                direct, relay = [], []
                for i in range(n):  # alternating, so both see the same machine
                    direct.append(await _first_token(http, a, f"r{i}", f"direct {i}") * 1000)
                    relay.append(await _first_token(http, b, f"r{i}", f"relayed {i}") * 1000)
                gone = []
                for i in range(n):  # a client of b hangs up mid-answer
                    text = f"left {i}"
                    provider.by_text[text] = Script(text=" ".join(["word"] * 2000), delay_s=0.01)
                    body = {"messages": [{"role": "user", "content": text}], "stream": True}
                    resp = await http.post(b.url + "/v1/chat/completions", json=body,
                                           headers={"X-Session-Id": f"r{i}"})
                    async for line in resp.content:
                        if b'"content"' in line and b'"content":""' not in line:
                            break
                    left = time.perf_counter()
                    resp.close()
                    closed = await provider.wait_closed(provider.requests_for(text)[0], 10)
                    gone.append((closed - left) * 1000)
        finally:
            a.kill()
            b.kill()
    return [row("first token, owner", n, direct), row("first token, relayed", n, relay),
            row("relayed hang-up→closed", n, gone)]


async def takeover(trials: int, tmp: Path, redis: RedisServer, provider_url: str) -> str:
    times = []
    for trial in range(trials):
        a = Worker(f"ta{trial}", redis.url, provider_url, tmp, ttl_s=TTL, SWITCHBOARD_AGENT__KIND="echo",
                   SWITCHBOARD_AGENT__ECHO_DELAY_S="0")
        b = Worker(f"tb{trial}", redis.url, provider_url, tmp, ttl_s=TTL, SWITCHBOARD_AGENT__KIND="echo",
                   SWITCHBOARD_AGENT__ECHO_DELAY_S="0")
        await asyncio.gather(a.start(), b.start())
        try:
            async with aiohttp.ClientSession() as http:
                assert (await a.ask(http, f"t{trial}", "hello"))[0] == 200
                await asyncio.sleep(random.random() * TTL / 3)  # anywhere in the renewal cycle
                a.kill()
                killed = time.perf_counter()
                while (await b.ask(http, f"t{trial}", "still there?"))[0] != 200:
                    await asyncio.sleep(0.02)
                times.append(time.perf_counter() - killed)
        finally:
            a.kill()
            b.kill()
    return (f"| takeover after kill -9 (TTL {TTL:g} s) | {trials} trials | median {statistics.median(times):.2f} s "
            f"| max {max(times):.2f} s |")


async def adoption(fault: str, trials: int, ttl: float, tmp: Path, redis: RedisServer) -> str:
    """Seconds from the fault (kill -9, restart with the same id, SIGSTOP) to the takeover notice."""
    import signal

    from tests.fakes.openai_provider import FakeProvider
    from tests.fakes.telegram_api import FakeTelegramAPI

    times: list[float] = []
    async with FakeProvider(delay_s=0.05, words=400) as provider, FakeTelegramAPI() as fake:
        env = {f"SWITCHBOARD_TELEGRAM__{k}": v for k, v in {
            "TOKEN": fake.token, "BASE_URL": fake.base_url, "BASE_FILE_URL": fake.base_file_url, "ACCESS": "open",
            "EDIT_INTERVAL_S": "0.2", "MODE": "webhook", "WEBHOOK_URL": "https://example.test/tg",
            "SECRET_TOKEN": "hook-secret-1"}.items()}
        for trial in range(trials):
            name = f"{fault}{trial}"
            a = Worker(f"{name}a", redis.url, provider.base_url, tmp, ttl_s=ttl, **env)
            b = Worker(f"{name}b", redis.url, provider.base_url, tmp, ttl_s=ttl, **env)
            await asyncio.gather(a.start(), b.start())
            again: Worker | None = None
            chat = next(_chats)  # unique across calls: Redis (and its de-duplication) is shared
            try:
                update = {"message": fake.user_message(chat, user_id=chat, text=f"story {name}")}
                assert await fake.post_webhook(a.url + "/telegram/webhook", update, "hook-secret-1") == 200
                deadline = time.monotonic() + 30
                while not fake.messages(chat):
                    assert time.monotonic() < deadline, "the turn never started"
                    await asyncio.sleep(0.02)
                await asyncio.sleep(random.random() * ttl / 3)  # anywhere in the renewal cycle
                started = time.perf_counter()
                if fault == "pause":
                    a.signal(signal.SIGSTOP)
                    await asyncio.sleep(ttl * 0.9)
                    a.signal(signal.SIGCONT)
                else:
                    a.kill()
                    if fault == "restart":
                        again = Worker(f"{name}a", redis.url, provider.base_url, tmp, ttl_s=ttl, **env)
                        await again.start()
                deadline = time.monotonic() + ttl + 30
                while not any(t.startswith("⏹ interrupted:") for t in fake.messages(chat).values()):
                    assert time.monotonic() < deadline, "never taken over"
                    await asyncio.sleep(0.01)
                times.append(time.perf_counter() - started)
            finally:
                for w in (a, b, again):
                    if w is not None:
                        w.kill()
    label = {"kill": "kill -9", "restart": "kill -9, restarted at once with the same id",
             "pause": f"SIGSTOP for {0.9 * ttl:g} s"}[fault]
    return (f"| {label} | TTL {ttl:g} s | {trials} | {statistics.median(times):.2f} s | {max(times):.2f} s |")


async def throughput(workers: int, sessions: int, per_session: int, tmp: Path, redis: RedisServer,
                     provider_url: str) -> float:
    pool = [Worker(f"p{workers}-{i}", redis.url, provider_url, tmp, ttl_s=30, SWITCHBOARD_AGENT__KIND="echo",
                   SWITCHBOARD_AGENT__ECHO_DELAY_S="0") for i in range(workers)]
    await asyncio.gather(*(w.start() for w in pool))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            async def session(s: int) -> None:
                worker = pool[s % workers]  # sticky, as a load balancer would pin it
                for m in range(per_session):
                    status, body = await worker.ask(http, f"tp{workers}-{s}", f"message {m} of session {s}")
                    assert status == 200, body

            started = time.perf_counter()
            await asyncio.gather(*(session(s) for s in range(sessions)))
            return sessions * per_session / (time.perf_counter() - started)
    finally:
        for w in pool:
            w.kill()


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis").start()
        try:
            if "--relay" in sys.argv:
                print("| measure | N | samples | p50 ms | p99 ms | max ms |")
                print("|---|---:|---:|---:|---:|---:|")
                print("\n".join(await relayed(200, Path(tmp), redis)))
                return
            lines = ["| measure                  |     N | stops |  p50 ms |  p99 ms |  max ms |",
                     "|--------------------------|------:|------:|--------:|--------:|--------:|"]
            lines += await cross_worker_stop(50, Path(tmp), redis)
            print("\n".join(lines))
            dummy = f"http://127.0.0.1:{free_port()}/v1"  # echo agent: no provider needed
            print(await takeover(3, Path(tmp), redis, dummy))
            print("| fault | lease TTL | trials | fault → takeover notice, median | max |")
            print("|---|---|---|---|---|")
            for fault, ttl in (("kill", 3.0), ("kill", 10.0), ("restart", 10.0), ("pause", 5.0)):
                print(await adoption(fault, 5, ttl, Path(tmp), redis))
            one = await throughput(1, 300, 10, Path(tmp), redis, dummy)
            three = await throughput(3, 300, 10, Path(tmp), redis, dummy)
            print(f"| throughput, HTTP API, echo | 1 worker {one:,.0f} msg/s | 3 workers {three:,.0f} msg/s |")
        finally:
            redis.stop()


if __name__ == "__main__":
    asyncio.run(main())
