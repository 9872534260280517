"""Activations: gated (SiLU-and-mul of the fused gate_up projection) and plain ones named
by a config's `activation_function` / `hidden_act`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.kernels import cpu_ops, cuda_ops


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the fused gate_up projection output [..., 2d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cuda_ops.usable(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1:
            return ops.silu_and_mul(x)  # one Triton kernel on CUDA
        return cpu_ops.silu_and_mul_any(x)


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:] (GeGLU, Gemma's MLP); approximate="tanh" is Hugging
    Face's gelu_pytorch_tanh."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


# Hugging Face activation names (transformers.activations.ACT2FN) -> modules with the same
# arithmetic. gelu_new is GPT-2's tanh approximation.
_ACTIVATIONS = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "swish": nn.SiLU,
}


def get_act_fn(name: str) -> nn.Module:
    """The elementwise activation a config names (`activation_function`, `hidden_act`)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation function {name!r} is not supported; raylm supports "
                         f"{', '.join(sorted(_ACTIVATIONS))}.")
    return _ACTIVATIONS[name]()
