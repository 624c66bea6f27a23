"""Fetching attachments for a turn, and the local copies a replay reuses.

Runs in the turn's task: a `/stop`, a new message that interrupts, or the turn's timeout cancels
a download like any other I/O (the connection is closed at once through `Run.on_cancel`). Every
download is streamed with a byte limit and a timeout. A copy of what was fetched is kept under
`<data_dir>/media/`, named by the SHA-256 of the platform and its file reference (a Telegram
file id, a Discord attachment URL, or for inline data its own hash), so a message replayed after
a restart is read from disk instead of downloaded again. Copies older than the retention period
are deleted.

Error texts never contain a download URL: Telegram's carry the bot token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from gateway.core.attachments import Attachment, MediaPart, MediaSettings, human_size, limit_for, note
from gateway.core.cancellation import get_run
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

    def __init__(self, settings: MediaSettings, directory: Path, sources: Mapping[str, Adapter]) -> None:
        self.settings = settings
        self.directory = directory
        self._sources = sources
        self._session: aiohttp.ClientSession | None = None
        self._pruned_at = 0.0
        self.downloads = 0  # fetched from a platform (not from a local copy)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def load(self, platform: str, attachments: Sequence[Attachment]) -> tuple[MediaPart, ...]:
        if time.monotonic() - self._pruned_at > PRUNE_EVERY_S:
            self._pruned_at = time.monotonic()
            await asyncio.to_thread(self.prune)
        parts = []
        for att in attachments:
            try:
                data = await self._bytes(platform, att)
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
        return self.directory / hashlib.sha256(f"{platform}\0{att.ref}".encode()).hexdigest()

    async def _bytes(self, platform: str, att: Attachment) -> bytes:
        limit = limit_for(att, self.settings)
        path = self.path_for(platform, att)
        if att.data is not None:  # came inline (a data: URL): kept so a replay finds it
            await asyncio.to_thread(self._keep, path, att.data)
            return att.data
        cached = await asyncio.to_thread(self._read, path, limit)
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
        await asyncio.to_thread(self._keep, path, data)
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

    def _keep(self, path: Path, data: bytes) -> None:
        """A local copy for replays; a failure to write one only costs a later download."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if path.exists():
                path.touch()
                return
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not keep a copy of an attachment: %s", exc.strerror)

    def prune(self) -> int:
        """Delete copies older than `retention_hours` (0 keeps them); returns how many went."""
        hours = self.settings.retention_hours
        if hours <= 0 or not self.directory.is_dir():
            return 0
        cutoff = time.time() - hours * 3600
        gone = 0
        for entry in os.scandir(self.directory):
            with contextlib.suppress(OSError):
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    gone += 1
        if gone:
            log.info("deleted %d stored attachment(s) older than %g h", gone, hours)
        return gone
