"""The ports of the session core: what it needs from the layers around it, and what it offers them.

The core imports none of its neighbours. Agents, stores and cluster coordination implement the
protocols below and are passed in when the router is built; platforms implement `Outlet` and talk
to the core only through `Gateway`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gateway.core.attachments import Attachment, MediaPart
from gateway.core.cancellation import Run, ToolReason
from gateway.core.context import HistoryMemo
from gateway.core.fencing import Fence
from gateway.core.messages import ChatRef, InboundMessage
from gateway.core.transcript import AgentEvent, ChatMessage, ToolCall
from gateway.core.turn_options import TurnOptions


@dataclass(frozen=True, slots=True)
class Health:
    """One component's readiness, as `/readyz` and the console show it. A check that is not
    `required` is advisory: shown, never counted against readiness (the model provider's
    reachability: every worker shares it, so it must not take them all out at once)."""

    ok: bool
    detail: str
    required: bool = True


# --- agents -----------------------------------------------------------------------------------

class AgentError(Exception):
    """The agent could not produce an answer; the text is safe to show the user."""


class TurnContext(Protocol):
    """What a running turn may ask of the core, besides its history and message."""

    def take_interjection(self) -> str | None:
        """Messages the user sent while this turn runs (busy policy "steer"), combined, in order —
        each handed over once; None if there are none. Asked at every model/tool boundary."""

    @property
    def token_ratio(self) -> float:
        """The provider's token count over the local estimate, as seen in this session (1.0: none yet)."""

    @property
    def history_memo(self) -> HistoryMemo | None:
        """What the context budget keeps of this session's history between turns (None: a turn
        without a stored session)."""

    def note_result(self, call_id: str, text: str) -> None:
        """What became of a tool call if the turn is stopped before it returns (its command moved to
        the background, say): recorded with the call's interrupted marker."""

    @property
    def options(self) -> TurnOptions | None:
        """What the client asked of this turn beyond its message, and where the agent reports
        back (an HTTP API request); None for a chat message."""

    @property
    def pace_s(self) -> float:
        """The least time between two states of the answer its chat can show (0: each delta as it
        comes, e.g. a client streaming it): text arriving faster may be handed over in bigger pieces."""


class Agent(Protocol):
    @property
    def description(self) -> str:
        """Agent kind and model, for /status and /v1/models."""

    def run_turn(self, history: Sequence[ChatMessage], message: ChatMessage,
                 context: TurnContext | None = None) -> AsyncIterator[AgentEvent]:
        """Stream one turn. Tool calls run inside; cancellation arrives as CancelledError."""


class MediaLoader(Protocol):
    """Fetches a message's attachments for its turn (in the run's task, so a stop cancels it)."""

    async def load(self, platform: str, attachments: Sequence[Attachment], *,
                   keep: bool = True) -> tuple[MediaPart, ...]:
        """One part per attachment not refused: the bytes or text, from the stored copy when there
        is one, else downloaded — or a note saying why not. Raises only CancelledError. `keep`: keep
        a copy for a replay (not for a stateless turn: nothing replays it)."""


# --- the store --------------------------------------------------------------------------------

class StoreError(Exception):
    """The store could not do what was asked (disk full, Redis down, fenced out...)."""


class DiskFull(StoreError):
    """The store's disk has no room: new messages are refused until it has (not a blip to wait out)."""


class FencedOut(StoreError):
    """A shared store refused a write: its fence is not the session's current one."""


class InboundStatus(StrEnum):
    """Where an inbound message is in its life. The first three keep it open (replayed or resumed)."""

    ACCEPTED = "accepted"  # stored, its turn never started
    RUNNING = "running"  # its turn started; still so after a crash
    RESTART = "restart"  # a graceful restart cut its turn off: resumed on the next start
    DONE = "done"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    FAILED = "failed"
    RESUMED = "resumed"  # closed; an automatic turn continues it

    @property
    def is_open(self) -> bool:
        return self in _OPEN


OPEN_STATUSES = ("accepted", "running", "restart")  # this order in SQL, to match partial indexes
_OPEN = frozenset(InboundStatus(s) for s in OPEN_STATUSES)


@dataclass(frozen=True, slots=True)
class InboundRecord:
    id: int
    session_key: str
    message: InboundMessage
    status: InboundStatus
    received_at: float


@dataclass(frozen=True, slots=True)
class SessionInfo:
    key: str
    conversation: int
    updated_at: float
    messages: int


class Store(Protocol):
    """Durable state. Every write that belongs to a session carries its `Fence`; a store shared by
    several workers refuses writes whose fence is not the session's current one."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def ping(self) -> bool: ...

    def problem(self) -> str | None:
        """What keeps the store from taking writes now, in words (e.g. a full disk); None: nothing known."""

    async def accept_inbound(self, fence: Fence, msg: InboundMessage, *,
                             started: tuple[int, ChatMessage] | None = None) -> int | None:
        """Durably record an inbound message; None if (platform, chat, message id) was seen before.
        `started` = (conversation, the user's row): its turn starts now, so the record is written
        `running` and the row added to that conversation in the same transaction — the message's
        acceptance and its turn's start are one durable write. Nothing is written for a duplicate."""

    async def finish_inbound(self, fence: Fence, inbound_id: int, status: InboundStatus,
                             detail: str | None = None) -> None:
        """Close (or re-mark) an accepted message, so it is not replayed."""

    async def unfinished_inbound(self, session_key: str | None = None) -> list[InboundRecord]:
        """Messages whose turn never ended (the process stopped first), oldest first — of one
        session, or of all sessions this store can enumerate cheaply (a shared store: none)."""

    async def conversation(self, session_key: str) -> tuple[int, list[ChatMessage]]:
        """The session's current conversation number and its history."""

    async def append(self, fence: Fence, conversation: int, rows: Sequence[ChatMessage], *,
                     inbound: tuple[int, InboundStatus, str | None] | None = None) -> None:
        """Add rows to one conversation of a session, and set `inbound` = (id, status, detail) of
        the message being answered in the same transaction."""

    async def reset(self, fence: Fence) -> int:
        """Archive the current conversation and start a new one; returns its number."""

    async def sessions(self, limit: int = 100) -> list[SessionInfo]: ...

    async def is_paired(self, platform: str, user_id: str) -> bool: ...

    async def pairing_code(self, platform: str, user_id: str, user_name: str, *, code: str,
                           ttl_s: float, max_pending: int) -> str | None:
        """The user's pending code (reusing an unexpired one, else `code`); None if too many pend."""

    async def approve_pairing(self, code: str, *, ttl_s: float) -> tuple[str, str, str] | None:
        """Approve a pending code: (platform, user id, name), or None if unknown or expired."""

    async def pairing_state(self) -> tuple[list[tuple[str, str, str, str, float]], list[tuple[str, str, str]]]: ...


# --- platforms --------------------------------------------------------------------------------

class NoticeKind(StrEnum):
    """What a notice is about, for platforms that show kinds differently (the web chat styles them)."""

    INFO = "info"
    ERROR = "error"
    QUEUED = "queued"
    STOPPED = "stopped"
    RESTART = "restart"
    INTERRUPTED = "interrupted"


UNAVAILABLE_RETRY_S = 5.0  # what a client is told to wait while our side (storage, Redis) is down


class Reply(ABC):
    """The outbound side of one turn. Implementations drop output once the run is cancelled."""

    @abstractmethod
    async def delta(self, text: str) -> None:
        """More assistant text arrived."""

    @abstractmethod
    async def finish(self, text: str) -> None:
        """The turn ended normally; `text` is the whole final answer."""

    @abstractmethod
    async def interrupted(self, reason: ToolReason) -> None:
        """The turn was stopped: show that, once, and send nothing more."""

    @abstractmethod
    async def failed(self, text: str, *, retry_after_s: float | None = None) -> None:
        """The turn failed; tell the user in words. `retry_after_s`: our side is unavailable for
        now (storage down, at capacity), so the same message may well work later."""

    def pace(self) -> float:
        """The least time between two states of the text this reply shows: deltas arriving faster
        may be handed over joined (`TurnContext.pace_s`). The default, 0: each delta as it comes."""
        return 0.0

    async def tool_started(self, call: ToolCall) -> None:
        """A tool call (a tool or an MCP call) starts running now: platforms that show progress
        show it (its name, its arguments, its elapsed time). `tool_ended` follows when it returns;
        a stop first is said by `interrupted`. The default shows nothing."""

    async def tool_ended(self, call_id: str, result: str) -> None:
        """The tool call `call_id` returned `result` (what the model is given). The default shows nothing."""

    async def settled(self, problem: str | None = None) -> None:
        """The turn is over and its outcome recorded (or, with `problem`, what the user must be told
        because it could not be); nothing more will be said for it. Called exactly once per
        accepted message, whatever happened to its turn."""

    def shown_text(self) -> str | None:
        """The part of the turn's streamed text the user has been shown — a prefix of what was
        passed to `delta` — once the reply has ended; None if everything given was shown (a client
        that receives every delta). A stopped turn's transcript keeps exactly this."""
        return None

    async def delivered(self) -> bool:
        """After `finish`: wait until the answer's end has reached the chat; False if it never
        will (the platform refused it for good). Platforms that deliver within `finish` say True."""
        return True


class Outlet(Protocol):
    """What the core needs from a platform: where replies and notices go."""

    @property
    def name(self) -> str: ...

    @property
    def pushes_anywhere(self) -> bool:
        """Can any worker reach this platform's chats (a REST API), or only the one holding the
        user's connection (web chat, HTTP API)? Decides whether messages may be forwarded."""

    @property
    def bot_username(self) -> str | None:
        """The bot's own name on the platform, so `/cmd@OtherBot` is told apart from ours."""

    @property
    def can_steer(self) -> bool:
        """May a message join the answer already being written (a chat), or does each need an
        answer of its own (an HTTP request)?"""

    @property
    def answers_later(self) -> bool:
        """Can a message still be answered after the process that took it is gone (a chat), or
        did its client wait on that process's connection and hear how it ended (an HTTP request)?
        Decides whether a restart or a takeover replays and resumes its turns."""

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply: ...

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        """Send a short notice (command replies, acks, rejections, stops); never raises.
        `reason` is set on notices about an interruption, for platforms that show it."""


class Outcome(StrEnum):
    ACCEPTED = "accepted"
    QUEUED = "queued"
    DUPLICATE = "duplicate"
    STEERED = "steered"  # handed to the answer being written (busy policy "steer")
    REJECTED = "rejected"  # the message itself was refused (empty, too long, not allowed...)
    UNAVAILABLE = "unavailable"  # not taken now (storage or Redis down): the same message may come again
    LIMITED = "limited"  # over a rate limit or a quota of its tenant: the same message may come again later
    COMMAND = "command"
    FORWARDED = "forwarded"  # cluster mode: handed to the worker that owns the session
    MOVED = "moved"  # cluster mode: a relayed message not taken here; the session's owner (`detail`) runs it


@dataclass(frozen=True, slots=True)
class Submitted:
    outcome: Outcome
    detail: str = ""
    run: Run | None = None
    retry_after_s: float | None = None  # with UNAVAILABLE or LIMITED: when trying again makes sense


@dataclass(frozen=True, slots=True)
class SessionStatus:
    key: str
    running: bool
    since: float | None
    queued: int
    agent: str


class Gateway(Protocol):
    """What the core offers platforms: the only way in."""

    async def submit(self, msg: InboundMessage, outlet: Outlet, *, key: str | None = None) -> Submitted:
        """Route one inbound message (commands included) to its session (`key`, or the one its
        chat maps to). Never raises for bad input: the user gets a reason."""

    async def submit_stateless(self, msg: InboundMessage, outlet: Outlet, history: Sequence[ChatMessage]) -> Submitted:
        """A turn over the history the client sent (the HTTP API without a session): nothing is
        loaded or stored."""

    def max_message_chars(self) -> int:
        """The longest message intake takes now (a reload may change it)."""

    def status(self, key: str) -> SessionStatus: ...

    async def history(self, key: str) -> list[ChatMessage]:
        """The current conversation of a session, as stored."""

    def count_outbound(self, platform: str, kind: str) -> None:
        """Metrics: one outbound `send`/`edit`/`notice`, or a `429` from the platform."""


Outlets = Mapping[str, Outlet]
