"""Triton KV-cache write: scatter this step's keys and values into their paged-cache slots.

Same contract as `raylm.kernels.torch_attention.write_kv_cache`. Cache layout (one pair per
layer): [num_blocks, block_size, num_kv_heads, head_size]; flat slot
= block_id * block_size + offset; slot -1 marks a padding token, which is not written.
An fp8 cache stores key / k_scale and value / v_scale rounded to its format
(`raylm.kernels.kv_cache_dtype`), written as bytes through a uint8 view (`fp8_encode`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raylm.kernels.kv_cache_dtype import triton_fp8_format
from raylm.kernels.triton_paged_kv import fp8_encode


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head, k_scale, v_scale,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr = False, FP8_MANT: tl.constexpr = 0, FP8_MIN_EXP: tl.constexpr = 0,
    FP8_MAX: tl.constexpr = 0.0,
):
    # One program per (token, kv head): a head_size row is the unit of contiguous memory.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    # Strides rather than slot * row_size: the key/value views the attention layer passes
    # come out of a fused QKV projection and are not contiguous.
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    key = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=d_mask)
    value = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=d_mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_token + head * stride_kc_head + d
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_token + head * stride_vc_head + d
    if KV_FP8:
        # The caches come as uint8 views: the bytes are built in integers (`fp8_encode`).
        tl.store(k_dst, fp8_encode(key.to(tl.float32), k_scale, FP8_MANT, FP8_MIN_EXP, FP8_MAX), mask=d_mask)
        tl.store(v_dst, fp8_encode(value.to(tl.float32), v_scale, FP8_MANT, FP8_MIN_EXP, FP8_MAX), mask=d_mask)
    else:
        tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
        tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=d_mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Stores this step's keys and values [T, Hkv, D] at their flat slots; slot -1 (padding
    tokens) is skipped. Any power-of-two block size. k_scale, v_scale: an fp8 cache's."""
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = k_cache.shape[1]
    assert k_cache.shape[2:] == (num_kv_heads, head_size) and v_cache.shape == k_cache.shape
    assert v_cache.dtype == k_cache.dtype
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    # The last dimension is read as a contiguous row.
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if num_tokens == 0:
        return
    fp8 = triton_fp8_format(k_cache.dtype)
    if fp8["KV_FP8"]:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _write_kv_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), float(k_scale), float(v_scale),
        HEAD_SIZE=head_size, BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(head_size), **fp8,
    )
