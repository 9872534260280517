"""compressed-tensors' integer weights (`quant_method: "compressed-tensors"`, `format:
"pack-quantized"`: llm-compressor's W4A16 and W8A16; docs/quantization.md): checkpoints packed
here in that format's order generate what Hugging Face generates on a plain fp32 checkpoint
of the weights they stand for ((code - zero) * scale, from the codes), in process and over
two tensor-parallel Ray workers, dense (Llama) and MoE (Mixtral's experts); a wrong tensor
in the same checkpoint no longer does. What
raylm does not read is an error raised from config.json alone.

The format, as compressed-tensors' PackedQuantizationCompressor writes it: `weight_packed`
int32 [out, in / (32 / bits)], code j of int32 c is input column c * (32 / bits) + j, each the
signed code plus 2^(bits - 1); `weight_scale` [out, groups] (channel: [out, 1]);
`weight_zero_point` (asymmetric only) int32 [out / (32 / bits), groups], packed along the
outputs with the same offset; `weight_g_idx` int32 [in] (actorder "group" only);
`weight_shape` [out, in].
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_checkpoints import write_config_only
from hf_reference import assert_generation_matches_hf
from int4_checkpoints import (LINEAR_NAMES, SAME_INPUT, dequantize_codes, pack_columns, quantize_groups,
                              write_checkpoint_pair)
from raylm.engine import LLM
from tiny_models import build_tiny_mixtral, build_tiny_model, random_prompts

MAX_TOKENS = 6
PROMPTS = random_prompts(3, seed=5, min_len=6, max_len=20)
ENGINE = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ct_int") / "llama", "llama", seed=13)


def pack_quantized_config(bits: int = 4, strategy: str = "group", group_size: int | None = 32, symmetric: bool = True,
                          actorder: str | None = None, **weights_extra) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group_size, "actorder": actorder, "dynamic": False, "observer": "minmax",
               **weights_extra}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def write_pack_quantized_checkpoint(source: Path, quantized: Path, dequantized: Path, bits: int = 4,
                                    strategy: str = "group", group_size: int = 32, symmetric: bool = True,
                                    actorder: str | None = None, unquantized: tuple[str, ...] = (),
                                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Writes the pack-quantized checkpoint of `source`'s linear layers into `quantized` and the
    fp32 weights they stand for into `dequantized`; returns the quantized tensors. The modules
    named in `unquantized` stay plain `.weight`s, on the config's ignore list."""
    generator = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    tensors, reference = {}, {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        linear = next((n for n in LINEAR_NAMES if name.endswith(f".{n}.weight")), None)
        if linear is None or name[:-len(".weight")] in unquantized:
            tensors[name] = reference[name] = tensor
            continue
        prefix = name[:-len(".weight")]
        out_features, in_features = tensor.shape
        size = in_features if strategy == "channel" else group_size
        g_idx = torch.arange(in_features) // size
        if actorder == "group":  # groups shuffled over the input features, one order per input
            key = (prefix.rsplit(".", 1)[0], SAME_INPUT[linear])  # per module (attention, MLP, expert)
            orders.setdefault(key, g_idx[torch.randperm(in_features, generator=generator)])
            g_idx = orders[key]
        # codes and zeros in [0, 2^bits): the signed ones plus 2^(bits - 1), as they are stored
        codes, zeros, scales = quantize_groups(tensor, g_idx, in_features // size, bits, symmetric)
        reference[name] = dequantize_codes(codes, zeros, scales, g_idx)
        tensors[prefix + ".weight_packed"] = pack_columns(codes, bits)
        tensors[prefix + ".weight_scale"] = scales.t().contiguous()
        tensors[prefix + ".weight_shape"] = torch.tensor([out_features, in_features])
        if not symmetric:
            tensors[prefix + ".weight_zero_point"] = pack_columns(zeros, bits).t().contiguous()
        if actorder == "group":
            tensors[prefix + ".weight_g_idx"] = g_idx.to(torch.int32)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = pack_quantized_config(bits, strategy, group_size if strategy == "group" else None,
                                                          symmetric, actorder)
    config["quantization_config"]["ignore"] += list(unquantized)
    write_checkpoint_pair(source, (quantized, tensors, config), (dequantized, reference))
    return tensors


def _nibbles_reversed(packed: torch.Tensor) -> torch.Tensor:
    """Each int32's eight 4-bit codes in the opposite order (a packer that got the order wrong)."""
    codes = [(packed >> (4 * k)) & 0xF for k in range(8)]
    out = torch.zeros_like(packed)
    for k, code in enumerate(reversed(codes)):
        out |= code << (4 * k)
    return out


def _zero_points_plus_one(packed: torch.Tensor) -> torch.Tensor:
    codes = [((packed >> (4 * k)) & 0xF) for k in range(8)]
    out = torch.zeros_like(packed)
    for k, code in enumerate(codes):
        out |= ((code + 1) & 0xF) << (4 * k)
    return out


# Each case, and a wrong tensor of it (a packer's mistake) that the comparison with HF must catch.
CASES = {
    "w4-group-sym": (dict(bits=4, symmetric=True),
                     "model.layers.0.mlp.down_proj.weight_packed", _nibbles_reversed),
    "w4-group-asym-actorder-weight": (dict(bits=4, symmetric=False, actorder="weight"),
                                      "model.layers.0.mlp.down_proj.weight_zero_point", _zero_points_plus_one),
    # with one layer left unquantized by the ignore list
    "w8-channel-sym-ignore": (dict(bits=8, strategy="channel", unquantized=("model.layers.1.mlp.down_proj",)),
                       "model.layers.0.mlp.down_proj.weight_scale", lambda scale: scale.flip(0)),
    "w4-group-actorder-group": (dict(bits=4, symmetric=False, actorder="group"),
                                "model.layers.0.mlp.down_proj.weight_g_idx", lambda g_idx: g_idx.sort().values),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pack_quantized_checkpoint_matches_hf_and_a_wrong_tensor_does_not(tmp_path, source, case):
    options, wrong_name, make_wrong = CASES[case]
    quantized, reference = tmp_path / "ct", tmp_path / "dequantized"
    tensors = write_pack_quantized_checkpoint(source, quantized, reference, **options)
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    layers = llm.llm_engine.executor.driver_worker.model_runner.model.model.layers
    down = layers[0].mlp.down_proj
    assert down.weight_packed.dtype == torch.int32 and "weight" not in dict(down.named_parameters())
    assert (layers[1].mlp.down_proj.quant_method is None) == bool(options.get("unquantized"))
    llm.shutdown()

    wrong = make_wrong(tensors[wrong_name])
    assert not torch.equal(wrong, tensors[wrong_name])
    save_file({**tensors, wrong_name: wrong.contiguous()}, str(quantized / "model.safetensors"))
    llm = LLM(model=str(quantized), **ENGINE)
    with pytest.raises(AssertionError):
        assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    llm.shutdown()


def test_pack_quantized_checkpoint_over_two_tensor_parallel_ray_workers_matches_hf(tmp_path, source, ray_cluster):
    # Asymmetric with act order: zero points cut by output columns on column-parallel layers
    # (k and v: 16 output features a rank, two int32s) and whole on row-parallel ones (act
    # order: a rank's input rows refer to any group).
    quantized, reference = tmp_path / "ct", tmp_path / "dequantized"
    write_pack_quantized_checkpoint(source, quantized, reference, bits=4, symmetric=False, actorder="group")
    with LLM(model=str(quantized), tensor_parallel_size=2, **ENGINE) as llm:  # shut down even when it fails
        assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)


@pytest.mark.cuda
def test_pack_quantized_checkpoint_on_a_gpu_gives_hf_logprobs_within_bf16_rounding(tmp_path, source):
    # CUDA's chunked dequantization of the converted tensors, in bf16: the sampled tokens'
    # logprobs stay within a few hundredths of HF's fp32 ones on the dequantized weights.
    from hf_reference import assert_sampled_logprobs_near_hf
    from raylm.engine import SamplingParams

    quantized, reference = tmp_path / "ct", tmp_path / "dequantized"
    write_pack_quantized_checkpoint(source, quantized, reference, bits=4, symmetric=False, actorder="group")
    llm = LLM(model=str(quantized), dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_sampled_logprobs_near_hf(reference, PROMPTS, outputs, abs_tol=0.05)
    llm.shutdown()


# ------------------------------------------------------------------ errors
def _group(**changes) -> dict:
    config = pack_quantized_config()
    group = config["config_groups"]["group_0"]
    for key, value in changes.items():
        if key in group["weights"]:
            group["weights"][key] = value
        else:
            group[key] = value
    return config


@pytest.mark.parametrize("quantization_config,message", [
    (_group(num_bits=3), "num_bits must be 4 or 8 for format 'pack-quantized', got 3"),
    (_group(strategy="tensor"), "strategy must be 'group' or 'channel' for format 'pack-quantized', got 'tensor'"),
    (_group(type="float"), "format 'pack-quantized' with weights type 'float'"),
    (_group(input_activations={"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                               "strategy": "token"}), "not W8A8"),
    (_group(strategy="channel", group_size=None, actorder="group"), "actorder 'group' needs strategy 'group'"),
    (_group(group_size=0), "group_size must be a positive integer or -1"),
    (_group(actorder=["group"]), "actorder must be 'group', 'weight', 'static' or null, got \\['group'\\]"),
    ({**_group(), "format": "int-quantized", "config_groups": {"group_0": {
        **_group()["config_groups"]["group_0"], "format": None}}}, "format 'int-quantized'"),
], ids=["3-bit", "strategy-tensor", "type-float", "w8a8-int", "actorder-channel", "group-size-0", "actorder-list",
    "int-quantized"])
def test_unsupported_pack_quantized_config_is_an_error_before_any_weight_is_read(tmp_path, source,
                                                                                 quantization_config, message):
    folder = write_config_only(source, tmp_path / "model", quantization_config)  # no weights to read
    with pytest.raises(ValueError, match=message):
        LLM(model=str(folder), **ENGINE)


@pytest.mark.parametrize("options", [dict(bits=4, symmetric=False, actorder="group"), dict(bits=8, symmetric=True)],
                         ids=["w4-asym-actorder-group", "w8-sym"])
def test_pack_quantized_mixtral_experts_match_hf(tmp_path, options):
    # The experts (w1/w3 fused into w13, w2) read as GPTQ's, after the same conversion.
    mixtral = build_tiny_mixtral(tmp_path / "mixtral", seed=3)
    quantized, reference = tmp_path / "ct", tmp_path / "dequantized"
    tensors = write_pack_quantized_checkpoint(mixtral, quantized, reference, **options)
    assert "model.layers.0.block_sparse_moe.experts.1.w2.weight_packed" in tensors
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    llm.shutdown()
