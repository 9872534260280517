"""Linear layers over GPTQ and AWQ weights: integer codes packed in int32, unpacked and
dequantized a chunk of output columns at a time as the GEMM runs (no Marlin or exllama
kernel: the same W4A16 path on CPU and CUDA).

Layouts (what AutoGPTQ / GPTQModel and AutoAWQ save; `pack_factor = 32 // bits` codes an int32,
code k of an int32 in bits [k * bits, (k + 1) * bits)):
- GPTQ: `qweight` [in / pack_factor, out], packed along the input dimension (int32 row r holds
  input rows r * pack_factor + k); `qzeros` [groups, out / pack_factor], packed along the output;
  `scales` [groups, out]; `g_idx` [in], the group of each input row (i // group_size, or a
  permuted order under desc_act). Checkpoint format "gptq" (v1) stores zero - 1; "gptq_v2"
  stores the zero itself.
- AWQ (GEMM): `qweight` [in, out / 8] and `qzeros` [groups, out / 8], both packed along the
  output with code k of an int32 holding column AWQ_PACK_ORDER[k] of its eight; `scales`
  [groups, out]; group of input row i is i // group_size.

Both dequantize to `(code - zero) * scale` of the element's group and output column.
"""

from __future__ import annotations

import functools

import torch

# AutoAWQ's interleaving: code k of an int32 holds column AWQ_PACK_ORDER[k] of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Elements of one dequantized chunk (as kernels/fp8_linear.py): it should stay in L2.
_DEQUANT_CHUNK_ELEMENTS = 2**19


def pack_factor(bits: int) -> int:
    return 32 // bits


@functools.cache
def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


@functools.cache
def _awq_unpack_order(device: torch.device) -> torch.Tensor:
    """Code position of each of eight consecutive columns (the inverse of AWQ_PACK_ORDER)."""
    inverse = [AWQ_PACK_ORDER.index(column) for column in range(8)]
    return torch.tensor(inverse, dtype=torch.long, device=device)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[r, c] int32 -> [r * pack_factor, c] codes: row r * pack_factor + k from code k (GPTQ's qweight)."""
    codes = (packed.unsqueeze(1) >> _shifts(bits, packed.device).view(1, -1, 1)) & ((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1])


def unpack_columns(packed: torch.Tensor, bits: int, awq_order: bool = False) -> torch.Tensor:
    """[r, c] int32 -> [r, c * pack_factor] codes: column c * pack_factor + j from code j, or,
    with `awq_order`, from the code AutoAWQ put it in."""
    codes = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)
    if awq_order:
        codes = codes.index_select(-1, _awq_unpack_order(packed.device))
    return codes.reshape(packed.shape[0], -1)


def dequantize_columns(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                       start: int, end: int, bits: int, awq: bool, zero_offset: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Output columns [start, end) of the weight, as [in, end - start] in `dtype` (x @ it is
    the layer's product). `start` and `end` are multiples of the pack factor; `zero_offset`
    is added to the stored zeros (1 for GPTQ v1)."""
    factor = pack_factor(bits)
    packed_start, packed_end = start // factor, -(-end // factor)
    if awq:
        codes = unpack_columns(qweight[:, packed_start:packed_end], bits, awq_order=True)
    else:
        codes = unpack_rows(qweight[:, start:end], bits)
    zeros = unpack_columns(qzeros[:, packed_start:packed_end], bits, awq_order=awq)
    offset = start - packed_start * factor
    codes = codes[:, offset:offset + end - start]
    zeros = zeros[:, offset:offset + end - start] + zero_offset
    scales = scales[:, start:end].float()
    # Per input row: its group's zero and scale (g_idx may be any order under desc_act).
    weight = (codes - zeros.index_select(0, g_idx)).float() * scales.index_select(0, g_idx)
    return weight.to(dtype)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
               awq: bool, zero_offset: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight as [out, in] (the PyTorch reference's and tests' view)."""
    out_features = scales.shape[1]
    return dequantize_columns(qweight, qzeros, scales, g_idx, 0, out_features, bits, awq, zero_offset, dtype).t()


def apply_int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      g_idx: torch.Tensor, bits: int, awq: bool, zero_offset: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` in x's dtype, dequantizing a chunk of output
    columns at a time and multiplying it while it is in the cache: never the whole weight
    in 16 bits."""
    in_features, out_features = g_idx.shape[0], scales.shape[1]
    factor = pack_factor(bits)
    chunk = max(factor, _DEQUANT_CHUNK_ELEMENTS // max(1, in_features))
    chunk -= chunk % factor
    x2 = x.reshape(-1, in_features)
    parts = [x2 @ dequantize_columns(qweight, qzeros, scales, g_idx, start, min(out_features, start + chunk), bits,
                                     awq, zero_offset, x.dtype)
             for start in range(0, out_features, chunk)]
    out = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).reshape(*x.shape[:-1], out_features)
    return out if bias is None else out + bias
