"""PyTorch reference paged attention: the CPU path, and the oracle the Triton kernels match.

Cache layout (one pair per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads,
head_size]; token t of a sequence lives at flat slot
block_table[t // block_size] * block_size + t % block_size.

Two per-layer options every backend implements the same way:
- `sliding_window` w: the query at position p attends to keys p - w + 1 .. p (w keys, itself
  included), as Hugging Face's sliding-window masks do; None attends to all p + 1. Blocks
  that hold only keys before a query's window are never read: the engine may have freed
  them, leaving a placeholder id in the block table (`KVCacheManager`). Within the first
  block of a window, the keys before it are masked.
- `logits_soft_cap` c (Gemma 2): the scaled scores s become c * tanh(s / c) before the mask
  and the softmax.
- `sinks` [Hq] (gpt-oss's learned attention sinks, vLLM's `sinks`): one more logit per query
  head in the softmax's denominator, with no value: p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)).
  The weights of a row then sum to less than 1.

An fp8 cache (`raylm.kernels.kv_cache_dtype`) stores key / k_scale and value / v_scale,
saturated and rounded to its format (`quantize`), and is read back times the scale in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.kv_cache_dtype import dequantize, is_fp8, quantize


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Stores this step's keys and values [T, Hkv, D] at their flat slots; slot -1 (padding
    tokens) is skipped. An fp8 cache stores them quantized with k_scale and v_scale."""
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_size)
    v_flat = v_cache.view(-1, num_kv_heads, head_size)
    # Padding is rare (the runner pads only for fixed-size batches); checking for it on the
    # host costs one small reduction, filtering costs three indexing ops per call. A device
    # cache would sync here, but device caches use the Triton kernel.
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    _bytes(k_flat).index_copy_(0, slot_mapping, _bytes(quantize(key, k_cache.dtype, k_scale)))
    _bytes(v_flat).index_copy_(0, slot_mapping, _bytes(quantize(value, v_cache.dtype, v_scale)))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """x, or for an fp8 tensor its bytes (PyTorch's CPU indexing ops take no fp8 dtype)."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


def _gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, index), fp8 caches included."""
    return _bytes(cache).index_select(0, index).view(cache.dtype)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its context in the cache (the last
    `sliding_window` positions of it for each query, when set; see the module docstring).
    k_scale, v_scale: an fp8 cache's scales.

    Called after `write_kv_cache` for the step. Sequence i's queries, rows
    query_start_loc[i]:query_start_loc[i+1] of `query` [T, Hq, D], sit at the last
    query_len_i of its seq_lens[i] positions. Query head h reads KV head h // (Hq // Hkv).
    Returns [T, Hq, D] in the query's dtype; rows of padding tokens past the last
    sequence are zero. Softmax runs in fp32.
    """
    md = attn_metadata
    num_tokens = query.shape[0]
    plan = _decode_plan(md, k_cache, sliding_window)
    if md.max_query_len == 1 and plan is not None and plan.rows is None and plan.batch == num_tokens:
        return _batched_decode(query, k_cache, v_cache, plan, scale, logits_soft_cap, k_scale, v_scale, sinks)

    out = paged_prefill_attention(query, k_cache, v_cache, md, scale, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    if plan is not None:
        # Decoding sequences go through one batched call, also in mixed batches.
        rows = plan.rows if plan.rows is not None else slice(0, plan.batch)
        out[rows] = _batched_decode(query[rows], k_cache, v_cache, plan, scale, logits_soft_cap, k_scale, v_scale,
                                    sinks)
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            attn_metadata: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention` for the sequences with more than one query, one sequence at a time;
    the rows of the others (decoding sequences) and of padding tokens are zero."""
    md = attn_metadata
    out = query.new_zeros(query.shape)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(md.query_lens_list, md.seq_lens_list)):
        if query_len > 1:
            out[start:start + query_len] = _prefill_one(query[start:start + query_len], k_cache, v_cache,
                                                        md.block_tables[i], seq_len, scale, logits_soft_cap,
                                                        sliding_window, k_scale, v_scale, sinks)
        start += query_len
    return out


@dataclass
class _DecodePlan:
    """Where the decoding sequences (query_len 1) of a step find their context: the same
    for every layer of a window, so it is built once per step and window."""

    batch: int
    # Query rows of the decoding sequences; None when they are rows 0..batch-1.
    rows: torch.Tensor | None
    # Keys gathered per sequence: the longest context, or window, of the batch.
    max_seq_len: int
    # [batch * Hkv * max_seq_len] rows of the cache viewed as [num_slots * Hkv, D], laid out
    # [sequence, kv head, key] so the gathered keys feed the matmul without a copy. Key j of
    # a sequence is position first + j, first the start of its window (0 without one).
    cache_rows: torch.Tensor
    # [batch, 1, 1, max_seq_len]: keys past each sequence's end.
    beyond_end: torch.Tensor


def _decode_plan(md: AttentionMetadata, k_cache: torch.Tensor, sliding_window: int | None) -> _DecodePlan | None:
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    key = (num_kv_heads, block_size, sliding_window)
    # Cached on the metadata object, which lives exactly one step; not a dataclass field.
    plans = md.__dict__.setdefault("_decode_plans", {})
    if key not in plans:
        plans[key] = _build_decode_plan(md, num_kv_heads, block_size, k_cache.device, sliding_window)
    return plans[key]


def _build_decode_plan(md: AttentionMetadata, num_kv_heads: int, block_size: int, device: torch.device,
                       sliding_window: int | None) -> _DecodePlan | None:
    if md.max_query_len == 1:
        seq_index, rows = None, None
        batch, seq_lens_list = md.num_seqs, md.seq_lens_list
        block_tables, seq_lens = md.block_tables, md.seq_lens
    else:
        decode_seqs, decode_rows = md.decode_seqs_and_rows()
        if not decode_seqs:
            return None
        seq_index = torch.tensor(decode_seqs, device=device)
        rows = torch.tensor(decode_rows, device=device)
        batch, seq_lens_list = len(decode_seqs), [md.seq_lens_list[i] for i in decode_seqs]
        block_tables, seq_lens = md.block_tables[seq_index], md.seq_lens[seq_index]
    seq_lens = seq_lens.long()
    # The one query at position seq_len - 1 reads keys from seq_len - window on.
    max_seq_len = max(seq_lens_list) if sliding_window is None else min(max(seq_lens_list), sliding_window)
    first = (seq_lens - sliding_window).clamp_(min=0) if sliding_window is not None else torch.zeros_like(seq_lens)
    positions = first[:, None] + torch.arange(max_seq_len, device=device)[None, :]
    # Keys past a sequence's end read its last token instead of whatever the padded block
    # table points at: those slots may hold anything (even NaN), and 0 * NaN is NaN even
    # under a -inf mask.
    clamped = torch.minimum(positions, seq_lens[:, None] - 1)
    slots = block_tables.long().gather(1, clamped // block_size) * block_size + clamped % block_size
    heads = torch.arange(num_kv_heads, device=device)
    cache_rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
    beyond_end = (positions >= seq_lens[:, None])[:, None, None, :]
    return _DecodePlan(batch, rows, max_seq_len, cache_rows, beyond_end)


def _batched_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _DecodePlan,
                    scale: float, logits_soft_cap: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per sequence [B, Hq, D]: every sequence's context gathered into a
    padded [B, Hkv, max_seq_len, D] tensor, the tail masked, one batched matmul per side."""
    batch, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    shape = (batch, num_kv_heads, plan.max_seq_len, head_size)
    key = _gather(k_cache.view(-1, head_size), plan.cache_rows).view(shape)
    value = _gather(v_cache.view(-1, head_size), plan.cache_rows).view(shape)
    # Query heads of one KV head are consecutive: fold them into the matmul's row dim.
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_size).float()
    scores = torch.matmul(q, dequantize(key, k_scale).transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, L]
    if logits_soft_cap is not None:
        scores = scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    scores = scores.masked_fill_(plan.beyond_end, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(num_kv_heads, -1, 1))
    out = torch.matmul(probs, dequantize(value, v_scale))  # [B, Hkv, G, D]
    return out.view(batch, num_heads, head_size).to(query.dtype)


def _prefill_one(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_len: int, scale: float, logits_soft_cap: float | None = None,
                 sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's [Lq, Hq, D] queries over its seq_len cached tokens, causal with the
    queries aligned to the end of the context (chunked prefill reads earlier chunks). With a
    window, only the blocks from the first query's window on are read."""
    query_len, num_heads, _ = query.shape
    block_size = k_cache.shape[1]
    first_query = seq_len - query_len
    first_block = 0 if sliding_window is None else max(0, first_query - sliding_window + 1) // block_size
    first_key = first_block * block_size
    blocks = block_table[first_block:-(-seq_len // block_size)].long()
    key = _gather(k_cache, blocks).flatten(0, 1)[:seq_len - first_key]  # [L, Hkv, D]
    value = _gather(v_cache, blocks).flatten(0, 1)[:seq_len - first_key]
    # SDPA's layout is [batch, heads, tokens, D]; fp32 so that the softmax is fp32 too.
    q = query.transpose(0, 1).unsqueeze(0).float()
    k = dequantize(key.transpose(0, 1).unsqueeze(0), k_scale)
    v = dequantize(value.transpose(0, 1).unsqueeze(0), v_scale)
    gqa = num_heads != key.shape[1]
    plain = logits_soft_cap is None and sinks is None
    if query_len == seq_len and plain and (sliding_window is None or sliding_window >= seq_len):
        return (F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)[0]
                .transpose(0, 1).to(query.dtype))
    # SDPA's is_causal aligns to the top-left; with earlier context the diagonal shifts.
    mask = _causal_mask(torch.arange(first_query, seq_len, device=query.device),
                        torch.arange(first_key, seq_len, device=query.device), sliding_window)
    if plain:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        out = _math_attention(q, k, v, mask, scale, logits_soft_cap, sinks)
    return out[0].transpose(0, 1).to(query.dtype)


def _causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                 sliding_window: int | None) -> torch.Tensor:
    """[Lq, L] True where the query at query_positions[i] may attend to key_positions[j]."""
    distance = query_positions[:, None] - key_positions[None, :]
    mask = distance >= 0
    if sliding_window is not None:
        mask &= distance < sliding_window
    return mask


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(scores) over the last dim, in fp32; with `sinks` (broadcast against scores'
    shape with the last dim 1) each row's denominator holds exp(sink) too, as if the sink were
    one more key whose weight is then dropped (Hugging Face's gpt-oss concatenates it)."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    logits_soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA's math with the scores capped and sinks in the softmax (SDPA has neither): q
    [1, Hq, Lq, D], k and v [1, Hkv, L, D], mask [Lq, L] (True where a query may attend),
    sinks [Hq]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if logits_soft_cap is not None:
        scores = scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    scores = scores.masked_fill_(~mask, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, -1, 1, 1))
    return torch.matmul(probs, v)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, *,
                     sliding_window: int | None = None, logits_soft_cap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over one whole sequence without a cache (the runner's profiling
    forward): query [T, Hq, D], key and value [T, Hkv, D] -> [T, Hq, D] in the query's
    dtype, with paged_attention's window, soft cap and sinks."""
    num_tokens = query.shape[0]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    if sliding_window is None and logits_soft_cap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out[0].transpose(0, 1)
    positions = torch.arange(num_tokens, device=query.device)
    mask = _causal_mask(positions, positions, sliding_window)
    if logits_soft_cap is None and sinks is None:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = _math_attention(q.float(), k.float(), v.float(), mask, scale, logits_soft_cap, sinks)
    return out[0].transpose(0, 1).to(query.dtype)
