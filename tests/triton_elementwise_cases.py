"""The fused pointwise Triton kernels (raylm.kernels.triton_elementwise) against a PyTorch
reference in fp32, on the CPU under Triton's interpreter, or natively on a GPU.

Not collected by the suite (the name does not start with test_): `tests/test_triton_elementwise.py`
runs this file in a pytest subprocess with TRITON_INTERPRET=1 (which must be set before
the kernels are decorated and would otherwise leak into every later test of the process),
and imports its `check_*` functions for the native `cuda` tests. The interpreter computes
in NumPy and truncates fp32 -> bf16 casts where a GPU rounds to nearest, so the comparison
here is with the fp32 reference within a tolerance of a few units of the dtype's last
place; the native tests also compare with the PyTorch path of `models/` bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# max |kernel - reference| / max |reference|, reference in fp32 on the same (rounded) inputs.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (rows, hidden): Llama-3-8B's 4096, a 5120 that is no power of two of the block, Qwen2-0.5B's
# 896, a head size of 64 (Qwen3's q/k norms); 1, 7 and 300 rows.
NORM_SHAPES = [(1, 4096), (7, 5120), (300, 896), (7, 64)]
SILU_SHAPES = [(1, 14336), (7, 896), (300, 64)]
# (rows, query heads, key heads, head size, rotary dim): GQA 4 and 7, MHA, partial rotary.
ROTARY_SHAPES = [(1, 32, 8, 128, 128), (7, 14, 2, 64, 64), (300, 4, 4, 64, 32), (7, 12, 4, 80, 40)]


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + weight_offset)


def reference_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int,
                     rotary_dim: int) -> torch.Tensor:
    x = x.float().view(x.shape[0], -1, head_size)
    cos, sin = cos_sin_cache.float()[positions].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x[..., :rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1).flatten(1)


def cos_sin_cache(max_position: int, rotary_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """As models/rotary_embedding.py builds it: [max_position, rotary_dim], cos then sin."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device, dtype)


def check_rms_norm(ops, rows: int, hidden: int, dtype: torch.dtype, device: torch.device, weight_offset: float,
                   with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    # Rows strided as a column slice of a wider tensor, like a view the layers may pass.
    wide = torch.randn(rows, hidden + 16, generator=gen).to(device, dtype)
    x = wide[:, :hidden]
    residual = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype)
    eps = 1e-6
    past_the_slice = wide[:, hidden:].clone()
    if with_residual:
        total = (x.float() + residual.float()).to(dtype)
        expected = reference_rms_norm(total, weight, eps, weight_offset)
        original_x = x.clone()
        out, new_residual = ops.fused_add_rms_norm(x, residual, weight, eps, weight_offset)
        assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
        assert relative_error(new_residual, total) < TOLERANCE[dtype]
        assert not torch.equal(x, original_x)
        assert torch.equal(wide[:, hidden:], past_the_slice)
    else:
        expected = reference_rms_norm(x, weight, eps, weight_offset)
        before = wide.clone()
        out = ops.rms_norm(x, weight, eps, weight_offset)
        assert torch.equal(wide, before)
    assert out.dtype == dtype and out.shape == (rows, hidden)
    assert relative_error(out, expected) < TOLERANCE[dtype], relative_error(out, expected)


def check_silu_and_mul(ops, rows: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(rows + d)
    x = (3 * torch.randn(rows, 2 * d, generator=gen)).to(device, dtype)
    gate, up = x.float().chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = ops.silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (rows, d)
    assert relative_error(out, expected) < TOLERANCE[dtype], relative_error(out, expected)


def check_rotary(ops, rows: int, query_heads: int, key_heads: int, head_size: int, rotary_dim: int,
                 dtype: torch.dtype, device: torch.device, separate_key: bool) -> None:
    """Queries and keys as column slices of one fused QKV output: in one tensor (the Llama
    layers' call) or as two (Qwen3's)."""
    gen = torch.Generator().manual_seed(rows * head_size + query_heads)
    q_size, k_size = query_heads * head_size, key_heads * head_size
    qkv = torch.randn(rows, q_size + 2 * k_size, generator=gen).to(device, dtype)
    positions = torch.randint(0, 4096, (rows,), generator=gen).to(device)
    cache = cos_sin_cache(4096, rotary_dim, dtype, device)
    before = qkv.clone()
    if separate_key:
        query, key = qkv[:, :q_size], qkv[:, q_size:q_size + k_size]
        ops.rotary_embedding_(positions, query, key, cache, head_size, rotary_dim)
    else:
        ops.rotary_embedding_(positions, qkv[:, :q_size + k_size], None, cache, head_size, rotary_dim)
    expected = reference_rotary(before[:, :q_size + k_size], positions, cache, head_size, rotary_dim)
    assert relative_error(qkv[:, :q_size + k_size], expected) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, q_size + k_size:], before[:, q_size + k_size:])  # values untouched
    if rotary_dim < head_size:  # the channels past rotary_dim of every head untouched
        heads = qkv[:, :q_size + k_size].view(rows, -1, head_size)
        assert torch.equal(heads[..., rotary_dim:], before[:, :q_size + k_size].view(rows, -1, head_size)[..., rotary_dim:])


# ---- under the interpreter ----------------------------------------------------------------

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs under TRITON_INTERPRET=1 (tests/test_triton_elementwise.py starts it)")


@pytest.fixture(scope="module")
def ops():
    pytest.importorskip("triton")
    from raylm.kernels import triton_elementwise
    return triton_elementwise


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "fused_add"])
def test_rms_norm_matches_the_fp32_reference(ops, rows, hidden, dtype, with_residual):
    check_rms_norm(ops, rows, hidden, dtype, torch.device("cpu"), 0.0, with_residual)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "fused_add"])
def test_gemma_rms_norm_scales_by_one_plus_weight(ops, dtype, with_residual):
    check_rms_norm(ops, 7, 896, dtype, torch.device("cpu"), 1.0, with_residual)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,d", SILU_SHAPES)
def test_silu_and_mul_matches_the_fp32_reference(ops, rows, d, dtype):
    check_silu_and_mul(ops, rows, d, dtype, torch.device("cpu"))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,query_heads,key_heads,head_size,rotary_dim", ROTARY_SHAPES)
@pytest.mark.parametrize("separate_key", [False, True], ids=["qk_together", "q_and_k"])
def test_rotary_embedding_matches_the_fp32_reference_in_place(ops, rows, query_heads, key_heads, head_size,
                                                              rotary_dim, dtype, separate_key):
    check_rotary(ops, rows, query_heads, key_heads, head_size, rotary_dim, dtype, torch.device("cpu"), separate_key)


@interpreted
def test_zero_rows_launch_nothing(ops):
    x = torch.empty(0, 64)
    weight = torch.ones(64)
    assert ops.rms_norm(x, weight, 1e-6).shape == (0, 64)
    assert ops.fused_add_rms_norm(x, x.clone(), weight, 1e-6)[0].shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
    ops.rotary_embedding_(torch.empty(0, dtype=torch.int64), x, None, cos_sin_cache(8, 64, torch.float32,
                                                                                   torch.device("cpu")), 64, 64)
