"""The streaming decode GEMMs, the AVX-512 one (`csrc/cpu_gemm_avx512.cpp`) and the AVX2 one
(`csrc/cpu_gemm_avx2.cpp`), against x W^T + b in float64, fp32 and bf16, with their gated
forms (SiLU-and-mul in the epilogue) and the layers' choice of them: one module over both, as
their ops share one shell (`csrc/cpu_gemm_op_shell.h`). Each test runs for each kernel this
build has (an AVX-512 machine runs both, an AVX2 one the AVX2 kernel only).

Both accumulate in fp32 (AVX2 widens bf16 exactly). An fp32 output is within fp32 summation
error of the float64 result (bounded here by 1e-5 of the sum of |x| |W|); a bf16 output adds
one bf16 rounding (2^-8 relative). Shapes cover every path: every row count through a few of
the kernels' 6-row groups, outputs not a multiple of their panels (64 and 16 columns) nor of
8, inputs longer than one block (the partial sums carried over), an odd bf16 input width,
strided and batched rows, fewer panels than threads, no input features at all.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from raylm.kernels import cpu_gemm, cpu_ops
from tests.memory_maps import mapping_of

DTYPES = [torch.float32, torch.bfloat16]


@dataclass(frozen=True)
class Kernel:
    """A streaming GEMM as the tests see it: its ops are torch.ops.raylm.<name>_*."""

    name: str
    built: Callable[[torch.dtype], bool]  # the kernel runs dtype in this build
    enabled: Callable[[torch.dtype], bool]  # the layers take it for dtype
    kind: int
    gated_kind: int
    # The row limit of its decode copies per dtype.
    max_rows: Callable[[torch.dtype], int]
    # Its gated epilogue gives silu_and_mul's scalar tail (past the row's last whole vector)
    # bit for bit too; the AVX-512 one applies its vector formula there.
    gated_tail_exact: bool

    def op(self, suffix: str):
        return getattr(torch.ops.raylm, f"{self.name}_{suffix}")

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return self.op("linear")(x, self.op("pack_weight")(w), w.shape[0], b)

    def silu_mul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.op("linear_silu_mul")(x, self.op("pack_gated_weight")(w), w.shape[0] // 2)


AVX512 = Kernel("avx512", cpu_gemm.avx512_linear_enabled, cpu_gemm.avx512_linear_enabled, cpu_gemm.LINEAR_AVX512,
                cpu_gemm.LINEAR_AVX512_SILU_MUL, lambda dtype: cpu_gemm.AVX512_MAX_ROWS, gated_tail_exact=False)
AVX2 = Kernel("avx2", cpu_gemm.avx2_linear_built, cpu_gemm.avx2_linear_enabled, cpu_gemm.LINEAR_AVX2,
              cpu_gemm.LINEAR_AVX2_SILU_MUL,
              lambda dtype: cpu_gemm.AVX2_BF16_MAX_ROWS if dtype == torch.bfloat16 else cpu_gemm.AVX2_MAX_ROWS,
              gated_tail_exact=True)
KERNELS = [pytest.param(AVX512, id="avx512"), pytest.param(AVX2, id="avx2")]


def built_or_skip(kernel: Kernel, dtype: torch.dtype) -> None:
    if not kernel.built(dtype):
        pytest.skip(f"no {kernel.name} kernel for {dtype} here (CPU or build)")


def enabled_or_skip(kernel: Kernel, dtype: torch.dtype) -> None:
    if not kernel.enabled(dtype):
        pytest.skip(f"layers do not take the {kernel.name} kernel for {dtype} here")
    if dtype == torch.bfloat16 and cpu_gemm.amx_linear_enabled():
        pytest.skip("bf16 decode batches take the AMX kernel here")


def assert_matches_float64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    expected = x64 @ w64.T + (b.double() if b is not None else 0.0)
    scale = x64.abs() @ w64.abs().T + (b.double().abs() if b is not None else 0.0)
    error = (y.double().reshape(expected.shape) - expected).abs()
    rounding = 2 ** -8 if y.dtype == torch.bfloat16 else 0.0
    bound = rounding * expected.abs() + 1e-5 * scale + 1e-30
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"


def random_case(m: int, k: int, n: int, dtype: torch.dtype, bias: str | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(m * 10_000 + k * 10 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / max(k, 1) ** 0.5).to(dtype)
    b = None if bias is None else torch.randn(n, generator=gen).to(dtype if bias == "same" else torch.float32)
    return x, w, b


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 32, 16), (1, 32, 64), (5, 100, 37), (6, 64, 128), (13, 33, 200),
                                   (64, 256, 80), (7, 1100, 70), (20, 2300, 130), (3, 1, 5), (2, 513, 3),
                                   (256, 96, 24)])
@pytest.mark.parametrize("bias", [None, "same", "fp32"])
def test_linear_equals_float64(kernel, dtype, m, k, n, bias):
    built_or_skip(kernel, dtype)
    x, w, b = random_case(m, k, n, dtype, bias)
    assert_matches_float64(kernel.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_count_of_a_decode_batch_equals_float64(kernel, dtype):
    # Row groups of 6, then the remainder (1-5 rows), each its own micro-kernel.
    built_or_skip(kernel, dtype)
    x_all, w, b = random_case(20, 300, 43, dtype, "fp32")
    packed = kernel.op("pack_weight")(w)
    for m in range(1, 21):
        x = x_all[:m]
        assert_matches_float64(kernel.op("linear")(x, packed, 43, b), x, w, b)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dimensions_and_strided_rows_are_taken_as_rows(kernel, dtype):
    built_or_skip(kernel, dtype)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 64, generator=gen).to(dtype)
    packed = kernel.op("pack_weight")(w)
    x3 = torch.randn(2, 9, 64, generator=gen).to(dtype)
    assert_matches_float64(kernel.op("linear")(x3, packed, 70, None), x3, w, None)
    wide = torch.randn(7, 100, generator=gen).to(dtype)
    x_cols = wide[:, 10:74]  # rows 100 elements apart
    assert_matches_float64(kernel.op("linear")(x_cols, packed, 70, None), x_cols, w, None)
    x_t = torch.randn(64, 7, generator=gen).to(dtype).T  # columns not contiguous
    assert_matches_float64(kernel.op("linear")(x_t, packed, 70, None), x_t, w, None)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows_and_zero_width_inputs(kernel, dtype):
    built_or_skip(kernel, dtype)
    packed = kernel.op("pack_weight")(torch.randn(16, 32).to(dtype))
    y = kernel.op("linear")(torch.empty(0, 32, dtype=dtype), packed, 16, None)
    assert y.shape == (0, 16) and y.dtype == dtype
    b = torch.randn(5).to(dtype)
    y = kernel.op("linear")(torch.empty(3, 0, dtype=dtype), kernel.op("pack_weight")(torch.empty(5, 0, dtype=dtype)),
                            5, b)
    assert torch.equal(y, b.expand(3, 5))  # no products: the bias alone


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_weight_of_other_sizes_or_dtype_is_refused(kernel, dtype):
    built_or_skip(kernel, dtype)
    packed = kernel.op("pack_weight")(torch.randn(32, 64).to(dtype))
    with pytest.raises(RuntimeError, match="does not match K = 96"):
        kernel.op("linear")(torch.randn(4, 96).to(dtype), packed, 32, None)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.op("linear")(torch.randn(4, 64).to(dtype), packed, 200, None)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    if kernel.built(other):
        with pytest.raises(RuntimeError, match="does not match"):
            kernel.op("linear")(torch.randn(4, 64).to(other), packed, 32, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel.op("linear")(torch.randn(4, 64).to(dtype), packed, 32, torch.randn(31))


@pytest.mark.parametrize("kernel", KERNELS)
def test_half_precision_is_refused_and_not_packed(kernel):
    built_or_skip(kernel, torch.float32)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        kernel.op("pack_weight")(torch.randn(16, 32).half())
    assert cpu_gemm.maybe_pack_decode_weight(torch.randn(16, 32).half()) is None


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [3, 256, 257, 1000])  # AVX512_MAX_ROWS = AVX2_MAX_ROWS = 256
def test_the_layer_gemm_takes_the_kernel_up_to_its_row_limit(kernel, dtype, tokens):
    """Where layers take the kernel, cpu_gemm.linear runs it up to its row limit (256 tokens;
    bf16 on the AVX2 kernel, with no native bf16 to fall back on, at any number), for fp32 at
    the probe sizes the timing at load allowed, and oneDNN or F.linear elsewhere. The result
    equals float64's either way."""
    enabled_or_skip(kernel, dtype)
    gen = torch.Generator().manual_seed(tokens)
    w = (torch.randn(48, 128, generator=gen) / 8).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(tokens, 128, generator=gen).to(dtype)
    packed = cpu_gemm.maybe_pack_linear_weight(w)
    decode = cpu_gemm.maybe_pack_decode_weight(w, packed)
    if dtype == torch.bfloat16:
        assert decode is not None and not decode.slower_at
    if decode is not None:  # fp32: at the probe sizes where it timed faster here, one at least
        assert decode.op is kernel.op("linear") and decode.kind == kernel.kind
        assert decode.max_rows == kernel.max_rows(dtype)
    y = cpu_gemm.linear(x, w, packed, b, decode)
    assert_matches_float64(y, x, w, b)
    if decode is not None and decode.takes(tokens):  # the layer ran exactly the decode kernel
        assert torch.equal(y, decode.op(x, decode.packed, 48, b))
    else:
        assert dtype == torch.float32 or tokens > kernel.max_rows(dtype)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_switch_turns_the_kernel_off(kernel, monkeypatch):
    monkeypatch.setenv("RAYLM_TEST_DISABLE_KERNELS", f"{kernel.name}_linear")
    assert not kernel.enabled(torch.float32)
    assert not kernel.enabled(torch.bfloat16)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_of_several_megabytes_is_packed_on_huge_pages_and_unmapped_when_dropped(kernel, dtype):
    # A decode step reads every weight from memory; 2 MiB pages spare the TLB misses. The
    # packed copy must start on a 2 MiB boundary, carry MADV_HUGEPAGE ("hg" in VmFlags), give
    # the same products as any other, and be unmapped when the tensor is freed.
    built_or_skip(kernel, dtype)
    gen = torch.Generator().manual_seed(3)
    n, k = 1100, 1030  # packed: 2.3-2.4 MB in bf16, 4.5-4.7 MB in fp32
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    packed = kernel.op("pack_weight")(w)
    address = packed.data_ptr()
    assert address % (2 << 20) == 0
    mapping = mapping_of(address)
    assert mapping is not None and int(mapping["start"]) == address
    assert "hg" in mapping["VmFlags"].split()
    x = torch.randn(13, k, generator=gen).to(dtype)
    assert_matches_float64(kernel.op("linear")(x, packed, n, None), x, w, None)
    del packed
    assert mapping_of(address) is None


@pytest.mark.parametrize("kernel", KERNELS)
def test_huge_pages_can_be_switched_off(kernel, monkeypatch):
    built_or_skip(kernel, torch.bfloat16)
    monkeypatch.setenv("RAYLM_CPU_HUGE_PAGES", "0")  # the kernel reads it at each packing
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(1100, 1030, generator=gen).to(torch.bfloat16)
    packed = kernel.op("pack_weight")(w)
    mapping = mapping_of(packed.data_ptr())
    assert mapping is not None and "hg" not in mapping["VmFlags"].split()
    x = torch.randn(5, 1030, generator=gen).to(torch.bfloat16)
    assert_matches_float64(kernel.op("linear")(x, packed, 1100, None), x, w, None)


# The gated kernels: silu(x Wg^T) * (x Wu^T) from a gate_up weight [2d, K].

def silu_and_mul_float64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    projected = x.double().reshape(-1, x.shape[-1]) @ w.double().T
    gate, up = projected.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def gated_built_or_skip(kernel: Kernel, dtype: torch.dtype) -> None:
    built_or_skip(kernel, dtype)
    if not cpu_ops.usable(torch.zeros(1)):  # loads silu_and_mul's library, which this file does not otherwise
        pytest.skip("the fused CPU ops cannot be built here")


def assert_gated_is_the_pair(kernel: Kernel, gated: torch.Tensor, two_ops: torch.Tensor, x: torch.Tensor,
                             w: torch.Tensor) -> None:
    """gated equals the linear then silu_and_mul bit for bit (the AVX-512 kernel: but in
    silu_and_mul's scalar tail, past each row's last 16, where float64's result holds) and is
    within one rounding of the dtype of float64's result."""
    d = w.shape[0] // 2
    assert gated.shape == (*x.shape[:-1], d) and gated.dtype == x.dtype
    exact = d if kernel.gated_tail_exact else d // 16 * 16
    assert torch.equal(gated[..., :exact], two_ops[..., :exact])
    tolerance = 2 ** -7 if x.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(gated.double().reshape(-1, d), silu_and_mul_float64(x, w), rtol=tolerance,
                               atol=tolerance)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,d", [(1, 32, 32), (5, 100, 37), (13, 33, 200), (64, 256, 80), (7, 1100, 70),
                                   (3, 1, 5), (64, 1024, 2816)])
def test_the_gated_kernel_is_the_linear_then_silu_and_mul_bit_for_bit(kernel, dtype, m, k, d):
    # The gate_up kernel with SiLU-and-mul in its epilogue, on the gated packing (gate and up
    # columns of the same outputs in one panel), gives what the kernel's linear then
    # silu_and_mul give: the same products, rounded to the dtype, through the same formulas.
    gated_built_or_skip(kernel, dtype)
    gen = torch.Generator().manual_seed(m * 10_000 + k * 10 + d)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(2 * d, k, generator=gen) / k ** 0.5).to(dtype)
    two_ops = torch.ops.raylm.silu_and_mul(kernel.linear(x, w, None))
    assert_gated_is_the_pair(kernel, kernel.silu_mul(x, w), two_ops, x, w)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gated_kernel_takes_any_rows_strided_batched_or_none(kernel, dtype):
    # 1-256 rows (each remainder of the 6-row groups, and the 256 a decode batch may reach)
    # on one packing; rows 100 elements apart, columns not contiguous, leading dimensions;
    # no input features (every product zero: silu(0) * 0); no rows.
    gated_built_or_skip(kernel, dtype)
    gen = torch.Generator().manual_seed(7)
    d, k = 45, 64
    w = (torch.randn(2 * d, k, generator=gen) / 8).to(dtype)
    packed, plain = kernel.op("pack_gated_weight")(w), kernel.op("pack_weight")(w)
    x_all = torch.randn(256, k, generator=gen).to(dtype)

    def check(x: torch.Tensor) -> None:
        two_ops = torch.ops.raylm.silu_and_mul(kernel.op("linear")(x, plain, 2 * d, None))
        assert_gated_is_the_pair(kernel, kernel.op("linear_silu_mul")(x, packed, d), two_ops, x, w)

    for m in [*range(1, 14), 63, 64, 255, 256]:
        check(x_all[:m])
    check(torch.randn(7, 100, generator=gen).to(dtype)[:, 10:74])
    check(torch.randn(k, 7, generator=gen).to(dtype).T)
    check(torch.randn(2, 9, k, generator=gen).to(dtype))
    no_features = kernel.op("linear_silu_mul")(torch.empty(3, 0, dtype=dtype),
                                                kernel.op("pack_gated_weight")(torch.empty(2 * d, 0, dtype=dtype)), d)
    assert torch.equal(no_features, torch.zeros(3, d, dtype=dtype))
    assert kernel.op("linear_silu_mul")(torch.empty(0, k, dtype=dtype), packed, d).shape == (0, d)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.op("linear_silu_mul")(x_all[:2], packed, d + 64)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_gated_weight_of_an_odd_row_count_is_refused(kernel):
    built_or_skip(kernel, torch.float32)
    with pytest.raises(RuntimeError, match=r"\[2d, in_features\]"):
        kernel.op("pack_gated_weight")(torch.randn(7, 32))


def seed_fp32_timings(monkeypatch: pytest.MonkeyPatch, gated_slower_at: frozenset[int]) -> None:
    """The load-time timings of the layers' fp32 shape [192, 64] as if measured (CI machines
    differ): oneDNN from 1 row, the plain streaming copy at every probe size, the gated copy
    slower at gated_slower_at."""
    monkeypatch.setitem(cpu_gemm._fp32_min_rows, (192, 64), 1)
    monkeypatch.setitem(cpu_gemm._fp32_decode_slower_at, (192, 64), frozenset())
    monkeypatch.setitem(cpu_gemm._fp32_silu_and_mul_slower_at, (192, 64), gated_slower_at)


def _gate_up_layer(dtype: torch.dtype, follows: bool, gen: torch.Generator):
    from raylm.parallel.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(64, [96, 96], params_dtype=dtype, silu_and_mul_follows=follows)
    layer.weight.data.copy_(torch.randn(192, 64, generator=gen).to(dtype) / 8)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_layers_of_decode_batches_run_the_gated_kernel(kernel, dtype, monkeypatch):
    # MergedColumnParallelLinear with silu_and_mul_follows packs the gated copy in place of a
    # streaming one: bf16 at every batch up to the kernel's row limit, fp32 at the probe sizes
    # where it timed faster than oneDNN then silu_and_mul (seeded here: at all but 16 rows, so
    # that batches of 5-16 rows run the two steps); larger batches and a layer not followed by
    # SiLU-and-mul get None (the caller runs the projection and the activation).
    enabled_or_skip(kernel, dtype)
    seed_fp32_timings(monkeypatch, frozenset({16}))
    gen = torch.Generator().manual_seed(5)
    gated, plain = _gate_up_layer(dtype, True, gen), _gate_up_layer(dtype, False, gen)
    assert plain.silu_and_mul_weight is None and plain.silu_and_mul(torch.randn(2, 64).to(dtype)) is None
    weight = gated.silu_and_mul_weight
    assert gated.decode_weight is None and weight.kind == kernel.gated_kind
    assert weight.op is kernel.op("linear_silu_mul") and weight.max_rows == kernel.max_rows(dtype)
    assert weight.slower_at == (frozenset({16}) if dtype == torch.float32 else frozenset())
    for rows in (1, 4, 5, 16, 17, 64, 200, 256):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        y = gated.silu_and_mul(x)
        if dtype == torch.float32 and 5 <= rows <= 16:
            assert y is None
            continue
        assert torch.equal(y, weight.op(x, weight.packed, 96))
        tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(y.double(), silu_and_mul_float64(x, gated.weight), rtol=tolerance, atol=tolerance)
    if weight.max_rows < sys.maxsize:
        assert gated.silu_and_mul(torch.randn(weight.max_rows + 1, 64).to(dtype)) is None


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_fp32_gated_copy_slower_at_every_probe_size_is_not_packed(kernel, monkeypatch):
    enabled_or_skip(kernel, torch.float32)
    seed_fp32_timings(monkeypatch, frozenset(cpu_gemm._FP32_PROBE_ROWS))
    layer = _gate_up_layer(torch.float32, True, torch.Generator().manual_seed(6))
    assert layer.silu_and_mul_weight is None
    assert layer.silu_and_mul(torch.randn(2, 64)) is None


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp32_probe_sizes_are_decided_one_by_one(kernel, monkeypatch):
    """A streaming copy timed slower at one probe size (here 16 rows, as a noisy or a
    memory-bound probe may) is skipped for the batches that round up to that size only:
    smaller and larger batches still take it, and `linear` gives each batch exactly the
    output of the kernel chosen for it."""
    enabled_or_skip(kernel, torch.float32)
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
    assert decode.kind == kernel.kind and cpu_gemm._fp32_decode_slower_at[(96, 64)] == {16}
    for rows, takes in ((1, True), (4, True), (5, False), (16, False), (17, True), (64, True), (256, True),
                        (257, False)):
        assert decode.takes(rows) is takes, rows
        x = torch.randn(rows, 64, generator=gen)
        y = cpu_gemm.linear(x, w, packed, b, decode)
        expected = decode.op(x, decode.packed, 96, b) if takes else cpu_gemm.cpu_linear(x, packed, b)
        assert torch.equal(y, expected), rows
        assert_matches_float64(y, x, w, b)


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_fp32_streaming_copy_slower_at_every_probe_size_is_not_kept(kernel, monkeypatch):
    enabled_or_skip(kernel, torch.float32)
    monkeypatch.setattr(cpu_gemm, "_best_times", lambda first, second: (2.0, 1.0))
    monkeypatch.setattr(cpu_gemm, "_fp32_decode_slower_at", {})
    monkeypatch.setattr(cpu_gemm, "_fp32_silu_and_mul_slower_at", {})
    w = torch.randn(96, 64)
    packed = cpu_gemm.pack_linear_weight(w)
    assert cpu_gemm.maybe_pack_decode_weight(w, packed) is None
    assert cpu_gemm.maybe_pack_silu_and_mul_weight(w, packed) is None
    assert cpu_gemm._fp32_decode_slower_at[(96, 64)] == set(cpu_gemm._FP32_PROBE_ROWS)
