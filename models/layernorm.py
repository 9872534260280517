"""LayerNorm (mean and variance, optional affine weight and bias), for the GPT-2 and OPT
families; Llama-family models use `RMSNorm`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """Hugging Face's `nn.LayerNorm` with the same parameter names (`weight`, `bias`), so
    checkpoints load by name. Replicated on every tensor-parallel rank."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.weight = (nn.Parameter(torch.ones(hidden_size), requires_grad=False)
                       if elementwise_affine else None)
        self.bias = (nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
                     if elementwise_affine and bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
