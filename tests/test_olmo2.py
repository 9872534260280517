"""OLMo 2 (`Olmo2ForCausalLM`) through the engine against Hugging Face transformers on the
same tiny random checkpoint, in fp32: at tensor parallel sizes 1 and 2 (the q/k norms over
whole projections then span both ranks, the one KV head and its k_norm replicated), with
chunked prefill (a 24-token budget) and prefix-cache hits, on the native CPU attention
kernels and the PyTorch reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_checks import assert_greedy_twice_with_full_prefix_hits, tensor_parallel_llm
from hf_reference import assert_logprobs_match_hf, hf_greedy, hf_log_softmax
from raylm.engine import SamplingParams
from stage_logits import logits_in_stages
from tiny_models import build_tiny_olmo2, random_prompts

MAX_TOKENS = 10
ENGINE_KWARGS = dict(dtype="float32", max_num_seqs=16, max_model_len=128, max_num_batched_tokens=24,
                     enable_prefix_caching=True, enable_chunked_prefill=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_olmo2(tmp_path_factory.mktemp("olmo2") / "model", seed=4)


CASES = [(1, "cpu"), (1, "torch"), (2, "cpu")]


@pytest.fixture(scope="module", params=CASES, ids=[f"tp{tp}-{backend}" for tp, backend in CASES])
def llm(request, model_dir):
    tensor_parallel_size, backend = request.param
    with tensor_parallel_llm(request, model_dir, tensor_parallel_size, attention_backend=backend,
                             **ENGINE_KWARGS) as llm:
        if tensor_parallel_size == 1:
            model = llm.llm_engine.executor.driver_worker.model_runner.model
            assert {layer.self_attn.attn.attn_backend.name for layer in model.model.layers} == {backend}
        yield llm


def test_greedy_tokens_equal_hf_generate_with_chunks_and_prefix_hits(llm, model_dir):
    prompts = random_prompts(8, seed=1, min_len=1, max_len=60)
    prompts += [prompts[1][:40] + tail for tail in random_prompts(2, seed=2, min_len=5, max_len=20)]
    expected = [hf_greedy(model_dir, prompt, MAX_TOKENS) for prompt in prompts]
    assert_greedy_twice_with_full_prefix_hits(llm, prompts, expected, MAX_TOKENS)


def test_sampled_top_and_prompt_logprobs_match_hf_log_softmax(llm, model_dir):
    prompts = random_prompts(4, seed=3, min_len=3, max_len=50)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5, abs_tol=1e-4)


@pytest.mark.parametrize("pp_size", [1, 2])
def test_forward_without_attention_metadata_in_pipeline_stages_equals_hf(model_dir, pp_size):
    # One causal sequence through the PyTorch attention, whole or in two pipeline stages.
    prompt = random_prompts(1, seed=5, min_len=40, max_len=40)[0]
    logits = logits_in_stages(model_dir, prompt, pp_size)
    assert (torch.log_softmax(logits, dim=-1) - hf_log_softmax(model_dir, prompt)).abs().max() < 1e-4
