"""Free TCP ports for test servers, from below the kernel's ephemeral range.

A port from `bind(0)` is an ephemeral one: between the moment it is handed out and the moment the
server binds it, any outgoing connection on the machine (the tests make thousands; so does
everything else running there) may take it as its source port — and a Redis restarted on "its"
port finds it taken. Below the ephemeral range only listeners bind, so a port checked free stays
free, barring another listener picking the same number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    high = _ephemeral_low()
    low = max(1024, high - 12_000)
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # that range is crowded: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
