"""`DequantizedMoEMethod`: what the MoE methods over quantized experts (`Fp8MoEMethod`,
`Int4MoEMethod`) share. Their experts stay quantized in memory; each forward dequantizes a
chunk of them at a time (~16 MiB of the activations' dtype, one expert at least) and runs
the layer's unquantized fused-experts kernel on it (`kernels/dequantized_moe.py`): on the
CPU only the experts some token is routed to, on CUDA every local expert in the same
chunks every step (nothing waits on the GPU's routing, and a CUDA graph replays the same
launches). A subclass says how one chunk dequantizes and how many bytes an expert takes
dequantized.
"""

from __future__ import annotations

import torch

from raylm.kernels.dequantized_moe import chunk_expert_map, chunked_fused_experts, expert_chunks, routed_local_experts
from raylm.parallel.fused_moe_weights import FusedMoEWeights


class DequantizedMoEMethod:
    """`apply` over chunks of dequantized experts; subclasses give `dequantize_chunk`."""

    def dequantize_chunk(self, layer: FusedMoEWeights, experts: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Local experts `experts` (int64) as (w13 [n, 2 I_local, H], w2 [n, H, I_local]) in `dtype`."""
        raise NotImplementedError

    def reset_chunks(self, layer: FusedMoEWeights) -> None:
        """Forgets the CUDA chunk plan (after the weights are (re)loaded)."""
        layer.dequant_gpu_chunks = None

    def apply(self, layer: FusedMoEWeights, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' output [T, H] (this rank's partial sum), as `FusedMoE.run_experts` computes
        it on the dequantized weights."""
        size, hidden = layer.intermediate_size_per_partition, layer.hidden_size
        bytes_per_expert = 3 * size * hidden * x.element_size()  # w13 [2I, H] and w2 [H, I]
        if x.device.type == "cuda":
            if getattr(layer, "dequant_gpu_chunks", None) is None:
                every = torch.arange(layer.num_local_experts, device=x.device)
                layer.dequant_gpu_chunks = _with_maps(layer, expert_chunks(every, bytes_per_expert))
            chunks = layer.dequant_gpu_chunks
        else:
            chunks = _with_maps(layer, expert_chunks(routed_local_experts(topk_ids, layer.expert_map),
                                                     bytes_per_expert))
        return chunked_fused_experts(layer.run_experts, x, topk_weights, topk_ids, chunks,
                                     lambda experts: self.dequantize_chunk(layer, experts, x.dtype),
                                     layer.w13_bias, layer.w2_bias if layer.adds_w2_bias else None)


def _with_maps(layer: FusedMoEWeights, chunks: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(chunk, chunk_expert_map(layer.num_experts, layer.first_expert, chunk)) for chunk in chunks]
