"""Relayed turns: a client connected to one worker (the HTTP API, the web chat), its session owned
by another. The owner runs the turn as for any message — busy policy, lane, store, guard — with an
outlet that publishes what it says to the receiving worker's relay stream; the receiving worker
plays those events into the reply its client waits on. A stop from the client's side (a
disconnect) goes to the owner's inbox and cancels that run there.

Invariants:
- Events of one turn are published by one owner, in order, on one stream: the receiver plays them
  in that order, each relay on a task of its own (a slow client holds up only its own turn).
- A relay ends with its `settled` event, or — if its owner dies first — with a retryable failure
  the receiver gives itself: a client never waits on a turn nobody runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from redis.exceptions import RedisError

from agent_cache import keys
from agent_cache.leases import AnyRedis
from agent_cache.tasks import cancel_and_wait
from gateway.core.backoff import Backoff
from gateway.core.cancellation import Run, ToolReason
from gateway.core.messages import ChatRef, InboundMessage
from gateway.core.outage import OutageLog
from gateway.core.ports import NoticeKind, Outlet, Reply

log = logging.getLogger(__name__)

STREAM_MAXLEN = 100_000  # entries kept per relay stream (approximately): minutes of traffic
READ_COUNT = 500
OWNER_GONE = "The worker running this conversation stopped; please try again."
OWNER_GONE_RETRY_S = 2.0
RELAY_LOST = ToolReason.system("part of the answer was lost on its way from the worker running it")
OWNER_GIVEN_UP = ToolReason.system("its client was told the worker running it stopped")

Event = dict[str, Any]


class RelayPublisher:
    """The owner's side: events for other workers' relay streams, written in order, several at a
    time (one pipeline per flush), by one task."""

    def __init__(self, redis: AnyRedis) -> None:
        self._redis = redis
        self._queue: asyncio.Queue[tuple[str, Event]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._outage = OutageLog(log, "relay publisher")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._flush())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    def publish(self, worker: str, event: Event) -> None:
        self._queue.put_nowait((worker, event))

    async def _flush(self) -> None:
        backoff = Backoff(0.05, 1.0)
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < READ_COUNT:
                batch.append(self._queue.get_nowait())
            # Invariant: a batch is written before any later event (order per relay), and is
            # retried until it is: a turn's end lost here would leave its client told to retry an
            # answer that is recorded. A retry after a partial write repeats events; receivers
            # drop repeats by number.
            while True:
                if await self._write(batch):
                    break
                await asyncio.sleep(backoff.step())
            backoff.reset()

    async def _write(self, batch: list[tuple[str, Event]]) -> bool:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker, event in batch:
                    pipe.xadd(keys.relay(worker), {"e": json.dumps(event, ensure_ascii=False)},
                              maxlen=STREAM_MAXLEN, approximate=True)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._outage.failed(type(exc).__name__, f"could not publish {len(batch)} event(s), retrying: {exc}")
            return False
        self._outage.recovered("publishing again")
        return True


class _Channel:
    """One relay's events, numbered from 1 in the order the owner says them (the reply's and the
    notices alike): the receiver drops a repeat and notices a gap."""

    def __init__(self, publisher: RelayPublisher, worker: str, relay_id: str) -> None:
        self._publisher, self._worker, self._id = publisher, worker, relay_id
        self._numbers = itertools.count(1)

    def send(self, kind: str, **fields: Any) -> None:
        self._publisher.publish(self._worker, {"r": self._id, "n": next(self._numbers), "e": kind, **fields})


class RelayReply(Reply):
    """A turn's reply, run on the owner, for a client connected to another worker."""

    def __init__(self, channel: _Channel) -> None:
        self._send = channel.send

    async def delta(self, text: str) -> None:
        self._send("delta", t=text)

    async def finish(self, text: str) -> None:
        self._send("finish", t=text)

    async def interrupted(self, reason: ToolReason) -> None:
        self._send("interrupted", k=reason.kind, x=reason.text)

    async def failed(self, text: str, *, retry_after_s: float | None = None) -> None:
        self._send("failed", t=text, a=retry_after_s)

    async def settled(self, problem: str | None = None) -> None:
        self._send("settled", p=problem)

    def shown_text(self) -> str | None:
        return None  # the client is shown every delta relayed: what the turn gave it


class RelayOutlet:
    """The owner's outlet for one relayed message: the platform's own properties, with replies and
    notices going to the worker the client is connected to."""

    def __init__(self, inner: Outlet, publisher: RelayPublisher, worker: str, relay_id: str) -> None:
        self._inner = inner
        self._channel = _Channel(publisher, worker, relay_id)

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def pushes_anywhere(self) -> bool:
        return self._inner.pushes_anywhere

    @property
    def bot_username(self) -> str | None:
        return self._inner.bot_username

    @property
    def can_steer(self) -> bool:
        return self._inner.can_steer

    @property
    def answers_later(self) -> bool:
        return self._inner.answers_later

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        return RelayReply(self._channel)

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        self._channel.send("notice", t=text, k=kind.value, rk=reason.kind if reason else None,
                           rx=reason.text if reason else None)


@dataclass(eq=False)
class _Link:
    """One relayed turn on the receiving worker."""

    relay_id: str
    owner: str
    msg: InboundMessage
    outlet: Outlet
    reply: Reply
    run: Run
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    token: str | None = None  # the owner's run: what a cancel from here names
    cancel: ToolReason | None = None  # cancelled here before the owner's token was known
    last_event: float = field(default_factory=time.monotonic)
    next_number: int = 1  # the number of the owner's next event (see `_Channel`)


CancelSender = Callable[[str, str, str, ToolReason], Awaitable[None]]  # (owner, session, token, reason)


class RelayReader:
    """The receiving side: this worker's relay stream, read by one task, each relay's events played
    by a task of its own into the reply its client waits on."""

    def __init__(self, redis: AnyRedis, worker_id: str, *, ttl_s: float, send_cancel: CancelSender) -> None:
        self._redis = redis
        self._stream = keys.relay(worker_id)
        self._ttl_s = ttl_s
        self._send_cancel = send_cancel
        self._links: dict[str, _Link] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_id = "$"
        self._outage = OutageLog(log, "relay reader")

    async def start(self) -> list[asyncio.Task[None]]:
        """Read from what is in the stream now on; returns the reader's and the watcher's tasks."""
        with contextlib.suppress(RedisError, OSError):
            newest = cast("list[Any]", await self._redis.xrevrange(self._stream, count=1))
            self._last_id = newest[0][0] if newest else "0-0"
        loop = asyncio.get_running_loop()
        return [loop.create_task(self._read()), loop.create_task(self._watch_owners())]

    def open(self, relay_id: str, owner: str, msg: InboundMessage, outlet: Outlet, run: Run) -> _Link:
        """Register a relay before its message is forwarded (its events may come at once)."""
        link = _Link(relay_id, owner, msg, outlet, outlet.open_reply(msg, run), run)
        self._links[relay_id] = link
        task = asyncio.get_running_loop().create_task(self._play(link))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return link

    def accepted(self, link: _Link, token: str, *, by: str) -> None:
        """Worker `by` took the message as a turn with run `token`."""
        link.token, link.owner = token, by
        if link.cancel is not None:  # the client left before the owner answered
            self._cancel(link, link.cancel)

    def drop(self, link: _Link) -> None:
        """The owner did not take it as a turn (refused, a duplicate, no answer): nothing to play."""
        self._links.pop(link.relay_id, None)
        link.events.put_nowait({"e": "dropped"})

    def close(self) -> None:
        for link in list(self._links.values()):
            self.drop(link)

    def _cancel(self, link: _Link, reason: ToolReason) -> None:
        if link.token is None:
            link.cancel = reason
            return
        task = asyncio.ensure_future(self._send_cancel(link.owner, link.run.session_key, link.token, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self) -> None:
        while True:
            try:
                got = await self._redis.xread({self._stream: self._last_id}, count=READ_COUNT, block=1000)
            except (RedisError, OSError) as exc:
                self._outage.failed(type(exc).__name__, f"reading failed: {type(exc).__name__}")
                await asyncio.sleep(0.5)
                continue
            self._outage.recovered("reading again")
            for _stream, entries in cast("list[tuple[str, list[tuple[str, dict[str, str]]]]]", got or []):
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    self._dispatch(fields)

    def _dispatch(self, fields: dict[str, str]) -> None:
        try:
            event = json.loads(fields["e"])
            link = self._links.get(event["r"])
        except (KeyError, ValueError, TypeError):
            log.warning("dropping a malformed relay event")
            return
        if link is None:  # a relay that ended here already, or another incarnation's
            return
        number = event.get("n", link.next_number)
        if number < link.next_number:  # a repeat: the owner retried a write that had landed
            return
        if number > link.next_number:  # events Redis lost (it restarted without them)
            self._end(link, RELAY_LOST)
            return
        link.next_number += 1
        link.last_event = time.monotonic()
        link.events.put_nowait(event)

    async def _play(self, link: _Link) -> None:
        """Until the relay ends: its events into the client's reply. A cancel of the local run
        (the client went away) is sent to the owner."""
        try:
            with link.run.on_cancel(lambda: self._cancel(link, cast("ToolReason", link.run.reason))):
                while (event := await link.events.get())["e"] not in ("settled", "dropped"):
                    await _apply(link, event)
                if event["e"] == "settled":
                    await link.reply.settled(event.get("p"))
        except Exception:
            log.exception("playing a relayed turn failed", extra={"session": link.run.session_key})
        finally:
            self._links.pop(link.relay_id, None)
            link.run.end()

    async def _watch_owners(self) -> None:
        """A relay whose owner stopped being alive ends here, retryably: its client does not wait
        for events nobody will publish. Gone means no heartbeat for a whole TTL past the key's
        expiry: a Redis that restarted (its keys expired meanwhile, or lost) is missing the key of
        an owner alive and streaming until that owner's next heartbeat, within a third of a TTL."""
        missing_since: dict[str, float] = {}
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            owners = {link.owner for link in self._links.values() if link.token is not None}
            for owner in owners:
                try:
                    alive = await self._redis.exists(keys.worker_alive(owner))
                except (RedisError, OSError):
                    continue  # Redis itself is down: the publisher's side cannot be told either
                if alive:
                    missing_since.pop(owner, None)
                elif time.monotonic() - missing_since.setdefault(owner, time.monotonic()) >= self._ttl_s:
                    self._owner_gone(owner)
            for owner in set(missing_since) - owners:
                del missing_since[owner]

    def _owner_gone(self, owner: str) -> None:
        for link in [x for x in self._links.values() if x.owner == owner]:
            log.warning("the owner of a relayed turn (%s) is gone", owner, extra={"session": link.run.session_key})
            self._cancel(link, OWNER_GIVEN_UP)  # if it lives after all, it must not record the answer as whole
            link.events.put_nowait({"e": "failed", "t": OWNER_GONE, "a": OWNER_GONE_RETRY_S})
            link.events.put_nowait({"e": "settled", "p": None})
            self._links.pop(link.relay_id, None)

    def _end(self, link: _Link, reason: ToolReason) -> None:
        """End a relay here as interrupted (`reason`), and stop its run on the owner."""
        log.warning("a relayed turn ends here: %s", reason.text, extra={"session": link.run.session_key})
        self._cancel(link, reason)
        link.events.put_nowait({"e": "interrupted", "k": reason.kind, "x": reason.text})
        link.events.put_nowait({"e": "settled", "p": None})
        self._links.pop(link.relay_id, None)


async def _notice(link: _Link, event: Event) -> None:
    reason = ToolReason(event["rk"], event["rx"]) if event.get("rk") else None
    await link.outlet.notify(link.msg.chat, event["t"], reply_to=link.msg.message_id,
                             kind=NoticeKind(event["k"]), reason=reason)


# How each event is played into the client's reply (`settled` ends the relay: see `_play`).
_PLAY: dict[str, Callable[[_Link, Event], Awaitable[None]]] = {
    "delta": lambda link, e: link.reply.delta(e["t"]),
    "finish": lambda link, e: link.reply.finish(e["t"]),
    "interrupted": lambda link, e: link.reply.interrupted(ToolReason(e["k"], e["x"])),
    "failed": lambda link, e: link.reply.failed(e["t"], retry_after_s=e.get("a")),
    "notice": _notice,
}


async def _apply(link: _Link, event: Event) -> None:
    play = _PLAY.get(event["e"])
    if play is not None:
        await play(link, event)
