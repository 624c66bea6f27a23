"""What every listener holds its clients to (the `[http]` keys of the same names). Data only: the
CLI's commands read the config without loading the web server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EdgeSettings:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    max_connections_per_address: int = 64  # 0: no cap
    uncapped_addresses: tuple[str, ...] = ("127.0.0.1", "::1")
