"""Every native CPU kernel, in fp32 and bf16, against PyTorch in float64 — on every instruction
set this CPU can run.

In this process the tests run the default build (-march=native). `test_narrower_isa_passes`
reruns this file in a subprocess per narrower path of cpu_vec.h (RAYLM_CPU_ISA=avx512_no_bf16,
avx2, scalar), each a separate library, so a machine with AVX-512 also tests the code that
other machines run. The reruns build only the libraries this file loads (ISA_LIBRARIES) and
leave out the cases marked `same_isa_path`: cases whose instructions other cases already run
on that ISA (see the marker's uses), so each kernel, vector tail and dtype conversion still
runs once per ISA. Tolerances: fp32 outputs to fp32 rounding; bf16 outputs to one bf16
rounding (2^-8 relative) of a result computed in fp32.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from raylm.engine import envs
from raylm.kernels import cpu_attention, cpu_ops, native_build
from raylm.kernels.kv_cache_dtype import dequantize, quantize
from paged_steps import build_cached_step
from penalty_reference import dense_penalties
from test_cpu_attention import float64_attention

DTYPES = [torch.float32, torch.bfloat16]
# What the narrower-ISA reruns leave out (test_narrower_isa_passes): a case that runs the same
# instructions as another one of its test on every ISA, only loop counts or a combination of
# code paths the other cases run one by one differing.
SAME_ISA_PATH = pytest.mark.same_isa_path
# The native libraries this file loads: what a narrower ISA's rerun builds first.
ISA_LIBRARIES = ("cpu_ops", "cpu_attention", "cpu_prefill_attention", "cpu_gemm_amx", "cpu_gemm_avx512",
                 "cpu_gemm_avx2", "cpu_fused_moe", "cpu_lora", "cpu_fp8_linear", "cpu_int4_linear", "cpu_int4_experts",
                 "cpu_peak_flops")


def query_and_cache_dtypes(cache_dtypes: list[torch.dtype], cache_ids: list[str]) -> list:
    """Every (query dtype, cache dtype) pair; the attention kernels load and store the query's
    dtype by one runtime branch and load the cache's by another (a template), so the pairs
    (DTYPES[i], cache_dtypes[i]) run each of both once and the others are `same_isa_path`."""
    return [pytest.param(dtype, cache_dtype, id=f"{dtype_id}-{cache_id}",
                         marks=() if i == j else SAME_ISA_PATH)
            for i, (dtype, dtype_id) in enumerate(zip(DTYPES, ["fp32", "bf16"]))
            for j, (cache_dtype, cache_id) in enumerate(zip(cache_dtypes, cache_ids))]
# (rtol, atol) of an output in this dtype against float64.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -8, 1e-5)}


@pytest.fixture(scope="module", autouse=True)
def native():
    if (not cpu_ops.usable(torch.zeros(1)) or not cpu_attention.is_available()
            or cpu_attention.load_prefill_kernel() is None):
        pytest.skip("the native CPU kernels cannot be built here (no compiler or ninja?)")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def test_the_fma_peak_loop_runs_the_widest_multiply_add_of_the_isa():
    # Assembled per ISA (csrc/cpu_peak_flops.cpp): AVX-512 zmm, AVX2 ymm, none without AVX.
    if native_build.load_native_library("cpu_peak_flops") is None:
        pytest.skip("the peak loop cannot be built here")
    fp32, bf16 = (torch.ops.raylm.cpu_peak_flops(dtype, 100_000) for dtype in (torch.float32, torch.bfloat16))
    instructions = {dtype: torch.ops.raylm.cpu_peak_flops_instruction(dtype) for dtype in DTYPES}
    isa, flags = envs.RAYLM_CPU_ISA, native_build._cpu_flags().split()
    if isa == "scalar" or not {"avx2", "fma"} <= set(flags):
        assert fp32 == bf16 == 0.0 and set(instructions.values()) == {""}
        return
    assert fp32 > 1e9 and bf16 > 1e9
    avx512 = "avx512f" in flags and isa != "avx2"
    register = "zmm" if avx512 else "ymm"
    assert instructions[torch.float32] == f"vfmadd231ps {register}"
    # bf16 without AVX512-BF16 runs the fp32 loop (bf16 is widened to fp32 to be multiplied).
    native_bf16 = avx512 and isa != "avx512_no_bf16" and "avx512_bf16" in flags
    assert instructions[torch.bfloat16] == ("vdpbf16ps zmm" if native_bf16 else f"vfmadd231ps {register}")


def test_the_build_uses_the_isa_asked_for():
    expected = {"avx512": 16, "avx512_no_bf16": 16, "avx2": 8, "scalar": 1}.get(envs.RAYLM_CPU_ISA)
    if expected is None:
        pytest.skip("default build: whatever -march=native gives")
    assert torch.ops.raylm.vector_width() == expected


def test_the_amx_gemm_is_built_only_for_the_full_isa_of_an_amx_cpu():
    """The narrower paths stand for CPUs without AMX: their build must not use it, so
    layers there keep oneDNN (the full build's AMX kernel is tested in test_cpu_gemm_amx)."""
    from raylm.kernels import cpu_gemm

    flags = native_build._cpu_flags().split()
    cpu_has_amx = all(f in flags for f in ("amx_tile", "amx_bf16", "avx512_bf16"))
    full_isa = envs.RAYLM_CPU_ISA in (None, "avx512")
    assert cpu_gemm.amx_linear_enabled() == (cpu_has_amx and full_isa)


def test_the_avx512_gemm_is_built_for_the_dtypes_the_isa_has():
    """fp32 with AVX-512, bf16 with AVX512-BF16 too; the AVX2 and scalar builds do without
    (the kernel itself is tested in test_cpu_gemm_streaming, which this file's narrower runs
    do not repeat: only the full build has both dtypes)."""
    from raylm.kernels import cpu_gemm

    flags = native_build._cpu_flags().split()
    isa = envs.RAYLM_CPU_ISA or ("avx512" if "avx512f" in flags else "native")
    has_avx512 = "avx512f" in flags and isa in ("avx512", "avx512_no_bf16")
    assert cpu_gemm.avx512_linear_enabled(torch.float32) == has_avx512
    assert cpu_gemm.avx512_linear_enabled(torch.bfloat16) == (has_avx512 and isa == "avx512" and "avx512_bf16" in flags)
    if has_avx512:  # and the fp32 kernel computes the same product in this build
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(9, 70, generator=gen), torch.randn(67, 70, generator=gen)
        y = torch.ops.raylm.avx512_linear(x, torch.ops.raylm.avx512_pack_weight(w), 67, None)
        assert_close(y, x.double() @ w.double().T, torch.float32)


def test_layers_take_the_avx2_gemm_only_where_the_build_has_avx2_and_not_avx512():
    """Decode GEMMs stream through the widest kernel built: AMX or AVX-512 where the build has
    AVX-512, the AVX2 one (fp32 and bf16) where it has AVX2 + FMA only, none in the scalar
    build, and gate_up projections through the same kernel's gated form; the AVX2 kernel
    computes the product in every build that has it, and its gated form what it and
    silu_and_mul give, bit for bit (silu_and_mul's vectors are 16 lanes in AVX-512 builds)."""
    from raylm.kernels import cpu_gemm

    flags = native_build._cpu_flags().split()
    isa = envs.RAYLM_CPU_ISA or ("avx512" if "avx512f" in flags else "native")
    has_avx512 = "avx512f" in flags and isa in ("avx512", "avx512_no_bf16")
    has_avx2 = {"avx2", "fma"} <= set(flags) and isa != "scalar"
    for dtype in DTYPES:
        assert cpu_gemm.avx2_linear_built(dtype) == has_avx2
        assert cpu_gemm.avx2_linear_enabled(dtype) == (has_avx2 and not has_avx512)
        decode = cpu_gemm.pack_streaming_weight(torch.randn(40, 24).to(dtype))
        if has_avx2 and not has_avx512:
            assert decode is not None and decode.kind == cpu_gemm.LINEAR_AVX2
        else:
            assert decode is None or decode.kind != cpu_gemm.LINEAR_AVX2
        if has_avx2:
            gen = torch.Generator().manual_seed(0)
            x, w = torch.randn(9, 70, generator=gen).to(dtype), torch.randn(67, 70, generator=gen).to(dtype)
            y = torch.ops.raylm.avx2_linear(x, torch.ops.raylm.avx2_pack_weight(w), 67, None)
            assert_close(y, x.double() @ w.double().T, dtype)
        gated = cpu_gemm.gated_kernel(dtype)
        if has_avx2 and not has_avx512:
            assert gated is not None and gated[3] == cpu_gemm.LINEAR_AVX2_SILU_MUL
        else:
            assert gated is None or gated[3] != cpu_gemm.LINEAR_AVX2_SILU_MUL
        if has_avx2:  # d = 37: whole vectors and a tail, in either vector width
            gate_up = torch.randn(74, 70, generator=gen).to(dtype) / 8
            y = torch.ops.raylm.avx2_linear_silu_mul(x, torch.ops.raylm.avx2_pack_gated_weight(gate_up), 37)
            pair = torch.ops.raylm.silu_and_mul(
                torch.ops.raylm.avx2_linear(x, torch.ops.raylm.avx2_pack_weight(gate_up), 74, None))
            assert torch.equal(y, pair)


# Widths with and without a tail past the last whole vector (16 or 8 lanes).
@pytest.mark.parametrize("hidden", [256, 100, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x, residual = torch.randn(5, hidden, generator=gen).to(dtype), (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    # The sum is rounded to the model dtype, then normalised: PyTorch's order.
    expected_residual = (x.double() + residual.double()).to(dtype).double()
    expected = expected_residual * torch.rsqrt(expected_residual.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    torch.ops.raylm.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_close(residual, expected_residual, dtype)
    assert_close(x, expected, dtype)


@pytest.mark.parametrize("hidden", [256, 37])
def test_bf16_sums_round_to_nearest_even_as_pytorch_does(hidden):
    # Sums of two bf16 values are exact in fp32 and often ties in bf16: the residual must be
    # bit for bit PyTorch's rounding, in the vector body and the scalar tail alike.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, hidden, generator=gen).to(torch.bfloat16)
    residual = torch.randn(64, hidden, generator=gen).to(torch.bfloat16)
    expected = (x.float() + residual.float()).to(torch.bfloat16)
    torch.ops.raylm.fused_add_rms_norm(x, residual, torch.ones(hidden, dtype=torch.bfloat16), 1e-6)
    assert torch.equal(residual, expected)


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(1)
    x, weight = (torch.randn(9, 100, generator=gen) * 10).to(dtype), torch.randn(100, generator=gen).to(weight_dtype)
    expected = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert_close(torch.ops.raylm.rms_norm(x, weight, 1e-5), expected, dtype)


@pytest.mark.parametrize("d", [688, 11])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_including_inputs_where_exp_overflows(dtype, d):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(3, 2 * d, generator=gen) * 4
    x[0, :4] = torch.tensor([-200.0, -88.0, 88.0, 200.0])
    x[0, d - 4:d] = torch.tensor([-200.0, -88.0, 88.0, 200.0])  # in the tail too
    x = x.to(dtype)
    expected = F.silu(x[:, :d].double()) * x[:, d:].double()
    assert_close(torch.ops.raylm.silu_and_mul(x), expected, dtype)


@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (32, 16), (36, 36)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_of_a_column_slice(dtype, head_size, rotary_dim):
    num_heads, rows = 3, 7
    gen = torch.Generator().manual_seed(head_size + rotary_dim)
    qkv = torch.randn(rows, (num_heads + 1) * head_size, generator=gen).to(dtype)
    x = qkv[:, :num_heads * head_size]
    positions = torch.randint(0, 100, (rows,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.arange(100, dtype=torch.float64)[:, None] * inv_freq
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)  # as the model stores it
    cos, sin = table.double()[positions].unsqueeze(1).chunk(2, dim=-1)
    heads = x.double().view(rows, num_heads, head_size)
    x1, x2 = heads[..., :rotary_dim // 2], heads[..., rotary_dim // 2:rotary_dim]
    expected = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, heads[..., rotary_dim:]], dim=-1).view(rows, -1)
    untouched = qkv[:, num_heads * head_size:].clone()
    torch.ops.raylm.rotary_embedding(x, positions, table, head_size, rotary_dim)
    assert_close(x, expected, dtype)
    assert torch.equal(qkv[:, num_heads * head_size:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_copies_rows_to_their_slots(dtype):
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(4, 2 * 2 * 8, generator=gen).to(dtype)
    key, value = kv[:, :16].view(4, 2, 8), kv[:, 16:].view(4, 2, 8)
    caches = [torch.zeros(3, 4, 2, 8, dtype=dtype) for _ in range(2)]
    torch.ops.raylm.write_kv_cache(key, value, *caches, torch.tensor([0, 11, -1, 5]))
    for cache, rows in zip(caches, (key, value)):
        flat = cache.view(12, 2, 8)
        assert torch.equal(flat[[0, 11, 5]], rows[[0, 1, 3]])
        assert not flat[[1, 2, 3, 4, 6, 7, 8, 9, 10]].any()


# (head_size, num_heads, num_kv_heads): head sizes with their own specialisations (32, 64,
# 128), others with (80) and without (40) a whole number of 16-channel groups, one that is
# not a multiple of 8 (36); MHA and GQA.
ATTENTION_SHAPES = [(32, 8, 2), (64, 4, 4), (128, 4, 2), (80, 4, 4), (40, 8, 4), (36, 8, 4)]


def float64_cumulative(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Each row's running sum of softmax(logits / temperature), in float64."""
    return torch.softmax(logits.double() / temperatures.double().unsqueeze(1), dim=-1).cumsum(dim=-1)


@pytest.mark.parametrize("vocab", [4096, 1003, 5])
def test_random_sample_draws_the_token_whose_interval_holds_u(vocab):
    # Inverse CDF: token i is drawn when u falls in [cum[i-1], cum[i]) of the softmax of
    # logits / temperature; the native sums are fp32, so u may sit that far past an edge.
    gen = torch.Generator().manual_seed(vocab)
    rows = 300
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 8
    logits[::7, ::3] = -math.inf  # masked tokens
    temperatures = torch.rand(rows, generator=gen) * 2 + 0.05
    uniforms = torch.rand(rows, generator=gen)
    tokens = cpu_ops.random_sample(logits, temperatures, uniforms)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    cumulative = float64_cumulative(logits, temperatures)
    below = torch.cat([torch.zeros(rows, 1, dtype=torch.float64), cumulative[:, :-1]], dim=1)
    picked = tokens.unsqueeze(1)
    lower, upper = below.gather(1, picked).squeeze(1), cumulative.gather(1, picked).squeeze(1)
    u = uniforms.double()
    assert bool((lower <= u + 1e-5).all()) and bool((u <= upper + 1e-5).all())
    assert bool((upper > lower).all())  # never a token of zero probability
    assert bool(torch.isfinite(logits.gather(1, picked)).all())


def test_random_sample_ends_of_the_interval_and_its_frequencies():
    logits = torch.tensor([[-math.inf, 0.5, -math.inf, 2.0, 1.0, -math.inf]])
    just_below_one = torch.tensor([1.0 - 2 ** -24])
    for u, expected in ((torch.zeros(1), 1), (just_below_one, 4)):
        assert cpu_ops.random_sample(logits, torch.ones(1), u).item() == expected
    # 20,000 draws at temperature 0.7 against the softmax, to within 4 standard errors.
    draws = 20000
    gen = torch.Generator().manual_seed(0)
    tokens = cpu_ops.random_sample(logits.expand(draws, -1).contiguous(), torch.full((draws,), 0.7),
                                   torch.rand(draws, generator=gen))
    frequencies = torch.bincount(tokens, minlength=6).double() / draws
    probabilities = torch.softmax(logits.double()[0] / 0.7, dim=-1)
    assert bool(((frequencies - probabilities).abs() <= 4 * (probabilities * (1 - probabilities) / draws).sqrt()).all())


@pytest.mark.parametrize("case", ["zero temperature", "u of one"])
def test_random_sample_rejects_what_it_cannot_draw_with(case):
    logits, temperatures, uniforms = torch.zeros(2, 8), torch.ones(2), torch.full((2,), 0.5)
    if case == "zero temperature":
        temperatures[1] = 0.0
    else:
        uniforms[0] = 1.0
    with pytest.raises(ValueError):
        cpu_ops.random_sample(logits, temperatures, uniforms)


@pytest.mark.parametrize("truncated", [False, True])
@pytest.mark.parametrize("case", ["a row of nan", "one nan among finite logits", "a row of -inf", "a row of +inf"])
def test_a_row_with_nothing_to_draw_from_draws_minus_one_and_the_others_draw(case, truncated):
    # A bad row (weights or a penalty that overflowed) must fail its own request, not the batch.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 50, generator=gen)
    temperatures, uniforms = torch.ones(3), torch.rand(3, generator=gen)
    expected = cpu_ops.random_sample(logits, temperatures, uniforms)
    if case == "a row of nan":
        logits[1] = math.nan
    elif case == "one nan among finite logits":
        logits[1, 5] = math.nan
    elif case == "a row of -inf":
        logits[1] = -math.inf
    else:
        logits[1, 7] = math.inf
    if truncated:
        tokens = cpu_ops.random_sample_truncated(logits, temperatures, uniforms, torch.full((3,), 10),
                                                 torch.full((3,), 1.0), torch.zeros(3))
        expected = cpu_ops.random_sample_truncated(logits[[0, 2]], temperatures[:2], uniforms[[0, 2]],
                                                   torch.full((2,), 10), torch.full((2,), 1.0), torch.zeros(2))
        assert tokens[[0, 2]].tolist() == expected.tolist()
    else:
        tokens = cpu_ops.random_sample(logits, temperatures, uniforms)
        assert tokens[[0, 2]].tolist() == expected[[0, 2]].tolist()
    assert tokens[1].item() == -1


def float64_truncated(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's probabilities after vLLM's (v1) cuts, in float64 by a full sort: min-p drops
    probabilities under min_p times the largest; top-k over what is left keeps the logits >=
    the k-th largest; top-p over what top-k keeps keeps a token while the tokens before it in
    a descending sort hold less than p of that mass. Also returns, per token, how far its
    kept-or-not decision is from the top-p boundary (the mass before it minus p), for rows
    where rounding decides."""
    scaled = logits.double() / temperature
    vocab = scaled.numel()
    probs = torch.softmax(scaled, dim=0)
    keep = probs >= probs.max() * min_p
    if top_k < vocab:
        kept_logits = scaled.masked_fill(~keep, -math.inf)
        keep &= kept_logits >= kept_logits.sort(descending=True).values[top_k - 1]
    probs = torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=0)
    margin = torch.full((vocab,), math.inf, dtype=torch.float64)
    if top_p < 1.0:
        order = probs.sort(descending=True, stable=True).indices
        before = torch.cat([torch.zeros(1, dtype=torch.float64), probs[order].cumsum(0)[:-1]])
        keep[order] &= before < top_p
        margin[order] = before - top_p
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(), margin


# 1003 and 37: whole vectors and a tail at every width (1003: more rows of the cut's histogram).
@pytest.mark.parametrize("vocab", [4096, pytest.param(1003, marks=SAME_ISA_PATH), 37])
def test_random_sample_truncated_draws_from_what_a_sort_keeps(vocab):
    # Every row cuts differently (k from 1 to past V, p, min-p, each on or off), with masked
    # tokens and runs of equal logits; the token drawn must be one the float64 sort keeps
    # (unless the top-p boundary is within rounding of it), and u must fall in its interval
    # of the kept distribution.
    gen = torch.Generator().manual_seed(vocab)
    rows = 240
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 8
    logits[::7, ::3] = -math.inf
    logits[::5, 10:20] = 1.5  # ties, at the cut in some rows
    temperatures = torch.rand(rows, generator=gen) * 1.5 + 0.1
    top_ks = torch.randint(1, vocab + 50, (rows,), generator=gen)
    top_ps = torch.where(torch.rand(rows, generator=gen) < 0.3, 1.0, torch.rand(rows, generator=gen) * 0.98 + 0.01)
    min_ps = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0, torch.rand(rows, generator=gen) * 0.4)
    uniforms = torch.rand(rows, generator=gen)
    tokens = cpu_ops.random_sample_truncated(logits, temperatures, uniforms, top_ks, top_ps, min_ps)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    for r in range(rows):
        probs, margin = float64_truncated(logits[r], float(temperatures[r]), int(top_ks[r]), float(top_ps[r]),
                                          float(min_ps[r]))
        token = int(tokens[r])
        if probs[token] == 0:
            assert abs(float(margin[token])) < 1e-5, f"row {r}: token {token} is cut off by the sort"
            continue
        cumulative = probs.cumsum(0)
        lower = float(cumulative[token - 1]) if token else 0.0
        assert lower - 1e-5 <= float(uniforms[r]) <= float(cumulative[token]) + 1e-5, f"row {r}"


def test_random_sample_truncated_cuts_as_vllm_does_at_its_edges():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, -math.inf, 1.0, 3.0]])
    one = torch.ones(1)

    def draws(top_k: int, top_p: float, min_p: float = 0.0, count: int = 4000) -> set[int]:
        u = (torch.arange(count, dtype=torch.float32) + 0.5) / count
        return set(cpu_ops.random_sample_truncated(logits.expand(count, -1).contiguous(), one.expand(count), u,
                                                   torch.full((count,), top_k), torch.full((count,), top_p),
                                                   torch.full((count,), min_p)).tolist())

    assert draws(1, 1.0) == {6}  # top-k 1 is greedy
    assert draws(2, 1.0) == {1, 3, 6}  # both logits equal to the 2nd largest are kept
    assert draws(7, 1.0) == {0, 1, 2, 3, 5, 6}  # k = V cuts nothing; -inf is never drawn
    # softmax of [0, 2, 1, 2, 1, 3]: 3 holds 0.4551, each 2 holds 0.1674. Top-p keeps a token
    # while the mass before it is under p: 0.3 keeps the maximum only, 0.5 one of the ties
    # (the first in vocabulary order, as a stable sort), 0.7 both.
    assert draws(7, 0.3) == {6}
    assert draws(7, 0.5) == {1, 6}
    assert draws(7, 0.7) == {1, 3, 6}
    # Top-k first, then top-p over what it keeps, renormalised: k = 3 leaves 3 with 0.576 and
    # each 2 with 0.212, so p = 0.7 now keeps one tie and 0.8 both.
    assert draws(3, 0.7) == {1, 6}
    assert draws(3, 0.8) == {1, 3, 6}
    assert draws(7, 1.0, min_p=0.3) == {1, 3, 6}  # e^-1 = 0.37 of the max stays, e^-2 goes
    # Min-p comes first (vLLM v1): min_p 0.3 leaves 3 and the two 2s, which top-p 0.7 then
    # weighs anew (0.576, 0.212, 0.212), keeping the max and one 2. Applied after top-p (vLLM
    # v0's order), min-p would have kept both 2s.
    assert draws(7, 0.7, min_p=0.3) == {1, 6}
    # Top-k counts only what min-p left: k = 5 of 3 survivors keeps the 3.
    assert draws(5, 1.0, min_p=0.3) == {1, 3, 6}
    # A row that cuts nothing draws what random_sample draws, bit for bit.
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(64, 5000, generator=gen) * 4
    t, u = torch.rand(64, generator=gen) + 0.2, torch.rand(64, generator=gen)
    assert torch.equal(cpu_ops.random_sample_truncated(wide, t, u, torch.full((64,), 5000), torch.ones(64),
                                                       torch.zeros(64)), cpu_ops.random_sample(wide, t, u))


def test_random_sample_truncated_frequencies():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 300, generator=gen) * 2
    logits[0, 50:60] = float(logits.max())  # ten tokens tie for the maximum
    draws = 40000
    tokens = cpu_ops.random_sample_truncated(logits.expand(draws, -1).contiguous(), torch.full((draws,), 0.8),
                                             torch.rand(draws, generator=gen), torch.full((draws,), 40),
                                             torch.full((draws,), 0.9), torch.full((draws,), 0.01))
    frequencies = torch.bincount(tokens, minlength=300).double() / draws
    probabilities, _ = float64_truncated(logits[0], 0.8, 40, 0.9, 0.01)
    assert bool(((frequencies - probabilities).abs() <= 4 * (probabilities * (1 - probabilities) / draws).sqrt()
                 + 1e-12).all())


def test_truncated_probs_are_what_a_sort_keeps_and_nan_rows_stay_nan():
    gen = torch.Generator().manual_seed(2)
    rows, vocab = 60, 2000
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    logits[::6, 5:15] = 1.0  # ties
    temperatures = torch.rand(rows, generator=gen) + 0.2
    top_ks = torch.randint(1, vocab + 10, (rows,), generator=gen)
    top_ps = torch.where(torch.rand(rows, generator=gen) < 0.3, 1.0, torch.rand(rows, generator=gen) * 0.9 + 0.05)
    min_ps = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0, torch.rand(rows, generator=gen) * 0.3)
    logits[7] = math.nan
    logits[8] = -math.inf
    probs = cpu_ops.truncated_probs(logits, temperatures, top_ks, top_ps, min_ps)
    assert probs.dtype == torch.float32 and probs.shape == (rows, vocab)
    assert bool(probs[7].isnan().all()) and bool(probs[8].isnan().all())
    for r in set(range(rows)) - {7, 8}:
        expected, margin = float64_truncated(logits[r], float(temperatures[r]), int(top_ks[r]), float(top_ps[r]),
                                             float(min_ps[r]))
        differs = (probs[r] > 0) != (expected > 0)
        assert bool((margin[differs].abs() < 1e-5).all()), f"row {r}: the kept tokens differ from the sort's"
        if not differs.any():
            torch.testing.assert_close(probs[r].double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", ["top_k of 0", "top_p of 0", "top_p over 1", "min_p over 1"])
def test_random_sample_truncated_rejects_what_it_cannot_cut(case):
    logits, temperatures, uniforms = torch.zeros(2, 8), torch.ones(2), torch.full((2,), 0.5)
    top_ks, top_ps, min_ps = torch.full((2,), 4), torch.full((2,), 0.9), torch.zeros(2)
    if case == "top_k of 0":
        top_ks[1] = 0
    elif case == "top_p of 0":
        top_ps[0] = 0.0
    elif case == "top_p over 1":
        top_ps[1] = 1.5
    else:
        min_ps[0] = 2.0
    with pytest.raises(ValueError):
        cpu_ops.random_sample_truncated(logits, temperatures, uniforms, top_ks, top_ps, min_ps)


def test_apply_penalties_touches_only_seen_tokens_as_the_dense_form_does():
    gen = torch.Generator().manual_seed(3)
    vocab = 3001
    logits = torch.randn(12, vocab, generator=gen) * 4
    entries = []
    for j, row in enumerate([0, 2, 3, 5, 6, 7, 9, 11]):  # rows 1, 4, 8, 10 are not penalised
        prompt = torch.randint(0, vocab, (int(torch.randint(0, 300, (1,), generator=gen)),), generator=gen).tolist()
        output = torch.randint(0, 50, (int(torch.randint(0, 80, (1,), generator=gen)),), generator=gen).tolist()
        if j == 1:
            prompt, output = [], []  # nothing seen
        if j == 2:
            output = prompt[:5] * 3  # repeated tokens, also in the prompt
        repetition = [1.0, 1.3, 0.8, 2.0][j % 4]
        frequency, presence = [(0.0, 0.0), (0.5, 0.0), (0.0, -0.7), (1.2, 0.4)][(j // 2) % 4]
        entries.append((row, prompt, output, repetition, frequency, presence))
    # Each history is read up to its length: what follows in its buffer (a worker's has room
    # for later tokens) is out of the vocabulary here, and must not be read.
    histories = [torch.tensor(prompt + output + [vocab + 7] * 5) for _, prompt, output, *_ in entries]
    actual = logits.clone()
    cpu_ops.apply_penalties(actual, torch.tensor([e[0] for e in entries]), histories,
                            torch.tensor([len(e[1]) + len(e[2]) for e in entries]),
                            torch.tensor([len(e[1]) for e in entries]),
                            torch.tensor([e[3] for e in entries]), torch.tensor([e[4] for e in entries]),
                            torch.tensor([e[5] for e in entries]))
    torch.testing.assert_close(actual, dense_penalties(logits, entries), rtol=0, atol=0)


def test_apply_penalties_refuses_a_token_outside_the_vocabulary():
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cpu_ops.apply_penalties(logits, torch.tensor([1]), [torch.tensor([3, 10])], torch.tensor([2]),
                                torch.tensor([1]), torch.tensor([1.2]), torch.zeros(1), torch.zeros(1))
    assert not logits.any()  # nothing written


# Row counts on both sides of the threading grain; widths with and without a SIMD tail.
@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 1000), (70, 333)])
def test_count_greater_counts_what_the_comparison_finds_greater(rows, vocab):
    # A logprob's rank (ranks_and_top): NaN is greater than nothing and nothing than NaN;
    # a value equal to the threshold is not greater.
    gen = torch.Generator().manual_seed(rows + vocab)
    padded = torch.randn(rows, vocab + 7, generator=gen)
    values = padded[:, 3:3 + vocab]  # strided rows, as a column slice of padded logits
    values[0, 0] = math.nan
    values[-1, -1] = math.inf
    values[rows // 2, :2] = -math.inf
    specials = [None, math.nan, math.inf, -math.inf]
    thresholds = torch.tensor([values[r, r % vocab].item() if specials[r % 4] is None else specials[r % 4]
                               for r in range(rows)])
    expected = (values > thresholds.unsqueeze(1)).sum(dim=-1)
    assert torch.equal(cpu_ops.count_greater(values, thresholds), expected)


@pytest.mark.parametrize("case", ["bf16 values", "strided values", "thresholds per row"])
def test_count_greater_rejects_what_it_cannot_count(case):
    values, thresholds = torch.zeros(3, 8), torch.zeros(3)
    if case == "bf16 values":
        values = values.to(torch.bfloat16)
    elif case == "strided values":
        values = torch.zeros(8, 3).t()
    else:
        thresholds = torch.zeros(2)
    with pytest.raises(RuntimeError, match="count_greater"):
        cpu_ops.count_greater(values, thresholds)


# Widths inside one block, with and without a SIMD tail, and across blocks (2048) with a tail.
@pytest.mark.parametrize("vocab", [1, 7, 16, 100, 2048, 5003])
def test_argmax_rows_is_torchs_max_indices_exactly(vocab):
    # The greedy token: the first index of the maximum on ties, a NaN counting as the maximum
    # (its first index), a row of -inf giving 0, -0 equal to +0; strided rows, transposed
    # views and a row index list (rows read in place, repeated, in any order).
    gen = torch.Generator().manual_seed(vocab)
    padded = torch.randint(-4, 4, (12, vocab + 5), generator=gen).float()  # few values: many ties
    logits = padded[:, 2:2 + vocab]
    logits[1] = -math.inf
    logits[2, vocab // 2] = math.nan
    logits[3] = math.nan
    logits[4, -1] = math.inf
    logits[4, vocab // 3] = math.inf
    logits[5] = torch.where(torch.arange(vocab) % 2 == 0, -0.0, 0.0)
    logits[6, -1] = 100.0  # the maximum in the last element (a block's tail)
    logits[7, vocab // 2:] = math.nan
    logits[7, vocab - 1] = 1000.0
    logits[8, :-1] = -math.inf
    expected = logits.max(dim=-1).indices
    assert torch.equal(cpu_ops.argmax_rows(logits), expected)
    transposed = logits.t().contiguous().t()
    assert transposed.stride(1) != 1 or vocab == 1
    assert torch.equal(cpu_ops.argmax_rows(transposed), expected)
    rows = torch.tensor([8, 3, 3, 0, 11, 2])
    assert torch.equal(cpu_ops.argmax_rows(logits, rows), logits[rows].max(dim=-1).indices)
    assert cpu_ops.argmax_rows(logits, torch.tensor([], dtype=torch.long)).shape == (0,)


def test_argmax_rows_of_many_random_rows_across_threads():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(70, 3000, generator=gen).round(decimals=1)  # ties of the maximum
    assert torch.equal(cpu_ops.argmax_rows(logits), logits.max(dim=-1).indices)


@pytest.mark.parametrize("case", ["bf16 logits", "no logits", "a row outside", "a negative row", "int32 rows"])
def test_argmax_rows_rejects_what_it_cannot_read(case):
    logits, rows = torch.zeros(3, 8), torch.tensor([0, 2])
    if case == "bf16 logits":
        logits = logits.to(torch.bfloat16)
    elif case == "no logits":
        logits = torch.zeros(3, 0)
    elif case == "a row outside":
        rows = torch.tensor([0, 3])
    elif case == "a negative row":
        rows = torch.tensor([-1])
    with pytest.raises((RuntimeError, ValueError), match="argmax_rows"):
        if case == "int32 rows":
            torch.ops.raylm.argmax_rows(logits, rows.int())
        cpu_ops.argmax_rows(logits, rows)


@pytest.mark.parametrize("truncated", [False, True])
def test_draws_of_a_row_index_list_are_the_draws_of_the_gathered_rows(truncated):
    # A mixed batch's random rows drawn in place: the same tokens as drawing a copy of them.
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 3001, generator=gen)
    logits[4] = math.nan
    rows = torch.tensor([7, 1, 4, 1, 8])
    temperatures, uniforms = torch.rand(5, generator=gen) + 0.5, torch.rand(5, generator=gen)
    if truncated:
        cuts = torch.tensor([3000, 20, 5, 3001, 100]), torch.tensor([1.0, 0.9, 1.0, 0.5, 0.99]), torch.zeros(5)
        tokens = cpu_ops.random_sample_truncated(logits, temperatures, uniforms, *cuts, rows=rows)
        expected = cpu_ops.random_sample_truncated(logits[rows], temperatures, uniforms, *cuts)
    else:
        tokens = cpu_ops.random_sample(logits, temperatures, uniforms, rows)
        expected = cpu_ops.random_sample(logits[rows], temperatures, uniforms)
    assert torch.equal(tokens, expected)
    assert tokens[2].item() == -1
    with pytest.raises(ValueError, match="row 9 is outside"):
        cpu_ops.random_sample(logits, temperatures, uniforms, torch.tensor([0, 1, 2, 3, 9]))
    with pytest.raises(RuntimeError, match="one per row"):
        cpu_ops.random_sample(logits, temperatures, uniforms, torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype,cache_dtype", query_and_cache_dtypes(DTYPES, ["fp32_cache", "bf16_cache"]))
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", ATTENTION_SHAPES)
def test_decode_attention(head_size, num_heads, num_kv_heads, dtype, cache_dtype):
    seq_lens = [1, 15, 16, 17, 100, 257]
    query, k_cache, v_cache, md = build_cached_step([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads,
                                                    head_size, dtype=cache_dtype, seed=head_size)
    query = query.to(dtype)
    scale = 1.0 / math.sqrt(head_size)
    out = torch.ops.raylm.paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, scale)
    assert_close(out, float64_attention(query, k_cache, v_cache, md, scale), dtype)


@pytest.mark.parametrize("block_size", [1, 8, 24])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [32, 40])
def test_decode_attention_with_other_block_sizes(head_size, dtype, block_size):
    # Blocks that are not a multiple of 8 keys take the one-key-at-a-time code.
    seq_lens = [1, 7, 9, 40, 101]
    query, k_cache, v_cache, md = build_cached_step([1] * len(seq_lens), seq_lens, 8, 4, head_size, block_size,
                                                    dtype=dtype, seed=block_size)
    out = torch.ops.raylm.paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, 0.3)
    assert_close(out, float64_attention(query, k_cache, v_cache, md, 0.3), dtype)


@pytest.mark.parametrize("dtype,cache_dtype", query_and_cache_dtypes(DTYPES, ["fp32_cache", "bf16_cache"]))
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", ATTENTION_SHAPES)
def test_prefill_attention(head_size, num_heads, num_kv_heads, dtype, cache_dtype):
    # A whole prompt, an extend after cached tokens, a short chunk mid-block.
    query_lens, seq_lens = [70, 20, 3], [70, 150, 21]
    query, k_cache, v_cache, md = build_cached_step(query_lens, seq_lens, num_heads, num_kv_heads, head_size,
                                                    dtype=cache_dtype, seed=head_size + 1)
    query = query.to(dtype)
    scale = 1.0 / math.sqrt(head_size)
    out = torch.ops.raylm.paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                  md.query_start_loc, scale, 1)
    assert_close(out, float64_attention(query, k_cache, v_cache, md, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (40, 8), (32, 1), (128, 32)])
def test_windowed_soft_capped_decode_attention(head_size, block_size, dtype):
    # Blocks before each window point at a NaN block (build_cached_step), as freed ones do.
    seq_lens = [1, 15, 40, 101, 257]
    query, k_cache, v_cache, md = build_cached_step([1] * len(seq_lens), seq_lens, 8, 2, head_size, block_size,
                                                    dtype=dtype, seed=head_size, sliding_window=23)
    scale = 2.0 / math.sqrt(head_size)
    out = torch.ops.raylm.paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, scale, 23,
                                                 3.0)
    assert_close(out, float64_attention(query, k_cache, v_cache, md, scale, 23, 3.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [7, 70])
def test_windowed_soft_capped_prefill_attention(window, dtype):
    query_lens, seq_lens = [200, 20, 3, 1], [200, 150, 21, 90]
    query, k_cache, v_cache, md = build_cached_step(query_lens, seq_lens, 8, 2, 64, dtype=dtype, seed=window,
                                                    sliding_window=window)
    out = torch.ops.raylm.paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                  md.query_start_loc, 0.25, 1, window, 3.0)
    assert_close(out, float64_attention(query, k_cache, v_cache, md, 0.25, window, 3.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_reads_query_rows_in_place_from_the_qkv_projection(dtype):
    # q as the attention layer passes it: a column slice of [T, (Hq + 2 Hkv) * D].
    query, k_cache, v_cache, md = build_cached_step([1, 1, 5], [9, 30, 5], 4, 2, 32, seed=7)
    qkv = torch.cat([query.flatten(1), torch.randn(query.shape[0], 2 * 2 * 32)], dim=1).to(dtype)
    q = qkv[:, :4 * 32].view(-1, 4, 32)
    decode = torch.ops.raylm.paged_decode_attention
    decode_args = (k_cache, v_cache, md.block_tables[:2], md.seq_lens[:2], 0.2)
    assert torch.equal(decode(q[:2], *decode_args), decode(q[:2].contiguous(), *decode_args))
    prefill = torch.ops.raylm.paged_prefill_attention
    prefill_args = (k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.2, 1)
    assert torch.equal(prefill(q, *prefill_args), prefill(q.contiguous(), *prefill_args))


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    """gpt-oss's attention sinks for a test: spread around 0, one far above every score (its
    head's output near 0) and one far below (no effect)."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 30.0, -30.0
    return sinks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,block_size,window,soft_cap", [(64, 16, None, None), (64, 16, 23, 3.0),
                                                                   (40, 8, None, None), (32, 1, 23, None),
                                                                   (128, 32, None, 3.0)])
def test_decode_attention_with_sinks(head_size, block_size, window, soft_cap, dtype):
    """The wide (head size a multiple of 16, blocks of 4s) and the block-by-block paths."""
    seq_lens = [1, 15, 40, 101, 257]
    query, k_cache, v_cache, md = build_cached_step([1] * len(seq_lens), seq_lens, 8, 2, head_size, block_size,
                                                    dtype=dtype, seed=head_size, sliding_window=window)
    sinks, scale = _sinks(8, head_size), 2.0 / math.sqrt(head_size)
    out = torch.ops.raylm.paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, scale,
                                                 window or 0, soft_cap or 0.0, sinks=sinks)
    assert_close(out, float64_attention(query, k_cache, v_cache, md, scale, window, soft_cap, sinks), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,window,soft_cap", [(64, None, None), (64, 7, 3.0), (40, 70, None)])
def test_prefill_attention_with_sinks(head_size, window, soft_cap, dtype):
    query_lens, seq_lens = [70, 20, 3, 1], [70, 150, 21, 90]
    query, k_cache, v_cache, md = build_cached_step(query_lens, seq_lens, 8, 2, head_size, dtype=dtype,
                                                    seed=head_size + 3, sliding_window=window)
    sinks = _sinks(8, head_size + 1)
    out = torch.ops.raylm.paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                  md.query_start_loc, 0.25, 1, window or 0, soft_cap or 0.0, sinks=sinks)
    assert_close(out, float64_attention(query, k_cache, v_cache, md, 0.25, window, soft_cap, sinks), dtype)


def test_sinks_of_another_head_count_are_a_value_error():
    query, k_cache, v_cache, md = build_cached_step([1, 3], [5, 9], 4, 2, 32, seed=1)
    with pytest.raises(ValueError, match=r"sinks must be one value per query head \[4\]"):
        torch.ops.raylm.paged_decode_attention(query[:1], k_cache, v_cache, md.block_tables[:1], md.seq_lens[:1],
                                               0.2, 0, 0.0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match=r"sinks must be one value per query head \[4\]"):
        torch.ops.raylm.paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                md.query_start_loc, 0.2, 1, 0, 0.0, sinks=torch.zeros(5))


# ---- fp8 caches, read by the kernels directly ----------------------------------------------

FP8_FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
# (k_scale, v_scale) per format: small enough that the largest keys and values (3 x randn,
# beyond 6.7 and 9 or 5.7 and 8.6) saturate.
FP8_SCALES = {torch.float8_e4m3fn: (0.015, 0.02), torch.float8_e5m2: (0.0001, 0.00015)}


def fp8_cached_step(query_lens, seq_lens, num_heads, num_kv_heads, head_size, fp8, block_size=16, seed=0,
                    sliding_window=None):
    """build_cached_step with its K and V stored as an fp8 cache stores them (x / scale,
    saturated; the NaN slots NaN codes); returns the query, the fp8 caches, the metadata,
    the scales and the caches as the reference reads them (`dequantize`, fp32)."""
    query, k, v, md = build_cached_step(query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
                                        seed=seed, sliding_window=sliding_window)
    k_scale, v_scale = FP8_SCALES[fp8]
    k_cache, v_cache = quantize(k * 3, fp8, k_scale), quantize(v * 3, fp8, v_scale)
    return query, k_cache, v_cache, md, (k_scale, v_scale), (dequantize(k_cache, k_scale), dequantize(v_cache, v_scale))


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_size", [32, 40])
def test_an_fp8_cache_reads_every_code_as_torch_converts_it(head_size, fp8):
    """One-token sequences (a softmax weight of 1): each output row is its value row times
    v_scale, exactly; the 256 codes spread over the rows, subnormals, infinities and NaNs
    included, through decode (the AVX-512 path at 32, the AVX2 one at 40) and prefill."""
    num_seqs = -(-256 // head_size)
    values = torch.zeros(num_seqs * head_size, dtype=torch.uint8)
    values[:256] = torch.arange(256, dtype=torch.uint8)
    v_cache = torch.zeros(num_seqs, 4, 1, head_size, dtype=torch.uint8)
    v_cache[:, 0, 0] = values.view(num_seqs, head_size)
    v_cache = v_cache.view(fp8)
    k_cache = torch.zeros_like(v_cache)
    query = torch.randn(num_seqs, 1, head_size)
    tables, lens = torch.arange(num_seqs, dtype=torch.int32)[:, None], torch.ones(num_seqs, dtype=torch.int32)
    expected = v_cache[:, 0].float() * 0.5
    out = torch.ops.raylm.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.1, 0, 0.0, 3.0, 0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    out = torch.ops.raylm.paged_prefill_attention(query, k_cache, v_cache, tables, lens, starts, 0.1, 1, 0, 0.0,
                                                  3.0, 0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype,fp8", query_and_cache_dtypes(FP8_FORMATS, ["e4m3", "e5m2"]))
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", ATTENTION_SHAPES)
def test_decode_attention_over_an_fp8_cache(head_size, num_heads, num_kv_heads, dtype, fp8):
    """Against float64 attention over the dequantized cache (the reference's values):
    scattered blocks of a NaN-poisoned cache, the scales applied."""
    seq_lens = [1, 15, 16, 17, 100, 257]
    query, k_cache, v_cache, md, (k_scale, v_scale), (k32, v32) = fp8_cached_step(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_size, fp8, seed=head_size)
    query = query.to(dtype)
    scale = 1.0 / math.sqrt(head_size)
    out = torch.ops.raylm.paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, scale, 0, 0.0,
                                                 k_scale, v_scale)
    assert_close(out, float64_attention(query, k32, v32, md, scale), dtype)


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_size,block_size", [(32, 1), (40, 24), (64, 8), (128, 32)])
def test_windowed_soft_capped_decode_over_an_fp8_cache_with_other_block_sizes(head_size, block_size, fp8):
    # Blocks that are not a multiple of 4 or 8 keys take the one-key-at-a-time code.
    seq_lens = [1, 7, 40, 101]
    query, k_cache, v_cache, md, (k_scale, v_scale), (k32, v32) = fp8_cached_step(
        [1] * len(seq_lens), seq_lens, 8, 2, head_size, fp8, block_size, seed=block_size, sliding_window=23)
    out = torch.ops.raylm.paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, 0.3, 23, 3.0,
                                                 k_scale, v_scale)
    assert_close(out, float64_attention(query, k32, v32, md, 0.3, 23, 3.0), torch.float32)


@pytest.mark.parametrize("dtype,fp8", query_and_cache_dtypes(FP8_FORMATS, ["e4m3", "e5m2"]))
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(32, 8, 2), (64, 4, 4), (40, 8, 4), (36, 8, 4)])
def test_prefill_and_extend_attention_over_an_fp8_cache(head_size, num_heads, num_kv_heads, dtype, fp8):
    # A whole prompt, an extend after cached tokens, a short chunk mid-block.
    query_lens, seq_lens = [70, 20, 3], [70, 150, 21]
    query, k_cache, v_cache, md, (k_scale, v_scale), (k32, v32) = fp8_cached_step(
        query_lens, seq_lens, num_heads, num_kv_heads, head_size, fp8, seed=head_size + 1)
    query = query.to(dtype)
    scale = 1.0 / math.sqrt(head_size)
    out = torch.ops.raylm.paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                  md.query_start_loc, scale, 1, 0, 0.0, k_scale, v_scale)
    assert_close(out, float64_attention(query, k32, v32, md, scale), dtype)


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=["e4m3", "e5m2"])
def test_windowed_soft_capped_prefill_over_an_fp8_cache(fp8):
    query_lens, seq_lens = [200, 20, 3, 1], [200, 150, 21, 90]
    query, k_cache, v_cache, md, (k_scale, v_scale), (k32, v32) = fp8_cached_step(
        query_lens, seq_lens, 8, 2, 64, fp8, seed=5, sliding_window=70)
    out = torch.ops.raylm.paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                  md.query_start_loc, 0.25, 1, 70, 3.0, k_scale, v_scale)
    assert_close(out, float64_attention(query, k32, v32, md, 0.25, 70, 3.0), torch.float32)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_the_kernels_refuse_an_fp8_scale_that_is_not_positive_and_finite(op):
    query, k_cache, v_cache, md, _, _ = fp8_cached_step([1, 1], [5, 9], 4, 2, 32, torch.float8_e4m3fn)
    for k_scale, v_scale in [(0.0, 1.0), (1.0, -2.0), (math.inf, 1.0), (1.0, math.nan)]:
        with pytest.raises(ValueError, match=r"k_scale \(.*\) and v_scale \(.*\) must be positive and finite"):
            if op == "decode":
                torch.ops.raylm.paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, 0.2, 0,
                                                       0.0, k_scale, v_scale)
            else:
                torch.ops.raylm.paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                        md.query_start_loc, 0.2, 1, 0, 0.0, k_scale, v_scale)


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_size,block_size,window,soft_cap", [(64, 16, None, None), (40, 8, 23, 3.0),
                                                                   (32, 1, None, None)])
def test_decode_attention_over_an_fp8_cache_with_sinks(head_size, block_size, window, soft_cap, fp8):
    """gpt-oss with kv_cache_dtype fp8: the sink joins the denominator against the same
    running maximum as the scores (k_scale in them), the output is v_scale * acc / (sum +
    sink term); the wide, block-by-block and one-key-at-a-time paths."""
    seq_lens = [1, 15, 40, 101, 257]
    query, k_cache, v_cache, md, (k_scale, v_scale), (k32, v32) = fp8_cached_step(
        [1] * len(seq_lens), seq_lens, 8, 2, head_size, fp8, block_size, seed=head_size, sliding_window=window)
    sinks, scale = _sinks(8, head_size), 1.0 / math.sqrt(head_size)
    out = torch.ops.raylm.paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, scale,
                                                 window or 0, soft_cap or 0.0, k_scale, v_scale, sinks)
    assert_close(out, float64_attention(query, k32, v32, md, scale, window, soft_cap, sinks), torch.float32)


@pytest.mark.parametrize("fp8", FP8_FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,window,soft_cap", [(64, None, None), (40, 7, 3.0)])
def test_prefill_attention_over_an_fp8_cache_with_sinks(head_size, window, soft_cap, dtype, fp8):
    query_lens, seq_lens = [70, 20, 3, 1], [70, 150, 21, 90]
    query, k_cache, v_cache, md, (k_scale, v_scale), (k32, v32) = fp8_cached_step(
        query_lens, seq_lens, 8, 2, head_size, fp8, seed=head_size + 3, sliding_window=window)
    query, sinks, scale = query.to(dtype), _sinks(8, head_size + 1), 1.0 / math.sqrt(head_size)
    out = torch.ops.raylm.paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                                  md.query_start_loc, scale, 1, window or 0, soft_cap or 0.0,
                                                  k_scale, v_scale, sinks)
    assert_close(out, float64_attention(query, k32, v32, md, scale, window, soft_cap, sinks), dtype)


def test_an_unknown_isa_is_an_error_naming_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("RAYLM_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match=r"RAYLM_CPU_ISA must be one of avx512, avx512_no_bf16, avx2, scalar, "
                                         r"got 'sse9'"):
        native_build.compile_flags()


def _isas_this_cpu_runs() -> list[str]:
    cpu_flags = native_build._cpu_flags().split()
    return [isa for isa, (_, needs) in native_build._ISA_FLAGS.items()
            if isa == "scalar" or (sys.platform == "linux" and all(flag in cpu_flags for flag in needs))]


@pytest.mark.parametrize("isa", list(native_build._ISA_FLAGS))
def test_narrower_isa_passes(isa):
    if envs.RAYLM_CPU_ISA:
        pytest.skip("already a subprocess of one ISA")
    if isa not in _isas_this_cpu_runs():
        pytest.skip(f"this CPU cannot run {isa} code")
    if isa == _isas_this_cpu_runs()[0]:
        pytest.skip(f"{isa} is this process's own build (-march=native)")
    if isa == "avx512_no_bf16" and "avx512_bf16" not in native_build._cpu_flags().split():
        pytest.skip("this process's own build has no AVX512-BF16 either")
    env = {**os.environ, "RAYLM_CPU_ISA": isa}
    # This file's libraries of this ISA first, compiled side by side (the tests would build them one by one).
    subprocess.run([sys.executable, "-m", "raylm.kernels.native_build", *ISA_LIBRARIES], env=env, capture_output=True,
                   timeout=600)
    result = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-x",
                             "-k", "not narrower_isa", "-m", "not same_isa_path"], env=env,
                            cwd=Path(__file__).parent.parent,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_bgmv_adds_each_tokens_own_adapter(dtype):
    """csrc/cpu_lora.cpp: tokens of slots 0-3 (adapters of ranks 16, 3, 9, 1 in slots of 16) get
    their adapter's product for 1 and 3 output slices; base-model tokens (-1) stay bitwise."""
    from test_lora_kernels import offsets_of, random_case, reference

    if native_build.load_native_library("cpu_lora") is None:
        pytest.skip("the LoRA kernel cannot be built here")
    for out_sizes in ([48], [64, 16, 19]):
        x, lora_a, lora_b, slots, base = random_case(23, 37, out_sizes, dtype, seed=len(out_sizes))
        out = base.clone()
        torch.ops.raylm.lora_bgmv(out, x, lora_a, lora_b, offsets_of(out_sizes), slots.to(torch.int32), 16)
        assert_close(out, reference(x, lora_a, lora_b, slots, base), dtype)
        assert torch.equal(out[slots < 0], base[slots < 0])


@pytest.mark.parametrize("bad", ["slot_past_the_slots", "offset_past_the_columns", "offset_that_wraps_int64",
                                 "fewer_slots_than_tokens"])
def test_lora_bgmv_refuses_indices_out_of_range_before_touching_memory(bad):
    """csrc/cpu_lora.cpp checks every index it reads or writes through against the tensors'
    sizes: a bad one is an error and `out` is unchanged (an offset near INT64_MAX used to pass
    the column check by overflowing `offset + width`, and the kernel wrote far outside `out`)."""
    from test_lora_kernels import SLOTS, offsets_of, random_case

    if native_build.load_native_library("cpu_lora") is None:
        pytest.skip("the LoRA kernel cannot be built here")
    out_sizes = [48]
    x, lora_a, lora_b, slots, base = random_case(5, 37, out_sizes, torch.float32, seed=0)
    slots, offsets = slots.to(torch.int32), offsets_of(out_sizes)
    if bad == "slot_past_the_slots":
        slots[2] = SLOTS
    elif bad == "offset_past_the_columns":
        offsets = [1]
    elif bad == "offset_that_wraps_int64":
        offsets = [2 ** 63 - 1]
    else:
        slots = slots[:-1]
    out = base.clone()
    with pytest.raises(RuntimeError, match="raylm::lora_bgmv"):
        torch.ops.raylm.lora_bgmv(out, x, lora_a, lora_b, offsets, slots, 16)
    assert torch.equal(out, base)


def test_fp8_linear_widens_every_e4m3_value_and_multiplies_as_float64_does():
    """csrc/cpu_fp8_linear.cpp: blocks of 8 tokens x 3 rows with remainders, features not a
    multiple of 16, per-row scales; and every e4m3 value (subnormals included) widened exactly."""
    if native_build.load_native_library("cpu_fp8_linear") is None:
        pytest.skip("the FP8 kernel cannot be built here")
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(7, 37, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(7, generator=generator)
    x = torch.randn(11, 37, generator=generator)
    out = torch.ops.raylm.fp8_linear(x, weight.view(torch.uint8), scale)
    expected = x.double() @ (weight.double() * scale.double()[:, None]).T
    assert_close(out, expected, torch.float32)
    values = torch.arange(256, dtype=torch.uint8)
    values[[0x7f, 0xff]] = 0  # the NaNs
    widened = torch.ops.raylm.fp8_linear(torch.eye(256), values.reshape(1, 256), torch.ones(1))[:, 0]
    assert torch.equal(widened, values.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("block", [None, (16, 32)], ids=["per-row", "block"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_experts_dequantize_every_e4m3_value_times_its_scale_rounded_once(dtype, block):
    """csrc/cpu_fused_moe.cpp's dequantize_fp8_experts (FP8 MoE experts): every e4m3 code
    (NaNs and subnormals included) of the chosen experts times its row's or block's scale,
    exactly PyTorch's fp32 product rounded once to the dtype; 70 columns leave a tail for every
    vector width, 40 rows a partial last block."""
    from raylm.kernels import cpu_fused_moe, fp8_fused_moe

    if not cpu_fused_moe.library_loaded():
        pytest.skip("the fused MoE kernel cannot be built here")
    generator = torch.Generator().manual_seed(0)
    experts, rows, columns = 4, 40, 70
    codes = torch.randint(0, 256, (experts, rows, columns), dtype=torch.uint8, generator=generator)
    codes[1].view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    weight = codes.view(torch.float8_e4m3fn)
    grid = (experts, rows) if block is None else (experts, 3, 3)
    scale = torch.rand(grid, generator=generator) + 0.01
    chosen = torch.tensor([1, 3, 0])
    out = fp8_fused_moe.dequantize_experts(weight, scale, block, chosen, dtype)
    expanded = (scale[chosen, :, None] if block is None else
                scale[chosen].repeat_interleave(16, 1)[:, :rows].repeat_interleave(32, 2)[:, :, :columns])
    expected = (weight[chosen].float() * expanded).to(dtype)
    assert out.dtype == dtype
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())


def test_int4_linear_multiplies_gptq_and_awq_codes_as_float64_does():
    """csrc/cpu_int4_linear.cpp: 4-bit AWQ with act-order-free groups of 32 and 8-bit GPTQ with
    act order, 40 output columns (a partial block of 32), 1 to 2 tokens from the codes in
    registers and 5 from the widened tile; the reference is (code - zero) * scale in float64.
    The kernel folds each group's zero in as zero * scale * sum(x) (fp32 rounding of sums
    as large as the layer's largest output), so the tolerance is relative to that output."""
    from test_int4_linear import int4_layer, native_product

    if native_build.load_native_library("cpu_int4_linear") is None:
        pytest.skip("the int4 kernel cannot be built here")
    for layout, group_size, desc_act, bits in [("awq", 32, False, 4), ("gptq", 64, True, 8)]:
        packed, zero_offset, weight = int4_layer(layout, 128, 40, group_size, desc_act, bits)
        for tokens in (1, 2, 5):
            x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(tokens))
            expected = x.double() @ weight
            torch.testing.assert_close(native_product(x, layout, packed, zero_offset, bits).double(), expected,
                                       rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _int4_linear_arguments() -> dict:
    """Arguments int4_linear takes: a 4-bit GPTQ layer of 64 inputs (2 groups of 32) and 40
    outputs as repack_for_cpu leaves it, and 2 tokens."""
    from test_int4_linear import int4_layer

    from raylm.kernels.int4_linear import repack_for_cpu

    packed, zero_offset, _ = int4_layer("gptq", 64, 40, 32)
    weight = repack_for_cpu(*packed, 4, False, zero_offset)
    return dict(x=torch.randn(2, weight.weight.shape[1] * 8), weight=weight.weight, scales=weight.scales,
                zero_scales=weight.zero_scales, chunk_starts=weight.chunk_starts, chunk_groups=weight.chunk_groups,
                bits=4, out_features=40)


def _int4_experts_arguments() -> dict:
    """Arguments dequantize_int4_experts takes: 3 GPTQ 4-bit experts of 64 inputs (2 groups of
    32, each row's group in g_idx) and 16 outputs, experts 2 and 0 chosen."""
    words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32)
    return dict(qweight=words(3, 8, 16), qzeros=words(3, 2, 2), scales=torch.rand(3, 2, 16),
                g_idx=torch.arange(64, dtype=torch.int32).repeat(3, 1) // 32, experts=torch.tensor([2, 0]), bits=4,
                awq=False, zero_offset=1, group_size=0, dtype=torch.float32)


def _with_group(g_idx: torch.Tensor, expert: int, row: int, group: int) -> torch.Tensor:
    g_idx = g_idx.clone()
    g_idx[expert, row] = group
    return g_idx


# (op, the arguments changed, the error, its message): each check of csrc/int4_checks.h once.
INT4_REFUSALS = [
    ("int4_linear", lambda a: dict(bits=6), RuntimeError, r"raylm::int4_linear: bits must be 4 or 8, got 6"),
    ("int4_linear", lambda a: dict(x=a["x"].t().contiguous().t()), RuntimeError,
     r"raylm::int4_linear: x must be a contiguous \[T, K\] Float CPU tensor, got a non-contiguous \[2, 64\]"),
    ("int4_linear", lambda a: dict(zero_scales=a["zero_scales"][:, :1].contiguous()), RuntimeError,
     r"zero_scales must be a contiguous \[blocks, groups, 32\] Float CPU tensor, got \[2, 1, 32\] Float"),
    ("int4_linear", lambda a: dict(chunk_groups=torch.full_like(a["chunk_groups"], 2)), ValueError,
     r"raylm::int4_linear: chunk_groups\[0\] = 2 is outside 0 to 1"),
    ("dequantize_int4_experts", lambda a: dict(bits=8, awq=True), RuntimeError,
     r"raylm::dequantize_int4_experts: bits must be 4 for AWQ, got 8"),
    ("dequantize_int4_experts", lambda a: dict(qzeros=a["qzeros"].long()), RuntimeError,
     r"qzeros must be a contiguous \[E, groups, out / pack\] Int CPU tensor, got \[3, 2, 2\] Long"),
    ("dequantize_int4_experts", lambda a: dict(experts=torch.tensor([0, 3])), ValueError,
     r"raylm::dequantize_int4_experts: experts\[1\] = 3 is outside 0 to 2"),
    ("dequantize_int4_experts", lambda a: dict(g_idx=_with_group(a["g_idx"], 2, 5, 9)), ValueError,
     r"raylm::dequantize_int4_experts: g_idx\[2, 5\] = 9 is outside 0 to 1"),
]


@pytest.mark.parametrize("op,change,error,message", INT4_REFUSALS,
                         ids=["linear-bits", "linear-strided-x", "linear-zero-scales-groups", "linear-chunk-group",
                              "experts-awq-8-bit", "experts-int64-qzeros", "experts-id", "experts-g-idx"])
def test_int4_ops_refuse_arguments_outside_their_layout_naming_op_argument_and_value(op, change, error, message):
    """csrc/int4_checks.h: a kernel never reads outside its tensors; the valid arguments run."""
    library = "cpu_int4_linear" if op == "int4_linear" else "cpu_int4_experts"
    if native_build.load_native_library(library) is None:
        pytest.skip(f"{library} cannot be built here")
    arguments = _int4_linear_arguments() if op == "int4_linear" else _int4_experts_arguments()
    run = getattr(torch.ops.raylm, op)
    run(**arguments)
    with pytest.raises(error, match=message):
        run(**{**arguments, **change(arguments)})


# (method, bits, group_size (-1: one group), desc_act, zero_offset, in, out): GPTQ v1 (zeros
# stored minus 1) and v2, 4 and 8 bits, AWQ; 76 and 75 inputs leave a partial last group and
# a tail past the last whole vector of every width, 72 a tail of AVX-512's 16.
INT4_EXPERT_CASES = [("gptq", 4, 128, False, 1, 256, 48), ("gptq", 8, 32, False, 0, 76, 40),
                     ("gptq", 4, -1, False, 1, 72, 24), ("gptq", 4, 32, True, 1, 96, 16),
                     ("gptq", 8, 16, True, 0, 64, 8), ("awq", 4, 32, False, 0, 75, 40),
                     ("awq", 4, -1, False, 0, 64, 16)]


@pytest.mark.parametrize("method,bits,group_size,desc_act,zero_offset,in_features,out_features", INT4_EXPERT_CASES,
                         ids=["gptq-v1-g128", "gptq-v2-8-bit-g32-partial", "gptq-one-group", "gptq-desc-act",
                              "gptq-8-bit-desc-act", "awq-g32-partial", "awq-one-group"])
def test_int4_experts_dequantize_bit_for_bit_as_the_pytorch_fallback(
        monkeypatch, method, bits, group_size, desc_act, zero_offset, in_features, out_features):
    """csrc/cpu_int4_experts.cpp (GPTQ/AWQ MoE experts): the chosen experts' [out, in] weights,
    every bit of random packed codes and zeros, equal to kernels/int4_fused_moe.py's PyTorch
    dequantization (its kernel switch off) in fp32 and bf16."""
    from raylm.kernels import int4_fused_moe

    if native_build.load_native_library("cpu_int4_experts") is None:
        pytest.skip("the int4 experts kernel cannot be built here")
    generator = torch.Generator().manual_seed(bits + in_features)
    experts, pack, awq = 3, 32 // bits, method == "awq"
    groups = 1 if group_size == -1 else -(-in_features // group_size)
    words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=generator)
    qweight = (words(experts, in_features, out_features // 8) if awq
               else words(experts, in_features // pack, out_features))
    qzeros = words(experts, groups, out_features // pack)
    scales = torch.randn(experts, groups, out_features, generator=generator) * 0.01
    g_idx = (torch.randint(0, groups, (experts, in_features), dtype=torch.int32, generator=generator) if desc_act
             else None)
    rows_per_group = None if desc_act else in_features if group_size == -1 else group_size
    chosen = torch.tensor([2, 0])
    for dtype in DTYPES:
        native = torch.ops.raylm.dequantize_int4_experts(qweight, qzeros, scales, g_idx, chosen, bits, awq, zero_offset,
                                                         rows_per_group or 0, dtype)
        assert native.dtype == dtype and native.shape == (2, out_features, in_features)
        assert torch.equal(int4_fused_moe.dequantize_int4_experts(qweight, qzeros, scales, g_idx, chosen, bits, awq,
                                                                  zero_offset, dtype, rows_per_group), native)
        with monkeypatch.context() as switched:
            switched.setenv("RAYLM_TEST_DISABLE_KERNELS", "int4_experts")
            assert not int4_fused_moe._native_runs(qweight, dtype, bits, awq)
            fallback = int4_fused_moe.dequantize_int4_experts(qweight, qzeros, scales, g_idx, chosen, bits, awq,
                                                              zero_offset, dtype, rows_per_group)
        assert torch.equal(native, fallback)
