"""Web chat session ids: the browser's cookie is a credential, never an identifier.

The session id is a keyed hash (HMAC-SHA256 under a server secret) of the cookie, so the session
key, the logs, the metrics, the console and the admin API can name a session without handing out
the means to open it: the cookie cannot be recovered from the id, and an id sent back as a cookie
is just another, empty session. The secret is `[webchat] session_secret` when set, else shared
through Redis in cluster mode, else made once and kept in `data_dir/webchat-secret` (mode 0600).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRET_FILE = "webchat-secret"


def session_id(secret: bytes, cookie: str) -> str:
    """The id of the session a cookie opens: 128 bits of HMAC-SHA256, hex."""
    return hmac.new(secret, cookie.encode(), hashlib.sha256).hexdigest()[:32]


def load_or_create(data_dir: Path) -> bytes:
    """The secret kept in the data dir, made on first use. Two daemons starting at once on the
    same dir agree: the file appears whole (hard link of a finished temp file) or not at all."""
    path = data_dir / SECRET_FILE
    with contextlib.suppress(FileNotFoundError):
        return _read(path)
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = data_dir / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        with contextlib.suppress(FileExistsError):  # someone else's came first: theirs counts
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return _read(path)


def _read(path: Path) -> bytes:
    value = path.read_text().strip()
    if len(value) < 32:
        raise ValueError(f"{path} holds no usable web chat secret; delete it to make a new one")
    return value.encode()
