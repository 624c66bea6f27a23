"""Stop latency through each chat adapter, against its loopback fake.

From the /stop update reaching the adapter (Telegram: posted to the webhook; Discord: the
MESSAGE_CREATE frame sent on the gateway) — or a Stop button's press (Telegram: the callback query
posted; Discord: the INTERACTION_CREATE frame sent) — to the provider — a separate process —
seeing the connection closed. N chats stream at once; half of them are stopped, 5 ms apart.

    python -m tests.bench.adapter_stop_latency            # N = 50
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from gateway.ops.config import load_config
from gateway.ops.daemon import Daemon
from tests.bench.stop_latency import row
from tests.fakes.discord_api import FakeDiscord, patch_discord
from tests.fakes.discord_models import FakeUser
from tests.fakes.telegram_api import FakeTelegramAPI
from tests.support.ports import free_port


def _env(provider: str, data: Path, **extra: str) -> dict[str, str]:
    return {"SWITCHBOARD_HTTP__PORT": str(free_port()), "SWITCHBOARD_ADMIN__PORT": str(free_port()),
            "SWITCHBOARD_STORE__DATA_DIR": str(data), "SWITCHBOARD_AGENT__KIND": "openai",
            "SWITCHBOARD_AGENT__BASE_URL": provider, "SWITCHBOARD_ROUTER__MESSAGES_PER_MINUTE": "0",
            "SWITCHBOARD_WEBCHAT__ENABLED": "false", **extra}


async def _closes(port: int) -> dict[str, float | None]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/_connections") as resp:
        return {c["last_user"]: c["closed_at"] for c in await resp.json()}


async def _measure(n: int, port: int, say: Callable[[int, str], Awaitable[None]],
                   streaming: Callable[[int], bool],
                   press: Callable[[int], Awaitable[None]] | None = None) -> list[float]:
    for i in range(n):
        await say(i, f"story {i}")
    deadline = time.monotonic() + 60
    while not all(streaming(i) for i in range(n)):
        assert time.monotonic() < deadline, "not every chat started streaming"
        await asyncio.sleep(0.05)
    sent: dict[int, float] = {}
    for i in random.Random(2).sample(range(n), n // 2):
        sent[i] = time.perf_counter()
        await (press(i) if press is not None else say(i, "/stop"))
        await asyncio.sleep(0.005)
    await asyncio.sleep(1.0)
    closed = await _closes(port)
    return [((closed[f"story {i}"] or float("inf")) - t) * 1000 for i, t in sent.items()]


def _telegram_button(fake: FakeTelegramAPI, chat: int) -> tuple[int, str] | None:
    for mid in fake.messages(chat):
        for row_ in (fake.message(chat, mid) or {}).get("reply_markup", {}).get("inline_keyboard", []):
            data = [b["callback_data"] for b in row_ if str(b.get("callback_data", "")).startswith("stop:")]
            if data:
                return mid, data[0]
    return None


async def telegram(n: int, provider: str, port: int, data: Path, *, button: bool = False) -> list[float]:
    async with FakeTelegramAPI() as fake:
        env = _env(provider, data, SWITCHBOARD_TELEGRAM__TOKEN=fake.token, SWITCHBOARD_TELEGRAM__BASE_URL=fake.base_url,
                   SWITCHBOARD_TELEGRAM__BASE_FILE_URL=fake.base_file_url, SWITCHBOARD_TELEGRAM__ACCESS="open",
                   SWITCHBOARD_TELEGRAM__MODE="webhook", SWITCHBOARD_TELEGRAM__WEBHOOK_URL="https://bench.test/tg",
                   SWITCHBOARD_TELEGRAM__SECRET_TOKEN="bench-secret", SWITCHBOARD_TELEGRAM__EDIT_INTERVAL_S="1")
        daemon = Daemon(load_config(None, env))
        await daemon.start()
        url = f"http://127.0.0.1:{daemon.config.http.port}/telegram/webhook"
        try:
            while not daemon.adapters["telegram"].health().ok:
                await asyncio.sleep(0.05)
            async def say(i: int, text: str) -> None:
                entities = [{"type": "bot_command", "offset": 0, "length": 5}] if text == "/stop" else None
                update = {"message": fake.user_message(1000 + i, user_id=1000 + i, text=text, entities=entities)}
                assert await fake.post_webhook(url, update, "bench-secret") == 200

            async def press(i: int) -> None:
                found = _telegram_button(fake, 1000 + i)
                assert found is not None, "no Stop button"
                query = fake.push_callback(1000 + i, found[0], found[1], user_id=1000 + i)
                update = next(u for u in fake.pending_updates if u["update_id"] == query)
                assert await fake.post_webhook(url, update, "bench-secret") == 200

            if button:
                return await _measure(n, port, say, lambda i: _telegram_button(fake, 1000 + i) is not None, press)
            return await _measure(n, port, say, lambda i: bool(fake.messages(1000 + i)))
        finally:
            await daemon.stop()


def _discord_button(messages: list[dict[str, Any]]) -> tuple[int, str] | None:
    for msg in messages:
        for row_ in msg.get("components", []):
            for c in row_.get("components", []):
                if str(c.get("custom_id", "")).startswith("stop:"):
                    return int(msg["id"]), c["custom_id"]
    return None


async def discord(n: int, provider: str, port: int, data: Path, *, button: bool = False) -> list[float]:
    users = [FakeUser(7000 + i, f"user{i}") for i in range(n)]
    async with FakeDiscord(users=users) as fake, patch_discord(fake):
        from platforms.discord_bot import DiscordAdapter

        DiscordAdapter.client_options = {"guild_ready_timeout": 0.05}
        env = _env(provider, data, SWITCHBOARD_DISCORD__TOKEN=fake.token, SWITCHBOARD_DISCORD__ACCESS="open",
                   SWITCHBOARD_DISCORD__GUILD_MODE="all", SWITCHBOARD_DISCORD__EDIT_INTERVAL_S="1",
                   SWITCHBOARD_DISCORD__REGISTER_COMMANDS="false")
        daemon = Daemon(load_config(None, env))
        await daemon.start()
        try:
            while not daemon.adapters["discord"].health().ok:
                await asyncio.sleep(0.05)
            dms = [fake.dm_channel_id(user.id) for user in users]  # one DM session per user

            async def say(i: int, text: str) -> None:
                await fake.dispatch_message(dms[i], text, author_id=users[i].id, author_name=users[i].username)

            async def press(i: int) -> None:
                found = _discord_button(fake.messages(dms[i]))
                assert found is not None, "no Stop button"
                await fake.push_component_interaction(dms[i], found[0], found[1], user_id=users[i].id)

            if button:
                return await _measure(n, port, say, lambda i: _discord_button(fake.messages(dms[i])) is not None,
                                      press)
            return await _measure(n, port, say, lambda i: bool(fake.messages(dms[i])))
        finally:
            await daemon.stop()


async def main(n: int) -> None:
    port = free_port()
    provider = subprocess.Popen([sys.executable, "-m", "tests.fakes.openai_provider", "--port", str(port),
                                 "--delay", "0.05", "--words", "2000"], stdout=subprocess.PIPE)
    assert provider.stdout is not None
    provider.stdout.readline()
    lines = ["| measure                  |     N | stops |  p50 ms |  p99 ms |  max ms |",
             "|--------------------------|------:|------:|--------:|--------:|--------:|"]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = f"http://127.0.0.1:{port}/v1"
            lines.append(row("telegram /stop → close", n, await telegram(n, base, port, Path(tmp) / "tg")))
            lines.append(row("discord /stop → close", n, await discord(n, base, port, Path(tmp) / "dc")))
            lines.append(row("telegram button → close", n,
                             await telegram(n, base, port, Path(tmp) / "tgb", button=True)))
            lines.append(row("discord button → close", n, await discord(n, base, port, Path(tmp) / "dcb", button=True)))
    finally:
        provider.terminate()
        provider.wait()
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50, help="concurrent chats per adapter")
    asyncio.run(main(parser.parse_args().n))
