"""Qwen's Mixture-of-Experts models: Qwen2-MoE (Qwen2's attention with qkv bias, routed experts
plus a shared expert gated by sigmoid(`shared_expert_gate`)) and Qwen3-MoE (Qwen3's attention
with per-head q/k RMSNorm, routed experts only).

A layer's MLP is sparse where its index is not in `mlp_only_layers` and (index + 1) is a
multiple of `decoder_sparse_step`, as in Hugging Face's models; other layers keep the dense
MLP of `intermediate_size`. Routing weights are renormalised over the chosen experts only
with `norm_topk_prob`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from raylm.models.llama import Qwen2ForCausalLM
from raylm.models.qwen3 import Qwen3ForCausalLM
from raylm.models.sparse_moe_block import SparseMoeBlock, load_weights_with_experts, moe_config


def sparse_layer_indices(config: Any) -> list[int]:
    """The layers whose MLP is the MoE block."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def use_sparse_blocks(model: Any, config: Any, shared_expert_intermediate_size: int = 0) -> None:
    """Puts the MoE block in place of the dense MLP of each sparse layer of `model` (the dense
    one, built by the Llama layers, is dropped before anything was written to it)."""
    routing = moe_config(config)
    for index in sparse_layer_indices(config):
        model.model.layers[index].mlp = SparseMoeBlock(
            config.hidden_size, routing["num_experts"], routing["top_k"], config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)), hidden_act=getattr(config, "hidden_act", "silu"),
            shared_expert_intermediate_size=shared_expert_intermediate_size)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        use_sparse_blocks(self, config, getattr(config, "shared_expert_intermediate_size", 0) or 0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_with_experts(self, self._checkpoint_tensors(weights), self.stacked_params_mapping)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        use_sparse_blocks(self, config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_with_experts(self, self._checkpoint_tensors(weights), self.stacked_params_mapping)
