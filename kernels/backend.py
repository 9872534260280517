"""Attention backend choice: the Triton kernels (GPU), the native CPU kernel, or the
PyTorch reference.

All backends share one contract (see `raylm.kernels.torch_attention`):
`write_kv_cache(key, value, k_cache, v_cache, slot_mapping)` and
`paged_attention(query, k_cache, v_cache, attn_metadata, scale, *, sliding_window=None,
logits_soft_cap=None) -> out`.
Triton is imported only when the Triton backend is asked for, so a CPU machine without
triton installed still runs the PyTorch path. The "cpu" backend compiles its C++ kernel at
first use (`raylm.kernels.cpu_attention`) and runs the PyTorch reference if it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from raylm.kernels.attention_metadata import AttentionMetadata

BACKEND_NAMES = ("triton", "cpu", "torch")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv_cache: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    # (query, k_cache, v_cache, attn_metadata, scale, *, sliding_window, logits_soft_cap) -> out
    paged_attention: Callable[..., torch.Tensor]


def default_backend_name() -> str:
    """Triton on a CUDA machine, else the native CPU kernel when it builds here and the
    PyTorch reference when it does not: the engine's choice when `attention_backend` is None."""
    if torch.cuda.is_available():
        return "triton"
    from raylm.kernels import cpu_attention
    return "cpu" if cpu_attention.is_available() else "torch"


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """The backend called `name` ("triton", "cpu" or "torch"); None means `default_backend_name()`."""
    name = name if name is not None else default_backend_name()
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}.")
    if name == "torch":
        from raylm.kernels import torch_attention
        return AttentionBackend("torch", torch_attention.write_kv_cache, torch_attention.paged_attention)
    if name == "cpu":
        from raylm.kernels import cpu_attention
        return AttentionBackend("cpu", cpu_attention.write_kv_cache, cpu_attention.paged_attention)
    try:
        import triton  # noqa: F401
    except ImportError as error:
        raise ValueError(f"attention backend 'triton' needs the triton package, which is not importable "
                         f"({error}); install triton or use the 'torch' backend.") from error
    from raylm.kernels.triton_kv_cache import write_kv_cache
    return AttentionBackend("triton", write_kv_cache, _triton_paged_attention)


def _triton_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            attn_metadata: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    # Decode-only steps take the kernel built for one query row per sequence (with its
    # split-K choice); anything with a longer chunk takes the prefill kernel, which also
    # serves the decode rows of a mixed batch.
    from raylm.kernels.triton_decode_attention import paged_decode_attention
    from raylm.kernels.triton_prefill_attention import paged_prefill_attention
    options = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, out=out)
    if attn_metadata.max_query_len <= 1:
        return paged_decode_attention(query, k_cache, v_cache, attn_metadata, scale, **options)
    return paged_prefill_attention(query, k_cache, v_cache, attn_metadata, scale, **options)
