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

`RAYLM_CPU_PACKED_LINEAR=0` turns both off (every layer then calls `F.linear`);
`RAYLM_CPU_AMX_LINEAR=0` only the AMX kernel.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from raylm.kernels import native_build


# fp32 below this many weight elements (every projection of the 5M benchmark Llama), and
# fp32 GEMVs, lose to F.linear: oneDNN's fixed cost per call (~15 us) outweighs its faster
# kernel there, and end to end the 5M model ran ~10% slower packed. bf16 won at every size.
_MIN_FP32_WEIGHT_NUMEL = 1 << 20
_MIN_FP32_ROWS = 4
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
    otherwise), and for fp32 weights too small to gain."""
    if (not packed_linear_enabled() or weight.device.type != "cpu" or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()):
        return None
    if weight.dtype == torch.bfloat16 and _bf16_is_native():
        return pack_linear_weight(weight)
    if weight.dtype == torch.float32 and weight.numel() >= _MIN_FP32_WEIGHT_NUMEL:
        return pack_linear_weight(weight)
    return None


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
        if x.dtype != torch.float32 or x.numel() >= _MIN_FP32_ROWS * x.shape[-1]:
            return cpu_linear(x, packed_weight, bias)
    return F.linear(x, weight, bias)
