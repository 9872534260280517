"""Linear layers over FP8 (float8_e4m3fn) weights: quantizing, and the GEMM in two ways.

A weight is stored in fp8 with float32 scales in one of three layouts (what the checkpoint
formats carry, `models/quantization.py`): one scale for the whole weight (a 0-d tensor),
one per output row (`[out]`: a channel-wise checkpoint, or a fused layer's per-shard
scales spread over their rows), or one per block of `block_size = (rows, columns)` elements
(`[ceil(out / rows), ceil(in / columns)]`, DeepSeek's and Qwen3-FP8's layout). The weight
dequantizes to `weight.float() * scale` of its row or block.

`apply_fp8_linear` runs the GEMM:
- W8A8 on CUDA GPUs of compute capability 8.9 and up (Ada, Hopper and later), as vLLM does:
  the activations quantized to fp8 too, per token (dynamic) or by the checkpoint's static
  `input_scale`, and multiplied by `torch._scaled_mm`. Block-wise weights keep the W8A16 path
  here (vLLM runs them through its own block kernel).
- W8A16 everywhere else (the CPU has no fp8 arithmetic), never holding a whole weight, let
  alone the model, in 16 bits. On the CPU, up to NATIVE_MAX_ROWS tokens (decode batches) run
  `csrc/cpu_fp8_linear.cpp`, which widens the weight's bytes in registers; larger batches,
  and block-wise weights, dequantize a chunk of output rows at a time to the activations'
  dtype and multiply each chunk while it is in the cache. On the CPU the chunks go through
  a native 256-entry table lookup (the `raylm::dequantize_blocks` op, fp32 and bf16),
  which ran ~6x faster than PyTorch's fp8 cast. Against unquantized bf16 (packed GEMMs,
  fused decode) the ~100M Llama decoded at 0.46-0.48x the tokens/s with the native kernel and
  0.11-0.23x with chunks alone (docs/quantization.md).

`fp8_linear_reference` is the PyTorch reference both are checked against.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from raylm.engine import envs
from raylm.kernels import cpu_ops
from raylm.kernels.native_build import load_native_library

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# A scale is never below this: an all-zero weight or token quantizes to zeros, not NaNs.
_MIN_SCALE = 1e-12
# Elements of one dequantized chunk of a W8A16 weight (1 MiB in bf16): the chunk is written
# and read straight back by the GEMM, so it should stay in the core's L2.
_DEQUANT_CHUNK_ELEMENTS = 2**19
# Tokens up to which the CPU takes the native FP8 kernel (decode batches); above, the
# dequantized chunks go through oneDNN, whose GEMM wins once the weight is reused enough.
NATIVE_MAX_ROWS = 32
# None: not tried yet; else whether csrc/cpu_fp8_linear.cpp is built and allowed.
_native_usable: bool | None = None


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, 0-d float32 scale): scale = amax(|weight|) / 448 (vLLM's dynamic
    per-tensor quantization, what `quantization="fp8"` does to a 16/32-bit checkpoint)."""
    scale = (weight.abs().amax().float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x, float32 scales [rows, 1]) for x [rows, features]: each row by its own
    amax / 448 (vLLM's dynamic per-token activation scales)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x divided by a checkpoint's static input_scale, saturated, in fp8."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the fp8 one stands for, `weight.float() * scale` of each element's row or
    block, in `dtype`."""
    return (weight.float() * _expanded_scale(scale, block_size, weight.shape)).to(dtype)


def _expanded_scale(scale: torch.Tensor, block_size: tuple[int, int] | None, shape: torch.Size) -> torch.Tensor:
    """The scale broadcast against a weight (or rows of one) of `shape`."""
    if block_size is not None:
        rows, columns = block_size
        return (scale.repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(columns, 1)[:, :shape[1]])
    return scale.reshape(-1, 1) if scale.dim() == 1 else scale


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         block_size: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, quantize_input: bool = False) -> torch.Tensor:
    """The product in float32, from the dequantized weight; with quantize_input, x quantized
    and dequantized first (by input_scale, else per token), as a W8A8 GEMM sees it."""
    x = x.float()
    if quantize_input:
        if input_scale is None:
            x_q, x_scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
            x = (x_q.float() * x_scale).reshape(x.shape)
        else:
            x = quantize_static(x, input_scale).float() * input_scale
    return F.linear(x, dequantize(weight, weight_scale, block_size), None if bias is None else bias.float())


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether `device` multiplies fp8 matrices: a CUDA GPU of compute capability 8.9 or up."""
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once (layers ask on every call)."""
    return torch.cuda.get_device_capability(index)


def apply_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block_size: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, weight_only: bool = False) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` in x's dtype: W8A8 where `uses_w8a8` says so
    (never for a `weight_only` checkpoint, whose activations stay as they are), else the
    chunked W8A16 GEMM."""
    if not weight_only and uses_w8a8(x, weight, block_size):
        return _w8a8_linear(x, weight, weight_scale, input_scale, bias)
    return _w8a16_linear(x, weight, weight_scale, block_size, bias)


def uses_w8a8(x: torch.Tensor, weight: torch.Tensor, block_size: tuple[int, int] | None) -> bool:
    """Whether `apply_fp8_linear` multiplies in fp8: per-tensor or per-row scales on a GPU
    with fp8 GEMMs, at shapes `torch._scaled_mm` takes (features multiples of 16)."""
    return (block_size is None and scaled_mm_supported(x.device) and x.dtype in (torch.bfloat16, torch.float16)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


def native_fp8_linear_usable() -> bool:
    """Whether the native FP8 decode kernel (csrc/cpu_fp8_linear.cpp) is built here and not
    switched off (RAYLM_TEST_DISABLE_KERNELS=fp8_linear)."""
    global _native_usable
    if _native_usable is None:
        _native_usable = (not envs.kernel_switched_off("fp8_linear")
                          and load_native_library("cpu_fp8_linear") is not None)
    return _native_usable


def _w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  block_size: tuple[int, int] | None, bias: torch.Tensor | None) -> torch.Tensor:
    out_features, in_features = weight.shape
    rows = x.numel() // in_features if in_features else 0
    if (block_size is None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and 0 < rows <= NATIVE_MAX_ROWS and weight.is_contiguous() and native_fp8_linear_usable()):
        # Decode batches: the weight streamed at one byte an element, widened in registers.
        out = torch.ops.raylm.fp8_linear(x.reshape(rows, in_features).float().contiguous(), weight.view(torch.uint8),
                                         weight_scale.float().reshape(-1).contiguous()).to(x.dtype)
        out = out.reshape(*x.shape[:-1], out_features)
        return out if bias is None else out + bias
    chunk_rows = max(1, _DEQUANT_CHUNK_ELEMENTS // max(1, in_features))
    if block_size is not None:
        chunk_rows = max(block_size[0], chunk_rows - chunk_rows % block_size[0])
    # Per-tensor and per-row scales multiply the products (fewer elements than the weight
    # at decode sizes); fp16 takes them on the weight, where raw fp8 values (up to 448)
    # summed over many features could overflow it; blocks always do.
    scale_output = block_size is None and x.dtype != torch.float16
    table = _fp8_table(x.dtype) if x.device.type == "cpu" and weight.is_contiguous() and cpu_ops.usable(x) else None
    parts = []
    for start in range(0, out_features, chunk_rows):
        rows = weight[start:start + chunk_rows]
        if table is not None:
            # The native table lookup, several times faster than PyTorch's fp8 cast.
            ids = torch.arange(start, start + rows.shape[0])
            rows = torch.ops.raylm.dequantize_blocks(weight.view(torch.uint8), ids, table)
        scale = weight_scale
        if block_size is not None:
            scale = weight_scale[start // block_size[0]:-(-(start + rows.shape[0]) // block_size[0])]
        elif weight_scale.dim() == 1:
            scale = weight_scale[start:start + rows.shape[0]]
        if scale_output:
            part = F.linear(x, rows.to(x.dtype)) * scale.to(x.dtype)
        else:
            part = F.linear(x, (rows.float() * _expanded_scale(scale, block_size, rows.shape)).to(x.dtype))
        parts.append(part)
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out if bias is None else out + bias


@functools.cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The 256 float8_e4m3fn values, by bit pattern, in `dtype` (exact: e4m3 fits bf16 and fp32)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(dtype)


def _w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """torch._scaled_mm over fp8 activations and weights: tensor-wise scales where both are
    one number, row-wise (a scale per token and per output feature) on Hopper and later,
    else the fp8 product in float32 scaled afterwards (vLLM's fallback for Ada)."""
    leading = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is None:
        x_q, x_scale = quantize_per_token(x2)
    else:
        x_q, x_scale = quantize_static(x2, input_scale), input_scale.reshape(()).float()
    weight_t = weight.t()  # column-major, as _scaled_mm wants its second operand
    if x_scale.numel() == 1 and weight_scale.numel() == 1:
        out = torch._scaled_mm(x_q, weight_t, scale_a=x_scale, scale_b=weight_scale.reshape(()).float(),
                               bias=bias, out_dtype=x.dtype)
        return out.reshape(*leading, -1)
    row_scale = weight_scale.float().reshape(1, -1).expand(1, weight.shape[0]).contiguous()
    token_scale = x_scale.float().reshape(-1, 1).expand(x2.shape[0], 1).contiguous()
    if _capability(x.device.index) >= (9, 0) and x.dtype == torch.bfloat16:
        out = torch._scaled_mm(x_q, weight_t, scale_a=token_scale, scale_b=row_scale, out_dtype=x.dtype)
    else:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        out = (torch._scaled_mm(x_q, weight_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
               * token_scale * row_scale).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*leading, -1)
