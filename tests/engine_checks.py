"""Checks and settings shared by the engine tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# The scheduler's modes every HF-equality test runs under: vLLM's defaults (prefix caching
# and chunked prefill on), both off, and a budget small enough that prompts are chunked
# and decodes wait for the budget.
ENGINE_MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "no-cache-no-chunk": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    "small-chunks": dict(max_num_batched_tokens=24),
}


@contextmanager
def tensor_parallel_llm(request: pytest.FixtureRequest, model_dir: Path, tensor_parallel_size: int,
                        **engine_kwargs: Any) -> Iterator[Any]:
    """An `LLM` over model_dir on this many tensor-parallel workers (the session's Ray,
    conftest's `ray_cluster`, when more than one), shut down on leaving."""
    from raylm.engine import LLM

    if tensor_parallel_size > 1:
        request.getfixturevalue("ray_cluster")
    llm = LLM(model=str(model_dir), tensor_parallel_size=tensor_parallel_size, **engine_kwargs)
    try:
        yield llm
    finally:
        llm.shutdown()


class WorkerKill:
    """When `kill_worker_at_step` killed its worker (time.monotonic(); None: not yet)."""

    killed_at: float | None = None


def kill_worker_at_step(llm: Any, rank: int, step: int = 3) -> WorkerKill:
    """Hooks the engine so that worker `rank` of its Ray executor is killed as step `step`
    starts (where every step starts, whichever way the engine then hands it to the workers)."""
    import ray

    executor = llm.llm_engine.executor
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule
    kill = WorkerKill()
    steps = 0

    def schedule_and_kill():
        nonlocal steps
        steps += 1
        if steps == step:
            ray.kill(executor.workers[rank], no_restart=True)
            kill.killed_at = time.monotonic()
        return schedule()

    scheduler.schedule = schedule_and_kill
    return kill


def assert_greedy_twice_with_full_prefix_hits(llm: Any, prompts: list[list[int]], expected: list[list[int]],
                                            max_tokens: int, block_size: int = 16) -> None:
    """Greedy generation of prompts, twice, gives `expected` (HF's tokens) both times; the
    second round finds every prompt's full blocks in the prefix cache (no block was freed
    early), and the engine ends idle."""
    from raylm.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    hits = []
    for _ in range(2):
        before = kv.prefix_cache_hits
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected
        hits.append(kv.prefix_cache_hits - before)
    assert hits[1] == sum((len(p) - 1) // block_size * block_size for p in prompts)
    assert_engine_idle(llm.llm_engine)


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


def assert_async_engine_idle(async_engine: Any, timeout_s: float = 10.0) -> None:
    """assert_engine_idle for an AsyncLLMEngine behind a server: every request answered, the
    engine thread may still be finishing the step that answered the last one, so wait for
    it (up to timeout_s) first."""
    deadline = time.monotonic() + timeout_s
    while async_engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_engine_idle(async_engine.engine)


def run_to_end(engine: Any) -> tuple[dict[str, list[int]], dict[str, BaseException]]:
    """Steps an `LLMEngine` until it has no request left: the token ids of each request that
    finished, and the error of each that failed, by request id."""
    finished: dict[str, list[int]] = {}
    failed: dict[str, BaseException] = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
        failed.update(engine.pop_failed_requests())
    return finished, failed
