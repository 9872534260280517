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
from raylm.kernels.kv_cache_dtype import is_fp8
from raylm.kernels.triton_paged_kv import paged_kv_tile_scores

# Tiles of a 16-bit cache when the step's chunks are long (BLOCK_M at least 128 rows would
# be wanted), by BLOCK_D: (BLOCK_M, BLOCK_N, num_warps, num_stages). Large tiles feed
# Hopper's warpgroup MMA (wgmma) and reuse each K/V tile for 128 rows; the chunk's causal
# diagonal costs a program (BLOCK_Q + BLOCK_N - 1) / BLOCK_N masked tiles at most. For sm_90a:
# cluster/benchmarks/gpu_kernel_check.py reports their registers, and gpu_speed_check.py
# times them against alternatives (`speed["prefill_attention"]`).
LONG_CHUNK_TILES = {16: (128, 128, 8, 3), 32: (128, 128, 8, 3), 64: (128, 128, 8, 3), 128: (128, 64, 8, 3),
                    256: (64, 32, 8, 2)}


def prefill_tiles(dtype: torch.dtype, group: int, head_size: int, max_query_len: int, on_gpu: bool = True) -> dict:
    """The prefill kernel's tile shape, warps and pipeline stages for a cache dtype, GQA
    group, head size and the step's longest query chunk.

    Rows (BLOCK_M) are (query, head of the group) pairs: at least 16 for the dot; few rows
    when the chunks are short (decode rows); at most 64 (32 in fp32, or at head size 256)
    unless the chunks are long and the cache 16-bit, where LONG_CHUNK_TILES apply, or the
    group alone is larger. fp32 keeps small tiles: its K/V tiles are twice the bytes and
    its dots run at a fraction of the tensor-core rate anyway."""
    block_d = max(16, triton.next_power_of_2(head_size))
    wanted_rows = max(16, triton.next_power_of_2(max_query_len * group))
    if dtype != torch.float32 and wanted_rows >= 128:
        block_m, block_n, num_warps, num_stages = LONG_CHUNK_TILES[block_d]
        block_m = max(block_m, triton.next_power_of_2(group))
    else:
        num_warps = 4 if block_d <= 64 else 8
        block_n = max(16, min(64, 16 * 32 * num_warps // block_d))
        max_rows = min(32 if dtype == torch.float32 else 64, 8192 // block_d)
        block_m = max(triton.next_power_of_2(group), min(max_rows, wanted_rows))
        num_stages = 3
        if dtype == torch.float32:
            # fp32 dots run on the CUDA cores from registers: 32 keys spilled 16-200 bytes
            # (sm_90a, head sizes 64 and 128); 16 keys and two stages leave no stack at all.
            block_n, num_stages = 16, 2
    return complete_tiles(dtype, group, head_size, dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
                                                        num_stages=num_stages), on_gpu)


def complete_tiles(dtype: torch.dtype, group: int, head_size: int, tiles: dict, on_gpu: bool = True) -> dict:
    """The kernel's launch options from a choice of BLOCK_M, BLOCK_N, num_warps and
    num_stages (prefill_tiles' or a benchmark's): queries per program, BLOCK_D and the dot's
    precision follow."""
    block_m, block_n = tiles["BLOCK_M"], tiles["BLOCK_N"]
    assert block_m >= 16 and block_n >= 16 and block_m >= group, tiles
    dot_fp32 = not on_gpu or dtype == torch.float32
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_D=max(16, triton.next_power_of_2(head_size)),
                BLOCK_N=block_n, DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32",
                num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])


def block_m_variants(dtype: torch.dtype, group: int, head_size: int) -> list[int]:
    """Every BLOCK_M prefill_tiles can choose for this dtype, group and head size (one
    compiled kernel each: the rest of a tile choice follows from its BLOCK_M)."""
    return sorted(variant_query_lens(dtype, group, head_size))


def variant_query_lens(dtype: torch.dtype, group: int, head_size: int) -> dict[int, int]:
    """For each BLOCK_M prefill_tiles can choose, the shortest longest-chunk that gets it:
    what a warm-up launches to compile that variant. (BLOCK_M // group queries need not:
    at head size 256 a 64-row tile comes only with chunks of 128 rows or more.)"""
    query_lens: dict[int, int] = {}
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        query_lens.setdefault(prefill_tiles(dtype, group, head_size, n)["BLOCK_M"], n)
    return query_lens


@triton.jit
def _attend_tiles(
    q, q_pos, m_i, l_i, acc, tile_begin, tile_end, kv_end, qk_scale, block_table, k_cache_ptr, v_cache_ptr, kv_head,
    d, d_mask,
    stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block, stride_vc_token, stride_vc_head,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, CAUSAL: tl.constexpr, MASK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """The online softmax over the key tiles from tile_begin to tile_end (m_i, l_i, acc
    carried in and returned). CAUSAL=False: every key of every tile is before kv_end and
    visible to every row (but for a sliding window's lower edge), so the loads and the
    scores carry no mask."""
    for tile_start in range(tile_begin, tile_end, BLOCK_N):
        pos, n_mask, s, v = paged_kv_tile_scores(  # s: [BLOCK_M, BLOCK_N]
            q, qk_scale, block_table, k_cache_ptr, v_cache_ptr, tile_start, kv_end, kv_head, d, d_mask,
            stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block, stride_vc_token, stride_vc_head,
            BLOCK_SIZE, BLOCK_N, DOT_FP32, DOT_PRECISION, SOFT_CAP, MASK_N=CAUSAL, MASK_D=MASK_D, KV_FP8=KV_FP8)
        if CAUSAL:
            visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            if SLIDING_WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
            s = tl.where(visible, s, -float("inf"))
        elif SLIDING_WINDOW > 0:
            s = tl.where(pos[None, :] > q_pos[:, None] - SLIDING_WINDOW, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if SLIDING_WINDOW > 0:
            # A row that has seen no key yet keeps a -inf maximum: exponentials against 0
            # instead of -inf - -inf, all of them 0 (padding rows; and rows whose window
            # starts past this tile).
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        else:
            # Key 0 (or, past the unmasked tiles, an earlier key) is visible to every row:
            # m_new is finite.
            shift = m_new
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# The block table's row stride (the step's longest context in blocks) changes from step to
# step: left specialised, each new value divisible or not by 16 would compile again.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_prefill_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr, sinks_ptr,
    qk_scale,  # softmax scale * log2(e) (* k_scale for an fp8 cache): the kernel works in base 2
    v_scale,  # an fp8 cache's value scale
    num_kv_heads,
    stride_qt, stride_qh,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    stride_bt, stride_ot, stride_oh,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0, SOFT_CAP: tl.constexpr = 0.0, KV_FP8: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    # Axis 0 runs over (query block, KV head) with the heads fastest and the last query
    # blocks, whose causal rows read the most keys, first: the GPU starts the longest
    # programs first and ends on short ones. Axis 1: the sequence.
    kv_head = tl.program_id(0) % num_kv_heads
    q_block = tl.num_programs(0) // num_kv_heads - 1 - tl.program_id(0) // num_kv_heads
    seq = tl.program_id(1)

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
    first_q_pos = context_len + q_block * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_q_pos + BLOCK_Q)
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(first_q_pos - SLIDING_WINDOW + 1, 0)
    else:
        kv_start = kv_end * 0
    # Keys up to the first query's own are visible to every row (padding rows sit past the
    # end): whole tiles of them need no causal or bounds mask (a prefix-cache hit's context
    # is all of this kind). The tiles from there to kv_end, the diagonal, are masked.
    unmasked_end = kv_start + (first_q_pos + 1 - kv_start) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend_tiles(
        q, q_pos, m_i, l_i, acc, kv_start, unmasked_end, kv_end, qk_scale, block_table, k_cache_ptr, v_cache_ptr,
        kv_head, d, d_mask, stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block, stride_vc_token,
        stride_vc_head, BLOCK_SIZE, BLOCK_N, DOT_FP32, DOT_PRECISION, SLIDING_WINDOW, SOFT_CAP,
        CAUSAL=False, MASK_D=HEAD_SIZE != BLOCK_D, KV_FP8=KV_FP8)
    m_i, l_i, acc = _attend_tiles(
        q, q_pos, m_i, l_i, acc, unmasked_end, kv_end, kv_end, qk_scale, block_table, k_cache_ptr, v_cache_ptr,
        kv_head, d, d_mask, stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block, stride_vc_token,
        stride_vc_head, BLOCK_SIZE, BLOCK_N, DOT_FP32, DOT_PRECISION, SLIDING_WINDOW, SOFT_CAP,
        CAUSAL=True, MASK_D=True, KV_FP8=KV_FP8)

    if HAS_SINKS:
        # gpt-oss's sink: one more term of each row's denominator, against the same maximum
        # (base 2). A row that saw no key (padding) gets inf, and 0 / inf is not stored.
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = l_i + tl.exp2(sink - m_i)
    if SLIDING_WINDOW > 0:
        # Padding rows (positions past the end) have seen no key at all: keep them out of 0 / 0.
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * v_scale
    tl.store(out_ptr + (q_start + q_index)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            attn_metadata: AttentionMetadata, scale: float,
                            out: torch.Tensor | None = None, *, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None, tiles: dict | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its context in the cache (the last
    `sliding_window` positions of it per query, when set; `logits_soft_cap` and `sinks` [Hq]
    as in the reference, torch_attention; k_scale, v_scale: an fp8 cache's). `tiles` (BLOCK_M, BLOCK_N,
    num_warps, num_stages) overrides prefill_tiles' choice: for benchmarks that compare tile shapes.

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
    on_gpu = query.device.type == "cuda"
    kv_fp8 = is_fp8(k_cache.dtype)
    # An fp8 cache's tiles are upcast to the query's dtype: tiles and dots as for that dtype.
    tile_dtype = query.dtype if kv_fp8 else k_cache.dtype
    tiles = (prefill_tiles(tile_dtype, group, head_size, md.max_query_len, on_gpu) if tiles is None
             else complete_tiles(tile_dtype, group, head_size, tiles, on_gpu))
    grid = (triton.cdiv(md.max_query_len, tiles["BLOCK_Q"]) * num_kv_heads, md.num_seqs)
    _paged_prefill_kernel[grid](
        query, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, out,
        out if sinks is None else sinks.detach().float().contiguous(),  # never read without sinks
        scale * math.log2(math.e) * (k_scale if kv_fp8 else 1.0), float(v_scale) if kv_fp8 else 1.0, num_kv_heads,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        md.block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, BLOCK_SIZE=block_size, **tiles,
        SLIDING_WINDOW=sliding_window or 0, SOFT_CAP=float(logits_soft_cap or 0.0), KV_FP8=kv_fp8,
        HAS_SINKS=sinks is not None,
    )
    return out
