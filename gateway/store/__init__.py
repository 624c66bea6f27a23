"""Durable state: transcripts, inbound messages (dedup and replay), session metadata."""

from gateway.store.base import InboundRecord, SessionInfo, Store, StoreError

__all__ = ["InboundRecord", "SessionInfo", "Store", "StoreError"]
