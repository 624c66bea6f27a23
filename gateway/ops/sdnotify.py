"""systemd's notify protocol (sd_notify), spoken directly: one datagram per message, no dependency.

`Notifier` does nothing when `NOTIFY_SOCKET` is unset, so the daemon can call it unconditionally.
`Watchdog` sends `WATCHDOG=1` from the event loop itself and only while the loop keeps its timers:
a blocked or starved loop stops the pings and systemd's `WatchdogSec=` kills the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping, MutableMapping

from gateway.core.cancellation import cancel_and_wait

log = logging.getLogger(__name__)

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def socket_address(value: str) -> str | None:
    """`NOTIFY_SOCKET` as an AF_UNIX address: a path, or "@name" for the abstract namespace."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # e.g. "vsock:…" (VMs): not something a service on a host gets


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, the clock systemd compares `MONOTONIC_USEC=` against."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def watchdog_interval(env: Mapping[str, str] | None = None, *, pid: int | None = None) -> float | None:
    """Seconds from `WATCHDOG_USEC`, or None when there is no watchdog for this process."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    owner = env.get("WATCHDOG_PID")
    if owner:  # set by systemd to the main pid; any other process must not ping
        try:
            if int(owner) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return usec / 1_000_000


class Notifier:
    """Sends sd_notify messages; every method returns whether a datagram went out and never raises."""

    def __init__(self, notify_socket: str | None, *, watchdog_usec: str | None = None,
                 watchdog_pid: str | None = None) -> None:
        self._address = socket_address(notify_socket) if notify_socket else None
        if notify_socket and self._address is None:
            log.debug("sd_notify: unsupported NOTIFY_SOCKET %r, notifications off", notify_socket)
        self._env = {k: v for k, v in (("WATCHDOG_USEC", watchdog_usec), ("WATCHDOG_PID", watchdog_pid)) if v}
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None, *, unset: bool = True) -> Notifier:
        """Read `NOTIFY_SOCKET`/`WATCHDOG_*` and (by default) remove them from `env`, so tool
        subprocesses do not inherit them and cannot speak for the service."""
        env = os.environ if env is None else env
        values = {k: env.get(k) for k in _ENV_KEYS}
        if unset:
            for key in _ENV_KEYS:
                env.pop(key, None)
        return cls(values["NOTIFY_SOCKET"], watchdog_usec=values["WATCHDOG_USEC"],
                   watchdog_pid=values["WATCHDOG_PID"])

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send "KEY=value" lines as one datagram."""
        if self._address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode()
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.setblocking(False)  # a full receive queue must never stall the event loop
                self._sock = sock
            self._sock.sendto(payload, self._address)
        except OSError as exc:  # no listener, queue full, socket gone: systemd's problem, not ours
            log.debug("sd_notify %r failed: %s", assignments[0], exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Start-up (or a reload) is complete."""
        return self.notify("READY=1", *_status(status))

    def status(self, text: str) -> bool:
        """A one-line status shown by `systemctl status`."""
        return self.notify(*_status(text))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def reloading(self, status: str | None = None) -> bool:
        """A reload began; `Type=notify-reload` needs the timestamp to match it to its SIGHUP.
        Follow it with `ready()` when the reload is done (or was rejected)."""
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}", *_status(status))

    def watchdog_ping(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more before the current start/stop/reload timeout fires."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def watchdog_interval(self) -> float | None:
        """`WatchdogSec=` in seconds as systemd passed it to this process, else None."""
        if not self.enabled:
            return None
        return watchdog_interval(self._env)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    return ("STATUS=" + " ".join(text.split()),)  # a newline would start a new assignment


class Watchdog:
    """Pings `WATCHDOG=1` every `interval / 2` from the event loop, but only if the loop kept time.

    A heartbeat wakes every `tick` seconds and records how late it woke. When a ping is due and
    any wake-up since the previous ping was more than `max_lag` late, the ping is skipped: the loop
    was blocked (or starved), and systemd should see that rather than a loop that caught up.
    """

    def __init__(self, notifier: Notifier, interval: float | None = None, *,
                 max_lag: float | None = None, tick: float | None = None) -> None:
        self.notifier = notifier
        self.interval = interval if interval is not None else notifier.watchdog_interval()
        period = self.interval / 2 if self.interval else 0.0
        self.period = period
        self.tick = tick if tick is not None else min(1.0, period / 4)
        self.max_lag = max_lag if max_lag is not None else period / 2
        self.pings = 0
        self.skipped = 0
        self.worst_lag = 0.0  # the largest lag seen, for status and metrics
        self._task: asyncio.Task[None] | None = None

    @property
    def active(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Begin pinging (needs a running loop); a no-op without a watchdog interval."""
        if not self.interval or not self.notifier.enabled or self.active:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sd-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._ping()  # the first one right away: systemd's timer starts at READY=1
        next_ping = loop.time() + self.period
        window_lag = 0.0
        while True:
            due = loop.time() + self.tick
            await asyncio.sleep(self.tick)
            now = loop.time()
            lag = max(0.0, now - due)
            window_lag = max(window_lag, lag)
            self.worst_lag = max(self.worst_lag, lag)
            if now < next_ping:
                continue
            if window_lag <= self.max_lag:
                self._ping()
            else:
                self.skipped += 1
                log.warning("event loop was blocked for %.1f s: watchdog ping withheld", window_lag)
            window_lag = 0.0
            next_ping = now + self.period

    def _ping(self) -> None:
        if self.notifier.watchdog_ping():
            self.pings += 1
