"""`CausalLM`: what every `*ForCausalLM` does the same way around its own decoder: logits
from its LM head, and loading a checkpoint through the parameters' `weight_loader`s."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from raylm.models.attention import load_checkpoint_kv_scale
from raylm.models.logits_processor import LogitsProcessor
from raylm.models.weight_utils import load_stacked_weights


class CausalLM(nn.Module):
    """A decoder-only model for generation. A subclass builds `lm_head`,
    `logits_processor` and `tie_word_embeddings`, and says how its checkpoints' names map
    to its parameters: `stacked_params_mapping`, and `_checkpoint_tensors` for renames and
    tensors it does not hold."""

    # Checkpoint names fused into one parameter: (our name, checkpoint name, shard id).
    stacked_params_mapping: list[tuple[str, str, Any]] = []
    # The attribute (and checkpoint name prefix) of the decoder under the LM head, as
    # transformers' PreTrainedModel.base_model_prefix: a bare `*Model` checkpoint saves
    # the decoder's tensors without it.
    base_model_prefix = "model"
    lm_head: nn.Module
    logits_processor: LogitsProcessor
    tie_word_embeddings: bool

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] fp32 logits; None on tensor-parallel ranks other than 0."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors into their (sharded) parameters; returns the names of
        the parameters it loaded."""
        return load_stacked_weights(self, self._checkpoint_tensors(weights), self.stacked_params_mapping)

    def checkpoint_module_name(self, name: str) -> str:
        """The checkpoint's name of our module `name`, which quantization configs (ignore
        lists, GPTQ's `dynamic` rules) are written against: the same unless
        `_checkpoint_tensors` renames."""
        return name

    def _checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors that this model holds; subclasses rename and skip more."""
        for name, tensor in weights:
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # some tied checkpoints store the shared matrix twice
            if load_checkpoint_kv_scale(self, name, tensor):
                continue  # an fp8 checkpoint's k_scale / v_scale: the attention layer holds it
            yield name, tensor
