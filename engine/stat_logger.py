"""Periodic log line of throughput, queue sizes, KV-cache use, prefix-cache hits and, with
speculative decoding, how many proposed tokens were accepted."""

from __future__ import annotations

import logging
import time
from typing import Any

from raylm.engine.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger(__name__)


class StatLogger:
    """Counts tokens per step and logs rates over the time the engine worked.

    A line is logged once `interval_s` of work has passed, and when the engine runs out of
    requests at least `interval_s` after the last line (so a burst shorter than the
    interval is logged too, and many small bursts share one line). Rates are taken over
    the time the engine spent in steps, never over idle time, which would make a busy
    burst look like a trickle.
    """

    def __init__(self, scheduler: Any, interval_s: float = 5.0) -> None:
        self._scheduler = scheduler
        self._interval_s = interval_s
        # Seconds spent in steps since the last line, and when that line was logged.
        self._work_s = 0.0
        self._last_log = float("-inf")
        # When the last recorded step ended: with async scheduling a step starts before the
        # previous one ends, and the time they overlap is counted once.
        self._last_step_end = float("-inf")
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        # Speculative decoding: the drafter's counters at the last line (the line shows the
        # interval's drafts).
        self._spec_logged = SpecDecodingStats()

    def record_step(self, sched_out: Any, num_generated: int, step_start: float) -> None:
        """step_start: time.monotonic() when the step began (steps are recorded in order)."""
        prompt_tokens = sched_out.num_prefill_tokens
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += num_generated
        self.total_prompt_tokens += prompt_tokens
        self.total_generation_tokens += num_generated
        now = time.monotonic()
        self._work_s += max(0.0, now - max(step_start, self._last_step_end))
        self._last_step_end = now
        if self._work_s >= self._interval_s:
            self._log(now)

    def flush(self) -> None:
        """The engine has gone idle: logs the work not logged yet, unless a line was
        logged less than interval_s ago (the next one will carry it)."""
        now = time.monotonic()
        if self._work_s > 0.0 and now - self._last_log >= self._interval_s:
            self._log(now)

    def _log(self, now: float) -> None:
        elapsed = max(self._work_s, 1e-9)
        scheduler = self._scheduler
        kv = scheduler.kv_cache_manager
        hit_rate = 100.0 * kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, avg generation throughput: %.1f tokens/s (over %.1f s of work), "
            "running: %d, waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%, preemptions: %d",
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed, elapsed, scheduler.num_running,
            scheduler.num_waiting, 100.0 * scheduler.kv_cache_usage, hit_rate, scheduler.num_preemptions)
        drafter = getattr(scheduler, "drafter", None)
        if drafter is not None:
            self._log_spec_decoding(drafter.stats)
        self._prompt_tokens = self._generation_tokens = 0
        self._work_s = 0.0
        self._last_log = now

    def _log_spec_decoding(self, totals: SpecDecodingStats) -> None:
        """vLLM's SpecDecoding metrics line, over the interval since the last line."""
        last = self._spec_logged
        interval = SpecDecodingStats(totals.num_drafts - last.num_drafts,
                                     totals.num_draft_tokens - last.num_draft_tokens,
                                     totals.num_accepted_tokens - last.num_accepted_tokens)
        self._spec_logged = SpecDecodingStats(totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens)
        logger.info("SpecDecoding metrics: mean acceptance length: %.2f, accepted: %d tokens, drafted: %d tokens, "
                    "draft acceptance rate: %.1f%%, drafts: %d", interval.mean_acceptance_length,
                    interval.num_accepted_tokens, interval.num_draft_tokens, 100.0 * interval.acceptance_rate,
                    interval.num_drafts)
