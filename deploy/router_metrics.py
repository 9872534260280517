"""The prefix-aware router's Prometheus metrics, in a registry of their own.

The router runs inside the ingress replica's process (Serve builds it for the ingress's
handle to the engine deployment), and the ingress's `/metrics` adds this registry to what
an engine replica reports. Serve ships the router class by value (cloudpickle), so its
module's globals would be copies: the counters live here, in a module both import by name.

- `raylm:router_requests_total{decision}`: routed requests by the router's decision
  (`Decision` kinds in deploy/prefix_router.py).
- `raylm:router_keyed_tokens_total`, `raylm:router_matched_tokens_total`: prompt tokens the
  routed requests' keys covered, and those the chosen replica was believed to hold (their
  ratio is the hit rate the router expects).
- Per replica, as the router sees it (`replica` label: Serve's replica id):
  `raylm:router_replica_prefix_cache_hits` / `_queries` (the replica's own counters, in
  tokens, from its last report), `raylm:router_replica_reported_blocks` (cached blocks it
  reported), `raylm:router_replica_tracked_blocks` (blocks the router remembers sending it
  within `router_retention_s`) and `raylm:router_replica_ongoing_requests` (Serve's count).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "raylm:"


@dataclass(frozen=True)
class ReplicaSummary:
    """One replica as the router last saw it."""

    replica: str
    prefix_cache_hits: int
    prefix_cache_queries: int
    reported_blocks: int
    tracked_blocks: int
    ongoing_requests: int | None


class SummarySource(Protocol):
    def replica_summaries(self) -> list[ReplicaSummary]: ...


REGISTRY = CollectorRegistry(auto_describe=True)
ROUTED_REQUESTS = Counter(PREFIX + "router_requests", "Requests routed, by the router's decision.", ["decision"],
                          registry=REGISTRY)
KEYED_TOKENS = Counter(PREFIX + "router_keyed_tokens", "Prompt tokens covered by the routing keys of routed requests.",
                       registry=REGISTRY)
MATCHED_TOKENS = Counter(PREFIX + "router_matched_tokens",
                         "Prompt tokens of routed requests that the chosen replica was believed to hold.",
                         registry=REGISTRY)

_sources: weakref.WeakSet = weakref.WeakSet()
_sources_lock = threading.Lock()


def register(source: SummarySource) -> None:
    """Adds a router's per-replica view to the metrics (for as long as the router lives)."""
    with _sources_lock:
        _sources.add(source)


class _ReplicaCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        with _sources_lock:
            sources = list(_sources)
        summaries = [s for source in sources for s in source.replica_summaries()]
        families = {
            "prefix_cache_hits": CounterMetricFamily(
                PREFIX + "router_replica_prefix_cache_hits",
                "Prompt tokens the replica found in its prefix cache, as of its last report.", labels=["replica"]),
            "prefix_cache_queries": CounterMetricFamily(
                PREFIX + "router_replica_prefix_cache_queries",
                "Prompt tokens the replica looked up in its prefix cache, as of its last report.", labels=["replica"]),
            "reported_blocks": GaugeMetricFamily(
                PREFIX + "router_replica_reported_blocks", "Cached blocks in the replica's last report.",
                labels=["replica"]),
            "tracked_blocks": GaugeMetricFamily(
                PREFIX + "router_replica_tracked_blocks",
                "Blocks the router remembers sending the replica within its retention time.", labels=["replica"]),
            "ongoing_requests": GaugeMetricFamily(
                PREFIX + "router_replica_ongoing_requests", "Requests in flight at the replica, as Serve counts them.",
                labels=["replica"]),
        }
        for summary in summaries:
            for name, family in families.items():
                value = getattr(summary, name)
                if value is not None:
                    family.add_metric([summary.replica], value)
        yield from families.values()


REGISTRY.register(_ReplicaCollector())
