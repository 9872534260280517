"""The AVX2 linear (`csrc/cpu_gemm_avx2.cpp`) against x W^T + b in float64, fp32 and bf16
weights, and the layers' choice of it.

Both dtypes accumulate in fp32 (bf16 widened exactly). An fp32 output is within fp32
summation error of the float64 result (bounded here by 1e-5 of the sum of |x| |W|); a bf16
output adds one bf16 rounding (2^-8 relative). Shapes cover every path: every row count
from 1 to past a few of the kernel's 6-row groups, outputs not a multiple of its 16-column
panels (nor of 8), inputs longer than one block (256 fp32 steps, 512 bf16) with the partial
sums carried over, strided and batched rows, fewer panels than threads. The kernel is built
on AVX-512 machines too (their layers keep the AVX-512 kernel), so these tests run there.
"""

from __future__ import annotations

import pytest
import torch

from raylm.kernels import cpu_gemm
from tests.memory_maps import mapping_of
from test_cpu_gemm_avx512 import assert_matches_float64

DTYPES = [torch.float32, torch.bfloat16]


def built_or_skip(dtype: torch.dtype) -> None:
    if not cpu_gemm.avx2_linear_built(dtype):
        pytest.skip(f"no AVX2 kernel for {dtype} here (CPU or build)")


def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.raylm.avx2_linear(x, torch.ops.raylm.avx2_pack_weight(w), w.shape[0], b)


def random_case(m: int, k: int, n: int, dtype: torch.dtype, bias: str | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(m * 10_000 + k * 10 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = None if bias is None else torch.randn(n, generator=gen).to(dtype if bias == "same" else torch.float32)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 32, 16), (5, 100, 37), (6, 64, 128), (13, 33, 200), (64, 256, 80),
                                   (7, 1100, 70), (20, 2300, 130), (3, 1, 5), (2, 513, 3), (256, 96, 24)])
@pytest.mark.parametrize("bias", [None, "same", "fp32"])
def test_avx2_linear_equals_float64(dtype, m, k, n, bias):
    built_or_skip(dtype)
    x, w, b = random_case(m, k, n, dtype, bias)
    assert_matches_float64(run(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_count_of_a_decode_batch_equals_float64(dtype):
    # Row groups of 6, then the remainder (1-5 rows), each its own micro-kernel.
    built_or_skip(dtype)
    x_all, w, b = random_case(20, 300, 43, dtype, "fp32")
    packed = torch.ops.raylm.avx2_pack_weight(w)
    for m in range(1, 21):
        x = x_all[:m]
        assert_matches_float64(torch.ops.raylm.avx2_linear(x, packed, 43, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dimensions_and_strided_rows_are_taken_as_rows(dtype):
    built_or_skip(dtype)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 64, generator=gen).to(dtype)
    packed = torch.ops.raylm.avx2_pack_weight(w)
    x3 = torch.randn(2, 9, 64, generator=gen).to(dtype)
    assert_matches_float64(torch.ops.raylm.avx2_linear(x3, packed, 70, None), x3, w, None)
    wide = torch.randn(7, 100, generator=gen).to(dtype)
    x_cols = wide[:, 10:74]  # rows 100 elements apart
    assert_matches_float64(torch.ops.raylm.avx2_linear(x_cols, packed, 70, None), x_cols, w, None)
    x_t = torch.randn(64, 7, generator=gen).to(dtype).T  # columns not contiguous
    assert_matches_float64(torch.ops.raylm.avx2_linear(x_t, packed, 70, None), x_t, w, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows_and_zero_width_inputs(dtype):
    built_or_skip(dtype)
    packed = torch.ops.raylm.avx2_pack_weight(torch.randn(16, 32).to(dtype))
    y = torch.ops.raylm.avx2_linear(torch.empty(0, 32, dtype=dtype), packed, 16, None)
    assert y.shape == (0, 16) and y.dtype == dtype
    b = torch.randn(5).to(dtype)
    y = torch.ops.raylm.avx2_linear(torch.empty(3, 0, dtype=dtype), torch.ops.raylm.avx2_pack_weight(
        torch.empty(5, 0, dtype=dtype)), 5, b)
    assert torch.equal(y, b.expand(3, 5))  # no products: the bias alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_weight_of_other_sizes_or_dtype_is_refused(dtype):
    built_or_skip(dtype)
    packed = torch.ops.raylm.avx2_pack_weight(torch.randn(32, 64).to(dtype))
    with pytest.raises(RuntimeError, match="does not match K = 96"):
        torch.ops.raylm.avx2_linear(torch.randn(4, 96).to(dtype), packed, 32, None)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.raylm.avx2_linear(torch.randn(4, 64).to(dtype), packed, 200, None)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.raylm.avx2_linear(torch.randn(4, 64).to(other), packed, 32, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.raylm.avx2_linear(torch.randn(4, 64).to(dtype), packed, 32, torch.randn(31))


def test_half_precision_is_refused():
    built_or_skip(torch.float32)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.raylm.avx2_pack_weight(torch.randn(16, 32).half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [3, cpu_gemm.AVX2_MAX_ROWS, cpu_gemm.AVX2_MAX_ROWS + 1, 1000])
def test_the_layer_gemm_takes_the_avx2_kernel_up_to_its_row_limit(dtype, tokens):
    """Where layers take the AVX2 kernel (a build without AVX-512), cpu_gemm.linear runs it for
    fp32 up to its row limit, at the probe sizes the timing at load allowed, and oneDNN or
    F.linear elsewhere; for bf16 (no native bf16 on such CPUs) at every row count. The result
    equals float64's either way."""
    if not cpu_gemm.avx2_linear_enabled(dtype):
        pytest.skip("layers do not take the AVX2 kernel here (an AVX-512 build, or none)")
    gen = torch.Generator().manual_seed(tokens)
    w = (torch.randn(48, 128, generator=gen) / 8).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(tokens, 128, generator=gen).to(dtype)
    packed = cpu_gemm.maybe_pack_linear_weight(w)
    decode = cpu_gemm.maybe_pack_decode_weight(w, packed)
    if dtype == torch.bfloat16:
        assert decode is not None and not decode.slower_at
    if decode is not None:
        assert decode.op is torch.ops.raylm.avx2_linear and decode.kind == cpu_gemm.LINEAR_AVX2
        expected_max_rows = cpu_gemm.AVX2_MAX_ROWS if dtype == torch.float32 else cpu_gemm.AVX2_BF16_MAX_ROWS
        assert decode.max_rows == expected_max_rows
    y = cpu_gemm.linear(x, w, packed, b, decode)
    assert_matches_float64(y, x, w, b)
    if decode is not None and decode.takes(tokens):  # the layer ran exactly the decode kernel
        assert torch.equal(y, decode.op(x, decode.packed, 48, b))
    else:
        assert dtype == torch.float32


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "avx2_linear")
    assert not cpu_gemm.avx2_linear_enabled(torch.float32)
    assert not cpu_gemm.avx2_linear_enabled(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_of_several_megabytes_is_packed_on_huge_pages_and_unmapped_when_dropped(dtype):
    built_or_skip(dtype)
    gen = torch.Generator().manual_seed(3)
    n, k = 1100, 1030  # packed: 69 panels x 16 columns x 1030 k, 2.3 MB in bf16, 4.5 MB in fp32
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    packed = torch.ops.raylm.avx2_pack_weight(w)
    address = packed.data_ptr()
    assert address % (2 << 20) == 0
    mapping = mapping_of(address)
    assert mapping is not None and "hg" in mapping["VmFlags"].split()
    x = torch.randn(13, k, generator=gen).to(dtype)
    assert_matches_float64(torch.ops.raylm.avx2_linear(x, packed, n, None), x, w, None)
    del packed
    assert mapping_of(address) is None
