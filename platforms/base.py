"""What every platform adapter implements: the core's `Outlet` (replies and notices) built on
three outbound operations — send, edit, typing — plus intake started with the core's `Gateway`."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from aiohttp import web

from gateway.core.cancellation import Run, ToolReason
from gateway.core.messages import Capabilities, ChatRef, InboundMessage
from gateway.core.ports import Gateway, Health, NoticeKind, Reply
from platforms.errors import OutboundError, RateLimited
from platforms.streaming import EditStreamReply

__all__ = ["Adapter", "OutboundError", "RateLimited"]

log = logging.getLogger(__name__)


class Adapter(ABC):
    """A platform. Subclasses set `name` and `capabilities` and implement the outbound trio."""

    name: str
    capabilities: Capabilities
    pushes_anywhere: bool = False  # see `Outlet.pushes_anywhere`
    _gateway: Gateway | None = None

    @property
    def gateway(self) -> Gateway:
        if self._gateway is None:
            raise RuntimeError(f"the {self.name} adapter has not been started")
        return self._gateway

    @property
    def bot_username(self) -> str | None:
        return None

    async def start(self, gateway: Gateway) -> None:
        """Begin intake: every inbound message goes to `gateway`."""
        self._gateway = gateway

    async def stop(self) -> None:
        """Stop intake; replies already in flight may still be delivered."""

    async def close(self) -> None:
        """Release clients and connections (after the core has shut down); idempotent."""

    def routes(self) -> list[web.RouteDef]:
        """HTTP routes for the daemon's listener (web chat, API, webhooks)."""
        return []

    def health(self) -> Health:
        return Health(True, "ok")

    @abstractmethod
    async def send(self, chat: ChatRef, text: str, *, reply_to: str | None = None) -> str:
        """Send a message; returns its platform message id."""

    @abstractmethod
    async def edit(self, chat: ChatRef, message_id: str, text: str) -> None:
        """Replace the text of a message this adapter sent."""

    async def typing(self, chat: ChatRef) -> None:
        """Show a typing indicator, if the platform has one."""

    def count(self, kind: str) -> None:
        """Metrics: one outbound `send`/`edit`/`notice`, or a `429` from the platform."""
        if self._gateway is not None:
            self._gateway.count_outbound(self.name, kind)

    async def notify(self, chat: ChatRef, text: str, *, reply_to: str | None = None,
                     kind: NoticeKind = NoticeKind.INFO, reason: ToolReason | None = None) -> None:
        """Send a short notice (command replies, acks, rejections); never raises."""
        try:
            await self.send(chat, text, reply_to=reply_to)
            self.count("notice")
        except Exception as exc:
            log.warning("%s: could not deliver a notice: %s", self.name, exc)

    def open_reply(self, msg: InboundMessage, run: Run) -> Reply:
        return EditStreamReply(self, msg.chat, run, reply_to=msg.message_id)
