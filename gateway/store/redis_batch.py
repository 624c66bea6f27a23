"""Scripts called in the same turn of the event loop go to Redis together: one pipeline (no MULTI:
each script is atomic on its own, and the calls are unrelated), so many sessions writing at once
cost one socket write and one pooled connection instead of one each. A call waits for nothing
but the end of the loop's current turn.

Each call gets its own result or its own error (a fenced write is refused alone; a call whose text
cannot be encoded fails alone, the others sent one by one). A script Redis does not know — it
restarted empty — is sent again whole (EVAL), as redis-py's `Script` does; the pipeline did not
run it. A dropped connection is retried by the pool's policy, the whole pipeline
again: every write sent this way carries a token that makes a second application a no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

Call = tuple[AsyncScript, Sequence[str], Sequence[Any], "asyncio.Future[Any]"]


class ScriptBatch:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._queued: list[Call] = []
        self._flushing: set[asyncio.Task[None]] = set()

    async def run(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """`script(keys, args)`, sent with whatever else is called in this turn of the loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self._queued:
            loop.call_soon(self._flush)
        self._queued.append((script, keys, args, fut))
        return await fut

    def _flush(self) -> None:
        calls, self._queued = self._queued, []
        calls = [c for c in calls if not c[3].done()]  # a caller cancelled before the send: not sent
        if not calls:
            return
        task = asyncio.get_running_loop().create_task(self._send(calls))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _send(self, calls: list[Call]) -> None:
        try:
            if len(calls) == 1:  # nothing to batch: redis-py's own call (EVALSHA, EVAL if unknown)
                script, keys, args, fut = calls[0]
                _settle(fut, await script(keys=keys, args=args))
                return
            pipe = self._redis.pipeline(transaction=False)
            for script, keys, args, _ in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            try:
                results = await pipe.execute(raise_on_error=False)
            except (RedisError, OSError):
                raise
            except Exception:  # not Redis's: e.g. one call's text cannot be encoded, so nothing was sent
                await self._one_by_one(calls)
                return
            unknown = []
            for call, result in zip(calls, results, strict=True):
                if isinstance(result, NoScriptError):
                    unknown.append(call)
                else:
                    _settle(call[3], result)
            await self._one_by_one(unknown)
        except BaseException as exc:
            for *_, fut in calls:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            if not isinstance(exc, Exception):
                raise

    @staticmethod
    async def _one_by_one(calls: list[Call]) -> None:
        """Each call alone, with its own result or error."""
        for script, keys, args, fut in calls:
            try:
                result = await script(keys=keys, args=args)
            except Exception as exc:
                result = exc
            _settle(fut, result)

    async def close(self) -> None:
        """Wait for what was sent (its callers are waiting for it too)."""
        if self._flushing:
            await asyncio.wait(list(self._flushing))


def _settle(fut: asyncio.Future[Any], result: Any) -> None:
    if fut.done():  # its caller was cancelled meanwhile
        return
    if isinstance(result, Exception):
        fut.set_exception(result)
    else:
        fut.set_result(result)
