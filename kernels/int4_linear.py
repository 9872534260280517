"""Linear layers over GPTQ and AWQ weights: integer codes packed in int32, multiplied without
ever holding the weight in 16 or 32 bits, in one of two ways:
- on the CPU, `csrc/cpu_int4_linear.cpp`, over a copy repacked at load (`repack_for_cpu`)
  into one layout for GPTQ and AWQ: the codes are widened in registers and the zeros folded
  in once per group (see the kernel's comment). It serves every batch size: on a 2-core AMD
  EPYC (AVX2) it ran the ~100M Llama's projections faster than the chunked path below at
  every size from 1 to 512 tokens (3.5x at 512), and at 128 and 512 tokens at 0.91-0.94x
  the speed of oneDNN's fp32 GEMM over the dequantized weight (docs/quantization.md);
- elsewhere (CUDA, or where the native library is not built), the codes unpacked and
  dequantized a chunk of output columns at a time as the GEMM runs (no Marlin or exllama
  kernel).

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raylm.engine import envs
from raylm.kernels.native_build import load_native_library

# AutoAWQ's interleaving: code k of an int32 holds column AWQ_PACK_ORDER[k] of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Elements of one dequantized chunk (as kernels/fp8_linear.py): it should stay in L2.
_DEQUANT_CHUNK_ELEMENTS = 2**19
# The native kernel's layout (csrc/cpu_int4_linear.cpp's kBlockColumns and kChunkRows): output
# columns in blocks of 32, inputs in chunks of at most 128 rows, each inside one group.
BLOCK_COLUMNS = 32
CHUNK_ROWS = 128
# None: not tried yet; else whether csrc/cpu_int4_linear.cpp is built and allowed.
_native_usable: bool | None = None


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


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[r * pack_factor, c] codes -> [r, c] int32 (GPTQ's qweight); the inverse of `unpack_rows`."""
    grouped = codes.to(torch.int32).reshape(-1, pack_factor(bits), codes.shape[1])
    packed = torch.zeros(grouped.shape[0], codes.shape[1], dtype=torch.int32, device=codes.device)
    for k in range(pack_factor(bits)):  # int32 shifts wrap: the top code lands in the sign bit, as packed
        packed |= grouped[:, k] << (bits * k)
    return packed


def pack_columns(codes: torch.Tensor, bits: int, awq_order: bool = False) -> torch.Tensor:
    """[r, c * pack_factor] codes -> [r, c] int32; the inverse of `unpack_columns` (with
    `awq_order`, code k of an int32 holds column AWQ_PACK_ORDER[k] of its eight)."""
    grouped = codes.to(torch.int32).reshape(codes.shape[0], -1, pack_factor(bits))
    packed = torch.zeros(grouped.shape[:2], dtype=torch.int32, device=codes.device)
    for k in range(pack_factor(bits)):
        packed |= grouped[:, :, AWQ_PACK_ORDER[k] if awq_order else k] << (bits * k)
    return packed


def compressed_tensors_packed_to_gptq(weight_packed: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' `weight_packed` [out, in / pack_factor] (pack-quantized: code j of
    int32 c is input column c * pack_factor + j, each stored plus 2^(bits - 1)) as GPTQ's
    qweight [in / pack_factor, out] of the same codes, which read with a zero of 2^(bits - 1)
    (or the unpacked `weight_zero_point`, stored with the same offset) give the same weight."""
    return pack_rows(unpack_columns(weight_packed, bits).t(), bits)


def compressed_tensors_zero_point_to_gptq(weight_zero_point: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' `weight_zero_point` [out / pack_factor, groups] (packed along the
    outputs, each stored plus 2^(bits - 1)) as GPTQ's qzeros [groups, out / pack_factor]."""
    return pack_columns(unpack_rows(weight_zero_point, bits).t(), bits)


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


@dataclass(frozen=True)
class CpuInt4Weight:
    """A GPTQ or AWQ weight repacked for csrc/cpu_int4_linear.cpp (layout in its comment).

    Its rows are the layer's input features sorted by group (act order's permutation undone
    once, here, rather than gathered from the weight on every call) and each group padded to
    whole words with rows of code 0 whose input is 0; `source_rows` says which input each row
    takes (`in_features`: the zero), None where that is every input in order."""

    weight: torch.Tensor  # [blocks, rows / pack, 32] int32
    scales: torch.Tensor  # [blocks, groups, 32] float32
    zero_scales: torch.Tensor  # [blocks, groups, 32] float32: zero * scale
    chunk_starts: torch.Tensor  # [chunks + 1] int32
    chunk_groups: torch.Tensor  # [chunks] int32
    source_rows: torch.Tensor | None  # [rows] int64
    bits: int
    in_features: int
    out_features: int


def native_int4_linear_usable() -> bool:
    """Whether the native GPTQ/AWQ GEMM (csrc/cpu_int4_linear.cpp) is built here and
    not switched off (RAYLM_TEST_DISABLE_KERNELS=int4_linear)."""
    global _native_usable
    if _native_usable is None:
        _native_usable = (not envs.kernel_switched_off("int4_linear")
                          and load_native_library("cpu_int4_linear") is not None)
    return _native_usable


def repack_for_cpu(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                   bits: int, awq: bool, zero_offset: int) -> CpuInt4Weight:
    """The layer's weight in the native kernel's layout, from either checkpoint format:
    codes by input row and output column, rows sorted by group (`g_idx`, any order),
    packed `32 // bits` rows a word along each block of 32 output columns."""
    in_features, out_features = g_idx.shape[0], scales.shape[1]
    factor = pack_factor(bits)
    codes = unpack_columns(qweight, bits, awq_order=True) if awq else unpack_rows(qweight, bits)
    zeros = unpack_columns(qzeros, bits, awq_order=awq)[:, :out_features] + zero_offset
    groups = scales.shape[0]
    group_of_row = g_idx.long().cpu()
    order = torch.argsort(group_of_row, stable=True)
    counts = torch.bincount(group_of_row, minlength=groups).tolist()
    pieces, chunk_starts, chunk_groups, taken = [], [0], [], 0
    for group, count in enumerate(counts):
        if count == 0:
            continue
        pieces.append(order[taken:taken + count])
        taken += count
        padded = -(-count // factor) * factor
        pieces.append(torch.full((padded - count,), in_features, dtype=torch.long))
        for start in range(0, padded, CHUNK_ROWS):
            chunk_starts.append(chunk_starts[-1] + min(CHUNK_ROWS, padded - start))
            chunk_groups.append(group)
    source_rows = torch.cat(pieces).to(codes.device)
    if source_rows.shape[0] == in_features and torch.equal(source_rows, torch.arange(in_features, device=codes.device)):
        source_rows = None
    else:
        codes = torch.cat([codes, codes.new_zeros(1, out_features)]).index_select(0, source_rows)
    blocks = -(-out_features // BLOCK_COLUMNS)
    padding = blocks * BLOCK_COLUMNS - out_features
    codes = F.pad(codes, (0, padding)).reshape(-1, factor, blocks * BLOCK_COLUMNS)
    words = torch.zeros(codes.shape[0], blocks * BLOCK_COLUMNS, dtype=torch.int32, device=codes.device)
    for k in range(factor):  # int32 shifts wrap: the top code lands in the sign bit, as packed
        words |= codes[:, k].to(torch.int32) << (bits * k)
    scales = F.pad(scales.float(), (0, padding))
    zero_scales = F.pad(zeros.float(), (0, padding)) * scales
    return CpuInt4Weight(
        weight=_by_column_block(words), scales=_by_column_block(scales), zero_scales=_by_column_block(zero_scales),
        chunk_starts=torch.tensor(chunk_starts, dtype=torch.int32),
        chunk_groups=torch.tensor(chunk_groups, dtype=torch.int32), source_rows=source_rows, bits=bits,
        in_features=in_features, out_features=out_features)


def unpack_cpu_weight(weight: CpuInt4Weight, awq: bool,
                      zero_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checkpoint's tensors back from the copy `repack_for_cpu` made of them: (qweight,
    qzeros, fp32 scales, g_idx: each input row's group), in the GPTQ or AWQ layout. Codes,
    scales and groups come back exactly; each zero as zero * scale / scale rounded, exact
    for any finite non-zero scale, and stored 0 where the scale is 0 (a group whose elements
    are all 0, whatever its zero), the one thing the copy does not keep."""
    bits, out_features = weight.bits, weight.out_features
    codes = unpack_rows(_from_column_blocks(weight.weight), bits)[:, :out_features]
    group_of_row = torch.repeat_interleave(weight.chunk_groups.long(), weight.chunk_starts.diff().long())
    if weight.source_rows is None:
        by_input, g_idx = codes, group_of_row
    else:  # undo the sort by group, dropping the padding rows (source row in_features)
        real = weight.source_rows < weight.in_features
        rows = weight.source_rows[real]
        by_input = codes.new_empty(weight.in_features, out_features)
        by_input[rows] = codes[real]
        g_idx = group_of_row.new_empty(weight.in_features)
        g_idx[rows] = group_of_row[real]
    scales = _from_column_blocks(weight.scales)[:, :out_features].contiguous()
    zero_scales = _from_column_blocks(weight.zero_scales)[:, :out_features]
    zeros = torch.where(scales != 0, torch.round(zero_scales / scales), zero_offset).to(torch.int32) - zero_offset
    qweight = pack_columns(by_input, bits, awq_order=True) if awq else pack_rows(by_input, bits)
    qzeros = pack_columns(zeros & ((1 << bits) - 1), bits, awq_order=awq)
    return qweight, qzeros, scales, g_idx.to(torch.int32)


def _by_column_block(t: torch.Tensor) -> torch.Tensor:
    """[rows, blocks * 32] -> [blocks, rows, 32], each block's rows contiguous."""
    return t.reshape(t.shape[0], -1, BLOCK_COLUMNS).transpose(0, 1).contiguous()


def _from_column_blocks(t: torch.Tensor) -> torch.Tensor:
    """[blocks, rows, 32] -> [rows, blocks * 32]; the inverse of `_by_column_block`."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def native_int4_linear(x: torch.Tensor, weight: CpuInt4Weight) -> torch.Tensor:
    """x [rows, in_features] times the repacked weight, computed and returned in fp32."""
    x = x.float()
    if weight.source_rows is not None:
        x = F.pad(x, (0, 1)).index_select(1, weight.source_rows)  # column in_features: the padding's 0
    return torch.ops.raylm.int4_linear(x.contiguous(), weight.weight, weight.scales, weight.zero_scales,
                                       weight.chunk_starts, weight.chunk_groups, weight.bits, weight.out_features)


def apply_int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      g_idx: torch.Tensor, bits: int, awq: bool, zero_offset: int,
                      bias: torch.Tensor | None = None, cpu_weight: CpuInt4Weight | None = None) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` in x's dtype: the native kernel over
    `cpu_weight` (the repacked copy, where the layer has one) on the CPU, else dequantizing
    a chunk of output columns at a time and multiplying it while it is in the cache: never
    the whole weight in 16 bits. With `cpu_weight` on the CPU the other tensors are not read
    (a layer frees them once it has that copy)."""
    if cpu_weight is not None and x.device.type == "cpu":
        out = native_int4_linear(x.reshape(-1, cpu_weight.in_features), cpu_weight).to(x.dtype)
        out = out.reshape(*x.shape[:-1], cpu_weight.out_features)
        return out if bias is None else out + bias
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
