"""In-kernel pieces the Triton paged attention kernels share (decode and prefill/extend):
one K/V tile read through a sequence's block table, its scores against the program's
queries, Gemma 2's soft cap, and the bytes of an fp8 KV cache's values (`fp8_encode`).
`@triton.jit` functions called from a kernel are inlined into it at compile time, so each
kernel compiles to what it did with the code written out."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap_scores(s, cap):
    """cap * tanh(s / cap) for scores s in the kernels' log2 units and cap in the same units,
    through exp2 (e = exp(-2|s| / cap) <= 1: nothing overflows)."""
    e = tl.exp2(tl.abs(s) * (-2.0 * 1.4426950408889634 / cap))
    magnitude = cap * (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -magnitude, magnitude)


@triton.jit
def fp8_encode(x, scale, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr):
    """The fp8 byte (tl.uint8) that `raylm.kernels.kv_cache_dtype.quantize` stores for x
    (fp32): x / scale (scale > 0) divided exactly, saturated to +-FP8_MAX, rounded to the
    nearest value of the format (ties to even; FP8_MANT mantissa bits, smallest normal
    exponent FP8_MIN_EXP, subnormals below it); NaN is 0x7F with x's sign, as PyTorch's cast
    gives. Callers store the byte through a uint8 view of the cache.

    Everything after the division is integer arithmetic on the fp32 bits, and the byte is
    built here rather than by a cast to Triton's fp8 type: Triton's interpreter (3.9) rounds
    fp32 -> fp8 casts wrongly (7.93 became 4.0 in e4m3), and on an H100 (Triton 3.6) an e4m3
    cache written by rounding here and casting after differed from PyTorch's bytes (the
    cause not isolated there); integer arithmetic means the same on every target. The
    division is tl.math.div_rn (PTX div.rn.f32): Triton compiles `a / b` in fp32 to
    div.full.f32, up to 2 ulp off, which moves a quotient within an ulp of a rounding
    midpoint to the wrong side."""
    y = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * scale)
    sign = tl.where(x.to(tl.int32, bitcast=True) < 0, 0x80, 0)  # scale > 0: x's sign, NaN's too
    is_nan = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    # Saturation on the bits: for non-negative floats (inf included) the order of the bit
    # patterns is the order of the values.
    max_bits = tl.full(x.shape, FP8_MAX, tl.float32).to(tl.int32, bitcast=True)
    magnitude = tl.minimum(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, max_bits)
    exponent = (magnitude >> 23) - 127
    significand = (magnitude & 0x7FFFFF) | 0x800000  # value = significand * 2^(exponent - 23)
    # The grid's step is 2^(e - FP8_MANT) for e = max(exponent, FP8_MIN_EXP) (subnormals
    # share the smallest normal's step); 25 bits or more of shift round everything to 0.
    grid_exponent = tl.maximum(exponent, FP8_MIN_EXP)
    shift = tl.minimum(23 - FP8_MANT + grid_exponent - exponent, 25)
    # Round half to even: add just under half a step, plus one when the kept part is odd.
    steps = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    # steps is the value in grid steps: 2^FP8_MANT up to 2^(FP8_MANT+1) (a carry) for a normal
    # value, its implicit leading one adding the 1 of the biased exponent; 0 up to 2^FP8_MANT
    # for a subnormal, whose code it is. A carry moves to the next exponent by itself, and
    # FP8_MAX, on the grid, is never rounded past.
    code = (tl.maximum(exponent - FP8_MIN_EXP, 0) << FP8_MANT) + steps
    return (tl.where(is_nan, 0x7F, code) | sign).to(tl.uint8)


@triton.jit
def paged_kv_tile_scores(
    q, qk_scale, block_table, k_cache_ptr, v_cache_ptr, tile_start, end, kv_head, d, d_mask,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr,
    MASK_N: tl.constexpr = True, MASK_D: tl.constexpr = True, KV_FP8: tl.constexpr = False,
):
    """The BLOCK_N positions from tile_start (pos, and n_mask: those before `end`), their V
    tile, and the scores of the queries q [rows, BLOCK_D] against their keys, scaled by
    qk_scale (log2 units) and soft-capped where SOFT_CAP > 0: [rows, BLOCK_N]. Positions at
    or past `end` read nothing; their scores are for the caller to mask.

    A caller that knows the whole tile lies before `end` passes MASK_N=False, and one whose
    head size fills BLOCK_D passes MASK_D=False: those loads carry no mask at all (n_mask
    is then all true), which keeps them 16-byte vectors the compiler can pipeline.

    KV_FP8: the cache holds fp8; its tiles are upcast (exactly) to the query's dtype before
    the dots, and the caller folds k_scale into qk_scale and v_scale into its output."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    n_mask = pos < end
    offset = pos % BLOCK_SIZE
    if MASK_N:
        physical = tl.load(block_table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        physical = tl.load(block_table + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]  # broadcast over the rows by the loads
    # One int64 offset per key row (the slot's place in the cache), the head's columns added
    # last: the cache can pass 2^31 elements, a row's columns never do.
    k_rows = physical * stride_kc_block + offset * stride_kc_token + kv_head * stride_kc_head
    v_rows = physical * stride_vc_block + offset * stride_vc_token + kv_head * stride_vc_head
    if MASK_N or MASK_D:
        # Masked loads keep never-written slots (garbage, NaN) out of the arithmetic.
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :])
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :])
    if KV_FP8:
        # Every fp8 value is exact in fp16, bf16 and fp32; tl.dot takes no fp8 x 16-bit mix.
        k = k.to(tl.float32).to(q.dtype)
        v = v.to(tl.float32).to(q.dtype)
    elif DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFT_CAP > 0:
        s = soft_cap_scores(s, SOFT_CAP * 1.4426950408889634)
    return pos, n_mask, s, v
