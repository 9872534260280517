"""The CPU GEMM behind the linear layers: oneDNN with the weight packed once, at load.

`F.linear` on CPU (a BLAS GEMM) packs the weight into its kernel's panels on every call; oneDNN's linear
with the weight reordered once into its blocked layout skips that, and on an AVX-512 /
AMX Xeon it ran 1.5-1.9x faster than `F.linear` at decode batch sizes (16-64 tokens) for
the ~100M Llama's projections in fp32 and bf16, and no slower at 1024 tokens
(`python -m raylm.cluster.benchmarks.bench_linear`); end to end that model decoded 1.2x faster in fp32.
The same op serves any number of tokens, so one packed copy serves prefill and decode.

`RAYLM_CPU_PACKED_LINEAR=0` turns it off (every layer then calls `F.linear`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


# fp32 below this many weight elements (every projection of the 5M benchmark Llama), and
# fp32 GEMVs, lose to F.linear: oneDNN's fixed cost per call (~15 us) outweighs its faster
# kernel there, and end to end the 5M model ran ~10% slower packed. bf16 won at every size.
_MIN_FP32_WEIGHT_NUMEL = 1 << 20
_MIN_FP32_ROWS = 4


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
    otherwise), and for fp32 weights too small to gain."""
    if (not packed_linear_enabled() or weight.device.type != "cpu" or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()):
        return None
    if weight.dtype == torch.bfloat16 and _bf16_is_native():
        return pack_linear_weight(weight)
    if weight.dtype == torch.float32 and weight.numel() >= _MIN_FP32_WEIGHT_NUMEL:
        return pack_linear_weight(weight)
    return None


def cpu_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed_weight` was packed from; x may
    have any number of leading dimensions (or none)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, packed_weight: torch.Tensor | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """The packed GEMM where the weight was packed and x suits it, else `F.linear`."""
    if packed_weight is not None and x.device.type == "cpu" and x.dtype == packed_weight.dtype:
        if x.dtype != torch.float32 or x.numel() >= _MIN_FP32_ROWS * x.shape[-1]:
            return cpu_linear(x, packed_weight, bias)
    return F.linear(x, weight, bias)
