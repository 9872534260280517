"""The Triton kernels over an fp8 KV cache (kv_cache_dtype fp8_e4m3 / fp8_e5m2) under
Triton's interpreter, on the CPU. Not collected by the suite: `tests/test_kv_cache_fp8.py`
runs this file in a pytest subprocess with TRITON_INTERPRET=1 (see
tests/triton_interpreter_cases.py for why).

The references are independent of the fp8 code in the kernels and in torch_attention: the
KV write must store, bit for bit, what `kv_cache_dtype.quantize` (PyTorch's own fp8 cast of
x / scale, saturated) stores; attention must equal the fp32 reference run on the fp8
cache's values times the scales (an fp32 cache holding the same rounded K and V). Scales
other than 1 with values large enough that x / scale passes the format's largest value make
the saturation matter. Caches are NaN-poisoned (NaN survives the fp8 cast), so a slot read
that should not be fails the comparison.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from paged_steps import build_cached_step
from raylm.kernels import torch_attention as reference
from triton_interpreter_cases import TOLERANCE, relative_error
from raylm.kernels.kv_cache_dtype import dequantize, quantize

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only (tests/test_kv_cache_fp8.py starts it)", allow_module_level=True)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KERNEL_MODULES = ("raylm.kernels.triton_kv_cache", "raylm.kernels.triton_decode_attention",
                  "raylm.kernels.triton_prefill_attention", "raylm.kernels.triton_elementwise")
# TOLERANCE (max |kernel - reference| / max |reference|) is the bf16/fp16 cache's: the dots'
# operands are the query's dtype.
# (scale, magnitude of the values): per format, one scale of 1 and one whose x / scale
# saturates a share of the values (e4m3 at 448, e5m2 at 57344).
SCALES = {E4M3: [(1.0, 1.0), (0.25, 60.0)], E5M2: [(1.0, 1.0), (0.004, 120.0)]}


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    return {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in KERNEL_MODULES}


def fp8_step(query_lens, seq_lens, *, fp8, dtype, k_scale, v_scale, magnitude, num_heads=8, num_kv_heads=2,
             head_size=64, block_size=16, seed=0, padding_tokens=0):
    """A step whose context sits quantized in NaN-poisoned fp8 caches at shuffled blocks:
    (query in `dtype`, k_cache, v_cache, metadata, the expected output from the fp32
    reference over the dequantized caches)."""
    query, k32, v32, md = build_cached_step(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                            head_size=head_size, block_size=block_size, dtype=torch.float32,
                                            seed=seed, padding_tokens=padding_tokens)
    k_cache, v_cache = quantize(k32 * magnitude, fp8, k_scale), quantize(v32 * magnitude, fp8, v_scale)
    query = query.to(dtype)
    assert k_cache.float().isnan().any()  # the poison survived
    return query, k_cache, v_cache, md


def expected_attention(query, k_cache, v_cache, md, scale, k_scale, v_scale, **layer):
    return reference.paged_attention(query.float(), dequantize(k_cache, k_scale), dequantize(v_cache, v_scale), md,
                                     scale, **layer)


def assert_saturates(k_cache: torch.Tensor, fp8: torch.dtype, k_scale: float, magnitude: float) -> None:
    """The large-magnitude cases put values at the format's limit (what makes saturation matter)."""
    if magnitude > 1.0:
        assert (k_cache.float().abs() == torch.finfo(fp8).max).any()


# ---- KV write ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_stores_exactly_the_saturated_rounded_values_and_skips_padding(kernels, fp8, dtype):
    for k_scale, magnitude in SCALES[fp8]:
        v_scale = k_scale * 1.5
        gen = torch.Generator().manual_seed(int(k_scale * 1000))
        num_blocks, block_size, num_kv_heads, head_size, num_tokens = 8, 8, 2, 64, 13
        # Strided views of a fused QKV output, in the model dtype, as the layers pass them.
        qkv = (torch.randn(num_tokens, 3, num_kv_heads, head_size, generator=gen) * magnitude).to(dtype)
        qkv[0, 1, 0, :4] = torch.tensor([0.0, -0.0, 1e-9, -1e-9])  # zeros and values that round to zero
        key, value = qkv[:, 1], qkv[:, 2]
        slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slot_mapping[[2, 7]] = -1
        k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan")).to(fp8)
        v_cache = k_cache.clone()
        k_expected = k_cache.view(torch.uint8).clone()  # the format's NaN
        v_expected = k_expected.clone()
        kernels["triton_kv_cache"].write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                                                  v_scale=v_scale)
        stored = slot_mapping >= 0
        k_expected.view(-1, num_kv_heads, head_size)[slot_mapping[stored]] = quantize(key[stored], fp8, k_scale).view(
            torch.uint8)
        v_expected.view(-1, num_kv_heads, head_size)[slot_mapping[stored]] = quantize(
            value[stored], fp8, v_scale).view(torch.uint8)
        assert torch.equal(k_cache.view(torch.uint8), k_expected)
        assert torch.equal(v_cache.view(torch.uint8), v_expected)
        assert_saturates(k_cache, fp8, k_scale, magnitude)


def test_fused_rotary_write_stores_the_rotated_keys_and_the_values_quantized(kernels):
    """The rotary kernel's cache write (CACHE_BLOCK_SIZE, BLOCK_REST: a rotary dim short of
    the head), as the attention layers call it on CUDA, into an e4m3 cache with scales."""
    ops = kernels["triton_elementwise"]
    gen = torch.Generator().manual_seed(5)
    rows, query_heads, key_heads, head_size, rotary_dim, block_size = 6, 4, 2, 64, 32, 8
    q_size, k_size = query_heads * head_size, key_heads * head_size
    qkv = (torch.randn(rows, q_size + 2 * k_size, generator=gen) * 40).to(torch.bfloat16)
    positions = torch.randint(0, 64, (rows,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(64).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.bfloat16)
    slot_mapping = torch.randperm(4 * block_size, generator=gen)[:rows]
    slot_mapping[-1] = -1
    k_cache = torch.full((4, block_size, key_heads, head_size), float("nan")).to(E4M3)
    v_cache = k_cache.clone()
    q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + k_size], qkv[:, q_size + k_size:]
    ops.rotary_embedding_(positions, q, k, cos_sin, head_size, rotary_dim, kv_cache=(v, k_cache, v_cache, slot_mapping),
                          k_scale=0.125, v_scale=0.5)
    stored = slot_mapping >= 0
    cached = k_cache.view(torch.uint8).flatten(0, 1)[slot_mapping[stored]]
    expected = quantize(k[stored].reshape(-1, key_heads, head_size), E4M3, 0.125).view(torch.uint8)
    assert torch.equal(cached, expected)  # the rotated keys (k after the launch), quantized
    cached_values = v_cache.view(torch.uint8).flatten(0, 1)[slot_mapping[stored]]
    assert torch.equal(cached_values, quantize(v[stored].reshape(-1, key_heads, head_size), E4M3, 0.5).view(
        torch.uint8))
    assert (k_cache.float().abs() == 448).any()
    unwritten = torch.ones(4 * block_size, dtype=torch.bool)
    unwritten[slot_mapping[stored]] = False
    assert k_cache.float().flatten(0, 1)[unwritten].isnan().all()


# ---- attention --------------------------------------------------------------------------------

# (cache format, query dtype, num_heads, num_kv_heads, block_size, seq_lens, num_splits)
DECODE_CASES = [
    (E4M3, torch.float32, 4, 4, 16, [1, 17, 150], 1),
    (E4M3, torch.bfloat16, 8, 2, 8, [5, 33, 97], 1),
    (E5M2, torch.float16, 4, 1, 16, [3, 48, 129], 1),
    (E4M3, torch.float16, 8, 2, 16, [300, 1, 40, 257], 3),  # split-K, sequences shorter than a partition
    (E5M2, torch.bfloat16, 4, 1, 16, [300, 1, 40, 257], 2),
]


@pytest.mark.parametrize("fp8,dtype,num_heads,num_kv_heads,block_size,seq_lens,num_splits", DECODE_CASES)
def test_decode_over_an_fp8_cache_matches_the_fp32_reference_on_its_values(kernels, fp8, dtype, num_heads,
                                                                           num_kv_heads, block_size, seq_lens,
                                                                           num_splits):
    for k_scale, magnitude in SCALES[fp8]:
        v_scale = 2 * k_scale
        query, k_cache, v_cache, md = fp8_step([1] * len(seq_lens), seq_lens, fp8=fp8, dtype=dtype, k_scale=k_scale,
                                               v_scale=v_scale, magnitude=magnitude, num_heads=num_heads,
                                               num_kv_heads=num_kv_heads, block_size=block_size,
                                               seed=len(seq_lens) + num_splits, padding_tokens=2)
        assert_saturates(k_cache, fp8, k_scale, magnitude)
        # Large keys, small softmax scale: no key takes all the weight.
        scale = 0.125 / magnitude
        out = torch.full_like(query, float("nan"))
        kernels["triton_decode_attention"].paged_decode_attention(query, k_cache, v_cache, md, scale, out=out,
                                                                  num_splits=num_splits, k_scale=k_scale,
                                                                  v_scale=v_scale)
        expected = expected_attention(query, k_cache, v_cache, md, scale, k_scale, v_scale)
        batch = len(seq_lens)
        assert out.dtype == dtype and torch.equal(out[batch:], torch.zeros_like(out[batch:]))
        assert relative_error(out[:batch], expected[:batch]) < TOLERANCE[dtype]


# (cache format, query dtype, num_heads, num_kv_heads, query_lens, seq_lens): whole prompts,
# chunks behind cached context (prefix-cache hits, chunked prefill), decode rows mixed in.
PREFILL_CASES = [
    (E4M3, torch.float32, 4, 4, [1, 23, 40], [1, 23, 40]),
    (E4M3, torch.bfloat16, 8, 2, [12, 30, 1], [50, 37, 70]),
    (E5M2, torch.float16, 4, 1, [33, 1, 5], [33, 100, 77]),
    (E5M2, torch.float32, 8, 2, [19, 1], [60, 33]),
]


@pytest.mark.parametrize("fp8,dtype,num_heads,num_kv_heads,query_lens,seq_lens", PREFILL_CASES)
def test_prefill_over_an_fp8_cache_matches_the_fp32_reference_on_its_values(kernels, fp8, dtype, num_heads,
                                                                            num_kv_heads, query_lens, seq_lens):
    for k_scale, magnitude in SCALES[fp8]:
        v_scale = k_scale / 2
        query, k_cache, v_cache, md = fp8_step(query_lens, seq_lens, fp8=fp8, dtype=dtype, k_scale=k_scale,
                                               v_scale=v_scale, magnitude=magnitude, num_heads=num_heads,
                                               num_kv_heads=num_kv_heads, seed=sum(seq_lens), padding_tokens=2)
        scale = 0.125 / magnitude
        out = torch.full_like(query, float("nan"))
        kernels["triton_prefill_attention"].paged_prefill_attention(query, k_cache, v_cache, md, scale, out=out,
                                                                    k_scale=k_scale, v_scale=v_scale)
        expected = expected_attention(query, k_cache, v_cache, md, scale, k_scale, v_scale)
        packed = sum(query_lens)
        assert torch.equal(out[packed:], torch.zeros_like(out[packed:]))
        assert relative_error(out[:packed], expected[:packed]) < TOLERANCE[dtype]


def test_windowed_soft_capped_layers_over_an_fp8_cache_match_the_reference(kernels):
    query, k_cache, v_cache, md = fp8_step([1, 1, 1], [90, 5, 130], fp8=E4M3, dtype=torch.float16, k_scale=0.5,
                                           v_scale=0.25, magnitude=1.0, seed=3)
    layer = dict(sliding_window=37, logits_soft_cap=4.0)
    out = kernels["triton_decode_attention"].paged_decode_attention(query, k_cache, v_cache, md, 0.2, num_splits=1,
                                                                    k_scale=0.5, v_scale=0.25, **layer)
    expected = expected_attention(query, k_cache, v_cache, md, 0.2, 0.5, 0.25, **layer)
    assert relative_error(out, expected) < TOLERANCE[torch.float16]
    query, k_cache, v_cache, md = fp8_step([40, 1], [40, 90], fp8=E4M3, dtype=torch.float16, k_scale=0.5,
                                           v_scale=0.25, magnitude=1.0, seed=4)
    out = kernels["triton_prefill_attention"].paged_prefill_attention(query, k_cache, v_cache, md, 0.2, k_scale=0.5,
                                                                      v_scale=0.25, **layer)
    expected = expected_attention(query, k_cache, v_cache, md, 0.2, 0.5, 0.25, **layer)
    assert relative_error(out, expected) < TOLERANCE[torch.float16]


def test_triton_backend_write_then_attend_equals_the_torch_backend_on_an_fp8_cache(kernels):
    """The backends' shared contract end to end on one mixed step: the same bytes written,
    the same attention (the torch backend's fp8 path, `torch_attention`)."""
    from raylm.kernels.backend import get_attention_backend

    query, k_cache, v_cache, md = fp8_step([4, 1], [4, 9], fp8=E5M2, dtype=torch.float32, k_scale=0.5, v_scale=2.0,
                                           magnitude=1.0, num_heads=4, block_size=8, seed=5)
    slots = [md.block_tables[0, t // 8].item() * 8 + t % 8 for t in range(4)] + [md.block_tables[1, 1].item() * 8]
    md.slot_mapping = torch.tensor(slots)
    key, value = torch.randn(5, 2, 64) * 3, torch.randn(5, 2, 64) * 3
    caches, outs = [], []
    for name in ("triton", "torch"):
        backend = get_attention_backend(name)
        k, v = k_cache.clone(), v_cache.clone()
        backend.write_kv_cache(key, value, k, v, md.slot_mapping, k_scale=0.5, v_scale=2.0)
        caches.append((k.view(torch.uint8), v.view(torch.uint8)))
        outs.append(backend.paged_attention(query, k, v, md, 0.125, k_scale=0.5, v_scale=2.0))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert relative_error(outs[0], outs[1]) < 1e-3


def test_warm_up_launches_the_fp8_variants_with_the_models_queries(kernels):
    from raylm.kernels import backend

    k_cache = torch.zeros(4, 16, 2, 64).to(E4M3)
    v_cache = k_cache.clone()
    backend.launch_every_variant(8, 2, 64, 0.125, k_cache, v_cache, 1024, query_dtype=torch.bfloat16)
    assert torch.equal(k_cache.view(torch.uint8), torch.zeros_like(k_cache.view(torch.uint8)))  # wrote nothing
    with pytest.raises(AssertionError, match="queries' dtype"):
        backend.launch_every_variant(8, 2, 64, 0.125, k_cache, v_cache, 1024)


def test_llama_layers_rotary_stores_into_an_fp8_cache_in_its_own_launch(kernels):
    """`RotaryEmbedding.rotate_and_cache`, as Llama's attention calls it on CUDA (here the
    CUDA branch on the CPU, interpreted), takes an fp8 cache: one launch rotates and stores
    the keys and values quantized with the layer's scales."""
    from raylm.kernels import cuda_ops
    from raylm.models.rotary_embedding import RotaryEmbedding

    torch.manual_seed(0)
    rotary = RotaryEmbedding(32, 32, 64, {"rope_type": "default", "rope_theta": 10000.0})
    rows, heads = 5, 2
    q, k, v = (torch.randn(rows, heads * 32) * 20 for _ in range(3))
    positions = torch.arange(rows)
    k_cache = torch.full((2, 4, heads, 32), float("nan")).to(E4M3)
    v_cache = k_cache.clone()
    slots = torch.tensor([6, 0, 3, -1, 7])
    with cuda_ops.interpreted_on_cpu():
        assert rotary.rotate_and_cache(positions, q, k, v, (k_cache, v_cache, slots, 0.03, 0.05))
    stored = slots >= 0
    expected_keys = quantize(k[stored].view(-1, heads, 32), E4M3, 0.03).view(torch.uint8)
    assert torch.equal(k_cache.view(torch.uint8).flatten(0, 1)[slots[stored]], expected_keys)
    expected_values = quantize(v[stored].view(-1, heads, 32), E4M3, 0.05).view(torch.uint8)
    assert torch.equal(v_cache.view(torch.uint8).flatten(0, 1)[slots[stored]], expected_values)
    assert (k_cache.float().abs() == 448).any()


def test_speed_checks_fp8_decode_figures_run_every_variant(kernels):
    """cluster/benchmarks/gpu_speed_check.py's `decode_attention_fp8` (the device run's
    figure of what the fp8 cache's reads buy), interpreted on a small shape: the model
    dtype's cache, the fp8 cache and the fp8 cache with 64-key tiles all run and are timed."""
    from raylm.cluster.benchmarks.gpu_speed_check import Shape, decode_attention_fp8

    rows = decode_attention_fp8(Shape(num_heads=8, num_kv_heads=2, head_size=64), ((3, 100),), torch.device("cpu"),
                                copy_bytes_s=1e9, use_triton=True, repeats=1)
    (row,) = rows
    assert (row["batch"], row["context"], row["backend"]) == (3, 100, "triton")
    assert all(row[key] > 0 for key in ("model_dtype_ms", "fp8_ms", "fp8_block_n_64_ms", "fp8_fraction_of_copy"))
