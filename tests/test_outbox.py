"""The per-chat outbound queues on their own: order, 429s per chat and per kind, withdrawal, closing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.core.cancellation import LEASE_LOST, STOPPED_BY_USER, Run, ToolReason
from platforms.errors import OutboundError, RateLimited
from platforms.outbox import Job, Outbox, Priority, Withdrawn
from tests.fakes.memory_chat import MemoryChat


class Wire:
    """Records calls; a call can be held on the wire until the test releases it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []  # (chat, label, monotonic time)
        self.gates: dict[str, asyncio.Event] = {}
        self.limited: dict[str, list[float]] = {}  # label -> retry_after of the 429s it gets first

    def call(self, chat: str, label: str, *, hold: bool = False) -> Callable[[], Awaitable[str]]:
        if hold:
            self.gates[label] = asyncio.Event()

        async def go() -> str:
            if label in self.gates:
                await self.gates[label].wait()
            if self.limited.get(label):
                raise RateLimited(self.limited[label].pop(0))
            self.calls.append((chat, label, time.monotonic()))
            return label

        return go

    def labels(self, chat: str | None = None) -> list[str]:
        return [label for c, label, _ in self.calls if chat is None or c == chat]


async def test_urgent_jobs_overtake_queued_streaming_ones_fifo_within_a_priority() -> None:
    box, wire = Outbox("t"), Wire()
    first = box.put("a", wire.call("a", "edit1", hold=True), priority=Priority.STREAM, kind="edit")
    await asyncio.sleep(0)
    jobs = [box.put("a", wire.call("a", "edit2"), priority=Priority.STREAM, kind="edit"),
            box.put("a", wire.call("a", "notice"), priority=Priority.NOTICE),
            box.put("a", wire.call("a", "stopped"), priority=Priority.URGENT),
            box.put("a", wire.call("a", "mark"), priority=Priority.URGENT, kind="edit")]
    assert first.running  # on the wire: it is not overtaken, it finishes first
    wire.gates["edit1"].set()
    for job in (first, *jobs):
        await job.wait()
    assert wire.labels() == ["edit1", "stopped", "mark", "notice", "edit2"]


async def test_withdrawn_jobs_never_run_and_say_so() -> None:
    box, wire = Outbox("t"), Wire()
    owner = object()
    busy = box.put("a", wire.call("a", "busy", hold=True))
    mine = [box.put("a", wire.call("a", f"mine{i}"), priority=Priority.STREAM, owner=owner) for i in range(3)]
    other = box.put("a", wire.call("a", "other"), priority=Priority.STREAM)
    assert box.withdraw("a", owner) == 3
    wire.gates["busy"].set()
    await other.wait()
    assert wire.labels() == ["busy", "other"]
    with pytest.raises(Withdrawn):
        await mine[0].wait()
    assert not busy.withdraw()  # it ran: too late


async def test_a_429_holds_back_that_chat_and_kind_only() -> None:
    box, wire = Outbox("t"), Wire()
    wire.limited["send1"] = [0.3]
    began = time.monotonic()
    send1 = box.put("a", wire.call("a", "send1"), attempts=2)
    send2 = box.put("a", wire.call("a", "send2"))
    edit = box.put("a", wire.call("a", "edit"), kind="edit")
    elsewhere = box.put("b", wire.call("b", "send-b"))
    await asyncio.gather(send1.wait(), send2.wait(), edit.wait(), elsewhere.wait())
    at = {label: t - began for _, label, t in wire.calls}
    assert at["edit"] < 0.1 and at["send-b"] < 0.1  # neither waited on chat a's send 429
    assert at["send1"] >= 0.3 and at["send2"] >= at["send1"]  # retried first, in its place
    assert wire.labels("a") == ["edit", "send1", "send2"]
    assert box.busy("a") is False


async def test_a_429_past_the_last_attempt_is_the_jobs_error() -> None:
    box, wire = Outbox("t"), Wire()
    wire.limited["edit"] = [0.01, 0.01]
    job: Job[str] = box.put("a", wire.call("a", "edit"), kind="edit", attempts=2)
    with pytest.raises(RateLimited):
        await job.wait()
    assert wire.calls == []


async def test_run_calls_at_once_in_an_idle_chat_and_queues_in_a_busy_one() -> None:
    box, wire = Outbox("t"), Wire()
    assert await box.run("a", wire.call("a", "inline")) == "inline"
    assert not box.busy("a")
    held = box.put("a", wire.call("a", "held", hold=True))
    await asyncio.sleep(0)
    waiting = asyncio.ensure_future(box.run("a", wire.call("a", "after"), priority=Priority.URGENT))
    queued = box.put("a", wire.call("a", "queued"), priority=Priority.STREAM)
    await asyncio.sleep(0.01)
    assert not waiting.done()  # one call at a time per chat
    wire.gates["held"].set()
    assert await waiting == "after"
    await asyncio.gather(held.wait(), queued.wait())
    assert wire.labels() == ["inline", "held", "after", "queued"]


async def test_close_delivers_what_is_queued_then_refuses_more() -> None:
    box, wire = Outbox("t"), Wire()
    jobs = [box.put("a", wire.call("a", f"j{i}")) for i in range(3)]
    await box.close(1.0)
    assert all(j.done for j in jobs) and wire.labels() == ["j0", "j1", "j2"]
    late = box.put("a", wire.call("a", "late"))
    with pytest.raises(OutboundError):
        await late.wait()


async def test_past_max_chats_idle_chats_are_forgotten_and_busy_or_limited_ones_kept() -> None:
    box, wire = Outbox("t", max_chats=4), Wire()
    held = box.put("held", wire.call("held", "first", hold=True))
    wire.limited["limited"] = [60.0]
    with pytest.raises(RateLimited):
        await box.put("limited", wire.call("limited", "limited")).wait()
    for i in range(40):
        await box.put(f"idle{i}", wire.call(f"idle{i}", f"i{i}")).wait()
        assert len(box._chats) <= box.max_chats  # idle chats do not pile up
    assert box.busy("limited")  # its 429 is still remembered: the chat was kept
    second = box.put("held", wire.call("held", "second"))
    await asyncio.sleep(0.01)
    assert not second.done  # still one call at a time in that chat: its queue was kept
    wire.gates["first"].set()
    await asyncio.gather(held.wait(), second.wait())
    assert wire.labels("held") == ["first", "second"]


class _Lease:
    """A session's ownership as a run sees it; `lost()` is a pause past the lease's TTL."""

    def __init__(self) -> None:
        self.ours = True

    def __call__(self) -> bool:
        return self.ours

    async def confirm(self) -> bool:
        return self.ours

    def lost(self) -> None:
        self.ours = False


@pytest.mark.parametrize("reason", [STOPPED_BY_USER, LEASE_LOST])
async def test_a_stop_mark_waiting_in_the_outbox_is_not_sent_once_the_session_is_no_longer_ours(
        reason: ToolReason) -> None:
    """The stop mark is decided when the chat's outbox gets to it, not when it was queued: a worker
    paused past its lease while the mark waited behind another call must not edit a chat another
    worker now speaks for (chaos soak, PostgreSQL, seed 13: a tool's status line marked
    "interrupted" 0.4 s after the pause ended, the session's new owner streaming below it)."""
    chat = MemoryChat()
    lease = _Lease()
    msg = chat.message("c1", "hello")
    run = Run("memory:dm:c1", guard=lease)
    reply = chat.open_reply(msg, run)
    await reply.delta("the first words")
    await chat.wait_for(lambda: chat.texts("c1") == ["the first words"])
    held = asyncio.Event()
    busy = chat.outbox.put(chat.outbox_key(msg.chat), held.wait, priority=Priority.URGENT)  # another call on the wire
    await until_running(busy)
    run.cancel(reason)
    stopping = asyncio.create_task(reply.interrupted(reason))
    await asyncio.sleep(0.05)  # the mark is queued behind the call on the wire
    assert not stopping.done()
    lease.lost()  # the worker is paused past its lease; another worker takes the session
    held.set()
    await asyncio.wait_for(stopping, 5)
    await chat.outbox.flush(5)
    assert chat.texts("c1") == ["the first words"], "the mark went out for a session this worker lost"
    assert all(b.edits == 0 for b in chat.bubbles)


async def until_running(job: Job[Any]) -> None:
    for _ in range(500):
        if job.running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the job never started")
