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

Whether fp32 gains depends on the CPU and the shape, so each fp32 shape is timed once, at
load (`fp32_packed_min_rows`): on the AMX Xeon `F.linear` won for weights under ~1M
elements (oneDNN's fixed cost per call, ~15 us, outweighed its faster kernel) and for
GEMVs; on a 2-core AMD EPYC (Zen 4) oneDNN won at every shape of the 5M Llama from 4 rows,
and `F.linear` (MKL, which takes no AVX-512 path on AMD CPUs) ran that model's decode GEMMs
at ~57 GFLOP/s. bf16 packed won everywhere it was measured and is always taken.

`RAYLM_CPU_PACKED_LINEAR=0` turns both off (every layer then calls `F.linear`);
`RAYLM_CPU_AMX_LINEAR=0` only the AMX kernel.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from raylm.kernels import native_build


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
# Tokens up to which the AMX kernel beats oneDNN (measured 1.1-1.5x at 256, 0.55-1.3x at 1024).
AMX_MAX_ROWS = 256

# None: not tried yet; else whether the AMX kernel is built and the CPU lets us use it.
_amx_usable: bool | None = None


def packed_linear_enabled() -> bool:
    return os.environ.get("RAYLM_CPU_PACKED_LINEAR", "1") != "0"


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
    best_packed = best_plain = float("inf")
    with torch.inference_mode():
        cpu_linear(x, packed, None), F.linear(x, weight)  # warm-up: first-call setup, caches
        for _ in range(_FP32_PROBE_REPEATS):
            start = time.perf_counter()
            cpu_linear(x, packed, None)
            middle = time.perf_counter()
            F.linear(x, weight)
            best_packed = min(best_packed, middle - start)
            best_plain = min(best_plain, time.perf_counter() - middle)
    return best_packed < best_plain


def amx_linear_enabled() -> bool:
    global _amx_usable
    if not packed_linear_enabled() or os.environ.get("RAYLM_CPU_AMX_LINEAR", "1") == "0":
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


def cpu_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed_weight` was packed from; x may
    have any number of leading dimensions (or none)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, packed_weight: torch.Tensor | None,
           bias: torch.Tensor | None, amx_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The AMX kernel for a few bf16 tokens where the weight was packed for it, else the
    packed oneDNN GEMM where the weight was packed and x suits it, else `F.linear`."""
    if (amx_weight is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and not x.requires_grad
            and x.numel() <= AMX_MAX_ROWS * x.shape[-1]):
        return torch.ops.raylm.amx_linear(x, amx_weight, weight.shape[0], bias)
    if packed_weight is not None and x.device.type == "cpu" and x.dtype == packed_weight.dtype:
        # A weight packed other than by maybe_pack_linear_weight has no timing: packed throughout.
        min_rows = 1
        if x.dtype == torch.float32:
            min_rows = _fp32_min_rows.get((weight.shape[0], weight.shape[1])) or 1
        if x.numel() >= min_rows * x.shape[-1]:
            return cpu_linear(x, packed_weight, bias)
    return F.linear(x, weight, bias)
