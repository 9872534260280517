"""Tensor parallelism on Ray (CPU, gloo, fp32): N workers give the same tokens as one
worker in process and as Hugging Face transformers, and each holds 1/N of the model.
Steps reach the workers through a Ray compiled graph unless `ray_compiled_graph=False`
asks for actor calls; both paths are checked against Hugging Face."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors import safe_open

from engine_checks import ENGINE_MODES
from hf_reference import assert_logprobs_match_hf, hf_greedy
from raylm.engine import LLM, SamplingParams
from raylm.engine.config import ParallelConfig
from tiny_models import build_tiny_model, random_prompts

ARCHS = ("llama", "qwen2", "mistral")
NUM_PROMPTS = 24
MAX_TOKENS = 16
# 24 prompts of 20-40 tokens growing by 16 need 3-4 blocks each (~85 in all): 20 blocks
# force the scheduler to preempt and recompute, which every rank must follow.
SMALL_KV_POOL = dict(num_gpu_blocks_override=20, max_model_len=128, max_num_seqs=32)


def greedy_token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def greedy_prompts() -> list[list[int]]:
    return random_prompts(NUM_PROMPTS, seed=7, min_len=20, max_len=40)


@pytest.fixture(scope="module")
def references(tiny_model_dirs, greedy_prompts):
    """For an architecture: (model dir, greedy tokens of one in-process worker with a roomy
    KV pool, HF's greedy tokens), computed once for all its tensor-parallel cases."""
    computed: dict[str, tuple] = {}

    def of(arch: str) -> tuple:
        if arch not in computed:
            model_dir = tiny_model_dirs[arch]
            llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=32)
            tokens = greedy_token_ids(llm, greedy_prompts)
            llm.shutdown()
            hf_tokens = [hf_greedy(model_dir, prompt, MAX_TOKENS) for prompt in greedy_prompts]
            computed[arch] = (model_dir, tokens, hf_tokens)
        return computed[arch]

    return of


# (architecture, tensor_parallel_size, scheduler mode, steps through the compiled graph).
# Every model at tp2 on the compiled graph: each model's own sharding on Ray workers. At tp4
# the 2 KV heads are replicated, two ranks a head: llama's plain projections and qwen2's
# biased ones (its bias is replicated with its head); mistral shares llama's layers. The
# actor-call path and the no-cache, no-chunk scheduler run on one model: they are the
# executor's and the scheduler's, the same for every model.
TP_CASES = [("llama", 1, "default", True),
            *[(arch, 2, "default", True) for arch in ARCHS],
            ("llama", 4, "default", True), ("qwen2", 4, "default", True),
            ("llama", 2, "no-cache-no-chunk", False)]


@pytest.fixture(scope="module", params=TP_CASES,
                ids=[f"tp{n}-{mode}-{'compiled' if compiled else 'actor-calls'}-{arch}"
                     for arch, n, mode, compiled in TP_CASES])
def tp_llm(request, ray_cluster, references):
    arch, tensor_parallel_size, mode, compiled = request.param
    model_references = references(arch)
    llm = LLM(model=str(model_references[0]), dtype="float32", tensor_parallel_size=tensor_parallel_size,
              distributed_executor_backend="ray", ray_compiled_graph=compiled, **SMALL_KV_POOL, **ENGINE_MODES[mode])
    yield model_references, llm, compiled
    llm.shutdown()


def test_steps_take_the_path_ray_compiled_graph_chose(tp_llm):
    _, llm, compiled = tp_llm
    assert llm.llm_engine.executor.uses_compiled_graph is compiled


def test_greedy_tokens_equal_one_worker_and_hf_while_a_small_kv_pool_preempts(tp_llm, greedy_prompts):
    (_, single_worker_tokens, hf_tokens), llm, _ = tp_llm
    tokens = greedy_token_ids(llm, greedy_prompts)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert tokens == single_worker_tokens
    for output, expected in zip(tokens, hf_tokens):
        # HF stops at EOS; with ignore_eos raylm goes on, so compare up to HF's length.
        assert output[:len(expected)] == expected


def test_sampled_and_prompt_logprobs_match_hf_within_1e_4(tp_llm):
    (model_dir, _, _), llm, _ = tp_llm
    prompts = random_prompts(4, seed=8, min_len=3, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=3)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """Big enough that replicated norms are a rounding error next to the sharded weights."""
    return build_tiny_model(tmp_path_factory.mktemp("wide") / "llama", "llama", vocab_size=4096, hidden_size=256,
                            intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4)


def test_each_worker_holds_about_one_nth_of_the_parameters(ray_cluster, wide_model_dir):
    with safe_open(str(wide_model_dir / "model.safetensors"), framework="pt") as f:
        full_bytes = 4 * sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # fp32
    llm = LLM(model=str(wide_model_dir), dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=64)
    try:
        per_worker = llm.llm_engine.executor.collective_rpc("parameter_bytes")
    finally:
        llm.shutdown()
    assert len(per_worker) == 2
    for worker_bytes in per_worker:
        assert worker_bytes == pytest.approx(full_bytes / 2, rel=0.01)


def test_an_engine_inside_a_placement_group_puts_its_workers_in_bundles_1_to_n(ray_cluster, llama_dir):
    """The Ray Serve contract: a replica runs in bundle 0 of its placement group and its
    tensor-parallel workers take bundles 1..N; the group stays the replica's."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    def replica(model_dir: str) -> dict:
        # Imports here: this runs in a Ray worker, which cannot import the test module.
        from raylm.engine import LLM, SamplingParams

        llm = LLM(model=model_dir, dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=64)
        executor = llm.llm_engine.executor
        outputs = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8),
                               use_tqdm=False)
        result = {"bundles": sorted(p.bundle_index for p in executor.placements),
                  "tokens": [outputs[0].outputs[0].token_ids]}
        llm.shutdown()
        result["group_alive"] = ray.util.placement_group_table(ray.util.get_current_placement_group())["state"]
        return result

    PROMPT = [5, 17, 42, 99, 7]
    group = placement_group([{"CPU": 0.5}] * 3, strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=30)
        result = ray.get(replica.options(num_cpus=0.5, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0)).remote(str(llama_dir)), timeout=180)
    finally:
        remove_placement_group(group)
    reference = LLM(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64)
    expected = [o.outputs[0].token_ids for o in reference.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)]
    reference.shutdown()
    assert result["bundles"] == [1, 2]
    assert result["tokens"] == expected
    assert result["group_alive"] == "CREATED"


def test_distributed_executor_backend_mp_is_an_error_that_names_uni_and_ray():
    with pytest.raises(ValueError, match=r"'mp' .* does not exist in raylm: use 'uni' .* or 'ray'"):
        ParallelConfig(distributed_executor_backend="mp")


def test_distributed_executor_backend_uni_runs_one_worker_in_process_and_ray_any_number():
    with pytest.raises(ValueError, match=r"'uni' runs one worker in process, but tensor_parallel_size is 2"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    assert not ParallelConfig(distributed_executor_backend="uni").use_ray
    assert ParallelConfig(distributed_executor_backend="ray").use_ray
    assert ParallelConfig(tensor_parallel_size=2).use_ray and not ParallelConfig().use_ray
