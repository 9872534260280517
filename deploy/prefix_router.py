"""`PrefixAwareRouter`: Ray Serve request routing to the replica that holds a prompt's prefix.

Serve builds the router inside each caller of the engine deployment (raylm's ingress) and
asks it, per request, which replicas to try. A request's key is the hashes of its prompt's
first blocks (deploy/prefix_key.py), the same hashes the replicas' KV-cache managers file
their blocks under. For each replica the router knows two sets of them:

- the blocks it sent there itself within the last `retention_s` seconds (a request's
  blocks are cached as soon as it is prefilled, long before the replica next reports);
- the blocks the replica last reported holding (`RaylmDeployment.record_routing_stats`,
  collected by Serve every `request_routing_stats_period_s`): the replica's own word,
  evictions included, and shared by every router, so that several ingress replicas, or
  one restarted, agree on where a prefix lives.

A replica's match is the longest run of the key's leading blocks found in either set.
Ray Serve LLM's PrefixCacheAffinityRouter and SGLang's cache-aware router keep only the
first kind, as a tree of prompt characters grown from their own routing (Ray's in a
detached actor called on every request); the replicas' reports let this router forget
what was evicted and learn what it never sent, at the cost of tokenizing in the ingress.

The policy (`decide`), per request, with the replicas' loads (requests in flight, as
Serve counts them):
- the replica with the longest match, if that match covers at least `min_match_ratio` of
  the key (ties: the least loaded): `prefix_match`;
- unless its load exceeds the least loaded replica's by more than `imbalance_threshold`:
  then the least loaded (`load_imbalance`);
- with no match worth the name, the least loaded; among equals, the one the router has
  sent the fewest blocks (so new prefixes spread): `no_match`;
- a request without a key (not a completion, chat or embeddings request, or no
  tokenizer): the less loaded of two replicas drawn at random, as Serve's
  power-of-two-choices router: `no_key`.
A replica at its `max_ongoing_requests` refuses the request and Serve tries the next in
the router's ranking (`replica_full`). Each routed request's decision is counted on the
ingress's /metrics (deploy/router_metrics.py) and logged at debug level on the "ray.serve"
logger, which Serve's `logging_config` (log_level: DEBUG) turns on.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from raylm.deploy import router_metrics

# A child of Serve's logger: Serve's logging_config sets its level and files.
logger = logging.getLogger("ray.serve.raylm.prefix_router")

PREFIX_MATCH = "prefix_match"
LOAD_IMBALANCE = "load_imbalance"
NO_MATCH = "no_match"
NO_KEY = "no_key"
REPLICA_FULL = "replica_full"

# Decisions kept for requests not yet routed (a request cancelled before it is routed
# never comes back for its own).
_MAX_PENDING_DECISIONS = 65536


# ------------------------------------------------------------------ policy
@dataclass(frozen=True)
class Candidate:
    """A replica as one decision sees it."""

    replica_id: Any
    matched_blocks: int  # leading blocks of the key the replica is believed to hold
    load: int  # requests in flight
    footprint: int  # blocks the router believes the replica holds, all prefixes together


@dataclass(frozen=True)
class Decision:
    kind: str
    ranked: tuple[Any, ...]  # replica ids, the one to try first first
    candidates: tuple[Candidate, ...] = ()
    num_key_blocks: int = 0

    def matched_blocks(self, replica_id: Any) -> int:
        return next((c.matched_blocks for c in self.candidates if c.replica_id == replica_id), 0)


def decide(candidates: Sequence[Candidate], num_key_blocks: int, imbalance_threshold: int, min_match_ratio: float,
           rng: random.Random | None = None) -> Decision:
    """Where a request with a key of `num_key_blocks` blocks goes (see the module's docstring)."""
    assert candidates, "no replica to choose from"
    rng = rng or random
    order = list(candidates)
    rng.shuffle(order)  # equal replicas in random order
    min_load = min(c.load for c in order)
    best_match = max(c.matched_blocks for c in order)
    if best_match > 0 and best_match >= min_match_ratio * num_key_blocks:
        best = min((c for c in order if c.matched_blocks == best_match), key=lambda c: c.load)
        if best.load - min_load <= imbalance_threshold:
            kind, first = PREFIX_MATCH, best
        else:
            kind, first = LOAD_IMBALANCE, min(order, key=lambda c: (c.load, -c.matched_blocks))
    else:
        kind, first = NO_MATCH, min(order, key=lambda c: (c.load, c.footprint))
    rest = sorted((c for c in order if c is not first), key=lambda c: (c.load, -c.matched_blocks))
    return Decision(kind, (first.replica_id, *(c.replica_id for c in rest)), tuple(candidates), num_key_blocks)


# ----------------------------------------------------- what replicas report
def build_report(block_size: int, cached_block_hashes: Sequence[bytes], prefix_cache_hits: int,
                 prefix_cache_queries: int, key_hash_bytes: int) -> dict[str, Any]:
    """A replica's routing stats, as Serve carries them to every router: the truncated
    hashes of its cached blocks (most recently used first) in one bytes object."""
    return {"block_size": block_size,
            "cached_block_hashes": b"".join(h[:key_hash_bytes] for h in cached_block_hashes),
            "key_hash_bytes": key_hash_bytes,
            "prefix_cache_hits": prefix_cache_hits,
            "prefix_cache_queries": prefix_cache_queries}


@dataclass
class _ReplicaView:
    """What the router knows of one replica's prefix cache."""

    label: str
    # Block hash -> when the router last sent a request holding it there (oldest first).
    sent: OrderedDict = field(default_factory=OrderedDict)
    reported: frozenset = frozenset()
    _reported_from: bytes | None = None
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0

    def read_report(self, stats: dict[str, Any] | None) -> None:
        blob = (stats or {}).get("cached_block_hashes")
        if not isinstance(blob, bytes) or blob is self._reported_from:
            return
        width = int(stats.get("key_hash_bytes", 8))
        self.reported = frozenset(blob[i:i + width] for i in range(0, len(blob), width))
        self._reported_from = blob
        self.prefix_cache_hits = int(stats.get("prefix_cache_hits", 0))
        self.prefix_cache_queries = int(stats.get("prefix_cache_queries", 0))

    def forget_sent_before(self, oldest: float) -> None:
        while self.sent:
            block_hash, sent_at = next(iter(self.sent.items()))
            if sent_at >= oldest:
                break
            del self.sent[block_hash]

    def matched_blocks(self, block_hashes: Sequence[bytes]) -> int:
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in self.sent and block_hash not in self.reported:
                break
            matched += 1
        return matched

    def record_sent(self, block_hashes: Sequence[bytes], now: float, max_blocks: int) -> None:
        for block_hash in block_hashes:
            self.sent[block_hash] = now
            self.sent.move_to_end(block_hash)
        while len(self.sent) > max_blocks:
            self.sent.popitem(last=False)

    @property
    def footprint(self) -> int:
        """Blocks the replica holds, as far as the router knows: the larger of the two sets
        (they mostly overlap, and their union would cost a pass over both per request)."""
        return max(len(self.reported), len(self.sent))


def _prefix_key(pending_request: PendingRequest | None) -> Any:
    """The PrefixKey the ingress attached to the request (deploy/serve_ingress.py)."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        key = getattr(arg, "prefix_key", None)
        if key is not None:
            return key
    return None


# ------------------------------------------------------------------ router
class PrefixAwareRouter(RequestRouter):
    """Serve's request router for the engine deployment (see the module's docstring)."""

    def initialize_state(self, imbalance_threshold: int = 32, min_match_ratio: float = 0.1,
                         retention_s: float = 60.0, max_tracked_blocks: int = 1 << 18) -> None:
        """Serve calls this with the deployment's `request_router_kwargs`."""
        self.imbalance_threshold = imbalance_threshold
        self.min_match_ratio = min_match_ratio
        self.retention_s = retention_s
        self.max_tracked_blocks = max_tracked_blocks
        self._views: dict[ReplicaID, _ReplicaView] = {}
        self._pending: OrderedDict[str, tuple[Decision, Any]] = OrderedDict()
        # Serve calls the router on its own loop; /metrics reads the views from another thread.
        self._lock = threading.Lock()
        router_metrics.register(self)

    # ------------------------------------------------------------ replicas
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        with self._lock:
            live = {r.replica_id: r for r in replicas}
            for replica_id in list(self._views):
                if replica_id not in live:
                    del self._views[replica_id]
            for replica_id, replica in live.items():
                view = self._views.setdefault(replica_id, _ReplicaView(replica_id.unique_id))
                view.read_report(replica.routing_stats)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._lock:
            self._views.pop(replica_id, None)

    # ------------------------------------------------------------- routing
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = _prefix_key(pending_request)
        if key is None:
            chosen = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            self._remember(pending_request, Decision(NO_KEY, tuple(r.replica_id for r in chosen)), None)
            return [chosen]
        loads = await self._loads(candidate_replicas)
        now = time.monotonic()
        with self._lock:
            candidates = []
            for replica in candidate_replicas:
                load = loads.get(replica.replica_id)
                if load is None or load >= replica.max_ongoing_requests:
                    continue  # unreachable or full: Serve retries after a backoff if none is left
                view = self._views.setdefault(replica.replica_id, _ReplicaView(replica.replica_id.unique_id))
                view.read_report(replica.routing_stats)
                view.forget_sent_before(now - self.retention_s)
                candidates.append(Candidate(replica.replica_id, view.matched_blocks(key.block_hashes), load,
                                            view.footprint))
        if not candidates:
            return []
        decision = decide(candidates, len(key.block_hashes), self.imbalance_threshold, self.min_match_ratio)
        self._remember(pending_request, decision, key)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[decision.ranked[0]]], [by_id[replica_id] for replica_id in decision.ranked[1:]]]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int | None]:
        """Requests in flight per replica: Serve's cached counts, probing those it lacks."""
        loads: dict[ReplicaID, int | None] = {}
        to_probe = []
        for replica in replicas:
            load = self._replica_queue_len_cache.get(replica.replica_id) if self._use_replica_queue_len_cache else None
            if load is None or load >= replica.max_ongoing_requests:
                to_probe.append(replica)
            else:
                loads[replica.replica_id] = load
        if to_probe:
            for replica, load in await self._probe_queue_lens(to_probe, 0):
                loads[replica.replica_id] = load
        return loads

    def _remember(self, pending_request: PendingRequest | None, decision: Decision, key: Any) -> None:
        if pending_request is None:
            return
        self._pending[pending_request.metadata.internal_request_id] = (decision, key)
        self._pending.move_to_end(pending_request.metadata.internal_request_id)
        while len(self._pending) > _MAX_PENDING_DECISIONS:
            self._pending.popitem(last=False)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Serve calls this once the replica accepted the request: counts and logs the
        decision, and remembers the request's blocks at that replica."""
        decision, key = self._pending.pop(pending_request.metadata.internal_request_id, (None, None))
        if decision is None:
            return
        kind = decision.kind if decision.ranked and decision.ranked[0] == replica_id else REPLICA_FULL
        router_metrics.ROUTED_REQUESTS.labels(kind).inc()
        if key is None:
            logger.debug("Request %s: %s, to replica %s.", pending_request.metadata.request_id, kind,
                         replica_id.unique_id)
            return
        matched = decision.matched_blocks(replica_id)
        block_size = key.num_tokens // max(1, len(key.block_hashes))
        router_metrics.KEYED_TOKENS.inc(key.num_tokens)
        router_metrics.MATCHED_TOKENS.inc(matched * block_size)
        with self._lock:
            view = self._views.get(replica_id)
            if view is not None:
                view.record_sent(key.block_hashes, time.monotonic(), self.max_tracked_blocks)
        if logger.isEnabledFor(logging.DEBUG):
            seen = ", ".join(f"{c.replica_id.unique_id}: {c.matched_blocks} blocks matched, load {c.load}"
                             for c in decision.candidates)
            logger.debug("Request %s (%d key blocks): %s, to replica %s (%s).", pending_request.metadata.request_id,
                         len(key.block_hashes), kind, replica_id.unique_id, seen)

    # ------------------------------------------------------------ metrics
    def replica_summaries(self) -> list[router_metrics.ReplicaSummary]:
        with self._lock:
            views = list(self._views.items())
            summaries = []
            for replica_id, view in views:
                load = self._replica_queue_len_cache.get(replica_id)
                summaries.append(router_metrics.ReplicaSummary(
                    view.label, view.prefix_cache_hits, view.prefix_cache_queries, len(view.reported),
                    len(view.sent), load))
        return summaries
