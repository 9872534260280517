"""Mixture-of-Experts in plain PyTorch: the router's top-k choice, and the reference that the
fused-experts kernels (`cpu_fused_moe`, `triton_fused_moe`) are checked against.

Weights follow the fused layout every kernel shares (vLLM's): w13 [E, 2I, H], each expert's
gate_proj rows then its up_proj rows, and w2 [E, H, I], its down_proj. An expert computes
down(silu(gate x) * up x). `expert_map` [E_global] maps a global expert id to its row of
these weights, or -1 for an expert held by another rank (expert parallelism).

gpt-oss's experts (vLLM's activation "swigluoai") have biases, w13_bias [E, 2I] (gate's then
up's) and w2_bias [E, H], and a clamped SwiGLU: with gate g clamped above at `limit` and up u
clamped to [-limit, limit], (u + 1) * g * sigmoid(alpha * g) (alpha 1.702).
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


ACTIVATIONS = ("silu", "swigluoai")
SWIGLUOAI_ALPHA = 1.702


def fused_topk_softmax_after(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router: the top_k largest logits, then the softmax over those k (Hugging
    Face's GptOssTopKRouter). router_logits [T, E] -> (topk_weights [T, top_k] fp32,
    topk_ids [T, top_k] int64)."""
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, num_experts={router_logits.shape[-1]}], got {top_k}.")
    topk_logits, topk_ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(topk_logits.float(), dim=-1), topk_ids


def swigluoai_and_mul(gate_up: torch.Tensor, limit: float, alpha: float = SWIGLUOAI_ALPHA) -> torch.Tensor:
    """[N, 2I] (gate's columns, then up's) -> [N, I]: (up + 1) * gate * sigmoid(alpha * gate),
    gate clamped above at limit, up to [-limit, limit], in Hugging Face's order of operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None, *,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: str = "silu", swiglu_limit: float | None = None,
                  swiglu_alpha: float = SWIGLUOAI_ALPHA) -> torch.Tensor:
    """x [T, H] -> sum over each token's k choices of topk_weight * expert(x), [T, H] in x's
    dtype; choices of experts this rank does not hold (expert_map -1) add nothing. One expert
    at a time in Python: the reference, and the path of last resort where no kernel runs.
    With biases and activation "swigluoai" (gpt-oss, `swiglu_limit` its clamp), see the
    module docstring; a tensor-parallel rank whose partial sum must not repeat the down
    projection's bias passes w2_bias None."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoE activation must be one of {ACTIVATIONS}, got {activation!r}.")
    if activation == "swigluoai" and swiglu_limit is None:
        raise ValueError("the swigluoai activation needs its swiglu_limit.")
    intermediate = w2.shape[2]
    local_ids = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        tokens, choice = torch.nonzero(local_ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = F.linear(x[tokens], w13[expert], None if w13_bias is None else w13_bias[expert])
        if activation == "silu":
            hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        else:
            hidden = swigluoai_and_mul(gate_up, swiglu_limit, swiglu_alpha)
        down = F.linear(hidden, w2[expert], None if w2_bias is None else w2_bias[expert])
        contribution = down.float() * topk_weights[tokens, choice, None].float()
        out.index_add_(0, tokens, contribution)
    return out.to(x.dtype)
