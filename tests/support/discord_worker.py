"""`python -m tests.support.discord_worker run …`: the real `switchboard` command, with discord.py
pointed at a fake Discord (as `patch_discord` does in the test process) — what worker processes of
a cluster test need, since a worker has no setting for Discord's addresses.

`FAKE_DISCORD_URL` is the fake's base URL (`http://127.0.0.1:PORT`). discord.py's waits are
shortened as the in-process tests shorten them (2 s for guilds before on_ready, 5 s between
IDENTIFYs), and workers compare their shards with their fair share every second, not every 5 s.
"""

from __future__ import annotations

import os

import discord.gateway
import discord.http
import yarl

from platforms.discord_bot import DiscordAdapter
from platforms.discord_connection import DiscordConnection

if __name__ == "__main__":
    base = os.environ["FAKE_DISCORD_URL"]
    discord.http.Route.BASE = f"{base}/api/v10"
    discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(base.replace("http://", "ws://", 1) + "/gateway-ws")
    DiscordAdapter.client_options = {"guild_ready_timeout": 0.05}
    DiscordAdapter.reidentify_delay_s = 0.0
    DiscordConnection.BALANCE_EVERY_S = 1.0

    from gateway.ops.cli import main

    raise SystemExit(main())
