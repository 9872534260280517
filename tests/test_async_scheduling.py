"""Async scheduling on Ray workers (vLLM's `async_scheduling`, on by default with Ray): step k+1 is scheduled and sent before step k is collected, its decodes carrying placeholders that
the workers fill with the tokens they sampled (under tensor parallel, rank 0 broadcasts
them). Outputs must be HF's for greedy decoding, and those of the engine that schedules one
step at a time for everything that reads a request's history or its random stream."""

from __future__ import annotations

import random

import pytest

from engine_checks import assert_engine_idle
from hf_reference import assert_logprobs_match_hf, hf_greedy
from raylm.engine import LLM, SamplingParams
from raylm.engine.step import PLACEHOLDER_TOKEN_ID

# A pool of 24 blocks of 16 tokens for 12 requests of up to ~60 tokens: they preempt.
COMMON = dict(dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray", max_model_len=128,
              num_gpu_blocks_override=24)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(rng.randint(5, 30))] for _ in range(count)]


@pytest.fixture(scope="module")
def engines(ray_cluster, llama_dir):
    pipelined = LLM(model=str(llama_dir), **COMMON)
    stepwise = LLM(model=str(llama_dir), **COMMON, async_scheduling=False)
    yield pipelined, stepwise
    pipelined.shutdown()
    stepwise.shutdown()


def _watch_steps(llm: LLM) -> dict[str, int]:
    """Counts, from now on, steps sent with placeholders and the most steps in flight."""
    core = llm.llm_engine.engine_core
    seen = {"with_placeholders": 0, "max_in_flight": 0}
    send = core.executor.execute_model_async

    def watched(req):
        seen["with_placeholders"] += any(s.token_ids[-1] == PLACEHOLDER_TOKEN_ID for s in req.requests)
        wait = send(req)
        seen["max_in_flight"] = max(seen["max_in_flight"], core.num_steps_in_flight + 1)
        return wait

    core.executor.execute_model_async = watched
    return seen


def test_the_next_step_is_sent_before_the_last_is_collected_unless_turned_off(engines):
    pipelined, stepwise = engines
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seen = [_watch_steps(llm) for llm in engines]
    try:
        for llm in engines:
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        for llm in engines:
            del llm.llm_engine.engine_core.executor.execute_model_async
    assert seen[0]["max_in_flight"] == 2 and seen[0]["with_placeholders"] > 0
    assert seen[1] == {"with_placeholders": 0, "max_in_flight": 1}


def test_greedy_tokens_and_logprobs_equal_hf_and_stop_at_max_tokens_while_preempting(engines, llama_dir):
    pipelined, _ = engines
    prompts = _prompts(12, seed=41)
    max_tokens = [24 - i for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=2, prompt_logprobs=1)
              for m in max_tokens]
    preemptions_before = pipelined.llm_engine.scheduler.num_preemptions
    outputs = pipelined.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert pipelined.llm_engine.scheduler.num_preemptions > preemptions_before
    for prompt, m, output in zip(prompts, max_tokens, outputs):
        completion = output.outputs[0]
        assert len(completion.token_ids) == m and completion.finish_reason == "length"
        expected = hf_greedy(llama_dir, prompt, m)
        assert completion.token_ids[:len(expected)] == expected  # HF stops at EOS, raylm ignores it
    assert_logprobs_match_hf(llama_dir, prompts, outputs, top_k=2)
    assert_engine_idle(pipelined.llm_engine)


def test_penalties_seeds_min_tokens_and_stop_ids_give_the_stepwise_engine_outputs(engines):
    pipelined, stepwise = engines
    prompts = [{"prompt_token_ids": p} for p in _prompts(10, seed=42)]
    # Penalties read the tokens the workers filled in; seeded draws their random streams;
    # stop ids and EOS (ignore_eos off) end requests one step before the batch in flight.
    frequent = [t for p in prompts for t in p["prompt_token_ids"][:2]]
    params = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=20, min_tokens=3, repetition_penalty=1.3,
                             frequency_penalty=0.4, presence_penalty=0.2, stop_token_ids=frequent[i:i + 6],
                             logprobs=1)
              for i in range(len(prompts))]
    got = pipelined.generate(prompts, params, use_tqdm=False)
    expected = stepwise.generate(prompts, params, use_tqdm=False)
    for mine, theirs in zip(got, expected):
        a, b = mine.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids
        assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
        assert [entry[t].logprob for t, entry in zip(a.token_ids, a.logprobs)] == \
            pytest.approx([entry[t].logprob for t, entry in zip(b.token_ids, b.logprobs)], abs=1e-5)
    assert any(o.outputs[0].finish_reason == "stop" for o in expected)
    assert any(o.outputs[0].finish_reason == "length" for o in expected)
    for llm in engines:
        assert_engine_idle(llm.llm_engine)
