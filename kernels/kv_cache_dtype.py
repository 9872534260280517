"""The KV cache's storage format (vLLM's `kv_cache_dtype`): the model's dtype ("auto"), or
fp8 with one scale per layer for keys and one for values (`k_scale`, `v_scale`).

An fp8 cache stores x / scale rounded to nearest (ties to even) and saturated to the
format's largest finite value (448 for e4m3, 57344 for e5m2), as vLLM's cache kernels do;
attention reads it back as fp8 * scale and computes in fp32 (or, on a GPU, dots in the
query's 16-bit dtype, which holds every fp8 value exactly, with the scales applied to the
fp32 scores and outputs). The scales are 1.0 unless the checkpoint carries them.

`quantize` and `dequantize` are the PyTorch definitions every kernel is checked against.
"""

from __future__ import annotations

import torch

# vLLM's choices; "fp8" is e4m3 (vLLM's meaning on CUDA).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """kv_cache_dtype itself, or a ValueError naming the value and the choices."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}.")
    return kv_cache_dtype


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the KV cache tensors are allocated in."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype == "auto" else _FP8_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_CACHE_DTYPES


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `dtype` stores it: for fp8, x / scale in fp32, saturated to the
    format's range, rounded to nearest; otherwise a plain cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    # The divisor is a tensor on x's device: on CUDA, PyTorch divides by a Python (CPU)
    # scalar as a multiply by its reciprocal, one fp32 bit off now and then, which moves a
    # value on a rounding boundary to the next fp8 step (2-3 of 4M values, emulated on the
    # CPU); the Triton kernels divide exactly.
    divisor = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What attention reads from a cache tensor: fp32, times the scale for fp8."""
    return x.float() * scale if is_fp8(x.dtype) else x.float()


def triton_fp8_format(dtype: torch.dtype) -> dict:
    """The Triton kernels' compile-time description of a cache dtype (`fp8_round`): KV_FP8
    off for 16/32-bit caches; else the format's mantissa bits, smallest normal exponent and
    largest finite value."""
    if not is_fp8(dtype):
        return dict(KV_FP8=False, FP8_MANT=0, FP8_MIN_EXP=0, FP8_MAX=0.0)
    mant, min_exp = (3, -6) if dtype == torch.float8_e4m3fn else (2, -14)
    return dict(KV_FP8=True, FP8_MANT=mant, FP8_MIN_EXP=min_exp, FP8_MAX=float(torch.finfo(dtype).max))
