"""An in-memory chat platform: a real `Adapter` whose outbound side records what users would see."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.messages import Capabilities, ChatRef, ChatType, InboundMessage
from platforms.base import Adapter


@dataclass
class Bubble:
    chat_id: str
    id: str
    text: str
    edits: int = 0
    notice: bool = False


class MemoryChat(Adapter):
    name = "memory"

    def __init__(self, *, max_len: int = 4000, edit_interval_s: float = 0.0) -> None:
        self.capabilities = Capabilities(max_message_len=max_len, can_edit=True, can_stream=True,
                                         edit_interval_s=edit_interval_s)
        self.bubbles: list[Bubble] = []
        self.by_id: dict[str, Bubble] = {}
        self.typing_count = 0
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()

    def message(self, chat_id: str, text: str, *, user: str = "u1", mid: str | None = None,
                chat_type: ChatType = ChatType.DM, thread_id: str | None = None) -> InboundMessage:
        return InboundMessage(platform=self.name, chat_id=chat_id, chat_type=chat_type, user_id=user,
                              user_name=user, message_id=mid or f"m{next(self._ids)}", text=text,
                              thread_id=thread_id, timestamp=time.time())

    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        bubble = Bubble(chat.chat_id, f"out{next(self._ids)}", text)
        self.bubbles.append(bubble)
        self.by_id[bubble.id] = bubble
        self._changed.set()
        return bubble.id

    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        bubble = self.by_id[message_id]
        bubble.text = text
        bubble.edits += 1
        self._changed.set()

    async def typing(self, chat: ChatRef) -> None:
        self.typing_count += 1

    def texts(self, chat_id: str) -> list[str]:
        return [b.text for b in self.bubbles if b.chat_id == chat_id]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until `predicate()` holds; re-checked on every chat change and every 10 ms."""
        async def loop() -> None:
            while True:
                self._changed.clear()
                if predicate():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 0.01)
        await asyncio.wait_for(loop(), timeout)
