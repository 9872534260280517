"""Triton paged prefill / extend attention: a chunk of new queries per sequence, causal,
over the tokens already in the cache plus the new ones (written there first).

Same semantics as `raylm.kernels.torch_attention.paged_attention` for any step, prefill,
chunked prefill, prefix-cache hits and decode rows mixed in one batch: sequence i's queries,
rows query_start_loc[i]:query_start_loc[i+1], sit at the last query_len_i of its seq_lens[i]
positions and read every key and value through block_tables[i].

One program handles one (sequence, block of queries, KV head). Its BLOCK_M rows are
(query token, query head of the group) pairs, so the query heads that share a KV head share
every K/V tile load, and a decode row with GQA still fills a 16-row dot.

In a sliding-window layer (SLIDING_WINDOW > 0) a program's keys start at its first query's
window, so positions before it are never loaded, and each row masks the keys before its own
window; SOFT_CAP (Gemma 2) caps the scores. Both are compile-time constants, 0 when off.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.triton_paged_kv import paged_kv_tile_scores

def prefill_tiles(dtype: torch.dtype, group: int, head_size: int, max_query_len: int, on_gpu: bool = True) -> dict:
    """The prefill kernel's tile shape and warps for a cache dtype, GQA group, head size and
    the step's longest query chunk.

    Rows (BLOCK_M) are (query, head of the group) pairs: at least 16 for the dot, at most 64
    (32 in fp32, or at head size 256) unless the group alone is larger; few rows when the
    chunks are short (decode rows). Compiled for sm_90a (Triton 3.9's ptxas), more than 16
    elements of a K/V tile per thread spilled: bf16 at BLOCK_N 64, head size 128 and 4 or 8
    warps used 255 registers and 104-528 bytes of stack, fp32 at BLOCK_M 64 and BLOCK_N 64
    ~9 KB; so did 64 rows at head size 256 (96 bytes, GQA 8). Within these budgets every
    variant compiled to 95-245 registers without a stack frame
    (`cluster/benchmarks/gpu_kernel_check.py` reports them)."""
    block_d = max(16, triton.next_power_of_2(head_size))
    num_warps = 4 if block_d <= 64 else 8
    block_n = max(16, min(64, 16 * 32 * num_warps // block_d))
    max_rows = min(32 if dtype == torch.float32 else 64, 8192 // block_d)
    block_m = max(triton.next_power_of_2(group),
                  min(max_rows, max(16, triton.next_power_of_2(max_query_len * group))))
    dot_fp32 = not on_gpu or dtype == torch.float32
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_D=block_d, BLOCK_N=block_n, DOT_FP32=dot_fp32,
                DOT_PRECISION="ieee" if dot_fp32 else "tf32", num_warps=num_warps)


def block_m_variants(dtype: torch.dtype, group: int, head_size: int) -> list[int]:
    """Every BLOCK_M prefill_tiles can choose for this dtype, group and head size (one
    compiled kernel each)."""
    return sorted({prefill_tiles(dtype, group, head_size, n)["BLOCK_M"] for n in (1, 2, 4, 8, 16, 32, 64, 128)})


# The block table's row stride (the step's longest context in blocks) changes from step to
# step: left specialised, each new value divisible or not by 16 would compile again.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_prefill_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    stride_bt, stride_ot, stride_oh,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0, SOFT_CAP: tl.constexpr = 0.0,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    query_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    if q_block * BLOCK_Q >= query_len:
        # The grid is sized for the longest query chunk of the batch.
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_index = q_block * BLOCK_Q + r // NUM_QUERIES_PER_KV  # within this sequence's chunk
    heads = kv_head * NUM_QUERIES_PER_KV + r % NUM_QUERIES_PER_KV
    d_mask = d < HEAD_SIZE
    row_mask = (r < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_index < query_len)
    q = tl.load(query_ptr + (q_start + q_index)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    # Padding rows get positions past the end, so they see every valid key: their softmax
    # stays finite (no -inf - -inf) and is simply not stored.
    q_pos = context_len + q_index

    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Causal: no key after this block's last query; none before its first query's window.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    else:
        kv_start = kv_end * 0
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        pos, n_mask, s, v = paged_kv_tile_scores(  # s: [BLOCK_M, BLOCK_N]
            q, qk_scale, block_table, k_cache_ptr, v_cache_ptr, tile_start, kv_end, kv_head, d, d_mask,
            stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block, stride_vc_token, stride_vc_head,
            BLOCK_SIZE, BLOCK_N, DOT_FP32, DOT_PRECISION, SOFT_CAP)
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if SLIDING_WINDOW > 0:
            # A row that has seen no key yet keeps a -inf maximum: exponentials against 0
            # instead of -inf - -inf, all of them 0. (Only padding rows: a block's BLOCK_Q <=
            # BLOCK_N queries all find a key of their window in its first tile.)
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        else:
            # Key 0 is in the first tile and visible to every row: m_new is finite.
            shift = m_new
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SLIDING_WINDOW > 0:
        # Padding rows (positions past the end) have seen no key at all: keep them out of 0 / 0.
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + q_index)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            attn_metadata: AttentionMetadata, scale: float,
                            out: torch.Tensor | None = None, *, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its context in the cache (the last
    `sliding_window` positions of it per query, when set; `logits_soft_cap` as in the
    reference, torch_attention).

    query [T, Hq, D] -> [T, Hq, D] in the query's dtype; rows past the last sequence
    (padding) are zero. `out`, if given, is written in place and returned.
    """
    md = attn_metadata
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and query.stride(2) == 1 and k_cache.stride(3) == 1
    if out is None:
        out = torch.empty_like(query)
    num_packed = sum(md.query_lens_list)
    if num_tokens > num_packed:
        out[num_packed:].zero_()
    if md.num_seqs == 0 or md.max_query_len == 0:
        return out

    group = num_heads // num_kv_heads
    tiles = prefill_tiles(k_cache.dtype, group, head_size, md.max_query_len, query.device.type == "cuda")
    grid = (md.num_seqs, triton.cdiv(md.max_query_len, tiles["BLOCK_Q"]), num_kv_heads)
    _paged_prefill_kernel[grid](
        query, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, out,
        scale * math.log2(math.e),
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        md.block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, BLOCK_SIZE=block_size, **tiles,
        SLIDING_WINDOW=sliding_window or 0, SOFT_CAP=float(logits_soft_cap or 0.0),
    )
    return out
