"""kv_cache_dtype fp8 (vLLM's "fp8", "fp8_e4m3", "fp8_e5m2"): the settings, the KV pool's
size, the per-layer k_scale / v_scale of a checkpoint, the CPU backend's and the Triton
kernels' fp8 paths (interpreted, tests/triton_fp8_cases.py), and the engine against
Hugging Face transformers run with its keys and values put through the same fp8 rounding.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_checks import assert_engine_idle
from fp8_code_points import SWEEP_SCALES, check_kv_write_sweep, check_rotary_write_sweep, code_point_sweep
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
    choices = "auto, fp8, fp8_e4m3, fp8_e5m2"
    with pytest.raises(ValueError, match=rf"kv_cache_dtype must be one of {choices}, got {value!r}"):
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


def test_triton_kv_writes_store_every_fp8_code_point_midpoint_and_limit_as_quantize():
    """tests/triton_fp8_sweep_cases.py: the KV write and the fused rotary write over every
    code point, midpoint (and one ulp either side), subnormal, signed zero, saturating value,
    infinity and NaN, at scales 1, 0.37, 3.1 and 2^-5, bit for bit (tests/fp8_code_points.py)."""
    pytest.importorskip("triton")
    assert_cases_pass_under_the_interpreter("triton_fp8_sweep_cases.py", timeout_s=120)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cpu_kv_writes_store_every_fp8_code_point_midpoint_and_limit_as_worked_out(backend, fp8):
    """The CPU backends' KV write over the same sweep: the bytes the format's code points
    give (tests/fp8_code_points.py, worked out without a cast), which `quantize` gives too."""
    from raylm.kernels.backend import get_attention_backend

    write_kv_cache = get_attention_backend(backend).write_kv_cache
    for scale in SWEEP_SCALES:
        x, expected, left_out = code_point_sweep(fp8, scale)
        assert left_out < len(x) // 4  # most quotients are reached at every scale
        assert torch.equal(quantize(x, fp8, scale).view(torch.uint8), expected)
        rows = x.view(-1, 1, 2)  # sweep lengths are even
        slots = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(len(x)))
        k_cache = torch.full((rows.shape[0], 1, 1, 2), float("nan")).to(fp8)
        v_cache = k_cache.clone()
        write_kv_cache(rows, rows.flip(0) * 2, k_cache, v_cache, slots, k_scale=scale, v_scale=scale * 2)
        assert torch.equal(k_cache.view(torch.uint8).view(-1, 2)[slots].flatten(), expected)
        expected_values = expected.view(-1, 2).flip(0).flatten()
        assert torch.equal(v_cache.view(torch.uint8).view(-1, 2)[slots].flatten(), expected_values)


def test_quantize_saturates_where_a_plain_e5m2_cast_gives_inf():
    x = torch.tensor([500.0, -1e6, 0.3])
    assert quantize(x, E4M3, 1.0).float().tolist() == [448.0, -448.0, 0.3125]
    assert quantize(x, E4M3, 0.5).float().tolist() == [448.0, -448.0, 0.625]
    assert quantize(x, E5M2, 1.0).float().tolist() == [512.0, -57344.0, 0.3125]
    assert torch.isinf(x.to(E5M2).float()[1])  # what saturation avoids


# (cache format, query dtype, num_heads, num_kv_heads, query_lens, seq_lens, padding rows,
# (k_scale, v_scale)): scales that saturate, and powers of two.
CPU_CASES = [
    (E4M3, torch.float32, 8, 2, [1, 1, 1], [1, 40, 97], 2, (0.02, 0.05)),  # decode-only, GQA 4, padding
    (E5M2, torch.bfloat16, 4, 4, [1, 1], [17, 64], 0, (0.0002, 0.0005)),
    (E4M3, torch.bfloat16, 8, 2, [12, 1, 30], [50, 70, 30], 1, (0.02, 0.05)),  # chunk behind context, decode row
    (E5M2, torch.float32, 4, 1, [23, 5], [23, 77], 0, (0.0002, 0.0005)),
    (E4M3, torch.bfloat16, 8, 2, [1, 1, 1], [3, 40, 97], 1, (1 / 32, 1 / 16)),
    (E5M2, torch.bfloat16, 4, 2, [9, 1], [60, 33], 0, (2.0**-12, 2.0**-11)),
]


@pytest.mark.parametrize("fp8,dtype,num_heads,num_kv_heads,query_lens,seq_lens,padding,scales", CPU_CASES)
def test_cpu_backend_writes_and_attends_over_an_fp8_cache_like_the_fp32_reference(fp8, dtype, num_heads,
                                                                                  num_kv_heads, query_lens, seq_lens,
                                                                                  padding, scales):
    """The CPU backend's contract on an fp8 cache: the write stores PyTorch's saturated fp8
    cast of x / scale, attention equals the fp32 reference over the cache's values times
    the scales; scattered blocks of a NaN-poisoned cache."""
    k_scale, v_scale = scales
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
    # fp32: the rounding of sums of values up to ~30 (12 x randn), the scales applied by the
    # kernels to the scores and outputs, by the reference to each element.
    rtol, atol = (1e-5, 5e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(out[:packed].float(), expected[:packed], rtol=rtol, atol=atol)


@pytest.mark.parametrize("fp8,scales", [(E4M3, (0.02, 0.05)), (E5M2, (0.0002, 0.0005))], ids=["e4m3", "e5m2"])
def test_cpu_backend_with_attention_sinks_over_an_fp8_cache_matches_the_fp32_reference(fp8, scales):
    """gpt-oss with kv_cache_dtype fp8: sinks and scales reach both native kernels through the
    backend (prefill rows, decode rows between them, padding), and the reference over the
    fp8 cache, as the fp32 reference over its dequantized values with the same sinks."""
    k_scale, v_scale = scales
    query_lens, seq_lens = [12, 1, 30, 1], [50, 70, 30, 9]
    query, k32, v32, md = build_cached_step(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_size=32,
                                            block_size=8, seed=3, padding_tokens=1)
    k_cache, v_cache = quantize(k32 * 12, fp8, k_scale), quantize(v32 * 12, fp8, v_scale)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4)) * 2
    sinks[0] = 30.0  # far above every score: its head's outputs near 0
    expected = torch_attention.paged_attention(query, dequantize(k_cache, k_scale), dequantize(v_cache, v_scale), md,
                                               0.1, sinks=sinks)
    packed = sum(query_lens)
    for backend in (cpu_attention, torch_attention):
        out = backend.paged_attention(query, k_cache, v_cache, md, 0.1, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        assert torch.equal(out[packed:], torch.zeros_like(out[packed:]))
        torch.testing.assert_close(out[:packed], expected[:packed], rtol=1e-5, atol=5e-5)
    # The sinks matter here: without them the outputs differ.
    without = torch_attention.paged_attention(query, dequantize(k_cache, k_scale), dequantize(v_cache, v_scale), md,
                                              0.1)
    assert (without[:packed] - expected[:packed]).abs().max() > 1e-2


# ---- the engine against Hugging Face ---------------------------------------------------------

@pytest.fixture(scope="module")
def scaled_llama_dir(llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with an fp8 checkpoint's per-layer scales beside its weights, in
    vLLM's spellings (`self_attn.k_proj.k_scale` for layer 0, `self_attn.k_scale` for the
    others), in a safetensors file of their own (which transformers does not read)."""
    path = tmp_path_factory.mktemp("fp8_scales") / "llama"
    shutil.copytree(llama_dir, path)
    scales = {}
    for layer, (k_scale, v_scale) in enumerate(zip(K_SCALES, V_SCALES)):
        stem = f"model.layers.{layer}.self_attn" + (".k_proj" if layer == 0 else "")
        scales[f"{stem}.k_scale"] = torch.tensor(k_scale)
        stem = f"model.layers.{layer}.self_attn" + (".v_proj" if layer == 0 else "")
        scales[f"{stem}.v_scale"] = torch.tensor(v_scale)
    save_file(scales, str(path / "kv_scales.safetensors"))
    return path


@functools.lru_cache(maxsize=2)
def hf_eager_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_log_softmax(model_dir: Path, token_ids: list[int], fp8: torch.dtype | None, k_scales: list[float],
                   v_scales: list[float]) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 log-softmax of HF's Llama (eager attention) over the
    sequence; with `fp8`, every layer's keys (after the rotary embedding) and values pass
    through that fp8 format's rounding with the layer's scale, as an fp8 cache stores them."""
    from transformers.models.llama import modeling_llama

    model = hf_eager_model(str(model_dir))
    eager = modeling_llama.eager_attention_forward

    def rounded(module, query, key, value, *args, **kwargs):
        layer = module.layer_idx
        key = dequantize(quantize(key, fp8, k_scales[layer]), k_scales[layer])
        value = dequantize(quantize(value, fp8, v_scales[layer]), v_scales[layer])
        return eager(module, query, key, value, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        if fp8 is not None:
            patch.setattr(modeling_llama, "eager_attention_forward", rounded)
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def largest_differences(model_dir: Path, outputs, fp8: torch.dtype | None, k_scales: list[float],
                        v_scales: list[float]) -> float:
    """The largest |engine - HF| over every request's prompt logprobs (after the first
    token) and sampled-token logprobs, HF run with `fp8` rounding (None: none)."""
    largest = 0.0
    for output in outputs:
        completion = output.outputs[0]
        tokens = output.prompt_token_ids + completion.token_ids
        engine = [entry[token].logprob for token, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])]
        engine += [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        table = hf_log_softmax(model_dir, tokens, fp8, k_scales, v_scales)
        reference = [table[i - 1, tokens[i]].item() for i in range(1, len(tokens))]
        assert len(engine) == len(reference)
        largest = max(largest, max(abs(a - b) for a, b in zip(engine, reference)))
    return largest


LOGPROBS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, prompt_logprobs=1, ignore_eos=True)
FORMATS = [("fp8", E4M3), ("fp8_e5m2", E5M2)]


@pytest.mark.parametrize("kv_cache_dtype,fp8", FORMATS, ids=["fp8", "fp8_e5m2"])
def test_engine_with_checkpoint_scales_equals_hf_with_keys_and_values_rounded_alike(scaled_llama_dir,
                                                                                    kv_cache_dtype, fp8):
    """The checkpoint's per-layer scales loaded, then the engine's prompt and sampled
    logprobs equal HF's with every key and value put through the same rounding (up to the
    suite's fp32 tolerance; measured 1.4e-6 e4m3, 9.5e-7 e5m2), and not HF's plain ones:
    these scales saturate keys and values (max difference measured 0.24 e4m3, 0.11 e5m2)."""
    llm = LLM(model=str(scaled_llama_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_seqs=8)
    layers = llm.llm_engine.executor.driver_worker.model_runner._attention_layers()
    assert [layer.k_scale for layer in layers] == pytest.approx(K_SCALES)
    assert [layer.v_scale for layer in layers] == pytest.approx(V_SCALES)
    prompts = random_prompts(4, seed=2, min_len=5, max_len=40)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], LOGPROBS, use_tqdm=False)
    assert_engine_idle(llm.llm_engine)
    llm.shutdown()
    assert largest_differences(scaled_llama_dir, outputs, fp8, K_SCALES, V_SCALES) < 1e-4
    assert largest_differences(scaled_llama_dir, outputs, None, K_SCALES, V_SCALES) > 1e-2


# Measured on the tiny Llama (conftest's) with unit scales (no checkpoint scales), these 4
# prompts of 5-40 tokens and 8 sampled each: the fp8 cache's logprobs lie at most 0.064
# (e4m3) and 0.135 (e5m2) from HF's unrounded fp32 ones, where the model-dtype cache's lie
# about 1e-6 away. The bounds leave half as much again.
UNIT_SCALE_BOUNDS = {"fp8": 0.1, "fp8_e5m2": 0.2}


@pytest.mark.parametrize("kv_cache_dtype,fp8", FORMATS, ids=["fp8", "fp8_e5m2"])
def test_engine_with_unit_scales_stays_within_a_measured_bound_of_the_models_dtype_cache(llama_dir,
                                                                                         kv_cache_dtype, fp8):
    llm = LLM(model=str(llama_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_seqs=8)
    layers = llm.llm_engine.executor.driver_worker.model_runner._attention_layers()
    assert {(layer.k_scale, layer.v_scale) for layer in layers} == {(1.0, 1.0)}
    prompts = random_prompts(4, seed=2, min_len=5, max_len=40)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], LOGPROBS, use_tqdm=False)
    llm.shutdown()
    ones = [1.0] * NUM_LAYERS
    assert largest_differences(llama_dir, outputs, fp8, ones, ones) < 1e-4
    assert largest_differences(llama_dir, outputs, None, ones, ones) < UNIT_SCALE_BOUNDS[kv_cache_dtype]


def test_prefix_caching_chunked_prefill_and_preemption_over_an_fp8_cache_keep_hfs_rounded_logprobs(
        scaled_llama_dir):
    """Prompts sharing a 32-token prefix (prefix-cache hits read fp8 blocks another request
    wrote), a 24-token step budget (prompts chunked: later chunks read earlier ones from the
    cache), 20 blocks for 12 requests (preempted and recomputed)."""
    llm = LLM(model=str(scaled_llama_dir), dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks_override=20,
              max_model_len=128, max_num_seqs=12, max_num_batched_tokens=24)
    prefix = random_prompts(1, seed=5, min_len=32, max_len=32)[0]
    prompts = [prefix + tail for tail in random_prompts(12, seed=6, min_len=3, max_len=20)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv_cache_manager.prefix_cache_hits > 0
    assert_engine_idle(engine)
    llm.shutdown()
    assert largest_differences(scaled_llama_dir, outputs, E4M3, K_SCALES, V_SCALES) < 1e-4


def test_a_draft_model_shares_the_fp8_pool_and_keeps_the_targets_greedy_tokens(scaled_llama_dir):
    """Speculative decoding with a draft model (the target's own weights, so that most
    proposals are accepted): the draft's caches are fp8 too, under the same block ids, the
    pool is sized for both, and the tokens are the plain fp8 engine's."""
    prompts = random_prompts(4, seed=8, min_len=5, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for speculative_config in (None, {"model": str(scaled_llama_dir), "num_speculative_tokens": 3}):
        llm = LLM(model=str(scaled_llama_dir), dtype="float32", kv_cache_dtype="fp8", max_num_seqs=8,
                  kv_cache_space=0.001, speculative_config=speculative_config)
        runner = llm.llm_engine.executor.driver_worker.model_runner
        blocks = llm.llm_engine.engine_config.cache_config.num_gpu_blocks
        # 0.001 GiB / (K and V x 2 layers x 16 tokens x 2 heads x 16 dims x 1 byte), halved with the draft's
        assert blocks == int(0.001 * 2**30) // (2 * 2 * 16 * 2 * 16 * (1 if speculative_config is None else 2))
        if speculative_config is not None:
            draft_caches = [layer.kv_cache for layer in runner.draft_runner._attention_layers()]
            assert {cache.dtype for pair in draft_caches for cache in pair} == {E4M3}
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outputs])
        assert_engine_idle(llm.llm_engine)
        llm.shutdown()
    assert tokens[1] == tokens[0]


def test_checkpoint_scales_of_no_attention_layer_or_not_positive_are_errors_naming_them():
    from torch import nn

    from raylm.models.attention import Attention, load_checkpoint_kv_scale

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(4, 16, 0.25, num_kv_heads=2)

    model = nn.Module()
    model.self_attn = Layer()
    assert not load_checkpoint_kv_scale(model, "self_attn.o_proj.weight", torch.ones(1))
    assert load_checkpoint_kv_scale(model, "self_attn.kv_scale", torch.tensor(0.5))  # one scale for both
    assert (model.self_attn.attn.k_scale, model.self_attn.attn.v_scale) == (0.5, 0.5)
    with pytest.raises(ValueError, match="'mlp.k_scale' is a KV-cache scale, but 'mlp' is no attention layer"):
        load_checkpoint_kv_scale(model, "mlp.k_scale", torch.tensor(0.5))
    with pytest.raises(ValueError, match="'self_attn.v_proj.v_scale' must hold positive finite numbers .*got -1.0"):
        load_checkpoint_kv_scale(model, "self_attn.v_proj.v_scale", torch.tensor(-1.0))


@pytest.mark.parametrize("scale,message", [
    (torch.tensor([0.5, -1.0]), "must hold positive finite numbers .*got -1.0"),  # one shard's: max() hid it
    (torch.tensor([0.5, float("nan")]), "must hold positive finite numbers .*got nan"),
    (torch.tensor(2.0 ** -140), "fp32 normal, at least 1.18e-38.*got 7.17"),  # subnormal: 1 / scale is inf
    (torch.empty(0), r"must be a scalar or a list \(one value per tensor-parallel shard or KV head\), got shape \[0\]"),
    (torch.ones(3, 4), r"must be a scalar or a list \(.*\), got shape \[3, 4\]"),
])
def test_a_checkpoint_scale_of_the_wrong_shape_or_with_any_bad_value_is_an_error_naming_the_tensor(scale, message):
    from torch import nn

    from raylm.models.attention import Attention, load_checkpoint_kv_scale

    model = nn.Module()
    model.self_attn = nn.Module()
    model.self_attn.attn = Attention(4, 16, 0.25, num_kv_heads=2)
    with pytest.raises(ValueError, match=f"checkpoint tensor 'self_attn.k_scale' .*{message}"):
        load_checkpoint_kv_scale(model, "self_attn.k_scale", scale)
    assert load_checkpoint_kv_scale(model, "self_attn.k_scale", torch.tensor([[0.25]]))  # one value, any shape
    assert model.self_attn.attn.k_scale == 0.25


# ---- compiled for an H100 ----------------------------------------------------------------------

def _fp8_variants():
    """The fp8 cache's variants at the heaviest shapes (bf16 d256 GQA 8; fp16 d128 GQA 4 over
    e5m2): decode, split-K decode, the largest prefill tile, the KV write; and the rotary
    kernel storing into an fp8 cache."""
    from raylm.cluster.benchmarks.gpu_kernel_check import (FP8_WRITE_POINTER, Variant, elementwise_variants,
                                                           launch_variants)

    for dtype, head_size, group, fp8 in ((torch.bfloat16, 256, 8, E4M3), (torch.float16, 128, 4, E5M2)):
        variants = launch_variants(dtype, group, head_size, max_model_len=4096, kv_cache_dtype=fp8)
        prefills = [v for v in variants if v.name.startswith("prefill")]
        largest_prefill = max(prefills, key=lambda v: v.constexprs["BLOCK_M"])
        for variant in variants:
            if variant.name in ("decode", "decode_split_k", "kv_write") or variant is largest_prefill:
                yield pytest.param(variant, id=f"{variant.name.split()[0]}-{fp8}-{dtype}-d{head_size}".replace(
                    "torch.", ""))
    rotary = next(v for v in elementwise_variants(torch.bfloat16, 64, 128, 128, 64) if v.name.endswith("kv cache"))
    yield pytest.param(Variant(rotary.name, rotary.kernel, dict(rotary.constexprs, KV_FP8=True, FP8_MANT=3,
                                                                FP8_MIN_EXP=-6, FP8_MAX=448.0),
                               rotary.num_warps, rotary.pointer_dtype, fp_fusion=rotary.fp_fusion,
                               cache_pointer_dtype=FP8_WRITE_POINTER), id="rotary-kv-cache-e4m3-bf16-d128")


@pytest.mark.parametrize("variant", list(_fp8_variants()))
def test_fp8_cache_variants_compile_for_sm90_without_spilling(variant):
    """Compiled ahead of time for an H100 (sm_90a) with the ptxas Triton ships, no GPU
    needed (`compile_resources`): the fp8 loads, the upcasts before tl.dot and the KV
    writes' rounding compile, and leave no stack frame."""
    pytest.importorskip("triton")
    from raylm.cluster.benchmarks.gpu_kernel_check import compile_resources

    report = compile_resources(variant)
    assert report["stack_bytes"] == 0 and report["local_bytes"] == 0, report
    assert report["registers"] <= 255


def _fp8_write_variants():
    """The fp8 KV writes as a launch compiles them: the KV write kernel from bf16 and fp32
    activations, the rotary kernel's fused write (with the channels past rotary_dim), into
    e4m3 and e5m2 caches."""
    from raylm.cluster.benchmarks.gpu_kernel_check import (FP8_WRITE_POINTER, Variant, elementwise_variants,
                                                           launch_variants)
    from raylm.kernels.kv_cache_dtype import triton_fp8_format

    for fp8, name in ((E4M3, "e4m3"), (E5M2, "e5m2")):
        for dtype in (torch.bfloat16, torch.float32):
            (kv_write,) = [v for v in launch_variants(dtype, 4, 128, kv_cache_dtype=fp8) if v.name == "kv_write"]
            yield pytest.param(kv_write, id=f"kv_write-{name}-{str(dtype).removeprefix('torch.')}")
        rotary = next(v for v in elementwise_variants(torch.bfloat16, 64, 128, 128, 64) if v.name.endswith("kv cache"))
        yield pytest.param(Variant(rotary.name, rotary.kernel, dict(rotary.constexprs, **triton_fp8_format(fp8)),
                                   rotary.num_warps, rotary.pointer_dtype, fp_fusion=rotary.fp_fusion,
                                   cache_pointer_dtype=FP8_WRITE_POINTER), id=f"rotary-kv-cache-{name}-bf16")


@pytest.mark.parametrize("variant", list(_fp8_write_variants()))
def test_fp8_kv_writes_compile_to_an_exact_division_and_no_fp8_conversion(variant):
    """The sm_90 PTX of the fp8 KV writes (Triton's own compiler, no GPU needed): x / scale
    is div.rn.f32, IEEE's division as PyTorch's reference divides (Triton compiles fp32 `/`
    to div.full.f32, up to 2 ulp off), and no cvt to e4m3x2 / e5m2x2: the bytes are built in
    integers (`fp8_encode`), so they cannot depend on how a Triton version converts to fp8
    (an H100 with Triton 3.6 wrote other e4m3 bytes than PyTorch when the kernels cast)."""
    pytest.importorskip("triton")
    from triton.backends import backends

    from raylm.cluster.benchmarks.gpu_kernel_check import compile_variant, ptx_arithmetic

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    try:
        ptx = compile_variant(variant).asm["ptx"]
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        if "ptxas" not in str(error):
            raise
        pytest.skip(f"this Triton's ptxas cannot compile for sm_90 here: {error}")
    arithmetic = ptx_arithmetic(ptx)
    assert arithmetic == dict(divisions=["div.rn.f32"], fp8_conversions=[]), arithmetic


# ---- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_on_a_gpu_rounds_exactly_as_on_the_cpu(fp8):
    """x / scale exactly, then rounded: PyTorch's CUDA division by a Python scalar multiplies
    by the reciprocal instead, and 2-3 of 4M values landed on the next fp8 step (emulated on
    the CPU with the scales below). Passed on an H100 (9f08493's check)."""
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
    for scale in (2.0 / 448, 3.0 / 448):
        on_gpu = quantize(x.cuda(), fp8, scale).cpu().view(torch.uint8)
        assert torch.equal(on_gpu, quantize(x, fp8, scale).view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_compiled_kv_writes_store_every_fp8_code_point_midpoint_and_limit_as_quantize(fp8):
    """The interpreter's sweep (tests/triton_fp8_sweep_cases.py) natively: the KV write and
    the rotary kernel's fused write, compiled for the GPU, store the bytes worked out from
    the code points at every scale; on failure the message names the first inputs written
    wrong (the e4m3 KV write once differed from PyTorch on an H100 with Triton 3.6)."""
    from raylm.kernels.triton_elementwise import rotary_embedding_
    from raylm.kernels.triton_kv_cache import write_kv_cache

    for scale in SWEEP_SCALES:
        check_kv_write_sweep(write_kv_cache, fp8, scale, torch.device("cuda"))
        check_rotary_write_sweep(rotary_embedding_, fp8, scale, torch.device("cuda"))


@pytest.mark.cuda
def test_cuda_engine_over_an_fp8_e4m3_cache_equals_hf_with_keys_and_values_rounded_alike(scaled_llama_dir):
    """The GPU path end to end (the GPU check's stage t): the compiled fp8 kernels, the
    rotary kernel's fused fp8 KV write, decode steps replayed from CUDA graphs with the
    layers' scales, against HF (CPU, fp32) with every key and value rounded as the cache
    stores them. fp32 activations: the kernels' dots run in fp32, so the bound is the
    suite's fp32 one loosened for the GPU's other summation order."""
    llm = LLM(model=str(scaled_llama_dir), dtype="float32", kv_cache_dtype="fp8", max_num_seqs=8, max_model_len=128)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.device.type == "cuda" and runner.kv_caches[0][0].dtype == E4M3
    prompts = random_prompts(4, seed=2, min_len=5, max_len=40)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], LOGPROBS, use_tqdm=False)
    assert_engine_idle(llm.llm_engine)
    llm.shutdown()
    assert largest_differences(scaled_llama_dir, outputs, E4M3, K_SCALES, V_SCALES) < 1e-3
