"""Live per-session agents (LRU) and, in cluster mode, the leases that say who owns a session."""

from agent_cache.lru import AgentCache, CacheFull

__all__ = ["AgentCache", "CacheFull"]
