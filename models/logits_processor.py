"""Turns final hidden states into full-vocabulary fp32 logits on the sampling rank."""

from __future__ import annotations

import torch
from torch import nn

from raylm.parallel.communication import tensor_model_parallel_gather
from raylm.parallel.vocab_parallel_embedding import ParallelLMHead


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[N, vocab] fp32 logits on tensor-parallel rank 0, None on the other ranks."""
        logits = tensor_model_parallel_gather(lm_head.logits_shard(hidden_states))
        if logits is None:
            return None
        # Drop the rows that only pad the vocabulary to a multiple of the TP size.
        return logits[..., :self.vocab_size].float()
