"""Triton paged decode attention: one query token per sequence over its cached context.

Same semantics as `raylm.kernels.torch_attention.paged_attention` for a decode-only step
(every query_len is 1). One program handles one (sequence, KV head) pair and all the query
heads that share that KV head (GQA), so each K/V tile is read from memory once for the whole
group. The group is padded to 16 rows because `tl.dot` operands must be at least 16 wide to
compile on a GPU.

Long contexts with few sequences leave most of a GPU idle at one program per (sequence, KV
head); the split-K (flash-decoding) variant also splits the context into partitions, each
program writes a partial output and its log-sum-exp, and a second kernel merges them.
`paged_decode_attention` picks the variant.

A sliding-window layer's program reads its sequence's last SLIDING_WINDOW positions only
(the partitions split that span): keys before it are never loaded, so the cost is bounded by
the window whatever the context. SOFT_CAP (Gemma 2) caps the scores. Both are compile-time
constants (0: off), so a layer without them runs the same code as before. HAS_SINKS (gpt-oss's
attention sinks, `sinks_ptr` [Hq] fp32): each head's sink is one more term of its softmax's
denominator, added once: by the single-pass kernel when it normalises, or under split-K by
the merge, over every partition's mass (the partitions themselves leave it out).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.kv_cache_dtype import is_fp8
from raylm.kernels.triton_paged_kv import paged_kv_tile_scores

# Split-K partitions are multiples of this many tokens (a multiple of every K/V tile width,
# so no tile straddles two partitions) ...
PARTITION_ALIGN = 64
# ... and at least this many: below it the merge costs more than the parallelism gains.
_MIN_PARTITION = 512
_MAX_SPLITS = 64


# The tiles of one pipeline stage, K and V together, hold about this many bytes: BLOCK_N
# follows from the head size and the cache's element size (bf16 d128: 32 keys).
DECODE_STAGE_BYTES = 16384
# Triton's software pipeliner splits num_stages - 2 between the block-table load and the K/V
# loads it feeds (an indirect load). At 3 or 4 stages the K/V tiles got one shared-memory
# buffer and each tile's copy was waited for right after it was issued (compiled for sm_90a:
# no overlap at all); at 5 they get two, and tile i+1 is copied (cp.async, 16-byte vectors)
# while tile i is computed.
DECODE_WARPS, DECODE_STAGES = 4, 5
def decode_tiles(dtype: torch.dtype, group: int, head_size: int, on_gpu: bool = True) -> dict:
    """The decode kernel's tile shape, warps and pipeline stages for a cache dtype, GQA group
    and head size.

    Decode reads each key and value once: the kernel is bound by memory bandwidth, which
    takes enough bytes in flight per SM, from several programs at once. Compiled for sm_90a
    with the launch's alignment (cluster/benchmarks/gpu_kernel_check.py), bf16 d128 at
    BLOCK_N 32, 4 warps, 5 stages: 103 registers with Triton 3.6's ptxas (94 with 3.9's),
    37 KiB of shared memory, no stack, each program with its next tile (16 KiB) in flight
    while it computes one (BLOCK_N 64, 8 warps and 3 stages: nothing in flight while they
    compute). Every dtype and head size compiles without a stack. No register cap: capped
    at 96, five programs fit an SM instead of four, but on an H100 that read no faster (batch
    256 x 640 tokens: 239 us capped, 232 us uncapped, 0.94-0.96 of copy bandwidth; equal at
    64 x 1k and 64 x 8k; the 0acff4d and 1e91401 records). `speed["decode_attention_sweep"]`
    times the alternatives. Off the GPU (the interpreter) the shape only has to be valid."""
    block_d = max(16, triton.next_power_of_2(head_size))
    element_size = 4 if dtype == torch.float32 else 2
    block_n = max(16, min(PARTITION_ALIGN, DECODE_STAGE_BYTES // (2 * block_d * element_size)))
    tiles = dict(BLOCK_N=block_n, num_warps=DECODE_WARPS, num_stages=DECODE_STAGES)
    return complete_decode_tiles(dtype, group, head_size, tiles, on_gpu)


def complete_decode_tiles(dtype: torch.dtype, group: int, head_size: int, tiles: dict, on_gpu: bool = True) -> dict:
    """The kernel's launch options from a choice of BLOCK_N, num_warps, num_stages and
    optionally maxnreg, Triton's cap on registers per thread (decode_tiles' or a
    benchmark's): the padded group, BLOCK_D and the dot's precision follow."""
    block_n = tiles["BLOCK_N"]
    # A power of two that divides PARTITION_ALIGN: no tile straddles two split-K partitions.
    assert 16 <= block_n <= PARTITION_ALIGN and block_n & (block_n - 1) == 0, tiles
    # The interpreter gets low-precision dots wrong, and fp32 caches need fp32 dots on a GPU
    # too (Triton's default for them is TF32).
    dot_fp32 = not on_gpu or dtype == torch.float32
    return dict(BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(head_size)),
                BLOCK_N=block_n, DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32",
                num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
                **({"maxnreg": tiles["maxnreg"]} if tiles.get("maxnreg") else {}))


# The block table's row stride (its width, the longest context of the step in blocks) and the
# partial results' strides (which follow the split count) change from step to step: left
# specialised, each new value divisible or not by 16 would compile the kernel again.
@triton.jit(do_not_specialize=["stride_bt", "stride_pl_seq", "stride_pl_head"])
def _paged_decode_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, sinks_ptr,
    qk_scale,  # softmax scale * log2(e) (* k_scale for an fp8 cache): the kernel works in base 2
    v_scale,  # an fp8 cache's value scale
    stride_qt, stride_qh,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    stride_bt, stride_ot, stride_oh,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    partition_size,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0, SOFT_CAP: tl.constexpr = 0.0, KV_FP8: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - row
    # The partitions split the positions the query reads: its window, or the whole context.
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    else:
        kv_start = seq_len * 0
    start = kv_start + split * partition_size
    end = tl.minimum(seq_len, start + partition_size)
    if (start >= end) | (query_len == 0):
        # Shorter than this split (the merge never reads this partition), or no query row.
        return

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < NUM_QUERIES_PER_KV
    d_mask = d < HEAD_SIZE
    heads = kv_head * NUM_QUERIES_PER_KV + g
    q = tl.load(query_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Every tile masks its positions against `end` (only the last can hold any past it). The
    # masked loads compile to the same 16-byte cp.async copies (zero-filled past the mask);
    # whole tiles without the mask saved registers (sm_90a, bf16 d128: 94 -> 72) that do not
    # bound how many programs share an SM (shared memory does), and the last tile in a loop
    # of its own would not be prefetched behind the others.
    for tile_start in range(start, end, BLOCK_N):
        pos, n_mask, s, v = paged_kv_tile_scores(  # s: [BLOCK_G, BLOCK_N]
            q, qk_scale, block_table, k_cache_ptr, v_cache_ptr, tile_start, end, kv_head, d, d_mask,
            stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block, stride_vc_token, stride_vc_head,
            BLOCK_SIZE, BLOCK_N, DOT_FP32, DOT_PRECISION, SOFT_CAP, KV_FP8=KV_FP8)
        s = tl.where(n_mask[None, :], s, -float("inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS and not SPLIT_K:
        # The sink's term, against the same maximum (base 2, as the scores).
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = l_i + tl.exp2(sink - m_i)
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * v_scale
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT_K:
        po = (partial_out_ptr + seq.to(tl.int64) * stride_po_seq + heads[:, None] * stride_po_head
              + split * stride_po_split + d[None, :])
        tl.store(po, out, mask=out_mask)
        tl.store(partial_lse_ptr + seq.to(tl.int64) * stride_pl_seq + heads * stride_pl_head + split,
                 m_i + tl.log2(l_i), mask=g_mask)
    else:
        o = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["stride_pl_seq", "stride_pl_head"])
def _merge_partitions_kernel(
    partial_out_ptr, partial_lse_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr, sinks_ptr,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_ot, stride_oh,
    partition_size,
    HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SLIDING_WINDOW: tl.constexpr = 0,
    HAS_SINKS: tl.constexpr = False,
):
    # One program per (sequence, query head): rescale each partition's normalised output by
    # its share of the total softmax mass, 2^(lse_s - lse_total).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    if tl.load(query_start_loc_ptr + seq + 1) == row:
        return
    if SLIDING_WINDOW > 0:
        num_partitions = tl.cdiv(tl.minimum(seq_len, SLIDING_WINDOW), partition_size)
    else:
        num_partitions = tl.cdiv(seq_len, partition_size)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_partitions
    lse = tl.load(partial_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + s, mask=s_mask,
                  other=-float("inf"))
    if HAS_SINKS:
        # The sink's mass joins the total once, beside every partition's.
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        shift = tl.maximum(tl.max(lse, axis=0), sink)
        weight = tl.exp2(lse - shift)
        weight = weight / (tl.sum(weight, axis=0) + tl.exp2(sink - shift))
    else:
        weight = tl.exp2(lse - tl.max(lse, axis=0))
        weight = weight / tl.sum(weight, axis=0)
    partial = tl.load(partial_out_ptr + seq * stride_po_seq + head * stride_po_head + s[:, None] * stride_po_split
                      + d[None, :], mask=s_mask[:, None] & (d[None, :] < HEAD_SIZE), other=0.0)
    out = tl.sum(partial * weight[:, None], axis=0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_SIZE)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many context partitions per (sequence, KV head): enough programs to fill the GPU
    about twice over, but no partition shorter than _MIN_PARTITION tokens."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    by_occupancy = -(-2 * num_sms // programs)
    by_length = max(1, max_seq_len // _MIN_PARTITION)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def partition(max_seq_len: int, num_splits: int) -> tuple[int, int]:
    """(partition size, split count) for about num_splits partitions of max_seq_len tokens:
    partitions are PARTITION_ALIGN multiples, so the count can come out lower."""
    partition_size = triton.cdiv(triton.cdiv(max_seq_len, num_splits), PARTITION_ALIGN) * PARTITION_ALIGN
    return partition_size, triton.cdiv(max_seq_len, partition_size)


def merge_block_s(num_splits: int) -> int:
    """The merge kernel's BLOCK_S (a compiled variant each) for a split count."""
    return max(2, triton.next_power_of_2(num_splits))


def possible_split_counts(max_model_len: int) -> list[int]:
    """Every split count the dispatcher can choose for contexts up to max_model_len (beyond 1)."""
    by_length = max(1, max_model_len // _MIN_PARTITION)
    return list(range(2, min(by_length, _MAX_SPLITS) + 1))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter has no SMs; this only keeps the heuristic meaningful on CPU.
    return 16


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           attn_metadata: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                           num_splits: int | None = None, *, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None, tiles: dict | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode step (every query_len is 1): query [T, Hq, D] -> [T, Hq, D] in the query's dtype.

    Sequence i's query is row query_start_loc[i]; rows past the last sequence (padding) are
    zero. `out`, if given, is written in place and returned. `num_splits` None lets the
    dispatcher choose between the single-pass kernel (1) and split-K (more than 1).
    `sliding_window` and `logits_soft_cap` as in the reference (torch_attention). `tiles`
    (BLOCK_N, num_warps, num_stages) overrides decode_tiles' choice: for benchmarks that
    compare tile shapes. k_scale, v_scale: an fp8 cache's scales (`kv_cache_dtype`). sinks
    [Hq]: attention sinks, as in the reference.
    """
    md = attn_metadata
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = md.num_seqs
    assert md.max_query_len <= 1, "paged_decode_attention takes decode-only steps"
    assert num_heads % num_kv_heads == 0 and query.stride(2) == 1 and k_cache.stride(3) == 1
    if out is None:
        out = torch.empty_like(query)
    if num_tokens > num_seqs:
        out[num_seqs:].zero_()
    if num_seqs == 0 or md.max_seq_len == 0:
        return out
    # The most keys one query reads.
    max_keys = md.max_seq_len if sliding_window is None else min(md.max_seq_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_keys, _num_sms(query.device))
    partition_size, num_splits = partition(max_keys, num_splits)

    group = num_heads // num_kv_heads
    on_gpu = query.device.type == "cuda"
    kv_fp8 = is_fp8(k_cache.dtype)
    # An fp8 cache's tiles are upcast to the query's dtype: tiles and dots as for that dtype.
    tile_dtype = query.dtype if kv_fp8 else k_cache.dtype
    tiles = (decode_tiles(tile_dtype, group, head_size, on_gpu) if tiles is None
             else complete_decode_tiles(tile_dtype, group, head_size, tiles, on_gpu))
    common = dict(NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
                  SLIDING_WINDOW=sliding_window or 0, SOFT_CAP=float(logits_soft_cap or 0.0), KV_FP8=kv_fp8,
                  HAS_SINKS=sinks is not None, **tiles)
    sinks_arg = out if sinks is None else sinks.detach().float().contiguous()  # a pointer never read without sinks
    qk_scale = scale * math.log2(math.e) * (k_scale if kv_fp8 else 1.0)
    v_scale = float(v_scale) if kv_fp8 else 1.0
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    grid = (num_seqs, num_kv_heads, num_splits)
    if num_splits == 1:
        _paged_decode_kernel[grid](
            query, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
            out, out, out, sinks_arg, qk_scale, v_scale,
            query.stride(0), query.stride(1), *cache_strides,
            md.block_tables.stride(0), out.stride(0), out.stride(1),
            0, 0, 0, 0, 0, partition_size, SPLIT_K=False, **common)
        return out

    partial_out = torch.empty(num_seqs, num_heads, num_splits, head_size, dtype=torch.float32,
                              device=query.device)
    partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _paged_decode_kernel[grid](
        query, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
        out, partial_out, partial_lse, sinks_arg, qk_scale, v_scale,
        query.stride(0), query.stride(1), *cache_strides,
        md.block_tables.stride(0), out.stride(0), out.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), partition_size, SPLIT_K=True, **common)
    _merge_partitions_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, md.seq_lens, md.query_start_loc, out, sinks_arg,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1), partition_size,
        HEAD_SIZE=head_size, BLOCK_D=max(16, triton.next_power_of_2(head_size)),
        BLOCK_S=merge_block_s(num_splits), SLIDING_WINDOW=sliding_window or 0, HAS_SINKS=sinks is not None,
        num_warps=4)
    return out
