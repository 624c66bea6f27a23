"""`switchboard` command line: run the daemon, check a config."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from gateway import __version__
from gateway.config import Config, ConfigError, load_config, render
from gateway.logs import setup_logging


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchboard", description="Connect LLM agents to chat platforms.")
    p.add_argument("--version", action="version", version=f"switchboard {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the daemon")
    check = sub.add_parser("check", help="validate a config and print the effective settings")
    for sp in (run, check):
        sp.add_argument("--config", "-c", default=os.environ.get("SWITCHBOARD_CONFIG"),
                        help="TOML config file (default: $SWITCHBOARD_CONFIG, else built-in defaults)")
    pairing = sub.add_parser("pairing", help="approve chat users who asked for access")
    pairing.add_argument("action", choices=["approve", "list"])
    pairing.add_argument("code", nargs="?", help="the 8-character code the user was given")
    pairing.add_argument("--config", "-c", default=os.environ.get("SWITCHBOARD_CONFIG"))
    run.add_argument("--log-format", choices=["json", "text"], help="override log.format")
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override log.level")
    return p


def _load(path: str | None) -> Config:
    return load_config(path)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = _load(args.config)
    except ConfigError as exc:
        print(f"switchboard: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "check":
        print(render(config), end="")
        return 0
    if args.command == "pairing":
        return asyncio.run(_pairing(config, args.action, args.code))
    if args.log_format:
        config.log.format = args.log_format
    if args.log_level:
        config.log.level = args.log_level
    setup_logging(config.log.level, config.log.format)
    from gateway.daemon import Daemon

    try:
        asyncio.run(Daemon(config).run())
    except OSError as exc:  # e.g. the port is taken: one clear line, not a traceback
        print(f"switchboard: cannot start: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


async def _pairing(config: Config, action: str, code: str | None) -> int:
    from pathlib import Path

    from gateway.access import CODE_TTL_S
    from gateway.store.sqlite import SqliteStore

    store = SqliteStore(Path(config.store.data_dir) / "switchboard.db")
    await store.open()
    try:
        if action == "list":
            pending, paired = await store.pairing_state()
            for c, platform, user_id, name, _at in pending:
                print(f"pending  {c}  {platform}:{user_id}  {name}")
            for platform, user_id, name in paired:
                print(f"paired   {platform}:{user_id}  {name}")
            return 0
        if not code:
            print("switchboard: pairing approve needs the CODE", file=sys.stderr)
            return 2
        approved = await store.approve_pairing(code.strip().upper(), ttl_s=CODE_TTL_S)
        if approved is None:
            print(f"switchboard: no pending pairing code {code!r} (codes expire after an hour)", file=sys.stderr)
            return 1
        platform, user_id, name = approved
        print(f"approved {name} ({platform}:{user_id})")
        return 0
    finally:
        await store.close()
