"""Mixtral: Llama's attention with every layer's MLP a sparse Mixture-of-Experts block
(`block_sparse_moe`: router `gate`, experts `experts.N.w1` (gate), `w3` (up), `w2` (down)),
top-`num_experts_per_tok` of `num_local_experts` experts, routing weights renormalised over
the chosen experts."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from raylm.models.llama import LlamaForCausalLM
from raylm.models.sparse_moe_block import SparseMoeBlock, load_weights_with_experts, moe_config


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        routing = moe_config(config)
        # The MoE block takes the place of the dense MLP each Llama layer built (dropped before
        # anything was written to it), under the name `mlp`, which Mixtral checkpoints call
        # `block_sparse_moe` (renamed at load).
        for layer in self.model.stage_layers:
            layer.mlp = SparseMoeBlock(config.hidden_size, routing["num_experts"], routing["top_k"],
                                       config.intermediate_size, renormalize=True,
                                       hidden_act=getattr(config, "hidden_act", "silu"))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_with_experts(self, self._checkpoint_tensors(weights), self.stacked_params_mapping)

    def _checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super()._checkpoint_tensors(weights):
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor

    def checkpoint_module_name(self, name: str) -> str:
        return re.sub(r"\.mlp(?=\.|$)", ".block_sparse_moe", name)
