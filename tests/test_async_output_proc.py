"""Async output processing on Ray workers (vLLM's `disable_async_output_proc=False`): the
driver makes one batch's text while the workers run the next. Requests a stop string ends,
or an abort takes, while their next batch runs must come out as they do without the
overlap, and give their blocks back."""

from __future__ import annotations

import random

import pytest

from engine_checks import assert_engine_idle
from raylm.engine import LLM, SamplingParams

MAX_TOKENS = 24


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(rng.randint(5, 30))] for _ in range(count)]


@pytest.fixture(scope="module")
def ray_llms(ray_cluster, llama_dir):
    """One Ray worker with the overlap, one without (same model, same KV pool)."""
    common = dict(model=str(llama_dir), dtype="float32", tensor_parallel_size=1, distributed_executor_backend="ray",
                  max_model_len=128, num_gpu_blocks_override=64)
    overlapped = LLM(**common)
    serial = LLM(**common, disable_async_output_proc=True)
    yield overlapped, serial
    overlapped.shutdown()
    serial.shutdown()


def test_ray_engine_overlaps_output_processing_unless_disabled(ray_llms):
    overlapped, serial = ray_llms
    assert overlapped.llm_engine._overlap_output_processing
    assert not serial.llm_engine._overlap_output_processing


def test_stop_strings_and_lengths_come_out_the_same_with_and_without_the_overlap(ray_llms):
    overlapped, serial = ray_llms
    prompts = [{"prompt_token_ids": p} for p in _prompts(12, seed=31)]
    # Greedy text of the serial engine gives stop strings that end requests mid-way, each
    # found by the output processor while the request's next batch already runs.
    plain = serial.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    params = []
    for i, output in enumerate(plain):
        text = output.outputs[0].text
        stop = text[len(text) // 3:len(text) // 3 + 2] if i % 2 == 0 and len(text) > 6 else None
        params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - i, ignore_eos=True,
                                     stop=[stop] if stop else None))
    expected = serial.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert any(o.outputs[0].finish_reason == "stop" for o in expected)
    for mine, theirs in zip(got, expected):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert mine.outputs[0].text == theirs.outputs[0].text
        assert (mine.outputs[0].finish_reason, mine.outputs[0].stop_reason) == \
            (theirs.outputs[0].finish_reason, theirs.outputs[0].stop_reason)
    assert_engine_idle(overlapped.llm_engine)


def test_an_abort_while_the_batch_runs_drops_its_token_and_frees_its_blocks(ray_llms):
    overlapped, serial = ray_llms
    engine = overlapped.llm_engine
    prompts = _prompts(3, seed=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, params)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        steps += 1
        if steps == 5:
            # A batch holding request 1 is on the workers now.
            assert engine.engine_core.has_step_in_flight()
            engine.abort_request("abort-1")
    assert set(finished) == {"abort-0", "abort-2"}
    reference = serial.generate([{"prompt_token_ids": prompts[i]} for i in (0, 2)], params, use_tqdm=False)
    assert [finished[k].outputs[0].token_ids for k in ("abort-0", "abort-2")] == \
        [r.outputs[0].token_ids for r in reference]
    assert_engine_idle(overlapped.llm_engine)
