"""Where each session last heard from: the chat a background job's end is reported to."""

from __future__ import annotations

import dataclasses

from gateway.core.bounded import BoundedMap
from gateway.core.messages import InboundMessage


class Origins:
    LIMIT = 50_000

    def __init__(self) -> None:
        self._last: BoundedMap[str, InboundMessage] = BoundedMap(self.LIMIT)

    def remember(self, key: str, msg: InboundMessage) -> None:
        if msg.attachments or msg.extra or len(msg.text) > 200:  # only where to answer is needed: not MBs of it
            msg = dataclasses.replace(msg, text="", attachments=(), reply_to=None, extra={})
        self._last[key] = msg

    def get(self, key: str) -> InboundMessage | None:
        return self._last.get(key)
