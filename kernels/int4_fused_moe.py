"""GPTQ and AWQ experts dequantized a chunk at a time (`kernels/dequantized_moe.py` runs the
unquantized fused-experts kernel on each chunk).

Each expert projection is stored as its dense layer would be (`kernels/int4_linear.py`'s
layouts), stacked over the experts: GPTQ's `qweight` [E, in / pack, out] packed along the
input, AWQ's [E, in, out / 8] along the output in AWQ's nibble order; `qzeros` [E, groups,
out / pack]; `scales` [E, groups, out]; each input row's group `g_idx` [E, in]. Gate's and
up's outputs are fused along `out` (w13), as the unquantized experts' rows are.

An element dequantizes to `(code - zero) * scale` of its input row's group and its output
column, computed in fp32 and rounded to the activations' dtype once: what the dense layers
compute (`int4_linear.dequantize`). Without act order the groups are runs of `group_size`
rows, so zeros and scales broadcast over each run; under desc_act each row's are gathered.
On the CPU `csrc/cpu_int4_experts.cpp` does all of it in one native pass (the codes widened in
registers, each output element written once), bit for bit as the PyTorch code below, which
runs elsewhere (CUDA, no native build, `RAYLM_TEST_DISABLE_KERNELS=int4_experts`): there the
codes are brought into the [out, in] layout the kernels take while they are small (GPTQ's
packed tensor, AWQ's codes as bytes), so every fp32 pass runs over contiguous memory.
"""

from __future__ import annotations

import functools
import sys

import torch

from raylm.engine import envs
from raylm.kernels.int4_linear import AWQ_PACK_ORDER
from raylm.kernels.native_build import load_native_library


@functools.cache
def _column_positions(bits: int, awq: bool, device: torch.device) -> torch.Tensor:
    """The code position of each of an int32's columns: k for column k, or, in AWQ's order,
    the k with AWQ_PACK_ORDER[k] == column."""
    positions = [AWQ_PACK_ORDER.index(column) for column in range(8)] if awq else list(range(32 // bits))
    return torch.tensor(positions, dtype=torch.int32, device=device)


def _unpack_last(packed: torch.Tensor, bits: int, awq: bool) -> torch.Tensor:
    """[..., c] int32 (contiguous) -> [..., c * pack] codes, column j of each int32's run
    from its code."""
    if packed.device.type == "cpu" and sys.byteorder == "little" and not (awq and bits != 4):
        # Code k sits in bits [k * bits, (k + 1) * bits), so on a little-endian CPU byte j of
        # an int32 is code j (8 bits), or codes 2j and 2j + 1 (4 bits): byte ops read a
        # quarter of the bytes of int32 shifts.
        byte = packed.view(torch.uint8)
        if bits == 8:
            return byte
        codes = torch.stack([byte & 15, byte >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
        if awq:  # AWQ's interleaved columns back in order: a pass over bytes, not floats
            codes = codes.view(*packed.shape, 8).index_select(-1, _column_positions(4, True, packed.device).long())
            codes = codes.reshape(*packed.shape[:-1], -1)
        return codes
    shifts = _column_positions(bits, awq, packed.device) * bits
    codes = (packed.unsqueeze(-1) >> shifts).bitwise_and_((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def _native_runs(qweight: torch.Tensor, dtype: torch.dtype, bits: int, awq: bool) -> bool:
    """Whether `csrc/cpu_int4_experts.cpp` dequantizes these experts: CPU tensors, an fp32 or
    bf16 result, a format it reads (AWQ is 4 bits), the library built, its switch on."""
    return (qweight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and (bits == 4 or not awq)
            and not envs.kernel_switched_off("int4_experts") and load_native_library("cpu_int4_experts") is not None)


def dequantize_int4_experts(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                            g_idx: torch.Tensor | None, experts: torch.Tensor, bits: int, awq: bool, zero_offset: int,
                            dtype: torch.dtype, group_size: int | None = None) -> torch.Tensor:
    """Local experts `experts` (int64) of one stacked projection as [n, out, in] in `dtype`
    (the fused-experts kernels' w13 / w2 layout). Each input row's group: `g_idx` [E, in]
    (under desc_act; `group_size` None), else row // `group_size`. `zero_offset` is added to
    the stored zeros (1 for GPTQ's v1 format)."""
    if _native_runs(qweight, dtype, bits, awq):
        return torch.ops.raylm.dequantize_int4_experts(qweight, qzeros, scales, g_idx if group_size is None else None,
                                                       experts, bits, awq, zero_offset, group_size or 0, dtype)
    n, out_features = experts.numel(), scales.shape[-1]
    if awq:  # codes [n, in, out], transposed as bytes
        codes = _unpack_last(qweight[experts], bits, awq=True).transpose(1, 2).contiguous()
    else:  # the packed rows transposed, then unpacked along the input
        codes = _unpack_last(qweight[experts].transpose(1, 2).contiguous(), bits, awq=False)
    in_features = codes.shape[2]  # codes: [n, out, in]
    zeros = _unpack_last(qzeros[experts], bits, awq)[..., :out_features].float().add_(zero_offset)
    zeros, group_scales = zeros.transpose(1, 2), scales[experts].float().transpose(1, 2)  # [n, out, G]
    if group_size is not None and in_features % group_size:  # a last partial group: gathered
        g_idx = (torch.arange(in_features, device=codes.device) // group_size).expand(qweight.shape[0], -1)
        group_size = None
    if group_size is not None:
        # Runs of group_size rows: each group's zero and scale broadcast over its run.
        values = codes.view(n, out_features, in_features // group_size, group_size).float()
        weight = values.sub_(zeros.unsqueeze(-1)).mul_(group_scales.unsqueeze(-1)).view(n, out_features, in_features)
    else:  # each row's group, in any order under desc_act: one expert at a time (index_select
        # over a row index, not a gather over an index of every element)
        rows = g_idx[experts].long()
        weight = codes.float()
        for i in range(n):
            weight[i].sub_(zeros[i].index_select(1, rows[i])).mul_(group_scales[i].index_select(1, rows[i]))
    return weight.to(dtype)
