"""The stat logger's rates are taken over the time the engine worked: steps that overlap
(async scheduling starts one before the last ends) count their common time once."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from raylm.engine import stat_logger
from raylm.engine.stat_logger import StatLogger


def test_overlapping_steps_count_their_common_time_once(monkeypatch, caplog):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(stat_logger.time, "monotonic", lambda: clock.now)
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(prefix_cache_hits=0, prefix_cache_queries=0),
                                num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0)
    logger = StatLogger(scheduler, interval_s=100.0)
    step = SimpleNamespace(num_prefill_tokens=0)
    # Step 1 runs over [0, 2]; step 2 starts at 1 and ends at 3; step 3 runs over [5, 6].
    for start, end in [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]:
        clock.now = end
        logger.record_step(step, num_generated=4, step_start=start)
    with caplog.at_level(logging.INFO, logger="raylm.engine.stat_logger"):
        logger.flush()
    # Worked over [0, 3] and [5, 6]: 4 s, not the 5 s that adding the steps up gives;
    # 12 tokens over it.
    assert "avg generation throughput: 3.0 tokens/s (over 4.0 s of work)" in caplog.text
