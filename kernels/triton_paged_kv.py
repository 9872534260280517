"""In-kernel pieces the Triton paged attention kernels share (decode and prefill/extend):
one K/V tile read through a sequence's block table, its scores against the program's
queries, and Gemma 2's soft cap. `@triton.jit` functions called from a kernel are inlined
into it at compile time, so each kernel compiles to what it did with the code written out."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap_scores(s, cap):
    """cap * tanh(s / cap) for scores s in the kernels' log2 units and cap in the same units,
    through exp2 (e = exp(-2|s| / cap) <= 1: nothing overflows)."""
    e = tl.exp2(tl.abs(s) * (-2.0 * 1.4426950408889634 / cap))
    magnitude = cap * (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -magnitude, magnitude)


@triton.jit
def paged_kv_tile_scores(
    q, qk_scale, block_table, k_cache_ptr, v_cache_ptr, tile_start, end, kv_head, d, d_mask,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr,
    MASK_N: tl.constexpr = True, MASK_D: tl.constexpr = True,
):
    """The BLOCK_N positions from tile_start (pos, and n_mask: those before `end`), their V
    tile, and the scores of the queries q [rows, BLOCK_D] against their keys, scaled by
    qk_scale (log2 units) and soft-capped where SOFT_CAP > 0: [rows, BLOCK_N]. Positions at
    or past `end` read nothing; their scores are for the caller to mask.

    A caller that knows the whole tile lies before `end` passes MASK_N=False, and one whose
    head size fills BLOCK_D passes MASK_D=False: those loads carry no mask at all (n_mask
    is then all true), which keeps them 16-byte vectors the compiler can pipeline."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    n_mask = pos < end
    offset = pos % BLOCK_SIZE
    if MASK_N:
        physical = tl.load(block_table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        physical = tl.load(block_table + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]  # broadcast over the rows by the loads
    # One int64 offset per key row (the slot's place in the cache), the head's columns added
    # last: the cache can pass 2^31 elements, a row's columns never do.
    k_rows = physical * stride_kc_block + offset * stride_kc_token + kv_head * stride_kc_head
    v_rows = physical * stride_vc_block + offset * stride_vc_token + kv_head * stride_vc_head
    if MASK_N or MASK_D:
        # Masked loads keep never-written slots (garbage, NaN) out of the arithmetic.
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :])
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :])
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFT_CAP > 0:
        s = soft_cap_scores(s, SOFT_CAP * 1.4426950408889634)
    return pos, n_mask, s, v
