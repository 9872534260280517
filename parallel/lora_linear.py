"""Linear layers with LoRA adapter slots, sharded like the layer they wrap (vLLM's
`*WithLoRA` layers).

A wrapper holds its base layer (whose weights and kernels are unchanged) and the stacked
weights of `max_loras` adapter slots (layout in `raylm.kernels.lora_ops`). Its output is the
base layer's plus, for each token that runs under an adapter, that adapter's
`scaling * (x A^T) B^T`. The base output comes from the base layer's own linear method, so a
quantized base (FP8, GPTQ, AWQ: its `quant_method`) runs its quantized GEMM and the adapter's
term is added in the model's 16/32-bit dtype, as vLLM serves LoRA over quantized models.

Sharding follows the base layer, so each rank holds only its share:
- column parallel (qkv_proj, gate_up_proj): the input is whole on every rank, so A is whole
  too (it is small: rank x in); B is split by output features exactly as the base weight is
  (by heads for q/k/v, KV heads replicated where ranks outnumber them), which the base
  layer's own `weight_loader` cuts. An adapter of the whole fused projection (Phi-3's
  checkpoints and adapters name qkv_proj, gate_up_proj) gives every slice the same A and
  is cut as the fused weight is;
- row parallel (o_proj, down_proj): the input is split, so A is split by input features
  (again by the base `weight_loader`) and B is whole. Each rank adds the expand of its
  partial shrink to its partial output before the base layer's all-reduce, which sums them:
  sum_r (x_r A_r^T) B^T = (x A^T) B^T, so no collective of its own is needed.

The model keeps calling the layer as before; the per-step `LoRABatch` says which slot each
row runs under. A wrapper also answers for its base layer's attributes that other code reads
(`weight`, `bias`, the packed CPU weights), so that the fused CPU decode op and the MLP see
the base weights on steps without adapters.
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.kernels.lora_ops import LoRABatch, add_lora
from raylm.parallel.communication import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from raylm.parallel.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear)

# A slice id of the layer: "q"/"k"/"v" for QKV, 0/1 for merged projections, None for one.
SliceId = str | int | None


class BaseLinearWithLoRA(nn.Module):
    """The part shared by column- and row-parallel LoRA layers: slot storage and the LoRA term."""

    def __init__(self, base_layer: LinearBase, batch: LoRABatch, slice_ids: list[SliceId],
                 in_features: int, out_sizes: list[int]) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_batch = batch
        self.slice_ids = slice_ids
        self.lora_in_features = in_features
        self.output_offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        slots, rank = batch.max_loras, batch.max_rank
        # A quantized base (FP8, GPTQ, AWQ) holds its weight in 8 bits or packed integers (a
        # meta-tensor placeholder): the adapter's term is computed in the model's dtype, as
        # vLLM computes it over quantized bases (QLoRA-style serving).
        plain = base_layer.quant_method is None
        dtype = base_layer.weight.dtype if plain else batch.dtype
        device = base_layer.weight.device if plain else batch.device
        # Not parameters: the model's state_dict and checkpoint loading never see them.
        self.lora_a = torch.zeros(in_features, len(slice_ids) * slots * rank, dtype=dtype, device=device)
        self.lora_b = [torch.zeros(slots * rank, size, dtype=dtype, device=device) for size in out_sizes]
        # Set for the last layer's projections after attention, which models run on the
        # step's output rows alone (ForwardContext.output_rows).
        self.runs_on_output_rows = False
        # Which rows of the step the next call covers (see `_add_lora`).
        self._row_version = -1
        self._next_row = 0

    # ---- what the rest of the model reads of the base layer -------------------------------------
    @property
    def weight(self) -> nn.Parameter:
        return self.base_layer.weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.base_layer.bias

    @property
    def packed_weight(self) -> torch.Tensor | None:
        return self.base_layer.packed_weight

    @property
    def decode_weight(self):
        return self.base_layer.decode_weight

    @property
    def quant_method(self):
        """The base layer's quantized method (None for 16/32-bit weights): `forward` runs the
        base's own GEMM through it, and the fused CPU decode op, which multiplies plain
        weights only, leaves layers that have one to their modules."""
        return self.base_layer.quant_method

    @property
    def tp_size(self) -> int:
        return self.base_layer.tp_size

    @property
    def tp_rank(self) -> int:
        return self.base_layer.tp_rank

    # ---- slots ---------------------------------------------------------------------------------
    def shard_adapter(self, a_full: dict[SliceId, torch.Tensor], b_full: dict[SliceId, torch.Tensor],
                      scaling: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's share of one adapter's weights for this layer, from the full PEFT
        tensors of the slices it adapts (A [r, in], B [out, r]): (A [n, r, in here],
        [B_i [out_i here, r]]), B scaled, in the layer's dtype, on the CPU. Slices the adapter
        leaves alone are zeros."""
        raise NotImplementedError

    def set_slot(self, slot: int, a: torch.Tensor | None, b: list[torch.Tensor] | None) -> None:
        """Copies an adapter's share (from `shard_adapter`) into slot `slot`; None empties it."""
        slots, rank = self.lora_batch.max_loras, self.lora_batch.max_rank
        a_slots = self.lora_a.view(self.lora_in_features, len(self.slice_ids), slots, rank)[:, :, slot]
        a_slots.zero_()
        if a is not None:
            a_slots[:, :, :a.shape[1]].copy_(a.permute(2, 0, 1))
        for index, stacked in enumerate(self.lora_b):
            b_slot = stacked.view(slots, rank, stacked.shape[1])[slot]
            b_slot.zero_()
            if b is not None:
                b_slot[:b[index].shape[1]].copy_(b[index].t())

    def _add_lora(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Adds the LoRA term of the step's adapter rows to `out`, the base output of `x`.

        Rows map to the step's tokens (to its output rows, for `runs_on_output_rows`) by
        position: a call covers the rows after those of this layer's previous call in the
        same step (a model that runs its MLP in row chunks calls it once per chunk, in order),
        starting over at each step and after the last row."""
        batch = self.lora_batch
        if not batch.active:
            return
        if self._row_version != batch.version:
            self._row_version, self._next_row = batch.version, 0
        num_rows = batch.slots_of_rows(self.runs_on_output_rows).shape[0]
        start, rows = self._next_row, x.shape[0]
        if start + rows > num_rows:
            raise RuntimeError(f"a LoRA layer got rows {start}..{start + rows} of a step of {num_rows} rows: LoRA "
                               f"layers need each layer to run on all of the step's rows (its output rows, after the "
                               f"last layer's attention), in order.")
        self._next_row = (start + rows) % num_rows
        add_lora(out, x, self.lora_a, self.lora_b, self.output_offsets, batch, start, self.runs_on_output_rows)


class ColumnParallelLinearWithLoRA(BaseLinearWithLoRA):
    """LoRA over a ColumnParallelLinear, a MergedColumnParallelLinear (gate_up_proj: slices
    0 and 1) or a QKVParallelLinear (slices q, k, v)."""

    def __init__(self, base_layer: ColumnParallelLinear, batch: LoRABatch) -> None:
        if isinstance(base_layer, QKVParallelLinear):
            q_size = base_layer.num_heads * base_layer.head_size
            kv_size = base_layer.num_kv_heads * base_layer.head_size
            slice_ids: list[SliceId] = ["q", "k", "v"]
            out_sizes = [q_size, kv_size, kv_size]
        elif isinstance(base_layer, MergedColumnParallelLinear):
            slice_ids = list(range(len(base_layer.output_sizes)))
            out_sizes = [size // base_layer.tp_size for size in base_layer.output_sizes]
            if base_layer.silu_and_mul_weight is not None:
                # The LoRA term must be added before the activation, so the kernel that applies
                # SiLU-and-mul as it stores cannot serve adapter steps: packed for it, the layer
                # has no streaming copy and its adapter steps fell back to oneDNN (1.8 against
                # 1.0 ms a call in the 5M Llama's decode). Repack it as a plain projection.
                base_layer.silu_and_mul_follows = False
                base_layer.process_weights_after_loading()
        else:
            slice_ids = [None]
            out_sizes = [base_layer.output_size_per_partition]
        super().__init__(base_layer, batch, slice_ids, base_layer.input_size, out_sizes)

    @property
    def output_size_per_partition(self) -> int:
        return self.base_layer.output_size_per_partition

    @property
    def silu_and_mul_weight(self):
        return getattr(self.base_layer, "silu_and_mul_weight", None)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """The base layer's fused gate_up + SiLU-and-mul kernel, on steps without adapters
        only (it has no LoRA term); None otherwise, and the caller runs `forward`."""
        if self.lora_batch.active or not hasattr(self.base_layer, "silu_and_mul"):
            return None
        return self.base_layer.silu_and_mul(x)

    def shard_adapter(self, a_full: dict[SliceId, torch.Tensor], b_full: dict[SliceId, torch.Tensor],
                      scaling: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        rank = next(iter(a_full.values())).shape[0]
        dtype = self.lora_a.dtype
        a = torch.zeros(len(self.slice_ids), rank, self.lora_in_features, dtype=dtype)
        b = torch.zeros(self.base_layer.output_size_per_partition, rank, dtype=torch.float32)
        if None in a_full and self.slice_ids != [None]:
            # One adapter over the whole fused projection (Phi-3's qkv_proj, gate_up_proj):
            # (x A^T) B^T with B the slices' B stacked, so every slice shares A, and B is cut
            # as the loader cuts the fused checkpoint weight (shard_id None).
            a.copy_(a_full[None].expand_as(a))
            self.base_layer.weight_loader(b, b_full[None].float(), None)
        for index, slice_id in enumerate(self.slice_ids):
            if slice_id not in a_full or (slice_id is None and len(self.slice_ids) > 1):
                continue
            a[index].copy_(a_full[slice_id])
            # The base layer's loader cuts this rank's rows of B as it cuts the weight's.
            self.base_layer.weight_loader(b, b_full[slice_id].float(), slice_id)
        b = (b * scaling).to(dtype)
        sizes = [stacked.shape[1] for stacked in self.lora_b]
        return a, [b.narrow(0, offset, size).clone() for offset, size in zip(self.output_offsets, sizes)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        out = base._linear(x, base.bias)
        self._add_lora(out, x)
        return tensor_model_parallel_all_gather(out) if base.gather_output else out


class RowParallelLinearWithLoRA(BaseLinearWithLoRA):
    """LoRA over a RowParallelLinear (o_proj, down_proj): A split by input features, B whole."""

    def __init__(self, base_layer: RowParallelLinear, batch: LoRABatch) -> None:
        super().__init__(base_layer, batch, [None], base_layer.input_size_per_partition, [base_layer.output_size])

    @property
    def input_size_per_partition(self) -> int:
        return self.base_layer.input_size_per_partition

    def shard_adapter(self, a_full: dict[SliceId, torch.Tensor], b_full: dict[SliceId, torch.Tensor],
                      scaling: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        full_a = a_full[None]
        a = torch.zeros(full_a.shape[0], self.lora_in_features, dtype=self.lora_a.dtype)
        self.base_layer.weight_loader(a, full_a)  # this rank's input features, as the weight's
        return a.unsqueeze(0), [(b_full[None].float() * scaling).to(self.lora_a.dtype)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if not base.input_is_parallel and base.tp_size > 1:
            x = x.narrow(-1, base.tp_rank * base.input_size_per_partition, base.input_size_per_partition)
        out = base._linear(x, base.bias if base.tp_rank == 0 else None)
        self._add_lora(out, x)
        return tensor_model_parallel_all_reduce(out) if base.reduce_results else out


def wrap_with_lora(layer: nn.Module, batch: LoRABatch) -> BaseLinearWithLoRA | None:
    """The LoRA layer over `layer`, or None for a layer type without one."""
    if isinstance(layer, ColumnParallelLinear):
        return ColumnParallelLinearWithLoRA(layer, batch)
    if isinstance(layer, RowParallelLinear):
        return RowParallelLinearWithLoRA(layer, batch)
    return None
