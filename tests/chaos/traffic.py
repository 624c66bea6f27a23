"""The clients: Telegram (updates posted to a webhook, as Telegram does) and the HTTP API.

Telegram chats are group chats (-101, -102, ...), so every reply quotes the message it answers.
Each update is posted to a random worker whose process is alive; a non-2xx answer, a connection
error or a timeout makes it post *the same update* again (same update_id) a moment later,
anywhere, as Telegram would. A chat's user then waits for an outcome of the message (an answer, a
notice, a refusal) and goes on after a short think; now and then the next message goes out
early, on purpose (it interrupts the running answer). Half the chats are *patient* (g01, g03, ...):
their users wait for an outcome, so a stall shows as one; the others are *pushy*: when the chat
shows nothing for a couple of seconds they write again ("hello?"), which is what sends messages to
a session whose owner just died or was restarted. A patient user who sees no outcome for as
long as the checker allows (records.outcome_bound; at most `patience_s`) gives up and writes the
next message anyway.

API requests go to a random live worker, as a plain load balancer would send them (the cluster
forwards each to its session's owner and relays the answer back); with `api_balance="pinned"` a
session sticks to one worker instead, and moves to another live one after a connection error.
The API users' think time grows with their number (`api_load`): hundreds of sessions are there
for concurrency — many sessions alive, leased and relayed at once — not to multiply the load of
a few. A refused attempt (any non-2xx, connection error, timeout) is
retried as a new attempt ("a01 m3 t2") until `give_up_s` after the first; then the message
counts as refused. Everything sent and every HTTP answer is logged for the checker.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from typing import Any

import aiohttp

from tests.chaos.cluster import SECRET, WEBHOOK_PATH, ChaosCluster
from tests.chaos.records import (
    END,
    FAIL_MARK,
    STOP_MARK,
    ApiMessage,
    Attempt,
    FaultRecord,
    Incarnation,
    TgMessage,
    chat_of,
    message_tag,
    outcome_bound,
    stream_number,
)
from tests.support.workers import Worker

SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
API_SESSIONS_AT_FULL_PACE = 16  # more API sessions than this think longer, in proportion


def _pushy(session: str) -> bool:
    """g02, g04, ...: write again when the chat goes quiet (and when poked)."""
    return session.startswith("g") and int(session[1:]) % 2 == 0


class Traffic:
    def __init__(self, cluster: ChaosCluster, seed: int, *, telegram_chats: int, api_sessions: int, stop_at: float,
                 hard_stop: float, faults: list[FaultRecord], patience_s: float = 40.0, early_p: float = 0.15,
                 api_balance: str = "random") -> None:
        self.cluster = cluster
        self.faults = faults  # the fault log, as it grows: a user waits as long as the checker allows
        self.seed = seed
        self.sessions = [f"g{i + 1:02d}" for i in range(telegram_chats)] + \
            [f"a{i + 1:02d}" for i in range(api_sessions)]
        self.stop_at = stop_at  # no new message after this
        self.hard_stop = hard_stop  # no retry after this
        self.patience_s = patience_s
        self.early_p = early_p
        self.give_up_s = 3 * cluster.ttl_s + 8
        self.api_balance = api_balance  # "random": every request to a random live worker; "pinned"
        # Think times and the first message's delay of the API users scale with their number beyond
        # API_SESSIONS_AT_FULL_PACE, so 200 sessions ask about as often in all as a dozen would.
        self.api_load = max(1.0, api_sessions / API_SESSIONS_AT_FULL_PACE)
        self.telegram: list[TgMessage] = []
        self.api: list[ApiMessage] = []
        self._update_ids = itertools.count(1)
        self._scan_from: dict[str, int] = {}  # message tag -> first Telegram record that can concern it
        self._pokes = {s: asyncio.Event() for s in self.sessions}
        self._http: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            self._http = http
            await asyncio.gather(*(self._telegram_chat(s) if s[0] == "g" else self._api_session(s)
                                   for s in self.sessions))

    def poke(self, sessions: list[str]) -> None:
        """Make the users of these sessions (the pushy ones) write their next message now."""
        for session in sessions:
            if session in self._pokes and _pushy(session):
                self._pokes[session].set()

    async def _pause(self, session: str, seconds: float) -> None:
        """Sleep, unless poked."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._pokes[session].wait(), seconds)

    def _rng(self, session: str) -> random.Random:
        return random.Random(f"{self.seed}:{session}")

    # --- Telegram -----------------------------------------------------------------------------

    async def _telegram_chat(self, session: str) -> None:
        rng = self._rng(session)
        chat = chat_of(session)
        user = 1000 + int(session[1:])
        pushy = _pushy(session)
        await asyncio.sleep(rng.uniform(0.0, 1.5))
        previous: TgMessage | None = None
        for n in itertools.count(1):
            if time.monotonic() >= self.stop_at:
                return
            text = f"[{session} m{n}] question {n} from chat {session}"
            payload = self.cluster.telegram.user_message(chat, user_id=user, text=text)
            msg = TgMessage(f"{session} m{n}", session, chat, int(payload["message_id"]), text, time.monotonic())
            self._scan_from[msg.tag] = len(self.cluster.telegram.sent)
            self._pokes[session].clear()
            self.telegram.append(msg)
            if previous is not None:
                previous.next_sent_at = msg.sent_at
            previous = msg
            await self._deliver(msg, {"update_id": next(self._update_ids), "message": payload}, rng)
            if msg.accepted_at is None:
                continue
            if rng.random() < self.early_p * (2.5 if pushy else 1):  # several short messages in a row
                await self._pause(session, rng.uniform(0.4, 2.0))
                if not self.has_outcome(msg):
                    msg.early = True
                continue
            cap = msg.accepted_at + self.patience_s
            silence = rng.uniform(2.0, 4.0)
            while not self.has_outcome(msg):
                now = time.monotonic()
                if now >= self.stop_at:
                    return  # the run is settling: the checker waits for this one's outcome
                if now >= min(cap, self._bound(msg) + 0.5):
                    msg.impatient = True
                    break
                if pushy and (now - max(msg.accepted_at, self._last_activity(msg)) > silence
                              or self._pokes[session].is_set()):
                    msg.early = True  # "hello?"
                    break
                await asyncio.sleep(0.2)
            await self._pause(session, rng.uniform(0.3, 2.0))

    async def _deliver(self, msg: TgMessage, update: dict[str, Any], rng: random.Random) -> None:
        assert self._http is not None
        while time.monotonic() < self.hard_stop:
            live = self.cluster.live()
            if live:
                _worker, inc = rng.choice(live)
                at = time.monotonic()
                status, error = None, None
                try:
                    async with self._http.post(inc.url + WEBHOOK_PATH, json=update, headers={SECRET_HEADER: SECRET},
                                               timeout=aiohttp.ClientTimeout(total=8)) as resp:
                        await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    error = type(exc).__name__
                msg.attempts.append(Attempt(at, inc.name, status, time.monotonic(), error))
                if status is not None and 200 <= status < 300:
                    msg.accepted_at = time.monotonic()
                    return
            await asyncio.sleep(rng.uniform(0.3, 1.0))

    def _bound(self, msg: TgMessage) -> float:
        """When the checker will call this message late: the user waits that long, then writes again."""
        assert msg.accepted_at is not None
        return outcome_bound(msg.accepted_at, self.faults, answer_s=self.cluster.answer_s, ttl_s=self.cluster.ttl_s,
                             now=time.monotonic(), owner_at=lambda t: self.cluster.owner_at(msg.session, t))[0]

    def _last_activity(self, msg: TgMessage) -> float:
        """When the chat last showed something (a text or "typing") since this message was sent."""
        sent = self.cluster.telegram.sent
        for rec in reversed(sent[self._scan_from.get(msg.tag, 0):]):
            if rec.chat_id == msg.chat_id:
                return rec.time
        return 0.0

    def has_outcome(self, msg: TgMessage) -> bool:
        """Has the user seen something that ends this message: its whole answer, a notice, a
        refusal? (Pacing only; the checker decides what counts.)"""
        sent = self.cluster.telegram.sent
        for rec in itertools.islice(sent, self._scan_from.get(msg.tag, 0), None):
            if rec.chat_id != msg.chat_id or rec.time < msg.sent_at or rec.method == "sendChatAction":
                continue
            text = rec.text or ""
            tag = message_tag(text)
            if tag is not None and tag != msg.tag:
                continue
            reply = rec.params.get("reply_parameters")
            if tag is None and isinstance(reply, dict) and reply.get("message_id") == msg.message_id:
                return True  # a notice or refusal quoting it
            if STOP_MARK in text or FAIL_MARK in text:
                return True
            if tag == msg.tag and stream_number(text) is not None and text.rstrip().endswith(END):
                return True
        return False

    # --- HTTP API -----------------------------------------------------------------------------

    async def _api_session(self, session: str) -> None:
        rng = self._rng(session)
        ids = self.cluster.worker_ids
        pinned = ids[int(session[1:]) % len(ids)]
        await self._think(rng.uniform(0.0, 1.5 * self.api_load))
        for n in itertools.count(1):
            if time.monotonic() >= self.stop_at:
                return
            msg = ApiMessage(f"{session} m{n}", session)
            self.api.append(msg)
            first = time.monotonic()
            for t in itertools.count(1):
                live = self.cluster.live()
                if not live or time.monotonic() > self.hard_stop:
                    if time.monotonic() > self.hard_stop:
                        msg.outcome, msg.outcome_detail = "refused", "no worker to ask"
                        break
                    await asyncio.sleep(0.5)
                    continue
                pinned = self._api_target(rng, pinned, live)
                inc = self.cluster.current[pinned][1]
                attempt = await self._ask(inc.name, inc.url, session, f"[{session} m{n} t{t}] question {n}")
                msg.attempts.append(attempt)
                if attempt.status == 200:
                    msg.outcome = "interrupted" if attempt.interrupted else "answered"
                    msg.outcome_detail = attempt.interrupted or ""
                    break
                if attempt.status is None:  # that worker is gone or hanging: go elsewhere
                    others = [i.worker_id for _w, i in self.cluster.live() if i.worker_id != pinned]
                    pinned = rng.choice(others) if others else pinned
                if time.monotonic() - first > self.give_up_s or time.monotonic() > self.hard_stop:
                    msg.outcome = "refused"
                    msg.outcome_detail = f"gave up after {t} attempt(s)"
                    break
                delay = 0.5
                if attempt.retry_after:
                    with contextlib.suppress(ValueError):
                        delay = min(2.0, max(0.1, float(attempt.retry_after)))
                await asyncio.sleep(delay * rng.uniform(0.8, 1.2))
            await self._think(rng.uniform(0.3, 2.0) * self.api_load)

    async def _think(self, seconds: float) -> None:
        """An API user's pause, cut short when the traffic stops (so a long think never outlasts it)."""
        await asyncio.sleep(max(0.0, min(seconds, self.stop_at - time.monotonic())))

    def _api_target(self, rng: random.Random, pinned: str, live: list[tuple[Worker, Incarnation]]) -> str:
        """The worker id this attempt goes to: a random live one, or (pinned) the session's own
        while it lives."""
        ids = [inc.worker_id for _w, inc in live]
        if self.api_balance == "random" or pinned not in ids:
            return rng.choice(ids)
        return pinned

    async def _ask(self, target: str, url: str, session: str, text: str) -> Attempt:
        assert self._http is not None
        at = time.monotonic()
        body = {"messages": [{"role": "user", "content": text}]}
        timeout = aiohttp.ClientTimeout(total=self.cluster.answer_s + 2 * self.cluster.ttl_s + 6)
        try:
            async with self._http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session},
                                       timeout=timeout) as resp:
                raw = await resp.text()
                status, retry_after = resp.status, resp.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Attempt(at, target, None, time.monotonic(), error=type(exc).__name__)
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        attempt = Attempt(at, target, status, time.monotonic(), retry_after=retry_after)
        if not isinstance(data, dict):
            attempt.body = raw[:300]
        elif "choices" in data:
            attempt.body = str(data["choices"][0].get("message", {}).get("content", ""))
            sb = data.get("switchboard")
            if isinstance(sb, dict) and sb.get("interrupted_by"):
                attempt.interrupted = f"{sb['interrupted_by']}: {sb.get('reason')}"
        else:
            attempt.error = str((data.get("error") or {}).get("message", raw[:300]))
        return attempt
