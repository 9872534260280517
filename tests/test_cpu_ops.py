"""The fused CPU ops against PyTorch written out in float64, and the layers that use them.
Every kernel in fp32 and bf16, on each instruction set, is in test_cpu_kernel_isa.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raylm.kernels import cpu_ops
from raylm.kernels.torch_attention import write_kv_cache as reference_write_kv_cache
from raylm.models.activation import SiluAndMul
from raylm.models.rmsnorm import RMSNorm
from raylm.models.rotary_embedding import get_rope


@pytest.fixture(scope="module", autouse=True)
def native():
    if not cpu_ops.usable(torch.zeros(1)):
        pytest.skip("the native CPU ops cannot be built here (no compiler or ninja?)")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


# Row counts on both sides of the threading grain; widths with and without a SIMD tail.
@pytest.mark.parametrize("rows,hidden", [(1, 256), (64, 256), (300, 100), (7, 13)])
def test_fused_add_rms_norm_updates_both_in_place(rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen) * 3
    weight = torch.rand(hidden, generator=gen) + 0.5
    expected_residual = x.double() + residual.double()
    expected = rms_norm_reference(expected_residual.float(), weight, 1e-6)
    out, new_residual = cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_residual.double(), expected_residual, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,hidden", [(3, 256), (100, 37)])
def test_rms_norm_matches_the_formula_and_leaves_its_input(rows, hidden):
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(rows, hidden, generator=gen) * 10, torch.randn(hidden, generator=gen)
    before = x.clone()
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before)


@pytest.mark.parametrize("rows,d", [(1, 688), (64, 688), (5, 11)])
def test_silu_and_mul_matches_pytorch_including_large_inputs(rows, d):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(rows, 2 * d, generator=gen) * 4
    x[0, :4] = torch.tensor([-200.0, -88.0, 88.0, 200.0])  # where a naive exp overflows
    expected = (F.silu(x[:, :d].double()) * x[:, d:].double()).float()
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_embedding_rotates_a_column_slice_in_place(rotary_dim):
    head_size, num_heads, rows = 32, 6, 9
    rope = get_rope(head_size, 128, {"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": rotary_dim / head_size})
    gen = torch.Generator().manual_seed(rotary_dim)
    # q and k heads at the front of a wider qkv row, as the attention layer passes them.
    qkv = torch.randn(rows, (num_heads + 2) * head_size, generator=gen)
    positions = torch.randint(0, 128, (rows,), generator=gen)
    qk = qkv[:, :num_heads * head_size]
    untouched = qkv[:, num_heads * head_size:].clone()

    x = qk.double().view(rows, num_heads, head_size)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = positions.double()[:, None, None] * inv_freq
    x1, x2 = x[..., :rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim]
    expected = torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin(),
                          x[..., rotary_dim:]], dim=-1).view(rows, -1)

    out = cpu_ops.rotary_embedding_(qk, positions, rope.cos_sin_cache, head_size, rotary_dim)
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qk.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, num_heads * head_size:], untouched)


def test_rotary_embedding_rejects_positions_beyond_the_table():
    rope = get_rope(32, 16, {"rope_type": "default", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="position 16"):
        cpu_ops.rotary_embedding_(torch.zeros(2, 64), torch.tensor([3, 16]), rope.cos_sin_cache, 32, 32)


def test_write_kv_cache_matches_the_reference_skips_padding_and_rejects_bad_slots():
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, head_size = 6, 4, 2, 8
    # Keys and values as strided column slices of one projection output.
    kv = torch.randn(5, 2 * heads * head_size, generator=gen)
    key = kv[:, :heads * head_size].view(5, heads, head_size)
    value = kv[:, heads * head_size:].view(5, heads, head_size)
    slots = torch.tensor([0, 7, -1, 23, 12])
    caches = [torch.randn(num_blocks, block_size, heads, head_size, generator=gen) for _ in range(2)]
    expected = [c.clone() for c in caches]
    reference_write_kv_cache(key, value, *expected, slots)
    cpu_ops.write_kv_cache(key, value, *caches, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))

    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 24"):
        cpu_ops.write_kv_cache(key[:2], value[:2], *caches, torch.tensor([1, 24]))
    assert all(torch.equal(a, b) for a, b in zip(caches, before))  # nothing written


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_layers_give_the_same_results_with_and_without_the_fused_ops_in_each_dtype(monkeypatch, dtype, tolerance):
    # In bf16 within two roundings of the inputs' scale (~1): PyTorch rounds after each op
    # (the rotary embedding's products before they cancel), the fused ops once at the end.
    gen = torch.Generator().manual_seed(12)
    norm = RMSNorm(64, 1e-6).to(dtype)
    norm.weight.data = (torch.rand(64, generator=gen) + 0.5).to(dtype)
    rope = get_rope(32, 64, {"rope_type": "default", "rope_theta": 10000.0}).to(dtype)
    x, residual = torch.randn(10, 64, generator=gen).to(dtype), torch.randn(10, 64, generator=gen).to(dtype)
    gate_up = torch.randn(10, 2 * 48, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (10,), generator=gen)

    def run_layers():
        return (norm(x.clone()), *norm(x.clone(), residual.clone()), SiluAndMul()(gate_up),
                rope.rotate(positions, x.clone()))

    fused = run_layers()
    monkeypatch.setattr(cpu_ops, "usable", lambda *tensors: False)
    for a, b in zip(fused, run_layers()):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_ops_take_fp32_and_bf16_and_decline_other_dtypes_and_autograd():
    assert cpu_ops.usable(torch.zeros(2), torch.ones(3, dtype=torch.bfloat16))
    assert not cpu_ops.usable(torch.zeros(2, dtype=torch.float16))
    assert not cpu_ops.usable(torch.zeros(2, requires_grad=True))


def test_ops_are_pytorch_operators_that_the_profiler_names():
    gen = torch.Generator().manual_seed(13)
    x, weight = torch.randn(4, 64, generator=gen).to(torch.bfloat16), torch.rand(64, generator=gen) + 0.5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = torch.ops.raylm.rms_norm(x, weight, 1e-6)
        gated = torch.ops.raylm.silu_and_mul(x)
    names = {event.name for event in profile.events()}
    assert {"raylm::rms_norm", "raylm::silu_and_mul"} <= names
    rtol = 2 ** -8
    torch.testing.assert_close(out.double(), rms_norm_reference(x.float(), weight, 1e-6).double(), rtol=rtol, atol=1e-5)
    expected = F.silu(x[:, :32].double()) * x[:, 32:].double()
    torch.testing.assert_close(gated.double(), expected, rtol=rtol, atol=1e-5)


def test_every_native_source_is_package_data():
    # A wheel without a header builds nothing: the CPU kernels would silently fall back.
    import tomllib
    from pathlib import Path

    import raylm.kernels
    kernels_dir = Path(raylm.kernels.__file__).parent
    pyproject = tomllib.loads((kernels_dir.parent / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["raylm.kernels"]
    packaged = {path for pattern in patterns for path in kernels_dir.glob(pattern)}
    sources = {path for path in (kernels_dir / "csrc").iterdir() if path.is_file()}
    assert sources and sources <= packaged
