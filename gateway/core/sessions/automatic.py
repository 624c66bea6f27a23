"""Messages the gateway writes into a session itself: a background job's end. Queued like a user's
message, in the chat the session last heard from, once (the store de-duplicates the message id)."""

from __future__ import annotations

import asyncio
import logging

from gateway.core.background import BackgroundJobs
from gateway.core.intake.ownership import Owners
from gateway.core.messages import InboundMessage
from gateway.core.ports import Outlet, Outlets, Store, StoreError
from gateway.core.sessions.origins import Origins
from gateway.core.sessions.queue import TurnQueue

log = logging.getLogger(__name__)


class AutomaticMessages:
    def __init__(self, *, origins: Origins, outlets: Outlets, queue: TurnQueue, owners: Owners, store: Store,
                 closing: asyncio.Event) -> None:
        self._origins = origins
        self._outlets = outlets
        self._queue = queue
        self._owners = owners
        self._store = store
        self._closing = closing

    async def deliver(self, key: str, message_id: str, text: str) -> bool:
        """Queue `text` into `key`; False if there is no chat to tell (or the gateway is stopping)."""
        found = None if self._closing.is_set() else self._message(key, message_id, text)
        if found is not None:
            await self._queue.resume(*found, key)
        return found is not None

    async def relay(self, jobs: BackgroundJobs) -> None:
        """Until cancelled: each job end a session should hear of, queued into that session."""
        while True:
            notice = await jobs.next_notice()
            try:
                if await self.deliver(notice.session, notice.message_id, notice.text):
                    notice.told()
            except Exception:
                log.exception("could not deliver the end of a job", extra={"session": notice.session})

    async def leave(self, key: str, message_id: str, text: str) -> None:
        """The same while stopping: stored as accepted, so the next start replays it."""
        found = self._message(key, message_id, text)
        fence = self._owners.fence(key)
        if found is None or fence is None:
            return
        try:
            await self._store.accept_inbound(fence, found[0])
        except StoreError as exc:
            log.warning("could not store a job's end for the next start: %s", exc, extra={"session": key})

    def _message(self, key: str, message_id: str, text: str) -> tuple[InboundMessage, Outlet] | None:
        origin = self._origins.get(key)
        outlet = self._outlets.get(origin.platform) if origin is not None else None
        if origin is None or outlet is None or not outlet.can_steer:
            # The HTTP API has no chat to answer in (each request waits for its own answer): the
            # job's end stays visible to the model through job_status.
            log.info("not told (no chat to answer in): %s", text.split("\n", 1)[0], extra={"session": key})
            return None
        return InboundMessage(platform=origin.platform, chat_id=origin.chat_id, chat_type=origin.chat_type,
                              user_id=origin.user_id, user_name=origin.user_name, message_id=message_id, text=text,
                              thread_id=origin.thread_id, user_handle=origin.user_handle, tenant=origin.tenant), outlet
