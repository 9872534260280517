"""Periodic log line of throughput, queue sizes, KV-cache use and prefix-cache hits."""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class StatLogger:
    """Counts tokens per step and logs rates over the time the engine worked.

    A line is logged once `interval_s` of work has passed, and when the engine runs out of
    requests (so a burst shorter than the interval is logged too). Rates are taken over
    the time from the first step of the interval to the end of its last, never over idle
    time, which would make a busy burst look like a trickle.
    """

    def __init__(self, scheduler: Any, interval_s: float = 5.0) -> None:
        self._scheduler = scheduler
        self._interval_s = interval_s
        self._work_start: float | None = None
        self._last_step_end = 0.0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    def record_step(self, sched_out: Any, num_generated: int, step_start: float) -> None:
        """step_start: time.monotonic() when the step began."""
        prompt_tokens = sched_out.num_prefill_tokens
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += num_generated
        self.total_prompt_tokens += prompt_tokens
        self.total_generation_tokens += num_generated
        if self._work_start is None:
            self._work_start = step_start
        self._last_step_end = time.monotonic()
        if self._last_step_end - self._work_start >= self._interval_s:
            self._log()

    def flush(self) -> None:
        """Logs the work not logged yet (the engine has gone idle)."""
        if self._work_start is not None:
            self._log()

    def _log(self) -> None:
        elapsed = max(self._last_step_end - self._work_start, 1e-9)
        scheduler = self._scheduler
        kv = scheduler.kv_cache_manager
        hit_rate = 100.0 * kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, avg generation throughput: %.1f tokens/s (over %.1f s of work), "
            "running: %d, waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%, preemptions: %d",
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed, elapsed, scheduler.num_running,
            scheduler.num_waiting, 100.0 * scheduler.kv_cache_usage, hit_rate, scheduler.num_preemptions)
        self._prompt_tokens = self._generation_tokens = 0
        self._work_start = None
