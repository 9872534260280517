"""Batched LoRA on CUDA in Triton, gather style (punica's BGMV): each token reads the A and
B of its own adapter slot only.

Layout as in `lora_ops`: `lora_a` [in, n * S * R] (A transposed; columns by slice, slot,
rank), `lora_b[i]` [S * R, out_i] (B transposed), token_slots [T] (-1: the base model, left
untouched).

shrink: one program per (token, slice) computes the token's R values x A_slot^T, in fp32,
into a [T, n * R] buffer; expand: one program per (token, block of outputs) per slice adds
h B_slot^T into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, in_features, rank, num_slots, stride_x, stride_a, stride_h,
                        BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0)
    piece = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        a_columns = a_ptr + (piece * num_slots + slot) * rank + r
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * stride_x + k, mask=k < in_features, other=0.0).to(tl.float32)
            a = tl.load(a_columns[:, None] + k[None, :] * stride_a,
                        mask=(r[:, None] < rank) & (k[None, :] < in_features), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + token * stride_h + piece * rank + r, acc, mask=r < rank)


@triton.jit
def _lora_expand_kernel(h_ptr, b_ptr, slots_ptr, out_ptr, out_features, rank, h_column, out_column, stride_h,
                        stride_b, stride_out, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0)
    block = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + token * stride_h + h_column + r, mask=r < rank, other=0.0)
        b = tl.load(b_ptr + (slot * rank + r[None, :]) * stride_b + n[:, None],
                    mask=(n[:, None] < out_features) & (r[None, :] < rank), other=0.0).to(tl.float32)
        delta = tl.sum(b * h[None, :], axis=1)
        out = out_ptr + token * stride_out + out_column + n
        previous = tl.load(out, mask=n < out_features, other=0.0)
        tl.store(out, (previous.to(tl.float32) + delta).to(previous.dtype), mask=n < out_features)


def lora_shrink_expand(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: list[torch.Tensor],
                       output_offsets: list[int], token_slots: torch.Tensor, num_slots: int, rank: int) -> None:
    """out[:, offset_i : offset_i + out_i] += (x A_slot,i^T) B_slot,i^T for each token with a
    slot, in place (see `lora_ops.add_lora`)."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert out.stride(-1) == 1 and lora_a.stride(-1) == 1, "rows must be contiguous"
    num_pieces = len(lora_b)
    shrunk = torch.empty(num_tokens, num_pieces * rank, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    in_features = x.shape[1]
    _lora_shrink_kernel[(num_tokens, num_pieces)](
        x, lora_a, token_slots, shrunk, in_features, rank, num_slots, x.stride(0), lora_a.stride(0), shrunk.stride(0),
        BLOCK_K=min(128, triton.next_power_of_2(in_features)), BLOCK_R=block_r)
    for index, (b, offset) in enumerate(zip(lora_b, output_offsets)):
        assert b.stride(-1) == 1
        out_features = b.shape[1]
        block_n = min(64, triton.next_power_of_2(out_features))
        _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
            shrunk, b, token_slots, out, out_features, rank, index * rank, offset, shrunk.stride(0), b.stride(0),
            out.stride(0), BLOCK_N=block_n, BLOCK_R=block_r)
