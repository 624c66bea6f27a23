"""`switchboard` command line: run the daemon, check a config, manage the store."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from gateway import __version__
from gateway.core.logs import redactor, setup_logging
from gateway.core.ports import StoreError
from gateway.ops import units
from gateway.ops.config import Config, ConfigError, load_config, render


class _Parser(argparse.ArgumentParser):
    """argparse, with "did you mean" for a mistyped command or action."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{_suggestion(message)}\n")


def _suggestion(message: str) -> str:
    """"did you mean 'pairing'?" for argparse's "invalid choice: 'paring' (choose from …)"."""
    match = re.search(r"invalid choice: '?([^'\s]*)'? \(choose from (.*)\)", message)
    if match is None:
        return ""
    choices = [c.strip(" '") for c in match[2].split(",")]
    close = difflib.get_close_matches(match[1], choices, n=1, cutoff=0.5)
    return f"\n  did you mean {close[0]!r}?" if close else ""


# Each command: (name, one-line help, description, examples). The description and examples make
# up its `switchboard COMMAND --help` page.
_PAGES: dict[str, tuple[str, str, str]] = {
    "run": ("run the daemon",
            "Run the daemon in the foreground until SIGTERM or Ctrl-C: the HTTP listener (web chat, API, "
            "health), the admin listener (console, metrics) and the platforms the config enables. Logs go to "
            "stderr: readable lines on a terminal, JSON lines elsewhere (log.format).",
            "switchboard run\n  switchboard run -c /etc/switchboard/switchboard.toml\n"
            "  switchboard run --log-format text --log-level debug"),
    "check": ("validate a config and print the effective settings",
              "Load the config the way `run` would (file, then SWITCHBOARD_<SECTION>__<KEY> variables, then "
              "credentials) and print every setting with secrets masked; exit 2 naming the first problem.",
              "switchboard check -c /etc/switchboard/switchboard.toml\n"
              "  SWITCHBOARD_AGENT__KIND=openai switchboard check"),
    "pairing": ("approve chat users who asked for access",
                "With access = \"pairing\", a stranger who writes to the bot gets an 8-character code. "
                "ACTION is one of:\n  list     the pending codes and the users already paired\n"
                "  approve  let in the user who was given CODE (codes expire after an hour)\n"
                "Works on the store directly: the daemon need not be running.",
                "switchboard pairing list\n  switchboard pairing approve K7XQ2M9P"),
    "sessions": ("list or stop sessions of the running daemon (admin endpoint)",
                 "Talks to the running daemon's admin listener ([admin] host, port and token). ACTION is one "
                 "of:\n  list  every session: its state, turn age, queue and last interruption\n"
                 "  stop  stop the turn running in session KEY, as the console's Stop button does",
                 "switchboard sessions list\n  switchboard sessions stop telegram:dm:12345"),
    "install-unit": ("write the systemd unit files (switchboard.service, switchboard@.service, switchboard.target)",
                     "Write the systemd units with ExecStart= pointing at this installation's switchboard "
                     "executable, and say what to do next. Warns about an executable or config path the "
                     "units' sandbox (ProtectHome=yes, PrivateTmp=yes) would hide from the service.",
                     "sudo switchboard install-unit\n"
                     "  sudo switchboard install-unit --exec-path /opt/switchboard/bin/switchboard"),
    "status": ("cluster mode: workers, their sessions and ingress leases",
               "Read the cluster's state from Redis ([redis] url): every worker, whether it is alive, the "
               "sessions it owns and the ingress leases it holds.",
               "switchboard status -c /etc/switchboard/switchboard.toml"),
    "store": ("PostgreSQL store: apply schema migrations, copy a store into it",
              "Manage the PostgreSQL store: `migrate` applies the schema migrations to the [store] url "
              "database; `copy` copies a SQLite or Redis store into an empty PostgreSQL database and "
              "verifies it.",
              "switchboard store migrate\n"
              "  switchboard store copy --from sqlite:///var/lib/switchboard/switchboard.db"),
    "export": ("everything stored about one session, as JSON lines on stdout",
               "Print everything the store holds about one session (its conversations, messages and "
               "inbound records) as JSON lines, for a data request or a bug report.",
               "switchboard export --session telegram:dm:12345 > session.jsonl"),
}


def _command(sub: argparse._SubParsersAction[_Parser], name: str) -> _Parser:
    short, description, examples = _PAGES[name]
    parser: _Parser = sub.add_parser(name, help=short, description=description, epilog=f"examples:\n  {examples}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", default=os.environ.get("SWITCHBOARD_CONFIG"), metavar="FILE",
                        help="TOML config file (default: $SWITCHBOARD_CONFIG, else built-in defaults)")


def _parser() -> _Parser:
    p = _Parser(prog="switchboard", description="Connect LLM agents to chat platforms.",
                epilog="Run `switchboard COMMAND --help` for a command's page, with examples.")
    p.add_argument("--version", action="version", version=f"switchboard {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run, check, pairing, sessions, unit, status, store, export = (_command(sub, name) for name in _PAGES)
    pairing.add_argument("action", choices=["approve", "list"], metavar="ACTION", help="list or approve")
    pairing.add_argument("code", nargs="?", help="the 8-character code the user was given (approve)")
    sessions.add_argument("action", choices=["list", "stop"], metavar="ACTION", help="list or stop")
    sessions.add_argument("key", nargs="?", help="the session key, e.g. webchat:dm:… (stop)")
    units.add_arguments(unit)
    store_sub = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    migrate = store_sub.add_parser(
        "migrate", help="apply the schema migrations to the [store] url database",
        description="Apply the schema migrations to the [store] url database (the daemon also does on start).",
        epilog="example:\n  switchboard store migrate -c /etc/switchboard/switchboard.toml",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    copy = store_sub.add_parser(
        "copy", help="copy a SQLite or Redis store into an empty PostgreSQL database, then verify it",
        description="Copy a SQLite or Redis store into an empty PostgreSQL database, then verify it (row counts "
                    "and checksums per table). Stop the daemon first.",
        epilog="examples:\n  switchboard store copy --from sqlite:///var/lib/switchboard/switchboard.db\n"
               "  switchboard store copy --from redis://127.0.0.1:6379/0 --to postgresql://switchboard@db/sb",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    copy.add_argument("--from", dest="source", required=True, metavar="URL",
                      help="sqlite:///path/to/switchboard.db, redis://… or redis+cluster://…")
    copy.add_argument("--to", dest="target", metavar="URL",
                      help="postgresql://… (default: [store] url; a password is better kept there or in PGPASSWORD)")
    export.add_argument("--session", required=True, metavar="KEY", help="session key, e.g. telegram:dm:12345")
    for sp in (run, check, pairing, sessions, status, migrate, copy, export):
        _config_option(sp)
    run.add_argument("--log-format", choices=["json", "text"],
                     help="override log.format (default: text on a terminal, else json)")
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override log.level")
    # What each command does with the loaded config (install-unit needs none: see `main`).
    run.set_defaults(handler=_run)
    check.set_defaults(handler=lambda config, args: _check(config))
    pairing.set_defaults(handler=lambda config, args: asyncio.run(_pairing(config, args.action, args.code)))
    sessions.set_defaults(handler=lambda config, args: asyncio.run(_sessions(config, args.action, args.key)))
    status.set_defaults(handler=lambda config, args: asyncio.run(_status(config)))
    migrate.set_defaults(handler=lambda config, args: asyncio.run(_migrate(config)))
    copy.set_defaults(handler=lambda config, args: asyncio.run(_copy(config, args.source, args.target)))
    export.set_defaults(handler=lambda config, args: asyncio.run(_export(config, args.session)))
    return p


Handler = Callable[[Config, argparse.Namespace], int]  # a command's exit status


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "install-unit":  # needs no config
        return units.command(args)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"switchboard: config error: {exc}", file=sys.stderr)
        return 2
    handler: Handler = args.handler
    try:
        return handler(config, args)
    except StoreError as exc:  # the store named in the config cannot be reached: one line, not a traceback
        print(f"switchboard: store error: {redactor(str(exc))}", file=sys.stderr)
        return 1


def log_format(configured: str, env: Mapping[str, str] | None = None, *, terminal: bool | None = None) -> str:
    """`auto`: readable lines for a person at a terminal; JSON lines for systemd's journal (which
    sets JOURNAL_STREAM and INVOCATION_ID, whatever stderr is), a pipe or a file."""
    if configured != "auto":
        return configured
    env = os.environ if env is None else env
    terminal = sys.stderr.isatty() if terminal is None else terminal
    return "text" if terminal and not ({"JOURNAL_STREAM", "INVOCATION_ID"} & env.keys()) else "json"


def _check(config: Config) -> int:
    """The effective configuration, then what it exposes: warnings, and unsafe settings (exit 2)."""
    print(render(config), end="")
    return 0 if _judged(config) else 2


def _judged(config: Config) -> bool:
    """Print the safety findings on stderr; False if the configuration is unsafe."""
    from gateway.ops.safety import findings

    found = findings(config)
    for line in found.warnings:
        print(f"switchboard: warning: {line}", file=sys.stderr)
    for line in found.unsafe:
        print(f"switchboard: unsafe: {line}", file=sys.stderr)
    return not found.unsafe


def _run(config: Config, args: argparse.Namespace) -> int:
    """The daemon, until it stops; 1 if it cannot start (one line, not a traceback)."""
    if args.log_format:
        config.log.format = args.log_format
    if args.log_level:
        config.log.level = args.log_level
    if not _judged(config):
        return 2  # the units do not restart on 2: a restart would not make it safe
    from gateway.ops.safety import UMASK

    os.umask(UMASK)  # what the daemon creates (the database, its WAL, media) is 0600, as under the units
    setup_logging(config.log.level, log_format(config.log.format))
    from gateway.ops.daemon import Daemon
    from gateway.ops.loop import LoopUnavailable, loop_factory

    try:
        factory = loop_factory(config.daemon.event_loop)
    except LoopUnavailable as exc:
        print(f"switchboard: config error: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(Daemon(config, config_path=args.config).run())
        # Stopped: a signal from now on changes nothing. (Closing the loop gave SIGTERM back its
        # default action, which would turn a clean stop into death by signal, -15.)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    except OSError as exc:  # e.g. the port is taken: one clear line, not a traceback
        print(f"switchboard: cannot start: {redactor(str(exc.strerror or exc))}", file=sys.stderr)
        return 1
    except StoreError as exc:  # e.g. Redis unreachable at start-up
        print(f"switchboard: cannot start: {redactor(str(exc))}", file=sys.stderr)
        return 1
    return 0


async def _pairing(config: Config, action: str, code: str | None) -> int:
    from gateway.core.access import CODE_TTL_S
    from gateway.ops.stores import build_store

    store = build_store(config)
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


async def _sessions(config: Config, action: str, key: str | None) -> int:
    import aiohttp

    admin = config.admin
    base = f"http://{admin.host}:{admin.port}/admin/api"
    headers = {"Authorization": f"Bearer {admin.token.reveal()}"} if admin.token else {}
    try:
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as http:
            if action == "list":
                async with http.get(f"{base}/sessions") as resp:
                    body = await resp.json()
                    if resp.status != 200:
                        print(f"switchboard: {body.get('error', resp.status)}", file=sys.stderr)
                        return 1
                for row in body["sessions"]:
                    last = row["last_interruption"]
                    age = f"{row['turn_age_s']:.0f}s" if row["turn_age_s"] is not None else "-"
                    note = f"  last stop: {last['kind']}: {last['reason']}" if last else ""
                    worker = row.get("worker") or "-"
                    print(f"{row['state']:<8} {age:>6}  q={row['queued']}  {worker:<12} {row['key']}{note}")
                return 0
            if not key:
                print("switchboard: sessions stop needs the session KEY", file=sys.stderr)
                return 2
            async with http.post(f"{base}/sessions/stop", json={"key": key}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    print(f"switchboard: {body.get('error', resp.status)}", file=sys.stderr)
                    return 1
            where = f" on {body['worker']}" if body.get("worker") else ""
            print(f"stopped{where}" if body["stopped"] else f"nothing was running in that session{where}")
            return 0
    except aiohttp.ClientConnectionError:
        print(f"switchboard: no daemon answering on {admin.host}:{admin.port} (is it running?)", file=sys.stderr)
        return 1


def _print_worker(worker: str, beat: dict[str, Any], alive: str | None, sessions: list[str], ingress: list[str],
                  limit: int) -> None:
    """One worker as `switchboard status` lists it: its state, the ingress leases and sessions it holds."""
    import time

    state = f"alive ({alive})" if alive else "DEAD"
    print(f"{worker}  {state}  seen {time.time() - beat['seen_at']:.0f}s ago  "
          f"http {beat.get('http', '?')}  {len(sessions)} session(s)")
    for name in ingress:
        print(f"    ingress  {name}")
    for session in sessions[:limit]:
        print(f"    session  {session}")
    if len(sessions) > limit:
        print(f"    … and {len(sessions) - limit} more")


async def _status(config: Config, limit: int = 50) -> int:
    import json
    from typing import cast

    from redis.asyncio import Redis
    from redis.exceptions import RedisError

    from agent_cache import keys

    if config.redis.url is None:
        print("single-process mode (no [redis] url); see `switchboard sessions list`")
        return 0
    redis = Redis.from_url(config.redis.url.reveal(), decode_responses=True)
    try:
        workers = cast("dict[str, str]", await redis.hgetall(keys.workers()))
        if not workers:
            print("no workers registered")
        # Ingress leases (a Telegram poller, each Discord shard) by their holder now, not as heartbeats last said.
        ingress = sorted({name for raw in workers.values() for name in json.loads(raw).get("ingress", {})})
        holders = {name: cast("str | None", await redis.hget(keys.ingress(name), "worker")) for name in ingress}
        for worker, raw in sorted(workers.items()):
            alive = cast("str | None", await redis.get(keys.worker_alive(worker)))
            listed = cast("set[str]", await redis.smembers(keys.worker_sessions(worker)))
            held = [name for name in ingress if holders[name] == worker]
            _print_worker(worker, json.loads(raw), alive, sorted(listed - set(ingress)), held, limit)
        for name in [name for name in ingress if holders[name] is None]:
            print(f"ingress  {name}: nobody holds it now (a standing-by worker takes it)")
        return 0
    except (RedisError, OSError) as exc:
        print(f"switchboard: cannot read cluster state from Redis ({type(exc).__name__})", file=sys.stderr)
        return 1
    finally:
        await redis.aclose()


async def _migrate(config: Config) -> int:
    from gateway.store.postgres import SCHEMA_VERSION, PostgresSettings, PostgresStore

    if config.store.url is None:
        print("switchboard: store migrate: [store] url is not set (only the PostgreSQL store has a schema "
              "to migrate)", file=sys.stderr)
        return 2
    store = PostgresStore(config.store.url.reveal(), require_fence=False, settings=PostgresSettings(pool_size=1))
    try:
        await store.open()
    except StoreError as exc:
        print(f"switchboard: store error: {redactor(str(exc))}", file=sys.stderr)
        return 1
    await store.close()
    for step in store.applied:
        print(f"applied  {step.version}  {step.description}")
    print(f"schema at version {SCHEMA_VERSION}" + ("" if store.applied else " (already up to date)"))
    return 0


async def _copy(config: Config, source: str, target: str | None) -> int:
    from gateway.store.transfer import TransferError, copy

    if target is None:
        if config.store.url is None:
            print("switchboard: store copy needs --to postgresql://… (or [store] url in the config)", file=sys.stderr)
            return 2
        target = config.store.url.reveal()
    for url in (source, target):
        _redact_url_password(url)
    try:
        report = await copy(source, target, progress=lambda text: print(text, file=sys.stderr))
    except TransferError as exc:
        print(f"switchboard: store copy: {redactor(str(exc))}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line)
    if not report.ok:
        print("switchboard: store copy: the target does not match the source (see MISMATCH above)",
              file=sys.stderr)
        return 1
    print("verified: every table has the same row count and checksum in the source and the target"
          + (" (the target already held this copy; nothing written)" if report.already else ""))
    return 0


def _redact_url_password(url: str) -> None:
    from gateway.store.postgres import url_secrets

    for secret in url_secrets(url):
        redactor.add(secret)


async def _export(config: Config, session: str) -> int:
    import json
    from pathlib import Path

    from gateway.store.transfer import Source, SqliteSource, TransferError, export, open_source

    source: Source
    if config.store.url is not None:
        source = open_source(config.store.url.reveal())
    elif config.redis.url is not None:
        source = open_source(config.redis.url.reveal())
    else:
        source = SqliteSource(Path(config.store.data_dir) / "switchboard.db")
    found = 0
    try:
        await source.open()
        try:
            async for item in export(source, session):
                print(json.dumps(item, ensure_ascii=False))
                found += 1
        finally:
            await source.close()
    except (TransferError, StoreError) as exc:
        print(f"switchboard: export: {redactor(str(exc))}", file=sys.stderr)
        return 1
    if not found:
        print(f"switchboard: export: nothing stored for session {session!r}", file=sys.stderr)
        return 1
    return 0
