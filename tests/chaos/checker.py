"""The invariants a cluster must keep under faults, judged only from the records of a run (the
fake provider's connections, the fake Telegram's calls and final messages, the Redis store read at
the end, the traffic generator's log, the fault log). See KINDS for the violation names.

Definitions:

- *accepted*: a Telegram message is accepted once any webhook POST of its update got a 2xx (or its
  user row is in the transcript); an HTTP API attempt is accepted if it got a 200 or its user row
  is in the transcript. A message never accepted before the client gave up is *refused* (counted,
  not a violation; an API 400 for a transient failure is one, see api-400-for-unavailable).
- *answered* (Telegram): a bot message whose final text is a whole answer for it — it starts with
  a stream tag of the message ("[g03_m2_c17]", also from an automatic resume of it) and ends with
  END, without a stop mark. (API): a 200 whose content is the whole tagged answer.
- *interrupted with notice* (Telegram): a bot message attributed to it that carries "⏹" — a
  partial answer marked stopped, or a notice of its own. Attribution: the stream tag in the text,
  else the user message the reply quotes, else the latest streamed output in the chat before it.
  (API): a 200 whose `switchboard` says interrupted.
- *superseded*: nothing at all was shown for it and the user's next message went out before any
  outcome — a turn the user's own next message replaced before it showed anything gets no notice
  by design (its transcript must still close it).

Invariants:

(a) A *stream* is one provider request; it is *active* from its start until it completed or its
    connection closed — a stream that asked for a tool stays active while the tool runs, until
    its worker's next stream for the session (at most TOOL_WINDOW_S) — except while its worker
    process was stopped (and WAKE_GRACE_S after SIGCONT, to notice the lost lease) or after it
    died. No two streams of one session are active at once (tolerance OVERLAP_TOLERANCE_S).
(b) Every accepted Telegram message ends answered (exactly once), interrupted with notice, or
    superseded; it is in the transcript (a webhook 2xx is a promise to keep it); every partial
    answer shown for it is followed by an answer or a notice for it; no takeover notice follows
    its whole answer; its first answer or notice comes within a bound (records.outcome_bound:
    answer time + 3 s, plus for each fault that can hold it up its length + TTL + 2 s, and one
    TTL more for Redis back empty: the workers' quarantine); a turn streaming when a pause or a
    Redis restart began shows something within TTL + 2 s (+ the quarantine) after the fault
    ended; a turn streaming on a process that is killed, restarted, or stopped past TTL + 2 s is
    taken over (a notice or a stream for it from another incarnation) within TTL + 2 s.
(c) *Acquisitions* of a session: each turn's first stream (by its incarnation) and each takeover
    notice. Output of a turn (its Telegram sends and edits, a stop notice, "typing", and provider
    requests that continue it after a tool) must not happen after another incarnation's later
    acquisition. A call arriving within INFLIGHT_S after its process' SIGCONT was on its way when
    the process was stopped: tolerated and listed.
(d) The final transcript: each user row is followed, before the next user row, by exactly one
    assistant row without tool calls (the answer or the interruption) as the last row of the
    turn — or by an interrupted tool result, if the turn was cut off while a tool ran; no message
    is recorded twice; an API answer given as whole is recorded as whole. User rows keep the
    order the messages were sent in, as far as the client could know it: a message acknowledged
    (a webhook 2xx, an API 200) before another was first sent is recorded before it. (Retries
    and resends of one message are one message; a message never acknowledged sets no order: a
    client that gave up on it, or whose request timed out, cannot know where it was put.)
(f) Leases, from Redis' own record of every lease write (tests/chaos/lease_log.py): a holder's
    lease runs from its acquisition until its release, or its last extension + the TTL it set,
    or its process' death; no other incarnation acquires the session's lease inside that
    (tolerance LEASE_TOLERANCE_S); every acquisition's fencing number is above all earlier ones.
(e) After settling, no inbound record is still open (accepted / running / restart) for a session
    with nothing running; no tool process of a killed worker outlives it by 0.5 s;
    no worker process exits unless killed.

Tolerances for at-least-once: a second whole answer, or a takeover notice after a whole answer,
or an API answer recorded as interrupted, is tolerated (and listed) when the first answer came at
most AT_FAULT_S before a fault of its worker (or of Redis): sending and recording cannot be one
atomic step. A recorded answer whose end its turn never confirmed shown is shown again, whole and
as a new message, by the incarnation that takes the session over: that call carries the earlier
incarnation's stream, and is tolerated (and listed) when it came after that incarnation's
acquisition; the answered-twice check still counts its whole answers.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.chaos.records import (
    END,
    FAIL_MARK,
    SHARED,
    STOP_MARK,
    TAKEOVER_MARKERS,
    TAKEOVER_SLACK_S,
    ApiMessage,
    BotMessage,
    FaultRecord,
    LeaseEvent,
    Records,
    Row,
    Stream,
    TgCall,
    TgMessage,
    chat_of,
    message_tag,
    outcome_bound,
    quarantine_s,
    session_of_key,
    stream_number,
)

OVERLAP_TOLERANCE_S = 0.1
TOOL_WINDOW_S = 5.0  # a tool run after a stream that asked for it, at most (the fake's tools sleep 2-4 s)
WAKE_GRACE_S = 1.0
INFLIGHT_S = 0.05
AT_FAULT_S = 0.5  # an answer shown this shortly before its process died may be shown again (at-least-once)
LEASE_TOLERANCE_S = 0.01  # both ends of a lease overlap are Redis' own clock
REFUSALS_400 = ("storage", "unavailable", "could not save", "could not pass")

KINDS = {
    "concurrent-streams": "two provider streams (or a stream's tool run) of one session active at the same time",
    "zombie-output": "a turn's output (Telegram call, or provider request after its tool) after another "
                     "incarnation took the session up",
    "foreign-stream-output": "a Telegram call carrying a stream tag of another incarnation",
    "double-takeover": "two incarnations each sent a takeover notice for the same message",
    "answered-twice": "two whole answers shown for one message",
    "answered-then-taken-over": "a whole answer was shown, and later a takeover notice said it was cut off",
    "frozen-half-answer": "a partial answer shown, and nothing after it: no answer, no notice",
    "no-outcome": "accepted and recorded, but the user saw nothing at all for it",
    "accepted-not-stored": "a webhook answered 2xx, but the message never reached the transcript",
    "stall": "no answer or notice within the bound (answer time + faults + TTL + 2 s)",
    "slow-takeover": "a turn in flight on a dead/stopped worker got no new owner within TTL + 2 s",
    "agent-failed": "a turn ended with 'the agent failed' (the fake provider never fails)",
    "transcript-unanswered": "a user row with no assistant row after it",
    "transcript-extra-assistant": "an assistant row with no user row before it (two answers for one message)",
    "transcript-duplicate-user": "one message recorded as a user row twice",
    "transcript-out-of-order": "a user's messages recorded out of the order they were sent in: a message "
                               "acknowledged to its client before the next one was sent is recorded after it",
    "api-answer-not-recorded": "the API answered 200, but the transcript has no such answer",
    "api-bad-answer": "a 200 answer that is neither whole nor marked interrupted",
    "api-refused-but-answered": "the API told the client to try again (503, 400) for a message whose turn was answered "
                                "whole and recorded: a retry (the SDKs retry 503 themselves) records the message twice",
    "api-400-for-unavailable": "the API answered 400 for a transient failure (should be 503 + Retry-After)",
    "api-503-without-retry-after": "a 503 without a Retry-After header",
    "api-unexpected-status": "an API status other than 200, 400 (busy elsewhere) and 503",
    "open-inbound": "after settling, an inbound record still open with nothing running for its session",
    "lease-overlap": "by Redis' own record of the lease writes (MONITOR), another incarnation acquired a session's "
                     "lease while its holder still held it (not released, not expired by its last renewal + TTL, "
                     "holder alive)",
    "fence-not-growing": "an acquisition of a session's lease took a fencing number not above an earlier one",
    "orphaned-tool": "a killed worker's tool process still running half a second after the kill",
    "restart-failed": "a worker process could not be (re)started",
    "worker-crashed": "a worker process exited although nobody killed it",
}


@dataclass
class Violation:
    kind: str
    session: str
    evidence: str


@dataclass
class Report:
    seed: int
    counts: dict[str, int]
    violations: list[Violation]
    tolerated: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_kind(self) -> dict[str, int]:
        return dict(Counter(v.kind for v in self.violations).most_common())

    def text(self, limit: int = 80) -> str:
        out = [f"chaos seed={self.seed}: {len(self.violations)} violation(s)"
               + (" " + ", ".join(f"{k} {n}" for k, n in self.by_kind().items()) if self.violations else "")
               + f"  [reproduce: CHAOS_SEED={self.seed}]"]
        out.append("counts: " + ", ".join(f"{k} {v}" for k, v in self.counts.items()))
        out.append("faults: " + ("; ".join(self.faults) or "none"))
        for note in self.notes:
            out.append(f"note: {note}")
        for v in self.violations[:limit]:
            out.append(f"- [{v.kind}] seed={self.seed} session {v.session}: {v.evidence}")
        if len(self.violations) > limit:
            out.append(f"- ... and {len(self.violations) - limit} more")
        for t in self.tolerated:
            out.append(f"tolerated: {t}")
        for kind in self.by_kind():
            out.append(f"({kind}: {KINDS.get(kind, '?')})")
        return "\n".join(out)


def check(records: Records) -> Report:
    return _Checker(records).run()


def classify(text: str) -> str:
    """What a bot message's text is: answer | partial | notice | failed | other."""
    if FAIL_MARK in text:
        return "failed"
    if STOP_MARK in text:
        return "notice"
    if stream_number(text) is not None:
        return "answer" if text.rstrip().endswith(END) else "partial"
    return "other"


def is_takeover(text: str) -> bool:
    return STOP_MARK in text and any(marker in text for marker in TAKEOVER_MARKERS)


class _Checker:
    def __init__(self, records: Records) -> None:
        self.r = records
        self.v: list[Violation] = []
        self.tolerated: list[str] = []
        self.notes: list[str] = []
        self.streams = {s.number: s for s in records.streams}
        self.by_tag = {m.tag: m for m in records.telegram}
        self.by_msgid = {(m.chat_id, m.message_id): m for m in records.telegram}
        self.chat_session = {m.chat_id: m.session for m in records.telegram}
        self.calls_by_chat: dict[int, list[TgCall]] = defaultdict(list)
        for call in sorted(records.calls, key=lambda c: c.at):
            self.calls_by_chat[call.chat_id].append(call)
        self.streams_by_session: dict[str, list[Stream]] = defaultdict(list)
        for s in sorted(records.streams, key=lambda s: s.opened_at):
            if s.session:
                self.streams_by_session[s.session].append(s)
        self.bots_by_tag: dict[str, list[BotMessage]] = defaultdict(list)
        self.tag_of_bot: dict[tuple[int, int], str] = {}
        for bm in records.bot_messages:
            tag = self._attribute(bm)
            if tag is not None:
                self.bots_by_tag[tag].append(bm)
                self.tag_of_bot[(bm.chat_id, bm.message_id)] = tag
        self.counts: Counter[str] = Counter()

    # --- helpers ----------------------------------------------------------------------------

    def t(self, at: float | None) -> str:
        return "never" if at is None else f"{at - self.r.t0:.2f}s"

    def add(self, kind: str, session: str, evidence: str) -> None:
        self.v.append(Violation(kind, session, evidence))

    def fault_before(self, at: float) -> str:
        """The last fault that started before `at`, for context."""
        before = [f for f in self.r.faults if f.started_at <= at]
        return f" (last fault before: {before[-1].describe(self.r.t0)})" if before else " (before any fault)"

    def _attribute(self, bm: BotMessage) -> str | None:
        n = stream_number(bm.text)
        if n is not None and n in self.streams:
            return self.streams[n].tag
        if bm.reply_to is not None and (m := self.by_msgid.get((bm.chat_id, bm.reply_to))) is not None:
            return m.tag
        for call in reversed(self.calls_by_chat.get(bm.chat_id, [])):
            if call.at < bm.sent_at and (n := stream_number(call.text)) is not None and n in self.streams:
                return self.streams[n].tag
        earlier = [m for m in self.r.telegram if m.chat_id == bm.chat_id and m.sent_at <= bm.sent_at]
        return earlier[-1].tag if earlier else None

    def bound(self, m: TgMessage, accepted: float) -> tuple[float, list[FaultRecord]]:
        return outcome_bound(accepted, self.r.faults, answer_s=self.r.answer_s, ttl_s=self.r.ttl_s,
                             now=self.r.collected_at, owner_at=lambda t: self.owner_at(m.session, t))

    def owner_at(self, session: str, at: float) -> str | None:
        """The incarnation that last started a stream for `session` before `at`."""
        before = [s.via for s in self.streams_by_session.get(session, []) if s.opened_at <= at]
        return before[-1] if before else None

    def transcript_rows(self, session: str) -> list[Row]:
        return self.r.transcripts.get(session, [])

    def turn_of(self, session: str, tag: str) -> list[Row] | None:
        """The rows after the message's user row up to the next user row (None: no user row)."""
        rows = self.transcript_rows(session)
        for i, row in enumerate(rows):
            if row.role == "user" and message_tag(row.content) == tag:
                block = []
                for later in rows[i + 1:]:
                    if later.role == "user":
                        break
                    block.append(later)
                return block
        return None

    # --- the checks -------------------------------------------------------------------------

    def run(self) -> Report:
        for line in self.r.harness_errors:
            self.add("restart-failed", "-", line)
        for name, code in sorted(self.r.crashed.items()):
            self.add("worker-crashed", "-", f"{name} exited by itself with status {code}" +
                     (f"; its log: {self.r.log_tails[name.split('.')[0]]}" if name.split(".")[0] in self.r.log_tails
                      else ""))
        for f in self.r.faults:
            if f.orphans:
                self.add("orphaned-tool", "-",
                         f"{f.kind} {f.target} at {self.t(f.started_at)}: {len(f.orphans)} of its "
                         f"{len(f.tools_at_kill)} tool process(es) still running 0.5 s later (pids "
                         f"{', '.join(map(str, f.orphans))})")
        self.check_streams()
        self.check_outputs()
        self.check_telegram_messages()
        self.check_takeover_latency()
        self.check_progress_after_faults()
        self.check_transcripts()
        self.check_send_order()
        self.check_api()
        self.check_open_inbound()
        self.check_leases()
        for worker_id, text in sorted(self.r.log_tails.items()):
            self.notes.append(f"{worker_id} log: {text}")
        counts = {
            "telegram messages": len(self.r.telegram),
            "accepted": self.counts["tg accepted"],
            "answered": self.counts["tg answered"],
            "interrupted with notice": self.counts["tg interrupted"],
            "superseded": self.counts["tg superseded"],
            "refused": self.counts["tg refused"],
            "without outcome": self.counts["tg no outcome"],
            "api messages": len(self.r.api),
            "api attempts": sum(len(m.attempts) for m in self.r.api),
            "api answered": sum(m.outcome == "answered" for m in self.r.api),
            "api interrupted": sum(m.outcome == "interrupted" for m in self.r.api),
            "api refused": sum(m.outcome == "refused" for m in self.r.api),
            "provider streams": len(self.r.streams),
            "telegram calls": len(self.r.calls),
            "faults": len(self.r.faults),
            "lease acquisitions": sum(e.op == "acquire" for e in self.r.leases),
        }
        return Report(self.r.seed, counts, self.v, self.tolerated,
                      [f.describe(self.r.t0) for f in self.r.faults], self.notes)

    # (a) never two streams of one session at once

    def _active(self, s: Stream) -> list[tuple[float, float]]:
        end = s.ended_at if s.ended_at is not None else self.r.collected_at
        if s.tool_call:  # the turn goes on running the tool, until its next round (or its next turn) starts
            later = [t.opened_at for t in self.streams_by_session.get(s.session or "", [])
                     if t.via == s.via and t.opened_at > s.opened_at]
            # The tool's own record of its end where there is one (it is stopped with its turn);
            # else the longest a tool could run.
            until = s.tool_ended_at if s.tool_ended_at is not None else s.opened_at + TOOL_WINDOW_S
            end = min([*later[:1], until, self.r.collected_at])
        inc = self.r.incarnations.get(s.via or "")
        if inc is not None and inc.ended_at is not None:
            end = min(end, inc.ended_at)
        spans = [(s.opened_at, end)]
        for stop, cont in inc.stopped if inc is not None else []:
            cut_end = (cont if cont is not None else self.r.collected_at) + WAKE_GRACE_S
            spans = [piece for a, b in spans for piece in ((a, min(b, stop)), (max(a, cut_end), b))
                     if piece[1] > piece[0]]
        return spans

    def check_streams(self) -> None:
        for session, streams in self.streams_by_session.items():
            active = [(s, self._active(s)) for s in streams]
            for i, (s1, a1) in enumerate(active):
                for s2, a2 in active[i + 1:]:
                    overlap = sum(max(0.0, min(b1, b2) - max(x1, x2)) for x1, b1 in a1 for x2, b2 in a2)
                    if overlap > OVERLAP_TOLERANCE_S:
                        self.add("concurrent-streams", session,
                                 f"{_stream(s1, a1, self.t)} and {_stream(s2, a2, self.t)} were active at the "
                                 f"same time for {overlap:.2f} s" + self.fault_before(s2.opened_at))

    # (c) nothing from an old owner after another took over

    def _acquisitions(self, session: str, chat: int | None) -> list[tuple[float, str]]:
        """(when, who) each time an incarnation took the session up: a turn's first stream, or a
        takeover notice. (A stream carrying a tool's result continues its turn: not one.)"""
        acq = [(s.opened_at, s.via or "?") for s in self.streams_by_session.get(session, []) if not s.after_tool]
        acq += [(c.at, c.via or "?") for c in self.calls_by_chat.get(chat or 0, [])
                if c.method == "sendMessage" and is_takeover(c.text)]
        return sorted(acq)

    def turn_start(self, s: Stream) -> float:
        """When the turn a stream belongs to began (a tool-result stream continues an earlier one)."""
        while s.after_tool:
            before = [t for t in self.streams_by_session.get(s.session or "", [])
                      if t.via == s.via and t.tag == s.tag and t.tool_call and t.opened_at < s.opened_at]
            if not before:
                break
            s = before[-1]
        return s.opened_at

    def check_outputs(self) -> None:
        """Telegram calls (and provider requests that continue a turn after its tool) belong to the
        acquisition they came from; none may happen after another incarnation's newer one."""
        for session in sorted(set(self.streams_by_session) | set(self.chat_session.values())):
            chat = chat_of(session) if session.startswith("g") else None
            acq = self._acquisitions(session, chat)
            outputs: list[tuple[float, str, str, float | None, str]] = []  # at, via, what, origin, sample
            for call in self.calls_by_chat.get(chat or 0, []):
                via = call.via or "?"
                n = stream_number(call.text) if call.method != "sendChatAction" else None
                if n is not None:
                    stream = self.streams.get(n)
                    if stream is None:
                        continue
                    origin: float | None = self.turn_start(stream)
                    if stream.via != via:
                        origin = self._foreign_stream(session, call, stream, origin)
                elif call.method == "sendChatAction" or (
                        (STOP_MARK in call.text or FAIL_MARK in call.text) and not is_takeover(call.text)):
                    own = [t for t, who in acq if who == via and t <= call.at + 1.0]
                    origin = own[-1] if own else None
                else:
                    continue  # refusals and takeover notices: intake and recovery, not a turn's output
                what = "typing" if call.method == "sendChatAction" else \
                    "notice" if STOP_MARK in call.text else call.method
                outputs.append((call.at, via, what, origin, "" if what == "typing" else call.text[:60]))
            for s in self.streams_by_session.get(session, []):
                if s.after_tool:
                    outputs.append((s.opened_at, s.via or "?", "provider request", self.turn_start(s),
                                    f"c{s.number} after its tool"))
            # per (incarnation, the acquisition its output came from): what it sent after being superseded
            zombies: dict[tuple[str, float | None], list[tuple[float, str, str, float, str]]] = defaultdict(list)
            for at, via, what, origin, sample in sorted(outputs):
                newer = [(t, who) for t, who in acq if who != via and (origin is None or t > origin) and t < at]
                if not newer:
                    continue
                inc = self.r.incarnations.get(via)
                woke = [c for _s, c in inc.stopped if c is not None and 0 <= at - c < INFLIGHT_S] if inc else []
                if woke:
                    self.tolerated.append(f"{session}: {what} by {via} at {self.t(at)}, "
                                          f"{(at - woke[0]) * 1000:.0f} ms after SIGCONT (in flight when stopped)")
                    continue
                zombies[(via, origin)].append((at, what, sample, *newer[0]))
            for (via, origin), found in zombies.items():
                kinds = Counter(what for _at, what, _sample, _t, _who in found)
                sample = next((x for _at, _what, x, _t, _who in found if x), "")
                _at, _what, _sample, t_new, who_new = found[0]
                self.add("zombie-output", session,
                         f"{len(found)} call(s) by {via} ({', '.join(f'{k} {n}' for k, n in kinds.items())}) "
                         f"at {self.t(found[0][0])}-{self.t(found[-1][0])} for its turn begun at {self.t(origin)}, "
                         f"after {who_new} had taken the session up at {self.t(t_new)}"
                         + (f"; e.g. {sample!r}" if sample else "") + self.fault_before(t_new))

    def _foreign_stream(self, session: str, call: TgCall, stream: Stream, origin: float | None) -> float | None:
        """A Telegram call carrying another incarnation's stream is a violation, but for a recovery
        showing again an answer whose showing its turn never confirmed (the answer recorded, its
        end not shown, the lease lost): the whole answer, sent anew by an incarnation that took the
        session up after the stream began. Returns the acquisition the call came from."""
        taken = [e.at for e in self.r.leases if e.session == session and e.op == "acquire" and e.holder == call.via
                 and stream.opened_at < e.at <= call.at]
        if call.method == "sendMessage" and stream.completed and call.text.rstrip().endswith(END) and taken:
            self.tolerated.append(f"{session}: c{stream.number} of {stream.via} shown again whole by {call.via} "
                                  f"at {self.t(call.at)} (recorded, never confirmed shown)")
            return taken[-1]
        self.add("foreign-stream-output", session, f"{call.method} by {call.via} at {self.t(call.at)} "
                 f"carries stream c{stream.number} of {stream.via}")
        return origin

    # (b) every accepted message: answered, or interrupted with notice, exactly once; in time

    def check_telegram_messages(self) -> None:
        for m in self.r.telegram:
            self._check_message(m)
        for chat, calls in self.calls_by_chat.items():
            # Per turn: a takeover of the message's turn, then of its resume (cut off too), is two.
            by_turn: dict[tuple[int, int], set[str]] = defaultdict(set)
            for c in calls:
                if c.method == "sendMessage" and is_takeover(c.text) and c.reply_to is not None:
                    by_turn[(c.reply_to, self._resumes_before(chat, c.reply_to, c.at))].add(c.via or "?")
            for (target, _turn), who in by_turn.items():
                if len(who) > 1:
                    taken = self.by_msgid.get((chat, target))
                    self.add("double-takeover", self.chat_session.get(chat, str(chat)),
                             f"[{taken.tag if taken else target}] taken over by {', '.join(sorted(who))}")

    def _resumes_before(self, chat: int, message_id: int, at: float) -> int:
        """How many resumes of a message's turn had begun by `at` (which of its turns a notice ends)."""
        taken = self.by_msgid.get((chat, message_id))
        if taken is None:
            return 0
        return sum(1 for s in self.streams.values() if s.tag == taken.tag and s.resume and s.opened_at < at)

    def _check_message(self, m: TgMessage) -> None:
        turn = self.turn_of(m.session, m.tag)
        stored = turn is not None
        if m.accepted_at is None and not stored:
            self.counts["tg refused"] += 1
            return
        self.counts["tg accepted"] += 1
        accepted = m.accepted_at if m.accepted_at is not None else m.attempts[0].at if m.attempts else m.sent_at
        bots = sorted(self.bots_by_tag.get(m.tag, []), key=lambda b: b.sent_at)
        kinds = {b.message_id: classify(b.text) for b in bots}
        answers = [b for b in bots if kinds[b.message_id] == "answer"]
        notices = [b for b in bots if kinds[b.message_id] in ("notice", "failed")]
        partials = [b for b in bots if kinds[b.message_id] == "partial"]
        if not stored:
            posts = ", ".join(f"{a.target}:{a.status or a.error}" for a in m.attempts)
            said = "; ".join(f"{b.via} said {b.text[:70]!r}" for b in bots if kinds[b.message_id] == "other")
            where = self.r.inbox.get(m.tag, "in no worker's inbox")
            self.add("accepted-not-stored", m.session,
                     f"[{m.tag}] webhook posts {posts}; accepted at {self.t(m.accepted_at)}; no user row; "
                     f"{said or 'no notice'}; {where}" + self.fault_before(accepted))
            self.counts["tg no outcome"] += 1
            return
        if len(answers) > 1:
            self._answered_twice(m, answers)
        for b in notices:
            if FAIL_MARK in b.text:
                self.add("agent-failed", m.session, f"[{m.tag}] {b.via} at {self.t(b.changed_at)}: {b.text[-80:]!r}")
        if answers:
            self._taken_over_after_answer(m, answers, notices)
        outcomes = answers + notices
        frozen = [p for p in partials if not any(o.changed_at >= p.sent_at for o in outcomes)]
        first_outcome = min((o.changed_at for o in outcomes), default=None)
        row = _closing(turn)
        if frozen:
            p = frozen[-1]
            self.add("frozen-half-answer", m.session,
                     f"[{m.tag}] partial c{stream_number(p.text)} by {p.via} last changed at {self.t(p.changed_at)} "
                     f"({len(p.text.split())} words), nothing after it; transcript: {_row(row)}"
                     + self.fault_before(p.changed_at))
        if answers:
            outcome = "answered"
        elif notices:
            outcome = "interrupted"
        elif not partials and m.next_sent_at is not None:
            outcome = "superseded"  # (whether its turn was closed properly is check_transcripts' business)
        else:
            outcome = "no outcome"
        self.counts[f"tg {outcome}"] += 1
        if outcome == "no outcome" and not frozen:
            self.add("no-outcome", m.session,
                     f"[{m.tag}] accepted at {self.t(accepted)}, nothing shown for it; transcript: {_row(row)}"
                     + self.fault_before(accepted))
        if m.early:
            return
        limit, touching = self.bound(m, accepted)
        why = "answer time + slack" + "".join(f" + {f.kind} {f.target}" for f in touching)
        if first_outcome is not None and first_outcome > limit:
            self.add("stall", m.session, f"[{m.tag}] accepted at {self.t(accepted)}, first answer/notice at "
                     f"{self.t(first_outcome)} ({first_outcome - accepted:.1f} s; bound {limit - accepted:.1f} s = "
                     f"{why})" + (f"; the user had written again at {self.t(m.next_sent_at)}"
                                  if m.next_sent_at and m.next_sent_at < first_outcome else ""))
        elif outcome == "superseded" and m.next_sent_at is not None and m.next_sent_at > limit:
            self.add("stall", m.session, f"[{m.tag}] accepted at {self.t(accepted)}, no answer or notice before "
                     f"the user gave up at {self.t(m.next_sent_at)} (bound {limit - accepted:.1f} s = {why})")

    def _answered_twice(self, m: TgMessage, answers: list[BotMessage]) -> None:
        first = min(answers, key=lambda b: b.changed_at)
        stream = self.streams.get(stream_number(first.text) or 0)
        at_fault = stream is not None and any(
            f.target in (stream.via, *SHARED) and 0 <= f.started_at - first.changed_at <= AT_FAULT_S
            for f in self.r.faults)
        shown = ", ".join(f"c{stream_number(b.text)} by {b.via} at {self.t(b.changed_at)}" for b in answers)
        if at_fault:
            self.tolerated.append(f"{m.session}: [{m.tag}] answered twice ({shown}); the first just before a fault")
        else:
            self.add("answered-twice", m.session, f"[{m.tag}] whole answers: {shown}" + self.fault_before(
                max(b.changed_at for b in answers)))

    def _taken_over_after_answer(self, m: TgMessage, answers: list[BotMessage], notices: list[BotMessage]) -> None:
        done = min(b.changed_at for b in answers)
        later = [b for b in notices if b.reply_to == m.message_id and b.sent_at > done and is_takeover(b.text)]
        if not later:
            return
        stream = self.streams.get(stream_number(min(answers, key=lambda b: b.changed_at).text) or 0)
        faulted = [f for f in self.r.faults if stream is not None and f.target in (stream.via, *SHARED)
                   and 0 <= f.started_at - done <= AT_FAULT_S]
        what = (f"[{m.tag}] whole answer shown at {self.t(done)} (c{stream.number if stream else '?'} by "
                f"{stream.via if stream else '?'}), then {later[0].via} said {later[0].text[:70]!r} at "
                f"{self.t(later[0].sent_at)}")
        if faulted:
            self.tolerated.append(f"{m.session}: {what}; {faulted[0].kind} right after the answer")
        else:
            self.add("answered-then-taken-over", m.session, what + self.fault_before(later[0].sent_at))

    # adoption: a turn cut off by a dead or stopped process gets a new owner within TTL + 2 s

    def check_takeover_latency(self) -> None:
        """A turn in flight on a process that is killed (or restarted, or stopped past TTL + 2 s)
        is taken over — a notice for it, or a stream for it, from another incarnation — within
        TTL + 2 s of the fault."""
        for f in self.r.faults:
            if f.kind not in ("kill", "kill_restart", "pause_long"):
                continue
            kill = f.started_at
            deadline = kill + self.r.ttl_s + TAKEOVER_SLACK_S
            if f.kind == "pause_long" and f.ended_at is not None and f.ended_at < deadline:
                continue  # it woke up first: nothing to adopt (check_progress_after_faults' case)
            for s in self.r.streams:
                if s.via != f.target or not s.session or s.session[0] != "g":
                    continue
                if not (s.opened_at < kill and (s.ended_at is None or s.ended_at >= kill)):
                    continue
                m = self.by_tag.get(s.tag or "")
                if m is None:
                    continue
                signs = [x.opened_at for x in self.streams_by_session[m.session]
                         if x.via != f.target and x.tag == m.tag and x.opened_at > kill]
                signs += [c.at for c in self.calls_by_chat.get(m.chat_id, [])
                          if c.via != f.target and c.at > kill and self._concerns(c, m)]
                first = min(signs, default=None)
                if first is None or first > deadline:
                    self.add("slow-takeover", m.session,
                             f"[{m.tag}] streaming on {f.target} (c{s.number}) at {f.kind} {self.t(kill)}; taken "
                             f"over (a notice or a stream for it from elsewhere) {self.t(first)}"
                             + (f" ({first - kill:.1f} s later" if first is not None else " (")
                             + f"; limit TTL + {TAKEOVER_SLACK_S:g} = {self.r.ttl_s + TAKEOVER_SLACK_S:.1f} s)")

    def check_progress_after_faults(self) -> None:
        """A turn in flight when a pause or a Redis restart began shows something within TTL + 2 s
        after the fault is over (one TTL more after Redis came back empty: the quarantine): more
        of its answer, its end, or a notice. (A pause that outlasts TTL + 2 s is
        check_takeover_latency's case.)"""
        for f in self.r.faults:
            if f.kind not in ("pause_short", "pause_long", "redis_restart", "redis_wipe", "pg_restart", "disk_full") \
                    or f.ended_at is None:
                continue
            start, back = f.started_at, f.ended_at
            if f.kind == "pause_long" and back >= start + self.r.ttl_s + TAKEOVER_SLACK_S:
                continue
            limit = back + self.r.ttl_s + TAKEOVER_SLACK_S + quarantine_s(f.kind, self.r.ttl_s)
            for s in self.r.streams:
                if (f.target not in SHARED and s.via != f.target) or not s.session or s.session[0] != "g":
                    continue
                if not (s.opened_at < start and (s.ended_at is None or s.ended_at >= start)):
                    continue
                m = self.by_tag.get(s.tag or "")
                if m is None:
                    continue
                done = [b for b in self.bots_by_tag.get(m.tag, [])
                        if classify(b.text) in ("answer", "notice", "failed") and b.changed_at <= back]
                if done:
                    continue
                calls = [c for c in self.calls_by_chat.get(m.chat_id, []) if self._concerns(c, m)]
                if any(back < c.at <= limit for c in calls):
                    continue
                # (a refusal of an earlier attempt, "can't take messages right now", is not its turn's output)
                shown = [c for c in calls if m.accepted_at is None or c.at >= m.accepted_at]
                if not shown and m.next_sent_at is not None and m.next_sent_at <= limit:
                    continue  # superseded: the user's next message replaced it before it showed anything
                before = [c.at for c in calls if c.at <= back]
                after = [c.at for c in calls if c.at > limit]
                self.add("stall", m.session,
                         f"[{m.tag}] streaming (c{s.number} on {s.via}) when {f.kind} {f.target} began at "
                         f"{self.t(start)}; it ended at {self.t(back)}, and nothing was shown for the message "
                         f"until {self.t(limit)} ({limit - back:.1f} s later): last output before "
                         f"{self.t(max(before, default=None))}, next {self.t(min(after, default=None))}")

    def _concerns(self, call: TgCall, m: TgMessage) -> bool:
        """Is this Telegram call (text, not typing) about message m?"""
        if call.method == "sendChatAction":
            return False
        if call.message_id is not None and (call.chat_id, call.message_id) in self.tag_of_bot:
            return self.tag_of_bot[(call.chat_id, call.message_id)] == m.tag
        n = stream_number(call.text)
        if n is not None:
            stream = self.streams.get(n)
            return stream is not None and stream.tag == m.tag
        return call.reply_to == m.message_id or STOP_MARK in call.text or FAIL_MARK in call.text

    # (d) the transcript: one assistant row per user row

    def check_transcripts(self) -> None:
        """Each user row starts a turn: the rows up to the next user row (tool calls and results,
        if any) end with exactly one assistant row without tool calls (the answer, or the
        interruption) — or, if it was cut off while a tool ran, with that interrupted tool result."""
        for session, rows in sorted(self.r.transcripts.items()):
            seen: set[str] = set()
            starts = [i for i, row in enumerate(rows) if row.role == "user"]
            if rows and (not starts or starts[0] > 0):
                self.add("transcript-extra-assistant", session, "rows before the first user row: " + _window(rows, 0))
            for n, i in enumerate(starts):
                tag = message_tag(rows[i].content)
                if tag is not None and tag in seen:
                    self.add("transcript-duplicate-user", session, f"[{tag}] twice: " + _window(rows, i))
                if tag is not None:
                    seen.add(tag)
                end = starts[n + 1] if n + 1 < len(starts) else len(rows)
                closing = [j for j in range(i + 1, end) if rows[j].role == "assistant" and not rows[j].tool_calls]
                closing += [j for j in range(i + 1, end - 1) if rows[j].role == "tool" and rows[j].interrupted_by]
                closing.sort()
                if not closing and end - 1 > i and rows[end - 1].closes_turn:
                    pass  # cut off while a tool ran: the interrupted tool result closes it
                elif not closing:
                    where = "is the last row" if end == len(rows) else "has no answer or interruption row " \
                        "before the next user row"
                    self.add("transcript-unanswered", session, f"{_label(rows[i])} {where}: " + _window(rows, i))
                elif len(closing) > 1:
                    self.add("transcript-extra-assistant", session, f"{_label(rows[i])} has {len(closing)} "
                             "answer/interruption rows: " + _window(rows, closing[1]))
                elif closing[0] != end - 1:
                    self.add("transcript-extra-assistant", session, f"rows after the end of {_label(rows[i])}'s "
                             "turn: " + _window(rows, closing[0] + 1))

    def _send_times(self) -> dict[str, tuple[float, float | None]]:
        """Message tag ("g03 m2", "a01 m3") -> (first sent, first acknowledged or None)."""
        out: dict[str, tuple[float, float | None]] = {}
        for m in self.r.telegram:
            out[m.tag] = (m.attempts[0].at if m.attempts else m.sent_at, m.accepted_at)
        for api in self.r.api:
            if api.attempts:
                acks = [a.ended_at for a in api.attempts if a.status == 200]
                out[api.tag] = (api.attempts[0].at, min(acks, default=None))
        return out

    def check_send_order(self) -> None:
        """A message acknowledged to its client before another of the session's messages was first
        sent must be recorded before it: a row of the later message above a row of the earlier
        one is a message put out of order (the client had been told the earlier one was taken)."""
        times = self._send_times()
        for session, rows in sorted(self.r.transcripts.items()):
            seq = [(i, _message_of(tag)) for i, row in enumerate(rows)
                   if row.role == "user" and (tag := message_tag(row.content)) is not None]
            reported: set[str] = set()
            for j, (row_j, later) in enumerate(seq):
                ack = times.get(later, (0.0, None))[1]
                if ack is None:
                    continue
                for row_i, earlier in seq[:j]:
                    sent = times.get(earlier, (None, None))[0]
                    if earlier == later or earlier in reported or sent is None or sent <= ack:
                        continue
                    reported.add(earlier)
                    self.add("transcript-out-of-order", session,
                             f"[{earlier}] (first sent at {self.t(sent)}) recorded as row {row_i}, before "
                             f"[{later}] (row {row_j}), which had been acknowledged at {self.t(ack)}: "
                             + _window(rows, row_i) + self.fault_before(sent))

    # the HTTP API's answers

    def check_api(self) -> None:
        for m in self.r.api:
            bad400 = [a for a in m.attempts if a.status == 400 and any(w in (a.error or "").lower()
                                                                     for w in REFUSALS_400)]
            if bad400:
                self.add("api-400-for-unavailable", m.session,
                         f"[{m.tag}] {len(bad400)} attempt(s) answered 400 {bad400[0].error!r} (by "
                         f"{bad400[0].target} at {self.t(bad400[0].at)})" + self.fault_before(bad400[0].at))
            for a in m.attempts:
                if a.status == 503 and not a.retry_after:
                    self.add("api-503-without-retry-after", m.session, f"[{m.tag}] {a.target} at {self.t(a.at)}")
                elif a.status is not None and a.status not in (200, 400, 503):
                    self.add("api-unexpected-status", m.session,
                             f"[{m.tag}] {a.status} from {a.target} at {self.t(a.at)}: {(a.error or a.body)[:100]!r}")
            self._check_refused_but_answered(m)
            for t, a in enumerate(m.attempts, 1):
                if a.status != 200:
                    continue
                tag = f"{m.tag} t{t}"
                if a.interrupted is None and not (a.body.rstrip().endswith(END) and message_tag(a.body) == tag):
                    self.add("api-bad-answer", m.session, f"[{tag}] 200 from {a.target}: {a.body[-80:]!r}")
                turn = self.turn_of(m.session, tag)
                closing = _closing(turn)
                answered = a.interrupted is None
                ok = closing is not None and (
                    not answered or (closing.interrupted_by is None and stream_number(closing.content) is not None))
                if not ok:
                    # the worker asked, or (relayed from another worker) the one that ran the turn
                    ran = {s.via for s in self.streams_by_session.get(m.session, []) if s.tag == tag}
                    died = [f for f in self.r.faults if f.target in (a.target, *ran, *SHARED)
                            and 0 <= f.started_at - a.ended_at <= AT_FAULT_S]
                    what = f"[{tag}] answered 200 ({'whole' if answered else a.interrupted}) by {a.target} at " \
                           f"{self.t(a.ended_at)}; transcript: {_row(closing)}" \
                           + (" (no user row)" if turn is None else "")
                    if died:
                        self.tolerated.append(f"{m.session}: {what}; {died[0].kind} just after")
                    else:
                        self.add("api-answer-not-recorded", m.session, what + self.fault_before(a.ended_at))

    # (f) leases, as Redis recorded them

    def check_leases(self) -> None:
        if not self.r.leases_monitored:
            return
        if self.r.lease_gaps:
            self.notes.append("lease monitor not connected: " + ", ".join(
                f"{self.t(a)}-{self.t(b)}" for a, b in self.r.lease_gaps))
        by_session: dict[str, list[LeaseEvent]] = defaultdict(list)
        for e in sorted(self.r.leases, key=lambda e: e.at):
            by_session[e.session].append(e)
        for session, events in sorted(by_session.items()):
            self._check_fences(session, events)
            self._check_holders(session, events)

    def _check_fences(self, session: str, events: list[LeaseEvent]) -> None:
        """Every acquisition's fencing number is above every earlier one of the session."""
        top: LeaseEvent | None = None
        for e in events:
            if e.op != "acquire" or e.fence is None:
                continue
            if top is not None and top.fence is not None and e.fence <= top.fence:
                self.add("fence-not-growing", session,
                         f"{e.holder} acquired the lease at {self.t(e.at)} with fence {e.fence}, not above fence "
                         f"{top.fence} taken by {top.holder} at {self.t(top.at)}" + self.fault_before(e.at))
            if top is None or top.fence is None or e.fence > top.fence:
                top = e

    def _lease_end(self, h: _Holding) -> float:
        """Until when a holder held the lease by its own record: its expiry, or its process' death."""
        inc = self.r.incarnations.get(h.holder)
        died = inc.ended_at if inc is not None and inc.ended_at is not None else float("inf")
        return min(h.expires, died)

    def _check_holders(self, session: str, events: list[LeaseEvent]) -> None:
        """No acquisition by another token while a holder's lease runs (release, expiry, death)."""
        held: dict[str, _Holding] = {}
        for e in events:
            if e.op == "release":
                held.pop(e.token, None)
            elif e.op == "extend":
                h = held.setdefault(e.token, _Holding(e.holder, e.at, None, e.at, e.at + e.ttl_s))
                h.last, h.expires = e.at, e.at + e.ttl_s
            else:
                for token, h in list(held.items()):
                    if token != e.token and self._lease_end(h) > e.at + LEASE_TOLERANCE_S:
                        self._overlap(session, h, e)
                    if token != e.token:
                        del held[token]
                again = held.get(e.token)
                if again is None or again.holder != e.holder:
                    held[e.token] = _Holding(e.holder, e.at, e.fence, e.at, e.at + e.ttl_s)
                else:  # the holder again (it had reported the lease lost): a new fence, the same holder
                    again.fence, again.last = e.fence, e.at

    def _overlap(self, session: str, h: _Holding, e: LeaseEvent) -> None:
        what = (f"{h.holder} acquired the lease at {self.t(h.start)} (fence {h.fence}), last renewed at "
                f"{self.t(h.last)}, so held it until {self.t(self._lease_end(h))}; {e.holder} acquired it at "
                f"{self.t(e.at)} (fence {e.fence}), {self._lease_end(h) - e.at:.2f} s before that")
        unseen = [(a, b) for a, b in self.r.lease_gaps if a < e.at and (b is None or b > h.last)]
        if unseen:
            self.tolerated.append(f"{session}: {what}; the lease monitor was not connected at "
                                  f"{self.t(unseen[0][0])}-{self.t(unseen[0][1])} (a release may be unseen)")
        else:
            self.add("lease-overlap", session, what + self.fault_before(e.at))

    def _check_refused_but_answered(self, m: ApiMessage) -> None:
        """An attempt answered "try again" (any status but 200; a timeout is no answer) whose turn
        the transcript closes with a whole answer: the client was told its message was not taken.
        Tolerated when the worker that ran the turn died or stopped just after its answer (the
        relay of a dying owner ends with a retryable error: at-least-once)."""
        for t, a in enumerate(m.attempts, 1):
            if a.status is None or a.status == 200:
                continue
            tag = f"{m.tag} t{t}"
            closing = _closing(self.turn_of(m.session, tag))
            if closing is None or closing.interrupted_by is not None or stream_number(closing.content) is None:
                continue
            stream = self.streams.get(stream_number(closing.content) or 0)
            done = stream.ended_at if stream is not None and stream.ended_at is not None else a.ended_at
            ran = stream.via if stream is not None else "?"
            what = (f"[{tag}] answered {a.status} {(a.error or '')[:60]!r} by {a.target} at {self.t(a.ended_at)} "
                    f"({a.ended_at - a.at:.1f} s after it was sent), but its turn was answered whole and recorded "
                    f"(c{stream.number if stream else '?'} by {ran}, ended {self.t(done)})")
            died = [f for f in self.r.faults if f.target == ran and 0 <= f.started_at - done <= AT_FAULT_S]
            if died:
                self.tolerated.append(f"{m.session}: {what}; {died[0].kind} {ran} just after")
            else:
                self.add("api-refused-but-answered", m.session, what + self.fault_before(done))

    # (e) nothing left open

    def check_open_inbound(self) -> None:
        for rec in self.r.open_inbound:
            session = session_of_key(rec.session_key)
            running = [s for s in self.streams_by_session.get(session, []) if s.ended_at is None]
            if running:
                continue
            lease = f"lease held by {rec.lease_holder} ({rec.lease_ttl_ms} ms left)" if rec.lease_holder \
                else "no lease"
            self.add("open-inbound", session, f"inbound {rec.inbound_id} [{message_tag(rec.text) or rec.text[:40]}] "
                     f"still {rec.status!r} at the end, nothing running; {lease}")


@dataclass
class _Holding:
    holder: str
    start: float
    fence: int | None
    last: float  # its last write (acquisition or extension)
    expires: float


def _stream(s: Stream, active: list[tuple[float, float]], t: Callable[[float | None], str]) -> str:
    what = " resume" if s.resume else ""
    what += " + its tool run" if s.tool_call else ""
    spans = ", ".join(f"{t(a)}-{t(b)}" for a, b in active) or "never"
    return f"c{s.number} ({s.via}, [{s.tag}]{what}, active {spans})"


def _message_of(tag: str) -> str:
    """"a01 m3 t2" -> "a01 m3": the attempts of one API message are one message."""
    return " ".join(tag.split()[:2])


def _label(row: Row) -> str:
    if row.role == "user":
        tag = message_tag(row.content)
        return f"user[{tag}]" if tag else "user[resume prompt]" if "Continue from where" in row.content \
            else f"user[{row.content[:30]!r}]"
    n = stream_number(row.content)
    what = f"c{n}" if n is not None else "no text"
    if row.role == "tool":
        what = "tool result"
    elif row.tool_calls:
        what += ", tool call"
    if row.interrupted_by:
        what += f", interrupted: {row.reason}"
    return f"{row.role}[{what}]"


def _closing(turn: list[Row] | None) -> Row | None:
    """The row that closed a turn, if it is closed."""
    return turn[-1] if turn and turn[-1].closes_turn else None


def _row(row: Row | None) -> str:
    return "no answer or interruption row after its user row" if row is None else _label(row)


def _window(rows: list[Row], i: int, span: int = 3) -> str:
    lo, hi = max(0, i - span), min(len(rows), i + span + 1)
    return " ".join(("> " if j == i else "") + _label(rows[j]) for j in range(lo, hi))
