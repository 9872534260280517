"""MXFP4 (the OCP microscaling format), as gpt-oss's released checkpoints store their experts:
blocks of 32 values sharing one power-of-two scale.

A weight `<w>` of shape [..., R, C] is stored as `<w>_blocks` uint8 [..., R, C / 32, 16], two
FP4 (E2M1) codes per byte, the low nibble the even element, and `<w>_scales` uint8
[..., R, C / 32], each an E8M0 exponent: a block's values are code * 2 ** (scale - 127). E2M1
codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8-15 the same negated (bit 3 the sign). This is
transformers' layout (its `convert_moe_packed_tensors`); raylm dequantizes at load to the
model dtype and computes in it (no FP4 kernels).
"""

from __future__ import annotations

from typing import Any

import torch

from raylm.parallel.checkpoint_slice import read_weight

# The gpt-oss expert weights a checkpoint may hold in MXFP4.
MXFP4_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
VALUES_PER_BLOCK = 32
E8M0_BIAS = 127
# E2M1 code -> value.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: Any, scales: Any, dtype: torch.dtype, name: str = "MXFP4 weight") -> torch.Tensor:
    """`<w>_blocks` [..., R, G, 16] and `<w>_scales` [..., R, G] (uint8, or checkpoint slices of
    them) -> the weight [..., R, G * 32] in `dtype`."""
    blocks, scales = read_weight(blocks), read_weight(scales)
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}.")
    if blocks.dim() < 2 or blocks.shape[-1] != VALUES_PER_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks must be [..., G, {VALUES_PER_BLOCK // 2}] over scales [..., G], got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}.")
    groups = blocks.shape[-2]
    block_rows, scale_rows = blocks.reshape(-1, groups, VALUES_PER_BLOCK // 2), scales.reshape(-1, groups)
    out = torch.empty(block_rows.shape[0], groups * VALUES_PER_BLOCK, dtype=dtype, device=blocks.device)
    # A few thousand rows at a time: the fp32 intermediates of a whole expert stack (gpt-oss-
    # 120b's gate_up: 128 x 5760 x 2880 values) would take tens of GB.
    for start in range(0, block_rows.shape[0], _ROWS_PER_CHUNK):
        end = start + _ROWS_PER_CHUNK
        out[start:end] = _dequantize_rows(block_rows[start:end], scale_rows[start:end])
    return out.view(*blocks.shape[:-2], groups * VALUES_PER_BLOCK)


_ROWS_PER_CHUNK = 4096


def _dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [N, G, 16], scales [N, G] -> [N, G * 32] fp32."""
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)  # [N, G, 16, 2]
    values = values.flatten(-2)  # [N, G, 32]: low nibble first
    # Every value is a few bits times a power of two: exact in fp32, as is the product with
    # 2 ** (scale - 127) wherever that is an fp32 normal number or zero.
    exponents = scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1).float()).flatten(-2)


def check_quantization_config(config: Any, model_name: str = "GptOssForCausalLM") -> None:
    """A config's `quantization_config` must be MXFP4's (quant_method "mxfp4"), or absent."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", None)
    if method != "mxfp4":
        raise ValueError(f"quantization_config.quant_method must be 'mxfp4' for {model_name}, got {method!r}.")


# The architectures whose model class reads MXFP4 checkpoints (`supports_quantization`).
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)


def refuse_quantization_config(config: Any, model_class: type) -> None:
    """An MXFP4 checkpoint (quant_method "mxfp4") is read by model classes that read it
    (`supports_quantization`) only: any other refuses it rather than read its packed tensors
    as weights. Other quant_methods are `models/quantization.py`'s."""
    quantization = getattr(config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", None)
    if method == "mxfp4" and not getattr(model_class, "supports_quantization", False):
        raise ValueError(f"config.json has quantization_config (quant_method {method!r}), which "
                         f"{model_class.__name__} does not read; raylm reads MXFP4 checkpoints of "
                         f"{', '.join(MXFP4_ARCHITECTURES)} only.")
