"""Embedding and LM head sharded by vocabulary rows across tensor-parallel ranks.

The vocabulary is padded up to a multiple of the tensor parallel size so every rank holds
the same number of rows; rank r owns token ids [r * V_pad / tp, (r + 1) * V_pad / tp).
Padding rows are zero and never looked up; their logits are cut off after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.kernels import cpu_gemm
from raylm.parallel.checkpoint_slice import read_weight
from raylm.parallel.communication import tensor_model_parallel_all_reduce
from raylm.parallel.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=params_dtype or torch.get_default_dtype()),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"checkpoint tensor for {type(self).__name__} has shape {tuple(loaded_weight.shape)}, "
                             f"the model expects {(self.num_embeddings, self.embedding_dim)}.")
        # The last rank's shard may run past the real vocabulary into padding rows.
        real_rows = max(0, min(self.vocab_end_index, self.num_embeddings) - self.vocab_start_index)
        param.data[:real_rows].copy_(read_weight(loaded_weight[self.vocab_start_index:self.vocab_start_index + real_rows]))
        param.data[real_rows:].zero_()

    def lookup_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial embedding: the rows it owns, zeros for ids other ranks own.
        Summing the partials over ranks gives the full embedding."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * owned
        return F.embedding(local_ids, self.weight).masked_fill_(~owned.unsqueeze(-1), 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(self.lookup_shard(input_ids))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocabulary, sharded like the embedding; its weight
    may be the embedding's own (tied embeddings). Logits are computed by
    `raylm.models.logits_processor.LogitsProcessor`, not by calling this module."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition,
                                                 dtype=params_dtype or torch.get_default_dtype()),
                                     requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.bias = None
        self.packed_weight: torch.Tensor | None = None
        self.decode_weight: cpu_gemm.DecodeWeight | None = None

    def process_weights_after_loading(self) -> None:
        """Packs the loaded weight once for the CPU GEMM, like the linear layers: the LM head
        is the largest single matmul of a small model's decode step. A tied weight keeps its
        one copy for the embedding lookup; the packed copy serves only the logits."""
        self.packed_weight, self.decode_weight = cpu_gemm.pack_weight_copies(self.weight)

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        real_rows = max(0, min(self.vocab_end_index, self.num_embeddings) - self.vocab_start_index)
        param.data[:real_rows].copy_(read_weight(loaded_weight[self.vocab_start_index:self.vocab_start_index + real_rows]))
        param.data[real_rows:].zero_()

    def logits_shard(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, V_pad / tp] logits of the vocabulary rows this rank owns."""
        return cpu_gemm.linear(hidden_states, self.weight, self.packed_weight, self.bias, self.decode_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called; compute logits with LogitsProcessor.")
