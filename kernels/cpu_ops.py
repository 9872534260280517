"""Fused CPU versions of a decoder layer's small ops (`csrc/cpu_ops.cpp`).

At decode batch sizes a layer's RMSNorms, SiLU-and-multiply, rotary embedding and KV write
are each a handful of PyTorch elementwise ops whose dispatch costs more than their
arithmetic; one C++ pass each saves about 1.5 ms of a 10 ms decode step of the benchmark
Llama. The layers call `usable(...)` and keep their PyTorch code for everything it
rejects: non-CPU or non-fp32 tensors, autograd, a machine where the library cannot be built.
"""

from __future__ import annotations

import ctypes
import os

import torch

from raylm.kernels.native_build import load_native_library

# Set RAYLM_CPU_FUSED_OPS=0 to run the PyTorch ops instead (for comparisons).
ENV_VAR = "RAYLM_CPU_FUSED_OPS"

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "raylm_fused_add_rms_norm": (None, [_ptr, _ptr, _ptr, _i64, _i64, _f32]),
    "raylm_rms_norm": (None, [_ptr, _ptr, _ptr, _i64, _i64, _f32]),
    "raylm_silu_and_mul": (None, [_ptr, _ptr, _i64, _i64]),
    "raylm_rotary_embedding": (None, [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64]),
    "raylm_write_kv_cache": (_i64, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64]),
}

# None: not tried yet; False: unavailable; else the library with its signatures set.
_library = None


def _load() -> ctypes.CDLL | None:
    global _library
    if _library is None:
        library = None if os.environ.get(ENV_VAR) == "0" else load_native_library("cpu_ops")
        if library is not None:
            for name, (restype, argtypes) in _SIGNATURES.items():
                function = getattr(library, name)
                function.restype, function.argtypes = restype, argtypes
        _library = library or False
    return _library or None


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops can take these tensors: all fp32 on the CPU, none needing
    gradients, and the library built."""
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or tensor.requires_grad:
            return False
    return _load() is not None


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, then x = rms_norm(residual) * weight; returns (x, residual).
    x, residual [T, H] contiguous."""
    assert x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
    hidden = x.shape[-1]
    assert weight.is_contiguous() and weight.numel() == hidden
    _load().raylm_fused_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // hidden,
                                     hidden, eps)
    return x, residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight over the last dimension, in a new tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    assert weight.is_contiguous() and weight.numel() == hidden
    _load().raylm_rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.numel() // hidden, hidden, eps)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d], in a new tensor."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = x.new_empty(x.shape[:-1] + (d,))
    _load().raylm_silu_and_mul(out.data_ptr(), x.data_ptr(), x.numel() // (2 * d), d)
    return out


def rotary_embedding_(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int,
                      rotary_dim: int) -> torch.Tensor:
    """Rotates x [T, H * head_size] in place (GPT-NeoX layout, the first rotary_dim channels
    of each head) by positions [T]; x may be a column slice of a wider tensor. Returns x."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % head_size == 0
    assert cos_sin_cache.is_contiguous() and cos_sin_cache.shape[1] == rotary_dim
    positions = positions.to(torch.int64).contiguous()
    if positions.numel() and int(positions.max()) >= cos_sin_cache.shape[0]:
        raise ValueError(f"position {int(positions.max())} is beyond the rotary table's "
                         f"{cos_sin_cache.shape[0]} positions.")
    _load().raylm_rotary_embedding(x.data_ptr(), x.stride(0), positions.data_ptr(), cos_sin_cache.data_ptr(),
                                   x.shape[0], x.shape[1] // head_size, head_size, rotary_dim)
    return x


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores key, value [T, Hkv, D] (rows may be strided) at their flat slots of the caches
    [num_blocks, block_size, Hkv, D]; slot -1 skips a row."""
    rows = key.shape[0]
    row_size = k_cache.shape[2] * k_cache.shape[3]
    key2, value2 = key.reshape(rows, row_size), value.reshape(rows, row_size)
    assert key2.stride(1) == 1 and value2.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    status = _load().raylm_write_kv_cache(key2.data_ptr(), key2.stride(0), value2.data_ptr(), value2.stride(0),
                                          k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), rows,
                                          row_size, num_slots)
    if status:
        row = status - 1
        raise ValueError(f"slot_mapping[{row}] = {int(slot_mapping[row])} is outside the KV cache's {num_slots} slots.")
