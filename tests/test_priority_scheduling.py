"""vLLM's priority scheduling end to end on the tiny Llama: a request of better priority
added behind a full pool is admitted before the requests waiting ahead of it, preemption by
priority leaves every greedy token equal to Hugging Face's, and the `priority` argument is
checked (an int in range, 0 under fcfs) by LLMEngine, LLM and AsyncLLMEngine alike."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
import torch

from engine_checks import assert_engine_idle
from hf_reference import hf_embedding, hf_greedy
from raylm.engine import LLM, PoolingParams, SamplingParams
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.async_llm_engine import AsyncLLMEngine
from raylm.engine.llm_engine import LLMEngine
from raylm.engine.request import MAX_PRIORITY, MIN_PRIORITY

GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_TOKENS = 32


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Each 18 tokens: a random pattern of 3 repeated (which n-gram lookups find)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(3)] * 6 for _ in range(count)]


# N-gram speculative decoding: a decode then holds proposals whose KV slots count against
# the pool, and a victim the step had scheduled gives its proposals' budget back too.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def _first_token_order(policy: str, llama_dir, **engine_kwargs) -> tuple[list[str], dict[str, list[int]], int]:
    """Two requests fill a pool of 6 blocks of 16 tokens (each grows to 50 tokens, 4 blocks;
    together they outgrow it, so one is preempted), then "mid" (priority 0) and "high"
    (priority -1 under "priority") are added behind them. Returns the order in which the
    requests produced their first token, every request's tokens, and the preemptions."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(llama_dir), dtype="float32", max_model_len=64, block_size=16, num_gpu_blocks_override=6,
        max_num_seqs=2, scheduling_policy=policy, disable_log_stats=True, **engine_kwargs))
    prompts = dict(zip(["low0", "low1", "mid", "high"], _prompts(4)))
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    order: list[str] = []
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for output in engine.step():
            if output.request_id not in order:
                order.append(output.request_id)
            tokens[output.request_id] = list(output.outputs[0].token_ids)

    engine.add_request("low0", {"prompt_token_ids": prompts["low0"]}, params, priority=0)
    engine.add_request("low1", {"prompt_token_ids": prompts["low1"]}, params, priority=0)
    step()
    assert order == ["low0", "low1"] and not engine.scheduler.waiting
    engine.add_request("mid", {"prompt_token_ids": prompts["mid"]}, params, priority=0)
    engine.add_request("high", {"prompt_token_ids": prompts["high"]}, params,
                       priority=-1 if policy == "priority" else 0)
    while engine.has_unfinished_requests():
        step()
    num_preemptions = engine.scheduler.num_preemptions
    assert_engine_idle(engine)
    engine.shutdown()
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == hf_greedy(llama_dir, prompt, MAX_TOKENS), request_id
    return order, tokens, num_preemptions


@pytest.mark.parametrize("engine_kwargs", [{}, {"speculative_config": NGRAM}], ids=["plain", "ngram"])
def test_a_better_priority_request_behind_a_full_pool_is_admitted_first_with_hf_tokens(llama_dir, engine_kwargs):
    order, _, num_preemptions = _first_token_order("priority", llama_dir, **engine_kwargs)
    assert num_preemptions > 0, "the pool was meant to run out"
    assert order.index("high") < order.index("mid")


def test_fcfs_admits_the_same_requests_in_arrival_order(llama_dir):
    order, _, _ = _first_token_order("fcfs", llama_dir)
    assert order.index("mid") < order.index("high")


@pytest.mark.parametrize("engine_kwargs", [{}, {"speculative_config": NGRAM}], ids=["plain", "ngram"])
def test_a_worse_priority_admitted_earlier_gives_its_blocks_to_a_better_one(llama_dir, engine_kwargs):
    """"early" (priority 1) is admitted a step before "late" (priority 0); both outgrow the
    6-block pool. The running request of the worst priority is early, scheduled ahead of
    late in the very step where late finds no block: early is taken back out of that step
    and preempted, so late finishes first (under fcfs late, the latest admitted, would be
    the one preempted, and early would finish first)."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(llama_dir), dtype="float32", max_model_len=64, block_size=16, num_gpu_blocks_override=6,
        max_num_seqs=2, scheduling_policy="priority", disable_log_stats=True, **engine_kwargs))
    prompts = dict(zip(["early", "late"], _prompts(2, seed=2)))
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    finished: list[str] = []
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
            if output.finished:
                finished.append(output.request_id)

    engine.add_request("early", {"prompt_token_ids": prompts["early"]}, params, priority=1)
    step()
    engine.add_request("late", {"prompt_token_ids": prompts["late"]}, params, priority=0)
    while engine.has_unfinished_requests():
        step()
    assert engine.scheduler.num_preemptions > 0
    assert finished == ["late", "early"]
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == hf_greedy(llama_dir, prompt, MAX_TOKENS), request_id
    assert_engine_idle(engine)
    engine.shutdown()


# -------------------------------------------------------------------- checks
@pytest.fixture(scope="module")
def fcfs_engine(llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=64,
                                                   disable_log_stats=True))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("priority,message", [
    (True, "priority must be an integer, got True (bool)"),
    (1.0, "priority must be an integer, got 1.0 (float)"),
    ("1", "priority must be an integer, got '1' (str)"),
    (MAX_PRIORITY + 1, f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {MAX_PRIORITY + 1}"),
    (MIN_PRIORITY - 1, f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {MIN_PRIORITY - 1}"),
    (3, "priority must be 0 under the 'fcfs' scheduling policy, got 3"),
])
def test_a_bad_priority_is_refused_naming_the_field(fcfs_engine, priority, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        fcfs_engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2),
                                priority=priority)
    assert error.value.param == "priority"
    assert not fcfs_engine.has_unfinished_requests()


def test_priority_zero_is_accepted_under_fcfs(fcfs_engine):
    fcfs_engine.add_request("zero", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, **GREEDY),
                            priority=0)
    while fcfs_engine.has_unfinished_requests():
        fcfs_engine.step()
    assert_engine_idle(fcfs_engine)


def test_llm_generate_takes_one_priority_per_prompt(llama_dir):
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, seed=1)]
    params = SamplingParams(max_tokens=4, **GREEDY)
    with LLM(model=str(llama_dir), dtype="float32", max_model_len=64, scheduling_policy="priority") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False, priority=[2, -7, 0])
        # Outputs come back in prompt order whatever order they ran in.
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == hf_greedy(llama_dir, prompt["prompt_token_ids"], 4)
        with pytest.raises(ValueError, match="Got 2 priorities for 3 prompts"):
            llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
        with pytest.raises(ValueError, match=f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}"):
            llm.generate(prompts, params, use_tqdm=False, priority=[0, 2**40, 0])
        assert_engine_idle(llm.llm_engine)


def test_async_engine_refuses_a_priority_under_fcfs_and_keeps_serving(llama_dir):
    async def run() -> list[int]:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), dtype="float32",
                                                            max_model_len=64, disable_log_stats=True))
        try:
            params = SamplingParams(max_tokens=3, **GREEDY)
            with pytest.raises(ValueError, match="priority must be 0 under the 'fcfs' scheduling policy"):
                async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "bad", priority=1):
                    pass
            beams = SamplingParams(use_beam_search=True, best_of=2, n=1, max_tokens=2, temperature=0.0)
            with pytest.raises(ValueError, match="priority must be 0 under the 'fcfs' scheduling policy"):
                await engine.add_request("beams", {"prompt_token_ids": [5, 6, 7]}, beams, priority=2)
            final = None
            async for output in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "good", priority=0):
                final = output
            return list(final.outputs[0].token_ids)
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == hf_greedy(llama_dir, [5, 6, 7], 3)


def test_pooling_requests_are_admitted_by_priority_with_hf_embeddings(llama_dir):
    """An embedding's priority orders the waiting queue as a generation's does: with one
    request running at a time, "high" (priority -1), added after "mid", is pooled before it.
    (The priority was checked and then dropped for pooling requests: "mid" came first.)"""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(llama_dir), dtype="float32", max_model_len=64, max_num_seqs=1, runner="pooling",
        scheduling_policy="priority", disable_log_stats=True))
    prompts = dict(zip(["first", "mid", "high"], _prompts(3, seed=3)))
    finished: list[str] = []
    embeddings: dict[str, torch.Tensor] = {}

    def step() -> None:
        for output in engine.step():
            finished.append(output.request_id)
            embeddings[output.request_id] = output.outputs.data

    engine.add_request("first", {"prompt_token_ids": prompts["first"]}, PoolingParams(), priority=0)
    engine.add_request("mid", {"prompt_token_ids": prompts["mid"]}, PoolingParams(), priority=0)
    engine.add_request("high", {"prompt_token_ids": prompts["high"]}, PoolingParams(), priority=-1)
    while engine.has_unfinished_requests():
        step()
    assert finished == ["high", "first", "mid"]
    for request_id, prompt in prompts.items():
        torch.testing.assert_close(embeddings[request_id], hf_embedding(llama_dir, prompt), atol=1e-4, rtol=0)
    assert_engine_idle(engine)
    engine.shutdown()
