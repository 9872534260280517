"""GPTQ and AWQ MoE experts (docs/quantization.md): Mixtral, Qwen3-MoE and Qwen2-MoE
checkpoints whose experts (and dense layers) are packed here in each format's bit order
generate what Hugging Face generates on a plain fp32 checkpoint of the weights they stand for
((code - zero) * scale, computed from the codes in `int4_checkpoints.py`, never from the packed
tensors), in process and over two tensor-parallel Ray workers; the same HF model on the
unquantized weights does not match (so the quantization is what is checked). Each rank's share
of the packed experts (sharded or whole experts) adds up to the PyTorch MoE on the dequantized
weights; malformed tensors are errors naming the layer, the expert and the projection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checks import tensor_parallel_llm
from hf_reference import assert_generation_matches_hf
from int4_checkpoints import AWQ_ORDER, dequantize_codes, pack_columns, pack_gptq_rows, quantize_groups, \
    write_int4_checkpoint
from raylm.engine import LLM
from raylm.kernels import torch_moe
from raylm.models.fused_moe import FusedMoE
from raylm.parallel.int4_linear_method import Int4LinearScheme
from raylm.parallel.int4_moe_method import Int4MoEMethod
from raylm.parallel.parallel_state import override_tensor_parallel
from tiny_models import build_tiny_mixtral, build_tiny_qwen2_moe, build_tiny_qwen3_moe, random_prompts

MAX_TOKENS = 6
PROMPTS = random_prompts(3, seed=7, min_len=6, max_len=20)
ENGINE = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
BUILDERS = {
    "mixtral": lambda path: build_tiny_mixtral(path, seed=40),
    "qwen3_moe": lambda path: build_tiny_qwen3_moe(path, seed=41),
    # every input a multiple of 128 (two groups of the experts): group_size 128 (Qwen3-30B-A3B-GPTQ-Int4's)
    "qwen3_moe_256": lambda path: build_tiny_qwen3_moe(path, seed=42, hidden_size=256, moe_intermediate_size=256),
    # the shared expert's 64 inputs are whole groups of 32
    "qwen2_moe": lambda path: build_tiny_qwen2_moe(path, seed=43, shared_expert_intermediate_size=64),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4_moe")
    return {arch: build(root / arch) for arch, build in BUILDERS.items()}


def checkpoint(tmp_path: Path, source: Path, method: str, **options) -> tuple[Path, Path, dict]:
    quantized, dequantized = tmp_path / method, tmp_path / "dequantized"
    return quantized, dequantized, write_int4_checkpoint(source, quantized, dequantized, method, **options)


def sparse_blocks(llm: LLM) -> list:
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def assert_about_a_quarter_of_bf16_bytes(experts: FusedMoE) -> None:
    # 4-bit codes are a quarter of bf16's bytes (E * 3 * H * I * 2, by hand); zeros, fp32
    # scales of groups of 128 and g_idx add under 3% (hidden and moe intermediate size 256).
    def size(name: str) -> int:
        tensor = getattr(experts, name)
        return tensor.numel() * tensor.element_size()

    bf16_bytes = experts.num_experts * 3 * experts.hidden_size * experts.intermediate_size * 2
    assert (size("w13_qweight") + size("w2_qweight")) * 4 == bf16_bytes
    total = sum(size(f"{p}_{kind}") for p in ("w13", "w2") for kind in ("qweight", "qzeros", "scales", "g_idx"))
    assert 0.25 < total / bf16_bytes < 0.28


# ------------------------------------------------------------------ against HF
def test_mixtral_gptq_experts_match_hf_on_the_dequantized_weights_not_the_original_ones(tmp_path, sources):
    quantized, reference, tensors = checkpoint(tmp_path, sources["mixtral"], "gptq")  # 4-bit, group 32, v1
    assert tensors["model.layers.0.block_sparse_moe.experts.6.w2.qweight"].shape == (96 // 8, 64)
    assert "model.layers.0.block_sparse_moe.gate.qweight" not in tensors  # the router
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    with pytest.raises(AssertionError):  # 4-bit rounding moves the logprobs far beyond 1e-4
        assert_generation_matches_hf(llm, sources["mixtral"], PROMPTS, MAX_TOKENS)
    block = sparse_blocks(llm)[1]
    assert block.experts.w13_qweight.dtype == torch.int32 and block.experts.w13_qweight.shape == (7, 8, 192)
    assert "w13_weight" not in dict(block.experts.named_parameters())
    assert block.gate.weight.dtype == torch.float32 and block.gate.quant_method is None
    llm.shutdown()


@pytest.mark.parametrize("arch,method,options", [
    ("qwen3_moe_256", "gptq", dict(group_size=128, desc_act=True, sym=True)),
    ("qwen3_moe", "gptq", dict(bits=8, group_size=-1, checkpoint_format="gptq_v2")),
    ("mixtral", "awq", dict(group_size=32)),
    ("qwen2_moe", "awq", dict(group_size=32)),
], ids=["qwen3-gptq-desc-act-g128", "qwen3-gptq-8-bit-one-group-v2", "mixtral-awq", "qwen2-awq-shared-expert"])
def test_int4_moe_checkpoint_matches_hf(tmp_path, sources, arch, method, options):
    quantized, reference, tensors = checkpoint(tmp_path, sources[arch], method, **options)
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    block = sparse_blocks(llm)[0]
    if options.get("desc_act"):  # each expert its own act order, gate's and up's shared
        g_idx = tensors["model.layers.0.mlp.experts.3.up_proj.g_idx"]
        assert not torch.equal(g_idx, torch.sort(g_idx).values)
        assert not torch.equal(g_idx, tensors["model.layers.0.mlp.experts.2.up_proj.g_idx"])
        assert torch.equal(block.experts.w13_g_idx[3], g_idx)
        assert_about_a_quarter_of_bf16_bytes(block.experts)
    if arch == "qwen2_moe":  # the shared expert takes the dense path, its gate stays fp32
        assert block.shared_expert.gate_up_proj.qweight.dtype == torch.int32
        assert block.shared_expert_gate.weight.dtype == torch.float32
    llm.shutdown()


def test_int4_moe_over_two_tensor_parallel_ray_workers_matches_hf(request, tmp_path, sources):
    # Each worker's 48 of Mixtral's 96 intermediate features: gate's and up's columns in six
    # int32s of codes, down's rows three whole groups of 16, whose act order refers to any of
    # the six groups (the scales stay whole on each rank).
    quantized, reference, _ = checkpoint(tmp_path, sources["mixtral"], "gptq", group_size=16, desc_act=True)
    with tensor_parallel_llm(request, quantized, 2, **ENGINE) as llm:
        assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)



@pytest.mark.cuda
def test_int4_moe_checkpoint_on_a_gpu_gives_hf_logprobs_within_bf16_rounding(tmp_path, sources):
    # On CUDA every local expert is dequantized in fixed chunks and run by the Triton kernel
    # in bf16: the sampled tokens' logprobs stay within a few hundredths of HF's, up to the
    # first token whose routing HF decides by less than bf16 can tell apart (an H100 run
    # routed one such token, a top-k gap of 0.007 in layer 0, to the other expert: 0.60 off).
    from hf_reference import assert_sampled_logprobs_near_hf, first_routing_near_tie
    from raylm.engine import SamplingParams

    quantized, reference, _ = checkpoint(tmp_path, sources["qwen3_moe_256"], "gptq", group_size=128, desc_act=True)
    llm = LLM(model=str(quantized), dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    top_k = json.loads((reference / "config.json").read_text())["num_experts_per_tok"]
    # 256 random experts: HF's own top-k gaps fall under 0.01 in some prompts already.
    steps = [first_routing_near_tie(reference, p + o.outputs[0].token_ids, top_k, margin=0.01) - (len(p) - 1)
             for p, o in zip(PROMPTS, outputs)]
    assert sum(min(8, max(0, s)) for s in steps) >= 8, steps
    # bf16 alone moved one token 0.052 (the same token on the H100 and in a CPU bf16 run).
    assert_sampled_logprobs_near_hf(reference, PROMPTS, outputs, abs_tol=0.08,
                                    steps_to_check=[max(0, s) for s in steps])

# ------------------------------------------------------------------ two ranks in process
EXPERTS, HIDDEN, INTERMEDIATE = 5, 64, 64


def expert_tensors(method: str, bits: int, group_size: int, desc_act: bool, seed: int = 1):
    """{(expert, shard): checkpoint tensors}, {(expert, shard): fp32 reference [out, in]}:
    each expert's projections quantized here; gate and up share an act order."""
    generator = torch.Generator().manual_seed(seed)
    tensors, reference = {}, {}
    for expert in range(EXPERTS):
        orders = {}
        for shard in ("w1", "w3", "w2"):
            weight = torch.randn((HIDDEN, INTERMEDIATE) if shard == "w2" else (INTERMEDIATE, HIDDEN),
                                 generator=generator)
            in_features = weight.shape[1]
            size = in_features if group_size == -1 else group_size
            g_idx = torch.arange(in_features) // size
            if desc_act:
                key = "down" if shard == "w2" else "gate_up"
                orders.setdefault(key, g_idx[torch.randperm(in_features, generator=generator)])
                g_idx = orders[key]
            codes, zeros, scales = quantize_groups(weight, g_idx, in_features // size, bits, sym=False)
            reference[expert, shard] = dequantize_codes(codes, zeros, scales, g_idx)
            if method == "gptq":
                packed = {"qweight": pack_gptq_rows(codes.t().contiguous(), bits),
                          "qzeros": pack_columns(zeros - 1, bits), "g_idx": g_idx.to(torch.int32)}
            else:
                packed = {"qweight": pack_columns(codes.t().contiguous(), 4, AWQ_ORDER),
                          "qzeros": pack_columns(zeros, 4, AWQ_ORDER)}
            tensors[expert, shard] = {**packed, "scales": scales}
    return tensors, reference


def load_layer(scheme: Int4LinearScheme, tensors: dict, rank: int = 0, world_size: int = 1,
               expert_parallel: bool = False) -> FusedMoE:
    with override_tensor_parallel(rank, world_size, expert_parallel):
        layer = FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, renormalize=True, reduce_results=False)
        Int4MoEMethod(scheme).create_weights(layer, "experts")
    for (expert, shard), kinds in tensors.items():
        for kind, tensor in kinds.items():
            param = getattr(layer, f"{'w2' if shard == 'w2' else 'w13'}_{kind}")
            param.weight_loader(param, tensor, (expert, shard))
    layer.process_weights_after_loading()
    return layer


# (method, bits, group_size, desc_act): each format's cut of scales and zeros.
SHARD_CASES = [("gptq", 4, 32, False), ("gptq", 8, 16, True), ("gptq", 4, -1, False), ("awq", 4, 32, False)]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded", "expert-parallel"])
@pytest.mark.parametrize("method,bits,group_size,desc_act", SHARD_CASES,
                         ids=["gptq-g32", "gptq-8-bit-desc-act", "gptq-one-group", "awq-g32"])
def test_two_ranks_cut_the_packed_experts_and_their_partial_sums_add_up_to_the_reference(
        method, bits, group_size, desc_act, expert_parallel):
    # Sharded, rank r holds intermediate features [32 r, 32 (r + 1)) of all 5 experts; under
    # expert parallelism experts 0-2 and 3-4 whole. The sum of the two ranks' outputs is the
    # PyTorch MoE on the dequantized weights.
    scheme = Int4LinearScheme(method, bits, group_size, desc_act, zero_offset=1 if method == "gptq" else 0)
    tensors, reference = expert_tensors(method, bits, group_size, desc_act)
    w13_ref = torch.stack([torch.cat([reference[e, "w1"], reference[e, "w3"]]) for e in range(EXPERTS)])
    w2_ref = torch.stack([reference[e, "w2"] for e in range(EXPERTS)])
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(2))
    router_logits = torch.randn(11, EXPERTS, generator=torch.Generator().manual_seed(3))
    total = torch.zeros(11, HIDDEN)
    for rank in range(2):
        layer = load_layer(scheme, tensors, rank, 2, expert_parallel)
        assert layer.w13_qweight.dtype == torch.int32
        total += layer(x, router_logits)
    topk_weights, topk_ids = torch_moe.fused_topk(router_logits, 2, renormalize=True)
    torch.testing.assert_close(total, torch_moe.fused_experts(x, w13_ref, w2_ref, topk_weights, topk_ids),
                               rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ errors
def _set(tensors: dict, key: tuple, kind: str, value: torch.Tensor) -> None:
    tensors[key][kind] = value


@pytest.mark.parametrize("mutate,message", [
    (lambda t: _set(t, (3, "w3"), "scales", t[3, "w3"]["scales"][:1]),
     r"experts expert 3 up_proj \(w3\) scales has shape \(1, 64\); .* expects \(2, 64\)"),
    (lambda t: _set(t, (1, "w2"), "qweight", t[1, "w2"]["qweight"].float()),
     r"experts expert 1 down_proj \(w2\) qweight is float32; GPTQ/AWQ/compressed-tensors qweight tensors must be int32"),
    (lambda t: _set(t, (2, "w3"), "g_idx", t[2, "w3"]["g_idx"].flip(0)),
     r"experts expert 2: gate_proj and up_proj have different g_idx"),
    (lambda t: t[4, "w1"]["scales"].__setitem__((1, 5), float("nan")),
     r"experts expert 4 gate_proj \(w1\) scales hold nan at group 1"),
    (lambda t: _set(t, (0, "w2"), "g_idx", torch.full_like(t[0, "w2"]["g_idx"], 7)),
     r"experts expert 0 down_proj \(w2\) g_idx holds 7 at row 0: .* \[0, 2\)"),
    (lambda t: t[3, "w2"].pop("qzeros"), r"lacks 1 expert tensors of a MoE layer: expert 3 w2_qzeros"),
], ids=["scales-shape", "qweight-dtype", "gate-up-g-idx", "nan-scale", "g-idx-range", "missing-qzeros"])
def test_malformed_expert_tensor_is_an_error_naming_the_expert_and_projection(mutate, message):
    tensors, _ = expert_tensors("gptq", 4, 32, desc_act=True)
    mutate(tensors)
    with pytest.raises(ValueError, match=message):
        load_layer(Int4LinearScheme("gptq", 4, 32, desc_act=True, zero_offset=1), tensors)


def test_tensor_parallel_size_that_cuts_a_group_of_down_proj_is_an_error_naming_the_layer():
    # 64 intermediate features on 4 ranks: 16 a rank, not whole groups of 32.
    with override_tensor_parallel(0, 4), pytest.raises(ValueError, match=r"experts \(hidden_size 64, 16 intermediate "
                                                                         r"features on each of 4 .* not whole groups"):
        layer = FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, renormalize=True, reduce_results=False)
        Int4MoEMethod(Int4LinearScheme("gptq", 4, 32)).create_weights(layer, "experts")


def test_expert_checkpoint_tensor_error_names_the_tensor(tmp_path, sources):
    quantized, _, _ = checkpoint(tmp_path, sources["qwen3_moe"], "awq", group_size=16)
    name = "model.layers.2.mlp.experts.4.down_proj.qzeros"
    tensors = load_file(str(quantized / "model.safetensors"))
    tensors[name] = tensors[name][:, :4].contiguous()
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"'{name}'.*expert 4 down_proj \(w2\) qzeros has shape \(3, 4\); .*"
                                         r"expects \(3, 8\)"):
        LLM(model=str(quantized), **ENGINE)


@pytest.mark.parametrize("bits,awq", [(4, False), (8, False), (4, True)], ids=["gptq-4-bit", "gptq-8-bit", "awq"])
def test_byte_unpacking_gives_the_codes_of_the_int32_shifts_that_cuda_runs(monkeypatch, bits, awq):
    from raylm.kernels import int4_fused_moe

    packed = torch.randint(-2**31, 2**31 - 1, (3, 5, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(4))
    by_bytes = int4_fused_moe._unpack_last(packed, bits, awq).long()
    monkeypatch.setattr(int4_fused_moe.sys, "byteorder", "big")  # the path of CUDA and big-endian CPUs
    assert torch.equal(by_bytes, int4_fused_moe._unpack_last(packed, bits, awq).long())
