"""Linear layers sharded across tensor-parallel ranks (vLLM's names and shard rules).

Column parallel: each rank holds a slice of the output features (rows of the weight);
row parallel: a slice of the input features (columns), with the partial products summed
by an all-reduce. Every parameter carries `weight_loader(param, loaded_weight,
shard_id=None)`, which takes the FULL Hugging Face tensor and copies out this rank's
shard, so the checkpoint loader never needs to know how a layer is split.
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.kernels import cpu_gemm
from raylm.parallel.checkpoint_slice import read_weight
from raylm.parallel.communication import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from raylm.parallel.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from raylm.parallel.utils import divide


def _new_parameter(*shape: int, dtype: torch.dtype | None, weight_loader) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by the checkpoint.
    param = nn.Parameter(torch.empty(*shape, dtype=dtype or torch.get_default_dtype()), requires_grad=False)
    param.weight_loader = weight_loader
    return param


def _copy_checked(param_slice: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param_slice.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}, "
                         f"the model expects {tuple(param_slice.shape)}.")
    param_slice.copy_(read_weight(loaded))


def _units(size: int, unit: int) -> int:
    """How many units of `unit` rows (or columns) cover `size`; a last partial one counts."""
    return -(-size // unit)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.packed_weight: torch.Tensor | None = None
        self.decode_weight: cpu_gemm.DecodeWeight | None = None
        # vLLM's quant_method: set (`models/quantization.py`) when the weight is quantized;
        # it then owns the weight's parameters, their processing after loading, and the GEMM.
        self.quant_method = None

    def process_weights_after_loading(self) -> None:
        """Packs the loaded weight once for the CPU GEMM (`kernels/cpu_gemm.py`); called by
        the loader after the checkpoint is in. `weight` stays as loaded; weights loaded again
        later need this called again."""
        if self.quant_method is not None:
            self.packed_weight = self.decode_weight = None
            self.quant_method.process_weights_after_loading(self)
            return
        self.packed_weight, self.decode_weight = cpu_gemm.pack_weight_copies(self.weight)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return cpu_gemm.linear(x, self.weight, self.packed_weight, bias, self.decode_weight)


class LinearOutputSlice:
    """Output features [start, start + size) of a loaded linear layer (its weight rows and
    bias entries on this rank), packed for the CPU GEMM as the layer's own weight is: for
    computing part of a layer's output, on rows where the rest is not read. Not a module:
    it holds no parameters of its own, only views of the layer's and packed copies, so it
    must be made again when the layer's weights are loaded again."""

    def __init__(self, layer: LinearBase, start: int, size: int) -> None:
        self.weight = layer.weight.detach().narrow(0, start, size)
        self.bias = None if layer.bias is None else layer.bias.detach().narrow(0, start, size)
        self.packed_weight, self.decode_weight = cpu_gemm.pack_weight_copies(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x, self.weight, self.packed_weight, self.bias, self.decode_weight)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, output_size, params_dtype)
        self.weight = _new_parameter(output_size, input_size, dtype=params_dtype, weight_loader=self.weight_loader)
        self.bias = (_new_parameter(output_size, dtype=params_dtype, weight_loader=self.weight_loader)
                     if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded_weight, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by output columns: rank r holds output features
    [r * out / tp, (r + 1) * out / tp). `gather_output` all-gathers the full Y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 params_dtype: torch.dtype | None = None, output_sizes: list[int] | None = None) -> None:
        super().__init__(input_size, output_size, params_dtype)
        self.gather_output = gather_output
        self.output_sizes = output_sizes or [output_size]
        for size in self.output_sizes:
            divide(size, self.tp_size, f"{type(self).__name__} output size")
        self.output_size_per_partition = output_size // self.tp_size
        self.weight = _new_parameter(self.output_size_per_partition, input_size, dtype=params_dtype,
                                     weight_loader=self.weight_loader)
        self.bias = (_new_parameter(self.output_size_per_partition, dtype=params_dtype,
                                    weight_loader=self.weight_loader) if bias else None)

    @property
    def output_partition_sizes(self) -> list[int]:
        """This rank's rows of each fused output, in the order the weight holds them (vLLM's name)."""
        return [size // self.tp_size for size in self.output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        self.load_rows(param, loaded_weight, shard_id)

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None, unit: int = 1) -> None:
        """Copies this rank's rows of checkpoint tensor `loaded` (output `shard_id` of a fused
        layer; None: the whole layer's tensor, fused ones split per output) into `param`, in
        units of `unit` rows: 1 for weights, biases and per-channel scales, the block's rows
        for block-wise scales (whose one row covers `unit` weight rows)."""
        shards = self.checkpoint_shards()
        if shard_id is None and len(shards) > 1:
            for sid, offset, size in shards:
                self.load_rows(param, loaded.narrow(0, offset // unit, _units(size, unit)), sid, unit)
            return
        param_offset, size, source_start = self.shard_rows(shards[0][0] if shard_id is None else shard_id)
        name = type(self).__name__ + ("" if shard_id is None else f" shard {shard_id}")
        _copy_checked(param.data.narrow(0, param_offset // unit, _units(size, unit)),
                      loaded.narrow(0, source_start // unit, _units(size, unit)), name)

    def checkpoint_shards(self) -> list[tuple[object, int, int]]:
        """(shard id, first row, rows) of each output within a fused checkpoint tensor."""
        return [(None, 0, self.output_size)]

    def shard_rows(self, shard_id) -> tuple[int, int, int]:
        """(first row in this rank's weight, rows, first row in the shard's checkpoint tensor)
        of this rank's part of output `shard_id`."""
        size = self.output_size_per_partition
        return 0, size, self.tp_rank * size

    def shard_index(self, shard_id) -> int:
        """The position of output `shard_id` among the fused outputs."""
        return 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(x, self.bias)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate_proj and up_proj): each rank holds [shard of output 0, shard of output 1, ...].
    shard_id is the index of the projection a checkpoint tensor belongs to.

    A gate_up projection that SiLU-and-mul always follows says so (`silu_and_mul_follows`):
    on a CPU with the AVX-512 or the AVX2 kernel it then packs, in place of a streaming copy, one
    for the kernel that applies the activation as it stores the products
    (`cpu_gemm.maybe_pack_silu_and_mul_weight`), and `silu_and_mul(x)` runs it."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, gather_output: bool = False,
                 params_dtype: torch.dtype | None = None, silu_and_mul_follows: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype, output_sizes)
        self.silu_and_mul_follows = (silu_and_mul_follows and not bias and not gather_output
                                     and len(output_sizes) == 2 and output_sizes[0] == output_sizes[1])
        self.silu_and_mul_weight: cpu_gemm.DecodeWeight | None = None

    def process_weights_after_loading(self) -> None:
        self.silu_and_mul_weight = None
        if not self.silu_and_mul_follows or self.quant_method is not None:
            return super().process_weights_after_loading()
        self.packed_weight = cpu_gemm.maybe_pack_linear_weight(self.weight)
        self.silu_and_mul_weight = cpu_gemm.maybe_pack_silu_and_mul_weight(self.weight, self.packed_weight)
        # Without the gated copy, decode batches may still take a streaming kernel (AMX).
        self.decode_weight = (None if self.silu_and_mul_weight is not None
                              else cpu_gemm.maybe_pack_decode_weight(self.weight, self.packed_weight))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this rank's projection of x, [..., output_size_per_partition / 2],
        in one kernel where the gated copy serves x (a CPU decode batch); None elsewhere,
        where the caller applies the activation to `forward(x)`."""
        weight = self.silu_and_mul_weight
        if (weight is None or x.device.type != "cpu" or x.dtype != weight.packed.dtype or x.requires_grad
                or not weight.takes(x.numel() // x.shape[-1] if x.shape[-1] else 0)):
            return None
        return weight.op(x, weight.packed, self.output_size_per_partition // 2)

    # weight_loader (ColumnParallelLinear's): a checkpoint that already stores the fused
    # tensor (shard_id None) is split back per output.
    def checkpoint_shards(self) -> list[tuple[object, int, int]]:
        offsets = [sum(self.output_sizes[:index]) for index in range(len(self.output_sizes))]
        return [(index, offset, size) for index, (offset, size) in enumerate(zip(offsets, self.output_sizes))]

    def shard_index(self, shard_id) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id!r}.")
        return shard_id

    def shard_rows(self, shard_id) -> tuple[int, int, int]:
        index = self.shard_index(shard_id)
        shard_size = self.output_sizes[index] // self.tp_size
        return sum(self.output_sizes[:index]) // self.tp_size, shard_size, self.tp_rank * shard_size


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj fused, sharded by heads: each rank holds its
    num_heads / tp query heads and num_kv_heads / tp KV heads. When ranks outnumber KV heads
    each KV head is replicated on tp / num_kv_heads consecutive ranks (one KV head each)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = False, params_dtype: torch.dtype | None = None) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            if tp_size % total_num_kv_heads != 0:
                raise ValueError(f"tensor parallel size ({tp_size}) must be a multiple of num_key_value_heads "
                                 f"({total_num_kv_heads}) when it exceeds it, so that KV heads replicate evenly.")
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        q_size = total_num_heads * head_size
        kv_size = self.num_kv_heads * tp_size * head_size  # replicated KV heads counted per rank
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, False, params_dtype,
                         [q_size, kv_size, kv_size])

    # weight_loader (ColumnParallelLinear's): a fused checkpoint qkv tensor (shard_id None)
    # is split into the full q, k, v first.
    def checkpoint_shards(self) -> list[tuple[object, int, int]]:
        total_kv = self.total_num_kv_heads * self.head_size
        total_q = self.total_num_heads * self.head_size
        return [("q", 0, total_q), ("k", total_q, total_kv), ("v", total_q + total_kv, total_kv)]

    def shard_index(self, shard_id) -> int:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}.")
        return "qkv".index(shard_id)

    def shard_rows(self, shard_id) -> tuple[int, int, int]:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if self.shard_index(shard_id) == 0:
            return 0, q_size, self.tp_rank * q_size
        # Replicas of one KV head sit on consecutive ranks.
        return (q_size if shard_id == "k" else q_size + kv_size, kv_size,
                (self.tp_rank // self.num_kv_head_replicas) * kv_size)


class RowParallelLinear(LinearBase):
    """Y = X A with A split by input rows: rank r holds input features
    [r * in / tp, (r + 1) * in / tp) and computes a partial Y; `reduce_results` sums the
    partials over ranks. The bias is added once, on rank 0, before the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, input_is_parallel: bool = True,
                 reduce_results: bool = True, params_dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, output_size, params_dtype)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, f"{type(self).__name__} input size")
        self.weight = _new_parameter(output_size, self.input_size_per_partition, dtype=params_dtype,
                                     weight_loader=self.weight_loader)
        self.bias = (_new_parameter(output_size, dtype=params_dtype, weight_loader=self.weight_loader)
                     if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is whole on every rank
            _copy_checked(param.data, loaded_weight, f"{type(self).__name__} bias")
            return
        self.load_columns(param, loaded_weight)

    def load_columns(self, param: nn.Parameter, loaded: torch.Tensor, unit: int = 1) -> None:
        """Copies this rank's input columns of checkpoint tensor `loaded` into `param`, in
        units of `unit` columns (a block-wise scale's column covers `unit` weight columns)."""
        size = self.input_size_per_partition
        _copy_checked(param.data, loaded.narrow(1, self.tp_rank * size // unit, _units(size, unit)),
                      type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.narrow(-1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
        bias = self.bias if self.tp_rank == 0 else None
        out = self._linear(x, bias)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out
