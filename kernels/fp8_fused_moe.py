"""Fused Mixture-of-Experts over FP8 experts: the weights stay float8_e4m3fn in memory, and
each call dequantizes a chunk of experts at a time into the activations' dtype and runs the
unquantized fused-experts kernel (native CPU op, Triton, or the PyTorch reference) on it.

An expert's w13 [2I, H] and w2 [H, I] dequantize as the dense FP8 layers' weights do
(`kernels/fp8_linear.py`): `fp8.float() * scale`, the scale of each element's row
(`[E, rows]`: per-tensor scales spread over their shard's rows, or per-channel ones) or
block (`[E, ceil(rows / bn), ceil(columns / bk)]`).

Which experts: on the CPU only those some token is routed to (a decode step touches few of
them), found from the router's choice; on CUDA all local experts, in chunks of fixed size,
so that nothing waits for the GPU and the same kernels are launched every step. There is
no fp8 grouped GEMM: vLLM's fp8 MoE kernels (W8A8 Triton/CUTLASS) are not ported, so on a
GPU this saves memory, not time.

Each chunk's output is a partial sum over its experts (the others are masked by an
`expert_map` of -1); chunks add up in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from raylm.kernels import cpu_fused_moe

# Dequantized weight bytes per chunk: one expert of Qwen3-30B-A3B in bf16 is ~9 MiB, so a
# chunk is one or two experts there, and every expert of a small model at once.
DEQUANT_CHUNK_BYTES = 16 * 2**20

# run(x, w13, w2, topk_weights, topk_ids, expert_map, w13_bias, w2_bias) -> [T, H]: the
# layer's unquantized fused-experts kernel.
ExpertsKernel = Callable[..., torch.Tensor]


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


def expert_chunks(experts: torch.Tensor, bytes_per_expert: int, chunk_bytes: int = DEQUANT_CHUNK_BYTES
                  ) -> list[torch.Tensor]:
    """`experts` (local ids) split into chunks of at most chunk_bytes of dequantized weights,
    one expert at least."""
    per_chunk = max(1, chunk_bytes // max(1, bytes_per_expert))
    return list(experts.split(per_chunk))


def chunk_expert_map(num_experts: int, first_expert: int, chunk: torch.Tensor) -> torch.Tensor:
    """[num_experts] int32: the global id of each local expert in `chunk` -> its row in the
    chunk's dequantized weights, every other expert -1 (its tokens add nothing)."""
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=chunk.device)
    expert_map[chunk + first_expert] = torch.arange(chunk.numel(), dtype=torch.int32, device=chunk.device)
    return expert_map


def routed_local_experts(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """The local expert rows (int64, ascending) that some token of `topk_ids` is routed to."""
    local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    routed = torch.unique(local)
    return routed[routed >= 0]


def fp8_fused_experts(run: ExpertsKernel, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      chunks: list[tuple[torch.Tensor, torch.Tensor]], w13: torch.Tensor, w13_scale: torch.Tensor,
                      w2: torch.Tensor, w2_scale: torch.Tensor, block_size: tuple[int, int] | None,
                      w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' output [T, H] in x's dtype: for each (local experts, expert_map) of
    `chunks`, those experts dequantized and run by `run`, the partial sums added in fp32."""
    if not chunks:  # no token routed to a local expert (expert parallelism)
        return torch.zeros_like(x)
    total: torch.Tensor | None = None
    for experts, expert_map in chunks:
        out = run(x, dequantize_experts(w13, w13_scale, block_size, experts, x.dtype),
                  dequantize_experts(w2, w2_scale, block_size, experts, x.dtype), topk_weights, topk_ids,
                  expert_map, None if w13_bias is None else w13_bias[experts],
                  None if w2_bias is None else w2_bias[experts])
        if len(chunks) == 1:
            return out
        total = out.float() if total is None else total.add_(out)
    return total.to(x.dtype)
