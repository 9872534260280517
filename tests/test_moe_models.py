"""Mixture-of-Experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) through `LLM.generate` against
Hugging Face transformers on the same tiny random checkpoints, in fp32: on one worker, on two
tensor-parallel Ray workers (every expert sharded), and on two with expert parallelism
(whole experts per worker: Qwen3-MoE's 5 split 3 + 2, Qwen2-MoE's 7 split 4 + 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_checks import assert_engine_idle, tensor_parallel_llm
from hf_reference import assert_logprobs_match_hf, cached_hf_greedy
from raylm.engine import SamplingParams
from raylm.kernels import cpu_gemm
from tiny_models import build_tiny_mixtral, build_tiny_qwen2_moe, build_tiny_qwen3_moe, random_prompts_spanning

NUM_PROMPTS = 12
MAX_TOKENS = 12

BUILDERS = {
    "mixtral": lambda path: build_tiny_mixtral(path, seed=20),
    "qwen3_moe": lambda path: build_tiny_qwen3_moe(path, seed=21),
    "qwen2_moe": lambda path: build_tiny_qwen2_moe(path, seed=22),
}
# (architecture, tensor_parallel_size, enable_expert_parallel)
CASES = [("mixtral", 1, False), ("qwen3_moe", 1, False), ("qwen2_moe", 1, False),
         ("mixtral", 2, False), ("qwen3_moe", 2, True), ("qwen2_moe", 2, True)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_models")
    return {arch: build(root / arch) for arch, build in BUILDERS.items()}


@pytest.fixture(scope="module", params=CASES, ids=[f"{arch}-tp{tp}{'-ep' if ep else ''}" for arch, tp, ep in CASES])
def moe_llm(request, model_dirs):
    arch, tensor_parallel_size, expert_parallel = request.param
    with tensor_parallel_llm(request, model_dirs[arch], tensor_parallel_size, dtype="float32",
                             enable_expert_parallel=expert_parallel, max_model_len=256, max_num_seqs=32) as llm:
        yield model_dirs[arch], llm, request.param


def test_greedy_tokens_equal_hf_generate_for_a_batch_of_varied_prompts(moe_llm):
    model_dir, llm, _ = moe_llm
    prompts = random_prompts_spanning(NUM_PROMPTS, seed=1, min_len=1, max_len=60)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == cached_hf_greedy(model_dir, tuple(prompt), MAX_TOKENS)
    assert_engine_idle(llm.llm_engine)


def test_sampled_top_and_prompt_logprobs_match_hf_log_softmax_within_1e_4(moe_llm):
    model_dir, llm, _ = moe_llm
    prompts = random_prompts_spanning(4, seed=2, min_len=3, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=3)


def test_expert_parallel_workers_hold_whole_experts_split_as_vllm_places_them(moe_llm):
    """An odd number of experts on 2 workers: the first holds exactly one expert more per
    sparse layer (3 matrices of hidden x moe_intermediate fp32); sharded experts leave both
    workers the same size."""
    model_dir, llm, (arch, tensor_parallel_size, expert_parallel) = moe_llm
    if tensor_parallel_size == 1:
        pytest.skip("one worker holds every expert")
    config = llm.llm_engine.model_config.hf_config
    per_worker = llm.llm_engine.executor.collective_rpc("parameter_bytes")
    expert_intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # Mixtral's
    one_expert_bytes = 3 * config.hidden_size * expert_intermediate * 4
    sparse_layers = len([i for i in range(config.num_hidden_layers)
                         if i not in (getattr(config, "mlp_only_layers", None) or [])])
    expected_difference = sparse_layers * one_expert_bytes if expert_parallel else 0
    assert per_worker[0] - per_worker[1] == expected_difference


def test_the_moe_layers_run_the_native_cpu_kernel_on_one_worker(moe_llm):
    _, llm, (arch, tensor_parallel_size, _) = moe_llm
    if tensor_parallel_size > 1 or not cpu_gemm.avx512_linear_enabled(torch.float32):
        pytest.skip("the in-process worker on a CPU with the AVX-512 kernel")
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    experts = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert experts and all(e.packed is not None for e in experts)
