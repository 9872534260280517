"""The fused pointwise ops of a decoder layer on CUDA, in Triton: the residual add with the
RMSNorm that follows it, plain RMSNorm (Llama's `weight` and Gemma's `1 + weight`),
SiLU-and-mul of the fused gate/up projection, and the rotary embedding of queries and keys
in place. Each is one launch where PyTorch's eager ops take two to five (vLLM runs its own
CUDA kernels for the same four ops). The rotary launch also takes what surrounds it in an
attention layer: Qwen3's per-head q/k RMSNorms before it and the KV-cache write after it
(the keys it rotated and the values), so a decode layer launches ten kernels
(tests/test_decode_launches.py).

They round where the PyTorch path of `models/` rounds, so that greedy tokens stay those of
Hugging Face: the residual sum in the model dtype before the norm, the norm in fp32 and once
at the end, SiLU's result in the model dtype before the multiply, each rotary product in
the model dtype before the sum. Sums of squares differ from PyTorch's only in their order.

CUDA-graph safe: no host reads, outputs sized by input shapes only. The number of rows is
the launch grid, never an argument, so a step's batch size compiles nothing new; what a
kernel specialises on (dtype, hidden size, row strides) is fixed by the model, and the
engine's warm-up steps compile it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raylm.kernels.kv_cache_dtype import triton_fp8_format
from raylm.kernels.triton_paged_kv import fp8_encode

# The widest row the norm kernels keep in registers in one pass (at 16 warps, 32 fp32
# values a thread); a wider one is left to PyTorch (`rms_norm_supported`).
MAX_NORM_HIDDEN = 16384
SILU_BLOCK = 1024
ROTARY_HEADS_PER_PROGRAM = 8


def norm_tiles(hidden: int) -> dict:
    """The norm kernel's launch for rows of `hidden` values: the whole row a program, 8 to
    16 values a thread."""
    block = triton.next_power_of_2(hidden)
    return dict(BLOCK=block, num_warps=min(16, max(1, block // 256)))


def rotary_tiles(rotary_dim: int) -> dict:
    """The rotary kernel's launch: ROTARY_HEADS_PER_PROGRAM heads a program, each head's
    rotary_dim / 2 pairs."""
    block_r = triton.next_power_of_2(rotary_dim // 2)
    # No FMA contraction: Triton turns each product rounded to bf16/fp16 into a native
    # 16-bit multiply and would fuse it with the sum (PTX fma.rn.bf16), rounding once where
    # PyTorch rounds twice (a quarter of bf16 outputs one unit off on an H100); in fp32 the
    # same holds for fp32 FMAs.
    return dict(HALF_ROTARY=rotary_dim // 2, BLOCK_R=block_r, BLOCK_H=ROTARY_HEADS_PER_PROGRAM,
                num_warps=4 if block_r * ROTARY_HEADS_PER_PROGRAM >= 512 else 2, enable_fp_fusion=False)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_residual, stride_out, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row. With a residual: residual = x + residual (rounded to the model
    # dtype, as PyTorch's add is), then out = norm(residual); out may be x itself.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * stride_residual + cols
        total = x + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)
        total = total.to(residual_ptr.dtype.element_ty)
        tl.store(residual_row, total, mask=mask)
        x = total.to(tl.float32)
    mean_square = tl.math.div_rn(tl.sum(x * x, axis=0), hidden.to(tl.float32))
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_OFFSET:  # Gemma: the checkpoint stores weight - 1
        weight = weight + 1.0
    out = (x * rstd) * weight
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr):
    # Program (row, column block): silu(x[row, :d]) * x[row, d:], SiLU rounded to the model
    # dtype before the multiply as PyTorch's two ops round.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rotary_embedding_kernel(positions_ptr, query_ptr, key_ptr, cos_sin_cache_ptr, stride_query, stride_key,
                             stride_cache, num_query_heads, num_key_heads, query_head_blocks,
                             q_norm_ptr, k_norm_ptr, eps,
                             value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_value,
                             stride_kc_block, stride_kc_token, stride_kc_head,
                             stride_vc_block, stride_vc_token, stride_vc_head, k_scale, v_scale,
                             HEAD_SIZE: tl.constexpr, HALF_ROTARY: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_REST: tl.constexpr,
                             CACHE_BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                             KV_FP8: tl.constexpr = False, FP8_MANT: tl.constexpr = 0,
                             FP8_MIN_EXP: tl.constexpr = 0, FP8_MAX: tl.constexpr = 0.0):
    # Program (token, head block): the head blocks of the query first, then the key's, so
    # one launch rotates both. GPT-NeoX layout: channel r of a head's first half turns with
    # channel r of its second half (of the first 2 * HALF_ROTARY channels; the rest stay).
    # QK_NORM (Qwen3): each head is RMS-normalised first (q_norm_ptr's weight for the query,
    # k_norm_ptr's for the key), in place. CACHE_BLOCK_SIZE > 0: the key programs also store
    # their rotated key heads and the same value heads at the token's cache slot (-1: none),
    # as the KV write kernel would (KV_FP8: divided by k_scale / v_scale, rounded to the fp8
    # cache's format and stored as bytes through uint8 views of the caches, `fp8_encode`).
    # BLOCK_REST > 0 covers the channels past the rotary ones, which only the norm and the
    # cache write read.
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    is_key = head_block >= query_head_blocks
    if head_block < query_head_blocks:
        base, stride, num_heads, norm_ptr = query_ptr, stride_query, num_query_heads, q_norm_ptr
    else:
        base, stride, num_heads, norm_ptr = key_ptr, stride_key, num_key_heads, k_norm_ptr
        head_block -= query_head_blocks
    position = tl.load(positions_ptr + token).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < HALF_ROTARY
    cos = tl.load(cos_sin_cache_ptr + position * stride_cache + r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_cache_ptr + position * stride_cache + HALF_ROTARY + r, mask=r_mask,
                  other=0.0).to(tl.float32)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    mask = head_mask[:, None] & r_mask[None, :]
    first = base + token * stride + heads[:, None] * HEAD_SIZE + r[None, :]
    dtype = base.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF_ROTARY, mask=mask, other=0.0).to(tl.float32)
    if BLOCK_REST > 0:
        rest = tl.arange(0, BLOCK_REST)
        rest_mask = head_mask[:, None] & (rest < HEAD_SIZE - 2 * HALF_ROTARY)[None, :]
        rest_ptrs = base + token * stride + heads[:, None] * HEAD_SIZE + 2 * HALF_ROTARY + rest[None, :]
        x3 = tl.load(rest_ptrs, mask=rest_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        # As the RMSNorm kernel rounds: the norm in fp32, rounded to the model dtype once.
        square_sum = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if BLOCK_REST > 0:
            square_sum += tl.sum(x3 * x3, axis=1)
        mean_square = tl.math.div_rn(square_sum, tl.full(square_sum.shape, HEAD_SIZE, tl.float32))
        rstd = tl.math.div_rn(tl.full(square_sum.shape, 1.0, tl.float32), tl.sqrt_rn(mean_square + eps))
        w1 = tl.load(norm_ptr + r, mask=r_mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF_ROTARY + r, mask=r_mask, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd[:, None]) * w1[None, :]).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd[:, None]) * w2[None, :]).to(dtype).to(tl.float32)
        if BLOCK_REST > 0:
            w3 = tl.load(norm_ptr + 2 * HALF_ROTARY + rest, mask=rest < HEAD_SIZE - 2 * HALF_ROTARY,
                         other=0.0).to(tl.float32)
            x3 = ((x3 * rstd[:, None]) * w3[None, :]).to(dtype).to(tl.float32)
            tl.store(rest_ptrs, x3.to(dtype), mask=rest_mask)
    # Each product rounded to the model dtype, as PyTorch's x1 * cos - x2 * sin rounds.
    x1_cos = (x1 * cos[None, :]).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin[None, :]).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos[None, :]).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin[None, :]).to(dtype).to(tl.float32)
    out1 = (x1_cos - x2_sin).to(dtype)
    out2 = (x2_cos + x1_sin).to(dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF_ROTARY, out2, mask=mask)
    if CACHE_BLOCK_SIZE > 0:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if is_key:
            if slot >= 0:
                cache_block = slot // CACHE_BLOCK_SIZE
                offset = slot % CACHE_BLOCK_SIZE
                k_row = (k_cache_ptr + cache_block * stride_kc_block + offset * stride_kc_token
                         + heads[:, None] * stride_kc_head)
                k_dtype = k_cache_ptr.dtype.element_ty
                if KV_FP8:
                    k1 = fp8_encode(out1.to(tl.float32), k_scale, FP8_MANT, FP8_MIN_EXP, FP8_MAX)
                    k2 = fp8_encode(out2.to(tl.float32), k_scale, FP8_MANT, FP8_MIN_EXP, FP8_MAX)
                else:
                    k1, k2 = out1.to(k_dtype), out2.to(k_dtype)
                tl.store(k_row + r[None, :], k1, mask=mask)
                tl.store(k_row + HALF_ROTARY + r[None, :], k2, mask=mask)
                if BLOCK_REST > 0:
                    if KV_FP8:
                        k3 = fp8_encode(x3.to(dtype).to(tl.float32), k_scale, FP8_MANT, FP8_MIN_EXP, FP8_MAX)
                    else:
                        k3 = x3.to(dtype).to(k_dtype)
                    tl.store(k_row + 2 * HALF_ROTARY + rest[None, :], k3, mask=rest_mask)
                d = tl.arange(0, BLOCK_D)
                v_mask = head_mask[:, None] & (d < HEAD_SIZE)[None, :]
                value = tl.load(value_ptr + token * stride_value + heads[:, None] * HEAD_SIZE + d[None, :],
                                mask=v_mask)
                if KV_FP8:
                    value = fp8_encode(value.to(tl.float32), v_scale, FP8_MANT, FP8_MIN_EXP, FP8_MAX)
                else:
                    value = value.to(v_cache_ptr.dtype.element_ty)
                v_row = (v_cache_ptr + cache_block * stride_vc_block + offset * stride_vc_token
                         + heads[:, None] * stride_vc_head)
                tl.store(v_row + d[None, :], value, mask=v_mask)


# ---- launchers ----------------------------------------------------------------------------

def rms_norm_supported(x: torch.Tensor) -> bool:
    """Whether the norm kernels take rows of x: 2-D, unit column stride, at most
    MAX_NORM_HIDDEN wide."""
    return x.dim() == 2 and x.stride(1) == 1 and x.shape[1] <= MAX_NORM_HIDDEN


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """rms_norm(x) * (weight + weight_offset) for x [T, H] (rows may be strided), a new
    contiguous tensor of x's dtype; weight_offset 1.0 is Gemma's norm."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, None, weight, out, eps, weight_offset)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x (in residual's dtype), then x = rms_norm(residual) *
    (weight + weight_offset); returns (x, residual), x [T, H] and residual of one shape."""
    assert x.shape == residual.shape and residual.stride(1) == 1, (x.shape, residual.shape)
    _launch_norm(x, residual, weight, x, eps, weight_offset)
    return x, residual


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float,
                 weight_offset: float) -> None:
    assert rms_norm_supported(x) and weight.shape == (x.shape[1],) and weight.is_contiguous()
    assert weight_offset in (0.0, 1.0), weight_offset
    rows, hidden = x.shape
    if rows == 0:
        return
    _rms_norm_kernel[(rows,)](
        x, x if residual is None else residual, weight, out, x.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, WEIGHT_OFFSET=weight_offset == 1.0, **norm_tiles(hidden))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [T, 2d] (rows may be strided): a new [T, d] tensor."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, (x.shape, x.stride())
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(d, SILU_BLOCK))](x, out, x.stride(0), out.stride(0), d,
                                                                 BLOCK=SILU_BLOCK, num_warps=4)
    return out


def rotary_embedding_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                      cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int, *,
                      qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                      kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Rotates query [T, Hq * head_size] and key [T, Hk * head_size] (or query alone) in
    place by positions [T] (int64 or int32), GPT-NeoX layout over the first rotary_dim
    channels of each head; cos_sin_cache [max_position, rotary_dim] holds the cos of each
    frequency, then the sin. Rows may be strided (column slices of a fused QKV output).
    A position past the cache's rows is not checked here (that would read back to the host):
    the engine bounds positions by max_model_len, which the cache covers.

    In the same launch: qk_norm (q_weight [head_size], k_weight [head_size], eps) first
    RMS-normalises every query and key head in place (Qwen3's q_norm and k_norm); kv_cache
    (value [T, Hk * head_size], k_cache, v_cache [num_blocks, block_size, Hk, head_size],
    slot_mapping [T]) then stores the rotated keys and the values at their slots as
    `triton_kv_cache.write_kv_cache` does (slot -1: not stored; an fp8 cache stores them
    divided by k_scale, v_scale and rounded to its format). Both need key."""
    tensors = [query] if key is None else [query, key]
    for x in tensors:
        assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % head_size == 0, (x.shape, x.stride())
        assert x.shape[0] == positions.shape[0] and x.dtype == query.dtype
    assert rotary_dim % 2 == 0 and rotary_dim <= head_size and cos_sin_cache.stride(1) == 1
    assert key is not None or (qk_norm is None and kv_cache is None)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    query_heads = query.shape[1] // head_size
    key_heads = 0 if key is None else key.shape[1] // head_size
    query_blocks = triton.cdiv(query_heads, ROTARY_HEADS_PER_PROGRAM)
    key_blocks = triton.cdiv(key_heads, ROTARY_HEADS_PER_PROGRAM)
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (query, query, 0.0)
    if qk_norm is not None:
        assert q_weight.shape == k_weight.shape == (head_size,) and q_weight.is_contiguous() and k_weight.is_contiguous()
    value, k_cache, v_cache, slot_mapping = kv_cache if kv_cache is not None else (query, query, query, positions)
    fp8 = triton_fp8_format(k_cache.dtype)
    if fp8["KV_FP8"]:
        assert v_cache.dtype == k_cache.dtype
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)  # written as bytes
    cache_strides = (0,) * 6
    if kv_cache is not None:
        assert value.shape == key.shape and value.stride(1) == 1 and slot_mapping.shape == (num_tokens,)
        assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (key_heads, head_size)
        assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
        cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    rest = head_size - rotary_dim
    reads_rest = rest > 0 and (qk_norm is not None or kv_cache is not None)
    _rotary_embedding_kernel[(num_tokens, query_blocks + key_blocks)](
        positions, query, query if key is None else key, cos_sin_cache, query.stride(0),
        query.stride(0) if key is None else key.stride(0), cos_sin_cache.stride(0), query_heads, key_heads,
        query_blocks, q_weight, k_weight, eps, value, k_cache, v_cache, slot_mapping, value.stride(0), *cache_strides,
        float(k_scale), float(v_scale),
        HEAD_SIZE=head_size, QK_NORM=qk_norm is not None, BLOCK_REST=triton.next_power_of_2(rest) if reads_rest else 0,
        CACHE_BLOCK_SIZE=k_cache.shape[1] if kv_cache is not None else 0,
        BLOCK_D=triton.next_power_of_2(head_size), **rotary_tiles(rotary_dim), **fp8)
