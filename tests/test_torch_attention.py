"""The PyTorch paged attention against a naive per-sequence softmax(QK^T)V reference."""

from __future__ import annotations

import math

import pytest
import torch

from raylm.kernels import paged_attention, write_kv_cache
from paged_steps import step_metadata

BLOCK_SIZE = 4
HEAD_SIZE = 8
NUM_BLOCKS = 64


def build_step(query_lens: list[int], seq_lens: list[int], num_kv_heads: int, num_heads: int, seed: int = 0,
               padding_tokens: int = 0):
    """Random K/V for every context token, the earlier ones already in a NaN-poisoned cache
    at shuffled blocks, and the step's queries; returns everything the kernel and the
    reference need."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_SIZE), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    max_blocks = max(-(-s // BLOCK_SIZE) for s in seq_lens)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    keys, values, new_keys, new_values, slot_mapping = [], [], [], [], []
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        blocks = [free_blocks.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        block_tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        key = torch.randn(seq_len, num_kv_heads, HEAD_SIZE, generator=gen)
        value = torch.randn(seq_len, num_kv_heads, HEAD_SIZE, generator=gen)
        slots = [blocks[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(seq_len)]
        cached = seq_len - query_len
        k_cache.view(-1, num_kv_heads, HEAD_SIZE)[slots[:cached]] = key[:cached]
        v_cache.view(-1, num_kv_heads, HEAD_SIZE)[slots[:cached]] = value[:cached]
        keys.append(key)
        values.append(value)
        new_keys.append(key[cached:])
        new_values.append(value[cached:])
        slot_mapping += slots[cached:]
    num_tokens = sum(query_lens) + padding_tokens
    query = torch.randn(num_tokens, num_heads, HEAD_SIZE, generator=gen)
    new_key = torch.cat(new_keys + [torch.randn(padding_tokens, num_kv_heads, HEAD_SIZE, generator=gen)])
    new_value = torch.cat(new_values + [torch.randn(padding_tokens, num_kv_heads, HEAD_SIZE, generator=gen)])
    slot_mapping += [-1] * padding_tokens
    metadata = step_metadata(query_lens, seq_lens, block_tables, slot_mapping)
    return query, new_key, new_value, k_cache, v_cache, metadata, keys, values


def naive_attention(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    query_lens: list[int], scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> torch.Tensor:
    """Per sequence: repeat KV heads for GQA, causal softmax in float64, queries at the end;
    with a window w the query at p also masks keys at or before p - w, and a soft cap c
    maps scores s to c * tanh(s / c)."""
    outs = []
    start = 0
    for key, value, query_len in zip(keys, values, query_lens):
        seq_len = key.shape[0]
        group = query.shape[1] // key.shape[1]
        q = query[start:start + query_len].double().transpose(0, 1)  # [H, Lq, D]
        k = key.double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = value.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        query_pos = torch.arange(seq_len - query_len, seq_len)
        future = torch.arange(seq_len)[None, :] > query_pos[:, None]
        if sliding_window is not None:
            future |= torch.arange(seq_len)[None, :] <= query_pos[:, None] - sliding_window
        scores = scores.masked_fill(future, float("-inf"))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1).float())
        start += query_len
    return torch.cat(outs)


def run_and_compare(query_lens, seq_lens, num_heads=4, num_kv_heads=2, seed=0, padding_tokens=0,
                    sliding_window=None, soft_cap=None):
    query, new_key, new_value, k_cache, v_cache, metadata, keys, values = build_step(
        query_lens, seq_lens, num_kv_heads, num_heads, seed, padding_tokens)
    scale = 1.0 / math.sqrt(HEAD_SIZE)
    write_kv_cache(new_key, new_value, k_cache, v_cache, metadata.slot_mapping)
    if sliding_window is not None:
        poison_blocks_before_each_window(k_cache, v_cache, metadata, sliding_window)
    out = paged_attention(query, k_cache, v_cache, metadata, scale, sliding_window=sliding_window,
                          logits_soft_cap=soft_cap)
    expected = naive_attention(query, keys, values, query_lens, scale, sliding_window, soft_cap)
    num_real = sum(query_lens)
    assert out.shape == query.shape
    torch.testing.assert_close(out[:num_real], expected, atol=1e-5, rtol=1e-5)
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_prefill_matches_naive_attention_for_each_gqa_ratio(num_heads, num_kv_heads):
    lens = [1, 3, 4, 9, 13]
    run_and_compare(lens, lens, num_heads, num_kv_heads)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_batched_decode_matches_naive_attention_for_each_gqa_ratio(num_heads, num_kv_heads):
    seq_lens = [1, 2, 4, 5, 8, 11, 17]
    run_and_compare([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, seed=1)


def test_chunked_prefill_reads_earlier_chunks_from_cache():
    # Query chunks of 3, 4 and 5 tokens after 5, 8 and 0 cached tokens.
    run_and_compare([3, 4, 5], [8, 12, 5], seed=2)


def test_mixed_prefill_and_decode_batch_matches_naive_attention():
    query_lens = [1, 6, 1, 3, 1]
    seq_lens = [9, 6, 3, 10, 16]
    run_and_compare(query_lens, seq_lens, num_heads=8, num_kv_heads=2, seed=3)


def test_padding_slots_are_not_written_and_their_rows_are_zero():
    seq_lens = [3, 7]
    query, new_key, new_value, k_cache, v_cache, metadata, _, _ = build_step(
        [1, 1], seq_lens, 2, 4, seed=4, padding_tokens=2)
    before = k_cache.clone()
    write_kv_cache(new_key, new_value, k_cache, v_cache, metadata.slot_mapping)
    changed = ~((k_cache == before) | (k_cache.isnan() & before.isnan()))
    assert int(changed.any(dim=(2, 3)).sum()) == 2  # exactly the two real tokens' slots
    out = paged_attention(query, k_cache, v_cache, metadata, 0.5)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert not out.isnan().any()


def test_padding_tokens_do_not_change_real_outputs():
    run_and_compare([1, 4, 1], [5, 4, 9], seed=5, padding_tokens=3)


def test_decode_ignores_garbage_beyond_each_sequence_end():
    # NaN fills every unwritten slot of the cache, including the tail of each sequence's
    # last block and block 0 behind the padded block tables; none may leak into outputs.
    out = run_and_compare([1, 1, 1], [1, 5, 14], seed=6)
    assert not out.isnan().any()


def test_bfloat16_cache_matches_naive_attention_within_bf16_precision():
    lens = [5, 9]
    query, new_key, new_value, k_cache, v_cache, metadata, keys, values = build_step(lens, lens, 2, 4, seed=7)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    write_kv_cache(new_key.bfloat16(), new_value.bfloat16(), k_cache, v_cache, metadata.slot_mapping)
    out = paged_attention(query.bfloat16(), k_cache, v_cache, metadata, 0.3)
    assert out.dtype == torch.bfloat16
    expected = naive_attention(query, keys, values, lens, 0.3)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def poison_blocks_before_each_window(k_cache, v_cache, metadata, sliding_window: int) -> None:
    """NaN in every block wholly before the window of its sequence's first query, as if the
    engine had freed it and another request had written it: reading one gives NaN."""
    for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_list, metadata.seq_lens_list)):
        first_needed = max(0, seq_len - query_len - sliding_window + 1)
        blocks = metadata.block_tables[i, :first_needed // BLOCK_SIZE].long()
        k_cache[blocks] = float("nan")
        v_cache[blocks] = float("nan")


@pytest.mark.parametrize("window", [1, 2, 4, 7, 30])
def test_sliding_window_matches_naive_attention_without_reading_blocks_before_the_window(window):
    # Prompts, chunks after cached tokens and decodes in one step, windows inside one block,
    # across several, and wider than every context.
    query_lens = [1, 9, 1, 4, 13, 1]
    seq_lens = [17, 9, 3, 21, 13, 26]
    out = run_and_compare(query_lens, seq_lens, num_heads=8, num_kv_heads=2, seed=window, sliding_window=window)
    assert not out.isnan().any()


def test_sliding_window_decode_only_step_matches_naive_attention():
    seq_lens = [1, 3, 5, 8, 13, 21]
    run_and_compare([1] * len(seq_lens), seq_lens, seed=11, sliding_window=5)


@pytest.mark.parametrize("window", [None, 6])
def test_soft_cap_matches_naive_attention(window):
    run_and_compare([1, 9, 4, 1], [17, 9, 21, 3], seed=12, sliding_window=window, soft_cap=0.5)
