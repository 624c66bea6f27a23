"""Three workers behind a plain round-robin balancer (no stickiness): every message of every
session is taken by whichever worker it lands on — streamed or not, with /stops and clients that
hang up in between — and each session's turns run one at a time, in the order they were sent.
Checked from the provider's records (who asked what, with which history, when)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fakes.openai_provider import FakeProvider, Script
from tests.support.balancer import round_robin
from tests.support.procs import until
from tests.support.redis_server import RedisServer
from tests.support.workers import Worker, end_all, start_all

TTL = 3.0
SESSIONS = 200
SEED = int(os.environ.get("SWITCHBOARD_SEED") or random.randrange(1 << 30))


async def _ask(http: aiohttp.ClientSession, url: str, session: str, text: str, *, stream: bool) -> tuple[int, Any]:
    body = {"messages": [{"role": "user", "content": text}], "stream": stream}
    async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session},
                         timeout=aiohttp.ClientTimeout(90)) as resp:
        if not stream or resp.status != 200:
            return resp.status, await resp.json()
        final: dict[str, Any] = {}
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"][0]["finish_reason"]:
                    final = chunk
        return resp.status, final


async def _messages_in(http: aiohttp.ClientSession, worker: Worker) -> float:
    async with http.get(f"http://127.0.0.1:{worker.admin_port}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("switchboard_messages_in_total{") and 'platform="api"' in line)


@pytest.mark.timeout(300)
async def test_behind_a_round_robin_balancer_every_message_is_taken_and_each_session_keeps_its_order(
        provider: FakeProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    seed = f"SWITCHBOARD_SEED={SEED}"
    provider.delay_s, provider.words = 0.01, 6
    workers = [Worker(f"w{i}", redis_server.url, provider.base_url, tmp_path, ttl_s=TTL) for i in (1, 2, 3)]
    statuses: list[tuple[str, str, int]] = []
    sent: dict[str, list[str]] = {}
    try:
        await start_all(*workers)
        async with round_robin([w.url for w in workers]) as lb, aiohttp.ClientSession() as http:
            gate = asyncio.Semaphore(40)

            async def session(i: int) -> None:
                name, fate = f"lb{i}", rng.choice(["plain"] * 8 + ["stop", "hang up"])
                texts = [f"{name} m{n}" for n in range(3)]
                sent[name] = texts
                async with gate:
                    for n, text in enumerate(texts):
                        if n == 1 and fate != "plain":
                            await _cut_short(http, lb, name, text, fate)
                            continue
                        status, _ = await _ask(http, lb, name, text, stream=rng.random() < 0.5)
                        statuses.append((name, text, status))

            async def _cut_short(http: aiohttp.ClientSession, url: str, name: str, text: str, fate: str) -> None:
                provider.by_text[text] = Script(text=" ".join(["long"] * 400), delay_s=0.02)
                turn = asyncio.create_task(_ask(http, url, name, text, stream=True))
                await until(lambda: bool(provider.requests_for(text)), 30, f"{text} never reached the provider; {seed}")
                if fate == "hang up":
                    turn.cancel()
                    await asyncio.gather(turn, return_exceptions=True)
                    try:
                        await asyncio.wait_for(provider.wait_closed(provider.requests_for(text)[0], 30), 35)
                    except TimeoutError:
                        raise AssertionError(f"{text}: its stream still open 35 s after its client hung up; "
                                             f"{seed}") from None
                    return
                status, _ = await _ask(http, url, name, "/stop", stream=False)
                statuses.append((name, "/stop", status))
                try:
                    status, final = await asyncio.wait_for(turn, 30)
                except TimeoutError:
                    raise AssertionError(f"{text}: not ended 30 s after /stop answered {status}; {seed}") from None
                statuses.append((name, text, status))
                assert final.get("switchboard", {}).get("interrupted_by") == "user", (name, final, seed)

            await asyncio.gather(*(session(i) for i in range(SESSIONS)))
            # Most messages landed on a worker that did not own their session: counted there and
            # again by the owner that ran them.
            counted = sum([await _messages_in(http, w) for w in workers])
            assert counted > 1.25 * len(statuses), (counted, len(statuses), seed)
    finally:
        end_all(*workers)
    refused = [s for s in statuses if s[2] != 200]
    assert refused == [], f"{len(refused)} refused, e.g. {refused[:5]}; {seed}"
    for name, texts in sent.items():
        conns = sorted((c for t in texts for c in provider.requests_for(t)), key=lambda c: c.opened_at)
        assert [c.last_user for c in conns] == texts, (name, [c.last_user for c in conns], seed)  # one each, in order
        for earlier, later in itertools.pairwise(conns):  # one turn at a time
            assert earlier.ended_at is not None and earlier.ended_at <= later.opened_at + 0.05, (name, seed)
        history = [m["content"] for m in conns[-1].body["messages"] if m["role"] == "user"]
        assert history == texts, (name, history, seed)  # the last turn saw the whole session, in order
