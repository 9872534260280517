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
GPTQ's codes are unpacked straight into the [out, in] layout the kernels take (the packed
tensor, an eighth of the codes' bytes at 4 bits, is the one transposed).
"""

from __future__ import annotations

import functools
import sys

import torch

from raylm.kernels.int4_linear import AWQ_PACK_ORDER


@functools.cache
def _column_shifts(bits: int, awq: bool, device: torch.device) -> torch.Tensor:
    """The shift of each of an int32's columns: code k holds column k, or AWQ_PACK_ORDER[k]."""
    positions = [AWQ_PACK_ORDER.index(column) for column in range(8)] if awq else list(range(32 // bits))
    return torch.tensor(positions, dtype=torch.int32, device=device) * bits


def _unpack_last(packed: torch.Tensor, bits: int, awq: bool) -> torch.Tensor:
    """[..., c] int32 (contiguous) -> [..., c * pack] codes, element j of each int32's run
    from its code."""
    if not awq and packed.device.type == "cpu":
        # Code k sits in bits [k * bits, (k + 1) * bits), so on a little-endian CPU byte j of
        # an int32 is code j (8 bits), or codes 2j and 2j + 1 (4 bits): byte ops read a
        # quarter of the int32 shifts' bytes (~1.5x faster on a 2-core AVX2 EPYC).
        if bits == 8 and sys.byteorder == "little":
            return packed.view(torch.uint8)
        if bits == 4 and sys.byteorder == "little":
            byte = packed.view(torch.uint8)
            return torch.stack([byte & 15, byte >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    codes = (packed.unsqueeze(-1) >> _column_shifts(bits, awq, packed.device)).bitwise_and_((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def dequantize_int4_experts(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                            g_idx: torch.Tensor | None, experts: torch.Tensor, bits: int, awq: bool, zero_offset: int,
                            dtype: torch.dtype, group_size: int | None = None) -> torch.Tensor:
    """Local experts `experts` (int64) of one stacked projection as [n, out, in] in `dtype`
    (the fused-experts kernels' w13 / w2 layout). Each input row's group: `g_idx` [E, in]
    (under desc_act; `group_size` None), else row // `group_size`. `zero_offset` is added to
    the stored zeros (1 for GPTQ's v1 format)."""
    n, out_features = experts.numel(), scales.shape[-1]
    zeros = _unpack_last(qzeros[experts], bits, awq)[..., :out_features].float() + zero_offset  # [n, G, out]
    group_scales = scales[experts].float()
    if awq:  # [n, in, out]
        codes = _unpack_last(qweight[experts], bits, awq=True)
        layout_out_last = True
    else:  # the packed rows transposed, then unpacked along the input: [n, out, in]
        codes = _unpack_last(qweight[experts].transpose(1, 2).contiguous(), bits, awq=False)
        zeros, group_scales = zeros.transpose(1, 2), group_scales.transpose(1, 2)  # [n, out, G]
        layout_out_last = False
    in_features = codes.shape[1] if layout_out_last else codes.shape[2]
    if group_size is not None and in_features % group_size:  # a last partial group: gathered
        g_idx = (torch.arange(in_features, device=codes.device) // group_size).expand(qweight.shape[0], -1)
        group_size = None
    if group_size is not None:
        # Runs of group_size rows: each group's zero and scale broadcast over its run.
        groups = in_features // group_size
        if layout_out_last:
            values = codes.view(n, groups, group_size, out_features).float()
            values.sub_(zeros.unsqueeze(2)).mul_(group_scales.unsqueeze(2))
            weight = values.view(n, in_features, out_features)
        else:
            values = codes.view(n, out_features, groups, group_size).float()
            values.sub_(zeros.unsqueeze(-1)).mul_(group_scales.unsqueeze(-1))
            weight = values.view(n, out_features, in_features)
    else:
        rows = g_idx[experts].long()  # [n, in]: any order under desc_act
        if layout_out_last:
            index = rows.unsqueeze(-1).expand(-1, -1, out_features)
            weight = codes.float().sub_(zeros.gather(1, index)).mul_(group_scales.gather(1, index))
        else:
            index = rows.unsqueeze(1).expand(-1, out_features, -1)
            weight = codes.float().sub_(zeros.gather(2, index)).mul_(group_scales.gather(2, index))
    if layout_out_last:
        weight = weight.transpose(1, 2)
    return weight.to(dtype, memory_format=torch.contiguous_format)

