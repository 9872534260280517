"""The fused pointwise ops of a decoder layer on CUDA, in Triton: the residual add with the
RMSNorm that follows it, plain RMSNorm (Llama's `weight` and Gemma's `1 + weight`),
SiLU-and-mul of the fused gate/up projection, and the rotary embedding of queries and keys
in place. Each is one launch where PyTorch's eager ops take two to five (vLLM runs its own
CUDA kernels for the same four ops).

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
                             HEAD_SIZE: tl.constexpr, HALF_ROTARY: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_H: tl.constexpr):
    # Program (token, head block): the head blocks of the query first, then the key's, so
    # one launch rotates both. GPT-NeoX layout: channel r of a head's first half turns with
    # channel r of its second half (of the first 2 * HALF_ROTARY channels; the rest stay).
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    if head_block < query_head_blocks:
        base, stride, num_heads = query_ptr, stride_query, num_query_heads
    else:
        base, stride, num_heads = key_ptr, stride_key, num_key_heads
        head_block -= query_head_blocks
    position = tl.load(positions_ptr + token).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < HALF_ROTARY
    cos = tl.load(cos_sin_cache_ptr + position * stride_cache + r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_cache_ptr + position * stride_cache + HALF_ROTARY + r, mask=r_mask,
                  other=0.0).to(tl.float32)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & r_mask[None, :]
    first = base + token * stride + heads[:, None] * HEAD_SIZE + r[None, :]
    dtype = base.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF_ROTARY, mask=mask, other=0.0).to(tl.float32)
    # Each product rounded to the model dtype, as PyTorch's x1 * cos - x2 * sin rounds.
    x1_cos = (x1 * cos[None, :]).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin[None, :]).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos[None, :]).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin[None, :]).to(dtype).to(tl.float32)
    tl.store(first, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(first + HALF_ROTARY, (x2_cos + x1_sin).to(dtype), mask=mask)


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
                      cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int) -> None:
    """Rotates query [T, Hq * head_size] and key [T, Hk * head_size] (or query alone) in
    place by positions [T] (int64 or int32), GPT-NeoX layout over the first rotary_dim
    channels of each head; cos_sin_cache [max_position, rotary_dim] holds the cos of each
    frequency, then the sin. Rows may be strided (column slices of a fused QKV output).
    A position past the cache's rows is not checked here (that would read back to the host):
    the engine bounds positions by max_model_len, which the cache covers."""
    tensors = [query] if key is None else [query, key]
    for x in tensors:
        assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % head_size == 0, (x.shape, x.stride())
        assert x.shape[0] == positions.shape[0] and x.dtype == query.dtype
    assert rotary_dim % 2 == 0 and rotary_dim <= head_size and cos_sin_cache.stride(1) == 1
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    query_heads = query.shape[1] // head_size
    key_heads = 0 if key is None else key.shape[1] // head_size
    query_blocks = triton.cdiv(query_heads, ROTARY_HEADS_PER_PROGRAM)
    key_blocks = triton.cdiv(key_heads, ROTARY_HEADS_PER_PROGRAM)
    _rotary_embedding_kernel[(num_tokens, query_blocks + key_blocks)](
        positions, query, query if key is None else key, cos_sin_cache, query.stride(0),
        query.stride(0) if key is None else key.stride(0), cos_sin_cache.stride(0), query_heads, key_heads,
        query_blocks, HEAD_SIZE=head_size, **rotary_tiles(rotary_dim))
