"""Mixture-of-Experts in plain PyTorch: the router's top-k choice, and the reference that the
fused-experts kernels (`cpu_fused_moe`, `triton_fused_moe`) are checked against.

Weights follow the fused layout every kernel shares (vLLM's): w13 [E, 2I, H], each expert's
gate_proj rows then its up_proj rows, and w2 [E, H, I], its down_proj. An expert computes
down(silu(gate x) * up x). `expert_map` [E_global] maps a global expert id to its row of
these weights, or -1 for an expert held by another rank (expert parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice, as Hugging Face's Mixtral and Qwen-MoE routers make it: softmax
    over the experts in fp32, the top_k most probable, and with `renormalize` their
    probabilities divided by their sum (Mixtral always; Qwen's `norm_topk_prob`).
    router_logits [T, E] -> (topk_weights [T, top_k] fp32, topk_ids [T, top_k] int64)."""
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, num_experts={router_logits.shape[-1]}], got {top_k}.")
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> sum over each token's k choices of topk_weight * expert(x), [T, H] in x's
    dtype; choices of experts this rank does not hold (expert_map -1) add nothing. One expert
    at a time in Python: the reference, and the path of last resort where no kernel runs."""
    intermediate = w2.shape[2]
    local_ids = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        tokens, choice = torch.nonzero(local_ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = F.linear(x[tokens], w13[expert])
        activation = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        contribution = F.linear(activation, w2[expert]).float() * topk_weights[tokens, choice, None].float()
        out.index_add_(0, tokens, contribution)
    return out.to(x.dtype)
