"""Telegram's native streaming: a private chat's answer grows as a draft (Bot API 9.3 sendMessageDraft).

One draft per turn: an empty draft ("Thinking…") soon after the turn starts, then the text as it
arrives (at most every `draft_interval_s`), re-sent if nothing changed for `draft_refresh_s` (a
draft not refreshed is gone after about 30 s). The final text is sent with sendMessage, split as
edit streaming splits it; that message replaces the draft in the app. A draft holds at most one
message's worth of text, so a longer answer's draft shows its last part.

A draft has no buttons, so with `stop_button` a small status message carrying the Stop button is
sent before the draft (silently: no notification) and deleted when the turn ends.

A stopped turn ends its draft at once: what the draft showed is sent as a message, marked
"⏹ stopped" — exactly the text the transcript keeps. If the chat refuses drafts (groups, some
topics, an older Bot API), the reply carries on by editing a message and `DraftChats` remembers the
chat, so its later answers start that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from gateway.core.bounded import BoundedMap
from gateway.core.cancellation import STOPPED_BY_USER, Run, ToolReason, still_ours, stop_notice
from gateway.core.messages import ChatRef, ChatType
from gateway.core.ports import NoticeKind
from platforms.errors import OutboundError, RateLimited, explain
from platforms.outbox import Job, Priority, Withdrawn
from platforms.stop_button import StopButton
from platforms.streaming import EditStreamReply, ReplyPlatform

log = logging.getLogger(__name__)

STATUS_TEXT = "✍️ writing…"
NO_DRAFTS_MAX = 100_000  # chats remembered as refusing drafts (a forgotten one tries a draft again)
STOP_PAIR_S = 5.0  # a typed /stop's "Stopped." and an empty draft's "⏹ stopped" this close are one stop


class DraftsRefused(OutboundError):
    """This chat does not take drafts (a group, a topic); `everywhere`: nor does any chat (the Bot
    API server predates sendMessageDraft)."""

    def __init__(self, detail: str, *, everywhere: bool = False) -> None:
        super().__init__(detail)
        self.everywhere = everywhere


class DraftCalls(Protocol):
    """The Bot API calls a draft reply makes beyond edit streaming's: the draft, and the status
    message carrying the Stop button beside it. They raise as `ReplyPlatform.send` does, and
    `send_draft` raises `DraftsRefused` where the chat takes no drafts."""

    async def send_draft(self, chat: ChatRef, draft_id: int, text: str) -> None: ...

    async def send_status(self, chat: ChatRef, text: str, *, stop: str) -> str: ...

    async def delete_status(self, chat: ChatRef, message_id: str) -> None: ...


class DraftChats:
    """Which chats an answer may stream to as a draft: private chats, except those that refused
    one (they stream by edits), and none once the Bot API server turned out to lack drafts."""

    def __init__(self, *, interval_s: float = 0.3, refresh_s: float = 20.0, remember: int = NO_DRAFTS_MAX) -> None:
        self.interval_s = interval_s  # at most one draft this often
        self.refresh_s = refresh_s  # an unchanged draft is sent again this often (it would expire)
        self._refused: BoundedMap[str, None] = BoundedMap(remember)
        self._off = False  # the Bot API server has no sendMessageDraft
        self._logged = False
        self._stops: BoundedMap[str, tuple[str, float]] = BoundedMap(remember)  # chat -> (who said it, when)

    def take_drafts(self, chat: ChatRef) -> bool:
        return not self._off and chat.chat_id not in self._refused and draft_chat(chat)

    def say_stop(self, chat: ChatRef, by: str) -> bool:
        """May a stop be said in `chat` by `by`: "notice" (a typed /stop's "Stopped.") or "mark" (the
        "⏹ stopped" that ends a draft which showed nothing yet)? Either one, a message, also ends
        the draft, so each stop is said once: whichever comes second, soon after the other, is not."""
        now = time.monotonic()
        other = self._stops.pop(chat.chat_id, None)
        if other is not None and other[0] != by and now - other[1] < STOP_PAIR_S:
            return False
        self._stops[chat.chat_id] = (by, now)
        return True

    def refused(self, chat: ChatRef, why: str, *, everywhere: bool = False) -> None:
        """Remember that `chat` (or, `everywhere`, every chat) takes no drafts; logged once per bot,
        then per chat at debug level."""
        self._off = self._off or everywhere
        self._refused[chat.chat_id] = None
        level = logging.DEBUG if self._logged else logging.WARNING
        self._logged = True
        log.log(level, "telegram: chat %s refused a draft (%s); its answers stream by editing a message",
                chat.chat_id, why)


class DraftStreamReply(EditStreamReply):
    """Streams a private chat's answer as a Telegram draft; falls back to edits if refused."""

    def __init__(self, adapter: ReplyPlatform, calls: DraftCalls, chats: DraftChats, chat: ChatRef, run: Run, *,
                 reply_to: str | None, stop: StopButton | None) -> None:
        super().__init__(adapter, chat, run, reply_to=reply_to, stop=stop)
        self._calls = calls
        self._chats = chats
        self._drafting = True
        self._draft_id = secrets.randbelow(2**31 - 2) + 1  # non-zero: 0 is refused
        self._draft_text: str | None = None  # what the draft shows; None: no draft yet
        self._drafted = 0  # the draft has shown the reply's text up to this offset
        self._drafted_at = 0.0  # monotonic time of the last accepted draft
        self._interval_s = chats.interval_s
        self._refresh_s = chats.refresh_s
        self._status: str | None = None  # the status message carrying the Stop button
        self._opened = False
        self._open_lock = asyncio.Lock()
        self._stopped_shown: str | None = None

    @property
    def drafting(self) -> bool:
        return self._drafting

    # --- the Reply port -------------------------------------------------------------------

    async def interrupted(self, reason: ToolReason) -> None:
        if not self._drafting:
            await super().interrupted(reason)
            await self._close_status()
            return
        if self._notice_shown:
            return
        self._notice_shown = True
        cut = self._progress.cut_short(reason)  # before `_end` forgets the calls
        await self._end()
        if not await still_ours(self._run.guard):
            return  # the session belongs to another worker now: it speaks for it
        shown = self._parts.text[:self._drafted]
        self._stopped_shown = shown
        notice = stop_notice(reason)
        if self._draft_text is None:  # no draft was shown: as edit streaming with nothing to mark
            await self._close_status()
            if reason.kind == "system":
                await self._settle(self._adapter.notify(self._chat, notice, reply_to=self._reply_to,
                                                        kind=NoticeKind.INTERRUPTED, reason=reason))
            return
        if not shown.strip() and reason == STOPPED_BY_USER and not self._chats.say_stop(self._chat, "mark"):
            await self._close_status()  # the typed /stop's "Stopped." replaced the empty draft already
            return
        # The draft ends only when a message replaces it: what it showed, marked as stopped.
        self._parts.text = f"{shown}\n\n{notice}" if shown.strip() else cut or notice
        self._after_stop = True
        await self._settle(self._deliver_final())

    def shown_text(self) -> str | None:
        return self._stopped_shown if self._stopped_shown is not None else super().shown_text()

    # --- streaming ------------------------------------------------------------------------

    def pace(self) -> float:
        return self._interval_s if self._drafting else super().pace()

    def _indicator(self) -> Coroutine[Any, Any, None]:
        return self._keep_draft() if self._drafting else super()._indicator()

    async def _keep_draft(self) -> None:
        """"Thinking…" until text arrives, and the draft kept alive while the turn runs."""
        await self._open()
        while self._drafting and not self._ended and self._run.may_send():
            due = self._drafted_at + self._refresh_s
            if self._draft_text is None or time.monotonic() >= due:
                try:
                    await self._push_draft(empty=self._draft_text is None, again=self._draft_text is not None)
                    due = max(self._drafted_at, time.monotonic()) + self._refresh_s  # a failure: retried then
                except RateLimited as exc:
                    due = time.monotonic() + exc.retry_after
            if not self.drafting:  # refused just now
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        if not self._drafting and not self._ended:
            await super()._indicator()  # refused: typing, as edit streaming shows it

    async def _render(self, *, final: bool) -> None:
        if final or not self._drafting:
            await super()._render(final=final)
            return
        await self._open()
        await self._push_draft()

    async def _open(self) -> None:
        """Before the first draft: the status message with the Stop button (a message sent
        later would replace the draft)."""
        async with self._open_lock:
            if self._opened:
                return
            self._opened = True
            if self._stop is None or not await self._run.may_send_now():
                return
            stop = self._stop

            async def call() -> None:  # made by the outbox worker: a cancel of this task cannot lose it
                self._status = await self._calls.send_status(self._chat, STATUS_TEXT, stop=stop)

            # Owned by the reply: `_end` withdraws it if it has not started, or waits for it to land,
            # so a status message is never sent after the answer (nor left behind).
            job: Job[None] = self._outbox.put(self._key, call, priority=Priority.NOTICE, attempts=3, owner=self)
            self._jobs.append(job)
            try:
                await job.wait()
            except Withdrawn:
                return
            except Exception as exc:  # cosmetic: the answer streams without its button
                log.info("telegram: could not send a Stop button beside a draft in chat %s: %s",
                         self._chat.chat_id, exc)

    async def _push_draft(self, *, empty: bool = False, again: bool = False) -> None:
        """Queue a draft: the text so far (its last part), an empty one ("Thinking…", unless text
        was drafted meanwhile), or the last one again (a refresh)."""
        text: str | None = None
        end = len(self._parts.text)
        status = self._progress.line(has_text=bool(self._parts.text.strip()))
        if empty and status:
            return  # a tool's status line shows already: no "Thinking…" over it
        if not (empty or again):
            text = self._parts.tail()
            if status:  # a tool runs: its status line below the text (a draft has room to spare)
                text = f"{text}\n\n{status}" if text.strip() else status
            if text == self._draft_text:
                return
        job: Job[None] = self._outbox.put(self._key, lambda: self._draft_call(text, end, empty=empty),
                                          kind="draft", priority=Priority.STREAM, owner=self)
        self._jobs = [j for j in self._jobs if not j.done]
        self._jobs.append(job)  # `_end` waits for one on the wire: what it shows counts as shown
        try:
            await job.wait()
        except Withdrawn:
            return
        except DraftsRefused as exc:
            self._fall_back(str(exc), everywhere=exc.everywhere)
        except OutboundError as exc:  # the chat refuses everything: the final send says so
            log.info("telegram: a draft in chat %s failed: %s", self._chat.chat_id, explain(exc))

    async def _draft_call(self, text: str | None, end: int, *, empty: bool = False) -> None:
        if text is None:  # decided now, not when queued
            if empty and self._draft_text is not None:
                return
            text, end = ("", 0) if empty else (self._draft_text or "", self._drafted)
        if not await self._run.may_send_now():
            return
        await self._calls.send_draft(self._chat, self._draft_id, text)
        self._draft_text, self._drafted, self._drafted_at = text, max(end, self._drafted), time.monotonic()
        self._adapter.count("draft")

    def _fall_back(self, why: str, *, everywhere: bool) -> None:
        """Drafts refused here: edit a message instead, from now on in this chat (or every chat)."""
        self._drafting = False
        self._chats.refused(self._chat, why, everywhere=everywhere)
        status, self._status = self._status, None
        if status is not None:  # edit streaming shows its Stop button on the message itself
            self._outbox.adopt(self._delete(status))
        if self._parts.text:  # stream what there is by edits, now
            self._pacer.wake(self._render_intermediate, self.pace, now=True)

    # --- ending ---------------------------------------------------------------------------

    async def _deliver_final(self) -> None:
        await super()._deliver_final()
        await self._close_status()

    async def _close_status(self) -> None:
        status, self._status = self._status, None
        if status is not None:
            await self._delete(status)

    async def _delete(self, mid: str) -> None:
        job: Job[None] = self._outbox.put(self._key, lambda: self._calls.delete_status(self._chat, mid),
                                          priority=Priority.URGENT, kind="edit", attempts=self.FINAL_ATTEMPTS)
        with contextlib.suppress(Exception):
            await job.wait()


def draft_chat(chat: ChatRef) -> bool:
    """Drafts are for private chats only."""
    return chat.chat_type is ChatType.DM
