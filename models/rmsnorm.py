"""RMSNorm, with the residual add of the next block fused in (vLLM's layer layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.kernels import cpu_ops, cuda_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or, given a residual, (norm(x + residual), x + residual). On the CPU in
        fp32 the fused op reuses x and residual for the two results, as does the Triton
        kernel on CUDA."""
        fused = _cuda_norm(self, x, residual, weight_offset=0.0)
        if fused is not None:
            return fused
        if cpu_ops.usable(x, self.weight) and x.is_contiguous():
            if residual is None:
                return cpu_ops.rms_norm(x, self.weight, self.eps)
            if cpu_ops.usable(residual) and residual.is_contiguous():
                return cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        # One fused op; it normalises in fp32 like Hugging Face, which differs only in
        # rounding to the model dtype before (not after) the weight multiply.
        out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight) (the checkpoint stores the offset from 1),
    normalising and scaling in fp32 and rounding to the input dtype once at the end, as
    Hugging Face does."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = _cuda_norm(self, x, residual, weight_offset=1.0)
        if fused is not None:
            return fused
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * (1.0 + self.weight.float())
        out = out.to(x.dtype)
        return out if residual is None else (out, residual)


def _cuda_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, weight_offset: float
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """The norm by the Triton kernel on CUDA (the residual add fused in, in place, as on
    the CPU), or None where it does not take these tensors."""
    ops = cuda_ops.usable(x, norm.weight)
    if ops is None or not ops.rms_norm_supported(x):
        return None
    if residual is None:
        return ops.rms_norm(x, norm.weight, norm.eps, weight_offset)
    if (residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()
            or cuda_ops.usable(residual) is None):
        return None
    return ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps, weight_offset)


def norm_with_residual(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's input norm: (norm(x + residual), x + residual), the previous
    layer's residual add fused in; the first layer, with no residual yet, gets (norm(x), x)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)
