"""PyTorch reference paged attention: the CPU path, and the oracle the Triton kernels match.

Cache layout (one pair per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads,
head_size]; token t of a sequence lives at flat slot
block_table[t // block_size] * block_size + t % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raylm.kernels.attention_metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores this step's keys and values [T, Hkv, D] at their flat slots; slot -1 (padding
    tokens) is skipped."""
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_size)
    v_flat = v_cache.view(-1, num_kv_heads, head_size)
    # Padding is rare (the runner pads only for fixed-size batches); checking for it on the
    # host costs one small reduction, filtering costs three indexing ops per call. A device
    # cache would sync here, but device caches use the Triton kernel.
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its whole context in the cache.

    Called after `write_kv_cache` for the step. Sequence i's queries, rows
    query_start_loc[i]:query_start_loc[i+1] of `query` [T, Hq, D], sit at the last
    query_len_i of its seq_lens[i] positions. Query head h reads KV head h // (Hq // Hkv).
    Returns [T, Hq, D] in the query's dtype; rows of padding tokens past the last
    sequence are zero. Softmax runs in fp32. `logits_soft_cap` (Gemma 2; off by default,
    and only this reference backend implements it) maps the scaled scores s to
    cap * tanh(s / cap) before the mask and softmax.
    """
    md = attn_metadata
    num_tokens = query.shape[0]
    plan = _decode_plan(md, k_cache)
    if md.max_query_len == 1 and plan is not None and plan.rows is None and plan.batch == num_tokens:
        return _batched_decode(query, k_cache, v_cache, plan, scale, logits_soft_cap)

    out = query.new_zeros(query.shape)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(md.query_lens_list, md.seq_lens_list)):
        if query_len > 1:
            out[start:start + query_len] = _prefill_one(query[start:start + query_len], k_cache, v_cache,
                                                        md.block_tables[i], seq_len, scale, logits_soft_cap)
        start += query_len
    if plan is not None:
        # Decoding sequences go through one batched call, also in mixed batches.
        rows = plan.rows if plan.rows is not None else slice(0, plan.batch)
        out[rows] = _batched_decode(query[rows], k_cache, v_cache, plan, scale, logits_soft_cap)
    return out


@dataclass
class _DecodePlan:
    """Where the decoding sequences (query_len 1) of a step find their context: the same
    for every layer, so it is built once per step."""

    batch: int
    max_seq_len: int
    # Query rows of the decoding sequences; None when they are rows 0..batch-1.
    rows: torch.Tensor | None
    # [batch * Hkv * max_seq_len] rows of the cache viewed as [num_slots * Hkv, D], laid out
    # [sequence, kv head, position] so the gathered keys feed the matmul without a copy.
    cache_rows: torch.Tensor
    # [batch, 1, 1, max_seq_len]: positions past each sequence's end.
    beyond_end: torch.Tensor


def _decode_plan(md: AttentionMetadata, k_cache: torch.Tensor) -> _DecodePlan | None:
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    key = (num_kv_heads, block_size)
    # Cached on the metadata object, which lives exactly one step; not a dataclass field.
    plans = md.__dict__.setdefault("_decode_plans", {})
    if key not in plans:
        plans[key] = _build_decode_plan(md, num_kv_heads, block_size, k_cache.device)
    return plans[key]


def _build_decode_plan(md: AttentionMetadata, num_kv_heads: int, block_size: int,
                       device: torch.device) -> _DecodePlan | None:
    if md.max_query_len == 1:
        seq_index, rows = None, None
        batch, max_seq_len = md.num_seqs, md.max_seq_len
        block_tables, seq_lens = md.block_tables, md.seq_lens
    else:
        decode_seqs, decode_rows, start = [], [], 0
        for i, query_len in enumerate(md.query_lens_list):
            if query_len == 1:
                decode_seqs.append(i)
                decode_rows.append(start)
            start += query_len
        if not decode_seqs:
            return None
        seq_index = torch.tensor(decode_seqs, device=device)
        rows = torch.tensor(decode_rows, device=device)
        batch, max_seq_len = len(decode_seqs), max(md.seq_lens_list[i] for i in decode_seqs)
        block_tables, seq_lens = md.block_tables[seq_index], md.seq_lens[seq_index]
    seq_lens = seq_lens.long()
    positions = torch.arange(max_seq_len, device=device)
    # Positions past a sequence's end read its last token instead of whatever the padded
    # block table points at: those slots may hold anything (even NaN), and 0 * NaN is NaN
    # even under a -inf mask.
    clamped = torch.minimum(positions[None, :], seq_lens[:, None] - 1)
    slots = block_tables.long().gather(1, clamped // block_size) * block_size + clamped % block_size
    heads = torch.arange(num_kv_heads, device=device)
    cache_rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
    beyond_end = (positions[None, :] >= seq_lens[:, None])[:, None, None, :]
    return _DecodePlan(batch, max_seq_len, rows, cache_rows, beyond_end)


def _batched_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _DecodePlan,
                    scale: float, logits_soft_cap: float | None = None) -> torch.Tensor:
    """One query row per sequence [B, Hq, D]: every sequence's context gathered into a
    padded [B, Hkv, max_seq_len, D] tensor, the tail masked, one batched matmul per side."""
    batch, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    shape = (batch, num_kv_heads, plan.max_seq_len, head_size)
    key = k_cache.view(-1, head_size).index_select(0, plan.cache_rows).view(shape)
    value = v_cache.view(-1, head_size).index_select(0, plan.cache_rows).view(shape)
    # Query heads of one KV head are consecutive: fold them into the matmul's row dim.
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_size).float()
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, L]
    if logits_soft_cap is not None:
        scores = scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    probs = scores.masked_fill_(plan.beyond_end, float("-inf")).softmax(dim=-1)
    out = torch.matmul(probs, value.float())  # [B, Hkv, G, D]
    return out.view(batch, num_heads, head_size).to(query.dtype)


def _prefill_one(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_len: int, scale: float, logits_soft_cap: float | None = None) -> torch.Tensor:
    """One sequence's [Lq, Hq, D] queries over its seq_len cached tokens, causal with the
    queries aligned to the end of the context (chunked prefill reads earlier chunks)."""
    query_len, num_heads, _ = query.shape
    block_size = k_cache.shape[1]
    blocks = block_table[:-(-seq_len // block_size)].long()
    key = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]  # [L, Hkv, D]
    value = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    # SDPA's layout is [batch, heads, tokens, D]; fp32 so that the softmax is fp32 too.
    q = query.transpose(0, 1).unsqueeze(0).float()
    k = key.transpose(0, 1).unsqueeze(0).float()
    v = value.transpose(0, 1).unsqueeze(0).float()
    gqa = num_heads != key.shape[1]
    if query_len == seq_len and logits_soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # SDPA's is_causal aligns to the top-left; with earlier context the diagonal shifts.
        query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= query_pos[:, None]
        if logits_soft_cap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            out = _soft_capped_attention(q, k, v, mask, scale, logits_soft_cap)
    return out[0].transpose(0, 1).to(query.dtype)


def _soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                           logits_soft_cap: float) -> torch.Tensor:
    """SDPA's math with the scores capped (SDPA has no cap): q [1, Hq, Lq, D], k and v
    [1, Hkv, L, D], mask [Lq, L] (True where a query may attend)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores = scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs, v)


def soft_capped_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                                 logits_soft_cap: float) -> torch.Tensor:
    """Causal attention with capped scores over one whole sequence without a cache (the
    runner's profiling forward): query [T, Hq, D], key and value [T, Hkv, D] -> [T, Hq, D]
    in the query's dtype."""
    num_tokens = query.shape[0]
    q, k, v = (x.transpose(0, 1).unsqueeze(0).float() for x in (query, key, value))
    mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=query.device).tril_()
    return _soft_capped_attention(q, k, v, mask, scale, logits_soft_cap)[0].transpose(0, 1).to(query.dtype)
