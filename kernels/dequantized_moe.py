"""Fused Mixture-of-Experts over experts held quantized (FP8, GPTQ, AWQ): each call
dequantizes a chunk of experts at a time into the activations' dtype and runs the
unquantized fused-experts kernel (native CPU op, Triton, or the PyTorch reference) on it.
The formats differ only in how a chunk is dequantized (`kernels/fp8_fused_moe.py`,
`kernels/int4_fused_moe.py`); the chunking and the sum over chunks are here.

Which experts: on the CPU only those some token is routed to (a decode step touches few of
them), found from the router's choice; on CUDA all local experts, in chunks of fixed size,
so that nothing waits for the GPU and the same kernels are launched every step
(`parallel/dequantized_moe_method.py` picks them).

Each chunk's output is a partial sum over its experts (the others are masked by an
`expert_map` of -1); chunks add up in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Dequantized weight bytes per chunk: one expert of Qwen3-30B-A3B in bf16 is ~9 MiB, so a
# chunk is one or two experts there, and every expert of a small model at once.
DEQUANT_CHUNK_BYTES = 16 * 2**20

# run(x, w13, w2, topk_weights, topk_ids, expert_map, w13_bias, w2_bias) -> [T, H]: the
# layer's unquantized fused-experts kernel.
ExpertsKernel = Callable[..., torch.Tensor]
# dequantize(local experts [n] int64) -> (w13 [n, 2I, H], w2 [n, H, I]) in the activations' dtype.
ExpertsDequantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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


def chunked_fused_experts(run: ExpertsKernel, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          chunks: list[tuple[torch.Tensor, torch.Tensor]], dequantize: ExpertsDequantizer,
                          w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' output [T, H] in x's dtype: for each (local experts, expert_map) of
    `chunks`, those experts dequantized and run by `run`, the partial sums added in fp32."""
    if not chunks:  # no token routed to a local expert (expert parallelism)
        return torch.zeros_like(x)
    total: torch.Tensor | None = None
    for experts, expert_map in chunks:
        w13, w2 = dequantize(experts)
        out = run(x, w13, w2, topk_weights, topk_ids, expert_map, None if w13_bias is None else w13_bias[experts],
                  None if w2_bias is None else w2_bias[experts])
        if len(chunks) == 1:
            return out
        total = out.float() if total is None else total.add_(out)
    return total.to(x.dtype)
