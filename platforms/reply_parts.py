"""A streaming reply's text and the messages that show it: which are final, which are still
edited, and how the open text splits into parts. No I/O: the reply makes the calls
(`platforms/streaming.py`) and records here what they did."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from platforms.splitting import Measure, Part, SplitMemo, iter_parts, open_fence

STOP_MARK_ROOM = 48  # a full part leaves this much room (at most a 16th) for a stop mark


@dataclass(slots=True)
class ShownMessage:
    """One message of a reply as the chat shows it."""

    mid: str
    text: str  # what it shows (a stop mark aside)
    end: int  # it carries the reply's text up to this offset
    gone: bool = False  # deleted on the platform
    stop: str | None = None  # the payload of the Stop button it shows, if any
    status: str = ""  # the end of `text` that is a status line (a tool running), not the answer

    @property
    def body(self) -> str:
        """What it shows of the answer: its text without the status line."""
        return self.text[:len(self.text) - len(self.status)] if self.status else self.text


class Change(Enum):
    """What bringing one message up to date with its part takes."""

    SEND = "send"  # no message for it yet
    EDIT = "edit"
    SAME = "same"  # it shows this already
    STUCK = "stuck"  # it differs, but the platform cannot edit


def change_for(shown: ShownMessage | None, text: str, stop: str | None, *, can_edit: bool) -> Change:
    """How to show `text` (with the Stop button `stop`, or none) where `shown` is. A message that
    shows the text without a button is not edited just to add one; a button left at the end is
    removed when the reply ends."""
    if shown is None:
        return Change.SEND
    if shown.text == text and (shown.stop == stop or shown.stop is None):
        return Change.SAME
    return Change.EDIT if can_edit else Change.STUCK


class ReplyParts:
    """The reply's text and its messages. Messages before the window are final (or deleted); the
    window's messages are edited as the text grows, and the window's text is split into parts,
    one per message.

    Invariant: the window starts at `base` in `text`; the frozen messages carry text before it.
    """

    def __init__(self, max_len: int, measure: Measure, bound: Measure | None, *, min_limit: int) -> None:
        self.text = ""
        self.max_len = max_len
        self.limit = max_len - min(STOP_MARK_ROOM, max_len // 16)  # room for a stop mark on a full part
        self._min_limit = min(min_limit, self.limit)
        self._measure, self._bound = measure, bound
        self._memo = SplitMemo()  # streaming re-splits a growing text: measure only its new tail
        self._base = 0
        self._frozen: list[ShownMessage] = []
        self._window: list[ShownMessage] = []

    # --- reading --------------------------------------------------------------------------

    def parts(self) -> Iterator[Part]:
        """The window's parts, cut as they are asked for; `start` and `end` are offsets in `text`."""
        if self._base == 0:
            window, origin, prefix = self.text, 0, 0
        else:  # reopen a code block the window starts inside
            reopen = open_fence(self.text[:self._base]) or ""
            rest = self.text[self._base:]
            body = rest.lstrip("\n") if reopen else rest.lstrip()
            window, origin, prefix = reopen + body, self._base + len(rest) - len(body), len(reopen)
        for part in iter_parts(window, self.limit, self._measure, bound=self._bound, memo=self._memo):
            yield Part(part.text, origin + max(0, part.start - prefix), origin + max(0, part.end - prefix))

    def with_status(self, status: str) -> Iterator[tuple[Part, str]]:
        """The window's parts and what each message shows: the last one with `status` below it
        (where it fits), or — while the window has no text yet — `status` alone."""
        last: Part | None = None
        for part in self.parts():
            if last is not None:
                yield last, last.text
            last = part
        if last is None:
            if status:
                yield Part("", self._base, self._base), status
            return
        shown = f"{last.text}\n\n{status}" if status else last.text
        yield last, shown if self._measure(shown) <= self.max_len else last.text

    def tail(self) -> str:
        """The last part of the whole text: what one message's worth (a draft) shows of it."""
        last = ""
        for part in iter_parts(self.text, self.limit, self._measure, bound=self._bound, memo=self._memo):
            last = part.text
        return last

    def message(self, index: int) -> ShownMessage | None:
        """The window's message for part `index`, if it has one yet."""
        return self._window[index] if index < len(self._window) else None

    def messages(self) -> list[ShownMessage]:
        return [*self._frozen, *self._window]

    def last(self) -> ShownMessage | None:
        """The message carrying the furthest text."""
        return max(self.messages(), key=lambda m: m.end, default=None)

    def shown(self) -> str:
        """The text up to what the messages show (deleted ones included: they were seen)."""
        return self.text[:max((m.end for m in self.messages()), default=0)]

    def final(self, text: str) -> str:
        """The reply's final text, given the answer's: what frozen messages show stays as it is."""
        if self._base and not text.startswith(self.text[:self._base]):
            # Part of the answer is in messages that no longer change (deleted, or given up).
            return self.text if text and self.text.endswith(text) else self.text[:self._base] + text
        return text if text.strip() else "(no answer)"

    # --- recording ------------------------------------------------------------------------

    def add(self, message: ShownMessage) -> None:
        """A message was sent for the window's next part."""
        self._window.append(message)

    def deleted(self, index: int) -> None:
        """The window's message `index` was deleted: the text after it continues in a new one."""
        gone = self._window[index]
        gone.gone = True
        self._rebase(index + 1, max(self._base, gone.end))

    def split_smaller(self, part: Part, index: int) -> bool:
        """Part `index` was refused: split from it on at half the size, down to the smallest size;
        False if it is that small already (see `give_up`)."""
        if self.limit <= self._min_limit:
            return False
        self.limit = max(self._min_limit, self.limit // 2)
        self._rebase(index, part.start)
        return True

    def give_up(self, part: Part, index: int) -> None:
        """Part `index` cannot be sent at all: the window goes on after it."""
        end = part.end if part.end > self._base else len(self.text)
        self._rebase(min(index + 1, len(self._window)), end)

    def _rebase(self, keep: int, base: int) -> None:
        """Freeze the window's messages before `keep`; the window restarts at `base`, reusing the
        messages from `keep` on."""
        self._frozen += self._window[:keep]
        self._window = self._window[keep:]
        self._base = base
        self._memo = SplitMemo()
