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

    def process_weights_after_loading(self) -> None:
        """Packs the loaded weight once for the CPU GEMM (`kernels/cpu_gemm.py`); called by
        the loader after the checkpoint is in. `weight` stays as loaded; weights loaded again
        later need this called again."""
        self.packed_weight, self.decode_weight = cpu_gemm.pack_weight_copies(self.weight)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
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

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        _copy_checked(param.data, loaded_weight.narrow(0, self.tp_rank * size, size), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(x, self.bias)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate_proj and up_proj): each rank holds [shard of output 0, shard of output 1, ...].
    shard_id is the index of the projection a checkpoint tensor belongs to.

    A gate_up projection that SiLU-and-mul always follows says so (`silu_and_mul_follows`):
    on a CPU with the AVX-512 kernel it then packs, in place of a streaming copy, one for the
    kernel that applies the activation as it stores the products
    (`cpu_gemm.maybe_pack_silu_and_mul_weight`), and `silu_and_mul(x)` runs it."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, gather_output: bool = False,
                 params_dtype: torch.dtype | None = None, silu_and_mul_follows: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype, output_sizes)
        self.silu_and_mul_follows = (silu_and_mul_follows and not bias and not gather_output
                                     and len(output_sizes) == 2 and output_sizes[0] == output_sizes[1])
        self.silu_and_mul_weight: cpu_gemm.DecodeWeight | None = None

    def process_weights_after_loading(self) -> None:
        self.silu_and_mul_weight = None
        if not self.silu_and_mul_follows:
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

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            # A checkpoint that already stores the fused tensor: split it back per output.
            offset = 0
            for index, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), index)
                offset += size
            return
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id!r}.")
        shard_size = self.output_sizes[shard_id] // self.tp_size
        shard_offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy_checked(param.data.narrow(0, shard_offset, shard_size),
                      loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size),
                      f"{type(self).__name__} shard {shard_id}")


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

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None) -> None:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id is None:
            # A fused checkpoint qkv tensor: split it into the full q, k, v first.
            total_kv = self.total_num_kv_heads * self.head_size
            total_q = self.total_num_heads * self.head_size
            for sid, offset, size in (("q", 0, total_q), ("k", total_q, total_kv), ("v", total_q + total_kv, total_kv)):
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), sid)
            return
        if shard_id == "q":
            param_offset, size, source_start = 0, q_size, self.tp_rank * q_size
        elif shard_id in ("k", "v"):
            param_offset = q_size if shard_id == "k" else q_size + kv_size
            size = kv_size
            # Replicas of one KV head sit on consecutive ranks.
            source_start = (self.tp_rank // self.num_kv_head_replicas) * kv_size
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}.")
        _copy_checked(param.data.narrow(0, param_offset, size), loaded_weight.narrow(0, source_start, size),
                      f"{type(self).__name__} shard {shard_id}")


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
        size = param.shape[1]
        _copy_checked(param.data, loaded_weight.narrow(1, self.tp_rank * size, size), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.narrow(-1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
        bias = self.bias if self.tp_rank == 0 else None
        out = self._linear(x, bias)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out
