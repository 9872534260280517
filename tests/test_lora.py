"""Multi-LoRA serving in the engine: greedy tokens equal peft's PeftModel on the same base for
adapters of different ranks and targets mixed with the base model in one batch (TP 1 and 2,
prefix caching on), the prefix cache keyed by adapter, more adapters than slots queueing,
and bad adapters refused with clear errors while the engine keeps serving."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine_checks import run_to_end
from lora_adapters import assert_peft_greedy, build_lora_adapter, peft_greedy
from raylm.engine import LLM, LoRARequest, SamplingParams
from tiny_models import build_tiny_model

MAX_TOKENS = 10
NUM_PROMPTS = 5


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, llama_dir: Path) -> dict[str, Path]:
    """Three adapters of the tiny Llama: rank 8 on every projection; rank 4 with rsLoRA on
    q/v/o/down; rank 16 on k/gate/up."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": build_lora_adapter(llama_dir, root / "a", rank=8, seed=1),
        "b": build_lora_adapter(llama_dir, root / "b", rank=4, targets=("q_proj", "v_proj", "o_proj", "down_proj"),
                                lora_alpha=8, use_rslora=True, seed=2),
        "c": build_lora_adapter(llama_dir, root / "c", rank=16, targets=("k_proj", "gate_proj", "up_proj"), seed=3),
    }


@pytest.fixture(scope="module")
def lora_requests(adapters: dict[str, Path]) -> dict[str, LoRARequest | None]:
    requests = {name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(adapters.items())}
    return requests | {"base": None}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    # Long enough for two full blocks of 16: the prefix cache has something to share.
    return [[rng.randrange(4, 512) for _ in range(rng.randint(33, 45))] for _ in range(NUM_PROMPTS)]


@dataclass(frozen=True)
class PeftReferences:
    """peft's PeftModel over the tiny Llama under each adapter (or none, "base"), as the
    judge of an engine's greedy tokens for the test's prompts."""

    llama_dir: Path
    adapters: dict[str, Path]
    prompts: list[list[int]]

    def check(self, index: int, name: str, tokens: list[int]) -> None:
        """The tokens are peft's greedy tokens for prompt `index` under `name`, up to near-ties
        (`lora_adapters.assert_peft_greedy`: prompt 1 under b has one, its best two logits
        3.3e-5 apart)."""
        assert_peft_greedy(self.llama_dir, self.adapters.get(name), self.prompts[index], tokens, MAX_TOKENS,
                           f"prompt {index} under {name}")


@pytest.fixture(scope="module")
def references(llama_dir: Path, adapters: dict[str, Path], prompts) -> PeftReferences:
    return PeftReferences(llama_dir, adapters, prompts)


@pytest.fixture(scope="module")
def llm(llama_dir: Path):
    engine = LLM(str(llama_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                 max_model_len=128, max_num_seqs=32)
    yield engine
    engine.shutdown()


def greedy(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outputs]


def mixed_plan(num_prompts: int, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """Every prompt under every name, interleaved so that each step mixes them."""
    return [(index, name) for index in range(num_prompts) for name in names]


def assert_plan_matches(llm: LLM, prompts, lora_requests, references, plan) -> None:
    tokens = greedy(llm, [prompts[i] for i, _ in plan], [lora_requests[name] for _, name in plan])
    for (index, name), got in zip(plan, tokens):
        references.check(index, name, got)


def test_the_peft_judge_takes_either_side_of_a_near_tie_and_refuses_any_other_choice(llama_dir, adapters, prompts):
    """At prompt 1 under b's near-tie the judge takes peft's greedy tokens and the runner-up
    followed by peft's greedy tokens after it (an exact comparison refused the latter); at
    every clear choice it refuses the runner-up."""
    from lora_adapters import NEAR_TIE, peft_model

    prompt, adapter = prompts[1], adapters["b"]
    greedy_tokens = peft_greedy(llama_dir, adapter, prompt, MAX_TOKENS)
    with torch.no_grad():
        logits = peft_model(str(llama_dir), str(adapter))(input_ids=torch.tensor([prompt + greedy_tokens])).logits[0]
    top2 = logits[len(prompt) - 1:len(prompt) - 1 + MAX_TOKENS].topk(2, dim=-1)
    gaps = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    tie = min(range(MAX_TOKENS), key=gaps.__getitem__)
    assert gaps[tie] <= NEAR_TIE, f"prompt 1 under b has no near-tie any more ({gaps}): pick a prompt that has"
    assert_peft_greedy(llama_dir, adapter, prompt, greedy_tokens, MAX_TOKENS)
    other_side = greedy_tokens[:tie] + [int(top2.indices[tie, 1])]
    other_side += peft_greedy(llama_dir, adapter, prompt + other_side, MAX_TOKENS - len(other_side))
    assert_peft_greedy(llama_dir, adapter, prompt, other_side, MAX_TOKENS)
    for step in range(MAX_TOKENS):
        if gaps[step] > NEAR_TIE:
            runner_up = greedy_tokens[:step] + [int(top2.indices[step, 1])] + greedy_tokens[step + 1:]
            with pytest.raises(AssertionError, match=f"token {step} is {runner_up[step]}, whose logit lies"):
                assert_peft_greedy(llama_dir, adapter, prompt, runner_up, MAX_TOKENS)
    with pytest.raises(AssertionError, match="9 tokens, not 10"):
        assert_peft_greedy(llama_dir, adapter, prompt, greedy_tokens[:-1], MAX_TOKENS)


def test_two_adapters_of_different_ranks_mixed_with_the_base_equal_peft(llm, prompts, lora_requests, references):
    plan = mixed_plan(NUM_PROMPTS, ("a", "b", "base"))
    assert_plan_matches(llm, prompts, lora_requests, references, plan)
    # Again: now every prompt's first blocks come from the prefix cache, under its own adapter.
    kv = llm.llm_engine.scheduler.kv_cache_manager
    hits = kv.prefix_cache_hits
    assert_plan_matches(llm, prompts, lora_requests, references, plan)
    assert kv.prefix_cache_hits - hits >= len(plan) * 32
    assert kv.usage == 0.0


def test_the_same_prompt_under_two_adapters_and_the_base_gives_three_answers(llm, prompts, lora_requests,
                                                                            references):
    plan = [(0, "a"), (0, "b"), (0, "base")]
    tokens = greedy(llm, [prompts[0]] * 3, [lora_requests[name] for _, name in plan])
    assert len({tuple(t) for t in tokens}) == 3
    for (index, name), got in zip(plan, tokens):
        references.check(index, name, got)


def test_the_fused_cpu_decode_op_runs_adapter_steps_with_their_terms(llm, prompts, lora_requests, references):
    """On this machine the fused op takes the decode steps, adapter steps included (it adds the
    adapters' terms natively): the tokens still equal peft's."""
    fused = llm.llm_engine.executor.driver_worker.model_runner.model.model.fused_decode
    run = fused.run
    ran: list[tuple[bool, bool]] = []

    def counted(*args):
        result = run(*args)
        ran.append((fused._lora_batch is not None and fused._lora_batch.active, result is not None))
        return result

    fused.run = counted
    try:
        assert_plan_matches(llm, prompts, lora_requests, references, mixed_plan(2, ("a", "b", "base")))
    finally:
        del fused.run
    if not fused._shape:
        pytest.skip("the fused CPU decode op is not available on this machine")
    assert (True, True) in ran


def test_prefix_cache_is_shared_within_an_adapter_and_never_across(llm, prompts, lora_requests):
    prompt = {"prompt_token_ids": [7] * 40}
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached_tokens(name: str) -> int:
        (output,) = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_requests[name])
        return output.metrics.num_cached_tokens

    llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
    assert cached_tokens("a") == 0
    assert cached_tokens("b") == 0
    assert cached_tokens("base") == 0
    assert cached_tokens("a") == 32
    assert cached_tokens("b") == 32
    assert cached_tokens("base") == 32


def test_more_adapters_than_slots_queue_and_all_equal_peft(llama_dir, prompts, lora_requests, references):
    """max_loras=1 and max_cpu_loras=2 with three adapters and the base in one generate: the
    adapters take turns in the one slot, the host cache drops and reads them again."""
    llm = LLM(str(llama_dir), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=16,
              max_model_len=128, max_num_seqs=32)
    try:
        steps = []
        executor = llm.llm_engine.executor
        run_step = executor.execute_model_async
        executor.execute_model_async = lambda req: (steps.append(req), run_step(req))[1]
        assert_plan_matches(llm, prompts, lora_requests, references, mixed_plan(3, ("a", "b", "c", "base")))
        assert len(llm.llm_engine.list_loras()) <= 2
        # The one slot changed hands several times, each time in a step with no request of
        # the adapter it held before.
        activations = [step.lora_activations for step in steps if step.lora_activations]
        assert len(activations) >= 3
        assert all(r.lora_slot in (-1, 0) for step in steps for r in step.requests)
        assert llm.llm_engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()


def test_an_mlp_run_in_row_chunks_keeps_each_rows_adapter(llm, prompts, lora_requests, references, monkeypatch):
    """A long prefill's MLP runs in row chunks on the CPU (kernels/mlp_row_chunks.py); the LoRA
    layers follow the chunks' rows. Chunks of a few rows here, so every prefill is chunked."""
    from raylm.kernels import mlp_row_chunks

    monkeypatch.setattr(mlp_row_chunks, "MLP_PASS_BYTES", 8 * 128 * 4)
    llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
    assert_plan_matches(llm, prompts, lora_requests, references, mixed_plan(2, ("a", "b", "base")))


@pytest.mark.parametrize("chunked_mlp", [False, True])
def test_logprobs_and_prompt_logprobs_under_an_adapter_equal_peft(llm, prompts, lora_requests, adapters,
                                                                  llama_dir, monkeypatch, chunked_mlp):
    """Prompt logprobs read every prompt row, the sampled rows first: the last layer's output
    projection and MLP run on those rows in that order, under each row's adapter (and in row
    chunks, with chunked_mlp)."""
    import torch

    from lora_adapters import peft_model

    if chunked_mlp:
        from raylm.kernels import mlp_row_chunks

        monkeypatch.setattr(mlp_row_chunks, "MLP_PASS_BYTES", 8 * 128 * 4)
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    names = ("a", "base", "b")
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in range(3)], params, use_tqdm=False,
                           lora_request=[lora_requests[name] for name in names])
    for index, (name, output) in enumerate(zip(names, outputs)):
        assert_peft_greedy(llama_dir, adapters.get(name), prompts[index], list(output.outputs[0].token_ids), 3, name)
        tokens = prompts[index] + list(output.outputs[0].token_ids)
        model = peft_model(str(llama_dir), None if name == "base" else str(adapters[name]))
        with torch.no_grad():
            reference = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
        for position in range(1, len(prompts[index])):
            token = prompts[index][position]
            assert output.prompt_logprobs[position][token].logprob == pytest.approx(
                reference[position - 1, token].item(), abs=1e-4)
        for step, token in enumerate(output.outputs[0].token_ids):
            row = reference[len(prompts[index]) - 1 + step]
            assert output.outputs[0].logprobs[step][token].logprob == pytest.approx(row[token].item(), abs=1e-4)


def test_a_qwen2_adapter_with_qkv_bias_equals_peft(tiny_model_dirs, tmp_path):
    qwen2 = tiny_model_dirs["qwen2"]
    adapter = build_lora_adapter(qwen2, tmp_path / "qwen2_adapter", rank=8, seed=5)
    prompt = list(range(20, 60))
    llm = LLM(str(qwen2), dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=128, max_num_seqs=8)
    try:
        tokens = greedy(llm, [prompt, prompt], [LoRARequest("q", 1, str(adapter)), None])
    finally:
        llm.shutdown()
    assert_peft_greedy(qwen2, adapter, prompt, tokens[0], MAX_TOKENS, "qwen2 under its adapter")
    assert_peft_greedy(qwen2, None, prompt, tokens[1], MAX_TOKENS, "qwen2's base")
    assert tokens[0] != tokens[1]


def assert_fails_alone_beside_b_and_base(engine, lora: LoRARequest, prompts, lora_requests, references) -> None:
    """`lora`'s request, run in the same steps as b's and the base model's at tensor-parallel
    size 2, fails alone with the error of an adapter another rank could not read; b and base
    equal peft's, no KV block is held and neither rank keeps `lora`."""
    name = lora.lora_name
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for request_id, request_lora in ((name, lora), ("b", lora_requests["b"]), ("base", None)):
        engine.add_request(request_id, {"prompt_token_ids": prompts[0]}, params, lora_request=request_lora)
    finished, failed = run_to_end(engine)
    assert set(finished) == {"b", "base"}
    for request_id, got in finished.items():
        references.check(0, request_id, got)
    assert set(failed) == {name}
    assert f"LoRA adapter '{name}' could not be read on another tensor-parallel rank" in str(failed[name])
    assert engine.scheduler.kv_cache_manager.usage == 0.0
    assert [lora.lora_int_id in ids for ids in engine.executor.collective_rpc("list_loras")] == [False, False]


@pytest.mark.parametrize("tp", [2])
def test_mixed_batch_equals_peft_at_tensor_parallel_2(ray_cluster, llama_dir, prompts, adapters, lora_requests,
                                                      references, tmp_path, tp):
    """Then a step puts adapter d in a slot when rank 1 has dropped it from host memory and its
    folder is gone: rank 0 holds it, rank 1 cannot read it. Both ranks leave the slot empty
    (rank 0 alone would serve half an adapter) and d's request alone fails; the base and b
    requests of the same steps equal peft's."""
    import shutil

    import ray

    llm = LLM(str(llama_dir), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, max_model_len=128,
              max_num_seqs=32, tensor_parallel_size=tp)
    try:
        plan = mixed_plan(NUM_PROMPTS, ("a", "b", "c", "base"))
        assert_plan_matches(llm, prompts, lora_requests, references, plan)
        assert_plan_matches(llm, prompts, lora_requests, references, plan)  # with prefix-cache hits
        assert llm.llm_engine.executor.collective_rpc("list_loras") == [[1, 2, 3], [1, 2, 3]]

        engine, folder = llm.llm_engine, _copy_adapter(adapters["a"], tmp_path / "d")
        d = LoRARequest("d", 4, str(folder))
        engine.add_lora(d)
        executor = engine.executor
        run_step = executor.execute_model_async

        def rank_1_loses_d(req):
            if any(lora.lora_int_id == 4 for lora, _ in (req.lora_activations or {}).values()):
                executor.execute_model_async = run_step
                ray.get(executor.workers[1].execute_method.remote("remove_lora", 4))
                shutil.rmtree(folder)
            return run_step(req)

        executor.execute_model_async = rank_1_loses_d
        assert_fails_alone_beside_b_and_base(engine, d, prompts, lora_requests, references)

        # Rank 1 must read adapter e in the step, and the read raises an error that is not a
        # bad adapter's (a MemoryError): rank 1 still joins the ranks' agreement on failed
        # slots (raising past it left rank 0 waiting in its all-reduce: the step hung), and e's
        # request alone fails.
        e = LoRARequest("e", 5, str(adapters["b"]))
        engine.add_lora(e)

        def rank_1_runs_out_of_memory(actor) -> None:
            manager = actor.worker.model_runner.lora_manager
            manager.remove_lora(5)

            def read(lora_request, digest):
                raise MemoryError("no room for the adapter's share")

            manager._read = read

        def rank_1_cannot_read_e(req):
            if any(lora.lora_int_id == 5 for lora, _ in (req.lora_activations or {}).values()):
                executor.execute_model_async = run_step
                ray.get(executor.workers[1].__ray_call__.remote(rank_1_runs_out_of_memory))
            return run_step(req)

        executor.execute_model_async = rank_1_cannot_read_e
        assert_fails_alone_beside_b_and_base(engine, e, prompts, lora_requests, references)
    finally:
        llm.shutdown()


# ---- bad input -----------------------------------------------------------------------------------

def _copy_adapter(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _edit_config(folder: Path, **changes) -> Path:
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def bad_adapters(tmp_path_factory, llama_dir, adapters) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_lora")
    other_base = build_tiny_model(root / "other_base", "llama", hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, num_key_value_heads=1)
    corrupt = _copy_adapter(adapters["a"], root / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    no_config = _copy_adapter(adapters["a"], root / "no_config")
    (no_config / "adapter_config.json").unlink()
    deep_json = _copy_adapter(adapters["a"], root / "deep_json")
    (deep_json / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    alpha_past_float = _copy_adapter(adapters["a"], root / "alpha_past_float")
    (alpha_past_float / "adapter_config.json").write_text(
        (alpha_past_float / "adapter_config.json").read_text().replace('"lora_alpha": 16', '"lora_alpha": 1' + "0" * 400))
    huge_config = _copy_adapter(adapters["a"], root / "huge_config")
    os.truncate(huge_config / "adapter_config.json", 64 << 20)  # sparse: no disk, but 64 MiB to read
    return {
        "missing": root / "does-not-exist",
        "no_config": no_config,
        "rank": build_lora_adapter(llama_dir, root / "rank32", rank=32),
        "other_base": build_lora_adapter(other_base, root / "for_other_base", rank=4),
        "corrupt": corrupt,
        "dora": _edit_config(_copy_adapter(adapters["a"], root / "dora"), use_dora=True),
        # Hostile or broken configs: each an error naming the field, none an uncaught exception.
        "deep_json": deep_json,
        "huge_config": huge_config,
        "two_lora_a": _two_lora_a_for_one_module(_copy_adapter(adapters["a"], root / "two_lora_a")),
        "alpha_past_float": alpha_past_float,
        "rslora_string": _edit_config(_copy_adapter(adapters["a"], root / "rslora_string"), use_rslora="false"),
        "name_too_long": root / ("x" * 5000),
        "nul_in_path": Path(f"{adapters['a']}\x00/x"),
        # Weights that would make every logit NaN (and the sampler stop the engine): refused
        # when the adapter is loaded, whether the file holds them or lora_alpha / r makes them.
        "nan_weights": _nan_weights(_copy_adapter(adapters["a"], root / "nan_weights")),
        "alpha_overflows": _edit_config(_copy_adapter(adapters["a"], root / "alpha_overflows"), lora_alpha=1e300),
    }


def _two_lora_a_for_one_module(folder: Path) -> Path:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "adapter_model.safetensors")
    name = next(name for name in sorted(weights) if name.endswith("lora_A.weight"))
    weights[name.replace("lora_A.weight", "lora_A.default.weight")] = weights[name] * 2
    save_file(weights, folder / "adapter_model.safetensors")
    return folder


def _nan_weights(folder: Path) -> Path:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "adapter_model.safetensors")
    name = next(name for name in sorted(weights) if "lora_B" in name)
    weights[name][0, 0] = float("nan")
    save_file(weights, folder / "adapter_model.safetensors")
    return folder


BAD_CASES = {
    "missing": "lora_path is not a folder",
    "no_config": "has no adapter_config.json",
    "rank": "rank r=32 is above the engine's max_lora_rank=16",
    "other_base": "made for another base model",
    "corrupt": "cannot be read",
    "dora": "use_dora=True is not supported",
    "deep_json": "adapter_config.json nests too deep",
    "huge_config": "adapter_config.json is 67108864 bytes",
    "two_lora_a": "are both the lora_A of",
    "alpha_past_float": "lora_alpha must be a finite number",
    "rslora_string": "use_rslora must be true or false, got 'false'",
    "name_too_long": "lora_path is not a folder",
    "nul_in_path": "lora_path must not contain a NUL character",
}
# Refused when the workers read the weights (after the check that lets the request in): the
# request fails with the load's error.
LOAD_FAILURES = {
    "nan_weights": "hold NaN or infinite values",
    "alpha_overflows": "hold NaN or infinite values",
}


@pytest.mark.parametrize("case", sorted(BAD_CASES | LOAD_FAILURES))
def test_a_bad_adapter_is_a_clear_error_and_the_engine_keeps_serving(llm, bad_adapters, prompts, lora_requests,
                                                                     references, case):
    bad = LoRARequest(f"bad-{case}", 100 + sorted(BAD_CASES | LOAD_FAILURES).index(case), str(bad_adapters[case]))
    with pytest.raises(ValueError if case in BAD_CASES else RuntimeError, match=(BAD_CASES | LOAD_FAILURES)[case]):
        greedy(llm, prompts[:2], [lora_requests["a"], bad])
    assert not llm.llm_engine.has_unfinished_requests()
    assert_plan_matches(llm, prompts, lora_requests, references, [(0, "a"), (1, "base")])
    assert llm.llm_engine.scheduler.kv_cache_manager.usage == 0.0


def _overflowing_weights(folder: Path) -> Path:
    """Finite weights (they pass the load's check) whose products overflow fp32 in a forward."""
    from safetensors.torch import load_file, save_file

    weights_file = folder / "adapter_model.safetensors"
    save_file({name: torch.full_like(tensor, 1e18) for name, tensor in load_file(weights_file).items()}, weights_file)
    return folder


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_adapter_whose_logits_overflow_fails_its_request_alone(llm, adapters, tmp_path, prompts, lora_requests,
                                                                  references, temperature):
    # Before: the NaN row stopped the sampler, the step failed, and the engine (and a server
    # with it) stopped.
    folder = _overflowing_weights(_copy_adapter(adapters["a"], tmp_path / f"overflow-{temperature}"))
    overflow = LoRARequest(f"overflow-{temperature}", 300 + int(temperature), str(folder))
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("fine", {"prompt_token_ids": prompts[0]}, params, lora_request=lora_requests["a"])
    engine.add_request("overflow", {"prompt_token_ids": prompts[1]}, params, lora_request=overflow)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({output.request_id: output for output in engine.step() if output.finished})
    failed = engine.pop_failed_requests()
    assert list(failed) == ["overflow"] and "held NaN or infinite values" in str(failed["overflow"])
    assert "overflow" in str(failed["overflow"]) and list(finished) == ["fine"]
    assert len(finished["fine"].outputs[0].token_ids) == MAX_TOKENS
    assert engine.scheduler.kv_cache_manager.usage == 0.0
    assert_plan_matches(llm, prompts, lora_requests, references, [(0, "a"), (1, "base")])


def test_lora_requests_need_enable_lora_and_one_id_names_one_adapter(llama_dir, llm, lora_requests, adapters):
    plain = LLM(str(llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=32)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            plain.generate([[5, 6, 7]], lora_request=lora_requests["a"], use_tqdm=False)
    finally:
        plain.shutdown()
    impostor = LoRARequest("impostor", lora_requests["a"].lora_int_id, str(adapters["b"]))
    with pytest.raises(ValueError, match="already names LoRA adapter 'a'"):
        llm.generate([[5, 6, 7]], lora_request=impostor, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, str(adapters["a"]))
    with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
        llm.generate([[5, 6, 7]], lora_request=[None, None], use_tqdm=False)


def test_an_adapter_that_fails_to_load_fails_its_requests_alone(llama_dir, adapters, tmp_path):
    """The adapter passes the check when its request is added, then breaks before the
    background load reads it: that request fails with the load's error, the others finish
    and every KV block is back in the pool."""
    from raylm.engine import EngineArgs, LLMEngine

    folder = _copy_adapter(adapters["a"], tmp_path / "breaks")
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), dtype="float32", enable_lora=True,
                                                   max_model_len=128, disable_log_stats=True))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        engine.add_request("base", {"prompt_token_ids": [5, 6, 7, 8]}, params)
        engine.add_request("doomed", {"prompt_token_ids": [5, 6, 7, 8]}, params,
                           lora_request=LoRARequest("breaks", 1, str(folder)))
        (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        finished, failed = {}, {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
            failed.update(engine.pop_failed_requests())
        assert set(finished) == {"base"} and set(failed) == {"doomed"}
        assert "adapter_model.safetensors changed since the engine checked" in str(failed["doomed"])
        assert engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        engine.shutdown()


# ---- beam search ---------------------------------------------------------------------------------

def test_beam_search_runs_each_prompts_beams_under_its_adapter(llama_dir, llm, prompts, adapters, lora_requests):
    """LLM.beam_search with one adapter per prompt: each prompt's beams equal peft's
    `generate(num_beams=2)` under that adapter (the base model for None); the async engine's
    beam search under an adapter gives the same beams."""
    import asyncio

    from lora_adapters import peft_model
    from raylm.engine import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=6)
    names = ["a", "base", "b"]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:3]], params,
                              lora_request=[lora_requests[name] for name in names])
    for prompt, name, output in zip(prompts, names, outputs):
        model = peft_model(str(llama_dir), None if name == "base" else str(adapters[name]))
        with torch.no_grad():
            reference = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                       dtype=torch.long), num_beams=2, num_return_sequences=2, do_sample=False,
                                       max_new_tokens=6, pad_token_id=0)
        assert [s.output_tokens for s in output.sequences] == [seq[len(prompt):].tolist() for seq in reference], name
    assert len({tuple(output.sequences[0].output_tokens) for output in outputs}) == 3

    async def async_beams() -> list[list[int]]:
        from raylm.engine import AsyncLLMEngine, EngineArgs

        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), dtype="float32", enable_lora=True,
                                                            max_lora_rank=16, max_model_len=128))
        try:
            result = await engine.beam_search({"prompt_token_ids": prompts[0]}, "beams", params,
                                              lora_request=lora_requests["a"])
            return [sequence.output_tokens for sequence in result.sequences]
        finally:
            engine.shutdown()

    assert asyncio.run(async_beams()) == [s.output_tokens for s in outputs[0].sequences]


# ---- speculative decoding ------------------------------------------------------------------------

def test_ngram_speculation_under_adapters_gives_plain_decodings_tokens(llama_dir, llm, adapters, lora_requests):
    """N-gram proposals verified by the target under each request's adapter: the greedy tokens
    are those of the same engine without speculation and of peft, while proposals are made,
    accepted and rejected under adapters (each verification step's proposals run in the
    request's slot)."""
    rng = random.Random(5)
    patterns = [[rng.randrange(4, 512) for _ in range(rng.randint(2, 4))] for _ in range(4)]
    repeating = [(pattern * 12)[:rng.randint(20, 34)] for pattern in patterns]
    plan = [(index, name) for index in range(len(repeating)) for name in ("a", "b", "base")]
    loras = [lora_requests[name] for _, name in plan]
    spec = LLM(str(llama_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128,
               max_num_seqs=32, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    try:
        got = greedy(spec, [repeating[i] for i, _ in plan], loras)
        stats = spec.llm_engine.scheduler.drafter.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert spec.llm_engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        spec.shutdown()
    assert got == greedy(llm, [repeating[i] for i, _ in plan], loras)
    for (index, name), tokens in zip(plan, got):
        assert_peft_greedy(llama_dir, adapters.get(name), repeating[index], tokens, MAX_TOKENS, f"{index} under {name}")


def test_a_draft_model_with_lora_is_refused_naming_both_settings(llama_dir):
    from raylm.engine import EngineArgs

    args = EngineArgs(model=str(llama_dir), enable_lora=True,
                      speculative_config={"model": str(llama_dir), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"enable_lora and a draft model in speculative_config"):
        args.create_engine_config()


# ---- Mixture-of-Experts models ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from tiny_models import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe")


def test_lora_on_a_moe_models_attention_equals_peft_and_expert_adapters_are_refused(moe_dir, tmp_path):
    """On a MoE model (tiny Qwen3-MoE) an adapter of the attention projections serves as peft
    computes it; adapters of the experts are refused when they are loaded, naming the module
    (peft's own, which adapts the stacked expert weights through target_parameters, and one
    in the per-expert naming), and the engine keeps serving."""
    from safetensors.torch import load_file, save_file

    attention = build_lora_adapter(moe_dir, tmp_path / "attention", rank=8, targets=("q_proj", "v_proj", "o_proj"),
                                   seed=6)
    # peft maps gate/up/down onto the experts' stacked weights (target_parameters).
    stacked = build_lora_adapter(moe_dir, tmp_path / "stacked", rank=8, targets=("q_proj", "gate_proj", "up_proj",
                                                                                  "down_proj"), seed=7)
    per_expert = _copy_adapter(attention, tmp_path / "per_expert")
    weights = load_file(per_expert / "adapter_model.safetensors")
    module = "base_model.model.model.layers.0.mlp.experts.1.gate_proj"
    weights[f"{module}.lora_A.weight"] = torch.zeros(8, 64)
    weights[f"{module}.lora_B.weight"] = torch.zeros(48, 8)
    save_file(weights, per_expert / "adapter_model.safetensors")
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(20, 40))] for _ in range(3)]
    llm = LLM(str(moe_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
              max_num_seqs=8)
    try:
        good = LoRARequest("attention", 1, str(attention))
        loras = [good, None, good]
        for index, (prompt, lora, tokens) in enumerate(zip(prompts, loras, greedy(llm, prompts, loras))):
            assert_peft_greedy(moe_dir, attention if lora else None, prompt, tokens, MAX_TOKENS, f"prompt {index}")
        refused = {"stacked": r"target_parameters=.*\(model\.layers\.0\.mlp\.experts, .*not on MoE experts",
                   "per_expert": r"'model\.layers\.0\.mlp\.experts\.1\.gate_proj'.*not on MoE experts"}
        for index, (name, message) in enumerate(refused.items()):
            folder = stacked if name == "stacked" else per_expert
            with pytest.raises(ValueError, match=message):
                greedy(llm, prompts[:2], [good, LoRARequest(name, 2 + index, str(folder))])
        (tokens,) = greedy(llm, prompts[:1], [good])
        assert_peft_greedy(moe_dir, attention, prompts[0], tokens, MAX_TOKENS, "prompt 0 after the refusals")
        assert llm.llm_engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()


def _renamed_adapter(adapter: Path, out_dir: Path, old: str, new: str, rows: int) -> Path:
    """A copy of `adapter` whose `old` module tensors are named `new`, B cut to its first rows."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir()
    weights = {}
    for name, tensor in load_file(str(adapter / "adapter_model.safetensors")).items():
        if f".{old}." in name:
            name = name.replace(f".{old}.", f".{new}.")
            tensor = tensor[:rows].clone() if ".lora_B." in name else tensor
        weights[name] = tensor
    save_file(weights, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = [new if target == old else target for target in config["target_modules"]]
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


@pytest.mark.parametrize("tp", [1, 2])
def test_a_phi3_adapter_on_its_fused_qkv_proj_and_gate_up_proj_equals_peft(tmp_path, request, tp):
    """Phi-3's checkpoints, and so peft's adapters of them, name the fused qkv_proj and
    gate_up_proj: one A over the whole projection and one B over its q, k and v (gate and up)
    rows, cut per rank as the fused weight is. enable_lora on Phi-3 failed at load (KeyError
    'q_proj'). An adapter naming q_proj, which Phi-3 does not have, is refused as made for
    another base model."""
    from tiny_models import build_tiny_phi3

    base = build_tiny_phi3(tmp_path / "phi3", seed=20)
    fused = build_lora_adapter(base, tmp_path / "fused", rank=8, seed=5,
                               targets=("qkv_proj", "gate_up_proj", "o_proj", "down_proj"))
    qkv_only = build_lora_adapter(base, tmp_path / "qkv", rank=4, seed=6, targets=("qkv_proj",))
    q_named = _renamed_adapter(qkv_only, tmp_path / "q_named", "qkv_proj", "q_proj", rows=64)
    prompt = list(range(20, 60))
    if tp > 1:
        request.getfixturevalue("ray_cluster")
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=128, max_num_seqs=8,
              tensor_parallel_size=tp)
    try:
        loras = [LoRARequest("fused", 1, str(fused)), LoRARequest("qkv", 2, str(qkv_only)), None]
        tokens = greedy(llm, [prompt] * 3, loras)
        # The workers' read fails it (LOAD_FAILURES above): its request alone.
        with pytest.raises(RuntimeError, match=r"self_attn\.q_proj, which this model does not have as a LoRA layer"):
            greedy(llm, [prompt], [LoRARequest("q_named", 3, str(q_named))])
        assert llm.llm_engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()
    for adapter, got in zip((fused, qkv_only, None), tokens):
        assert_peft_greedy(base, adapter, prompt, got, MAX_TOKENS, f"phi3 under {adapter}")
    assert len({tuple(t) for t in tokens}) == 3


@pytest.mark.parametrize("tp_size,num_kv_heads", [(1, 2), (2, 2), (4, 2), (4, 1)])
def test_a_fused_projections_adapter_shards_as_its_slices_adapters_sharing_a_do(tp_size, num_kv_heads):
    """(x A^T) [Bq; Bk; Bv]^T is the q, k and v adapters (A, Bq), (A, Bk), (A, Bv): every rank's
    share of an adapter of the fused qkv_proj (gate_up_proj) equals its share of those, KV
    heads replicated where ranks outnumber them."""
    from raylm.kernels.lora_ops import LoRABatch
    from raylm.parallel import MergedColumnParallelLinear, QKVParallelLinear, override_tensor_parallel
    from raylm.parallel.lora_linear import ColumnParallelLinearWithLoRA

    hidden, head_size, num_heads, intermediate, rank = 16, 4, 8, 12, 4
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rank, hidden, generator=generator)
    bq, bk, bv = (torch.randn(n * head_size, rank, generator=generator)
                  for n in (num_heads, num_kv_heads, num_kv_heads))
    b_gate, b_up = torch.randn(intermediate, rank, generator=generator), torch.randn(intermediate, rank,
                                                                                    generator=generator)
    batch = LoRABatch(1, rank, torch.device("cpu"), torch.float32)
    for tp_rank in range(tp_size):
        with override_tensor_parallel(tp_rank, tp_size):
            qkv = ColumnParallelLinearWithLoRA(QKVParallelLinear(hidden, head_size, num_heads, num_kv_heads), batch)
            mlp = ColumnParallelLinearWithLoRA(MergedColumnParallelLinear(hidden, [intermediate] * 2), batch)
        for layer, parts in ((qkv, {"q": bq, "k": bk, "v": bv}), (mlp, {0: b_gate, 1: b_up})):
            fused_a, fused_b = layer.shard_adapter({None: a}, {None: torch.cat(list(parts.values()))}, 2.0)
            split_a, split_b = layer.shard_adapter({s: a for s in parts}, parts, 2.0)
            assert torch.equal(fused_a, split_a)
            assert all(torch.equal(f, s) for f, s in zip(fused_b, split_b)) and len(fused_b) == len(split_b)
