"""Random paged-attention steps whose KV is already in the cache, for kernel tests."""

from __future__ import annotations

import torch

from raylm.kernels.attention_metadata import AttentionMetadata


def step_metadata(query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                  slot_mapping: list[int]) -> AttentionMetadata:
    """The metadata of a step whose sequences have these query and context lengths."""
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
    )


def build_cached_step(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int,
                      block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0, padding_tokens: int = 0,
                      sliding_window: int | None = None):
    """A step after its KV write: every sequence's context at shuffled blocks of a cache whose
    other slots are NaN, block tables padded with a NaN block; returns the query, caches
    and metadata. With a sliding_window, the table entries of the blocks wholly before the
    window of a sequence's first query point at the NaN block, as the engine's freed blocks
    do (at a block of someone else's): a kernel that reads them returns NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    poisoned_block = free_blocks.pop()  # never written: what padded table entries point at
    block_tables = torch.full((len(seq_lens), max(blocks_needed) + 1), poisoned_block, dtype=torch.int32)
    for i, seq_len in enumerate(seq_lens):
        blocks = [free_blocks.pop() for _ in range(blocks_needed[i])]
        block_tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[t // block_size] * block_size + t % block_size for t in range(seq_len)])
        k_cache.view(-1, num_kv_heads, head_size)[slots] = torch.randn(
            seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v_cache.view(-1, num_kv_heads, head_size)[slots] = torch.randn(
            seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        if sliding_window is not None:
            first_needed = max(0, seq_len - query_lens[i] - sliding_window + 1)
            block_tables[i, :first_needed // block_size] = poisoned_block
    num_tokens = sum(query_lens) + padding_tokens
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    # slot_mapping is unused: the cache is already written.
    metadata = step_metadata(query_lens, seq_lens, block_tables, [0] * num_tokens)
    return query, k_cache, v_cache, metadata
