"""The forwarder's wait for an owner's answer: in slices, so a stop, a socket timeout or a Redis
that restarts (empty) mid-wait never turns into an error for the client. Two coordinators in one
process on a real redis-server; the owner's core is a `ClusterEvents` that answers when told."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent_cache import keys
from gateway.agents.echo import EchoAgent
from gateway.agents.tools import ToolRegistry
from gateway.cluster.coordinator import Cluster
from gateway.core.cancellation import GATEWAY_RESTART
from gateway.core.cluster import ClusterUnavailable
from gateway.core.fencing import Fence
from gateway.core.messages import ChatType, InboundMessage, session_key
from gateway.core.metrics import Metrics
from gateway.core.ports import InboundRecord, InboundStatus, Outcome, Outlet, Submitted
from gateway.core.router import Router
from gateway.core.transcript import ChatMessage
from gateway.store.redis import connect
from gateway.store.sqlite import SqliteStore
from tests.fakes.memory_chat import MemoryChat
from tests.support.cluster_events import Working
from tests.support.redis_server import RedisServer
from tests.support.routers import build_router
from tests.support.stopping import stop_or_show_why_not

TTL = 6.0
WAIT_DEADLINE_S = 30.0  # readiness on a busy machine; never a figure asserted on
SOCKET_TIMEOUT_S = 2.0  # the sender's client: shorter than the answer takes in these tests
DOWN_S = 1.5  # Redis stays down longer than redis-py's own retries of a dropped connection (< 0.5 s)


class Holding(Working):
    """The owner's core: takes each forwarded message, but answers only once `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.delivered: list[str] = []

    async def deliver(self, msg: InboundMessage, session: str, hops: int, *,
                      via: Callable[[Outlet], Outlet] | None = None) -> Submitted | None:
        self.delivered.append(msg.message_id)
        self.arrived.set()
        await self.release.wait()
        return Submitted(Outcome.ACCEPTED)


def _message() -> InboundMessage:
    return InboundMessage(platform="telegram", chat_id="42", chat_type=ChatType.DM, user_id="42",
                          user_name="u", message_id="m1", text="hello")


@dataclass
class Pair:
    owner_events: Holding
    sender: Cluster
    running: list[Cluster]

    async def start_owner(self, url: str) -> None:
        owner = Cluster(connect(url, decode_responses=True), "owner", ttl_s=TTL, metrics=Metrics())
        await owner.start(self.owner_events)
        self.running.append(owner)

    def forward(self) -> asyncio.Task[Submitted | None]:
        return asyncio.create_task(self.sender.forward("owner", _message(), "telegram:dm:42", hops=0,
                                                       want_reply=True))


@pytest.fixture
async def pair(redis_server: RedisServer) -> AsyncIterator[Pair]:
    """A sender whose client has a short socket timeout, and the owner's events; the owner itself
    is started by the test (`start_owner`). Both stopped at the end, whatever happened."""
    sender = Cluster(connect(redis_server.url, decode_responses=True, socket_timeout=SOCKET_TIMEOUT_S),
                     "sender", ttl_s=TTL, metrics=Metrics())
    await sender.start(Working())
    p = Pair(Holding(), sender, [sender])
    try:
        yield p
    finally:
        p.owner_events.release.set()
        for cluster in p.running:
            await cluster.stop()


async def test_an_answer_slower_than_the_socket_timeout_still_arrives(pair: Pair, redis_server: RedisServer) -> None:
    """A single BLPOP for the whole wait (10 s) outlives a 2 s socket timeout: the client gave up
    on an idle connection and the message was reported as not passed on."""
    await pair.start_owner(redis_server.url)
    started = time.monotonic()
    forwarding = pair.forward()
    await asyncio.wait_for(pair.owner_events.arrived.wait(), WAIT_DEADLINE_S)
    while time.monotonic() - started < SOCKET_TIMEOUT_S + 0.5 and not forwarding.done():
        await asyncio.sleep(0.05)
    pair.owner_events.release.set()
    answer = await asyncio.wait_for(forwarding, WAIT_DEADLINE_S)
    assert answer is not None and answer.outcome is Outcome.ACCEPTED


async def test_a_worker_stopping_mid_wait_stops_within_a_slice(pair: Pair, redis_server: RedisServer) -> None:
    await pair.start_owner(redis_server.url)
    forwarding = pair.forward()
    await asyncio.wait_for(pair.owner_events.arrived.wait(), WAIT_DEADLINE_S)
    started = time.monotonic()
    stopping = asyncio.create_task(pair.sender.stop())
    done, _ = await asyncio.wait({forwarding, stopping}, timeout=WAIT_DEADLINE_S)
    took = time.monotonic() - started
    assert done == {forwarding, stopping}
    assert forwarding.result() is None  # no answer: the platform is told to send it again
    assert took < 2.5, f"stopping while a forward waited took {took:.2f} s"
    pair.running.remove(pair.sender)


async def test_redis_restarting_empty_while_the_owner_holds_the_message_loses_no_answer(
        pair: Pair, redis_server: RedisServer) -> None:
    """The owner read the message before Redis went down; its answer goes to the Redis that came
    back, and the sender, still waiting, takes it: no error, no "send it again"."""
    await pair.start_owner(redis_server.url)
    forwarding = pair.forward()
    await asyncio.wait_for(pair.owner_events.arrived.wait(), WAIT_DEADLINE_S)
    await _sender_waiting(redis_server)
    redis_server.kill()
    await asyncio.sleep(DOWN_S)  # the scenario: down longer than a reconnect's retries
    await asyncio.to_thread(redis_server.start)  # the same port, nothing in it
    pair.owner_events.release.set()
    answer = await asyncio.wait_for(forwarding, WAIT_DEADLINE_S)
    assert answer is not None and answer.outcome is Outcome.ACCEPTED


async def test_a_forward_redis_lost_before_the_owner_read_it_is_forwarded_again(
        pair: Pair, redis_server: RedisServer) -> None:
    """The entry is in the owner's inbox, unread, when Redis restarts empty: the sender, still
    waiting, puts it there again, and the owner answers it."""
    forwarding = pair.forward()
    client = redis_server.client()
    try:
        deadline = time.monotonic() + WAIT_DEADLINE_S
        while not client.xlen(keys.worker_inbox("owner")):
            assert time.monotonic() < deadline, "the forward never reached the owner's inbox"
            await asyncio.sleep(0.01)
    finally:
        client.close()
    await _sender_waiting(redis_server)
    redis_server.kill()
    await asyncio.sleep(DOWN_S)
    await asyncio.to_thread(redis_server.start)
    pair.owner_events.release.set()
    await pair.start_owner(redis_server.url)  # its inbox's consumer group is made anew
    answer = await asyncio.wait_for(forwarding, WAIT_DEADLINE_S)
    assert answer is not None and answer.outcome is Outcome.ACCEPTED
    assert pair.owner_events.delivered == ["m1"]


async def _sender_waiting(redis_server: RedisServer) -> None:
    """Until the sender blocks on its answer (a client in BLPOP): its XADD was acknowledged, so a
    Redis killed now fails the wait, not the forward itself (which would rightly be refused as
    unavailable: the sender never heard that its message was taken)."""
    client = redis_server.client()
    try:
        deadline = time.monotonic() + WAIT_DEADLINE_S
        while not any(c.get("cmd") == "blpop" for c in client.client_list()):
            assert time.monotonic() < deadline, "the sender never waited for its answer"
            await asyncio.sleep(0.01)
    finally:
        client.close()


class RefusingOnce(Working):
    """The owner's core: cannot take the first delivery of a message (its store failed, say), takes
    every later one."""

    def __init__(self) -> None:
        super().__init__()
        self.delivered: list[str] = []

    async def deliver(self, msg: InboundMessage, session: str, hops: int, *,
                      via: Callable[[Outlet], Outlet] | None = None) -> Submitted | None:
        self.delivered.append(msg.message_id)
        if len(self.delivered) == 1:
            return Submitted(Outcome.UNAVAILABLE, "could not save it", retry_after_s=1.0)
        return Submitted(Outcome.ACCEPTED)


class PushingChat(MemoryChat):
    """A platform that can be answered from any worker (as Telegram and Discord can)."""

    name = "pushing"
    pushes_anywhere = True


async def test_a_message_the_owner_could_not_take_is_forwarded_again_when_the_platform_redelivers_it(
        redis_server: RedisServer, store: SqliteStore) -> None:
    """The owner answers "unavailable" (retryable): the platform is told so and delivers the
    message again, and that delivery must reach the owner again. The sender had remembered the
    message as seen and answered the redelivery "duplicate" (2xx): acknowledged, stored nowhere."""
    chat = PushingChat()
    msg = chat.message("42", "hello", mid="m1")
    owner_events = RefusingOnce()
    owner = Cluster(connect(redis_server.url, decode_responses=True), "owner", ttl_s=TTL, metrics=Metrics())
    sender = Cluster(connect(redis_server.url, decode_responses=True), "sender", ttl_s=TTL, metrics=Metrics())
    router = build_router(store, EchoAgent(ToolRegistry(), delay_s=0.0), chat, cluster=sender)
    try:
        await owner.start(owner_events)
        key = session_key(msg)
        assert (await owner.route(key)).fence is not None  # the owner holds the session
        await sender.start(router.cluster_events())
        await chat.start(router)
        await router.start()
        first = await router.submit(msg, chat)
        assert first.outcome is Outcome.UNAVAILABLE and first.retry_after_s
        again = await router.submit(chat.message("42", "hello", mid="m1"), chat)
        assert again.outcome is Outcome.FORWARDED, again
        assert owner_events.delivered == ["m1", "m1"]
        third = await router.submit(chat.message("42", "hello", mid="m1"), chat)
        assert third.outcome is Outcome.DUPLICATE  # taken once: a true repeat stays out
    finally:
        await _end(router, sender, owner)



async def test_an_answer_that_came_while_the_sender_was_paused_past_its_wait_is_still_taken(
        pair: Pair, redis_server: RedisServer) -> None:
    """The sender's process is stopped (here: its event loop blocked) across the end of its wait;
    the answer is pushed meanwhile. Its last BLPOP had timed out on the server, so it saw no
    answer and told its client the owner did not answer — for a turn that ran."""
    def answer_later() -> None:
        client = redis_server.client()
        try:
            deadline = time.monotonic() + WAIT_DEADLINE_S
            while not (entries := client.xrange(keys.worker_inbox("nobody"))):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            _entry_id, fields = entries[0]
            assert fields is not None
            request = json.loads(fields["data"])["reply"]
            time.sleep(1.0)  # past the wait (0.3 s) and its last BLPOP's timeout, while the sender is stopped
            client.lpush(keys.forward_reply(request), json.dumps({"answer": 42}))
        finally:
            client.close()

    pusher = threading.Thread(target=answer_later)
    pusher.start()
    try:
        asking = asyncio.ensure_future(pair.sender.forwarder.ask("nobody", {"question": 1}, wait_s=0.3))
        asyncio.get_running_loop().call_later(0.1, time.sleep, 1.5)  # the process stopped, as by SIGSTOP
        assert await asyncio.wait_for(asking, WAIT_DEADLINE_S) == {"answer": 42}
    finally:
        pusher.join()


async def test_forwards_waiting_on_a_slow_owner_never_starve_the_senders_leases(redis_server: RedisServer) -> None:
    """An owner falling behind leaves every message forwarded to it waiting for its answer, each
    wait holding a Redis connection for seconds. On a pool shared with the lease renewals, those
    waits took every connection and the renewals queued behind them failed: the sender lost its
    own sessions (the fleet soak at load 13.7: one worker lost 3,481 leases). The waits have a pool
    of their own: here the sender's client has 6 connections (2 of them its inbox's and its relay
    reader's blocking reads) and 5 forwards wait 3 TTLs."""
    ttl = 3.0
    owner_events = Holding()  # takes the first message and answers nothing until released
    owner = Cluster(connect(redis_server.url, decode_responses=True), "owner", ttl_s=ttl, metrics=Metrics())
    sender = Cluster(connect(redis_server.url + "?max_connections=6", decode_responses=True), "sender",
                     ttl_s=ttl, metrics=Metrics())
    await owner.start(owner_events)
    await sender.start(Working())
    waiting: list[asyncio.Task[Submitted | None]] = []
    try:
        own = await sender.route("telegram:dm:7")
        assert own.fence is not None
        for i in range(5):
            msg = dataclasses.replace(_message(), message_id=f"m{i}")
            waiting.append(asyncio.create_task(sender.forward("owner", msg, "telegram:dm:42", hops=0,
                                                              want_reply=True)))
        await asyncio.wait_for(owner_events.arrived.wait(), WAIT_DEADLINE_S)
        await asyncio.sleep(3 * ttl)  # renewals every TTL/3, while 5 waits block
        assert not any(task.done() for task in waiting), "the owner answered: nothing was waiting"
        assert sender.holds(own.fence), "the sender lost its own session while its forwards waited"
        assert (await sender.route("telegram:dm:7")).fence == own.fence
    finally:
        owner_events.release.set()
        await stop_or_show_why_not(sender.stop(), WAIT_DEADLINE_S)
        await stop_or_show_why_not(owner.stop(), WAIT_DEADLINE_S)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)



class GatedStore(SqliteStore):
    """Stores `held`'s acceptance only once `gate` is set (a slow disk, a database far away)."""

    def __init__(self, path: Path, held: str) -> None:
        super().__init__(path)
        self.held = held
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def accept_inbound(self, fence: Fence, msg: InboundMessage, *,
                             started: tuple[int, ChatMessage] | None = None) -> int | None:
        if msg.message_id == self.held:
            self.entered.set()
            await self.gate.wait()
        return await super().accept_inbound(fence, msg, started=started)


async def test_a_session_whose_message_is_being_stored_is_not_let_go_as_idle(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A message this worker forwarded comes back to it (claimed from the inbox of the owner that
    read it and stopped): it is stored before it is queued. While it was being stored, the session
    had no turn and no agent here, and housekeeping released its lease as idle; the turn then ran
    without a lease, and was cut off as "session lease lost" with its message left open."""
    ttl = 3.0
    chat = PushingChat()
    msg = chat.message("42", "hello", mid="m1")
    key = session_key(msg)
    store = GatedStore(tmp_path / "s.db", held="m1")
    await store.open()
    owner_events = Holding()
    owner = Cluster(connect(redis_server.url, decode_responses=True), "owner", ttl_s=ttl, metrics=Metrics())
    sender = Cluster(connect(redis_server.url, decode_responses=True), "sender", ttl_s=ttl, metrics=Metrics())
    router = build_router(store, EchoAgent(ToolRegistry(), delay_s=0.0), chat, cluster=sender)
    client = redis_server.client()
    stopped_owner = False
    try:
        await owner.start(owner_events)
        assert (await owner.route(key)).fence is not None
        await sender.start(router.cluster_events())
        await chat.start(router)
        await router.start()
        submitting = asyncio.create_task(router.submit(msg, chat))  # forwarded to the owner
        await asyncio.wait_for(owner_events.arrived.wait(), WAIT_DEADLINE_S)
        await owner.stop()  # it read the message and never answered: the entry stays pending
        stopped_owner = True
        await asyncio.wait_for(store.entered.wait(), WAIT_DEADLINE_S)  # claimed back, now being stored
        assert sender.fence_of(key) is not None
        beats = {_beat(client, "sender")}
        deadline = time.monotonic() + WAIT_DEADLINE_S
        while len(beats) < 3:  # two more housekeeping rounds (idle leases released) with the write pending
            assert time.monotonic() < deadline, "no housekeeping round"
            await asyncio.sleep(0.05)
            beats.add(_beat(client, "sender"))
        assert sender.fence_of(key) is not None, "the session was let go while its message was being stored"
        assert client.hget(keys.lease(key), "worker") == "sender"
        store.gate.set()
        assert (await asyncio.wait_for(submitting, WAIT_DEADLINE_S)).outcome is Outcome.FORWARDED
        await chat.wait_for(lambda: any("hello" in t for t in chat.texts("42")), WAIT_DEADLINE_S)
        # The answer shows while it streams; its record closes when the turn ends, soon after.
        deadline = time.monotonic() + WAIT_DEADLINE_S
        while open_ := await store.unfinished_inbound(key):
            assert time.monotonic() < deadline, f"the message stayed open: {open_}"
            await asyncio.sleep(0.05)
    finally:
        owner_events.release.set()
        store.gate.set()
        await _end(router, sender, *([] if stopped_owner else [owner]), store=store)
        client.close()


def _beat(client: Any, worker: str) -> float:
    """When a worker's last heartbeat was (each housekeeping round begins with one)."""
    beat = client.hget(keys.workers(), worker)
    return json.loads(beat)["seen_at"] if beat else 0.0


class StallingStore(SqliteStore):
    """The first read of what one session left open returns, then the process stops for `stall_s`
    (its event loop blocked, as by SIGSTOP): the adoption that asked resumes with its lease no
    longer provable by its own clock."""

    def __init__(self, path: Path, stall_s: float) -> None:
        super().__init__(path)
        self.stall_s = stall_s
        self.reads = 0

    async def unfinished_inbound(self, session_key: str | None = None) -> list[InboundRecord]:
        records = await super().unfinished_inbound(session_key)
        if session_key is not None:  # (not the start-up read of every session's)
            self.reads += 1
            if self.reads == 1:
                time.sleep(self.stall_s)
        return records


async def test_an_adoption_that_loses_its_lease_mid_recovery_is_tried_again_not_taken_as_done(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """Recovery skipped the open messages it could no longer prove it owned, then reported the
    takeover done: the session was held with its messages open, later released as idle, and
    never adopted again."""
    ttl = 3.0
    chat = PushingChat()
    msg = chat.message("42", "left open", mid="m1")
    key = session_key(msg)
    seed = SqliteStore(tmp_path / "s.db")
    await seed.open()
    assert await seed.accept_inbound(Fence.local(key), msg) is not None  # accepted, never run
    await seed.close()
    store = StallingStore(tmp_path / "s.db", stall_s=ttl * 0.95)  # past the clock's margin, within the TTL
    await store.open()
    worker, router = _worker(redis_server, store, chat, ttl_s=ttl)
    try:
        await _start(worker, router, chat)
        await worker.adopt()  # scans for lapsed leases from now on
        with contextlib.suppress(ClusterUnavailable):
            await worker.route(key)  # a takeover: its recovery reads m1, and the process stops
        await chat.wait_for(lambda: any("left open" in t for t in chat.texts("42")), WAIT_DEADLINE_S)
        deadline = time.monotonic() + WAIT_DEADLINE_S
        while await store.unfinished_inbound(key):
            assert time.monotonic() < deadline, "the message stayed open"
            await asyncio.sleep(0.05)
        assert store.reads >= 2  # adopted again
    finally:
        await _end(router, worker, store=store)


async def test_two_messages_routed_at_once_to_a_session_share_one_takeover(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """Before an acquisition, the worker asks Redis whether it lost its data (a GET). Two routes
    both waited on that GET before either had registered its acquisition, so both took the
    session (one it had lost: each acquisition a takeover with a fence of its own), and the turn
    left open was closed twice and resumed twice."""
    chat = PushingChat()
    msg = chat.message("42", "cut off", mid="m1")
    key = session_key(msg)
    store = SqliteStore(tmp_path / "s.db")
    await store.open()
    worker, router = _worker(redis_server, store, chat, ttl_s=TTL)
    try:
        await _start(worker, router, chat)
        assert (await worker.route(key)).fence is not None
        # Reported lost (as when a renewal comes too late): the next acquisition is a takeover.
        worker.leases.drop([key], "a renewal came too late")
        # Meanwhile a turn of the session was left open, cut off.
        inbound_id = await store.accept_inbound(Fence.local(key), msg)
        assert inbound_id is not None
        await store.append(Fence.local(key), 1, [ChatMessage("user", msg.text)],
                           inbound=(inbound_id, InboundStatus.RUNNING, None))
        await asyncio.sleep(0.2)  # past the last look at Redis's sentinel: the next route looks again
        first, second = await asyncio.gather(worker.route(key), worker.route(key))
        assert first.fence is not None and first == second
        deadline = time.monotonic() + WAIT_DEADLINE_S
        while (await store.conversation(key))[1][-1].role != "assistant" or await store.unfinished_inbound(key):
            assert time.monotonic() < deadline, f"never resumed: {chat.texts('42')}"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a second takeover, if any, has had time to write
        _conversation, history = await store.conversation(key)
        closed = [row for row in history if row.role == "assistant" and row.interrupted_by is not None]
        resumes = [row for row in history if row.role == "user" and row.content != msg.text]
        assert len(closed) == 1 and len(resumes) == 1, history
    finally:
        await _end(router, worker, store=store)


async def _end(router: Router, *clusters: Cluster, store: SqliteStore | None = None) -> None:
    """The router stopped, then each coordinator, then the store: every path of these tests."""
    await router.shutdown(GATEWAY_RESTART, grace_s=5)
    for cluster in clusters:
        await cluster.stop()
    if store is not None:
        await store.close()


def _worker(redis_server: RedisServer, store: SqliteStore, chat: MemoryChat, *, ttl_s: float) -> tuple[Cluster, Router]:
    """A cluster worker "w" on `store` serving `chat` with the echo agent (not started)."""
    worker = Cluster(connect(redis_server.url, decode_responses=True), "w", ttl_s=ttl_s, metrics=Metrics())
    return worker, build_router(store, EchoAgent(ToolRegistry(), delay_s=0.0), chat, cluster=worker)


async def _start(worker: Cluster, router: Router, chat: MemoryChat) -> None:
    await worker.start(router.cluster_events())
    await chat.start(router)
    await router.start()


async def test_an_owner_takes_other_sessions_messages_while_one_is_being_stored_and_one_sessions_in_order(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """Overload (a fleet of 10,000 sessions at a load average of 14): the owner handled its inbox one
    entry at a time, each waiting for its record to be committed, so one slow write held up every
    other session's message until their senders gave up waiting (503). Now other sessions' messages
    pass one being stored, and a session's own messages are still accepted in the order sent."""
    chat = PushingChat()
    first, second, other = (chat.message("42", "first", mid="a1"), chat.message("42", "second", mid="a2"),
                            chat.message("43", "other", mid="b1"))
    store = GatedStore(tmp_path / "s.db", held="a1")
    await store.open()
    owner, router = _worker(redis_server, store, chat, ttl_s=TTL)
    sender = Cluster(connect(redis_server.url, decode_responses=True), "sender", ttl_s=TTL, metrics=Metrics())
    forwards: list[asyncio.Task[Submitted | None]] = []
    try:
        await _start(owner, router, chat)
        await sender.start(Working())

        def forward(msg: InboundMessage) -> asyncio.Task[Submitted | None]:
            forwards.append(asyncio.create_task(sender.forward("w", msg, session_key(msg), hops=1, want_reply=True)))
            return forwards[-1]

        held = forward(first)
        await asyncio.wait_for(store.entered.wait(), WAIT_DEADLINE_S)  # a1 is being stored
        behind = forward(second)
        # Answered while a1's write is held (one at a time, it waited REPLY_WAIT_S and got None).
        answered = await asyncio.wait_for(forward(other), WAIT_DEADLINE_S)
        assert answered is not None and answered.outcome is Outcome.ACCEPTED, answered
        assert not held.done() and not behind.done(), "a2 was taken before a1, sent before it, was stored"
        store.gate.set()
        for task in (held, behind):
            result = await asyncio.wait_for(task, WAIT_DEADLINE_S)
            assert result is not None and result.outcome in (Outcome.ACCEPTED, Outcome.QUEUED), result
        deadline = time.monotonic() + WAIT_DEADLINE_S
        while await store.unfinished_inbound():
            assert time.monotonic() < deadline, "a message stayed open"
            await asyncio.sleep(0.05)
        _conversation, history = await store.conversation(session_key(first))
        assert [row.content for row in history if row.role == "user"] == ["first", "second"], history
    finally:
        store.gate.set()
        for task in forwards:
            task.cancel()
        await _end(router, owner, sender, store=store)
