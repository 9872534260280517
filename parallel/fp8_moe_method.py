"""`Fp8MoEMethod`: a MoE layer's experts held in FP8 (vLLM's Fp8MoEMethod and
CompressedTensorsW8A8Fp8MoEMethod), loaded from an FP8 checkpoint or quantized at load.

`create_weights` replaces `FusedMoEWeights`' w13_weight [E, 2I, H] and w2_weight [E, H, I]
by float8_e4m3fn parameters and adds their scales, named as vLLM names them (checkpoint
tensors `experts.N.<proj>.<kind>` load into `w13_<kind>` / `w2_<kind>`, see
`models/sparse_moe_block.py`), each cut as the weight it scales (every rank's share of an
expert's gate/up rows and down columns; whole experts under expert parallelism):

- per tensor, `weight_scale`: w13 [E, 2] (gate's, up's: kept apart, not requantized to
  their maximum as vLLM does, so nothing is rounded twice), w2 [E, 1];
- per channel (compressed-tensors), `weight_scale`: w13 [E, 2I, 1], w2 [E, H, 1] (whole:
  down's output is not split);
- block-wise, `weight_scale_inv` (compressed-tensors: `weight_scale`): w13 [E, 2I / bn,
  ceil(H / bk)], w2 [E, ceil(H / bn), ceil(I / bk)]; gate's and up's rows of each rank (and
  down's columns under tensor parallelism) must be whole blocks, as vLLM requires;
- static `input_scale`: w13 [E, 2], w2 [E, 1], read and checked only: the experts compute
  in the activations' dtype (W8A16), so no activation is quantized.

Online (`quantization="fp8"`): each expert's checkpoint tensor is quantized as it loads,
one scale per tensor (amax / 448), into per-tensor scale buffers.

Every scale is checked as it loads, so an error names the checkpoint tensor: weight scales
finite and >= 0, input scales finite and > 0. The computation is `DequantizedMoEMethod.apply` over
`kernels/fp8_fused_moe.py`'s dequantization.
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.kernels.fp8_fused_moe import dequantize_experts
from raylm.kernels.fp8_linear import FP8_DTYPE, quantize_per_tensor
from raylm.parallel.checkpoint_slice import CheckpointSlice, read_weight
from raylm.parallel.dequantized_moe_method import DequantizedMoEMethod
from raylm.parallel.fp8_linear_method import Fp8LinearScheme
from raylm.parallel.fused_moe_weights import FusedMoEWeights


class Fp8MoEMethod(DequantizedMoEMethod):
    """Creates, loads, processes and runs one MoE layer's FP8 experts."""

    def __init__(self, scheme: Fp8LinearScheme) -> None:
        self.scheme = scheme

    @property
    def scale_shards(self) -> tuple[str, ...]:
        """The (expert, shard) entries every local expert's checkpoint must fill besides its
        weights (`FusedMoEWeights.expected_shards`): none online."""
        if not self.scheme.checkpoint_is_fp8:
            return ()
        kinds = (self.scheme.scale_name,) + (("input_scale",) if self.scheme.activation_scheme == "static" else ())
        return tuple(f"{shard}_{kind}" for kind in kinds for shard in ("w1", "w2", "w3"))

    def create_weights(self, layer: FusedMoEWeights, prefix: str) -> None:
        """FP8 weights and scale parameters in place of `layer`'s (not yet loaded) weights;
        `prefix` (the layer's module name) names it in errors."""
        scheme = self.scheme
        experts, size, hidden = layer.num_local_experts, layer.intermediate_size_per_partition, layer.hidden_size
        device = layer.w13_weight.device
        weight_loader = self._online_weight_loader(layer, prefix) if not scheme.checkpoint_is_fp8 else \
            self._fp8_weight_loader(layer, prefix)
        layer.w13_weight = _parameter(torch.empty(experts, 2 * size, hidden, dtype=FP8_DTYPE, device=device),
                                      weight_loader)
        layer.w2_weight = _parameter(torch.empty(experts, hidden, size, dtype=FP8_DTYPE, device=device),
                                     weight_loader)
        if scheme.weight_strategy == "tensor":
            shapes = ((experts, 2), (experts, 1))
        elif scheme.weight_strategy == "channel":
            shapes = ((experts, 2 * size, 1), (experts, hidden, 1))
        else:
            block_rows, block_columns = scheme.block_size
            _check_whole_blocks(layer, prefix, scheme.block_size)
            shapes = ((experts, 2 * size // block_rows, -(-hidden // block_columns)),
                      (experts, -(-hidden // block_rows), -(-size // block_columns)))
        for projection, shape in zip(("w13", "w2"), shapes):
            scale = torch.ones(shape, dtype=torch.float32, device=device)
            name = f"{projection}_{scheme.scale_name}"
            if scheme.checkpoint_is_fp8:
                setattr(layer, name, _parameter(scale, self._scale_loader(layer, prefix, scheme.scale_name)))
            else:  # filled by the weight's loader, named by no checkpoint tensor
                layer.register_buffer(name, scale, persistent=False)
            if scheme.activation_scheme == "static":
                per_shard = torch.ones(experts, 2 if projection == "w13" else 1, dtype=torch.float32, device=device)
                setattr(layer, f"{projection}_input_scale",
                        _parameter(per_shard, self._scale_loader(layer, prefix, "input_scale")))
        layer.w13_scale_runtime = layer.w2_scale_runtime = None
        layer.quant_prefix = prefix
        layer.quant_method = self

    def process_weights_after_loading(self, layer: FusedMoEWeights) -> None:
        """The scales as `dequantize_experts` takes them: one per row ([E, rows]) or the
        block grid."""
        name = self.scheme.scale_name
        w13_scale = getattr(layer, f"w13_{name}").detach().float()
        w2_scale = getattr(layer, f"w2_{name}").detach().float()
        if self.scheme.weight_strategy == "tensor":  # gate's scale over gate's rows, up's over up's
            w13_scale = w13_scale.repeat_interleave(layer.intermediate_size_per_partition, dim=1)
            w2_scale = w2_scale.expand(-1, layer.hidden_size)
        elif self.scheme.weight_strategy == "channel":
            w13_scale, w2_scale = w13_scale.squeeze(-1), w2_scale.squeeze(-1)
        layer.w13_scale_runtime = w13_scale.contiguous()
        layer.w2_scale_runtime = w2_scale.contiguous()
        self.reset_chunks(layer)

    def dequantize_chunk(self, layer: FusedMoEWeights, experts: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        block_size = self.scheme.block_size
        return (dequantize_experts(layer.w13_weight, layer.w13_scale_runtime, block_size, experts, dtype),
                dequantize_experts(layer.w2_weight, layer.w2_scale_runtime, block_size, experts, dtype))

    # ------------------------------------------------------------ loaders
    def _online_weight_loader(self, layer: FusedMoEWeights, prefix: str):
        def load(param: nn.Parameter, loaded_weight, shard_id: tuple[int, str]) -> None:
            expert_id, shard = shard_id
            local = layer.local_expert(expert_id, shard)
            if local is None:
                return  # another rank's expert: not read, not quantized
            # The whole checkpoint tensor's amax: every rank's shard of it gets the same scale.
            weight, scale = quantize_per_tensor(read_weight(loaded_weight).to(param.device))
            _check_scale_values(f"{prefix} expert {expert_id} {shard} weight_scale (quantized online)", scale,
                                allow_zero=True)
            layer.weight_loader(param, weight, shard_id)
            scales = getattr(layer, f"{'w2' if shard == 'w2' else 'w13'}_{self.scheme.scale_name}")
            scales[local, 1 if shard == "w3" else 0] = scale
        return load

    @staticmethod
    def _fp8_weight_loader(layer: FusedMoEWeights, prefix: str):
        """The layer's own loader, for float8_e4m3fn checkpoint tensors only: a copy casts by
        value, so bytes of another dtype (e5m2, a uint8 view) would load as garbage."""
        def load(param: nn.Parameter, loaded_weight, shard_id: tuple[int, str]) -> None:
            dtype = (loaded_weight.dtype_name if isinstance(loaded_weight, CheckpointSlice)
                     else str(loaded_weight.dtype).removeprefix("torch."))
            if dtype not in ("F8_E4M3", "float8_e4m3fn"):
                raise ValueError(f"the checkpoint's weight of {prefix} expert {shard_id[0]} {shard_id[1]} is {dtype}; "
                                 f"an FP8 checkpoint's quantized expert weights must be float8_e4m3fn (F8_E4M3).")
            layer.weight_loader(param, loaded_weight, shard_id)
        return load

    def _scale_loader(self, layer: FusedMoEWeights, prefix: str, kind: str):
        """A loader of one expert's checkpoint scale `kind` (weight_scale, weight_scale_inv,
        input_scale) of projection w1, w2 or w3, cut as that projection's weight."""
        scheme = self.scheme

        def load(param: nn.Parameter, loaded_weight, shard_id: tuple[int, str]) -> None:
            expert_id, shard = shard_id
            local = layer.local_expert(expert_id, shard)
            if local is None:
                return
            where = f"{prefix} expert {expert_id} {shard} {kind}"
            if kind == "input_scale" or scheme.weight_strategy == "tensor":
                value = read_weight(loaded_weight)
                if value.numel() != 1:
                    raise ValueError(f"{where} must hold one value (a per-tensor scale), got shape "
                                     f"{tuple(value.shape)}.")
                _check_scale_values(where, value, allow_zero=kind != "input_scale")
                param.data[local, 1 if shard == "w3" else 0] = value.reshape(()).float()
            else:
                value = _cut_scale(layer, scheme, where, loaded_weight, shard)
                _check_scale_values(where, value, allow_zero=True)
                target = param.data[local]
                if shard != "w2":  # gate's rows, then up's
                    target = target.narrow(0, 0 if shard == "w1" else target.shape[0] // 2, target.shape[0] // 2)
                if target.shape != value.shape:
                    raise ValueError(f"{where} has this rank's shape {tuple(value.shape)}, the model expects "
                                     f"{tuple(target.shape)}.")
                target.copy_(value)
            layer._loaded_shards.add((expert_id, f"{shard}_{kind}"))
        return load


def _cut_scale(layer: FusedMoEWeights, scheme: Fp8LinearScheme, where: str, loaded_weight, shard: str
               ) -> torch.Tensor:
    """This rank's share of one expert's per-channel or block scale, read: gate's and up's rows
    (block rows) of this rank's intermediate features; down's channels whole, its block
    columns of this rank's intermediate features."""
    size, hidden, intermediate = layer.intermediate_size_per_partition, layer.hidden_size, layer.intermediate_size
    if scheme.weight_strategy == "channel":
        full = (hidden, 1) if shard == "w2" else (intermediate, 1)
    else:
        block_rows, block_columns = scheme.block_size
        full = ((-(-hidden // block_rows), -(-intermediate // block_columns)) if shard == "w2"
                else (-(-intermediate // block_rows), -(-hidden // block_columns)))
    if tuple(loaded_weight.shape) != full:
        raise ValueError(f"{where} has shape {tuple(loaded_weight.shape)}, the checkpoint layout "
                         f"({scheme.weight_strategy}) expects {full}.")
    if layer.moe_tp_size > 1 and not (scheme.weight_strategy == "channel" and shard == "w2"):
        # Whole blocks of this rank's features (`_check_whole_blocks`); channels: its rows.
        unit = 1 if scheme.weight_strategy == "channel" else block_columns if shard == "w2" else block_rows
        count = size // unit
        loaded_weight = loaded_weight.narrow(1 if shard == "w2" else 0, layer.moe_tp_rank * count, count)
    return read_weight(loaded_weight).float()


def _parameter(data: torch.Tensor, weight_loader) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = weight_loader
    return param


def _check_scale_values(where: str, scale: torch.Tensor, allow_zero: bool) -> None:
    scale = scale.float()
    bad = ~torch.isfinite(scale) | (scale < 0 if allow_zero else scale <= 0)
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]] if scale.dim() else []
        allowed = "finite and >= 0" if allow_zero else "finite and > 0"
        raise ValueError(f"{where} holds {scale[tuple(index)].item()} at index {index}: FP8 scales must be {allowed}.")


def _check_whole_blocks(layer: FusedMoEWeights, prefix: str, block_size: tuple[int, int]) -> None:
    """Gate's and up's rows of each rank must be whole blocks (they are fused into w13), and
    under tensor parallelism so must each rank's share of down's columns (vLLM's rule)."""
    block_rows, block_columns = block_size
    size = layer.intermediate_size_per_partition
    if size % block_rows or (layer.moe_tp_size > 1 and size % block_columns):
        raise ValueError(f"weight_block_size {list(block_size)} does not divide the experts' intermediate size of "
                         f"{prefix} ({size} features on each of {layer.moe_tp_size} tensor-parallel ranks): each "
                         f"rank's gate, up and down shards must be whole blocks.")
