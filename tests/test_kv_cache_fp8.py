"""kv_cache_dtype fp8 (vLLM's "fp8", "fp8_e4m3", "fp8_e5m2"): the settings, the KV pool's
size, the per-layer k_scale / v_scale of a checkpoint, the CPU backend's and the Triton
kernels' fp8 paths (interpreted, tests/triton_fp8_cases.py), and the engine against
Hugging Face transformers run with its keys and values put through the same fp8 rounding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_checks import assert_engine_idle
from paged_steps import build_cached_step
from raylm.engine import LLM, EngineArgs, SamplingParams
from raylm.kernels import cpu_attention, torch_attention
from raylm.kernels.kv_cache_dtype import dequantize, quantize
from tiny_models import random_prompts
from triton_interpreter import assert_cases_pass_under_the_interpreter

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NUM_LAYERS = 2  # tiny_models' Llama
# The checkpoint's scales per layer: small enough that some keys and values of the tiny
# model pass 448 * scale and saturate (see test_checkpoint_scales_make_saturation_matter).
K_SCALES = [0.004, 0.006]
V_SCALES = [0.003, 0.005]


# ---- settings and sizing ---------------------------------------------------------------------

@pytest.mark.parametrize("value", ["fp8_e4m3fn", "int8", "FP8", ""])
def test_unknown_kv_cache_dtype_is_an_error_naming_the_value_and_the_choices(llama_dir, value):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got {value!r}"):
        EngineArgs(model=str(llama_dir), kv_cache_dtype=value).create_engine_config()


def test_cli_flag_takes_vllms_choices_only():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp16"])


def test_calculate_kv_scales_is_refused_with_what_raylm_does_instead(llama_dir):
    with pytest.raises(ValueError, match="calculate_kv_scales=True is not supported.*checkpoint, else 1.0"):
        EngineArgs(model=str(llama_dir), kv_cache_dtype="fp8", calculate_kv_scales=True).create_engine_config()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_cache_gets_twice_the_blocks_of_a_16_bit_one_in_the_same_memory(llama_dir, kv_cache_dtype):
    blocks = {}
    for cache in ("auto", kv_cache_dtype):
        llm = LLM(model=str(llama_dir), dtype="bfloat16", kv_cache_space=0.001, kv_cache_dtype=cache)
        blocks[cache] = llm.llm_engine.engine_config.cache_config.num_gpu_blocks
        runner = llm.llm_engine.executor.driver_worker.model_runner
        k_cache = runner.kv_caches[0][0]
        # 0.001 GiB / (2 layers x K and V x 16 tokens x 2 heads x 16 dims x bytes an element)
        assert k_cache.shape[0] == blocks[cache] == int(0.001 * 2**30) // (2 * 2 * 16 * 2 * 16 * k_cache.element_size())
        llm.shutdown()
    assert k_cache.dtype == (E4M3 if kv_cache_dtype == "fp8" else E5M2)
    assert blocks[kv_cache_dtype] == 2 * blocks["auto"]


# ---- kernels ---------------------------------------------------------------------------------

def test_triton_kernels_over_fp8_caches_match_the_reference_under_the_interpreter():
    """tests/triton_fp8_cases.py: the KV write and the fused rotary write bit-exact against
    PyTorch's fp8 cast, decode (split-K too) and prefill/extend against the fp32 reference."""
    pytest.importorskip("triton")
    assert_cases_pass_under_the_interpreter("triton_fp8_cases.py", timeout_s=300)


def test_quantize_saturates_where_a_plain_e5m2_cast_gives_inf():
    x = torch.tensor([500.0, -1e6, 0.3])
    assert quantize(x, E4M3, 1.0).float().tolist() == [448.0, -448.0, 0.3125]
    assert quantize(x, E4M3, 0.5).float().tolist() == [448.0, -448.0, 0.625]
    assert quantize(x, E5M2, 1.0).float().tolist() == [512.0, -57344.0, 0.3125]
    assert torch.isinf(x.to(E5M2).float()[1])  # what saturation avoids


# (cache format, query dtype, num_heads, num_kv_heads, query_lens, seq_lens, padding rows)
CPU_CASES = [
    (E4M3, torch.float32, 8, 2, [1, 1, 1], [1, 40, 97], 2),     # decode-only, GQA 4, padding
    (E5M2, torch.bfloat16, 4, 4, [1, 1], [17, 64], 0),
    (E4M3, torch.bfloat16, 8, 2, [12, 1, 30], [50, 70, 30], 1),  # chunk behind context, decode row, prompt
    (E5M2, torch.float32, 4, 1, [23, 5], [23, 77], 0),
]


@pytest.mark.parametrize("fp8,dtype,num_heads,num_kv_heads,query_lens,seq_lens,padding", CPU_CASES)
def test_cpu_backend_writes_and_attends_over_an_fp8_cache_like_the_fp32_reference(fp8, dtype, num_heads,
                                                                                  num_kv_heads, query_lens, seq_lens,
                                                                                  padding):
    """The CPU backend's contract on an fp8 cache: the write stores PyTorch's saturated fp8
    cast of x / scale, attention equals the fp32 reference over the cache's values times
    the scales; scattered blocks of a NaN-poisoned cache."""
    k_scale, v_scale = (0.02, 0.05) if fp8 == E4M3 else (0.0002, 0.0005)
    query, k32, v32, md = build_cached_step(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                            head_size=32, block_size=8, seed=sum(seq_lens), padding_tokens=padding)
    # The context in the cache already, scaled so that some of it saturates; then this
    # step's tokens (the last query_len of each sequence) written through the backend.
    k_cache, v_cache = quantize(k32 * 12, fp8, k_scale), quantize(v32 * 12, fp8, v_scale)
    assert (k_cache.float().abs() == torch.finfo(fp8).max).any()
    slots = []
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        for t in range(seq_len - query_len, seq_len):
            slots.append(md.block_tables[i, t // 8].item() * 8 + t % 8)
    md.slot_mapping = torch.tensor(slots + [-1] * padding)
    new_keys = torch.randn(len(slots) + padding, num_kv_heads, 32).to(dtype) * 3
    new_values = torch.randn(len(slots) + padding, num_kv_heads, 32).to(dtype) * 3
    expected_k, expected_v = k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone()
    expected_k.view(-1, num_kv_heads, 32)[slots] = quantize(new_keys[:len(slots)], fp8, k_scale).view(torch.uint8)
    expected_v.view(-1, num_kv_heads, 32)[slots] = quantize(new_values[:len(slots)], fp8, v_scale).view(torch.uint8)

    cpu_attention.write_kv_cache(new_keys, new_values, k_cache, v_cache, md.slot_mapping, k_scale=k_scale,
                                 v_scale=v_scale)
    assert torch.equal(k_cache.view(torch.uint8), expected_k) and torch.equal(v_cache.view(torch.uint8), expected_v)
    query = query.to(dtype)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.1, k_scale=k_scale, v_scale=v_scale)
    expected = torch_attention.paged_attention(query.float(), dequantize(k_cache, k_scale),
                                               dequantize(v_cache, v_scale), md, 0.1)
    packed = sum(query_lens)
    assert out.dtype == dtype and torch.equal(out[packed:], torch.zeros_like(out[packed:]))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[:packed].float(), expected[:packed], rtol=tolerance, atol=tolerance)
