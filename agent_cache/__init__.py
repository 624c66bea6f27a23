"""Live per-session agents (LRU) and, in cluster mode, the leases that say which worker's cache
holds a session; every Redis key is named in `agent_cache.keys`."""

from agent_cache.lru import AgentCache, CacheFull, CacheSettings

__all__ = ["AgentCache", "CacheFull", "CacheSettings"]
