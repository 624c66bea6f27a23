"""What a chaos run recorded, as plain data: the checker's only input.

Every time is `time.monotonic()` of the test process (the fake provider's `perf_counter` is the
same clock on Linux; `scenario.collect` converts anyway). Names used throughout:

- session: "g03" (Telegram group chat -103) or "a01" (HTTP API, `X-Session-Id: a01`)
- message tag: "g03 m2" (second message of g03); an API attempt adds " t1", " t2"...
- incarnation: "w2.1" — worker w2's first process; a restart with the same worker id is "w2.2"
- stream: one provider request, numbered from 1 (`c17`); the fake provider's answer starts with
  "[g03_m2_c17]" and ends with the word END, so every Telegram text names its stream
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

# "[g03 m2]" in a user text, "[a01 m3 t2]" for an API attempt; an answer starts with "[g03_m2_c17]"
# (one word: the fake provider streams word by word, and the first piece shown must name its stream).
TAG = re.compile(r"\[(?P<session>[ga]\d+)[ _]m(?P<m>\d+)(?:[ _]t(?P<t>\d+))?(?:[ _]c(?P<c>\d+))?\]")
END = "END"  # the last word of every complete answer
STOP_MARK = "⏹"  # every interruption notice (a notice of its own, or appended to a partial answer)
FAIL_MARK = "⚠️"  # "the agent failed" (the fake provider never fails, so this is always a finding)
# Notices a worker sends when it takes over a session and closes the turn a dead owner left open.
TAKEOVER_MARKERS = ("taken over", "gateway stopped before the turn finished")


SHARED = ("redis", "postgres")  # fault targets every worker depends on
BASE_SLACK_S = 3.0  # on top of the answer time, before a first answer or notice is late
TAKEOVER_SLACK_S = 2.0  # a lost owner's turns get a new owner within TTL + this


def quarantine_s(kind: str, ttl_s: float) -> float:
    """How long workers take no session after the fault on top of its TTL: a Redis that came
    back empty (`redis_wipe`) makes every worker quarantine acquisitions for one lease TTL
    (gateway/cluster/redis_loss.py), so a holder that has not noticed yet runs out first."""
    return ttl_s if kind == "redis_wipe" else 0.0


def outcome_bound(accepted: float, faults: list[FaultRecord], *, answer_s: float, ttl_s: float, now: float,
                  owner_at: Callable[[float], str | None]) -> tuple[float, list[FaultRecord]]:
    """Latest acceptable time for the first answer or notice of a message accepted at `accepted`:
    answer time + BASE_SLACK_S, plus for each fault that touches that window and can hold the
    message up — a fault of Redis or of the store, or a fault of the session's owner (`owner_at(fault start)`:
    the incarnation that last started a stream for it; None: unknown, so it counts) — its length +
    TTL + TAKEOVER_SLACK_S, + one more TTL for Redis back empty (the quarantine, `quarantine_s`)
    (a fault still going on counts until `now`). Also returns those faults."""
    end = accepted + answer_s + BASE_SLACK_S
    touching = []
    for f in sorted(faults, key=lambda f: f.started_at):
        if f.target not in SHARED and (owner := owner_at(f.started_at)) is not None and owner != f.target:
            continue
        f_end = f.ended_at if f.ended_at is not None else now
        extra = ttl_s + TAKEOVER_SLACK_S + quarantine_s(f.kind, ttl_s)
        if f.started_at < end and f_end + extra > accepted:
            end += (f_end - f.started_at) + extra
            touching.append(f)
    return end, touching


def chat_of(session: str) -> int:
    """The Telegram group chat of session "g03": -103."""
    return -100 - int(session[1:])


def message_tag(text: str) -> str | None:
    """"g03 m2" (or "a01 m3 t2") for the first tag in `text`, without the stream number."""
    m = TAG.search(text)
    if m is None:
        return None
    tag = f"{m['session']} m{m['m']}"
    return f"{tag} t{m['t']}" if m["t"] else tag


def answer_tag(tag: str, stream: int) -> str:
    """The first word of stream `stream`'s answer to message `tag`: "[g03_m2_c17]"."""
    return f"[{tag.replace(' ', '_')}_c{stream}]"


def stream_number(text: str) -> int | None:
    m = TAG.search(text)
    return int(m["c"]) if m is not None and m["c"] else None


@dataclass
class Incarnation:
    name: str  # "w2.1"
    worker_id: str  # "w2"
    pid: int
    started_at: float
    url: str = ""
    ready_at: float | None = None
    ended_at: float | None = None  # killed (kill -9), or stopped at teardown
    stopped: list[tuple[float, float | None]] = field(default_factory=list)  # SIGSTOP .. SIGCONT

    def frozen_at(self, t: float) -> bool:
        return any(a <= t and (b is None or t < b) for a, b in self.stopped)

    def available(self, a: float, b: float) -> bool:
        """Was this process running (alive, not stopped) at some point between a and b?"""
        if self.ended_at is not None and self.ended_at <= a:
            return False
        return not any(s <= a and (c is None or c >= b) for s, c in self.stopped)


@dataclass
class FaultRecord:
    kind: str  # kill | kill_restart | pause_short | pause_long | redis_restart | redis_wipe | pg_restart | disk_full
    target: str  # incarnation name, or "redis"
    started_at: float
    ended_at: float | None = None  # SIGCONT sent / replacement ready / redis answering again
    duration: float = 0.0  # planned: pause length, time dead, redis down time
    replacement: str | None = None  # the new incarnation after a kill
    note: str = ""
    tools_at_kill: list[int] = field(default_factory=list)  # its tool processes alive when it was killed
    orphans: list[int] = field(default_factory=list)  # ...and those still running half a second later

    def describe(self, t0: float) -> str:
        end = f"{self.ended_at - t0:.1f}" if self.ended_at is not None else "?"
        what = f"{self.kind} {self.target}"
        if self.replacement:
            what += f" -> {self.replacement}"
        return f"{what} [{self.started_at - t0:.1f}-{end} s]" + (f" ({self.note})" if self.note else "")


@dataclass
class Attempt:
    """One HTTP request the traffic generator made."""

    at: float
    target: str  # incarnation
    status: int | None  # None: no HTTP answer (connection error, timeout)
    ended_at: float
    error: str | None = None
    retry_after: str | None = None
    body: str = ""  # API: the answer's content, or the error message
    interrupted: str | None = None  # API: "system: session lease lost" when the answer says it was cut off


@dataclass
class TgMessage:
    tag: str  # "g03 m2"
    session: str
    chat_id: int
    message_id: int  # Telegram's id of the user's message
    text: str
    sent_at: float
    attempts: list[Attempt] = field(default_factory=list)
    accepted_at: float | None = None  # first 2xx from a webhook
    next_sent_at: float | None = None  # the user's next message in this chat
    early: bool = False  # the next message was sent on purpose before this one had an outcome
    impatient: bool = False  # the user gave up waiting for an outcome and went on


@dataclass
class ApiMessage:
    tag: str  # "a01 m3"; each attempt's text carries "a01 m3 tN"
    session: str
    attempts: list[Attempt] = field(default_factory=list)
    outcome: str = "pending"  # answered | interrupted | refused | pending
    outcome_detail: str = ""


@dataclass
class Stream:
    """One provider request (a turn's model call), as the fake provider saw it."""

    number: int  # 1-based, "c17"
    via: str | None  # the incarnation that made it
    opened_at: float
    ended_at: float | None  # completed, or its connection closed; None: still open at collection
    completed: bool
    tag: str | None  # the message it answers (the last tagged user message in its body)
    resume: bool  # its last user message is an automatic "continue" prompt
    tool_call: bool = False  # answered with a tool call: the turn goes on with a tool process
    after_tool: bool = False  # the request that carries a tool's result (the turn's next round)
    tool_ended_at: float | None = None  # when its tool process ended (it wrote the time), if seen

    @property
    def session(self) -> str | None:
        return self.tag.split()[0] if self.tag else None


@dataclass
class TgCall:
    """A successful sendMessage / editMessageText / sendChatAction at the fake Telegram."""

    at: float
    via: str | None
    method: str
    chat_id: int
    message_id: int | None  # the bot message sent or edited
    text: str  # raw text as sent; the action for sendChatAction
    reply_to: int | None  # sendMessage: the user message it quotes


@dataclass
class BotMessage:
    chat_id: int
    message_id: int
    via: str | None  # who sent it
    sent_at: float
    text: str  # final text, after every edit
    reply_to: int | None
    changed_at: float  # last send or edit


@dataclass
class Row:
    role: str  # user | assistant | tool
    content: str
    interrupted_by: str | None
    reason: str | None
    tool_calls: bool = False  # an assistant row that asks for tools (its turn goes on)

    @property
    def closes_turn(self) -> bool:
        """The row that ends a turn: an assistant row without tool calls (an answer, or an
        interruption), or a tool row cut off by an interruption (nothing follows it)."""
        if self.role == "assistant":
            return not self.tool_calls
        return self.role == "tool" and self.interrupted_by is not None


@dataclass
class LeaseEvent:
    """A write to a session's lease, as Redis ran it (tests/chaos/lease_log.py)."""

    at: float
    session: str  # "g03", "a01"
    op: str  # acquire (with its fence) | extend (PEXPIRE: the acquisition's TTL, a renewal) | release
    token: str  # the lease token, "<worker id>/<incarnation id>"
    fence: int | None
    ttl_s: float  # extend: the lease's new time to live
    holder: str = ""  # the incarnation ("w2.1") the token belongs to


def session_of_key(key: str) -> str:
    """"telegram:group:-103" -> "g03"; "api:dm:a01" -> "a01"."""
    platform, _kind, chat = key.split(":", 2)
    if platform == "telegram":
        return f"g{-int(chat) - 100:02d}"
    return chat


@dataclass
class OpenInbound:
    session_key: str
    inbound_id: str
    status: str
    text: str
    lease_holder: str | None  # worker field of the session's lease, if any
    lease_ttl_ms: int


@dataclass
class Records:
    seed: int
    ttl_s: float
    answer_s: float  # how long the fake provider takes for a whole answer
    t0: float  # the run's start
    traffic_end: float
    collected_at: float
    incarnations: dict[str, Incarnation]
    faults: list[FaultRecord]
    telegram: list[TgMessage]
    api: list[ApiMessage]
    streams: list[Stream]
    calls: list[TgCall]
    bot_messages: list[BotMessage]
    transcripts: dict[str, list[Row]]  # by session ("g03", "a01")
    open_inbound: list[OpenInbound]
    inbox: dict[str, str] = field(default_factory=dict)  # message tag -> where it sits in a worker's inbox
    harness_errors: list[str] = field(default_factory=list)
    crashed: dict[str, int] = field(default_factory=dict)  # incarnation -> exit status (nobody killed it)
    log_tails: dict[str, str] = field(default_factory=dict)  # worker id -> errors seen in its log
    leases: list[LeaseEvent] = field(default_factory=list)  # every lease write Redis ran, in order
    lease_gaps: list[tuple[float, float | None]] = field(default_factory=list)  # the monitor was not connected
    leases_monitored: bool = False  # False: no lease records (an old run's records)
