"""FP8 linear weights (`quantization`, docs/quantization.md): FP8 checkpoints in each layout
vLLM reads, and a 16/32-bit checkpoint quantized at load, generate what Hugging Face
generates on a plain fp32 checkpoint of the weights they stand for (fp8.float() * scale);
in process and over two tensor-parallel Ray workers (MoE experts: tests/test_fp8_moe.py). What raylm does not read is an error
raised from config.json alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_checkpoints import quantize, write_config_only, write_fp8_checkpoint
from hf_reference import assert_generation_matches_hf
from raylm.engine import LLM, SamplingParams
from tiny_models import build_tiny_model, random_prompts

MAX_TOKENS = 8
PROMPTS = random_prompts(4, seed=3, min_len=6, max_len=24)
ENGINE = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fp8") / "llama", "llama", seed=11)


def checkpoint(tmp_path: Path, source: Path, layout: str, **options) -> tuple[Path, Path, dict]:
    quantized, dequantized = tmp_path / "fp8", tmp_path / "dequantized"
    tensors = write_fp8_checkpoint(source, quantized, dequantized, layout, **options)
    return quantized, dequantized, tensors


def driver_model(llm: LLM):
    return llm.llm_engine.executor.driver_worker.model_runner.model


def test_fp8_per_tensor_checkpoint_with_differing_qkv_scales_matches_hf(tmp_path, source):
    # k_proj 8x larger: its scale differs from q_proj's and v_proj's, which qkv_proj fuses.
    quantized, reference, tensors = checkpoint(tmp_path, source, "fp8-tensor", static=True,
                                               weight_multipliers={"k_proj": 8.0})
    prefix = "model.layers.0.self_attn."
    scales = [tensors[prefix + f"{p}_proj.weight_scale"].item() for p in "qkv"]
    assert scales[1] > 4 * max(scales[0], scales[2])
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    qkv = driver_model(llm).model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    assert qkv.weight_scale.tolist() == pytest.approx(scales)  # one scale per shard, none requantized
    assert qkv.input_scale_runtime.item() == max(tensors[prefix + f"{p}_proj.input_scale"].item() for p in "qkv")
    llm.shutdown()


def test_fp8_block_checkpoint_matches_hf(tmp_path, source):
    quantized, reference, tensors = checkpoint(tmp_path, source, "fp8-block", block=(32, 32))
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 4)
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    llm.shutdown()


@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor", "ct-block"])
def test_compressed_tensors_fp8_checkpoint_matches_hf(tmp_path, source, layout):
    quantized, reference, _ = checkpoint(tmp_path, source, layout, static=layout == "ct-tensor",
                                         block=(32, 16) if layout == "ct-block" else None)
    llm = LLM(model=str(quantized), quantization="compressed-tensors", **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    llm.shutdown()


def test_online_fp8_quantizes_each_linear_weight_per_tensor_and_leaves_embeddings_and_lm_head(tmp_path, source):
    # The reference: each linear weight rounded by torch here, amax / 448 per tensor.
    reference = tmp_path / "rounded"
    shutil.copytree(source, reference)
    tensors = load_file(str(source / "model.safetensors"))
    rounded = {name: quantize(t, "tensor")[2] if name.endswith("_proj.weight") else t for name, t in tensors.items()}
    save_file(rounded, str(reference / "model.safetensors"))
    llm = LLM(model=str(source), quantization="fp8", **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    model = driver_model(llm)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    llm.shutdown()


def test_fp8_linear_weights_take_half_the_bytes_of_bf16_ones(source):
    def linear_bytes(llm: LLM) -> int:
        return sum(p.numel() * p.element_size() for name, p in driver_model(llm).named_parameters()
                   if name.endswith("_proj.weight"))

    plain = LLM(model=str(source), dtype="bfloat16", max_model_len=128, num_gpu_blocks_override=16)
    plain_bytes = linear_bytes(plain)
    plain.shutdown()
    fp8 = LLM(model=str(source), dtype="bfloat16", quantization="fp8", max_model_len=128, num_gpu_blocks_override=16)
    assert linear_bytes(fp8) * 2 == plain_bytes
    fp8.shutdown()


@pytest.mark.parametrize("layout,block", [("ct-channel", None), ("fp8-block", (16, 32))])
def test_fp8_checkpoint_over_two_tensor_parallel_ray_workers_matches_hf(tmp_path, source, ray_cluster, layout, block):
    # Column-parallel layers cut channel scales and block rows with their weight's rows,
    # row-parallel ones block columns with their input columns (16-row blocks: 2 per
    # rank's k and v of 16 rows each).
    quantized, reference, _ = checkpoint(tmp_path, source, layout, block=block)
    with LLM(model=str(quantized), tensor_parallel_size=2, **ENGINE) as llm:  # shut down even when it fails
        assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)


def test_serve_flag_quantization_reaches_the_model_config(source):
    from raylm.deploy import cli
    from raylm.engine.arg_utils import EngineArgs

    args = cli.build_parser().parse_args(["serve", str(source), "--quantization", "fp8"])
    assert EngineArgs.from_cli_args(args).create_engine_config().model_config.quantization == "fp8"


@pytest.mark.cuda
def test_fp8_checkpoint_on_a_gpu_gives_hf_logprobs_within_w8a8_rounding(tmp_path, source):
    # W8A8 (compute capability >= 8.9) rounds activations to fp8 too (W8A16 elsewhere). On this
    # tiny random model that alone moves a sampled logprob up to ~0.1 from HF's fp32 one on
    # the dequantized weights (the W8A8 path run on the CPU's torch._scaled_mm: mean 0.03,
    # max 0.10; W8A16 in bf16 0.017 at most), so the bound is on the mean, with a loose one per
    # token; a wrong scale or layout moves them by whole units (the GEMM itself is checked
    # exactly against its reference in test_fp8_linear).
    from hf_reference import assert_sampled_logprobs_near_hf

    quantized, reference, _ = checkpoint(tmp_path, source, "ct-channel")
    llm = LLM(model=str(quantized), dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_sampled_logprobs_near_hf(reference, PROMPTS, outputs, abs_tol=0.25, mean_abs_tol=0.06)
    llm.shutdown()


# ------------------------------------------------------------------ errors
BITSANDBYTES = {"quant_method": "bitsandbytes", "load_in_4bit": True}
# W8A8 integers (int8 weights and activations): compressed-tensors' 'int-quantized' format.
W8A8_INT_COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                        "strategy": "token", "dynamic": True},
                                  "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                              "group_size": None, "dynamic": False}}},
    "ignore": ["lm_head"]}


@pytest.mark.parametrize("quantization_config,quantization,message", [
    (BITSANDBYTES, None, "quant_method 'bitsandbytes'"),
    (W8A8_INT_COMPRESSED_TENSORS, None, "format 'int-quantized'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "compressed-tensors", "does not match"),
    (None, "bitsandbytes", "quantization must be one of 'fp8', 'compressed-tensors'"),
    (None, "compressed-tensors", "needs a checkpoint quantized so"),
], ids=["bitsandbytes", "w8a8-int-compressed-tensors", "mismatch", "unknown-argument", "compressed-tensors-without-config"])
def test_unsupported_quantization_is_an_error_naming_what_is_supported_before_any_weight_is_read(
        tmp_path, source, quantization_config, quantization, message):
    folder = write_config_only(source, tmp_path / "model", quantization_config)  # no weights to read
    with pytest.raises(ValueError, match=message) as error:
        LLM(model=str(folder), quantization=quantization, **ENGINE)
    assert "fp8" in str(error.value)


def test_weight_block_size_that_splits_a_fused_shard_is_an_error_naming_the_layer(tmp_path, source):
    folder = write_config_only(source, tmp_path / "model", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                            "weight_block_size": [48, 48]})
    with pytest.raises(ValueError, match=r"weight_block_size \[48, 48\] does not divide .*qkv_proj"):
        LLM(model=str(folder), **ENGINE)


def test_ignore_list_matches_names_and_regexes_and_a_fused_layer_is_ignored_whole_or_not_at_all():
    from raylm.models.quantization import QuantizationConfig
    from raylm.parallel.fp8_linear_method import Fp8LinearScheme

    config = QuantizationConfig("compressed-tensors", Fp8LinearScheme(True, "channel"),
                                ("lm_head", "re:.*layers\\.1\\.self_attn\\.[qkv]_proj$", "model.layers.0.mlp.up_proj"))
    qkv = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert config.is_ignored("model.layers.1.self_attn.qkv_proj", qkv)
    assert not config.is_ignored("model.layers.2.self_attn.qkv_proj", [n.replace(".1.", ".2.") for n in qkv])
    assert config.is_ignored("lm_head", [])
    with pytest.raises(ValueError, match="fused layer is quantized whole or not at all"):
        config.is_ignored("model.layers.0.mlp.gate_up_proj",
                          ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"])


def _rewrite(folder: Path, mutate) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.01], ids=["nan", "inf", "negative"])
def test_fp8_weight_scale_that_is_not_finite_or_is_negative_is_an_error_naming_the_layer(tmp_path, source, value):
    quantized, _, _ = checkpoint(tmp_path, source, "fp8-tensor")
    _rewrite(quantized, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight_scale", torch.tensor(value)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight_scale holds .* finite"):
        LLM(model=str(quantized), **ENGINE)


def test_fp8_static_input_scale_of_zero_is_an_error_naming_the_layer(tmp_path, source):
    quantized, _, _ = checkpoint(tmp_path, source, "fp8-tensor", static=True)
    _rewrite(quantized, lambda t: t.__setitem__("model.layers.1.mlp.down_proj.input_scale", torch.tensor(0.0)))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.input_scale holds 0\.0 .* > 0"):
        LLM(model=str(quantized), **ENGINE)


def test_fp8_weights_without_a_quantization_config_are_an_error_naming_the_tensor(tmp_path, source):
    quantized, _, _ = checkpoint(tmp_path, source, "fp8-tensor")
    # Stripped of its config and scales, the checkpoint would load its FP8 values unscaled.
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (quantized / "config.json").write_text(json.dumps(config))
    _rewrite(quantized, lambda t: [t.pop(name) for name in [n for n in t if n.endswith("weight_scale")]])
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.\d+\..*\.weight' .* is FP8 \(F8_E4M3\)"):
        LLM(model=str(quantized), **ENGINE)


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.uint8], ids=["e5m2", "uint8"])
def test_fp8_checkpoint_weight_of_another_dtype_is_an_error_naming_the_layer(tmp_path, source, dtype):
    quantized, _, _ = checkpoint(tmp_path, source, "fp8-tensor")
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(quantized, lambda t: t.__setitem__(name, t[name].view(torch.uint8) if dtype == torch.uint8
                                                 else t[name].float().to(dtype)))
    message = r"weight of model\.layers\.0\.mlp\.down_proj is (F8_E5M2|U8); .*float8_e4m3fn"
    with pytest.raises(ValueError, match=message):
        LLM(model=str(quantized), **ENGINE)


def test_fp8_block_scale_of_the_wrong_rank_is_an_error_naming_the_checkpoint_tensor(tmp_path, source):
    quantized, _, _ = checkpoint(tmp_path, source, "fp8-block", block=(16, 16))
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    _rewrite(quantized, lambda t: t.__setitem__(name, t[name].reshape(-1).contiguous()))
    with pytest.raises(ValueError, match=rf"loading checkpoint tensor '{name}'"):
        LLM(model=str(quantized), **ENGINE)


def test_online_fp8_of_a_weight_holding_nan_is_an_error_naming_the_layer(tmp_path, source):
    folder = tmp_path / "nan"
    shutil.copytree(source, folder)
    name = "model.layers.1.self_attn.o_proj.weight"
    _rewrite(folder, lambda t: t[name].__setitem__((3, 5), float("nan")))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight_scale holds nan"):
        LLM(model=str(folder), quantization="fp8", **ENGINE)
