"""Fused Mixture-of-Experts over FP8 experts: the weights stay float8_e4m3fn in memory, and
each call dequantizes a chunk of experts at a time into the activations' dtype and runs the
unquantized fused-experts kernel (native CPU op, Triton, or the PyTorch reference) on it.

An expert's w13 [2I, H] and w2 [H, I] dequantize as the dense FP8 layers' weights do
(`kernels/fp8_linear.py`): `fp8.float() * scale`, the scale of each element's row
(`[E, rows]`: per-tensor scales spread over their shard's rows, or per-channel ones) or
block (`[E, ceil(rows / bn), ceil(columns / bk)]`).

There is no fp8 grouped GEMM: vLLM's fp8 MoE kernels (W8A8 Triton/CUTLASS) are not ported, so
on a GPU this saves memory, not time. The chunking (which experts, how many at a time) is
`kernels/dequantized_moe.py`'s, shared with GPTQ and AWQ experts.
"""

from __future__ import annotations

import torch

from raylm.kernels import cpu_fused_moe
# The chunking, shared with GPTQ/AWQ experts (and read from here by older callers).
from raylm.kernels.dequantized_moe import (DEQUANT_CHUNK_BYTES, ExpertsKernel, chunk_expert_map,  # noqa: F401
                                           chunked_fused_experts, expert_chunks, routed_local_experts)


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None,
                       experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [E, R, C] fp8 -> its experts `experts` (local rows, int64) [n, R, C] in `dtype`:
    `weight.float() * scale` of each element's row (scale [E, R]) or block (scale [E, ceil(R / bn),
    ceil(C / bk)] for block_size (bn, bk)), computed in fp32 and rounded to `dtype` once."""
    num_experts, rows, columns = weight.shape
    row_group, column_group = block_size if block_size is not None else (1, columns)
    if (weight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous()
            and cpu_fused_moe.library_loaded()):
        # One native pass over the bytes (a table lookup, the scale, the rounding): PyTorch's
        # fp8 cast and separate scaling took several times longer (docs/quantization.md).
        grid = scale.float().reshape(num_experts, -(-rows // row_group), -(-columns // column_group)).contiguous()
        return torch.ops.raylm.dequantize_fp8_experts(weight.view(torch.uint8), experts, grid, row_group,
                                                      column_group, dtype)
    # e4m3 values are exact in every float dtype; the in-place product with the fp32 scale
    # is computed in fp32 and rounded once.
    values = weight[experts].to(dtype)
    scale = scale[experts].float()
    if block_size is None:
        return values.mul_(scale.unsqueeze(-1))
    expanded = scale.repeat_interleave(row_group, 1)[:, :rows].repeat_interleave(column_group, 2)[:, :, :columns]
    return values.mul_(expanded)


def fp8_fused_experts(run: ExpertsKernel, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      chunks: list[tuple[torch.Tensor, torch.Tensor]], w13: torch.Tensor, w13_scale: torch.Tensor,
                      w2: torch.Tensor, w2_scale: torch.Tensor, block_size: tuple[int, int] | None,
                      w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' output [T, H] in x's dtype: for each (local experts, expert_map) of
    `chunks`, those experts dequantized and run by `run`, the partial sums added in fp32."""
    def dequantize(experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_experts(w13, w13_scale, block_size, experts, x.dtype),
                dequantize_experts(w2, w2_scale, block_size, experts, x.dtype))

    return chunked_fused_experts(run, x, topk_weights, topk_ids, chunks, dequantize, w13_bias, w2_bias)
