"""Fused Mixture-of-Experts on the CPU (`csrc/cpu_fused_moe.cpp`): every expert's gated MLP
over the tokens routed to it, in one native call per layer, with no Python between experts.

Where the AVX-512 GEMM runs the weights' dtype (`cpu_gemm.avx512_linear_enabled`), each
expert's gate_up and down are packed at load into that kernel's panels (`pack_experts`) and
`avx512_fused_moe` runs the grouped GEMMs on them, SiLU-and-mul applied as the gate_up
products are stored. Elsewhere `dense_fused_moe` groups the tokens the same way and runs
ATen's GEMM on each expert's group, from C++; it alone takes gpt-oss's expert biases and
"swigluoai" activation. Without the native library the PyTorch reference runs
(`torch_moe.fused_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.kernels import cpu_gemm, cpu_ops, torch_moe
from raylm.kernels.native_build import load_native_library


@dataclass(frozen=True)
class PackedExperts:
    """Every local expert's weights in the AVX-512 panels: w13 [E, ceil(I / 32), steps, 256 B]
    (gated: each panel 32 gate rows and their 32 up rows), w2 [E, ceil(H / 64), steps, 256 B].
    A snapshot of the weights it was packed from."""

    w13: torch.Tensor
    w2: torch.Tensor
    intermediate_size: int


def library_loaded() -> bool:
    return load_native_library("cpu_fused_moe") is not None


def _avx512_runs(dtype: torch.dtype) -> bool:
    return (cpu_gemm.avx512_linear_enabled(dtype) and library_loaded()
            and bool(torch.ops.raylm.avx512_fused_moe_available(dtype)))


def _stack_packed(weights: torch.Tensor, pack) -> torch.Tensor:
    """pack(weights[e]) for every expert, stacked [E, ...] on huge pages, as the linear
    layers' streaming copies are (a decode step reads them once each)."""
    first = pack(weights[0])
    stacked = cpu_ops.zeros_on_huge_pages((weights.shape[0], *first.shape), first.dtype)
    stacked[0].copy_(first)
    for expert in range(1, weights.shape[0]):  # at load only
        stacked[expert].copy_(pack(weights[expert]))
    return stacked


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts | None:
    """The weights packed for `avx512_fused_moe` where it runs their dtype here (CPU, AVX-512,
    bf16 with AVX512-BF16, the libraries built, `RAYLM_CPU_PACKED_LINEAR` and
    `RAYLM_CPU_AVX512_LINEAR` not 0); else None."""
    if w13.device.type != "cpu" or w13.shape[0] == 0 or not _avx512_runs(w13.dtype):
        return None
    return PackedExperts(_stack_packed(w13.detach(), torch.ops.raylm.avx512_pack_gated_weight),
                         _stack_packed(w2.detach(), torch.ops.raylm.avx512_pack_weight), w2.shape[2])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                  packed: PackedExperts | None = None, *, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation: str = "silu", swiglu_limit: float | None = None,
                  swiglu_alpha: float = torch_moe.SWIGLUOAI_ALPHA) -> torch.Tensor:
    """`torch_moe.fused_experts`'s result for CPU tensors (its biases and activation too): on
    the packed panels where `packed` is given in x's dtype (no biases, SiLU), else on ATen's
    GEMM per expert group (both one native call), else in PyTorch."""
    topk_weights = topk_weights.float()
    gpt_oss = w13_bias is not None or w2_bias is not None or activation != "silu"
    if gpt_oss:
        if activation not in torch_moe.ACTIVATIONS or (activation == "swigluoai" and not swiglu_limit):
            raise ValueError(f"MoE activation must be 'silu' or 'swigluoai' with a positive swiglu_limit, got "
                             f"{activation!r} with {swiglu_limit!r}.")
        if library_loaded() and not x.requires_grad:
            return torch.ops.raylm.dense_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map, w13_bias, w2_bias,
                                                   float(swiglu_limit) if activation == "swigluoai" else 0.0,
                                                   float(swiglu_alpha))
        return torch_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, expert_map, w13_bias=w13_bias,
                                       w2_bias=w2_bias, activation=activation, swiglu_limit=swiglu_limit,
                                       swiglu_alpha=swiglu_alpha)
    if packed is not None and packed.w13.dtype == x.dtype and not x.requires_grad:
        return torch.ops.raylm.avx512_fused_moe(x, packed.w13, packed.w2, topk_weights, topk_ids, expert_map,
                                                packed.intermediate_size)
    if library_loaded() and not x.requires_grad:
        return torch.ops.raylm.dense_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map)
    return torch_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, expert_map)
