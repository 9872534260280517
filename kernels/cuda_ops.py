"""Where a decoder layer's fused pointwise ops run on CUDA: the Triton kernels of
`kernels/triton_elementwise.py` (fused residual add and RMSNorm, SiLU-and-mul, rotary
embedding), as `cpu_ops` is for the CPU. The layers call `usable(...)` and keep their
PyTorch code for everything it rejects: tensors off CUDA, dtypes other than fp32, fp16 and
bf16, autograd, a machine without triton, the `triton_elementwise` test switch.
"""

from __future__ import annotations

from types import ModuleType

import torch

from raylm.engine import envs

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# None: not tried yet; False: off (no triton, or switched off); else the kernels' module.
_module: ModuleType | bool | None = None


def _load() -> ModuleType | None:
    global _module
    if _module is None:
        _module = False
        if not envs.kernel_switched_off("triton_elementwise"):
            try:
                from raylm.kernels import triton_elementwise
                _module = triton_elementwise
            except ImportError:
                pass
    return _module or None


def usable(*tensors: torch.Tensor) -> ModuleType | None:
    """The kernels' module if they can take these tensors (all on CUDA, of a float dtype
    they know, none needing gradients), else None."""
    for tensor in tensors:
        if tensor.device.type != "cuda" or tensor.dtype not in _DTYPES or tensor.requires_grad:
            return None
    return _load()
