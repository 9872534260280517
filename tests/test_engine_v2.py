"""The request-centred engine end to end: prefix caching, chunked prefill, n fan-out and
memory, each checked against Hugging Face transformers or arithmetic by hand."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine_checks import assert_engine_idle
from hf_reference import hf_greedy
from raylm.engine import LLM, SamplingParams
from raylm.engine.llm_engine import LLMEngine
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.sampling_params import MAX_N_SEQUENCES
from tiny_models import build_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory) -> Path:
    """The tiny Llama with a 2,048-token context."""
    return build_tiny_model(tmp_path_factory.mktemp("long_llama"), "llama", seed=7, max_position_embeddings=2048)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(4, 512) for _ in range(count)]


def test_shared_prefix_is_prefilled_once_and_outputs_do_not_change(long_llama_dir):
    rng = random.Random(0)
    prefix = _tokens(rng, 1000)
    prompts = [prefix + _tokens(rng, 32) for _ in range(64)]
    params = SamplingParams(max_tokens=4, **GREEDY)
    requests = [{"prompt_token_ids": p} for p in prompts]
    with LLM(model=str(long_llama_dir), dtype="float32", max_num_seqs=64) as cached:
        stats = cached.llm_engine.stat_logger
        outputs = cached.generate(requests, params, use_tqdm=False)
        # The first request computes all 1,032 tokens; every other finds the prefix's 62
        # full blocks (992 tokens) in the cache and computes the remaining 40.
        block_size = 16
        hit = 1000 // block_size * block_size
        assert stats.total_prompt_tokens == 1032 + 63 * (1032 - hit)
        kv = cached.llm_engine.scheduler.kv_cache_manager
        assert kv.prefix_cache_hits == 63 * hit
        assert all(o.metrics.num_cached_tokens == (0 if i == 0 else hit) for i, o in enumerate(outputs))
        assert_engine_idle(cached.llm_engine)
    with LLM(model=str(long_llama_dir), dtype="float32", max_num_seqs=64, enable_prefix_caching=False) as plain:
        reference = plain.generate(requests, params, use_tqdm=False)
        assert plain.llm_engine.stat_logger.total_prompt_tokens == 64 * 1032
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    for prompt, output in list(zip(prompts, outputs))[:6]:
        assert output.outputs[0].token_ids == hf_greedy(long_llama_dir, prompt, 4)


def test_a_long_prompt_is_chunked_while_every_decode_gains_a_token_each_step(long_llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(long_llama_dir), dtype="float32",
                                                   max_num_batched_tokens=256, max_num_seqs=32))
    rng = random.Random(1)
    short_prompts = {f"short-{i}": _tokens(rng, rng.randint(5, 30)) for i in range(16)}
    long_prompt = _tokens(rng, 2000)
    for request_id, prompt in short_prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=30, **GREEDY))
    tokens: dict[str, list[int]] = {}
    while len(tokens) < len(short_prompts):  # every short request prefilled and decoding
        for output in engine.step():
            tokens[output.request_id] = output.outputs[0].token_ids
    engine.add_request("long", {"prompt_token_ids": long_prompt}, SamplingParams(max_tokens=5, **GREEDY))
    prefill_steps = 0
    while "long" not in tokens:
        before = {request_id: len(t) for request_id, t in tokens.items()}
        outputs = {output.request_id: output for output in engine.step()}
        prefill_steps += 1
        for request_id, count in before.items():
            # Each decoding request gains exactly one token in every step of the prefill.
            assert len(outputs[request_id].outputs[0].token_ids) == count + 1
            tokens[request_id] = outputs[request_id].outputs[0].token_ids
        if "long" in outputs:
            tokens["long"] = outputs["long"].outputs[0].token_ids
    # 2,000 prompt tokens in steps that leave 256 - 16 tokens of budget to prefill.
    assert prefill_steps == -(-2000 // (256 - 16))
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = output.outputs[0].token_ids
    for request_id, prompt in short_prompts.items():
        assert tokens[request_id] == hf_greedy(long_llama_dir, prompt, 30)
    assert tokens["long"] == hf_greedy(long_llama_dir, long_prompt, 5)
    assert_engine_idle(engine)
    engine.shutdown()


def test_n_above_the_limit_is_rejected_naming_it():
    with pytest.raises(ValueError, match=f"n must be an integer from 1 to {MAX_N_SEQUENCES}"):
        SamplingParams(n=MAX_N_SEQUENCES + 1, temperature=1.0)
    with pytest.raises(ValueError, match=f"best_of must be at most {MAX_N_SEQUENCES}"):
        SamplingParams(n=2, best_of=MAX_N_SEQUENCES + 1, temperature=1.0)


_MEMORY_SCRIPT = """
import resource, sys
from raylm.engine import LLM, SamplingParams

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

llm = LLM(model=sys.argv[1], dtype="float32")
llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)  # warm: kernels built, first step run
before = peak_mb()
out = llm.generate("x", SamplingParams(n=5000, temperature=1.0, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
assert len(out.outputs) == 5000 and all(len(c.token_ids) == 2 for c in out.outputs)
kv = llm.llm_engine.scheduler.kv_cache_manager
assert kv.get_num_free_blocks() == kv.num_blocks and not llm.llm_engine.has_unfinished_requests()
print(f"GROWTH_MB {peak_mb() - before:.1f}")
"""


def test_n_5000_samples_cost_memory_in_proportion_to_their_tokens_and_never_stall(llama_dir):
    # n = 5000 is more than the step's token budget (2048) and max_num_seqs (256): the
    # children are ordinary requests that the scheduler admits as room allows. A fresh
    # process measures the peak resident memory that the request adds.
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_MEMORY_SCRIPT), str(llama_dir)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    growth_mb = float(result.stdout.split("GROWTH_MB")[1])
    assert growth_mb < 200, f"n=5000 with max_tokens=2 grew the process by {growth_mb:.0f} MB"
