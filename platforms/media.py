"""Fetching attachments for a turn, and the local copies a replay reuses.

Runs in the turn's task: a `/stop`, a new message that interrupts, or the turn's timeout cancels
a download like any other I/O (the connection is closed at once through `Run.on_cancel`). Every
download is streamed with a byte limit and a timeout. A copy of what was fetched is kept under
`<data_dir>/media/<tenant>/` (a folder per tenant, named by a hash of its name), named by the
SHA-256 of the platform and its file reference (a Telegram file id, a Discord attachment URL, or
for inline data its own hash), so a message replayed after a restart is read from disk instead of
downloaded again. A stateless turn keeps no copy (nothing replays it). Copies older than the
retention period are deleted, and each tenant's copies are held to its quota (`quotas.media_mb`):
past it, the tenant's least recently used copies go (a copy is only a replay's shortcut). Copies
are 0600 in folders of 0700.

Error texts never contain a download URL: Telegram's carry the bot token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import aiohttp

from gateway.core.attachments import MB, Attachment, MediaPart, MediaSettings, human_size, limit_for, note
from gateway.core.cancellation import get_run
from gateway.core.quotas import tenant_of
from platforms.base import Adapter
from platforms.errors import explain

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 3600.0
CHUNK = 64 * 1024


class MediaError(Exception):
    """An attachment could not be fetched; the text is safe to show (no URL, no token)."""


def sniff_image(data: bytes) -> str | None:
    """The image type the bytes really are (declared types are not trusted), or None."""
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def inline_text(att: Attachment, data: bytes, budget: int) -> MediaPart:
    """A text file for the model: its name, then its text fenced, cut to `budget` characters."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return note(att, "it is not UTF-8 text")
    if "\x00" in text:
        return note(att, "it is a binary file, not text")
    cut = ""
    if len(text) > budget:
        cut = f"\n[… cut: the first {budget:,} of {len(text):,} characters]"
        text = text[:budget]
    fence = "```"
    while fence in text:
        fence += "`"
    return MediaPart("text", att, text=f"File {att.name} ({att.mime}, {human_size(len(data))}):\n"
                                        f"{fence}\n{text}\n{fence}{cut}")


class MediaStore:
    """The daemon's `MediaLoader`: local copies first, else the platform's download."""

    def __init__(self, settings: MediaSettings, directory: Path, sources: Mapping[str, Adapter], *,
                 quota: Callable[[str], float] | None = None) -> None:
        """`quota(tenant)`: the bytes of copies a tenant may keep (0: no limit), read at each copy."""
        self.settings = settings
        self.directory = directory
        self._sources = sources
        self._quota = quota
        self._session: aiohttp.ClientSession | None = None
        self._pruned_at = 0.0
        self.downloads = 0  # fetched from a platform (not from a local copy)
        self._kept = _Kept()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def load(self, platform: str, attachments: Sequence[Attachment], *,
                   keep: bool = True) -> tuple[MediaPart, ...]:
        if time.monotonic() - self._pruned_at > PRUNE_EVERY_S:
            self._pruned_at = time.monotonic()
            await asyncio.to_thread(self.prune)
        parts = []
        for att in attachments:
            try:
                data = await self._bytes(platform, att, keep)
            except MediaError as exc:
                log.info("%s: attachment %s not read: %s", platform, att.name, explain(exc))
                parts.append(note(att, str(exc)))
                continue
            parts.append(self._part(att, data))
        return tuple(parts)

    def _part(self, att: Attachment, data: bytes) -> MediaPart:
        if att.kind == "image":
            mime = sniff_image(data)
            if mime is None or mime not in self.settings.image_types:
                return note(att, "it is not a JPEG, PNG, GIF or WebP image")
            return MediaPart("image", att, data=data, mime=mime, tokens=self.settings.image_tokens)
        return inline_text(att, data, self.settings.inline_chars)

    def path_for(self, platform: str, att: Attachment) -> Path:
        """Where the copy of `att` is kept: in the folder of the current run's tenant."""
        return self._folder(self._tenant(platform)) / hashlib.sha256(f"{platform}\0{att.ref}".encode()).hexdigest()

    def _folder(self, tenant: str) -> Path:
        return self.directory / hashlib.sha256(tenant.encode()).hexdigest()[:16]

    @staticmethod
    def _tenant(platform: str) -> str:
        run = get_run()
        return tenant_of(platform, run.tenant if run is not None else None)

    def _budget(self, platform: str) -> int:
        return int(self._quota(self._tenant(platform)) * MB) if self._quota is not None else 0

    async def _bytes(self, platform: str, att: Attachment, keep: bool = True) -> bytes:
        limit = limit_for(att, self.settings)
        path = self.path_for(platform, att)
        budget = self._budget(platform)
        if att.data is not None:  # came inline (a data: URL): kept so a replay finds it
            if keep:
                await asyncio.to_thread(self._keep, path, att.data, budget)
            return att.data
        cached = await asyncio.to_thread(self._read, path, limit)
        if cached is None:  # kept by a version that had one folder for every tenant
            cached = await asyncio.to_thread(self._read, self.directory / path.name, limit)
        if cached is not None:
            return cached
        source = self._sources.get(platform)
        if source is None or att.ref.startswith("sha256:"):
            raise MediaError("it is no longer available")
        timeout = self.settings.download_timeout_s
        try:
            async with asyncio.timeout(timeout):
                url = await source.attachment_url(att)
                data = await self._download(url, limit)
        except LookupError as exc:
            raise MediaError(str(exc)) from None
        except TimeoutError:
            raise MediaError(f"the download took longer than {timeout:g} s") from None
        self.downloads += 1
        if keep:
            await asyncio.to_thread(self._keep, path, data, budget)
        return data

    async def _download(self, url: str, limit: int) -> bytes:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        run = get_run()
        try:
            async with self._session.get(url, allow_redirects=True) as resp:
                with run.on_cancel(resp.close) if run else contextlib.nullcontext():
                    if resp.status != 200:
                        raise MediaError(f"the platform answered HTTP {resp.status}")
                    if resp.content_length is not None and resp.content_length > limit:
                        raise MediaError(f"it is over the {human_size(limit)} limit")
                    data = bytearray()
                    async for chunk in resp.content.iter_chunked(CHUNK):
                        data += chunk
                        if len(data) > limit:  # the declared size was missing or wrong
                            raise MediaError(f"it is over the {human_size(limit)} limit")
                    return bytes(data)
        except aiohttp.ClientError as exc:  # never str(exc): it may carry the URL (and a token)
            raise MediaError(f"the download failed ({type(exc).__name__})") from None

    @staticmethod
    def _read(path: Path, limit: int) -> bytes | None:
        try:
            if path.stat().st_size > limit:
                return None
            return path.read_bytes()
        except OSError:
            return None

    def _keep(self, path: Path, data: bytes, budget: int = 0) -> None:
        """A local copy for replays, within the tenant's `budget` of bytes (0: none); a failure to
        write one only costs a later download."""
        try:
            self._kept.keep(path, data, budget)
        except OSError as exc:
            log.warning("could not keep a copy of an attachment: %s", exc.strerror)

    def usage(self, folder: Path) -> int:
        """Bytes of copies kept in a tenant's folder."""
        return self._kept.usage(folder)

    def prune(self) -> int:
        """Delete copies older than `retention_hours` (0 keeps them); returns how many went."""
        hours = self.settings.retention_hours
        if hours <= 0 or not self.directory.is_dir():
            return 0
        cutoff = time.time() - hours * 3600
        gone = 0
        for folder in [self.directory, *(Path(e.path) for e in os.scandir(self.directory) if e.is_dir())]:
            for entry in os.scandir(folder):
                with contextlib.suppress(OSError):
                    if entry.is_file() and entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        gone += 1
        self._kept.forget()
        if gone:
            log.info("deleted %d stored attachment(s) older than %g h", gone, hours)
        return gone


class _Kept:
    """What each tenant's folder holds (learnt from the disk on first use), and the rule that keeps
    it within the tenant's budget. Called from threads: one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._folders: dict[Path, dict[str, int]] = {}  # folder -> name -> size, least recently used first

    def keep(self, path: Path, data: bytes, budget: int) -> None:
        with self._lock:
            held = self._held(path.parent)
            if path.name in held:
                path.touch()
                held[path.name] = held.pop(path.name)  # most recently used now
                return
            if budget and len(data) > budget:
                log.info("an attachment of %d bytes is not kept: over its tenant's media quota", len(data))
                return
            while budget and held and sum(held.values()) + len(data) > budget:
                oldest = next(iter(held))
                with contextlib.suppress(FileNotFoundError):
                    (path.parent / oldest).unlink()
                del held[oldest]
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
                out.write(data)
            os.replace(tmp, path)
            held[path.name] = len(data)

    def usage(self, folder: Path) -> int:
        with self._lock:
            return sum(self._held(folder).values())

    def forget(self) -> None:
        with self._lock:
            self._folders.clear()

    def _held(self, folder: Path) -> dict[str, int]:
        held = self._folders.get(folder)
        if held is None:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            found = []
            for entry in os.scandir(folder):
                with contextlib.suppress(OSError):
                    if entry.is_file() and not entry.name.endswith(".tmp"):
                        st = entry.stat()
                        found.append((st.st_mtime, entry.name, st.st_size))
            held = self._folders[folder] = {name: size for _, name, size in sorted(found)}
        return held
