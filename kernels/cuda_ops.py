"""Where a decoder layer's fused pointwise ops run on CUDA: the Triton kernels of
`kernels/triton_elementwise.py` (fused residual add and RMSNorm, SiLU-and-mul, rotary
embedding), as `cpu_ops` is for the CPU. The layers call `usable(...)` and keep their
PyTorch code for everything it rejects: tensors off CUDA, dtypes other than fp32, fp16 and
bf16, autograd, a machine without triton, the `triton_elementwise` test switch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from raylm.engine import envs

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The device types whose tensors the kernels take: CUDA's, and the CPU's inside
# `interpreted_on_cpu()`.
_devices: tuple[str, ...] = ("cuda",)

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
        if tensor.device.type not in _devices or tensor.dtype not in _DTYPES or tensor.requires_grad:
            return None
    return _load()


@contextmanager
def interpreted_on_cpu() -> Iterator[None]:
    """Within it the layers take their CUDA branches on CPU tensors too, the kernels run by
    Triton's interpreter: for tests that run (and count) what a CUDA forward launches
    without a GPU. Only in a process with TRITON_INTERPRET=1, which must be set before the
    kernels are decorated (`tests/triton_interpreter.py`)."""
    global _devices
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("cuda_ops.interpreted_on_cpu() needs TRITON_INTERPRET=1 set before triton is imported")
    previous, _devices = _devices, ("cuda", "cpu")
    try:
        yield
    finally:
        _devices = previous
