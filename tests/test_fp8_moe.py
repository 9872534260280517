"""FP8 MoE experts (docs/quantization.md): Mixtral, Qwen3-MoE and Qwen2-MoE checkpoints written
in the FP8 layouts vLLM reads, and 16/32-bit ones quantized at load, generate what Hugging Face
generates on a plain fp32 checkpoint of the weights they stand for (fp8.float() * scale); in
process, and over two tensor-parallel Ray workers. The experts
stay fp8 in memory; the fused kernel over dequantized chunks of experts computes what the
PyTorch reference computes on the dequantized weights, and each rank's share of the experts
and their scales (sharded or whole experts) adds up to it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checks import tensor_parallel_llm
from fp8_checkpoints import is_linear_weight, quantize, write_config_only, write_fp8_checkpoint
from hf_reference import assert_generation_matches_hf
from raylm.engine import LLM
from raylm.kernels import cpu_fused_moe, fp8_fused_moe, torch_moe
from raylm.models.fused_moe import FusedMoE
from raylm.parallel.fp8_linear_method import Fp8LinearScheme
from raylm.parallel.fp8_moe_method import Fp8MoEMethod
from raylm.parallel.parallel_state import override_tensor_parallel
from tiny_models import (build_tiny_gpt_oss, build_tiny_mixtral, build_tiny_qwen2_moe, build_tiny_qwen3_moe,
                         random_prompts)

MAX_TOKENS = 8
PROMPTS = random_prompts(4, seed=5, min_len=6, max_len=24)
ENGINE = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
BUILDERS = {"mixtral": lambda path: build_tiny_mixtral(path, seed=30),
            "qwen3_moe": lambda path: build_tiny_qwen3_moe(path, seed=31),
            "qwen2_moe": lambda path: build_tiny_qwen2_moe(path, seed=32)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_moe")
    return {arch: build(root / arch) for arch, build in BUILDERS.items()}


def checkpoint(tmp_path: Path, source: Path, layout: str, **options) -> tuple[Path, Path, dict]:
    quantized, dequantized = tmp_path / "fp8", tmp_path / "dequantized"
    return quantized, dequantized, write_fp8_checkpoint(source, quantized, dequantized, layout, **options)


def sparse_blocks(llm: LLM) -> list:
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _rewrite(folder: Path, mutate) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


# ------------------------------------------------------------------ against HF
def test_mixtral_fp8_per_tensor_checkpoint_with_static_input_scales_matches_hf(tmp_path, sources):
    # w3 4x larger: each expert's up scale differs from its gate's, which w13 fuses.
    quantized, reference, tensors = checkpoint(tmp_path, sources["mixtral"], "fp8-tensor", static=True,
                                               weight_multipliers={".w3.": 4.0})
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    block = sparse_blocks(llm)[1]
    assert block.experts.w13_weight.dtype == block.experts.w2_weight.dtype == torch.float8_e4m3fn
    assert block.gate.weight.dtype == torch.float32 and block.gate.quant_method is None  # the router
    prefix = "model.layers.1.block_sparse_moe.experts.5."
    assert block.experts.w13_weight_scale[5].tolist() == pytest.approx(
        [tensors[prefix + "w1.weight_scale"].item(), tensors[prefix + "w3.weight_scale"].item()])
    assert block.experts.w2_weight_scale[5].item() == pytest.approx(tensors[prefix + "w2.weight_scale"].item())
    llm.shutdown()


def test_qwen3_moe_fp8_block_checkpoint_matches_hf(tmp_path, sources):
    # Qwen3-FP8's layout: weight_scale_inv per [16, 16] block; moe_intermediate_size 48.
    quantized, reference, tensors = checkpoint(tmp_path, sources["qwen3_moe"], "fp8-block", block=(16, 16))
    assert tensors["model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"].shape == (4, 3)
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    assert sparse_blocks(llm)[0].experts.w13_weight_scale_inv.shape == (5, 6, 4)
    llm.shutdown()


@pytest.mark.parametrize("arch,layout,static", [("qwen2_moe", "ct-channel", True), ("mixtral", "ct-tensor", False)])
def test_compressed_tensors_fp8_moe_checkpoint_matches_hf(tmp_path, sources, arch, layout, static):
    # Qwen2-MoE's shared expert takes the dense FP8 path, its shared_expert_gate stays fp32.
    quantized, reference, _ = checkpoint(tmp_path, sources[arch], layout, static=static)
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    block = sparse_blocks(llm)[0]
    if static:  # one per expert and projection, read and checked (the experts compute W8A16)
        assert block.experts.w13_input_scale.shape == (7, 2) and block.experts.w2_input_scale.shape == (7, 1)
    if arch == "qwen2_moe":
        assert block.shared_expert.gate_up_proj.weight.dtype == torch.float8_e4m3fn
        assert block.shared_expert_gate.weight.dtype == torch.float32
    llm.shutdown()


def test_online_fp8_quantizes_each_expert_tensor_per_tensor_and_leaves_the_router(tmp_path, sources):
    # The reference: every linear and expert weight rounded by torch here, amax / 448 per
    # checkpoint tensor; the router (mlp.gate) as it is.
    source, reference = sources["qwen3_moe"], tmp_path / "rounded"
    shutil.copytree(source, reference)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({name: quantize(t, "tensor")[2] if is_linear_weight(name) else t for name, t in tensors.items()},
              str(reference / "model.safetensors"))
    llm = LLM(model=str(source), quantization="fp8", **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    block = sparse_blocks(llm)[0]
    assert block.experts.w2_weight.dtype == torch.float8_e4m3fn and block.gate.weight.dtype == torch.float32
    expected = tensors["model.layers.0.mlp.experts.3.up_proj.weight"].abs().amax() / 448
    assert block.experts.w13_weight_scale[3, 1].item() == pytest.approx(expected.item())
    llm.shutdown()


def test_online_fp8_gpt_oss_quantizes_each_expert_projection_and_keeps_its_biases(tmp_path):
    # gpt-oss stores its experts stacked: gate_up_proj [E, H, 2I] (gate the even columns, up
    # the odd ones) and down_proj [E, I, H]; each expert's gate, up and down get a scale.
    source = build_tiny_gpt_oss(tmp_path / "gpt_oss", seed=3)
    reference = tmp_path / "rounded"
    shutil.copytree(source, reference)

    def rounded(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("experts.gate_up_proj"):
            tensor = tensor.clone()
            for expert in tensor:
                for columns in (slice(0, None, 2), slice(1, None, 2)):
                    expert[:, columns] = quantize(expert[:, columns].t(), "tensor")[2].t()
            return tensor
        if name.endswith("experts.down_proj"):
            return torch.stack([quantize(expert.t(), "tensor")[2].t() for expert in tensor]).contiguous()
        return quantize(tensor, "tensor")[2] if is_linear_weight(name) else tensor

    save_file({name: rounded(name, t) for name, t in load_file(str(source / "model.safetensors")).items()},
              str(reference / "model.safetensors"))
    llm = LLM(model=str(source), quantization="fp8", **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    mlp = llm.llm_engine.executor.driver_worker.model_runner.model.model.layers[0].mlp
    assert mlp.experts.w13_weight.dtype == torch.float8_e4m3fn and mlp.router.weight.dtype == torch.float32
    llm.shutdown()


def test_fp8_experts_take_half_the_bytes_of_bf16_ones(sources):
    def expert_bytes(llm: LLM) -> int:
        return sum(p.numel() * p.element_size() for block in sparse_blocks(llm)
                   for p in (block.experts.w13_weight, block.experts.w2_weight))

    plain = LLM(model=str(sources["mixtral"]), dtype="bfloat16", max_model_len=128, num_gpu_blocks_override=16)
    plain_bytes = expert_bytes(plain)
    plain.shutdown()
    fp8 = LLM(model=str(sources["mixtral"]), dtype="bfloat16", quantization="fp8", max_model_len=128,
              num_gpu_blocks_override=16)
    assert expert_bytes(fp8) * 2 == plain_bytes
    fp8.shutdown()


def test_fp8_moe_over_two_tensor_parallel_ray_workers_matches_hf(request, tmp_path, sources):
    # Each worker's 48 of Mixtral's 96 intermediate features are 3 whole 16-row blocks of
    # gate and of up, and 3 block columns of down.
    quantized, reference, _ = checkpoint(tmp_path, sources["mixtral"], "fp8-block", block=(16, 16))
    with tensor_parallel_llm(request, quantized, 2, **ENGINE) as llm:
        assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)


# (strategy, block, checkpoint_is_fp8): every layout's scales, and online quantization.
SHARD_CASES = [("tensor", None, True), ("channel", None, True), ("block", (16, 16), True), ("tensor", None, False)]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded", "expert-parallel"])
@pytest.mark.parametrize("strategy,block,fp8_checkpoint", SHARD_CASES,
                         ids=["tensor", "channel", "block", "online"])
def test_two_ranks_cut_the_scales_with_the_experts_and_their_partial_sums_add_up_to_the_reference(
        strategy, block, fp8_checkpoint, expert_parallel):
    # Each rank's layer built and loaded in this process (no collectives): sharded, rank r
    # holds intermediate features [48 r, 48 (r + 1)) of all 5 experts; under expert
    # parallelism experts 0-2 and 3-4 whole. The sum of the two ranks' outputs is the
    # reference MoE on the dequantized weights.
    torch.manual_seed(1)
    experts, hidden, intermediate = 5, 64, 96
    scheme = Fp8LinearScheme(fp8_checkpoint, strategy, block, "dynamic",
                             "weight_scale_inv" if strategy == "block" else "weight_scale")
    full = {(e, shard): torch.randn((hidden, intermediate) if shard == "w2" else (intermediate, hidden))
            for e in range(experts) for shard in ("w1", "w2", "w3")}
    quantized = {key: quantize(weight, strategy, block) for key, weight in full.items()}
    w13_ref = torch.stack([torch.cat([quantized[e, "w1"][2], quantized[e, "w3"][2]]) for e in range(experts)])
    w2_ref = torch.stack([quantized[e, "w2"][2] for e in range(experts)])
    x = torch.randn(11, hidden)
    router_logits = torch.randn(11, experts)
    total = torch.zeros(11, hidden)
    for rank in range(2):
        with override_tensor_parallel(rank, 2, expert_parallel):
            layer = FusedMoE(experts, 2, hidden, intermediate, renormalize=True, reduce_results=False)
        Fp8MoEMethod(scheme).create_weights(layer, "experts")
        for (expert, shard), (q, scale, _) in quantized.items():
            projection = "w2" if shard == "w2" else "w13"
            weight = getattr(layer, f"{projection}_weight")
            weight.weight_loader(weight, q if fp8_checkpoint else full[expert, shard], (expert, shard))
            if fp8_checkpoint:
                scales = getattr(layer, f"{projection}_{scheme.scale_name}")
                scales.weight_loader(scales, scale, (expert, shard))
        layer.process_weights_after_loading()
        assert layer.w13_weight.dtype == torch.float8_e4m3fn
        total += layer(x, router_logits)
    topk_weights, topk_ids = torch_moe.fused_topk(router_logits, 2, renormalize=True)
    torch.testing.assert_close(total, torch_moe.fused_experts(x, w13_ref, w2_ref, topk_weights, topk_ids),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_fp8_moe_checkpoint_on_a_gpu_gives_hf_logprobs_within_bf16_rounding(tmp_path, sources):
    # On CUDA every local expert is dequantized in fixed chunks and run by the Triton kernel
    # in bf16: the sampled tokens' logprobs stay within a few hundredths of HF's.
    from hf_reference import assert_sampled_logprobs_near_hf
    from raylm.engine import SamplingParams

    quantized, reference, _ = checkpoint(tmp_path, sources["qwen3_moe"], "fp8-block", block=(16, 16))
    llm = LLM(model=str(quantized), dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_sampled_logprobs_near_hf(reference, PROMPTS, outputs, abs_tol=0.05)
    llm.shutdown()


# ------------------------------------------------------------------ the kernel
@pytest.mark.parametrize("every_expert", [False, True], ids=["routed-experts", "every-expert"])
@pytest.mark.parametrize("block", [None, (16, 32)], ids=["per-row", "block"])
def test_fp8_fused_experts_in_chunks_equal_the_reference_on_dequantized_weights(block, every_expert):
    # 6 experts, this rank holding experts 2-4 (expert parallelism), one expert per chunk:
    # those some token is routed to (the CPU's choice), or all three (CUDA's).
    torch.manual_seed(0)
    hidden, intermediate, experts, first = 64, 48, 6, 2
    strategy = "block" if block else "channel"
    w13, w13_scale, w13_ref, w2, w2_scale, w2_ref = [], [], [], [], [], []
    for _ in range(3):
        q, scale, ref = quantize(torch.randn(2 * intermediate, hidden), strategy, block)
        w13.append(q), w13_scale.append(scale if block else scale.squeeze(1)), w13_ref.append(ref)
        q, scale, ref = quantize(torch.randn(hidden, intermediate), strategy, block)
        w2.append(q), w2_scale.append(scale if block else scale.squeeze(1)), w2_ref.append(ref)
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[first:first + 3] = torch.arange(3, dtype=torch.int32)
    x = torch.randn(9, hidden)
    topk_weights, topk_ids = torch_moe.fused_topk(torch.randn(9, experts), 2, renormalize=True)
    routed = torch.arange(3) if every_expert else fp8_fused_moe.routed_local_experts(topk_ids, expert_map)
    chunks = [(chunk, fp8_fused_moe.chunk_expert_map(experts, first, chunk))
              for chunk in fp8_fused_moe.expert_chunks(routed, bytes_per_expert=1, chunk_bytes=1)]
    assert len(chunks) == routed.numel() >= 2
    out = fp8_fused_moe.fp8_fused_experts(
        lambda *args: cpu_fused_moe.fused_experts(*args[:6], w13_bias=args[6], w2_bias=args[7]), x, topk_weights,
        topk_ids, chunks, torch.stack(w13), torch.stack(w13_scale), torch.stack(w2), torch.stack(w2_scale), block)
    expected = torch_moe.fused_experts(x, torch.stack(w13_ref), torch.stack(w2_ref), topk_weights, topk_ids,
                                       expert_map)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("name,value,message", [
    ("model.layers.0.block_sparse_moe.experts.3.w3.weight_scale", float("nan"), r"expert 3 w3 weight_scale holds nan"),
    ("model.layers.1.block_sparse_moe.experts.0.w2.input_scale", 0.0, r"expert 0 w2 input_scale holds 0\.0 .* > 0"),
], ids=["nan-weight-scale", "zero-input-scale"])
def test_bad_expert_scale_is_an_error_naming_the_checkpoint_tensor(tmp_path, sources, name, value, message):
    quantized, _, _ = checkpoint(tmp_path, sources["mixtral"], "fp8-tensor", static=True)
    _rewrite(quantized, lambda t: t.__setitem__(name, torch.tensor(value)))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}'.*{message}"):
        LLM(model=str(quantized), **ENGINE)


def test_negative_expert_block_scale_is_an_error_naming_the_tensor_and_index(tmp_path, sources):
    quantized, _, _ = checkpoint(tmp_path, sources["qwen3_moe"], "fp8-block", block=(16, 16))
    name = "model.layers.2.mlp.experts.4.down_proj.weight_scale_inv"
    _rewrite(quantized, lambda t: t[name].__setitem__((1, 2), -0.5))
    with pytest.raises(ValueError, match=rf"'{name}'.*holds -0\.5 at index \[1, 2\].*finite and >= 0"):
        LLM(model=str(quantized), **ENGINE)


def test_expert_block_scale_of_the_wrong_shape_is_an_error_naming_the_tensor(tmp_path, sources):
    quantized, _, _ = checkpoint(tmp_path, sources["qwen3_moe"], "fp8-block", block=(16, 16))
    name = "model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv"
    _rewrite(quantized, lambda t: t.__setitem__(name, t[name][:2].contiguous()))
    with pytest.raises(ValueError, match=rf"'{name}'.*shape \(2, 4\), .* expects \(3, 4\)"):
        LLM(model=str(quantized), **ENGINE)


def test_missing_expert_scale_is_an_error_naming_the_expert(tmp_path, sources):
    quantized, _, _ = checkpoint(tmp_path, sources["mixtral"], "fp8-tensor")
    _rewrite(quantized, lambda t: t.pop("model.layers.0.block_sparse_moe.experts.6.w1.weight_scale"))
    with pytest.raises(ValueError, match="lacks 1 expert tensors of a MoE layer: expert 6 w1_weight_scale"):
        LLM(model=str(quantized), **ENGINE)


def test_expert_weight_of_another_dtype_is_an_error_naming_the_expert(tmp_path, sources):
    quantized, _, _ = checkpoint(tmp_path, sources["mixtral"], "fp8-tensor")
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    _rewrite(quantized, lambda t: t.__setitem__(name, t[name].float().to(torch.float8_e5m2)))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts expert 2 w2 is F8_E5M2; .*float8_e4m3fn"):
        LLM(model=str(quantized), **ENGINE)


def test_weight_block_size_that_splits_the_expert_intermediate_size_is_an_error_naming_the_layer(tmp_path, sources):
    # moe_intermediate_size 48: gate's rows end inside the second 32-row block.
    folder = write_config_only(sources["qwen3_moe"], tmp_path / "model",
                               {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]})
    with pytest.raises(ValueError, match=r"weight_block_size \[32, 32\] does not divide .*"
                                         r"model\.layers\.0\.mlp\.experts \(48 features"):
        LLM(model=str(folder), **ENGINE)

