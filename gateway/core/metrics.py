"""Prometheus metrics, one registry per daemon (so several daemons can share a test process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Stop latency is sub-millisecond when all is well; the upper buckets catch a stuck turn.
STOP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _Counter(Counter):
    """A counter whose labelled children are looked up in a dict: `Counter.labels` validates the
    values and takes a lock on every call, and several run for every message."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._children: dict[tuple[Any, ...], _Counter] = {}

    def labels(self, *values: Any, **by_name: Any) -> _Counter:
        if by_name:
            return super().labels(*values, **by_name)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = super().labels(*values)
        return child


class _CacheCollector(Collector):
    """Reads the agent cache's counters at scrape time instead of mirroring every change."""

    def __init__(self, read: Callable[[], tuple[int, int, int, int]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        size, hits, misses, evictions = self._read()
        yield GaugeMetricFamily("switchboard_agent_cache_size", "Live agents in the cache", value=size)
        yield CounterMetricFamily("switchboard_agent_cache_hits", "Agent cache hits", value=hits)
        yield CounterMetricFamily("switchboard_agent_cache_misses", "Agent cache misses", value=misses)
        yield CounterMetricFamily("switchboard_agent_cache_evictions", "Agents evicted", value=evictions)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.turns_running = Gauge("switchboard_turns_running", "Turns running now", registry=r)
        self.messages_in = _Counter("switchboard_messages_in", "Inbound messages", ["platform", "outcome"], registry=r)
        self.messages_out = _Counter("switchboard_messages_out", "Messages sent or edited", ["platform", "kind"],
                                    registry=r)
        self.cancels = _Counter("switchboard_cancels", "hard_cancels by who and why", ["kind", "reason"], registry=r)
        self.stop_latency = Histogram("switchboard_stop_latency_seconds", "From hard_cancel to the turn's task done",
                                      buckets=STOP_BUCKETS, registry=r)
        self.turns = _Counter("switchboard_turns", "Turns ended, by outcome", ["status"], registry=r)
        self.provider_errors = Counter("switchboard_provider_errors", "Agent/provider failures", registry=r)
        self.platform_429s = _Counter("switchboard_platform_rate_limited", "429s from chat platforms", ["platform"],
                                     registry=r)
        self.tokens = _Counter("switchboard_tokens", "Tokens the model provider counted, by kind and tenant",
                              ["kind", "tenant"], registry=r)
        self.lease_events = _Counter("switchboard_lease_events", "Session lease acquisitions and losses", ["event"],
                                    registry=r)

    def watch_cache(self, read: Callable[[], tuple[int, int, int, int]]) -> None:
        self.registry.register(_CacheCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def stop_histogram(self) -> list[tuple[float, float]]:
        """(upper bound, cumulative count) pairs of the stop-latency histogram, for the console."""
        out = []
        for metric in self.stop_latency.collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):
                    out.append((float(sample.labels["le"]), sample.value))
        return out
