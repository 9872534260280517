"""`kernels/fp8_linear.py` against its PyTorch reference: the CPU's chunked W8A16 GEMM over
per-tensor, per-row and block-wise scales, and (marked `cuda`) the W8A8 `torch._scaled_mm`
path with activations quantized per token or by a static scale."""

from __future__ import annotations

import pytest
import torch

from raylm.kernels import fp8_linear
from raylm.kernels.fp8_linear import FP8_DTYPE, apply_fp8_linear, fp8_linear_reference, quantize_per_tensor

OUT, IN = 96, 80


def fp8_weight(scales: str, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(OUT, IN, generator=generator) * 100).clamp(-448, 448).to(FP8_DTYPE)
    if scales == "tensor":
        scale, block = torch.tensor(0.003), None
    elif scales == "rows":
        scale, block = torch.rand(OUT, generator=generator) * 0.01 + 1e-3, None
    else:  # 32 x 48 blocks: the last block row and column are partial (96 = 3 x 32, 80 < 2 x 48)
        block = (32, 48)
        scale = torch.rand(3, 2, generator=generator) * 0.01 + 1e-3
    return weight.to(device), scale.to(device), block


@pytest.mark.parametrize("scales", ["tensor", "rows", "blocks"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_cpu_w8a16_in_row_chunks_equals_the_dequantized_reference(monkeypatch, scales, dtype, tolerance):
    # Chunks of 32 rows (2560 elements / 80 columns; blocks keep whole 32-row blocks): three.
    monkeypatch.setattr(fp8_linear, "_DEQUANT_CHUNK_ELEMENTS", 2560)
    monkeypatch.setattr(fp8_linear, "NATIVE_MAX_ROWS", 0)  # the native decode kernel: its own test
    weight, scale, block = fp8_weight(scales)
    x = torch.randn(7, IN, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(OUT)
    out = apply_fp8_linear(x.to(dtype), weight, scale, block, None, bias.to(dtype))
    reference = fp8_linear_reference(x.to(dtype), weight, scale, block, None, bias.to(dtype))
    assert out.dtype == dtype and out.shape == (7, OUT)
    torch.testing.assert_close(out.float(), reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())


native = pytest.mark.skipif(not fp8_linear.native_fp8_linear_usable(), reason="native FP8 kernel not built here")


@native
@pytest.mark.parametrize("tokens", [1, 3, 8, 9, 32])
@pytest.mark.parametrize("out_features,in_features", [(96, 80), (5, 17), (64, 256)])
@pytest.mark.parametrize("scales", ["tensor", "rows"])
def test_native_fp8_decode_kernel_equals_the_dequantized_reference(tokens, out_features, in_features, scales):
    # Token blocks of 8 and output blocks of 3 with remainders, features not multiples of 16.
    generator = torch.Generator().manual_seed(tokens)
    weight = (torch.randn(out_features, in_features, generator=generator) * 100).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.tensor(0.003) if scales == "tensor" else torch.rand(out_features, generator=generator) * 0.01
    x = torch.randn(tokens, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    assert tokens <= fp8_linear.NATIVE_MAX_ROWS
    out = apply_fp8_linear(x, weight, scale, None, None, bias)
    reference = fp8_linear_reference(x, weight, scale, None, None, bias)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


@native
def test_native_fp8_kernel_widens_every_e4m3_value_exactly_subnormals_included():
    values = torch.arange(256, dtype=torch.uint8)
    values[[0x7f, 0xff]] = 0  # the NaNs: never written by a quantizer
    weight = values.view(FP8_DTYPE).reshape(1, 256)
    out = torch.ops.raylm.fp8_linear(torch.eye(256), weight.view(torch.uint8), torch.ones(1))
    assert torch.equal(out[:, 0], weight.float()[0])


def test_quantize_per_tensor_scale_is_amax_over_448_and_round_trips_within_fp8_precision():
    weight = torch.randn(64, 64) * 3
    q, scale = quantize_per_tensor(weight)
    assert q.dtype == FP8_DTYPE
    assert scale.item() == pytest.approx(weight.abs().max().item() / 448)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 away from the subnormals.
    torch.testing.assert_close(q.float() * scale, weight, rtol=2**-4, atol=scale.item() * 2**-6)


@pytest.mark.cuda
@pytest.mark.parametrize("scales,static", [("tensor", False), ("tensor", True), ("rows", False), ("rows", True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_w8a8_scaled_mm_equals_the_reference_with_activations_quantized_alike(scales, static, dtype):
    device = torch.device("cuda")
    if not fp8_linear.scaled_mm_supported(device):
        pytest.skip("fp8 GEMMs need compute capability 8.9 or up (W8A16 there)")
    weight, scale, _ = fp8_weight(scales)
    out_features, in_features = 128, 256  # multiples of 16, as _scaled_mm needs
    weight = weight.view(torch.uint8).repeat(2, 4)[:out_features, :in_features].contiguous().view(FP8_DTYPE)
    weight, scale = weight.to(device), (scale.repeat(2)[:out_features] if scale.dim() else scale).to(device)
    x = torch.randn(5, in_features, device=device).to(dtype)
    input_scale = (x.float().abs().max() / 448 * 1.5).reshape(()) if static else None
    bias = torch.randn(out_features, device=device).to(dtype)
    assert fp8_linear.uses_w8a8(x, weight, None)
    out = apply_fp8_linear(x, weight, scale, None, input_scale, bias)
    reference = fp8_linear_reference(x, weight, scale, None, input_scale, bias, quantize_input=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())
