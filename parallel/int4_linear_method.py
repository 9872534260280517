"""`GPTQLinearMethod` / `AWQLinearMethod`: a parallel linear layer whose weight is GPTQ or AWQ
packed integers (vLLM's quant_methods of those names; layouts in `kernels/int4_linear.py`),
or compressed-tensors' `pack-quantized` integers (vLLM's CompressedTensorsWNA16).

compressed-tensors' tensors keep their checkpoint names (`weight_packed`, `weight_scale`,
`weight_zero_point`, `weight_g_idx`, `weight_shape`) but are held in GPTQ's layout: each
loader turns the checkpoint tensor into it (`compressed_tensors_*_to_gptq`, scales
transposed) before cutting the rank's shard as below, so that everything after (the checks,
the CPU repack, the chunked GEMM) is GPTQ's with zero_offset 0. Symmetric weights store no
zero point: their codes are offset by 2^(bits - 1), which a constant zero buffer holds.

`create_weights` replaces a layer's weight by `qweight`, `qzeros`, `scales` (and GPTQ's
`g_idx`), each with a `weight_loader` that cuts this rank's shard as vLLM does:
- column-parallel layers (and each fused output of qkv / gate_up) cut output columns:
  `qweight`, `qzeros` and `scales` along their last dimension (packed ones in whole int32s,
  so every rank's share of every output is a multiple of the pack factor); `g_idx` whole;
- row-parallel layers cut input rows: `qweight` along its input dimension, `scales` and
  `qzeros` by whole groups (an input shard that is not whole groups is an error, as in
  vLLM), `g_idx` by rows. Under desc_act the rank's rows refer to any group, so `scales`
  and `qzeros` stay whole there (as vLLM does); with group_size -1 they are one group, whole.
The weights stay packed. On the CPU, `process_weights_after_loading` repacks each layer into
the native kernel's layout (`kernels/int4_linear.repack_for_cpu`) and frees the loaded
tensors (the parameters stay, empty), so the layer holds its codes once, as vLLM's layers do;
elsewhere (CUDA, no native kernel) the loaded tensors are kept and the GEMM dequantizes a
chunk of output columns at a time. A weight load into a layer whose tensors were freed (a
reload after sleep, an RLHF `load_weights`, of the whole checkpoint or of some tensors) first
gives them back from the repacked copy (`unpack_cpu_weight`: the checkpoint's bits), and the
next `process_weights_after_loading` repacks and frees them again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raylm.kernels.int4_linear import (apply_int4_linear, compressed_tensors_packed_to_gptq,
                                      compressed_tensors_zero_point_to_gptq, native_int4_linear_usable, pack_columns,
                                      pack_factor, repack_for_cpu, unpack_cpu_weight)
from raylm.parallel.checkpoint_slice import CheckpointSlice, read_weight
from raylm.parallel.linear import ColumnParallelLinear, LinearBase, RowParallelLinear, _copy_checked


@dataclass(frozen=True)
class Int4LinearScheme:
    """How a GPTQ, AWQ or compressed-tensors (pack-quantized) checkpoint stores its linear
    weights (parsed by `models/quantization.py`)."""

    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int
    group_size: int  # -1: one group over all input features
    desc_act: bool = False  # GPTQ's act-order: g_idx is read, not i // group_size
    zero_offset: int = 0  # added to stored zeros: 1 for GPTQ's v1 checkpoint format
    # False: compressed-tensors' symmetric weights, which store no zero point (2^(bits - 1)).
    has_zero_point: bool = True


@dataclass(frozen=True)
class _TensorNames:
    """The layer's attribute (and checkpoint) names of its packed tensors."""

    qweight: str
    qzeros: str
    scales: str
    g_idx: str


_GPTQ_NAMES = _TensorNames("qweight", "qzeros", "scales", "g_idx")
_COMPRESSED_TENSORS_NAMES = _TensorNames("weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx")


class Int4LinearMethod:
    """Creates, loads, processes and multiplies one layer's GPTQ or AWQ weight."""

    def __init__(self, scheme: Int4LinearScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: LinearBase, prefix: str) -> None:
        """Replaces `layer.weight` (not yet loaded) by the packed parameters. `prefix` (the
        layer's module name) names it in errors."""
        scheme = self.scheme
        out_rows, in_columns = layer.weight.shape
        device = layer.weight.device
        factor = pack_factor(scheme.bits)
        _check_shapes(layer, prefix, scheme, factor)
        row_parallel = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
        full_in = layer.input_size
        group_size = full_in if scheme.group_size == -1 else scheme.group_size
        whole_groups = scheme.group_size == -1 or (scheme.desc_act and row_parallel)
        groups = -(-(full_in if whole_groups or not row_parallel else in_columns) // group_size)
        group_unit = None if whole_groups or not row_parallel else group_size
        awq = scheme.method == "awq"
        compressed = scheme.method == "compressed-tensors"
        names = _COMPRESSED_TENSORS_NAMES if compressed else _GPTQ_NAMES
        qweight_shape = (in_columns, out_rows // factor) if awq else (in_columns // factor, out_rows)
        int32 = dict(dtype=torch.int32, device=device)
        qweight_loader = self._loader(layer, out_unit=factor if awq else 1, in_unit=1 if awq else factor)
        qzeros_loader = self._loader(layer, out_unit=factor, in_unit=group_unit)
        scales_loader = self._loader(layer, out_unit=1, in_unit=group_unit)
        if compressed:
            bits = scheme.bits
            qweight_loader = _converting(qweight_loader, lambda t: compressed_tensors_packed_to_gptq(t, bits))
            qzeros_loader = _converting(qzeros_loader, lambda t: compressed_tensors_zero_point_to_gptq(t, bits))
            scales_loader = _converting(scales_loader, lambda t: t.t())
        # Checked before any conversion or copy: a copy into the int32 / float32 parameter would
        # cast a float, uint8 or int64 tensor without a word (garbage codes), and the unpacking
        # shifts of a float one fail with a bare NotImplementedError.
        qweight_loader = _dtype_checked(qweight_loader, f"{prefix}.{names.qweight}", "qweight")
        qzeros_loader = _dtype_checked(qzeros_loader, f"{prefix}.{names.qzeros}", "qzeros")
        scales_loader = _dtype_checked(scales_loader, f"{prefix}.{names.scales}", "scales")
        layer.int4_names = names
        setattr(layer, names.qweight, _parameter(torch.empty(qweight_shape, **int32), qweight_loader))
        if scheme.has_zero_point:
            setattr(layer, names.qzeros, _parameter(torch.empty(groups, out_rows // factor, **int32), qzeros_loader))
        else:  # not in the checkpoint: every code's zero is the offset it is stored with
            offset = torch.full((groups, out_rows), 1 << (scheme.bits - 1), **int32)
            layer.register_buffer(names.qzeros, pack_columns(offset, scheme.bits), persistent=False)
        # float32: fp16 and bf16 checkpoint scales both fit without rounding.
        setattr(layer, names.scales, _parameter(torch.empty(groups, out_rows, dtype=torch.float32, device=device),
                                                scales_loader))
        if not awq and (scheme.desc_act or not compressed):  # compressed-tensors stores g_idx under actorder only
            setattr(layer, names.g_idx, _parameter(torch.full((in_columns,), -1, **int32), _dtype_checked(
                self._g_idx_loader(layer, prefix), f"{prefix}.{names.g_idx}", "g_idx")))
        if compressed:
            layer.weight_shape = _parameter(torch.zeros(2, dtype=torch.int64, device=device),
                                            _weight_shape_loader(layer, prefix))
        # The 16/32-bit weight is never filled: drop it, keeping its shape for the layers
        # that read it (a meta tensor holds no memory).
        del layer._parameters["weight"]
        layer.weight = torch.empty(out_rows, in_columns, device="meta")
        layer.g_idx_runtime = None
        layer.cpu_int4_weight = None
        layer.quant_prefix = prefix  # names the layer in errors found after loading
        layer.quant_method = self

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Each local input row's group: g_idx under desc_act, else row // group_size (as
        vLLM, which reads g_idx only for act-order checkpoints). A scale that is NaN or
        infinite, or a g_idx that names no group, is an error naming the layer: either would
        make the layer's outputs garbage (or wrap to the last group) without a word. A scale
        of 0 (an fp16 underflow of a tiny group) or below 0 is exact arithmetic and is kept:
        GPTQ and AWQ writers only write positive scales, but (code - zero) * scale holds for any.
        On the CPU with the native kernel: the repacked copy, and the loaded tensors freed.
        """
        scheme = self.scheme
        if _loaded_tensors_freed(layer):
            return  # nothing loaded since they were repacked: the copy stands
        _check_finite_scales(layer)
        if scheme.desc_act:
            _check_g_idx_range(layer)
        layer.g_idx_runtime = self._group_of_rows(layer)
        layer.cpu_int4_weight = None
        qweight, qzeros, scales = _packed(layer)
        if qweight.device.type == "cpu" and native_int4_linear_usable():
            layer.cpu_int4_weight = repack_for_cpu(qweight.detach(), qzeros.detach(), scales.detach(),
                                                   layer.g_idx_runtime, scheme.bits, scheme.method == "awq",
                                                   scheme.zero_offset)
            # The kernel reads only its copy: keeping the loaded tensors too would double the
            # codes' bytes (half of bf16's rather than a quarter).
            for param in _loaded_parameters(layer):
                param.data = param.data.new_empty(0)
            layer.g_idx_runtime = None

    def restore_loaded_tensors(self, layer: LinearBase) -> None:
        """Gives back the loaded tensors that `process_weights_after_loading` freed, from the
        repacked copy (which it drops: the next processing makes it again), before a weight
        load writes some or all of them. A g_idx that is not read (no desc_act) comes back as
        not loaded (-1), as `create_weights` makes it."""
        if not _loaded_tensors_freed(layer):
            return
        scheme = self.scheme
        qweight, qzeros, scales, g_idx = unpack_cpu_weight(layer.cpu_int4_weight, scheme.method == "awq",
                                                           scheme.zero_offset)
        for tensor, loaded in zip(_packed(layer), (qweight, qzeros, scales)):
            tensor.data = loaded
        if _g_idx(layer) is not None:
            _g_idx(layer).data = g_idx if scheme.desc_act else torch.full_like(g_idx, -1)
        layer.g_idx_runtime = self._group_of_rows(layer)
        layer.cpu_int4_weight = None

    def _group_of_rows(self, layer: LinearBase) -> torch.Tensor:
        """Each local input row's group (what the chunked GEMM reads as g_idx)."""
        if self.scheme.desc_act:
            return _g_idx(layer).detach().long()
        in_columns = layer.weight.shape[1]
        group_size = in_columns if self.scheme.group_size == -1 else self.scheme.group_size
        return torch.arange(in_columns, device=_packed(layer)[2].device) // group_size

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        scheme = self.scheme
        return apply_int4_linear(x, *_packed(layer), layer.g_idx_runtime, scheme.bits, scheme.method == "awq",
                                 scheme.zero_offset, bias, layer.cpu_int4_weight)

    # ------------------------------------------------------------ loaders
    def _loader(self, layer: LinearBase, out_unit: int, in_unit: int | None):
        """A loader cutting a column-parallel layer's output columns (in units of `out_unit`
        checkpoint columns per tensor column) or a row-parallel layer's input rows (one tensor
        row per `in_unit` input features; None: whole)."""
        def load(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
            self.restore_loaded_tensors(layer)
            if isinstance(layer, ColumnParallelLinear):
                _load_output_columns(layer, param, loaded_weight, shard_id, out_unit)
            elif isinstance(layer, RowParallelLinear) and layer.tp_size > 1 and in_unit is not None:
                size = layer.input_size_per_partition
                _copy_checked(param.data, loaded_weight.narrow(0, layer.tp_rank * size // in_unit, size // in_unit),
                              type(layer).__name__)
            else:
                _copy_checked(param.data, loaded_weight, type(layer).__name__)
        return load

    def _g_idx_loader(self, layer: LinearBase, prefix: str):
        def load(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
            self.restore_loaded_tensors(layer)
            if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
                size = layer.input_size_per_partition
                loaded_weight = loaded_weight.narrow(0, layer.tp_rank * size, size)
            loaded = read_weight(loaded_weight).to(torch.int32)
            # Fused outputs share their input, so GPTQ gives them one act order: one g_idx.
            if bool((param.data >= 0).any()) and not torch.equal(param.data, loaded.to(param.device)):
                raise ValueError(f"the fused outputs of {prefix} have different g_idx in the checkpoint; raylm "
                                 f"fuses them into one layer, which takes one act order for its input.")
            _copy_checked(param.data, loaded, f"{type(layer).__name__} g_idx")
        return load


def _load_output_columns(layer: ColumnParallelLinear, param: torch.Tensor, loaded, shard_id, unit: int) -> None:
    """`ColumnParallelLinear.load_rows` along the last dimension: this rank's output columns
    of output `shard_id` (None: the whole, fused ones split per output), `unit` per column."""
    shards = layer.checkpoint_shards()
    last = loaded.dim() - 1
    if shard_id is None and len(shards) > 1:
        for sid, offset, size in shards:
            _load_output_columns(layer, param, loaded.narrow(last, offset // unit, size // unit), sid, unit)
        return
    param_offset, size, source_start = layer.shard_rows(shards[0][0] if shard_id is None else shard_id)
    name = type(layer).__name__ + ("" if shard_id is None else f" shard {shard_id}")
    # The whole output's tensor, not just this rank's columns of it: `narrow` alone would take
    # the first columns of a longer tensor (a wrong checkpoint) without a word.
    full = _output_size(layer, shard_id) // unit
    if loaded.shape[last] != full:
        raise ValueError(f"checkpoint tensor for {name} has {loaded.shape[last]} output columns (shape "
                         f"{tuple(loaded.shape)}), the model expects {full}.")
    _copy_checked(param.data.narrow(last, param_offset // unit, size // unit),
                  loaded.narrow(last, source_start // unit, size // unit), name)


def _output_size(layer: LinearBase, shard_id) -> int:
    """The checkpoint's output features of output `shard_id` of a column-parallel layer
    (None: all of them, fused or not)."""
    if shard_id is None:
        return layer.output_size
    return next(size for sid, _, size in layer.checkpoint_shards() if sid == shard_id)


def _packed(layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's (qweight, qzeros, scales) in the GPTQ or AWQ layout, whatever their names."""
    names = layer.int4_names
    return getattr(layer, names.qweight), getattr(layer, names.qzeros), getattr(layer, names.scales)


def _g_idx(layer: LinearBase) -> nn.Parameter | None:
    """The checkpoint's g_idx parameter (None: AWQ's and compressed-tensors' without actorder)."""
    return getattr(layer, layer.int4_names.g_idx, None)


def _loaded_parameters(layer: LinearBase) -> list[torch.Tensor]:
    """The tensors in the checkpoint's layout, which weight loads write (and a symmetric
    compressed-tensors layer's zero buffer, which the repacked copy holds too)."""
    return list(_packed(layer)) + ([_g_idx(layer)] if _g_idx(layer) is not None else [])


def _loaded_tensors_freed(layer: LinearBase) -> bool:
    """Whether the loaded tensors were freed, the repacked copy standing for them."""
    return layer.cpu_int4_weight is not None and _packed(layer)[0].numel() == 0


def _check_finite_scales(layer: LinearBase) -> None:
    scales = _packed(layer)[2].detach()
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        # compressed-tensors' weight_scale is [output, group] in the checkpoint.
        where = "(group, output)" if layer.int4_names is _GPTQ_NAMES else "(group, output) of its transpose"
        raise ValueError(f"{layer.quant_prefix}.{layer.int4_names.scales} holds {scales[tuple(index)].item()} at "
                         f"index {index} {where}: GPTQ/AWQ/compressed-tensors scales must be finite.")


def _check_g_idx_range(layer: LinearBase) -> None:
    groups = _packed(layer)[2].shape[0]
    g_idx = _g_idx(layer).detach()
    bad = (g_idx < 0) | (g_idx >= groups)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"{layer.quant_prefix}.{layer.int4_names.g_idx} holds {int(g_idx[index])} at index {index}: "
                         f"each input row's group must be in [0, {groups}), the groups of its scales.")


def _check_shapes(layer: LinearBase, prefix: str, scheme: Int4LinearScheme, factor: int) -> None:
    """Every rank's share of every output packs whole int32s, and a row-parallel rank's
    input rows are whole groups (vLLM's rule: else "too large tensor parallel size")."""
    sizes = layer.output_partition_sizes if isinstance(layer, ColumnParallelLinear) else [layer.weight.shape[0]]
    if any(size % factor for size in sizes):
        raise ValueError(f"{prefix} has output shards of {sizes} features on each of {layer.tp_size} tensor-parallel "
                         f"ranks; {scheme.method} {scheme.bits}-bit weights pack {factor} output features an int32, "
                         f"so each must be a multiple of {factor}.")
    in_columns = layer.weight.shape[1]
    if scheme.method != "awq" and in_columns % factor:
        raise ValueError(f"{prefix} has {in_columns} input features on each rank; {scheme.method} {scheme.bits}-bit "
                         f"weights pack {factor} input features an int32, so it must be a multiple of {factor}.")
    if scheme.group_size != -1 and layer.input_size % scheme.group_size:
        raise ValueError(f"{prefix} has {layer.input_size} input features, not a multiple of the checkpoint's "
                         f"group_size {scheme.group_size}.")
    if (isinstance(layer, RowParallelLinear) and layer.tp_size > 1 and scheme.group_size != -1
            and layer.input_size_per_partition % scheme.group_size):
        raise ValueError(f"tensor_parallel_size {layer.tp_size} cuts {prefix}'s {layer.input_size} input features "
                         f"into {layer.input_size_per_partition} a rank, not whole groups of the checkpoint's "
                         f"group_size {scheme.group_size}: the input size is not aligned with the quantized weight "
                         f"shape (as in vLLM); use a smaller tensor_parallel_size.")


def _converting(loader, convert):
    """`loader` handed the checkpoint tensor (read whole) in the layout `convert` makes of it."""
    def load(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        loader(param, convert(read_weight(loaded_weight)), shard_id)
    return load


# Each kind's dtypes, as safetensors' header and torch spell them.
_INTEGER_DTYPES = ("I32", "int32")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "float16", "bfloat16", "float32")
# g_idx holds group numbers, range-checked after loading: an int64 one (some exporters write
# them so) casts exactly, unlike packed codes, whose bytes a cast would reinterpret.
_DTYPES = {"qweight": _INTEGER_DTYPES, "qzeros": _INTEGER_DTYPES, "g_idx": ("I64", "I32", "int64", "int32"),
           "scales": _FLOAT_DTYPES, "weight_shape": ("I64", "I32", "int64", "int32")}


def check_int4_dtype(where: str, kind: str, loaded) -> None:
    """A GPTQ/AWQ/compressed-tensors tensor of kind `kind` (named `where` in the error) has a
    dtype its format writes: int32 codes and zeros, int32/int64 g_idx, 16/32-bit float scales."""
    dtype = loaded.dtype_name if isinstance(loaded, CheckpointSlice) else str(loaded.dtype).removeprefix("torch.")
    allowed = _DTYPES[kind]
    if dtype not in allowed:
        names = ", ".join(sorted({d for d in allowed if d.islower()}))
        raise ValueError(f"{where} is {dtype}; GPTQ/AWQ/compressed-tensors {kind} tensors must be {names}.")


def _dtype_checked(loader, where: str, kind: str):
    """`loader`, after checking its checkpoint tensor's dtype (`check_int4_dtype`)."""
    def load(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        check_int4_dtype(where, kind, loaded_weight)
        loader(param, loaded_weight, shard_id)
    return load


def _weight_shape_loader(layer: LinearBase, prefix: str):
    """compressed-tensors' `weight_shape` [out, in] of the (unpacked) checkpoint weight, checked
    against the layer's (a fused layer's part: that output's features). The tensors' shapes
    are checked as they load too; a weight_shape that disagrees says the checkpoint is not
    what its config says (vLLM ignores it; HF's decompressor unpacks to it)."""
    def load(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        check_int4_dtype(f"{prefix}.weight_shape", "weight_shape", loaded_weight)
        loaded = read_weight(loaded_weight)
        out = layer.output_size if not isinstance(layer, ColumnParallelLinear) else _output_size(layer, shard_id)
        expected = [out, layer.input_size]
        if loaded.dim() != 1 or loaded.tolist() != expected:
            part = "" if shard_id is None else f" (output {shard_id!r} of the fused layer)"
            raise ValueError(f"{prefix}.weight_shape is {loaded.tolist()} (shape {tuple(loaded.shape)}); the "
                             f"layer{part} is [out, in] = {expected}, a 1-D tensor of those two integers.")
        param.data.copy_(loaded.to(param.dtype))
    return load


def _parameter(data: torch.Tensor, weight_loader) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = weight_loader
    return param
