"""Store backends (the `Store` port of gateway.core.ports): SQLite for one process, Redis for clusters."""
