"""Session leases as Redis itself saw them: a MONITOR connection on the chaos Redis, kept in a
process of its own, records every lease write the lease scripts make (agent_cache/leases.py).

`redis-cli monitor` prints each command as the server runs it, with the server's wall-clock time;
a Lua script's own calls follow the script's EVALSHA line as `[0 lua] "HSET" ...`. Only three of
them change a session's lease (`sb:{s:<session key>}:lease`): HSET token/worker/fence (an
acquisition, with its fencing number), PEXPIRE (the acquisition's TTL, a renewal, or a holder
extending its own lease) and DEL (a release). The lease scripts take the caller's token as their
first ARGV, so the EVALSHA line before a PEXPIRE or DEL says whose lease it was.

The monitor runs `redis-cli` in a shell loop: when the harness kills Redis the connection drops
and the loop connects again as soon as the restarted server answers (every 10 ms until then);
the times it was not connected are logged ("connect"/"lost" lines), so the checker can tell a
lease write it cannot have seen.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from tests.chaos.records import Incarnation, LeaseEvent, session_of_key
from tests.support.spawn import Group

# Lines kept: lease writes made by scripts, the EVALSHA lines that name a lease key (the caller's
# token), redis-cli's "OK" when MONITOR is on, and the loop's own connect/lost marks.
KEEP = r'lua\] "(hset|pexpire|del)" "[^"]*:lease"|"evalsha?" .*:lease"|^OK|^(connect|lost) '
# Ends by itself once the harness that started it is gone (a soak killed hard cannot end it), and
# retries a Redis that is down 20 times a second, not as fast as it can fork.
LOOP = """
while kill -0 {parent} 2>/dev/null; do
  echo "connect $(date +%s.%N)"
  {cli} -p {port} monitor 2>/dev/null | grep --line-buffered -iE '{keep}'
  echo "lost $(date +%s.%N)"
  sleep 0.05
done
"""
LINE = re.compile(r'^(?P<at>\d+\.\d+) \[\d+ (?P<who>[^\]]+)\] (?P<rest>.*)$')
ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
LEASE_KEY = re.compile(r"^sb:\{s:(?P<key>.*)\}:lease$")


class LeaseMonitor:
    """The MONITOR loop's process (one process group, ended with `stop`)."""

    def __init__(self, port: int, path: Path) -> None:
        self.port = port
        self.path = path
        self.proc: Group | None = None

    def start(self) -> None:
        cli = shutil.which("redis-cli") or "redis-cli"
        script = LOOP.format(cli=cli, port=self.port, keep=KEEP, parent=os.getpid())
        with self.path.open("ab") as out:
            self.proc = Group(["bash", "-c", script], stdout=out, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.end()


def parse(text: str, *, clock_offset: float, incarnations: dict[str, Incarnation], ttl_s: float
          ) -> tuple[list[LeaseEvent], list[tuple[float, float | None]]]:
    """The lease events and the times the monitor was not connected ((lost, connected again)),
    from the monitor's output; times on our monotonic clock (`clock_offset`: wall minus monotonic).
    A token is named by the incarnation of its worker id that was running when it was first seen."""
    events: list[LeaseEvent] = []
    gaps: list[tuple[float, float | None]] = []
    lost: float | None = None
    connecting: float | None = None
    caller_token = ""
    names: dict[str, str] = {}
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()  # cut off mid-line when the monitor was ended
    for line in lines:
        if line.startswith(("connect ", "lost ")):
            word, _, at = line.partition(" ")
            t = float(at) - clock_offset
            if word == "connect":
                connecting = t
            elif lost is None:
                lost = t
            continue
        if line == "OK":  # monitoring again
            if lost is not None:
                gaps.append((lost, connecting))
            lost = None
            continue
        m = LINE.match(line)
        if m is None:
            continue
        args = ARG.findall(m["rest"])
        if not args:
            continue
        if m["who"] != "lua":
            caller_token = _caller_token(args)
            continue
        event = _event(args, float(m["at"]) - clock_offset, caller_token, ttl_s)
        if event is not None:
            event.holder = names.setdefault(event.token, _incarnation(event.token, event.at, incarnations))
            events.append(event)
    if lost is not None:
        gaps.append((lost, None))
    return events, gaps


def _caller_token(args: list[str]) -> str:
    """ARGV[1] of an EVAL/EVALSHA line: the caller's lease token in every lease script."""
    if args[0].lower() not in ("evalsha", "eval") or len(args) < 3:
        return ""
    try:
        numkeys = int(args[2])
    except ValueError:
        return ""
    rest = args[3 + numkeys:]
    return rest[0] if rest else ""


def _event(args: list[str], at: float, caller_token: str, ttl_s: float) -> LeaseEvent | None:
    command = args[0].lower()
    key = LEASE_KEY.match(args[1]) if len(args) > 1 else None
    if key is None:
        return None
    session = session_of_key(key["key"])
    if command == "hset":
        fields = dict(zip(args[2::2], args[3::2], strict=False))
        try:
            fence = int(float(fields.get("fence", "")))
        except ValueError:
            fence = None
        return LeaseEvent(at, session, "acquire", fields.get("token", caller_token), fence, ttl_s)
    if command == "pexpire":
        try:
            ttl = int(args[2]) / 1000
        except (IndexError, ValueError):
            ttl = ttl_s
        return LeaseEvent(at, session, "extend", caller_token, None, ttl)
    if command == "del":
        return LeaseEvent(at, session, "release", caller_token, None, 0.0)
    return None


def _incarnation(token: str, at: float, incarnations: dict[str, Incarnation]) -> str:
    worker_id = token.split("/", 1)[0]
    running = [inc for inc in incarnations.values() if inc.worker_id == worker_id and inc.started_at <= at
               and (inc.ended_at is None or at <= inc.ended_at)]
    return max(running, key=lambda inc: inc.started_at).name if running else token
