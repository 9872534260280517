"""`Int4MoEMethod`: a MoE layer's experts held as GPTQ or AWQ packed integers (vLLM's
GPTQMarlinMoEMethod / AWQMarlinMoEMethod / MoeWNA16Method read the same checkpoints).

`create_weights` replaces `FusedMoEWeights`' w13_weight [E, 2I, H] and w2_weight [E, H, I]
by each format's tensors stacked over the local experts, named as vLLM names them
(checkpoint tensors `experts.N.<proj>.<kind>` load into `w13_<kind>` / `w2_<kind>`, see
`models/sparse_moe_block.py`; layouts in `kernels/int4_fused_moe.py`):

| tensor | GPTQ | AWQ |
|---|---|---|
| w13_qweight | [E, H / pack, 2I] | [E, H, 2I / 8] |
| w13_qzeros, w13_scales | [E, groups(H), 2I / pack], [E, groups(H), 2I] | same |
| w13_g_idx | [E, H] | - |
| w2_qweight | [E, I / pack, H] | [E, I, H / 8] |
| w2_qzeros, w2_scales | [E, groups(I), H / pack], [E, groups(I), H] | same |
| w2_g_idx | [E, I] | - |

Cut as the unquantized experts are: under tensor parallelism each rank holds its share
I_local of every expert's intermediate features, gate's and up's output columns (whole
int32s of packed codes: I_local a multiple of the pack factor) and down's input rows (whole
groups, as vLLM requires; its share of scales and zeros are those groups, except under
desc_act, where a rank's rows refer to any group and they stay whole, as in the dense
layers, and with group_size -1: one group); under
expert parallelism whole experts. Gate and up share their input, so they must share one act
order (`g_idx`), as the dense fused gate_up does.

compressed-tensors' `pack-quantized` experts (W4A16 / W8A16) are held as GPTQ's, under their
checkpoint names (`w13_weight_packed`, `w13_weight_zero_point`, `w13_weight_scale`,
`w13_weight_g_idx`, and w2's): each loader first turns the expert's checkpoint tensor into
GPTQ's layout (`compressed_tensors_*_to_gptq`, scales transposed), then checks and cuts it as
GPTQ's; symmetric ones hold a constant zero buffer (2^(bits - 1)), and g_idx exists under
actorder "group" only.

Scales are held in float32 (fp16 and bf16 checkpoint scales fit without rounding). Every
tensor is checked as it loads (dtype, shape) and the scales and g_idx after loading, each
error naming the layer, the expert and the projection. The computation is
`DequantizedMoEMethod.apply`.
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.kernels.int4_fused_moe import dequantize_int4_experts
from raylm.kernels.int4_linear import (compressed_tensors_packed_to_gptq, compressed_tensors_zero_point_to_gptq,
                                      pack_columns, pack_factor)
from raylm.parallel.checkpoint_slice import CheckpointSlice, read_weight
from raylm.parallel.dequantized_moe_method import DequantizedMoEMethod
from raylm.parallel.fused_moe_weights import FusedMoEWeights
from raylm.parallel.int4_linear_method import Int4LinearScheme, check_int4_dtype

# Each GPTQ tensor kind's name in a compressed-tensors checkpoint (and on the layer).
_COMPRESSED_TENSORS_NAMES = {"qweight": "weight_packed", "qzeros": "weight_zero_point", "scales": "weight_scale",
                             "g_idx": "weight_g_idx"}
_PROJECTION_NAMES = {"w1": "gate_proj (w1)", "w3": "up_proj (w3)", "w2": "down_proj (w2)"}


class Int4MoEMethod(DequantizedMoEMethod):
    """Creates, loads, processes and dequantizes one MoE layer's GPTQ or AWQ experts."""

    def __init__(self, scheme: Int4LinearScheme) -> None:
        self.scheme = scheme

    @property
    def awq(self) -> bool:
        return self.scheme.method == "awq"

    @property
    def compressed(self) -> bool:
        return self.scheme.method == "compressed-tensors"

    def name(self, kind: str) -> str:
        """The layer's (and checkpoint's) name of GPTQ tensor kind `kind`."""
        return _COMPRESSED_TENSORS_NAMES[kind] if self.compressed else kind

    @property
    def scale_shards(self) -> tuple[str, ...]:
        """The (expert, shard) entries every local expert's checkpoint must fill besides its
        qweight (`FusedMoEWeights.expected_shards`): g_idx only where desc_act reads it,
        zeros only where the checkpoint stores them. Named as the checkpoint names them (a
        missing compressed-tensors zero point is `w2_weight_zero_point`, not `w2_qzeros`)."""
        kinds = (("qzeros",) if self.scheme.has_zero_point else ()) + ("scales",)
        kinds += ("g_idx",) if self.scheme.desc_act else ()
        return tuple(f"{shard}_{self.name(kind)}" for kind in kinds for shard in ("w1", "w2", "w3"))

    # ------------------------------------------------------------ shapes
    def _group_size(self, in_features: int) -> int:
        return in_features if self.scheme.group_size == -1 else self.scheme.group_size

    def _w2_scales_whole(self, layer: FusedMoEWeights) -> bool:
        """Whether every rank holds all of down's groups (desc_act or one group under tensor
        parallelism), not only those of its input rows."""
        return layer.moe_tp_size == 1 or self.scheme.group_size == -1 or self.scheme.desc_act

    def _shapes(self, layer: FusedMoEWeights, shard: str, local: bool) -> dict[str, tuple[int, ...]]:
        """One expert projection's tensors: this rank's shapes (`local`, w1 and w3 each) or the
        checkpoint's full ones."""
        factor, hidden = pack_factor(self.scheme.bits), layer.hidden_size
        size = layer.intermediate_size_per_partition if local else layer.intermediate_size
        if shard == "w2":
            in_features, out_features = size, hidden
            grouped = layer.intermediate_size if not local or self._w2_scales_whole(layer) else size
            groups = -(-grouped // self._group_size(layer.intermediate_size))
        else:
            in_features, out_features = hidden, size
            groups = -(-hidden // self._group_size(hidden))
        shapes = {"qweight": (in_features, out_features // factor) if self.awq else (in_features // factor,
                                                                                     out_features),
                  "qzeros": (groups, out_features // factor), "scales": (groups, out_features)}
        if not self.awq and (self.scheme.desc_act or not self.compressed):
            shapes["g_idx"] = (in_features,)
        return shapes

    def create_weights(self, layer: FusedMoEWeights, prefix: str) -> None:
        """Packed parameters in place of `layer`'s (not yet loaded) weights; `prefix` (the
        layer's module name) names it in errors."""
        _check_shapes(layer, prefix, self.scheme)
        experts, device = layer.num_local_experts, layer.w13_weight.device
        for projection, shard in (("w13", "w1"), ("w2", "w2")):
            for kind, shape in self._shapes(layer, shard, local=True).items():
                if projection == "w13" and kind != "g_idx":  # gate's outputs, then up's
                    shape = shape[:-1] + (2 * shape[-1],)
                name = f"{projection}_{self.name(kind)}"
                if kind == "qzeros" and not self.scheme.has_zero_point:
                    # compressed-tensors' symmetric codes: their zero is the offset they are stored with
                    offset = torch.full((experts * shape[0], shape[1] * pack_factor(self.scheme.bits)),
                                        1 << (self.scheme.bits - 1), dtype=torch.int32, device=device)
                    layer.register_buffer(name, pack_columns(offset, self.scheme.bits).reshape(experts, *shape),
                                          persistent=False)
                    continue
                if kind == "scales":
                    data = torch.empty(experts, *shape, dtype=torch.float32, device=device)
                elif kind == "g_idx":
                    data = torch.full((experts, *shape), -1, dtype=torch.int32, device=device)
                else:
                    data = torch.empty(experts, *shape, dtype=torch.int32, device=device)
                param = nn.Parameter(data, requires_grad=False)
                param.weight_loader = self._loader(layer, prefix, kind)
                setattr(layer, name, param)
        # The 16/32-bit weights are never filled: dropped, their shapes kept (meta tensors hold
        # no memory).
        for name in ("w13_weight", "w2_weight"):
            shape = getattr(layer, name).shape
            del layer._parameters[name]
            setattr(layer, name, torch.empty(shape, device="meta"))
        layer.w13_g_idx_runtime = layer.w2_g_idx_runtime = None
        layer.quant_prefix = prefix
        layer.quant_method = self

    def process_weights_after_loading(self, layer: FusedMoEWeights) -> None:
        """Checks the scales (finite: a NaN or an infinity would make the expert's output
        garbage without a word) and, under desc_act, that every g_idx names a group; without
        desc_act g_idx is not read (groups are runs of group_size rows, as vLLM reads them)."""
        for projection in ("w13", "w2"):
            scales = getattr(layer, f"{projection}_{self.name('scales')}").detach()
            _check_finite(layer, projection, scales)
            runtime = None
            if self.scheme.desc_act:
                runtime = getattr(layer, f"{projection}_{self.name('g_idx')}").detach()
                _check_g_idx(layer, projection, runtime, scales.shape[1])
            setattr(layer, f"{projection}_g_idx_runtime", runtime)
        self.reset_chunks(layer)

    def dequantize_chunk(self, layer: FusedMoEWeights, experts: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        scheme = self.scheme
        chunk = []
        for projection, in_features in (("w13", layer.hidden_size), ("w2", layer.intermediate_size_per_partition)):
            # Runs of group_size rows in order (one run with group_size -1), unless act order.
            group_size = None if scheme.desc_act else in_features if scheme.group_size == -1 else scheme.group_size
            chunk.append(dequantize_int4_experts(
                *(getattr(layer, f"{projection}_{self.name(kind)}") for kind in ("qweight", "qzeros", "scales")),
                getattr(layer, f"{projection}_g_idx_runtime"), experts,
                scheme.bits, self.awq, scheme.zero_offset, dtype, group_size))
        return chunk[0], chunk[1]

    # ------------------------------------------------------------ loading
    def _loader(self, layer: FusedMoEWeights, prefix: str, kind: str):
        """A loader of one expert's checkpoint tensor `kind` of projection w1, w2 or w3: checks
        its dtype and full shape, cuts this rank's share, and copies it into the expert's
        gate or up half (w13) or whole (w2)."""
        factor = pack_factor(self.scheme.bits)

        def load(param: nn.Parameter, loaded_weight, shard_id: tuple[int, str]) -> None:
            expert_id, shard = shard_id
            local = layer.local_expert(expert_id, shard)
            where = f"{prefix} expert {expert_id} {_PROJECTION_NAMES[shard]} {self.name(kind)}"
            check_int4_dtype(where, kind, loaded_weight)
            if self.compressed:  # into GPTQ's layout, whole (then checked and cut as GPTQ's)
                loaded_weight = _compressed_tensors_to_gptq(read_weight(loaded_weight), kind, self.scheme.bits)
            full = self._shapes(layer, shard, local=False)[kind]
            if tuple(loaded_weight.shape) != full:
                raise ValueError(f"{where} has shape {tuple(loaded_weight.shape)}; the model's "
                                 f"{self.scheme.method} {self.scheme.bits}-bit layout (group_size "
                                 f"{self.scheme.group_size}) expects {full}.")
            if local is None:
                return  # another rank's expert: not read
            piece = self._cut(layer, loaded_weight, shard, kind, factor)
            value = read_weight(piece)
            target = param.data[local]
            if shard != "w2" and kind != "g_idx":  # gate's output columns, then up's
                half = target.shape[-1] // 2
                target = target.narrow(-1, 0 if shard == "w1" else half, half)
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(f"{where}: this rank's share has shape {tuple(value.shape)}, the model expects "
                                 f"{tuple(target.shape)}.")
            if kind == "g_idx" and shard != "w2":
                value = value.to(torch.int32)
                if bool((target >= 0).any()) and not torch.equal(target, value.to(target.device)):
                    raise ValueError(f"{prefix} expert {expert_id}: gate_proj and up_proj have different g_idx in "
                                     f"the checkpoint; raylm fuses them into w13, which takes one act order for "
                                     f"their shared input.")
            target.copy_(value)
            layer._loaded_shards.add((expert_id, shard if kind == "qweight" else f"{shard}_{self.name(kind)}"))
        return load

    def _cut(self, layer: FusedMoEWeights, loaded, shard: str, kind: str, factor: int):
        """This rank's share of one expert's full checkpoint tensor (whole without tensor parallelism)."""
        if layer.moe_tp_size == 1:
            return loaded
        size, rank = layer.intermediate_size_per_partition, layer.moe_tp_rank
        if shard != "w2":  # column parallel: output columns, packed ones in whole int32s
            if kind == "g_idx":
                return loaded
            unit = factor if kind == "qzeros" or (kind == "qweight" and self.awq) else 1
            return loaded.narrow(loaded.dim() - 1, rank * size // unit, size // unit)
        # row parallel: input rows (packed in whole int32s for GPTQ's qweight), whole groups
        if kind in ("qzeros", "scales"):
            if self._w2_scales_whole(layer):
                return loaded
            group = self._group_size(layer.intermediate_size)
            return loaded.narrow(0, rank * size // group, size // group)
        unit = factor if kind == "qweight" and not self.awq else 1
        return loaded.narrow(0, rank * size // unit, size // unit)


def check_expert_weight_shape(layer: nn.Module, name: str, expert_id: int, shard: str, loaded) -> None:
    """compressed-tensors' `weight_shape` [out, in] of expert `expert_id`'s projection `shard`
    (checkpoint tensor `name`), checked against the layer: nothing reads it (weight_packed's
    checked shape says the same), but one of another shape, or of an expert the layer has not,
    says the checkpoint is not the model's and must not pass without a word."""
    method = getattr(layer, "quant_method", None)
    if not isinstance(method, Int4MoEMethod) or not method.compressed:
        raise ValueError(f"checkpoint tensor {name!r} is a compressed-tensors weight_shape, but the model reads "
                         f"that MoE layer's experts as {'unquantized' if method is None else 'another format'}.")
    layer.local_expert(expert_id, shard)  # an expert id the layer has not is an error
    check_int4_dtype(name, "weight_shape", loaded)
    loaded = read_weight(loaded)
    expected = [layer.hidden_size, layer.intermediate_size]
    expected = expected if shard == "w2" else expected[::-1]
    if loaded.dim() != 1 or loaded.tolist() != expected:
        raise ValueError(f"{name} is {loaded.tolist()} (shape {tuple(loaded.shape)}); expert {expert_id} "
                         f"{_PROJECTION_NAMES[shard]} is [out, in] = {expected}, a 1-D tensor of those two integers.")


def _compressed_tensors_to_gptq(loaded: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    if kind == "qweight":
        return compressed_tensors_packed_to_gptq(loaded, bits)
    if kind == "qzeros":
        return compressed_tensors_zero_point_to_gptq(loaded, bits)
    return loaded.t() if kind == "scales" else loaded


def _expert_and_projection(layer: FusedMoEWeights, projection: str, local: int, column: int) -> str:
    expert = layer.first_expert + local
    if projection == "w2":
        return f"expert {expert} down_proj (w2)"
    half = layer.intermediate_size_per_partition
    return f"expert {expert} {'gate_proj (w1)' if column < half else 'up_proj (w3)'}"


def _check_finite(layer: FusedMoEWeights, projection: str, scales: torch.Tensor) -> None:
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        local, group, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{layer.quant_prefix} {_expert_and_projection(layer, projection, local, column)} scales "
                         f"hold {scales[local, group, column].item()} at group {group}: GPTQ/AWQ scales must be "
                         f"finite.")


def _check_g_idx(layer: FusedMoEWeights, projection: str, g_idx: torch.Tensor, groups: int) -> None:
    bad = (g_idx < 0) | (g_idx >= groups)
    if bool(bad.any()):
        local, row = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{layer.quant_prefix} {_expert_and_projection(layer, projection, local, 0)} g_idx holds "
                         f"{int(g_idx[local, row])} at row {row}: each input row's group must be in [0, {groups}), "
                         f"the groups of its scales.")


def _check_shapes(layer: FusedMoEWeights, prefix: str, scheme: Int4LinearScheme) -> None:
    """Every rank's gate/up outputs pack whole int32s, GPTQ's inputs too, the group size
    divides each input, and a tensor-parallel rank's share of down's inputs is whole groups
    (vLLM's rule)."""
    factor, size = pack_factor(scheme.bits), layer.intermediate_size_per_partition
    where = (f"{prefix} (hidden_size {layer.hidden_size}, {size} intermediate features on each of "
             f"{layer.moe_tp_size} tensor-parallel ranks)")
    if size % factor or layer.hidden_size % factor:
        raise ValueError(f"{where}: {scheme.method} {scheme.bits}-bit experts pack {factor} features an int32, so the "
                         f"hidden size and each rank's intermediate features must be multiples of {factor}.")
    for name, in_features in (("hidden_size", layer.hidden_size), ("moe intermediate size", layer.intermediate_size)):
        if scheme.group_size != -1 and in_features % scheme.group_size:
            raise ValueError(f"{where}: the {name} {in_features} is not a multiple of the checkpoint's group_size "
                             f"{scheme.group_size}.")
    if layer.moe_tp_size > 1 and scheme.group_size != -1 and size % scheme.group_size:
        raise ValueError(f"{where}: tensor_parallel_size {layer.moe_tp_size} cuts down_proj's "
                         f"{layer.intermediate_size} input features into {size} a rank, not whole groups of the "
                         f"checkpoint's group_size {scheme.group_size} (as in vLLM); use a smaller "
                         f"tensor_parallel_size or enable_expert_parallel.")
