"""The CPU GEMM behind the linear layers: oneDNN with the weight packed once, at load.

`F.linear` on CPU (a BLAS GEMM) packs the weight into its kernel's panels on every call; oneDNN's linear
with the weight reordered once into its blocked layout skips that, and on an AVX-512 /
AMX Xeon it ran 1.5-1.9x faster than `F.linear` at decode batch sizes (16-64 tokens) for
the ~100M Llama's projections in fp32 and bf16, and no slower at 1024 tokens
(`python -m raylm.cluster.benchmarks.bench_linear`); end to end that model decoded 1.2x faster in fp32.
The same op serves any number of tokens, so one packed copy serves prefill and decode.

bf16 on a CPU with AMX adds a second packed copy for decode-sized batches (up to
`AMX_MAX_ROWS` tokens): `csrc/cpu_gemm_amx.cpp` streams the weight in AMX tiles. Per call
it ran 1.7-2.9x faster than oneDNN at 1-64 tokens on the ~100M Llama's projections, weights
cold (a decode step is one pass over the weights; oneDNN read them at 8-9 GB/s of the
~25 GB/s the cores read); in that model's decode step the GEMMs went from 14.3 to 11.3 ms.
At 1024 tokens oneDNN is as fast or faster, so prefill keeps it. The cost is memory: a bf16
layer holds its weight three times (as loaded, oneDNN's copy, AMX's copy).

Without AMX, AVX-512 CPUs get the same kind of second copy from `csrc/cpu_gemm_avx512.cpp`
(fp32, and bf16 with AVX512-BF16), up to `AVX512_MAX_ROWS` tokens: 64-column panels streamed
front to back, the next block prefetched while the current one is multiplied. On a 2-core
AMD EPYC (Zen 4), weights cold, it ran the ~100M Llama's projections at 64 tokens 1.10-1.23x
faster than oneDNN in bf16 and 1.03-1.21x in fp32 (1.2-1.7x at 1-16 tokens); in that model's
generate the bf16 decode GEMMs went from 3.97 to 3.50 s (the floor at the cores' measured
peak: 3.34 s). bf16 takes it wherever it is built; fp32 where it timed faster at load
(`fp32_decode_slower_at`, per probe size of rows).

CPUs with AVX2 + FMA and no AVX-512 (AMD EPYC up to Zen 3, many cloud parts) get the
same kind of copy from `csrc/cpu_gemm_avx2.cpp`: 16-column panels, a 6-row micro-kernel of
12 ymm accumulators, fp32 weights, and bf16 weights widened to fp32 in registers (half the
bytes to stream). On one core of a 2-core Zen 3 EPYC (weights cold, thread CPU time: the
machine was shared) it ran the ~100M Llama's projections 1.2-1.6x faster than oneDNN in
fp32 at 16-64 rows and level with `F.linear` at 1 row; its bf16 form ran 5-8x faster than
`F.linear` in bf16 (which widens in software) at 16-1024 rows, and 1.3-1.7x faster than
its own fp32 form at 1 row, where a decode step waits on memory. fp32 takes it up to
`AVX2_MAX_ROWS` tokens where it timed faster at load (as the AVX-512 kernel), bf16 at every
row count (`AVX2_BF16_MAX_ROWS`); its gated form serves the gate_up projections as the
AVX-512 kernel's does (`maybe_pack_silu_and_mul_weight`). AVX-512 builds compile it too (so
their tests run it), but their layers keep the AVX-512 kernels (`avx2_linear_enabled`).

The streaming kernels pack their copy onto 2 MiB transparent huge pages where the kernel
allows it (`csrc/huge_pages.h`): a decode step reads every weight once, and with 4 KiB pages
each page of it is a TLB miss; in that generate the bf16 decode GEMMs went from 3.74-3.81 to
3.69-3.70 s. `RAYLM_CPU_HUGE_PAGES=0` keeps them on ordinary pages.

Whether fp32 gains depends on the CPU and the shape, so each fp32 shape is timed once, at
load (`fp32_packed_min_rows`): on the AMX Xeon `F.linear` won for weights under ~1M
elements (oneDNN's fixed cost per call, ~15 us, outweighed its faster kernel) and for
GEMVs; on a 2-core AMD EPYC (Zen 4) oneDNN won at every shape of the 5M Llama from 4 rows,
and `F.linear` (MKL, which takes no AVX-512 path on AMD CPUs) ran that model's decode GEMMs
at ~57 GFLOP/s. bf16 packed won everywhere it was measured and is always taken.
The timings follow the engine's case: where a model's weights are more than the last-level
cache holds, every probe call finds its weight cold (`probing_with_cold_weights`, set by the
loader). Timed warm, the kernels were within a few percent of each other at decode sizes and
the choice changed from process to process; cold, the ~100M Llama's decode GEMMs all took the
AVX-512 kernel and its generate's decode GEMMs went from ~7.43 to 7.27 s.

oneDNN compiles a primitive per GEMM shape and keeps it (in its primitive cache and ideep's,
1,024 entries each, ~0.55 MiB an entry), so every new row count of a prefill step stayed in
memory: over 1,000 requests of random prompt lengths the tiny test model's server grew 61%
here (516 to 832 MiB; ~440 to ~730 MiB on a Zen 5 EPYC). `cpu_linear` therefore pads its
rows to `onednn_rows` (exact up to 16, then 8 counts per doubling: 72 up to 2,048 rows, less
than 12.5% added, 4.4% on average over log-uniform lengths) and returns the rows asked for;
that server then grew 6-8% in 1,000 requests and ~11% in 5,000
(`cluster/benchmarks/bench_memory_under_load.py`). The padded rows cost prefill steps of
random lengths ~4.5% against exact rows whose primitives are already built (~100M Llama
shapes, fp32 and bf16, `bench_onednn_rows`); a full step (the token budget, a power of two)
is not padded.

For tests and comparisons, RAYLM_TEST_DISABLE_KERNELS (engine/envs.py) turns the packed
kernels off: "packed_linear" all of them (every layer then calls `F.linear`), "amx_linear" only the AMX
kernel, "avx512_linear" only the AVX-512 one, "avx2_linear" only the AVX2 one; "silu_and_mul_linear"
only the gated copies (gate_up projections then take the streaming kernel and silu_and_mul).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from raylm.engine import envs
from raylm.kernels import cpu_ops, native_build


# Row counts at which an fp32 shape is timed both ways: a decode step's batch runs from 1
# to max_num_seqs rows, a prefill chunk to thousands (where both kernels are near the
# machine's peak and the larger sizes add no information, only load time).
_FP32_PROBE_ROWS = (1, 4, 16, 64, 256)
# Timed calls per kernel and row count; the fastest counts (the others carry the noise of
# a shared machine).
_FP32_PROBE_REPEATS = 5
# (out_features, in_features) of a timed fp32 shape -> the fewest rows from which the packed
# GEMM is taken (None: never).
_fp32_min_rows: dict[tuple[int, int], int | None] = {}
# (out_features, in_features) of a timed fp32 shape -> the probe sizes at which the AVX-512
# decode kernel timed slower than the kernel `linear` takes without it.
_fp32_decode_slower_at: dict[tuple[int, int], frozenset[int]] = {}
# Written over before each timed call of a probe, so that the kernel finds no weight in the
# caches; None: probes time warm (see `probing_with_cold_weights`).
_probe_evict: torch.Tensor | None = None
# Tokens up to which the AMX kernel beats oneDNN (measured 1.1-1.5x at 256, 0.55-1.3x at 1024).
AMX_MAX_ROWS = 256

# None: not tried yet; else whether the AMX kernel is built and the CPU lets us use it.
_amx_usable: bool | None = None
# Tokens up to which the AVX-512 kernel is taken: at 256 it measured level with oneDNN (weights
# cold) on a Zen 4 EPYC, at 2048 3-4% slower.
AVX512_MAX_ROWS = 256
# (out_features, in_features) of a timed fp32 gate_up shape -> the probe sizes at which the
# gated AVX-512 or AVX2 kernel (SiLU-and-mul in its epilogue) timed slower than the GEMM and then
# silu_and_mul.
_fp32_silu_and_mul_slower_at: dict[tuple[int, int], frozenset[int]] = {}
# dtype -> whether the AVX-512 kernel is built for it here (filled at first use).
_avx512_usable: dict[torch.dtype, bool] = {}
# Tokens up to which the AVX2 kernel (CPUs without AVX-512) is taken for fp32, as AVX512_MAX_ROWS.
AVX2_MAX_ROWS = 256
# bf16 takes it at any number of tokens: without AVX-512 there is no native bf16, and the
# alternative, F.linear in bf16, ran the ~100M Llama's projections at ~9-10 GFLOP/s on one core
# of a Zen 3 EPYC where this kernel ran 50-75 at 16-1024 rows (oneDNN in fp32: 55-70).
AVX2_BF16_MAX_ROWS = sys.maxsize
# dtype -> whether the AVX2 kernel is built for it here (filled at first use).
_avx2_usable: dict[torch.dtype, bool] = {}

# oneDNN GEMMs run at a few row counts (see `onednn_rows` and the module's docstring): exact
# up to ONEDNN_EXACT_ROWS, then ONEDNN_ROWS_PER_DOUBLING counts per doubling.
ONEDNN_EXACT_ROWS = 16
ONEDNN_ROWS_PER_DOUBLING = 8
# False only inside `exact_onednn_rows`.
_pad_onednn_rows = True

# The kernels `linear` chooses among, numbered for the callers that run it from C++ (the fused
# decode op: csrc/cpu_decode_layers.cpp's LinearKind); LINEAR_AVX512_SILU_MUL and
# LINEAR_AVX2_SILU_MUL are the AVX-512 and AVX2 kernels on a gated gate_up weight, whose output
# is already silu(gate) * up.
LINEAR_AVX512, LINEAR_AMX, LINEAR_ONEDNN, LINEAR_DENSE, LINEAR_AVX512_SILU_MUL, LINEAR_AVX2 = 0, 1, 2, 3, 4, 5
LINEAR_AVX2_SILU_MUL = 6


@dataclass(frozen=True)
class DecodeWeight:
    """A second packed copy of a weight for a kernel that streams it, and the batches it
    takes (`takes`): `op(x, packed, out_features, bias)` for x of packed's dtype and at most
    `max_rows` tokens, but for the probe sizes in `slower_at` (fp32, where it timed slower
    than the kernel `linear` takes without it); `kind` is op's LINEAR_* number."""

    packed: torch.Tensor
    op: Callable[..., torch.Tensor]
    max_rows: int
    kind: int
    slower_at: frozenset[int] = frozenset()

    def takes(self, rows: int) -> bool:
        """Whether a batch of `rows` tokens runs on this copy: a batch counts as the probe
        size it rounds up to."""
        return rows <= self.max_rows and (not self.slower_at or probe_size_of(rows) not in self.slower_at)


def probe_size_of(rows: int) -> int:
    """The smallest fp32 probe size (_FP32_PROBE_ROWS) that holds `rows` rows, or the largest."""
    return next((size for size in _FP32_PROBE_ROWS if rows <= size), _FP32_PROBE_ROWS[-1])


def packed_linear_enabled() -> bool:
    return not envs.kernel_switched_off("packed_linear")


def _bf16_is_native() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of `weight` ([out_features, in_features], fp32 or bf16, on CPU) in oneDNN's
    blocked layout, for `cpu_linear`. The copy is a snapshot: a weight changed afterwards
    must be packed again."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def maybe_pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`pack_linear_weight(weight)` where the packed GEMM is faster on this machine, else
    None (the layer keeps `F.linear`): off the CPU, with the switch off, for dtypes other
    than fp32 and bf16 (bf16 only where the CPU has bf16 instructions; oneDNN emulates it
    otherwise), and for fp32 shapes where it measured slower (`fp32_packed_min_rows`)."""
    if (not packed_linear_enabled() or weight.device.type != "cpu" or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()):
        return None
    if weight.dtype == torch.bfloat16 and _bf16_is_native():
        return pack_linear_weight(weight)
    if weight.dtype == torch.float32:
        if _fp32_min_rows.get((weight.shape[0], weight.shape[1]), 1) is None:
            return None  # this shape was timed slower packed: no copy to pack and drop per layer
        packed = pack_linear_weight(weight)
        return packed if fp32_packed_min_rows(weight, packed) is not None else None
    return None


def fp32_packed_min_rows(weight: torch.Tensor, packed: torch.Tensor) -> int | None:
    """The fewest rows from which `cpu_linear` on `packed` beats `F.linear` on `weight` (fp32,
    [out_features, in_features]), timed on this machine once per shape; None when it wins
    at none of the largest probe sizes. Timings alternate between the two kernels so that
    a burst of load elsewhere on the machine hits both."""
    shape = (weight.shape[0], weight.shape[1])
    if shape not in _fp32_min_rows:
        wins = [_packed_is_faster(weight, packed, rows) for rows in _FP32_PROBE_ROWS]
        # The smallest probe size from which packed wins at every larger one too.
        min_rows = None
        for rows, won in reversed(list(zip(_FP32_PROBE_ROWS, wins))):
            if not won:
                break
            min_rows = rows
        _fp32_min_rows[shape] = min_rows
    return _fp32_min_rows[shape]


def _packed_is_faster(weight: torch.Tensor, packed: torch.Tensor, rows: int) -> bool:
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    best_packed, best_plain = _best_times(lambda: cpu_linear(x, packed, None), lambda: F.linear(x, weight))
    return best_packed < best_plain


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of CPU 0's last-level cache as Linux reports it (sysfs), else 32 MiB."""
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            sizes[level] = int(digits) * scale
    return sizes[max(sizes)] if sizes else 32 << 20


@contextmanager
def probing_with_cold_weights(cold: bool) -> Iterator[None]:
    """While active (cold True), the fp32 probes time each kernel after writing over twice the
    last-level cache, so that it finds no weight in the caches: the engine's case when a
    decode step's weights are more than the cache holds, since each layer's weights are then
    evicted by the others' before the next step. Timed warm, the ~100M Llama's fp32 probes
    on a 2-core Zen 4 EPYC gave oneDNN the qkv, o and down projections at 64 rows in some
    processes (hot, the two kernels were within a few percent); with the weights cold the
    AVX-512 kernel was 1.10-1.19x faster at 64 rows and 1.4-2.1x at 1-16, at every shape.
    It costs load time: the ~100M Llama's fp32 load went from 2.2 to 3.5-3.7 s there."""
    global _probe_evict
    previous = _probe_evict
    _probe_evict = torch.empty(2 * last_level_cache_bytes(), dtype=torch.uint8) if cold else None
    try:
        yield
    finally:
        _probe_evict = previous


def _best_times(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float]:
    """The fastest of _FP32_PROBE_REPEATS timed calls of each kernel. The calls alternate, so
    that a burst of load elsewhere on the machine hits both; with cold probing each call
    follows a write over twice the last-level cache."""
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        first(), second()  # warm-up: first-call setup
        for _ in range(_FP32_PROBE_REPEATS):
            for i, kernel in enumerate((first, second)):
                if _probe_evict is not None:
                    _probe_evict.add_(1)
                start = time.perf_counter()
                kernel()
                best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def amx_linear_enabled() -> bool:
    global _amx_usable
    if not packed_linear_enabled() or envs.kernel_switched_off("amx_linear"):
        return False
    if _amx_usable is None:
        _amx_usable = (native_build.load_native_library("cpu_gemm_amx") is not None
                       and bool(torch.ops.raylm.amx_available()))
    return _amx_usable


def maybe_pack_amx_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in the AMX kernel's tile layout where that kernel runs here (a bf16 CPU
    weight, an AMX CPU, the kernel built), else None. A snapshot, as pack_linear_weight's."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype != torch.bfloat16:
        return None
    if not amx_linear_enabled():
        return None
    return torch.ops.raylm.amx_pack_weight(weight.detach())


def avx512_linear_enabled(dtype: torch.dtype) -> bool:
    """Whether the AVX-512 kernel (`csrc/cpu_gemm_avx512.cpp`) runs dtype here: fp32 with
    AVX-512, bf16 with AVX512-BF16, the library built and neither switch off."""
    if (not packed_linear_enabled() or envs.kernel_switched_off("avx512_linear")
            or dtype not in (torch.float32, torch.bfloat16)):
        return False
    if dtype not in _avx512_usable:
        _avx512_usable[dtype] = (native_build.load_native_library("cpu_gemm_avx512") is not None
                                 and bool(torch.ops.raylm.avx512_linear_available(dtype)))
    return _avx512_usable[dtype]


def avx2_linear_built(dtype: torch.dtype) -> bool:
    """Whether the AVX2 kernel (`csrc/cpu_gemm_avx2.cpp`) is built for dtype here: fp32 or bf16
    (widened to fp32 in registers) wherever the build has AVX2 + FMA, AVX-512 builds included
    (so that their tests run it)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype not in _avx2_usable:
        _avx2_usable[dtype] = (native_build.load_native_library("cpu_gemm_avx2") is not None
                               and bool(torch.ops.raylm.avx2_linear_available(dtype)))
    return _avx2_usable[dtype]


@functools.cache
def _avx512_built() -> bool:
    """Whether the AVX-512 kernel is built here (for fp32: the build has AVX-512), switches aside."""
    return (native_build.load_native_library("cpu_gemm_avx512") is not None
            and bool(torch.ops.raylm.avx512_linear_available(torch.float32)))


def avx2_linear_enabled(dtype: torch.dtype) -> bool:
    """Whether layers take the AVX2 kernel for dtype: where it is built and the build has no
    AVX-512 (CPUs with AVX-512 keep their kernels, in either dtype), and neither switch is off."""
    if not packed_linear_enabled() or envs.kernel_switched_off("avx2_linear"):
        return False
    return avx2_linear_built(dtype) and not _avx512_built()


def pack_streaming_weight(weight: torch.Tensor) -> DecodeWeight | None:
    """The weight packed for the widest streaming decode kernel this machine runs in its dtype,
    with no timing: AMX for bf16 where the CPU has it, else the AVX-512 kernel (bf16 or fp32),
    else the AVX2 one (fp32, or bf16 widened to fp32: CPUs without AVX-512); None for a weight
    off the CPU or where none runs. A snapshot, as pack_linear_weight's."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    amx = maybe_pack_amx_weight(weight)
    if amx is not None:
        return DecodeWeight(amx, torch.ops.raylm.amx_linear, AMX_MAX_ROWS, LINEAR_AMX)
    if avx512_linear_enabled(weight.dtype):
        return DecodeWeight(torch.ops.raylm.avx512_pack_weight(weight.detach()), torch.ops.raylm.avx512_linear,
                            AVX512_MAX_ROWS, LINEAR_AVX512)
    if avx2_linear_enabled(weight.dtype):
        max_rows = AVX2_BF16_MAX_ROWS if weight.dtype == torch.bfloat16 else AVX2_MAX_ROWS
        return DecodeWeight(torch.ops.raylm.avx2_pack_weight(weight.detach()), torch.ops.raylm.avx2_linear,
                            max_rows, LINEAR_AVX2)
    return None


def pack_weight_copies(weight: torch.Tensor) -> tuple[torch.Tensor | None, DecodeWeight | None]:
    """A loaded weight's copies for `linear`: the oneDNN copy (`maybe_pack_linear_weight`) and
    the streaming decode copy (`maybe_pack_decode_weight`), each None where it is not taken."""
    packed_weight = maybe_pack_linear_weight(weight)
    return packed_weight, maybe_pack_decode_weight(weight, packed_weight)


def maybe_pack_decode_weight(weight: torch.Tensor, packed_weight: torch.Tensor | None = None) -> DecodeWeight | None:
    """`pack_streaming_weight(weight)`: always in bf16; in fp32 for the batches at whose probe
    size it timed faster than what `linear` would take otherwise (`packed_weight`, the layer's
    oneDNN copy, or `F.linear`; `fp32_decode_slower_at`), None where that is none."""
    if weight.dtype == torch.float32 and weight.dim() == 2 \
            and _fp32_decode_slower_at.get((weight.shape[0], weight.shape[1])) == _ALL_PROBE_SIZES:
        return None  # timed slower at this shape already: no copy to pack and drop per layer
    decode = pack_streaming_weight(weight)
    if decode is not None and weight.dtype == torch.float32:
        slower_at = fp32_decode_slower_at(weight, packed_weight, decode)
        return None if slower_at == _ALL_PROBE_SIZES else dataclasses.replace(decode, slower_at=slower_at)
    return decode


def maybe_pack_silu_and_mul_weight(weight: torch.Tensor, packed_weight: torch.Tensor | None = None
                                   ) -> DecodeWeight | None:
    """For a gate_up weight [2d, in_features] (gate rows, then up rows) that SiLU-and-mul
    follows, where decode batches would take the AVX-512 or the AVX2 kernel: the weight packed
    for `avx512_linear_silu_mul` / `avx2_linear_silu_mul`, which return silu(gate) * up [.., d]
    from the products still in registers, bit for bit what that kernel and `silu_and_mul`
    give, without writing the [.., 2d] projection out and reading it back (the ~100M Llama's
    generate on a Zen 4 EPYC: fp32 15.37 -> 15.09 s, bf16 8.05 -> 7.95 s; the AVX2 figures
    are in docs/performance.md). bf16 takes it always, as the streaming kernels; fp32 for the
    batches at whose probe size it timed faster than what runs without it, oneDNN
    (`packed_weight`) or `F.linear` and then silu_and_mul (`fp32_silu_and_mul_slower_at`).
    None elsewhere (AMX, no AVX2 kernel either, an odd row count, fp32 slower at every probe
    size): the caller keeps the two steps. A snapshot, as pack_linear_weight's."""
    if (weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[0] % 2
            or envs.kernel_switched_off("silu_and_mul_linear")
            or (weight.dtype == torch.bfloat16 and amx_linear_enabled())):  # AMX streams bf16 there
        return None
    kernel = gated_kernel(weight.dtype)
    if kernel is None:
        return None
    shape = (weight.shape[0], weight.shape[1])
    if weight.dtype == torch.float32 and _fp32_silu_and_mul_slower_at.get(shape) == _ALL_PROBE_SIZES:
        return None  # timed slower at this shape already: no copy to pack and drop per layer
    pack, op, max_rows, kind = kernel
    gated = DecodeWeight(pack(weight.detach()), op, max_rows, kind)
    if weight.dtype != torch.float32:
        return gated
    slower_at = fp32_silu_and_mul_slower_at(weight, packed_weight, gated)
    return None if slower_at == _ALL_PROBE_SIZES else dataclasses.replace(gated, slower_at=slower_at)


# A gated gate_up kernel: (pack, op, max_rows, LINEAR_* kind).
GatedKernel = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor], int, int]


def gated_kernel(dtype: torch.dtype) -> GatedKernel | None:
    """The gated form of the streaming kernel layers take in dtype here (AVX-512, else AVX2),
    or None where they take neither."""
    if avx512_linear_enabled(dtype):
        return (torch.ops.raylm.avx512_pack_gated_weight, torch.ops.raylm.avx512_linear_silu_mul, AVX512_MAX_ROWS,
                LINEAR_AVX512_SILU_MUL)
    if avx2_linear_enabled(dtype):
        max_rows = AVX2_BF16_MAX_ROWS if dtype == torch.bfloat16 else AVX2_MAX_ROWS
        return (torch.ops.raylm.avx2_pack_gated_weight, torch.ops.raylm.avx2_linear_silu_mul, max_rows,
                LINEAR_AVX2_SILU_MUL)
    return None


# Every probe size: a streaming copy slower at all of them is not kept.
_ALL_PROBE_SIZES = frozenset(_FP32_PROBE_ROWS)


def fp32_silu_and_mul_slower_at(weight: torch.Tensor, packed_weight: torch.Tensor | None,
                                gated: DecodeWeight) -> frozenset[int]:
    """The probe sizes at which the gated kernel is slower than the GEMM `linear` takes
    without a streaming copy followed by silu_and_mul (fp32; timed once per shape). Timed
    against the plain streaming kernel instead, the choice turned on noise: on a Zen 4 EPYC
    that kernel and oneDNN were within a few percent at the ~100M Llama's gate_up (64 rows,
    weights cold), and some loads gave the layer to oneDNN, without the fused activation."""
    shape = (weight.shape[0], weight.shape[1])
    if shape not in _fp32_silu_and_mul_slower_at:
        _fp32_silu_and_mul_slower_at[shape] = _probe_sizes_slower(
            weight, gated, lambda x: gated.op(x, gated.packed, weight.shape[0] // 2),
            lambda x: cpu_ops.silu_and_mul_any(linear(x, weight, packed_weight, None)))
    return _fp32_silu_and_mul_slower_at[shape]


def fp32_decode_slower_at(weight: torch.Tensor, packed_weight: torch.Tensor | None,
                          decode: DecodeWeight) -> frozenset[int]:
    """The probe sizes at which the decode kernel is slower than the kernel `linear` takes
    without it (fp32; timed once per shape). The AVX-512 kernel won at every decode size of
    the ~100M Llama on a Zen 4 EPYC, but on Intel CPUs `F.linear` (MKL) is strong for small
    fp32 shapes, so the choice is measured rather than assumed."""
    shape = (weight.shape[0], weight.shape[1])
    if shape not in _fp32_decode_slower_at:
        _fp32_decode_slower_at[shape] = _probe_sizes_slower(
            weight, decode, lambda x: decode.op(x, decode.packed, weight.shape[0], None),
            lambda x: linear(x, weight, packed_weight, None))
    return _fp32_decode_slower_at[shape]


def _probe_sizes_slower(weight: torch.Tensor, streaming: DecodeWeight, streaming_call: Callable[[torch.Tensor], object],
                        other_call: Callable[[torch.Tensor], object]) -> frozenset[int]:
    """The probe sizes at which `streaming_call(x)` timed slower than `other_call(x)`, with
    those past the kernel's `max_rows`, alternating as fp32_packed_min_rows does. Each size
    is decided on its own: a batch then takes the kernel that won at the size it rounds up
    to (`DecodeWeight.takes`). Deciding "up to the first loss" instead, a noisy or genuine
    loss at 16 rows (where both kernels wait on memory) gave away the 64-row decode batches,
    which the AVX-512 kernels ran 10-18% faster: on a 2-core Zen 5 EPYC, loads of the ~100M
    Llama in fp32 put its gate_up and LM head on oneDNN in two processes of four."""
    slower = set()
    for rows in _FP32_PROBE_ROWS:
        if rows > streaming.max_rows:
            slower.add(rows)
            continue
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        best_streaming, best_other = _best_times(lambda: streaming_call(x), lambda: other_call(x))
        if best_streaming >= best_other:
            slower.add(rows)
    return frozenset(slower)


def onednn_rows(rows: int) -> int:
    """The rows a oneDNN GEMM of `rows` rows runs with (`cpu_linear` pads the rest): `rows`
    up to ONEDNN_EXACT_ROWS, else `rows` rounded up to the next of ONEDNN_ROWS_PER_DOUBLING
    evenly spaced counts between the powers of two around it (2^k < rows <= 2^(k+1): a
    multiple of 2^k / ONEDNN_ROWS_PER_DOUBLING), which adds less than 1/ONEDNN_ROWS_PER_DOUBLING.
    csrc/cpu_decode_layers.cpp's onednn_rows is the same function."""
    if not _pad_onednn_rows or rows <= ONEDNN_EXACT_ROWS:
        return rows
    step = (1 << ((rows - 1).bit_length() - 1)) // ONEDNN_ROWS_PER_DOUBLING
    return -(-rows // step) * step


@contextmanager
def exact_onednn_rows() -> Iterator[None]:
    """While active, `cpu_linear` runs oneDNN at the rows it is given, unpadded: for the
    benchmark that measures what the padding costs (cluster/benchmarks/bench_onednn_rows.py)."""
    global _pad_onednn_rows
    previous, _pad_onednn_rows = _pad_onednn_rows, False
    try:
        yield
    finally:
        _pad_onednn_rows = previous


def cpu_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed_weight` was packed from; x may
    have any number of leading dimensions (or none). Runs at `onednn_rows(rows)` rows,
    zeros below x's, and returns the first `rows` rows of the product."""
    rows = x.numel() // x.shape[-1] if x.dim() > 1 and x.shape[-1] else 0
    padded_rows = onednn_rows(rows)
    if padded_rows == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    padded = x.new_empty(padded_rows, x.shape[-1])
    padded[:rows].view(x.shape).copy_(x)
    padded[rows:].zero_()
    out = torch.ops.mkldnn._linear_pointwise(padded, packed_weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, packed_weight: torch.Tensor | None,
           bias: torch.Tensor | None, decode_weight: DecodeWeight | None = None) -> torch.Tensor:
    """The streaming decode kernel (AMX or AVX-512) for a decode-sized batch where the weight
    was packed for it, else the packed oneDNN GEMM where the weight was packed and x suits
    it, else `F.linear` (see `choose_linear`)."""
    if x.device.type != "cpu" or (packed_weight is None and decode_weight is None):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    kind, chosen = choose_linear(weight, packed_weight, None if x.requires_grad else decode_weight, rows, x.dtype)
    if kind == LINEAR_DENSE:
        return F.linear(x, weight, bias)
    if kind == LINEAR_ONEDNN:
        return cpu_linear(x, chosen, bias)
    return decode_weight.op(x, chosen, weight.shape[0], bias)


def choose_linear(weight: torch.Tensor, packed_weight: torch.Tensor | None, decode_weight: DecodeWeight | None,
                  rows: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """The kernel (LINEAR_*) that `linear` runs on `rows` rows of CPU activations of `dtype`,
    and the copy of the weight it reads."""
    if decode_weight is not None and dtype == decode_weight.packed.dtype and decode_weight.takes(rows):
        return decode_weight.kind, decode_weight.packed
    if packed_weight is not None and dtype == packed_weight.dtype:
        # A weight packed other than by maybe_pack_linear_weight has no timing: packed throughout.
        min_rows = (_fp32_min_rows.get((weight.shape[0], weight.shape[1])) or 1) if dtype == torch.float32 else 1
        if rows >= min_rows:
            return LINEAR_ONEDNN, packed_weight
    return LINEAR_DENSE, weight
