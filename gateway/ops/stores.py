"""Which store a config names, built without the rest of the daemon: the operator commands
(`switchboard pairing`, `export`) open the store and nothing else, so they start in a fraction of a
second instead of importing every platform client and the MCP SDK."""

from __future__ import annotations

from pathlib import Path

from gateway.core.ports import Store
from gateway.ops.config import Config


def build_store(config: Config, *, retention: bool = False) -> Store:
    """PostgreSQL when `[store] url` is set (in cluster mode with Redis for de-duplication and
    pairing codes), else the shared Redis store in cluster mode, else SQLite in the data dir.
    `retention`: the daemon's own store (the `keep_days` pruning, the disk reserve); the stores of
    CLI commands have neither."""
    if config.store.url is not None:
        from gateway.store.postgres import PostgresStore

        keep_days = config.store.keep_days if retention else 0
        history = PostgresStore(config.store.url.reveal(), require_fence=config.redis.url is not None,
                                keep_days=keep_days)
        if config.redis.url is None:
            return history
        from gateway.store.composite import PostgresClusterStore
        from gateway.store.redis import RedisStore

        return PostgresClusterStore(history, RedisStore(config.redis.url.reveal()))
    if config.redis.url is not None:
        from gateway.store.redis import RedisStore

        return RedisStore(config.redis.url.reveal())
    from gateway.store.sqlite import RESERVE_BYTES, SqliteStore

    return SqliteStore(Path(config.store.data_dir) / "switchboard.db",
                       reserve_bytes=RESERVE_BYTES if retention else 0)


def store_kind(config: Config) -> str:
    """Where history lives, for /readyz and the console."""
    if config.store.url is not None:
        return "postgres+redis" if config.redis.url is not None else "postgres"
    return "redis" if config.redis.url is not None else "sqlite"
