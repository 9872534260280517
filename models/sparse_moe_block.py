"""The MLP of an MoE decoder layer: a router, the routed experts, and for some models a shared
expert that every token goes through (Qwen2-MoE's `shared_expert`, gated per token by
sigmoid(`shared_expert_gate`)). Module names follow Hugging Face's, so checkpoints load by
name; `load_weights_with_experts` maps the per-expert checkpoint tensors
(`experts.N.gate_proj` or Mixtral's `experts.N.w1`, ...) into the fused expert weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from raylm.models.fused_moe import FusedMoE
from raylm.models.llama import LlamaMLP
from raylm.models.weight_utils import load_stacked_weights
from raylm.parallel import ReplicatedLinear
from raylm.parallel.communication import tensor_model_parallel_all_reduce
from raylm.parallel.int4_moe_method import check_expert_weight_shape


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 hidden_act: str, shared_expert_intermediate_size: int = 0) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' for the MoE experts, got {hidden_act!r}.")
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        # Routers stay in the model's dtype under FP8 quantization, as vLLM builds them.
        self.gate.keep_unquantized = True
        # The experts' partial sums join the shared expert's in one all-reduce.
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                reduce_results=False)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(hidden_size, shared_expert_intermediate_size, hidden_act)
            self.shared_expert.down_proj.reduce_results = False
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
            self.shared_expert_gate.keep_unquantized = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H], summed over the tensor-parallel ranks."""
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            # The gate is whole on every rank and the shared expert's output a partial sum,
            # so gating each rank's part gates the sum.
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return tensor_model_parallel_all_reduce(out)


def moe_config(config: Any) -> dict[str, Any]:
    """The expert count and routing a config asks for, checked (Mixtral's num_local_experts or
    Qwen's num_experts; num_experts_per_tok)."""
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not num_experts or num_experts < 1:
        raise ValueError(f"config.json must give num_experts (or num_local_experts) >= 1 for an MoE model, got "
                         f"{num_experts!r}.")
    top_k = config.num_experts_per_tok
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}] (the number of experts), got {top_k}.")
    return dict(num_experts=num_experts, top_k=top_k)


# A checkpoint tensor of one routed expert: `<prefix>.experts.<id>.<projection>.weight`, one
# of its FP8 scales (`weight_scale`, `weight_scale_inv`, `input_scale`), its GPTQ/AWQ
# tensors (`qweight`, `qzeros`, `scales`, `g_idx`) or its compressed-tensors integer ones
# (`weight_packed`, `weight_zero_point`, `weight_g_idx`, `weight_scale`; `weight_shape`).
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\."
                            r"(?P<projection>w1|w2|w3|gate_proj|up_proj|down_proj)\."
                            r"(?P<kind>weight|weight_scale|weight_scale_inv|input_scale|qweight|qzeros|scales|g_idx|"
                            r"weight_packed|weight_zero_point|weight_g_idx|weight_shape)$")
# Checkpoint projection -> FusedMoEWeights shard (vLLM's w1/w2/w3: Mixtral's own names).
_EXPERT_SHARD = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2", "down_proj": "w2"}


def load_weights_with_experts(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                              stacked_params_mapping: Iterable[tuple[str, str, Any]]) -> set[str]:
    """`load_stacked_weights`, with each routed expert's tensor sent to its FusedMoE's fused
    parameter (w13_weight for gate/up, w2_weight for down; FP8 scales and GPTQ/AWQ tensors
    likewise to w13_<kind> and w2_<kind>) with shard id (expert, shard).
    Returns the names of the parameters loaded."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()

    def other_tensors():
        for name, tensor in weights:
            match = _EXPERT_TENSOR.match(name)
            if match is None:
                yield name, tensor
                continue
            shard = _EXPERT_SHARD[match["projection"]]
            if match["kind"] == "weight_shape":  # the unpacked [out, in]: checked, not held
                check_expert_weight_shape(model.get_submodule(match["prefix"]), name, int(match["expert"]), shard,
                                          tensor)
                continue
            target = f"{match['prefix']}.{'w2' if shard == 'w2' else 'w13'}_{match['kind']}"
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} maps to {target!r}, which the model lacks.")
            params[target].weight_loader(params[target], tensor, (int(match["expert"]), shard))
            loaded.add(target)

    return loaded | load_stacked_weights(model, other_tensors(), stacked_params_mapping)
