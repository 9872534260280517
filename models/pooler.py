"""Sequence pooling: one vector per prompt from its final hidden states (vLLM's Pooler).

A function of tensors: the runner picks each prompt's rows (its last, its first, or all of
them), the model returns their final-norm hidden states in that order, and `pool_rows`
averages each prompt's run of rows (a run of one row is that row).
"""

from __future__ import annotations

import torch


def pooled_row_span(pooling_type: str, chunk_start: int, chunk_len: int, prompt_len: int) -> range:
    """Which of a chunk's rows (0-based within the chunk) a prompt pools in this step:
    LAST the prompt's last row, CLS its first, MEAN every row. Empty when the chunk holds
    none of them (LAST before the prompt's end). The chunk covers prompt positions
    chunk_start .. chunk_start + chunk_len - 1."""
    if pooling_type == "LAST":
        last = prompt_len - 1 - chunk_start
        return range(last, last + 1) if 0 <= last < chunk_len else range(0)
    if pooling_type == "CLS":
        return range(0, 1) if chunk_start == 0 else range(0)
    assert pooling_type == "MEAN", pooling_type
    return range(0, chunk_len)


def pool_rows(hidden_states: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[sum(counts), H] hidden states, `counts[i]` consecutive rows for prompt i, to
    [len(counts), H] float32: each prompt's mean (its one row for LAST and CLS)."""
    hidden = hidden_states.float()
    if all(count == 1 for count in counts):
        return hidden
    segments = torch.repeat_interleave(torch.arange(len(counts), device=hidden.device),
                                       torch.tensor(counts, device=hidden.device))
    sums = torch.zeros(len(counts), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, segments, hidden)
    return sums / torch.tensor(counts, dtype=torch.float32, device=hidden.device).unsqueeze(1)
