"""Stage a's check of the fused pointwise Triton kernels (`kernels/triton_elementwise.py`):
RMSNorm plain and with the residual add (Llama's and Gemma's weights), SiLU-and-mul and the
rotary embedding, against a PyTorch reference computed in fp32 on the same inputs, and,
where the kernel promises to round as the PyTorch path of `models/` does, against that path.

Every case also checks what the kernel must leave alone: in place means the same storage,
the columns past a strided view, the values beside the rotated queries and keys, the
channels past a partial rotary dimension. On the CPU the kernels run under Triton's
interpreter (tests/triton_elementwise_cases.py), which truncates fp32 -> bf16 casts where a
GPU rounds to nearest; so the comparison with the PyTorch path counts on a GPU only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# max |kernel - reference| / max |reference|, reference in fp32 on the same (rounded) inputs:
# a few units of the dtype's last place.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# (rows, hidden): Llama-3-8B's 4096, 5120 (no power of two), Qwen2-0.5B's 896, a head size
# (Qwen3's q/k norms); rows of a decode step to those of a prefill. Each program takes one row
# (the grid is rows), so the interpreter's shapes (NORM_SHAPES, ...; each program interpreted
# costs ~10-40 ms on a CPU) stop at 3 rows (more rows are more of the same programs; one
# rotary shape keeps 19: at 3 rows its bf16 fused case's error relative to the largest output,
# a smaller maximum, was 0.0172 against 0.016 allowed) and the GPU's go on to prefill sizes.
NORM_SHAPES = [(1, 4096), (2, 5120), (3, 896), (2, 64)]
GPU_NORM_SHAPES = NORM_SHAPES + [(300, 896), (8192, 4096), (2048, 8192)]
SILU_SHAPES = [(1, 14336), (2, 896), (3, 64)]
GPU_SILU_SHAPES = SILU_SHAPES + [(300, 64), (8192, 14336)]
# (rows, query heads, key heads, head size, rotary dim): GQA 4 and 7, MHA, partial rotary
# (head 80, rotary 40: neither a power of two).
ROTARY_SHAPES = [(1, 32, 8, 128, 128), (2, 14, 2, 64, 64), (19, 4, 4, 64, 32), (2, 12, 4, 80, 40)]
GPU_ROTARY_SHAPES = ROTARY_SHAPES + [(300, 4, 4, 64, 32), (8192, 32, 8, 128, 128), (256, 64, 8, 128, 128)]
# The dry run's: one small case per kernel form (plain and fused norm over a hidden size that
# is no power of two, Gemma's weight; full and partial rotary, GQA): it proves stage a's
# plumbing, while tests/triton_elementwise_cases.py checks every shape above in every dtype
# under the interpreter already.
DRY_NORM_SHAPES = [(2, 896)]
DRY_SILU_SHAPES = [(2, 896)]
DRY_ROTARY_SHAPES = [(1, 8, 2, 64, 64), (2, 12, 4, 80, 40)]
MAX_POSITION = 4096


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def equal_fraction(out: torch.Tensor, torch_path: torch.Tensor) -> float:
    """The share of elements bit-equal to the PyTorch path's."""
    return (out == torch_path).float().mean().item()


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + weight_offset)


def reference_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int,
                     rotary_dim: int) -> torch.Tensor:
    x = x.float().reshape(x.shape[0], -1, head_size)
    cos, sin = cos_sin_cache.float()[positions].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x[..., :rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1).flatten(1)


def torch_path_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int,
                      rotary_dim: int) -> torch.Tensor:
    """What RotaryEmbedding.rotate computes with PyTorch's ops, in the model dtype."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    x = x.reshape(x.shape[0], -1, head_size)
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1).flatten(1)


def cos_sin_cache(max_position: int, rotary_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """As models/rotary_embedding.py builds it: [max_position, rotary_dim], cos then sin."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device, dtype)


def check_rms_norm(ops, rows: int, hidden: int, dtype: torch.dtype, device: torch.device, weight_offset: float,
                   with_residual: bool) -> dict:
    """One norm case on x a strided view (a column slice of a wider tensor)."""
    gen = torch.Generator().manual_seed(rows * hidden + int(with_residual))
    wide = torch.randn(rows, hidden + 16, generator=gen).to(device, dtype)
    x = wide[:, :hidden]
    residual = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype)
    eps = 1e-6
    past_the_slice = wide[:, hidden:].clone()
    result: dict = {}
    if with_residual:
        total = x + residual  # the model dtype's sum, as the PyTorch path rounds it
        expected = reference_rms_norm(total, weight, eps, weight_offset)
        torch_path = _torch_path_norm(total, weight, eps, weight_offset)
        out, new_residual = ops.fused_add_rms_norm(x, residual, weight, eps, weight_offset)
        result["in_place"] = out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
        result["residual_error"] = relative_error(new_residual, total)
    else:
        expected = reference_rms_norm(x, weight, eps, weight_offset)
        torch_path = _torch_path_norm(x, weight, eps, weight_offset)
        out = ops.rms_norm(x, weight, eps, weight_offset)
        result["in_place"] = out.data_ptr() != x.data_ptr()  # a new tensor
    result.update(shape_ok=out.dtype == dtype and tuple(out.shape) == (rows, hidden),
                  untouched=torch.equal(wide[:, hidden:], past_the_slice), rel_error=relative_error(out, expected),
                  torch_path_error=relative_error(out, torch_path), torch_path_equal=equal_fraction(out, torch_path))
    return result


def _torch_path_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    """models/rmsnorm.py's PyTorch path: RMSNorm's F.rms_norm in the model dtype, Gemma's in fp32."""
    if weight_offset == 0.0:
        return F.rms_norm(x, weight.shape, weight, eps)
    return (F.rms_norm(x.float(), weight.shape, eps=eps) * (1.0 + weight.float())).to(x.dtype)


def check_silu_and_mul(ops, rows: int, d: int, dtype: torch.dtype, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(rows + d)
    x = (3 * torch.randn(rows, 2 * d, generator=gen)).to(device, dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate.float()) * up.float()
    torch_path = F.silu(gate) * up
    out = ops.silu_and_mul(x)
    return dict(shape_ok=out.dtype == dtype and tuple(out.shape) == (rows, d), in_place=True, untouched=True,
                rel_error=relative_error(out, expected), torch_path_error=relative_error(out, torch_path),
                torch_path_equal=equal_fraction(out, torch_path))


def check_rotary(ops, rows: int, query_heads: int, key_heads: int, head_size: int, rotary_dim: int,
                 dtype: torch.dtype, device: torch.device, separate_key: bool) -> dict:
    """Queries and keys as column slices of one fused QKV output, rotated as one tensor (the
    Llama layers' call) or as two in one launch (Qwen3's)."""
    gen = torch.Generator().manual_seed(rows * head_size + query_heads + int(separate_key))
    q_size, k_size = query_heads * head_size, key_heads * head_size
    qkv = torch.randn(rows, q_size + 2 * k_size, generator=gen).to(device, dtype)
    positions = torch.randint(0, MAX_POSITION, (rows,), generator=gen).to(device)
    cache = cos_sin_cache(MAX_POSITION, rotary_dim, dtype, device)
    before = qkv.clone()
    if separate_key:
        ops.rotary_embedding_(positions, qkv[:, :q_size], qkv[:, q_size:q_size + k_size], cache, head_size,
                              rotary_dim)
    else:
        ops.rotary_embedding_(positions, qkv[:, :q_size + k_size], None, cache, head_size, rotary_dim)
    rotated, original = qkv[:, :q_size + k_size], before[:, :q_size + k_size]
    heads, original_heads = rotated.reshape(rows, -1, head_size), original.reshape(rows, -1, head_size)
    untouched = (torch.equal(qkv[:, q_size + k_size:], before[:, q_size + k_size:])  # the values
                 and torch.equal(heads[..., rotary_dim:], original_heads[..., rotary_dim:]))
    torch_path = torch_path_rotary(original, positions, cache, head_size, rotary_dim)
    return dict(shape_ok=True, in_place=True, untouched=untouched,
                rel_error=relative_error(rotated, reference_rotary(original, positions, cache, head_size, rotary_dim)),
                torch_path_error=relative_error(rotated, torch_path), torch_path_equal=equal_fraction(rotated, torch_path))


def check_rotary_fused(ops, rows: int, query_heads: int, key_heads: int, head_size: int, rotary_dim: int,
                       dtype: torch.dtype, device: torch.device, qk_norm: bool, block_size: int = 16) -> dict:
    """The rotary kernel with what it fuses in one launch, as the attention layers call it
    on CUDA: q and k column slices of one QKV output, each head RMS-normalised first with
    `qk_norm` (Qwen3), the rotated keys and the values stored at their cache slots (the
    last of several tokens a padding row, slot -1) in a NaN-poisoned paged cache."""
    gen = torch.Generator().manual_seed(rows * head_size + query_heads + 7 * int(qk_norm))
    q_size, k_size = query_heads * head_size, key_heads * head_size
    qkv = torch.randn(rows, q_size + 2 * k_size, generator=gen).to(device, dtype)
    positions = torch.randint(0, MAX_POSITION, (rows,), generator=gen).to(device)
    cache = cos_sin_cache(MAX_POSITION, rotary_dim, dtype, device)
    weights = [(torch.rand(head_size, generator=gen) + 0.5).to(device, dtype) for _ in range(2)]
    eps = 1e-6
    num_blocks = 2 * (-(-rows // block_size)) + 1
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    if rows > 1:
        slot_mapping[-1] = -1  # a padding row
    stored = slot_mapping >= 0
    slot_mapping = slot_mapping.to(device)
    k_cache = torch.full((num_blocks, block_size, key_heads, head_size), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    before = qkv.clone()
    q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + k_size], qkv[:, q_size + k_size:]
    ops.rotary_embedding_(positions, q, k, cache, head_size, rotary_dim,
                          qk_norm=(weights[0], weights[1], eps) if qk_norm else None,
                          kv_cache=(v, k_cache, v_cache, slot_mapping))
    expected, torch_path = [], []
    for part, weight in ((before[:, :q_size], weights[0]), (before[:, q_size:q_size + k_size], weights[1])):
        heads = part.reshape(rows, -1, head_size)
        normed = reference_rms_norm(heads, weight, eps, 0.0) if qk_norm else heads.float()
        path = F.rms_norm(heads, weight.shape, weight, eps) if qk_norm else heads
        expected.append(reference_rotary(normed.flatten(1), positions, cache.float(), head_size, rotary_dim))
        torch_path.append(torch_path_rotary(path.flatten(1), positions, cache, head_size, rotary_dim))
    rotated = qkv[:, :q_size + k_size]
    expected_qk, torch_path_qk = torch.cat(expected, dim=1), torch.cat(torch_path, dim=1)
    written = slot_mapping[stored.to(device)].long().cpu()
    cached_keys = k_cache.flatten(0, 1)[written.to(device)].flatten(1)
    cached_values = v_cache.flatten(0, 1)[written.to(device)].flatten(1)
    unwritten = torch.ones(num_blocks * block_size, dtype=torch.bool)
    unwritten[written] = False
    untouched = (torch.equal(v, before[:, q_size + k_size:])
                 and bool(k_cache.flatten(0, 1)[unwritten.to(device)].isnan().all())
                 and bool(v_cache.flatten(0, 1)[unwritten.to(device)].isnan().all()))
    if not qk_norm:  # the channels past the rotary ones stay as they were
        heads, original = rotated.reshape(rows, -1, head_size), before[:, :q_size + k_size].reshape(rows, -1, head_size)
        untouched = untouched and torch.equal(heads[..., rotary_dim:], original[..., rotary_dim:])
    return dict(shape_ok=True, in_place=True, untouched=untouched,
                rel_error=relative_error(rotated, expected_qk),
                # The cache holds exactly what the key rows hold after the launch, and the values.
                cache_error=max(relative_error(cached_keys, rotated[stored.to(device), q_size:]),
                                relative_error(cached_values, v[stored.to(device)])),
                torch_path_error=relative_error(rotated, torch_path_qk),
                torch_path_equal=equal_fraction(rotated, torch_path_qk))


def elementwise_cases(dtype: torch.dtype, dry_run: bool):
    """(kernel name, case label, check(ops, device) -> dict) for every case in this dtype."""
    for rows, hidden in (DRY_NORM_SHAPES if dry_run else GPU_NORM_SHAPES):
        for with_residual in (False, True):
            kernel = "fused_add_rms_norm" if with_residual else "rms_norm"
            yield (kernel, f"{rows} x {hidden}",
                   lambda ops, device, r=rows, h=hidden, w=with_residual: check_rms_norm(ops, r, h, dtype, device,
                                                                                         0.0, w))
    gemma_rows = 2 if dry_run else 7
    for with_residual in (False, True):
        kernel = "fused_add_rms_norm" if with_residual else "rms_norm"
        yield (kernel, f"{gemma_rows} x 896, Gemma's 1 + weight",
               lambda ops, device, w=with_residual: check_rms_norm(ops, gemma_rows, 896, dtype, device, 1.0, w))
    for rows, d in (DRY_SILU_SHAPES if dry_run else GPU_SILU_SHAPES):
        yield "silu_and_mul", f"{rows} x 2*{d}", lambda ops, device, r=rows, n=d: check_silu_and_mul(ops, r, n, dtype,
                                                                                                     device)
    for shape in (DRY_ROTARY_SHAPES if dry_run else GPU_ROTARY_SHAPES):
        rows, query_heads, key_heads, head_size, rotary_dim = shape
        for separate_key in (False, True):
            label = (f"{rows} tokens, {query_heads}/{key_heads} heads of {head_size}, rotary {rotary_dim}, "
                     + ("q and k apart" if separate_key else "q and k as one tensor"))
            yield ("rotary_embedding", label,
                   lambda ops, device, s=shape, k=separate_key: check_rotary(ops, *s, dtype, device, k))
        for qk_norm in (False, True):
            label = (f"{rows} tokens, {query_heads}/{key_heads} heads of {head_size}, rotary {rotary_dim}, "
                     + ("q/k norms, " if qk_norm else "") + "keys and values into the paged cache")
            yield ("rotary_embedding", label,
                   lambda ops, device, s=shape, n=qk_norm: check_rotary_fused(ops, *s, dtype, device, n))


def passed(result: dict, dtype: torch.dtype, native: bool) -> bool:
    """Within the tolerance of the fp32 reference, and of the PyTorch path natively (the
    interpreter rounds otherwise); in place, shapes and untouched memory as promised."""
    tolerance = TOLERANCE[dtype]
    errors = [result["rel_error"], result.get("residual_error", 0.0), result.get("cache_error", 0.0)]
    if native:
        errors.append(result["torch_path_error"])
    return all(e <= tolerance for e in errors) and result["in_place"] and result["untouched"] and result["shape_ok"]


def check_elementwise(dtype: torch.dtype, device: torch.device, dry_run: bool) -> list[dict]:
    """Stage a's records for the pointwise kernels in one dtype."""
    from raylm.kernels import triton_elementwise as ops

    records = []
    for kernel, case, check in elementwise_cases(dtype, dry_run):
        result = check(ops, device)
        records.append(dict(dtype=DTYPE_NAMES[dtype], kernel=kernel, case=case, rel_error=result["rel_error"],
                            torch_path_error=result["torch_path_error"],
                            torch_path_equal=round(result["torch_path_equal"], 6), tolerance=TOLERANCE[dtype],
                            passed=passed(result, dtype, native=device.type == "cuda")))
    return records
