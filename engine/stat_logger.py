"""Periodic log line of throughput, queue sizes and KV-cache use."""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class StatLogger:
    """Counts tokens per step and logs rates every `interval_s` seconds."""

    def __init__(self, scheduler: Any, interval_s: float = 5.0) -> None:
        self._scheduler = scheduler
        self._interval_s = interval_s
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    def record_step(self, sched_out: Any, num_generated: int) -> None:
        prompt_tokens = sched_out.num_prefill_tokens
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += num_generated
        self.total_prompt_tokens += prompt_tokens
        self.total_generation_tokens += num_generated
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self._interval_s:
            return
        scheduler = self._scheduler
        kv = scheduler.kv_cache_manager
        hit_rate = 100.0 * kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, avg generation throughput: %.1f tokens/s, running: %d, "
            "waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%, preemptions: %d",
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed, scheduler.num_running,
            scheduler.num_waiting, 100.0 * scheduler.kv_cache_usage, hit_rate, scheduler.num_preemptions)
        self._prompt_tokens = self._generation_tokens = 0
        self._last_log = now
