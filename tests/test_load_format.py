"""load_format (vLLM's engine argument): "auto" and "safetensors" read the checkpoint,
"dummy" reads none of its tensors and gives every parameter vLLM's dummy values, uniform in
[-1e-3, 1e-3) from a generator seeded 1234 per parameter, on each tensor-parallel rank for
its own shard. The reference is that recipe recomputed here from each parameter's shape;
the folders these tests load hold config.json and the tokenizer but no weights at all."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from engine_checks import assert_engine_idle, tensor_parallel_llm
from tiny_models import build_tiny_mixtral

LOW, HIGH, SEED = -1e-3, 1e-3, 1234
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def weightless_copy(model_dir: Path, out_dir: Path) -> Path:
    """model_dir's config and tokenizer files, without its *.safetensors files."""
    shutil.copytree(model_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not list(out_dir.glob("*.safetensors"))
    return out_dir


@pytest.fixture(scope="module")
def weightless_llama(llama_dir: Path, tmp_path_factory) -> Path:
    return weightless_copy(llama_dir, tmp_path_factory.mktemp("weightless") / "llama")


@pytest.fixture(scope="module")
def weightless_mixtral(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixtral")
    return weightless_copy(build_tiny_mixtral(root / "with_weights"), root / "weightless")


def expected_stats(shape: tuple[int, ...], device: str = "cpu") -> tuple[float, float, float]:
    """Sum, min and max of vLLM's dummy values for a float32 parameter of `shape` on
    `device` (vLLM draws on the parameter's device, from that device's generator: a GPU's
    values are not the CPU's)."""
    generator = torch.Generator(device=device).manual_seed(SEED)
    values = torch.empty(shape, dtype=torch.float32, device=device).uniform_(LOW, HIGH, generator=generator)
    return float(values.double().sum()), float(values.min()), float(values.max())


def assert_dummy_parameters(stats: dict[str, tuple], names: list[str] | None = None, device: str = "cpu") -> None:
    """Each parameter (of `names`, default all) holds the recipe's values for its shape:
    finite, within [LOW, HIGH), and the very values a generator of `device` seeded SEED
    draws."""
    assert stats
    for name in names or list(stats):
        shape, total, smallest, largest = stats[name]
        assert all(math.isfinite(v) for v in (total, smallest, largest)), name
        assert LOW <= smallest and largest < HIGH, (name, smallest, largest)
        assert (total, smallest, largest) == pytest.approx(expected_stats(shape, device), rel=1e-9, abs=1e-12), name


def greedy(llm, max_tokens: int, **kwargs) -> list[list[int]]:
    from raylm.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, **kwargs)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_dummy_engine_loads_no_checkpoint_and_generates_the_requested_tokens(weightless_llama):
    from raylm.engine import LLM

    llm = LLM(model=str(weightless_llama), load_format="dummy", max_model_len=64, num_gpu_blocks_override=32)
    try:
        (stats,) = llm.llm_engine.executor.collective_rpc("parameter_stats")
        assert_dummy_parameters(stats)
        tokens = greedy(llm, max_tokens=7)
        assert [len(t) for t in tokens] == [7, 7]
        assert all(0 <= t < 512 for ids in tokens for t in ids)
        assert greedy(llm, max_tokens=7) == tokens  # deterministic
        assert_engine_idle(llm.llm_engine)
        assert llm.get_tokenizer().decode([5, 6])  # the folder's tokenizer
    finally:
        llm.shutdown()


def test_auto_and_safetensors_read_the_checkpoint_and_fail_without_one(llama_dir, weightless_llama):
    from raylm.engine import LLM

    for load_format in ("auto", "safetensors"):
        with pytest.raises(ValueError, match=r"has no \*\.safetensors files"):
            LLM(model=str(weightless_llama), load_format=load_format, max_model_len=64, num_gpu_blocks_override=32)
    llm = LLM(model=str(llama_dir), load_format="safetensors", max_model_len=64, num_gpu_blocks_override=32)
    try:
        (stats,) = llm.llm_engine.executor.collective_rpc("parameter_stats")
        # The checkpoint's weights (tests/tiny_models.py draws them at a scale of 0.02 and more).
        assert max(largest for _, _, _, largest in stats.values()) > 10 * HIGH
    finally:
        llm.shutdown()


@pytest.mark.parametrize("load_format", ["pt", "gguf", "dumy", ""])
def test_an_unknown_load_format_is_an_error_naming_the_choices(weightless_llama, load_format):
    from raylm.engine import EngineArgs

    with pytest.raises(ValueError, match="load_format must be one of 'auto', 'safetensors', 'dummy'"):
        EngineArgs(model=str(weightless_llama), load_format=load_format).create_engine_config()


def test_the_load_format_flag_takes_the_choices_only():
    import argparse

    from raylm.engine import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--load-format", "dummy"]).load_format == "dummy"
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-format", "pt"])
    assert EngineArgs.from_values({"load_format": "dummy"}).load_format == "dummy"


def test_dummy_weights_under_lora_keep_the_recipe_and_the_adapter_applies(llama_dir, weightless_llama, tmp_path):
    """LoRA wraps the dummy model's layers: their base weights keep the dummy values, the
    adapter's own weights come from its files and change what the model computes."""
    from lora_adapters import write_lora_adapter
    from raylm.engine import LLM, LoRARequest, SamplingParams

    adapter = write_lora_adapter(llama_dir, tmp_path / "adapter", rank=4, std=1.0)
    llm = LLM(model=str(weightless_llama), load_format="dummy", enable_lora=True, max_lora_rank=8,
              max_model_len=64, num_gpu_blocks_override=32)
    try:
        (stats,) = llm.llm_engine.executor.collective_rpc("parameter_stats")
        assert_dummy_parameters(stats, [name for name in stats if "lora" not in name])
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
        prompt = [{"prompt_token_ids": PROMPTS[0]}]
        base = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        adapted = llm.generate(prompt, params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))[0]
        assert len(base.token_ids) == len(adapted.outputs[0].token_ids) == 4
        first_base, first_adapted = base.logprobs[0], adapted.outputs[0].logprobs[0]
        assert first_base[base.token_ids[0]].logprob != first_adapted[adapted.outputs[0].token_ids[0]].logprob
    finally:
        llm.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded experts", "expert parallel"])
def test_tp2_dummy_moe_ranks_each_draw_their_shard_and_generate(request, weightless_mixtral, expert_parallel):
    """Each of the 2 Ray workers gives its own shards (of attention, the LM head, the fused
    experts, or its whole experts) the recipe's values for their shapes, and the engine
    generates the requested tokens."""
    with tensor_parallel_llm(request, weightless_mixtral, 2, load_format="dummy", max_model_len=64,
                             num_gpu_blocks_override=32, enable_expert_parallel=expert_parallel) as llm:
        per_rank = llm.llm_engine.executor.collective_rpc("parameter_stats")
        for stats in per_rank:
            assert_dummy_parameters(stats)
        assert per_rank[0].keys() == per_rank[1].keys()
        if expert_parallel:  # 7 experts: 4 on rank 0, 3 on rank 1
            w2 = next(name for name in per_rank[0] if name.endswith("w2_weight"))
            assert (per_rank[0][w2][0][0], per_rank[1][w2][0][0]) == (4, 3)
        tokens = greedy(llm, max_tokens=5)
        assert [len(t) for t in tokens] == [5, 5]


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3"},
    {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [16, 16]},
], ids=["per-tensor static", "block-wise"])
def test_a_dummy_fp8_checkpoint_draws_positive_scales_and_generates(llama_dir, tmp_path, quantization_config):
    """An FP8 checkpoint's scales drawn as the recipe says would be negative half the time,
    which the loader refuses of a real checkpoint: they take their draw's magnitude."""
    from fp8_checkpoints import write_config_only

    from raylm.engine import LLM

    folder = write_config_only(llama_dir, tmp_path / "fp8", quantization_config)
    llm = LLM(model=str(folder), load_format="dummy", max_model_len=64, num_gpu_blocks_override=32)
    try:
        (stats,) = llm.llm_engine.executor.collective_rpc("parameter_stats")
        scales = {name: s for name, s in stats.items() if "scale" in name.rsplit(".", 1)[-1]}
        assert scales
        for name, (shape, total, smallest, largest) in scales.items():
            drawn = torch.empty(shape).uniform_(LOW, HIGH, generator=torch.Generator().manual_seed(SEED))
            assert smallest > 0 and largest < HIGH, (name, smallest, largest)
            assert total == pytest.approx(float(drawn.abs().double().sum()), rel=1e-6), name
        tokens = greedy(llm, max_tokens=5)
        assert [len(t) for t in tokens] == [5, 5]
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()
