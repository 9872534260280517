"""What every attention layer needs to know about the current step's batch."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; read by every attention layer.

    Tokens of all sequences are packed along one dimension, sequence after sequence.
    Sequence i owns rows query_start_loc[i]:query_start_loc[i+1] of the packed query;
    its queries sit at positions seq_lens[i] - query_len_i ... seq_lens[i] - 1 and attend
    causally to all seq_lens[i] tokens, which are in the KV cache once this step's new
    keys and values have been written to it.
    """

    # [num_tokens] int64: flat cache slot (block_id * block_size + offset) of each new
    # token; -1 for padding tokens, which are not written.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: prefix sums of query lengths.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: tokens in context after this step (computed + new).
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: physical block ids, padded with 0.
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Python-side copies, so the PyTorch path needs no device sync to loop or pad.
    query_lens_list: list[int]
    seq_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def decode_seqs_and_rows(self) -> tuple[list[int], list[int]]:
        """The sequences with one query token this step (decode), and each one's packed row."""
        seqs: list[int] = []
        rows: list[int] = []
        start = 0
        for i, query_len in enumerate(self.query_lens_list):
            if query_len == 1:
                seqs.append(i)
                rows.append(start)
            start += query_len
        return seqs, rows

    def for_rows(self, rows: list[int]) -> AttentionMetadata:
        """This step's attention from the packed rows `rows` alone, in that order: each is a
        one-token query at its own position p attending to the first p + 1 tokens of its
        sequence, all in the cache once the step's keys and values are written. What a layer
        needs whose outputs are read at those rows only (the last decoder layer)."""
        seqs, seq_lens = rows_sequences(self.query_lens_list, self.seq_lens_list, rows)
        device = self.seq_lens.device
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.index_select(0, torch.tensor(rows, dtype=torch.long, device=device)),
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=device)),
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_lens_list=[1] * len(rows),
            seq_lens_list=seq_lens,
        )


def rows_sequences(query_lens: list[int], seq_lens: list[int], rows: list[int]) -> tuple[list[int], list[int]]:
    """For packed rows of a step: each row's sequence, and the context length of a one-token
    query at that row's position (what `AttentionMetadata.for_rows` builds on)."""
    starts = list(itertools.accumulate(query_lens, initial=0))
    seqs: list[int] = []
    lens: list[int] = []
    for row in rows:
        seq = bisect.bisect_right(starts, row) - 1
        seqs.append(seq)
        lens.append(seq_lens[seq] - query_lens[seq] + (row - starts[seq]) + 1)
    return seqs, lens
