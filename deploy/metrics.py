"""Prometheus metrics of one server, in a registry of its own.

Names follow vLLM's with the `raylm:` prefix (`raylm:num_requests_running`, ...), so
dashboards built for vLLM need only the prefix changed. Queue sizes, KV-cache use and the
token counters are read from the engine when scraped; the latency histograms are filled
as requests finish. Each app owns its `CollectorRegistry`, so several apps (tests, Serve
replicas sharing a process) never clash over metric names.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from raylm.engine.async_llm_engine import AsyncLLMEngine, FinishedRequestStats
from raylm.engine.spec_decode.metrics import SpecDecodingStats

PREFIX = "raylm:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)


class _EngineCollector(Collector):
    """Reads the engine's live state at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        scheduler = engine.scheduler
        kv_cache_manager = scheduler.kv_cache_manager
        total_blocks = kv_cache_manager.num_blocks
        free_blocks = kv_cache_manager.get_num_free_blocks()
        yield self._gauge("num_requests_running", "Requests in the running batch.", scheduler.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).",
                          scheduler.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                          scheduler.kv_cache_usage)
        yield self._gauge("num_kv_cache_blocks_used", "KV-cache blocks held by requests.", total_blocks - free_blocks)
        yield self._gauge("num_kv_cache_blocks_total", "KV-cache blocks in the pool.", total_blocks)
        yield self._gauge("engine_healthy", "1 while the engine loop runs without error.", 0 if engine.errored else 1)
        yield self._counter("num_preemptions", "Requests preempted (recomputed) since start.",
                            scheduler.num_preemptions)
        yield self._counter("prompt_tokens", "Prompt tokens processed since start.", engine.num_prompt_tokens_total)
        yield self._counter("generation_tokens", "Tokens generated since start.", engine.num_generation_tokens_total)
        # vLLM's names: prompt tokens looked up in the prefix cache, and those found there.
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache since start.",
                            kv_cache_manager.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache since start.",
                            kv_cache_manager.prefix_cache_hits)
        if scheduler.drafter is not None:
            yield from self._spec_decoding(scheduler.drafter.stats)

    def _spec_decoding(self, stats: SpecDecodingStats) -> Iterator[Metric]:
        """vLLM's spec_decode counters (present only with speculative decoding on), and the
        mean acceptance length since start."""
        yield self._counter("spec_decode_num_drafts", "Verification steps of a request with proposed tokens.",
                            stats.num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Proposed (draft) tokens verified since start.",
                            stats.num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted since start.",
                            stats.num_accepted_tokens)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Proposed tokens accepted since start, by position in the draft (0 first).",
                                      labels=list(self._labels) + ["position"])
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos.add_metric(list(self._labels.values()) + [str(position)], count)
        yield per_pos
        yield self._gauge("spec_decode_mean_acceptance_length", "Tokens a verification step yields on average "
                          "since start: accepted proposals plus the target's own (0 before any).",
                          stats.mean_acceptance_length)


class ServerMetrics:
    """The metrics of one app: a registry, the engine collector and the histograms."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]
        self._model_name = model_name
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds",
                                             "Time from arrival to the first generated token.", labels,
                                             buckets=_TTFT_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(PREFIX + "time_per_output_token_seconds",
                                               "Mean time between generated tokens of a request, after the first.",
                                               labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(PREFIX + "e2e_request_latency_seconds",
                                             "Time from arrival to the last token.", labels,
                                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.request_success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        engine.add_stats_listener(self.observe_finished)

    def observe_finished(self, stats: FinishedRequestStats) -> None:
        name = self._model_name
        for reason in stats.finish_reasons:
            self.request_success.labels(name, reason or "unknown").inc()
        self.e2e_request_latency.labels(name).observe(max(0.0, stats.finished_time - stats.arrival_time))
        if stats.first_token_time is None:
            return
        self.time_to_first_token.labels(name).observe(max(0.0, stats.first_token_time - stats.arrival_time))
        per_sequence = stats.num_generation_tokens / max(1, len(stats.finish_reasons))
        if per_sequence > 1:
            self.time_per_output_token.labels(name).observe(
                max(0.0, stats.finished_time - stats.first_token_time) / (per_sequence - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
