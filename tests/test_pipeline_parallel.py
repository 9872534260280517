"""Pipeline parallelism on Ray (CPU, fp32): 2 stages of 1 worker (compiled graph) and 2
stages of 2 tensor-parallel workers (actor calls) give Hugging Face's greedy tokens and
logprobs with chunked prefill, prefix caching and preemption; micro-batches of different
requests keep the stages busy and never hold a request whose token is still in flight;
penalised greedy tokens equal the dense PyTorch reference's;
each stage holds its own layers and their KV cache only; a killed stage fails its requests
with an error naming it."""

from __future__ import annotations

import random
import time
from collections import deque
from pathlib import Path

import pytest
import ray

from engine_checks import assert_engine_idle, kill_worker_at_step
from hf_reference import assert_logprobs_match_hf, hf_greedy
from penalty_reference import penalised_greedy
from raylm.engine import LLM, SamplingParams
from raylm.parallel.pipeline import get_pp_indices
from tiny_models import build_tiny_model

MAX_TOKENS = 16
# Prompts of 20-60 tokens on 4 shared 32-token prefixes (so later ones hit the prefix cache),
# chunked by a 24-token budget, in a pool of 24 blocks of 16 tokens that the 12 requests
# (3-5 blocks each) outgrow: the scheduler preempts.
ENGINE = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=24, num_gpu_blocks_override=24,
              enable_prefix_caching=True, enable_chunked_prefill=True)


def shared_prefix_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, 512) for _ in range(32)] for _ in range(4)]
    return [prefixes[i % 4] + [rng.randrange(4, 512) for _ in range(rng.randint(0, 28))] for i in range(count)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline_parallel")
    # 3 layers split 2 + 1; Qwen2's 4 layers 2 + 2 with the LM head tied to the embedding,
    # which the last stage then holds too.
    return {"llama": build_tiny_model(root / "llama", "llama", seed=11, num_hidden_layers=3),
            "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=12, num_hidden_layers=4)}


# (name, architecture, tensor_parallel_size, pipeline_parallel_size, steps through the compiled graph)
LAYOUTS = [("pp2-compiled", "llama", 1, 2, True), ("tp2-pp2-actor-calls", "qwen2", 2, 2, False)]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def pp_llm(request, ray_cluster, model_dirs):
    _, arch, tp, pp, compiled = request.param
    llm = LLM(model=str(model_dirs[arch]), tensor_parallel_size=tp, pipeline_parallel_size=pp,
              ray_compiled_graph=compiled, ray_cpus_per_worker=0.5, **ENGINE)
    yield model_dirs[arch], llm, tp, pp
    llm.shutdown()


def _watch_steps(llm: LLM) -> dict:
    """Records, from now on, the most steps in flight, the requests of each step, and
    whether a step ever took a request whose sampled token was still in flight."""
    core = llm.llm_engine.engine_core
    seen = {"max_in_flight": 0, "steps": [], "reused_in_flight": False}
    in_flight: deque[set[int]] = deque()
    send = core.executor.execute_model_async

    def watched(req):
        ids = {s.req_id for s in req.requests}
        sampled = {s.req_id for s in req.requests if s.do_sample}
        seen["reused_in_flight"] |= any(ids & earlier for earlier in in_flight)
        in_flight.append(sampled)
        seen["steps"].append(ids)
        seen["max_in_flight"] = max(seen["max_in_flight"], len(in_flight))
        wait = send(req)

        def collected():
            output = wait()
            in_flight.popleft()
            return output

        return collected

    core.executor.execute_model_async = watched
    return seen


def test_greedy_tokens_and_logprobs_equal_hf_with_chunks_prefix_hits_and_preemption(pp_llm):
    model_dir, llm, _, pp = pp_llm
    prompts = shared_prefix_prompts(12, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    seen = _watch_steps(llm)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        del llm.llm_engine.engine_core.executor.execute_model_async
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert output.outputs[0].token_ids[:len(expected)] == expected  # HF stops at EOS, raylm ignores it
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=2)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert kv.prefix_cache_hits > hits_before
    # pipeline_parallel_size + 1 micro-batches in flight, none sharing a request whose
    # token was being sampled.
    assert seen["max_in_flight"] == pp + 1
    assert not seen["reused_in_flight"]
    assert_engine_idle(llm.llm_engine)


def test_each_stage_holds_its_layers_and_their_kv_cache_only(pp_llm):
    _, llm, tp, pp = pp_llm

    def stage_report(wrapper) -> dict:
        """Run on a worker actor (a nested function travels by value): where it runs
        and what its stage holds."""
        import ray as actor_ray

        from raylm.models.pipeline import PPMissingLayer

        worker = wrapper.worker
        model = worker.model_runner.model
        names = [name for name, _ in model.named_parameters()]
        return dict(node_id=actor_ray.get_runtime_context().get_node_id(), pp_rank=worker.pp_rank,
                    tp_rank=worker.tp_rank,
                    layers=[i for i, layer in enumerate(model.model.layers) if not isinstance(layer, PPMissingLayer)],
                    embeds="model.embed_tokens.weight" in names, has_norm="model.norm.weight" in names,
                    kv_caches=len(worker.model_runner.kv_caches),
                    block_bytes=worker.model_runner.get_cache_block_size_bytes())

    executor = llm.llm_engine.executor
    reports = ray.get([w.__ray_call__.remote(stage_report) for w in executor.workers], timeout=60)
    config = llm.llm_engine.model_config
    num_layers = config.num_layers
    kv_heads_per_rank = config.num_kv_heads // tp
    for rank, report in enumerate(reports):
        stage = rank // tp
        start, end = get_pp_indices(num_layers, stage, pp)
        assert (report["pp_rank"], report["tp_rank"]) == (stage, rank % tp)
        assert report["layers"] == list(range(start, end))
        assert report["kv_caches"] == end - start
        assert report["block_bytes"] == 2 * (end - start) * 16 * kv_heads_per_rank * config.head_size * 4
        assert report["has_norm"] == (stage == pp - 1)
        assert report["embeds"] == (stage == 0 or (stage == pp - 1 and config.hf_config.tie_word_embeddings))
    assert len({(r["pp_rank"], r["tp_rank"]) for r in reports}) == tp * pp


def test_without_async_scheduling_one_batch_at_a_time_gives_the_same_tokens(pp_llm, model_dirs):
    model_dir, llm, tp, pp = pp_llm
    if tp > 1:
        pytest.skip("one layout is enough for the one-at-a-time path")
    prompts = shared_prefix_prompts(6, seed=22)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    pipelined = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]
    with LLM(model=str(model_dir), pipeline_parallel_size=pp, async_scheduling=False, **ENGINE) as stepwise_llm:
        seen = _watch_steps(stepwise_llm)
        stepwise = [o.outputs[0].token_ids for o in stepwise_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                            params, use_tqdm=False)]
    assert stepwise == pipelined
    assert seen["max_in_flight"] == 1


def test_penalised_greedy_tokens_equal_the_dense_reference(pp_llm):
    # The token histories that penalties read are kept by the worker that samples alone
    # (the last stage's tensor-parallel rank 0).
    model_dir, llm, _, _ = pp_llm
    prompts = shared_prefix_prompts(6, seed=23)
    penalties = [(1.3, 0.0, 0.0), (1.2, 0.4, 0.3), (0.8, 0.2, -0.5)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=r,
                             frequency_penalty=f, presence_penalty=p) for r, f, p in penalties * 2]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        assert output.outputs[0].token_ids == penalised_greedy(model_dir, prompt, MAX_TOKENS, *penalties[i % 3])


# Last: it kills a worker of the module's engine (pytest runs a parametrized module
# fixture's tests in the order they are written, then tears it down).
def test_a_killed_stage_fails_its_requests_naming_it_within_30_s(pp_llm):
    _, llm, tp, pp = pp_llm
    executor = llm.llm_engine.executor
    victim = tp * (pp - 1)  # rank 0 of the last stage
    kill = kill_worker_at_step(llm, rank=victim, step=3)
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(6, seed=23)]
    with pytest.raises(RuntimeError) as excinfo:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - kill.killed_at < 30
    message = str(excinfo.value)
    assert f"rank(s) [{victim}] died (rank {victim} (pipeline stage {pp - 1}) on node" in message
    with pytest.raises(RuntimeError, match=rf"worker rank\(s\) \[{victim}\] .* dead"):
        llm.llm_engine.check_health()
    # The failed requests are gone, their blocks back in the pool.
    scheduler = llm.llm_engine.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert scheduler.kv_cache_manager.get_num_free_blocks() == scheduler.kv_cache_manager.num_blocks
    workers, group = list(executor.workers), executor.placement_group
    llm.shutdown()
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.ping.remote(), timeout=10)
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
