"""GPTQ and AWQ weights (`quantization="gptq"|"awq"`, docs/quantization.md): checkpoints packed
here in each format's bit order generate what Hugging Face generates on a plain fp32
checkpoint of the weights they stand for ((code - zero) * scale, from the codes), in process
and over two tensor-parallel Ray workers. What raylm does not read is an error raised from
config.json alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8_checkpoints import write_config_only
from hf_reference import assert_generation_matches_hf
from int4_checkpoints import (AWQ_ORDER, awq_config, gptq_config, held_tensor_bytes, pack_columns, pack_gptq_rows,
                              write_int4_checkpoint)
from raylm.engine import LLM, SamplingParams
from raylm.executors.model_runner import ModelRunner
from raylm.kernels.int4_linear import (apply_int4_linear, dequantize, native_int4_linear_usable, unpack_columns,
                                       unpack_rows)
from tiny_models import build_tiny_model, random_prompts

MAX_TOKENS = 6
PROMPTS = random_prompts(3, seed=5, min_len=6, max_len=20)
ENGINE = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("int4") / "llama", "llama", seed=13)


def run_checkpoint(tmp_path: Path, source: Path, method: str, tp: int = 1, **options):
    quantized, reference = tmp_path / method, tmp_path / "dequantized"
    tensors = write_int4_checkpoint(source, quantized, reference, method, **options)
    llm = LLM(model=str(quantized), tensor_parallel_size=tp, **ENGINE)
    try:
        assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    except BaseException:
        llm.shutdown()  # the failure's traceback would keep the workers alive
        raise
    return llm, tensors


# ------------------------------------------------------------------ packing
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_unpacking_gives_back_the_packed_codes(bits):
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 2**bits, (32, 24), generator=generator)
    assert torch.equal(unpack_rows(pack_gptq_rows(codes, bits), bits).long(), codes)
    assert torch.equal(unpack_columns(pack_columns(codes, bits), bits).long(), codes)


def test_awq_unpacking_undoes_the_interleaved_nibble_order():
    codes = torch.randint(0, 16, (5, 32), generator=torch.Generator().manual_seed(1))
    packed = pack_columns(codes, 4, AWQ_ORDER)
    # Column 1 of each eight sits in nibble 4 (bits 16-19), as AutoAWQ packs it.
    assert torch.equal((packed[:, 0] >> 16) & 0xF, codes[:, 1].to(torch.int32))
    assert torch.equal(unpack_columns(packed, 4, awq_order=True).long(), codes)
    assert not torch.equal(unpack_columns(packed, 4).long(), codes)


def test_chunked_int4_linear_matches_the_dequantized_weight_product(monkeypatch):
    from raylm.kernels import int4_linear

    monkeypatch.setattr(int4_linear, "_DEQUANT_CHUNK_ELEMENTS", 64 * 16)  # 16-column chunks
    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (64, 40), generator=generator)  # [in, out]
    zeros = torch.randint(0, 16, (4, 40), generator=generator)
    scales = torch.rand(4, 40, generator=generator).half()
    g_idx = (torch.arange(64) // 16)[torch.randperm(64, generator=generator)]
    reference = ((codes - zeros[g_idx]).float() * scales.float()[g_idx]).t()
    x = torch.randn(3, 64, generator=generator)
    qweight, qzeros = pack_gptq_rows(codes, 4), pack_columns(zeros, 4)
    assert torch.equal(dequantize(qweight, qzeros, scales, g_idx, 4, False, 0), reference)
    out = apply_int4_linear(x, qweight, qzeros, scales.float(), g_idx, 4, False, 0)
    torch.testing.assert_close(out, x @ reference.t(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ checkpoints vs HF
@pytest.mark.parametrize("sym,checkpoint_format", [(True, "gptq"), (False, "gptq"), (False, "gptq_v2")])
def test_gptq_checkpoint_matches_hf(tmp_path, source, sym, checkpoint_format):
    llm, _ = run_checkpoint(tmp_path, source, "gptq", sym=sym, checkpoint_format=checkpoint_format)
    qkv = llm.llm_engine.executor.driver_worker.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.int32 and "weight" not in dict(qkv.named_parameters())
    llm.shutdown()


def test_gptq_desc_act_checkpoint_with_shuffled_g_idx_matches_hf(tmp_path, source):
    llm, tensors = run_checkpoint(tmp_path, source, "gptq", desc_act=True)
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
    assert not torch.equal(g_idx, torch.sort(g_idx).values)
    llm.shutdown()


def test_gptq_8_bit_and_one_group_checkpoint_matches_hf(tmp_path, source):
    llm, tensors = run_checkpoint(tmp_path, source, "gptq", bits=8, group_size=-1)
    assert tensors["model.layers.0.mlp.down_proj.scales"].shape == (1, 64)
    llm.shutdown()


def test_awq_checkpoint_matches_hf(tmp_path, source):
    llm, tensors = run_checkpoint(tmp_path, source, "awq")
    assert tensors["model.layers.0.mlp.down_proj.qweight"].shape == (128, 8)
    llm.shutdown()


@pytest.mark.skipif(not native_int4_linear_usable(), reason="the native int4 kernel is not built here")
def test_cpu_int4_layers_hold_their_codes_once_and_a_level_2_sleep_and_reload_gives_hf_again(tmp_path, source,
                                                                                            monkeypatch):
    # The GPU's sleep path walked on the CPU: level 2 frees the parameters and wakes them as
    # zeros; reload_weights gives the freed int4 tensors back, then repacks and frees them.
    monkeypatch.setattr(ModelRunner, "sleep_offload_devices", ("cuda", "cpu"))
    quantized, reference = tmp_path / "gptq", tmp_path / "dequantized"
    write_int4_checkpoint(source, quantized, reference, "gptq", desc_act=True)
    llm = LLM(model=str(quantized), enable_sleep_mode=True, **ENGINE)
    layers = [module for module in llm.llm_engine.executor.driver_worker.model_runner.model.modules()
              if hasattr(module, "cpu_int4_weight")]
    assert len(layers) == 8  # qkv, o, gate_up, down in each of 2 layers

    def assert_codes_held_once() -> None:
        for layer in layers:
            out_features, in_features = layer.weight.shape
            groups = in_features // 32
            # By hand: the 4-bit codes, fp32 scale and zero * scale per group and output, one
            # chunk of 32 rows per group (starts and groups, int32), each row's source row
            # (int64, act order); the loaded qweight (another in * out / 2 bytes) is gone.
            expected = (in_features * out_features // 2 + 2 * groups * out_features * 4 + (2 * groups + 1) * 4
                        + in_features * 8)
            assert held_tensor_bytes(layer) == expected, layer.quant_prefix
            assert layer.qweight.numel() == layer.qzeros.numel() == layer.scales.numel() == 0

    assert_codes_held_once()
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    assert_codes_held_once()
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    llm.shutdown()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_qwen2_checkpoint_with_qkv_bias_matches_hf(tmp_path, method):
    # Qwen2's q/k/v biases stay 16/32-bit tensors beside the packed weights (Qwen2.5-*-GPTQ/AWQ).
    qwen2 = build_tiny_model(tmp_path / "qwen2", "qwen2", seed=17)
    llm, tensors = run_checkpoint(tmp_path, qwen2, method)
    assert tensors["model.layers.0.self_attn.k_proj.bias"].dtype == torch.float32
    llm.shutdown()


@pytest.mark.parametrize("method,options", [("gptq", dict(desc_act=True)), ("awq", {})], ids=["gptq-desc-act", "awq"])
def test_int4_checkpoint_over_two_tensor_parallel_ray_workers_matches_hf(tmp_path, source, ray_cluster, method,
                                                                         options):
    # k and v: 16 output features a rank (two int32s of codes); o_proj's 32 input features
    # a rank are one group of 32.
    llm, _ = run_checkpoint(tmp_path, source, method, tp=2, **options)
    llm.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("method,options", [("gptq", dict(desc_act=True)), ("awq", {})], ids=["gptq-desc-act", "awq"])
def test_int4_checkpoint_on_a_gpu_gives_hf_logprobs_within_bf16_rounding(tmp_path, source, method, options):
    # The same chunked dequantization on CUDA, in bf16: the sampled tokens' logprobs stay
    # within a few hundredths of HF's fp32 ones on the dequantized weights.
    from hf_reference import assert_sampled_logprobs_near_hf

    quantized, reference = tmp_path / method, tmp_path / "dequantized"
    write_int4_checkpoint(source, quantized, reference, method, **options)
    llm = LLM(model=str(quantized), dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_sampled_logprobs_near_hf(reference, PROMPTS, outputs, abs_tol=0.05)
    llm.shutdown()


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("quantization_config,message", [
    ({**gptq_config(3, 128, True, False, "gptq")}, "bits must be 4 or 8"),
    ({**awq_config(128), "bits": 8}, r"\(awq\) bits must be 4"),
    ({**awq_config(128), "version": "gemv"}, "version must be 'gemm'"),
    ({**gptq_config(4, 128, True, False, "gptq_v3")}, "checkpoint_format must be 'gptq' or 'gptq_v2'"),
    ({**gptq_config(4, 0, True, False, "gptq")}, "group_size must be a positive integer or -1"),
], ids=["gptq-3-bit", "awq-8-bit", "awq-gemv", "gptq-unknown-format", "gptq-group-size-0"])
def test_unsupported_gptq_or_awq_config_is_an_error_before_any_weight_is_read(tmp_path, source, quantization_config,
                                                                              message):
    folder = write_config_only(source, tmp_path / "model", quantization_config)  # no weights to read
    with pytest.raises(ValueError, match=message):
        LLM(model=str(folder), **ENGINE)


def test_fused_outputs_with_different_g_idx_are_an_error_naming_the_layer(tmp_path, source):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gptq"
    write_int4_checkpoint(source, folder, tmp_path / "dequantized", "gptq", desc_act=True)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj have different g_idx"):
        LLM(model=str(folder), **ENGINE)


def test_tensor_parallel_size_that_cuts_a_group_is_an_error(tmp_path, source, ray_cluster):
    # o_proj's 64 input features over 2 ranks are 32 a rank: not whole groups of 64.
    folder = tmp_path / "awq"
    write_int4_checkpoint(source, folder, tmp_path / "dequantized", "awq", group_size=64)
    with pytest.raises(Exception, match="not whole groups of the checkpoint's group_size 64"):
        LLM(model=str(folder), tensor_parallel_size=2, **ENGINE)


def _rewrite(folder: Path, mutate) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _set(tensors: dict, name: str, index: tuple, value: float) -> None:
    tensors[name] = tensors[name].clone()
    tensors[name][index] = value


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "-inf"])
def test_int4_scale_that_is_not_finite_is_an_error_naming_the_layer_and_scales(tmp_path, source, method, value):
    folder = tmp_path / method
    write_int4_checkpoint(source, folder, tmp_path / "dequantized", method)
    _rewrite(folder, lambda t: _set(t, "model.layers.1.mlp.down_proj.scales", (1, 3), value))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.scales holds -?(nan|inf) at index "
                                         r"\[1, 3\] .*must be finite"):
        LLM(model=str(folder), **ENGINE)


def test_int4_scales_of_zero_and_below_zero_are_kept_as_the_arithmetic_they_state(tmp_path, source):
    # GPTQ/AWQ writers write positive scales, but (code - zero) * scale is exact for any: a
    # group of 0 (an fp16 underflow) and a negated group still generate HF's tokens.
    quantized, reference = tmp_path / "gptq", tmp_path / "dequantized"
    write_int4_checkpoint(source, quantized, reference, "gptq")
    name = "model.layers.0.mlp.down_proj"

    def scale_groups(tensors: dict, factors: list[float]) -> None:
        tensors[name + ".scales"] = tensors[name + ".scales"].clone()
        for group, factor in enumerate(factors):
            tensors[name + ".scales"][group] *= factor

    _rewrite(quantized, lambda t: scale_groups(t, [0.0, -1.0]))
    # The dequantized weight [out, in]: group 0's input columns zeroed, group 1's negated.
    _rewrite(reference, lambda t: t.__setitem__(name + ".weight", t[name + ".weight"].clone()
                                                  * torch.tensor([0.0] * 32 + [-1.0] * 32 + [1.0] * 64)))
    llm = LLM(model=str(quantized), **ENGINE)
    assert_generation_matches_hf(llm, reference, PROMPTS, MAX_TOKENS)
    llm.shutdown()


@pytest.mark.parametrize("bad", [-1, 4], ids=["negative", "past-the-groups"])
def test_gptq_g_idx_outside_the_groups_is_an_error_naming_g_idx(tmp_path, source, bad):
    # down_proj: 128 inputs in 4 groups of 32 under desc_act.
    folder = tmp_path / "gptq"
    write_int4_checkpoint(source, folder, tmp_path / "dequantized", "gptq", desc_act=True)
    _rewrite(folder, lambda t: _set(t, "model.layers.1.mlp.down_proj.g_idx", (5,), bad))
    with pytest.raises(ValueError, match=rf"model\.layers\.1\.mlp\.down_proj\.g_idx holds {bad} at index 5: .*"
                                         r"\[0, 4\)"):
        LLM(model=str(folder), **ENGINE)
