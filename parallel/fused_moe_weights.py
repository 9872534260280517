"""The expert weights of a Mixture-of-Experts layer, sharded across the tensor-parallel ranks.

Every expert is a gated MLP: gate_proj and up_proj ([I, H] each, vLLM's w1 and w3) fused
into w13 [E, 2I, H], down_proj (w2) in w2 [E, H, I]. Two ways to spread them over ranks:

- tensor parallel (the default): every rank holds every expert, each expert's gate/up
  column-parallel and its down row-parallel, so rank r holds intermediate features
  [r I / tp, (r + 1) I / tp) of each: w13 [E, 2I / tp, H], w2 [E, H, I / tp];
- expert parallel (`get_expert_parallel()`, vLLM's enable_expert_parallel): rank r holds
  whole experts, a contiguous range of E / tp of them (the first E % tp ranks one more, as
  vLLM places them), and `expert_map` gives each global expert id its row here or -1.

Either way each rank's output is a partial sum over its shards or experts, and one
all-reduce over the group gives the layer's output (the caller runs it, so that a shared
expert's partial sum joins the same collective).

`weight_loader(param, checkpoint_tensor, (expert_id, "w1" | "w2" | "w3"))` takes one
expert's full checkpoint tensor and copies this rank's share; a tensor of an expert held by
another rank is not read at all.

With `has_bias` (gpt-oss) the experts carry biases too: w13_bias [E, 2 I_local] cut as w13's
rows, w2_bias [E, H] whole on every rank that holds the expert (`bias_loader`, same shard ids,
from each expert's [I] or [H] checkpoint bias). The down projection's bias belongs to the sum,
so only one rank of a sharded expert adds it (`adds_w2_bias`).
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.kernels import cpu_fused_moe
from raylm.parallel.linear import _copy_checked, _new_parameter
from raylm.parallel.parallel_state import (get_expert_parallel, get_tensor_model_parallel_rank,
                                           get_tensor_model_parallel_world_size)
from raylm.parallel.utils import divide

# Checkpoint projection -> the fused parameter it goes to.
EXPERT_SHARDS = ("w1", "w2", "w3")


def expert_placement(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """(first expert, number of experts) of rank ep_rank under expert parallelism: contiguous
    ranges, num_experts // ep_size each, the first num_experts % ep_size ranks one more."""
    base, extra = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, extra), base + (ep_rank < extra)


class FusedMoEWeights(nn.Module):
    """This rank's w13_weight [E_local, 2 I_local, H] and w2_weight [E_local, H, I_local], with
    their weight_loader; `expert_map` [E] (a buffer, None without expert parallelism) maps
    global expert ids to rows of them. On the CPU `packed` holds them in the AVX-512 panels
    (`process_weights_after_loading`), None where that kernel does not run."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 params_dtype: torch.dtype | None = None, has_bias: bool = False) -> None:
        super().__init__()
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.use_expert_parallel = get_expert_parallel() and tp_size > 1
        if self.use_expert_parallel:
            if num_experts < tp_size:
                raise ValueError(f"enable_expert_parallel places whole experts on the {tp_size} tensor-parallel "
                                 f"ranks, but the model has only {num_experts} experts per layer: use at most "
                                 f"{num_experts} ranks, or turn expert parallelism off to shard every expert.")
            self.first_expert, self.num_local_experts = expert_placement(num_experts, tp_size, tp_rank)
            self.moe_tp_size, self.moe_tp_rank = 1, 0
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.first_expert:self.first_expert + self.num_local_experts] = torch.arange(
                self.num_local_experts, dtype=torch.int32)
        else:
            self.first_expert, self.num_local_experts = 0, num_experts
            self.moe_tp_size, self.moe_tp_rank = tp_size, tp_rank
            expert_map = None
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.intermediate_size_per_partition = divide(intermediate_size, self.moe_tp_size,
                                                      "MoE intermediate size (moe_intermediate_size)")
        size = self.intermediate_size_per_partition
        self.w13_weight = _new_parameter(self.num_local_experts, 2 * size, hidden_size, dtype=params_dtype,
                                         weight_loader=self.weight_loader)
        self.w2_weight = _new_parameter(self.num_local_experts, hidden_size, size, dtype=params_dtype,
                                        weight_loader=self.weight_loader)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if has_bias:
            self.w13_bias = _new_parameter(self.num_local_experts, 2 * size, dtype=params_dtype,
                                           weight_loader=self.bias_loader)
            self.w2_bias = _new_parameter(self.num_local_experts, hidden_size, dtype=params_dtype,
                                          weight_loader=self.bias_loader)
        self.packed: cpu_fused_moe.PackedExperts | None = None
        # `Fp8MoEMethod` / `Int4MoEMethod` (`models/quantization.py`) where the experts are
        # quantized: it then owns their parameters, their processing after loading, and the
        # computation.
        self.quant_method = None
        self._loaded_shards: set[tuple[int, str]] = set()

    @property
    def expected_shards(self) -> tuple[str, ...]:
        scales = self.quant_method.scale_shards if self.quant_method is not None else ()
        return (EXPERT_SHARDS + (tuple(f"{shard}_bias" for shard in EXPERT_SHARDS) if self.w13_bias is not None else ())
                + scales)

    def local_expert(self, expert_id: int, shard: str) -> int | None:
        """The row of global expert `expert_id` in this rank's weights, None where another rank
        holds it; an error for an id or shard the layer has not."""
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"expert shard must be one of {EXPERT_SHARDS}, got {shard!r}.")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"checkpoint tensor of expert {expert_id}: the layer has experts 0 to "
                             f"{self.num_experts - 1} (num_experts = {self.num_experts}).")
        local = expert_id - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    @property
    def adds_w2_bias(self) -> bool:
        """Whether this rank's partial sum carries the down projection's bias: the first rank
        of a sharded expert, every rank of whole ones (expert parallelism)."""
        return self.moe_tp_rank == 0

    def bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """Copies this rank's share of expert `shard_id[0]`'s checkpoint bias of projection
        shard_id[1] (w1: gate [I], w3: up [I], w2: down [H])."""
        expert_id, shard = shard_id
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"expert shard must be one of {EXPERT_SHARDS}, got {shard!r}.")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"checkpoint bias of expert {expert_id}: the layer has experts 0 to "
                             f"{self.num_experts - 1} (num_experts = {self.num_experts}).")
        full = (self.hidden_size,) if shard == "w2" else (self.intermediate_size,)
        if tuple(loaded_weight.shape) != full:
            raise ValueError(f"checkpoint bias of expert {expert_id} {shard} has shape {tuple(loaded_weight.shape)}, "
                             f"the model expects {full}.")
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        size = self.intermediate_size_per_partition
        name = f"{type(self).__name__} expert {expert_id} {shard} bias"
        if shard == "w2":
            _copy_checked(param.data[local], loaded_weight, name)
        else:
            offset = 0 if shard == "w1" else size
            _copy_checked(param.data[local].narrow(0, offset, size),
                          loaded_weight.narrow(0, self.moe_tp_rank * size, size), name)
        self._loaded_shards.add((expert_id, f"{shard}_bias"))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """Copies this rank's share of expert `shard_id[0]`'s full checkpoint tensor for
        projection shard_id[1] (w1: gate_proj [I, H], w3: up_proj [I, H], w2: down_proj [H, I])."""
        expert_id, shard = shard_id
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"expert shard must be one of {EXPERT_SHARDS}, got {shard!r}.")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"checkpoint tensor of expert {expert_id}: the layer has experts 0 to "
                             f"{self.num_experts - 1} (num_experts = {self.num_experts}).")
        full = (self.hidden_size, self.intermediate_size) if shard == "w2" else (self.intermediate_size,
                                                                                 self.hidden_size)
        if tuple(loaded_weight.shape) != full:
            raise ValueError(f"checkpoint tensor of expert {expert_id} {shard} has shape {tuple(loaded_weight.shape)}, "
                             f"the model expects {full}.")
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert: not read
        size = self.intermediate_size_per_partition
        start = self.moe_tp_rank * size
        name = f"{type(self).__name__} expert {expert_id} {shard}"
        if shard == "w2":  # row parallel: this rank's input features
            _copy_checked(param.data[local], loaded_weight.narrow(1, start, size), name)
        else:  # column parallel: gate rows, then up rows
            offset = 0 if shard == "w1" else size
            _copy_checked(param.data[local].narrow(0, offset, size), loaded_weight.narrow(0, start, size), name)
        self._loaded_shards.add((expert_id, shard))

    def mark_all_weights_loaded(self) -> None:
        """load_format "dummy": every local expert holds values (random ones), none read from
        a checkpoint, so the completeness check below has nothing to find missing."""
        self._loaded_shards = {(self.first_expert + local, shard) for local in range(self.num_local_experts)
                               for shard in self.expected_shards}

    def process_weights_after_loading(self) -> None:
        """Checks that every local expert was loaded whole, then packs the weights for the
        CPU kernel (the loader calls this once every weight is in)."""
        missing = sorted({(self.first_expert + local, shard) for local in range(self.num_local_experts)
                          for shard in self.expected_shards} - self._loaded_shards)
        if missing:
            shown = ", ".join(f"expert {expert} {shard}" for expert, shard in missing[:6])
            raise ValueError(f"the checkpoint lacks {len(missing)} expert tensors of a MoE layer: {shown}"
                             f"{', ...' if len(missing) > 6 else ''}.")
        if self.quant_method is not None:  # quantized experts are dequantized per call: no panels
            self.packed = None
            self.quant_method.process_weights_after_loading(self)
            return
        # Experts with biases run the PyTorch reference (`FusedMoE`): nothing reads panels.
        self.packed = cpu_fused_moe.pack_experts(self.w13_weight, self.w2_weight) if self.w13_bias is None else None
