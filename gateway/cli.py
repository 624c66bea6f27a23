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
