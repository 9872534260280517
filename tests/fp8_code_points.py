"""Inputs that decide whether an fp8 KV write rounds as `kv_cache_dtype.quantize` does, with
the bytes each must become, worked out from the format's code points (not from a cast):
for a scale s, inputs x whose quotient x / s (fp32, exactly rounded) is

- every finite value of the format: its own byte;
- every midpoint between neighbouring values (0 and the smallest subnormal included): the
  byte of the neighbour whose code is even (ties to even), and one fp32 ulp below / above
  it: the lower / upper neighbour's;
- past the largest finite value (half a step past it, one ulp past it, twice it): the
  largest value's byte (saturation);

each with both signs (-0.0 is 0x80), and a few raw inputs: an fp32 subnormal and zeros
(zero), 3e38 and infinities (saturated), NaN (0x7F with its sign, PyTorch's choice).

For scales that are not powers of two, not every quotient is reachable: an x is searched
within a few fp32 ulps of target * s, and targets without one are left out (counted).

`check_kv_write_sweep` and `check_rotary_write_sweep` put the sweep through the Triton KV
write and the rotary kernel's fused write: interpreted (tests/triton_fp8_sweep_cases.py)
and natively on a GPU (tests/test_kv_cache_fp8.py, cuda-marked).
"""

from __future__ import annotations

import torch

SWEEP_SCALES = (1.0, 0.37, 3.1, 2.0**-5)
_SEARCH_ULPS = 4
HEAD_SIZE, NUM_KV_HEADS, BLOCK_SIZE = 64, 2, 8


def _next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("inf")))


def _next_down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("-inf")))


def quotient_targets(fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(quotients fp32 [N] >= 0, their bytes uint8 [N]): the positive half of the sweep."""
    codes = torch.arange(128, dtype=torch.uint8)
    values = codes.view(fp8).float()
    finite = values.isfinite()
    codes, values = codes[finite].long(), values[finite]  # ascending, 0 first
    low, high = values[:-1], values[1:]
    midpoints = (low + high) / 2  # one bit more than the format: exact in fp32
    assert torch.equal(midpoints.double(), (low.double() + high.double()) / 2)
    even = torch.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:])
    largest, top_step = values[-1:], values[-1:] - values[-2:-1]
    past = torch.cat([largest + top_step / 2, _next_up(largest), largest * 2])
    targets = torch.cat([values, midpoints, _next_down(midpoints), _next_up(midpoints), past])
    expected = torch.cat([codes, even, codes[:-1], codes[1:], codes[-1:].expand(3)])
    return targets, expected.to(torch.uint8)


def inputs_for_quotients(targets: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, found): for each target t an fp32 x with x / scale == t exactly (both fp32, as
    `quantize` divides), where one lies within _SEARCH_ULPS ulps of t * scale."""
    divisor = torch.tensor(scale, dtype=torch.float32)
    start = (targets.double() * float(divisor)).float()
    x, found = start.clone(), torch.zeros_like(targets, dtype=torch.bool)
    below, above = start.clone(), start.clone()
    for _ in range(_SEARCH_ULPS + 1):
        for candidate in (below, above):
            hit = ~found & (candidate / divisor == targets)
            x[hit], found = candidate[hit], found | hit
        below, above = _next_down(below), _next_up(above)
    return x, found


def code_point_sweep(fp8: torch.dtype, scale: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x fp32 [N], expected bytes uint8 [N], targets left out): the whole sweep for this
    format and scale, positive and negative."""
    targets, all_codes = quotient_targets(fp8)
    x, found = inputs_for_quotients(targets, scale)
    x, codes = x[found], all_codes[found]
    raw = torch.tensor([1e-42, 0.0, 3e38, float("inf")])
    largest = int(all_codes.max())
    raw_codes = torch.tensor([0, 0, largest, largest], dtype=torch.uint8)
    x = torch.cat([x, raw, -x, -raw, torch.tensor([float("nan"), -float("nan")])])
    nan_codes = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
    expected = torch.cat([codes, raw_codes, codes | 0x80, raw_codes | 0x80, nan_codes])
    return x, expected, int((~found).sum())


# ---- through the Triton writes -----------------------------------------------------------------

def sweep_rows(fp8: torch.dtype, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sweep as [tokens, NUM_KV_HEADS, HEAD_SIZE] fp32 inputs and their expected bytes
    (the tail padded with zeros, whose byte is 0); asserts `quantize` gives those bytes."""
    from raylm.kernels.kv_cache_dtype import quantize

    x, expected, _ = code_point_sweep(fp8, scale)
    assert torch.equal(quantize(x, fp8, scale).view(torch.uint8), expected), "the reference disagrees"
    row = NUM_KV_HEADS * HEAD_SIZE
    padding = -len(x) % row
    x = torch.cat([x, torch.zeros(padding)]).view(-1, NUM_KV_HEADS, HEAD_SIZE)
    expected = torch.cat([expected, torch.zeros(padding, dtype=torch.uint8)]).view(-1, NUM_KV_HEADS, HEAD_SIZE)
    return x, expected


def _nan_cache(num_slots: int, fp8: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((num_slots // BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), float("nan"),
                      device=device).to(fp8)


def _slots(num_tokens: int, seed: int, device: torch.device) -> tuple[torch.Tensor, int]:
    num_slots = BLOCK_SIZE * -(-(num_tokens + 3) // BLOCK_SIZE)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:num_tokens]
    return slots.to(device), num_slots


def _written(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8).flatten(0, 1)[slots].cpu()


def check_kv_write_sweep(write_kv_cache, fp8: torch.dtype, scale: float, device: torch.device) -> None:
    """`triton_kv_cache.write_kv_cache` stores the sweep's bytes: keys with k_scale = scale,
    the sweep reversed (other inputs in each program) times 2 as values with v_scale =
    2 * scale (the same quotients: a swapped scale fails)."""
    keys, expected = sweep_rows(fp8, scale)
    values, expected_values = keys.flip(0), expected.flip(0)
    slots, num_slots = _slots(keys.shape[0], keys.shape[0], device)
    k_cache, v_cache = _nan_cache(num_slots, fp8, device), _nan_cache(num_slots, fp8, device)
    write_kv_cache(keys.to(device), (values * 2).to(device), k_cache, v_cache, slots, k_scale=scale, v_scale=scale * 2)
    written_keys, written_values = _written(k_cache, slots), _written(v_cache, slots)
    assert torch.equal(written_keys, expected), first_differences(keys, written_keys, expected)
    assert torch.equal(written_values, expected_values), first_differences(values, written_values, expected_values)


def check_rotary_write_sweep(rotary_embedding_, fp8: torch.dtype, scale: float, device: torch.device) -> None:
    """`triton_elementwise.rotary_embedding_`'s fused write, fp32 activations: the values and
    the key channels past rotary_dim (HEAD_SIZE / 2) reach the cache as the sweep's bytes;
    the rotated channels (position 0: cos 1, sin 0; inf * 0 makes NaN) as `quantize` of the
    keys the launch left."""
    from raylm.kernels.kv_cache_dtype import quantize

    rows, expected = sweep_rows(fp8, scale)
    num_tokens, rotary_dim = rows.shape[0], HEAD_SIZE // 2
    query = torch.zeros(num_tokens, NUM_KV_HEADS * HEAD_SIZE, device=device)
    key = rows.flatten(1).clone().to(device)  # rotated in place
    value = rows.flip(0).flatten(1).to(device)
    cos_sin = torch.cat([torch.ones(1, rotary_dim // 2), torch.zeros(1, rotary_dim // 2)], dim=-1).to(device)
    positions = torch.zeros(num_tokens, dtype=torch.long, device=device)
    slots, num_slots = _slots(num_tokens, num_tokens + 1, device)
    k_cache, v_cache = _nan_cache(num_slots, fp8, device), _nan_cache(num_slots, fp8, device)
    rotary_embedding_(positions, query, key, cos_sin, HEAD_SIZE, rotary_dim,
                      kv_cache=(value, k_cache, v_cache, slots), k_scale=scale, v_scale=scale)
    written_keys, written_values = _written(k_cache, slots), _written(v_cache, slots)
    rotated = key.cpu().view(rows.shape)
    assert torch.equal(written_keys, quantize(rotated, fp8, scale).view(torch.uint8)), first_differences(
        rotated, written_keys, quantize(rotated, fp8, scale).view(torch.uint8))
    rest = (..., slice(rotary_dim, None))
    assert torch.equal(written_keys[rest], expected[rest]), first_differences(rows[rest], written_keys[rest],
                                                                             expected[rest])
    assert torch.equal(written_values, expected.flip(0)), first_differences(rows.flip(0), written_values,
                                                                           expected.flip(0))


def first_differences(x: torch.Tensor, written: torch.Tensor, expected: torch.Tensor, shown: int = 6) -> str:
    """The first few inputs written wrong: the input, its written and expected bytes."""
    wrong = (written != expected).nonzero().tolist()
    return f"{len(wrong)} bytes differ: " + "; ".join(
        f"x={float(x[tuple(i)])!r}: wrote {int(written[tuple(i)]):#04x}, expected {int(expected[tuple(i)]):#04x}"
        for i in wrong[:shown])
