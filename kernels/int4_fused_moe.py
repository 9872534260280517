"""GPTQ and AWQ experts dequantized a chunk at a time (`kernels/dequantized_moe.py` runs the
unquantized fused-experts kernel on each chunk).

Each expert projection is stored as its dense layer would be (`kernels/int4_linear.py`'s
layouts), stacked over the experts: GPTQ's `qweight` [E, in / pack, out] packed along the
input, AWQ's [E, in, out / 8] along the output in AWQ's nibble order; `qzeros` [E, groups,
out / pack]; `scales` [E, groups, out]; each input row's group `g_idx` [E, in]. Gate's and
up's outputs are fused along `out` (w13), as the unquantized experts' rows are.

An element dequantizes to `(code - zero) * scale` of its input row's group and its output
column, computed in fp32 and rounded to the activations' dtype once: what the dense layers
compute (`int4_linear.dequantize`).
"""

from __future__ import annotations

import torch

from raylm.kernels.int4_linear import unpack_columns, unpack_rows


def dequantize_int4_experts(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                            experts: torch.Tensor, bits: int, awq: bool, zero_offset: int,
                            dtype: torch.dtype) -> torch.Tensor:
    """Local experts `experts` (int64) of one stacked projection as [n, out, in] in `dtype`
    (the fused-experts kernels' w13 / w2 layout). `g_idx` [E, in] int64; `zero_offset` is
    added to the stored zeros (1 for GPTQ's v1 format)."""
    n = experts.numel()
    packed = qweight[experts]
    # Rows of the packed tensors are independent: unpack the experts' rows as one 2-D tensor.
    if awq:
        codes = unpack_columns(packed.reshape(-1, packed.shape[-1]), bits, awq_order=True).reshape(n, packed.shape[1], -1)
    else:
        codes = unpack_rows(packed.reshape(-1, packed.shape[-1]), bits).reshape(n, -1, packed.shape[-1])
    zeros = qzeros[experts]
    zeros = unpack_columns(zeros.reshape(-1, zeros.shape[-1]), bits, awq_order=awq).reshape(n, zeros.shape[1], -1)
    out_features = scales.shape[-1]
    # Each input row's group's zero and scale (g_idx may be any order under desc_act).
    rows = g_idx[experts].unsqueeze(-1).expand(-1, -1, out_features)
    zero_of_row = zeros[..., :out_features].gather(1, rows) + zero_offset
    weight = (codes - zero_of_row).float().mul_(scales[experts].float().gather(1, rows))
    return weight.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
