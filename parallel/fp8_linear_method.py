"""`Fp8LinearMethod`: a parallel linear layer whose weight is FP8 (vLLM's quant_method).

`create_weights` replaces a layer's weight parameter by one of float8_e4m3fn and adds its
scale parameters, each with a `weight_loader` that cuts this rank's shard as the weight's
does (`ColumnParallelLinear.load_rows`, `RowParallelLinear.load_columns`):

- per-tensor `weight_scale`: one value per fused output (q, k, v; gate, up), kept apart
  rather than requantizing the shards to their largest scale as vLLM's per-tensor kernels
  do: nothing is rounded twice, and after loading the values spread over their rows
  (`process_weights_after_loading`), unless they are all equal;
- per-channel `weight_scale` `[out, 1]`: rows sharded with the weight's rows on column-parallel
  layers, whole on row-parallel ones (their output is not split);
- block-wise `weight_scale_inv` (or compressed-tensors' `weight_scale`) `[ceil(out / bn),
  ceil(in / bk)]`: block rows sharded on column-parallel layers, block columns on
  row-parallel ones, so every rank's shard must be whole blocks;
- a static `input_scale` per fused output, of which the largest is taken (as vLLM does).

`online` (`quantization="fp8"` over a 16/32-bit checkpoint): each checkpoint tensor is
quantized as it is loaded, one scale per tensor (amax / 448), so fused layers get one per
shard; the model never holds its 16-bit weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raylm.kernels.fp8_linear import FP8_DTYPE, apply_fp8_linear, quantize_per_tensor
from raylm.parallel.checkpoint_slice import CheckpointSlice, read_weight
from raylm.parallel.linear import (ColumnParallelLinear, LinearBase, ReplicatedLinear, RowParallelLinear,
                                   _copy_checked)

WEIGHT_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8LinearScheme:
    """How a checkpoint stores its FP8 linear weights (parsed by `models/quantization.py`)."""

    # False: a 16/32-bit checkpoint quantized at load (online, per tensor).
    checkpoint_is_fp8: bool
    weight_strategy: str  # one of WEIGHT_STRATEGIES
    block_size: tuple[int, int] | None = None  # (rows, columns) for "block"
    # "dynamic" (per token), "static" (the checkpoint's input_scale) or None (weight only:
    # the GEMM always dequantizes, W8A16).
    activation_scheme: str | None = "dynamic"
    # The checkpoint's name of the weight scale ("weight_scale_inv": quant_method "fp8" blocks).
    scale_name: str = "weight_scale"


class Fp8LinearMethod:
    """Creates, loads, processes and multiplies one layer's FP8 weight."""

    def __init__(self, scheme: Fp8LinearScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: LinearBase, prefix: str) -> None:
        """Replaces `layer.weight` (not yet loaded) by an FP8 parameter and adds the scales.
        `prefix` (the layer's module name) names it in errors."""
        scheme = self.scheme
        out_rows, in_columns = layer.weight.shape
        device = layer.weight.device
        num_shards = len(layer.output_sizes) if isinstance(layer, ColumnParallelLinear) else 1
        weight_loader = (self._online_weight_loader(layer) if not scheme.checkpoint_is_fp8
                         else self._fp8_weight_loader(layer, prefix))
        layer.weight = _parameter(torch.empty(out_rows, in_columns, dtype=FP8_DTYPE, device=device), weight_loader)
        if scheme.weight_strategy == "tensor":
            scale = torch.ones(num_shards, dtype=torch.float32, device=device)
            if scheme.checkpoint_is_fp8:
                setattr(layer, scheme.scale_name, _parameter(scale, self._per_shard_loader(layer)))
            else:  # filled by the weight's loader, named by no checkpoint tensor
                layer.register_buffer(scheme.scale_name, scale, persistent=False)
        elif scheme.weight_strategy == "channel":
            setattr(layer, scheme.scale_name, _parameter(torch.ones(out_rows, 1, dtype=torch.float32, device=device),
                                                         self._sharded_loader(layer, 1, 1)))
        else:
            block_rows, block_columns = scheme.block_size
            _check_whole_blocks(layer, prefix, scheme.block_size)
            shape = (-(-out_rows // block_rows), -(-in_columns // block_columns))
            setattr(layer, scheme.scale_name, _parameter(torch.ones(shape, dtype=torch.float32, device=device),
                                                         self._sharded_loader(layer, block_rows, block_columns)))
        if scheme.activation_scheme == "static":
            layer.input_scale = _parameter(torch.ones(num_shards, dtype=torch.float32, device=device),
                                           self._per_shard_loader(layer))
        layer.weight_scale_runtime = None
        layer.input_scale_runtime = None
        layer.quant_prefix = prefix  # names the layer in errors found after loading
        layer.quant_method = self

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """The scales as the GEMM takes them: one number, one per row, or the block grid."""
        scheme = self.scheme
        scale = getattr(layer, scheme.scale_name).detach().float()
        # A NaN, infinite or negative scale (a corrupt checkpoint, or NaN in a 16/32-bit
        # weight quantized online) would make every output of the layer garbage, silently:
        # refuse it while loading. A weight scale of 0 is a block (tensor) of zeros; an
        # input scale divides the activations and must be positive.
        _check_scale_values(layer, scheme.scale_name, scale, allow_zero=True)
        if scheme.activation_scheme == "static":
            _check_scale_values(layer, "input_scale", layer.input_scale.detach().float(), allow_zero=False)
        if scheme.weight_strategy == "tensor":
            if bool((scale == scale[0]).all()):
                scale = scale[0].clone()
            else:
                sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
                scale = scale.repeat_interleave(sizes)
        elif scheme.weight_strategy == "channel":
            scale = scale.reshape(-1)
        layer.weight_scale_runtime = scale.contiguous()
        layer.input_scale_runtime = (layer.input_scale.detach().float().max()
                                     if scheme.activation_scheme == "static" else None)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_fp8_linear(x, layer.weight, layer.weight_scale_runtime, self.scheme.block_size,
                                layer.input_scale_runtime, bias, weight_only=self.scheme.activation_scheme is None)

    # ------------------------------------------------------------ loaders
    def _online_weight_loader(self, layer: LinearBase):
        def load(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
            # The whole checkpoint tensor's amax: every rank's shard gets the same scale.
            weight, scale = quantize_per_tensor(read_weight(loaded_weight).to(param.device))
            layer.weight_loader(param, weight, shard_id)
            _load_per_shard(layer, getattr(layer, self.scheme.scale_name), scale, shard_id)
        return load

    @staticmethod
    def _fp8_weight_loader(layer: LinearBase, prefix: str):
        """The layer's own loader, for float8_e4m3fn checkpoint tensors only: a copy casts
        by value, so bytes of another dtype (e5m2, a uint8 view) would load as garbage."""
        def load(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
            dtype = (loaded_weight.dtype_name if isinstance(loaded_weight, CheckpointSlice)
                     else str(loaded_weight.dtype).removeprefix("torch."))
            if dtype not in ("F8_E4M3", "float8_e4m3fn"):
                raise ValueError(f"the checkpoint's weight of {prefix}{'' if shard_id is None else f' ({shard_id})'} "
                                 f"is {dtype}; an FP8 checkpoint's quantized weights must be float8_e4m3fn "
                                 f"(F8_E4M3).")
            layer.weight_loader(param, loaded_weight, shard_id)
        return load

    @staticmethod
    def _per_shard_loader(layer: LinearBase):
        def load(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
            _load_per_shard(layer, param, read_weight(loaded_weight), shard_id)
        return load

    @staticmethod
    def _sharded_loader(layer: LinearBase, row_unit: int, column_unit: int):
        """A loader for a scale with one row per `row_unit` weight rows and one column per
        `column_unit` weight columns, sharded as the weight is."""
        def load(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
            if isinstance(layer, ColumnParallelLinear):
                layer.load_rows(param, loaded_weight, shard_id, row_unit)
            elif isinstance(layer, RowParallelLinear) and column_unit > 1:
                layer.load_columns(param, loaded_weight, column_unit)
            else:  # replicated, or a row-parallel layer's per-channel scales: whole
                _copy_checked(param.data, loaded_weight, f"{type(layer).__name__} scale")
        return load


def _parameter(data: torch.Tensor, weight_loader) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = weight_loader
    return param


def _load_per_shard(layer: LinearBase, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
    """One scale into the slot of its fused output (shard_id None: every slot)."""
    if loaded.numel() != 1:
        raise ValueError(f"a per-tensor scale of {type(layer).__name__} must hold one value, got shape "
                         f"{tuple(loaded.shape)}.")
    value = loaded.reshape(()).float()
    if shard_id is None:
        param.data.fill_(value)
    else:
        param.data[layer.shard_index(shard_id)] = value


def _check_scale_values(layer: LinearBase, name: str, scale: torch.Tensor, allow_zero: bool) -> None:
    bad = ~torch.isfinite(scale) | (scale < 0 if allow_zero else scale <= 0)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        allowed = "finite and >= 0" if allow_zero else "finite and > 0"
        raise ValueError(f"{getattr(layer, 'quant_prefix', type(layer).__name__)}.{name} holds "
                         f"{scale[index].item()} at index {list(index)}: FP8 scales must be {allowed}.")


def _check_whole_blocks(layer: LinearBase, prefix: str, block_size: tuple[int, int]) -> None:
    """Every block-scale row (column) must cover rows (columns) of one output shard of one
    rank: fused outputs and tensor-parallel shards must be whole blocks (as vLLM requires)."""
    block_rows, block_columns = block_size
    if isinstance(layer, ColumnParallelLinear):
        sizes = layer.output_partition_sizes
        if (len(sizes) > 1 or layer.tp_size > 1) and any(size % block_rows for size in sizes):
            raise ValueError(f"weight_block_size {list(block_size)} does not divide the output shards of {prefix} "
                             f"({sizes} rows on each of {layer.tp_size} tensor-parallel ranks): fused outputs and "
                             f"tensor-parallel shards must be whole blocks.")
    elif isinstance(layer, RowParallelLinear) and layer.tp_size > 1 and layer.input_size_per_partition % block_columns:
        raise ValueError(f"weight_block_size {list(block_size)} does not divide the input shard of {prefix} "
                         f"({layer.input_size_per_partition} columns on each of {layer.tp_size} tensor-parallel "
                         f"ranks): tensor-parallel shards must be whole blocks.")
    elif not isinstance(layer, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
        raise ValueError(f"{prefix} ({type(layer).__name__}) cannot hold block-wise FP8 weights.")
