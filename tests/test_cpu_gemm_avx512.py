"""The AVX-512 linear (`csrc/cpu_gemm_avx512.cpp`) against x W^T + b in float64, fp32 and bf16.

Both accumulate in fp32. An fp32 output is within fp32 summation error of the float64 result
(bounded here by 1e-5 of the sum of |x| |W|); a bf16 output adds one bf16 rounding (2^-8
relative). Shapes cover every path: rows not a multiple of the kernel's 6, outputs not a
multiple of its 64-column panels, inputs longer than one 512-step block (and a block's
partial sums carried over), an odd bf16 input width, strided and batched rows, few panels
for two threads.
"""

from __future__ import annotations

import pytest
import torch

from raylm.kernels import cpu_ops
from raylm.kernels import cpu_gemm
from tests.memory_maps import mapping_of

DTYPES = [torch.float32, torch.bfloat16]


def usable_or_skip(dtype: torch.dtype) -> None:
    if not cpu_gemm.avx512_linear_enabled(dtype):
        pytest.skip(f"no AVX-512 kernel for {dtype} here (CPU or build)")


def assert_matches_float64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    expected = x64 @ w64.T + (b.double() if b is not None else 0.0)
    scale = x64.abs() @ w64.abs().T + (b.double().abs() if b is not None else 0.0)
    error = (y.double().reshape(expected.shape) - expected).abs()
    rounding = 2 ** -8 if y.dtype == torch.bfloat16 else 0.0
    bound = rounding * expected.abs() + 1e-5 * scale + 1e-30
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"


def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.raylm.avx512_linear(x, torch.ops.raylm.avx512_pack_weight(w), w.shape[0], b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 32, 64), (5, 100, 37), (6, 64, 128), (13, 33, 200), (64, 256, 80),
                                   (7, 1100, 70), (20, 2300, 130), (3, 1, 5)])
@pytest.mark.parametrize("bias", [None, "same", "fp32"])
def test_avx512_linear_equals_float64(dtype, m, k, n, bias):
    usable_or_skip(dtype)
    gen = torch.Generator().manual_seed(m * 10_000 + k * 10 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = None if bias is None else torch.randn(n, generator=gen).to(dtype if bias == "same" else torch.float32)
    assert_matches_float64(run(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dimensions_and_strided_rows_are_taken_as_rows(dtype):
    usable_or_skip(dtype)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 64, generator=gen).to(dtype)
    packed = torch.ops.raylm.avx512_pack_weight(w)
    x3 = torch.randn(2, 9, 64, generator=gen).to(dtype)
    assert_matches_float64(torch.ops.raylm.avx512_linear(x3, packed, 70, None), x3, w, None)
    wide = torch.randn(7, 100, generator=gen).to(dtype)
    x_cols = wide[:, 10:74]  # rows 100 elements apart
    assert_matches_float64(torch.ops.raylm.avx512_linear(x_cols, packed, 70, None), x_cols, w, None)
    x_t = torch.randn(64, 7, generator=gen).to(dtype).T  # columns not contiguous
    assert_matches_float64(torch.ops.raylm.avx512_linear(x_t, packed, 70, None), x_t, w, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows_give_an_empty_result(dtype):
    usable_or_skip(dtype)
    packed = torch.ops.raylm.avx512_pack_weight(torch.randn(16, 32).to(dtype))
    y = torch.ops.raylm.avx512_linear(torch.empty(0, 32, dtype=dtype), packed, 16, None)
    assert y.shape == (0, 16) and y.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_weight_of_other_sizes_or_dtype_is_refused(dtype):
    usable_or_skip(dtype)
    packed = torch.ops.raylm.avx512_pack_weight(torch.randn(32, 64).to(dtype))
    with pytest.raises(RuntimeError, match="does not match K = 96"):
        torch.ops.raylm.avx512_linear(torch.randn(4, 96).to(dtype), packed, 32, None)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.raylm.avx512_linear(torch.randn(4, 64).to(dtype), packed, 200, None)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    if cpu_gemm.avx512_linear_enabled(other):
        with pytest.raises(RuntimeError, match="does not match"):
            torch.ops.raylm.avx512_linear(torch.randn(4, 64).to(other), packed, 32, None)


def test_half_precision_is_refused_and_not_packed():
    usable_or_skip(torch.float32)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.raylm.avx512_pack_weight(torch.randn(16, 32).half())
    assert cpu_gemm.maybe_pack_decode_weight(torch.randn(16, 32).half()) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [3, cpu_gemm.AVX512_MAX_ROWS, cpu_gemm.AVX512_MAX_ROWS + 1, 600])
def test_the_layer_gemm_equals_float64_on_both_sides_of_the_decode_row_limit(dtype, tokens):
    """cpu_gemm.linear takes the decode kernel up to its row limit (for fp32, what the timing
    at load allowed) and oneDNN (or F.linear) above."""
    usable_or_skip(dtype)
    gen = torch.Generator().manual_seed(tokens)
    w = (torch.randn(48, 128, generator=gen) / 8).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(tokens, 128, generator=gen).to(dtype)
    packed = cpu_gemm.maybe_pack_linear_weight(w)
    decode = cpu_gemm.maybe_pack_decode_weight(w, packed)
    if dtype == torch.bfloat16:
        assert decode is not None
    if decode is not None and (dtype == torch.float32 or not cpu_gemm.amx_linear_enabled()):
        # fp32: at the probe sizes where it timed faster here, of which there is one at least
        assert decode.op is torch.ops.raylm.avx512_linear and decode.max_rows == cpu_gemm.AVX512_MAX_ROWS
        assert dtype == torch.float32 or not decode.slower_at
    y = cpu_gemm.linear(x, w, packed, b, decode)
    assert_matches_float64(y, x, w, b)
    if decode is not None and decode.takes(tokens):  # the layer ran exactly the decode kernel
        assert torch.equal(y, decode.op(x, decode.packed, 48, b))


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", "avx512_linear")
    assert not cpu_gemm.avx512_linear_enabled(torch.float32)
    assert not cpu_gemm.avx512_linear_enabled(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_of_several_megabytes_is_packed_on_huge_pages_and_unmapped_when_dropped(dtype):
    # A decode step reads every weight from memory; 2 MiB pages spare the TLB misses. The
    # packed copy must start on a 2 MiB boundary, carry MADV_HUGEPAGE ("hg" in VmFlags), give
    # the same products as any other, and be unmapped when the tensor is freed.
    usable_or_skip(dtype)
    gen = torch.Generator().manual_seed(3)
    n, k = 1100, 1030  # packed: 18 panels x 64 columns x 1030 k, 2.4 MB in bf16, 4.7 MB in fp32
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    packed = torch.ops.raylm.avx512_pack_weight(w)
    address = packed.data_ptr()
    assert address % (2 << 20) == 0
    mapping = mapping_of(address)
    assert mapping is not None and int(mapping["start"]) == address
    assert "hg" in mapping["VmFlags"].split()
    x = torch.randn(13, k, generator=gen).to(dtype)
    assert_matches_float64(torch.ops.raylm.avx512_linear(x, packed, n, None), x, w, None)
    del packed
    assert mapping_of(address) is None


def test_huge_pages_can_be_switched_off(monkeypatch):
    usable_or_skip(torch.bfloat16)
    monkeypatch.setenv("RAYLM_CPU_HUGE_PAGES", "0")  # the kernel reads it at each packing
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(1100, 1030, generator=gen).to(torch.bfloat16)
    packed = torch.ops.raylm.avx512_pack_weight(w)
    mapping = mapping_of(packed.data_ptr())
    assert mapping is not None and "hg" not in mapping["VmFlags"].split()
    x = torch.randn(5, 1030, generator=gen).to(torch.bfloat16)
    assert_matches_float64(torch.ops.raylm.avx512_linear(x, packed, 1100, None), x, w, None)


def silu_and_mul_float64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    projected = x.double() @ w.double().T
    gate, up = projected.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,d", [(1, 32, 32), (5, 100, 37), (13, 33, 200), (64, 256, 80), (7, 1100, 70),
                                   (64, 1024, 2816)])
def test_the_gated_kernel_is_the_linear_then_silu_and_mul_bit_for_bit(dtype, m, k, d):
    # The gate_up kernel with SiLU-and-mul in its epilogue (avx512_linear_silu_mul on the gated
    # packing: 32 gate and 32 up columns a panel) gives what avx512_linear then silu_and_mul
    # give: the same products, rounded to the dtype, through the same vsilu. silu_and_mul's
    # scalar tail (past the last 16 of each row) is another formula: there, float64's result.
    usable_or_skip(dtype)
    if not cpu_ops.usable(torch.zeros(1)):  # loads silu_and_mul's library, which this file does not otherwise
        pytest.skip("the fused CPU ops cannot be built here")
    gen = torch.Generator().manual_seed(m * 10_000 + k * 10 + d)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(2 * d, k, generator=gen) / k ** 0.5).to(dtype)
    gated = torch.ops.raylm.avx512_linear_silu_mul(x, torch.ops.raylm.avx512_pack_gated_weight(w), d)
    two_ops = torch.ops.raylm.silu_and_mul(torch.ops.raylm.avx512_linear(x, torch.ops.raylm.avx512_pack_weight(w),
                                                                         2 * d, None))
    assert gated.shape == (m, d) and gated.dtype == dtype
    vector_part = d // 16 * 16
    assert torch.equal(gated[:, :vector_part], two_ops[:, :vector_part])
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(gated.double(), silu_and_mul_float64(x, w), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_layers_of_decode_batches_run_the_gated_kernel(dtype):
    # MergedColumnParallelLinear with silu_and_mul_follows packs the gated copy in place of a
    # streaming one, up to the rows it took (fp32: timed against oneDNN and silu_and_mul);
    # larger batches get None (the caller runs the projection and the activation), as does a
    # layer not followed by SiLU-and-mul.
    from raylm.parallel.linear import MergedColumnParallelLinear

    usable_or_skip(dtype)
    if cpu_gemm.amx_linear_enabled() and dtype == torch.bfloat16:
        pytest.skip("bf16 decode batches take the AMX kernel here")
    gen = torch.Generator().manual_seed(5)
    layers = {}
    for follows in (True, False):
        layer = MergedColumnParallelLinear(64, [96, 96], params_dtype=dtype, silu_and_mul_follows=follows)
        layer.weight.data.copy_(torch.randn(192, 64, generator=gen).to(dtype) / 8)
        layer.process_weights_after_loading()
        layers[follows] = layer
    gated, plain = layers[True], layers[False]
    assert plain.silu_and_mul_weight is None and plain.silu_and_mul(torch.randn(2, 64).to(dtype)) is None
    if gated.silu_and_mul_weight is None:  # fp32 timed it slower than oneDNN then silu_and_mul here
        assert dtype == torch.float32
        return
    assert gated.decode_weight is None and gated.silu_and_mul_weight.kind == cpu_gemm.LINEAR_AVX512_SILU_MUL
    taken = [rows for rows in (1, 4, 5, 16, 64, 200, 256) if gated.silu_and_mul_weight.takes(rows)]
    assert taken, "a gated copy is kept only where it timed faster at some probe size"
    for rows in {1, 4, 5, 16, 64, 200, 256} - set(taken):  # fp32 timed it slower at these rows' probe size
        assert gated.silu_and_mul(torch.randn(rows, 64).to(dtype)) is None
    for rows in taken:
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(gated.silu_and_mul(x).double(), silu_and_mul_float64(x, gated.weight),
                                   rtol=tolerance, atol=tolerance)
    assert gated.silu_and_mul(torch.randn(gated.silu_and_mul_weight.max_rows + 1, 64).to(dtype)) is None


def test_a_gated_weight_of_an_odd_row_count_is_refused():
    usable_or_skip(torch.float32)
    with pytest.raises(RuntimeError, match=r"\[2d, in_features\]"):
        torch.ops.raylm.avx512_pack_gated_weight(torch.randn(7, 32))


def test_fp32_probe_sizes_are_decided_one_by_one(monkeypatch):
    """A streaming copy timed slower at one probe size (here 16 rows, as a noisy or a
    memory-bound probe may) is skipped for the batches that round up to that size only:
    smaller and larger batches still take it, and `linear` gives each batch exactly the
    output of the kernel chosen for it."""
    usable_or_skip(torch.float32)
    slower_probe = cpu_gemm._FP32_PROBE_ROWS.index(16)
    calls = []

    def timings(first, second):  # first: the streaming kernel; second: what linear takes without it
        calls.append(len(calls))
        return (2.0, 1.0) if calls[-1] == slower_probe else (1.0, 2.0)

    monkeypatch.setattr(cpu_gemm, "_best_times", timings)
    monkeypatch.setattr(cpu_gemm, "_fp32_decode_slower_at", {})
    monkeypatch.setattr(cpu_gemm, "_fp32_min_rows", {(96, 64): 1})
    gen = torch.Generator().manual_seed(11)
    w, b = torch.randn(96, 64, generator=gen) / 8, torch.randn(96, generator=gen)
    packed = cpu_gemm.pack_linear_weight(w)
    decode = cpu_gemm.maybe_pack_decode_weight(w, packed)
    assert len(calls) == len(cpu_gemm._FP32_PROBE_ROWS) and decode.slower_at == {16}
    assert cpu_gemm._fp32_decode_slower_at[(96, 64)] == {16}
    for rows, takes in ((1, True), (4, True), (5, False), (16, False), (17, True), (64, True), (256, True),
                        (257, False)):
        assert decode.takes(rows) is takes, rows
        x = torch.randn(rows, 64, generator=gen)
        y = cpu_gemm.linear(x, w, packed, b, decode)
        expected = decode.op(x, decode.packed, 96, b) if takes else cpu_gemm.cpu_linear(x, packed, b)
        assert torch.equal(y, expected), rows
        assert_matches_float64(y, x, w, b)


def test_an_fp32_streaming_copy_slower_at_every_probe_size_is_not_kept(monkeypatch):
    usable_or_skip(torch.float32)
    monkeypatch.setattr(cpu_gemm, "_best_times", lambda first, second: (2.0, 1.0))
    monkeypatch.setattr(cpu_gemm, "_fp32_decode_slower_at", {})
    monkeypatch.setattr(cpu_gemm, "_fp32_silu_and_mul_slower_at", {})
    w = torch.randn(96, 64)
    packed = cpu_gemm.pack_linear_weight(w)
    assert cpu_gemm.maybe_pack_decode_weight(w, packed) is None
    assert cpu_gemm.maybe_pack_silu_and_mul_weight(w, packed) is None
    assert cpu_gemm._fp32_decode_slower_at[(96, 64)] == set(cpu_gemm._FP32_PROBE_ROWS)
