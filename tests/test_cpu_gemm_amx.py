"""The AMX bf16 linear (`csrc/cpu_gemm_amx.cpp`) against x W^T + b in float64.

The kernel accumulates in fp32 and rounds once to bf16, so each output is within one bf16
rounding (2^-8 relative) of the float64 result, plus fp32 summation error, bounded here
by 1e-5 of the sum of |x| |W|. Shapes cover every padding path: rows not a multiple of 16,
k not a multiple of 32, outputs not a multiple of 16, more than four row tiles.
"""

from __future__ import annotations

import pytest
import torch

from raylm.kernels import cpu_gemm


@pytest.fixture(scope="module", autouse=True)
def amx():
    if not cpu_gemm.amx_linear_enabled():
        pytest.skip("no AMX here (or the kernel could not be built)")


def assert_matches_float64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    expected = x64 @ w64.T + (b.double() if b is not None else 0.0)
    scale = x64.abs() @ w64.abs().T
    error = (y.double().reshape(expected.shape) - expected).abs()
    bound = 2 ** -8 * expected.abs() + 1e-5 * scale + 1e-30
    assert y.dtype == torch.bfloat16 and y.shape == (*x.shape[:-1], w.shape[0])
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"


@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (5, 100, 37), (16, 32, 16), (17, 96, 48), (64, 256, 80),
                                   (70, 288, 33), (100, 1024, 48)])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_amx_linear_equals_float64(m, k, n, bias_dtype):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    b = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    y = torch.ops.raylm.amx_linear(x, cpu_gemm.maybe_pack_amx_weight(w), n, b)
    assert_matches_float64(y, x, w, b)


def test_leading_dimensions_and_strided_rows_are_taken_as_rows():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(24, 64, generator=gen).bfloat16()
    packed = cpu_gemm.maybe_pack_amx_weight(w)
    x3 = torch.randn(2, 9, 64, generator=gen).bfloat16()
    assert_matches_float64(torch.ops.raylm.amx_linear(x3, packed, 24, None), x3, w, None)
    wide = torch.randn(7, 100, generator=gen).bfloat16()
    x_cols = wide[:, 10:74]  # rows 100 elements apart
    assert_matches_float64(torch.ops.raylm.amx_linear(x_cols, packed, 24, None), x_cols, w, None)


def test_zero_rows_give_an_empty_result():
    w = torch.randn(16, 32).bfloat16()
    y = torch.ops.raylm.amx_linear(torch.empty(0, 32, dtype=torch.bfloat16), cpu_gemm.maybe_pack_amx_weight(w), 16, None)
    assert y.shape == (0, 16)


def test_a_packed_weight_of_other_sizes_is_refused():
    packed = cpu_gemm.maybe_pack_amx_weight(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="does not match K = 96"):
        torch.ops.raylm.amx_linear(torch.randn(4, 96).bfloat16(), packed, 32, None)


@pytest.mark.parametrize("tokens", [3, cpu_gemm.AMX_MAX_ROWS, cpu_gemm.AMX_MAX_ROWS + 1, 700])
def test_the_layer_gemm_equals_float64_on_both_sides_of_the_amx_row_limit(tokens):
    """cpu_gemm.linear takes the AMX kernel up to AMX_MAX_ROWS tokens and oneDNN above."""
    gen = torch.Generator().manual_seed(tokens)
    w = (torch.randn(48, 128, generator=gen) / 8).bfloat16()
    b = torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(tokens, 128, generator=gen).bfloat16()
    y = cpu_gemm.linear(x, w, cpu_gemm.maybe_pack_linear_weight(w), b, cpu_gemm.maybe_pack_decode_weight(w))
    assert_matches_float64(y, x, w, b)


def test_fp32_weights_are_not_packed_for_amx():
    assert cpu_gemm.maybe_pack_amx_weight(torch.randn(16, 32)) is None
