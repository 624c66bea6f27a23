"""File downloads as the fakes serve them: optionally slow (a chunk, then a pause), and recorded —
when each download began and whether it finished or the client hung up mid-way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web


@dataclass
class Download:
    path: str
    opened_at: float
    closed_at: float | None = None
    completed: bool = False
    sent: int = 0  # bytes written before it ended


@dataclass
class FileServing:
    """Shared by a fake's file route: how fast files go out, and every download so far."""

    chunk: int = 64 * 1024
    delay_s: float = 0.0  # pause after each chunk (0: all at once)
    declared_length: bool = True  # send Content-Length (False: chunked, the size unknown up front)

    def __post_init__(self) -> None:
        self.downloads: list[Download] = []
        self._changed = asyncio.Event()

    async def serve(self, request: web.Request, data: bytes) -> web.StreamResponse:
        record = Download(request.path, time.monotonic())
        self.downloads.append(record)
        self._wake()
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        if self.declared_length:
            resp.content_length = len(data)
        try:
            await resp.prepare(request)
            for start in range(0, len(data), self.chunk):
                await resp.write(data[start:start + self.chunk])
                record.sent = min(len(data), start + self.chunk)
                self._wake()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
            await resp.write_eof()
            record.completed = True
        except ConnectionError:  # the client hung up (a stop, a timeout); a cancelled handler: the same
            pass
        finally:
            record.closed_at = time.monotonic()
            self._wake()
        return resp

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until `condition()` holds, re-checked whenever a download starts or ends."""
        async with asyncio.timeout(timeout):
            while not condition():
                await self._changed.wait()
