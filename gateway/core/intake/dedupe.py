"""The first line of de-duplication: messages seen recently, in memory. The store is the second
(an inbound record per platform message id)."""

from __future__ import annotations

from typing import Literal

from gateway.core.bounded import BoundedMap
from gateway.core.messages import InboundMessage

WINDOW = 50_000  # messages remembered; a platform redelivers within minutes, not after this many


def _id(msg: InboundMessage) -> tuple[str, str, str]:
    return msg.platform, msg.chat_id, msg.message_id


class RecentMessages:
    def __init__(self, window: int = WINDOW) -> None:
        self._seen: BoundedMap[tuple[str, str, str], None] = BoundedMap(window)

    def seen(self, msg: InboundMessage, hops: int) -> bool:
        """Was `msg` seen recently? For messages straight from a platform. A forwarded message
        (`hops` > 0) may well have passed through here before (this worker forwarded it): the
        store decides for it, so it is only remembered."""
        known = self._seen.add(_id(msg), None)
        return known and not hops

    def check(self, msg: InboundMessage, hops: int) -> Literal["new", "duplicate", "known"]:
        """`seen`, told apart: "known" is a forwarded message seen here before (this worker
        forwarded it, or it comes again): only the store can tell whether it is new."""
        if not self._seen.add(_id(msg), None):
            return "new"
        return "known" if hops else "duplicate"

    def remember(self, msg: InboundMessage) -> None:
        self._seen.add(_id(msg), None)

    def forget(self, msg: InboundMessage) -> None:
        """`msg` was not taken after all (storage failed): the platform's redelivery must get in."""
        self._seen.pop(_id(msg))
