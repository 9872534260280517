"""Fused Mixture-of-Experts for CUDA in Triton, in the manner of vLLM's fused_moe.

The (token, k) assignments are sorted by expert and each expert's run padded to a whole
number of BLOCK_M rows (`moe_align_block_size`), so every block of BLOCK_M rows belongs to
one expert. One grouped GEMM then runs every expert's gate_up at once: a program takes one
row block and one BLOCK_N column block, reads its expert's weight and its tokens' rows of x
(gathered through the sorted ids), and stores the products at the assignments' rows. SiLU-
and-mul follows in PyTorch, then the second grouped GEMM runs every down projection, scaling
each row by its routing weight, into fp32 rows that are summed per token.

The alignment runs in PyTorch without reading anything back to the host: its buffers are
sized for the worst case (each expert's run padded by up to BLOCK_M - 1 rows) and blocks
past the real end (`num_tokens_post_padded`, on the device) return at once.

Same contract as `torch_moe.fused_experts`, gpt-oss's expert biases (HAS_BIAS: each row
block's expert's bias added to its products before the routing weight) and "swigluoai"
activation (in PyTorch, as SiLU-and-mul) included. Under TRITON_INTERPRET (CPU tensors) low-
precision inputs are widened to fp32 before each tl.dot, which the interpreter gets wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from raylm.kernels import torch_moe


@triton.jit
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    bias_ptr,
    N, K, num_valid_tokens,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_bias_e,
    TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr = False,
):
    # C[assignment, n] = A[row of assignment] . B[expert][n] (* routing weight), for the
    # BLOCK_M sorted assignments of row block pid_m, all of one expert.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_token = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    token_mask = offs_token < num_valid_tokens  # padding rows hold num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # GEMM 1 reads token rows of x (an assignment is token * TOP_K + k); GEMM 2 (TOP_K 1)
    # reads the assignment's own row of the activation.
    a_ptrs = a_ptr + (offs_token // TOP_K)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_mask, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & n_mask[None, :])


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                         expert_map: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The assignments (flat indices token * top_k + k of topk_ids [T, top_k]) sorted by their
    local expert, each expert's run padded with the index T * top_k to a multiple of block_m.

    Returns sorted_token_ids [worst-case length], expert_ids [one per block of block_m: the
    local expert, -1 past the end] and num_tokens_post_padded [1] (the padded length used).
    Assignments to experts this rank does not hold (expert_map -1) are left out."""
    flat = topk_ids.reshape(-1).long()
    num_valid = flat.numel()
    device = flat.device
    local = flat if expert_map is None else expert_map.long()[flat]
    bucket = torch.where(local < 0, num_experts, local)  # bucket num_experts: not held here
    # scatter_add rather than bincount, which reads the largest id back to the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, bucket,
                                                                                      torch.ones_like(bucket))
    starts = torch.cumsum(counts, 0) - counts
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    max_length = triton.cdiv(num_valid + num_experts * (block_m - 1), block_m) * block_m
    # Where each expert's padded run starts; the left-out bucket goes to a spare last slot.
    padded_starts = torch.cat([padded_ends - padded, torch.full((1,), max_length, device=device)])
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank_in_run = torch.arange(num_valid, device=device) - starts[sorted_bucket]
    destination = torch.where(sorted_bucket < num_experts, padded_starts[sorted_bucket] + rank_in_run, max_length)
    sorted_token_ids = torch.full((max_length + 1,), num_valid, dtype=torch.int32, device=device)
    sorted_token_ids[destination] = order.to(torch.int32)
    sorted_token_ids = sorted_token_ids[:max_length]
    block_starts = torch.arange(0, max_length, block_m, device=device)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, padded_ends[-1:].to(torch.int32)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
                  sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor,
                  top_k: int, mul_routed_weight: bool, block_m: int, bias: torch.Tensor | None = None) -> None:
    num_valid = topk_weights.numel()
    n, k = b.shape[1], b.shape[2]
    # CPU means the interpreter, which gets low-precision dots wrong; fp32 weights need fp32
    # dots on a GPU too (the default would be TF32).
    dot_fp32 = a.device.type != "cuda" or b.dtype == torch.float32
    block_n = 64
    block_k = 32 if k >= 32 else 16
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    _fused_moe_kernel[grid](
        a, b, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        c if bias is None else bias,  # a pointer never read without HAS_BIAS
        n, k, num_valid,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        0 if bias is None else bias.stride(0),
        TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_routed_weight, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32", HAS_BIAS=bias is not None, num_warps=4,
    )


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None, *,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: str = "silu", swiglu_limit: float | None = None,
                  swiglu_alpha: float = torch_moe.SWIGLUOAI_ALPHA) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] of x's dtype, topk_weights [T, k], topk_ids
    [T, k] -> [T, H] in x's dtype: `torch_moe.fused_experts`'s result (biases [E, 2I] and
    [E, H] and the activation as there)."""
    if activation not in torch_moe.ACTIVATIONS:
        raise ValueError(f"MoE activation must be one of {torch_moe.ACTIVATIONS}, got {activation!r}.")
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    intermediate = w2.shape[2]
    assert w13.shape[1:] == (2 * intermediate, hidden) and w2.shape[:2] == (w13.shape[0], hidden)
    if num_tokens == 0:
        return torch.empty_like(x)
    # Few assignments (decode) keep blocks small, so padding wastes little.
    block_m = 16 if num_tokens * top_k <= 64 * w13.shape[0] else 64
    sorted_token_ids, expert_ids, num_tokens_post_padded = moe_align_block_size(topk_ids, block_m, w13.shape[0],
                                                                                 expert_map)
    weights = topk_weights.float().contiguous()
    gate_up = torch.empty(num_tokens * top_k, 2 * intermediate, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, False,
                  block_m, w13_bias)
    if activation == "silu":
        hidden_states = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    else:
        hidden_states = torch_moe.swigluoai_and_mul(gate_up, swiglu_limit, swiglu_alpha)
    # fp32, zeroed: rows of assignments to other ranks' experts stay zero in the sum.
    contributions = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _grouped_gemm(hidden_states, w2, contributions, weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                  1, True, block_m, w2_bias)
    return contributions.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
