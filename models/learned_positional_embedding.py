"""Absolute position embeddings learned as a table (GPT-2, OPT), the alternative to rotary
embeddings: position p adds row p + offset of the table to the token embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LearnedPositionalEmbedding(nn.Module):
    """[num_positions + offset, dim] table, replicated on every tensor-parallel rank (it is
    small next to the vocabulary). `offset` is 2 for OPT, whose checkpoints keep two
    unused rows in front (a fairseq leftover), and 0 for GPT-2."""

    def __init__(self, num_positions: int, embedding_dim: int, offset: int = 0) -> None:
        super().__init__()
        self.num_positions = num_positions
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(num_positions + offset, embedding_dim), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] int64, absolute token positions -> [T, dim]."""
        return F.embedding(positions + self.offset, self.weight)
