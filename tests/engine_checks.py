"""Checks and settings shared by the engine tests."""

from __future__ import annotations

from typing import Any

# The scheduler's modes every HF-equality test runs under: vLLM's defaults (prefix caching
# and chunked prefill on), both off, and a budget small enough that prompts are chunked
# and decodes wait for the budget.
ENGINE_MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "no-cache-no-chunk": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    "small-chunks": dict(max_num_batched_tokens=24),
}


def assert_engine_idle(engine: Any) -> None:
    """No request left anywhere, every KV block back in the pool (free, or free and
    cached), and the pool's bookkeeping consistent."""
    assert not engine.has_unfinished_requests()
    scheduler = engine.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    kv = scheduler.kv_cache_manager
    assert kv.req_to_blocks == {}
    assert kv.get_num_free_blocks() == kv.num_blocks
    kv.check_invariants()
