"""Attention backend choice: the Triton kernels (GPU), the native CPU kernel, or the
PyTorch reference.

All backends share one contract (see `raylm.kernels.torch_attention`):
`write_kv_cache(key, value, k_cache, v_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0)` and
`paged_attention(query, k_cache, v_cache, attn_metadata, scale, *, sliding_window=None,
logits_soft_cap=None, k_scale=1.0, v_scale=1.0, sinks=None) -> out`. The caches may be fp8
(`raylm.kernels.kv_cache_dtype`), the scales being the layer's. `sinks` (gpt-oss's per-head
attention sinks) only where `supports_sinks`: a backend without them refuses a layer that
has them (`Attention.attn_backend`) rather than attend without.
Triton is imported only when the Triton backend is asked for, so a CPU machine without
triton installed still runs the PyTorch path. The "cpu" backend compiles its C++ kernel at
first use (`raylm.kernels.cpu_attention`) and runs the PyTorch reference if it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.kv_cache_dtype import is_fp8

BACKEND_NAMES = ("triton", "cpu", "torch")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (key, value, k_cache, v_cache, slot_mapping, *, k_scale, v_scale)
    write_kv_cache: Callable[..., None]
    # (query, k_cache, v_cache, attn_metadata, scale, *, sliding_window, logits_soft_cap, k_scale, v_scale) -> out
    paged_attention: Callable[..., torch.Tensor]
    # (num_heads, num_kv_heads, head_size, scale, k_cache, v_cache, max_model_len, *,
    # sliding_window, logits_soft_cap, query_dtype, has_sinks): compiles every kernel variant a
    # run of that layer shape can launch; None where nothing compiles.
    warm_up: Callable[..., None] | None = None
    # Whether paged_attention takes `sinks`.
    supports_sinks: bool = False


SINKS_UNSUPPORTED = ("attention_backend {backend!r} has no attention sinks, which this model's attention layers "
                     "have (gpt-oss); use attention_backend 'torch' or 'cpu'.")


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
        return AttentionBackend("torch", torch_attention.write_kv_cache, torch_attention.paged_attention,
                                supports_sinks=True)
    if name == "cpu":
        from raylm.kernels import cpu_attention
        return AttentionBackend("cpu", cpu_attention.write_kv_cache, cpu_attention.paged_attention,
                                supports_sinks=True)
    try:
        import triton  # noqa: F401
    except ImportError as error:
        raise ValueError(f"attention backend 'triton' needs the triton package, which is not importable "
                         f"({error}); install triton or use the 'torch' backend.") from error
    from raylm.kernels.triton_kv_cache import write_kv_cache
    return AttentionBackend("triton", write_kv_cache, _triton_paged_attention, _triton_warm_up, supports_sinks=True)


def _triton_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            attn_metadata: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None, out: torch.Tensor | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    # Decode-only steps take the kernel built for one query row per sequence (with its
    # split-K choice); anything with a longer chunk takes the prefill kernel, which also
    # serves the decode rows of a mixed batch.
    from raylm.kernels.triton_decode_attention import paged_decode_attention
    from raylm.kernels.triton_prefill_attention import paged_prefill_attention
    options = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, out=out, k_scale=k_scale,
                   v_scale=v_scale, sinks=sinks)
    if attn_metadata.max_query_len <= 1:
        return paged_decode_attention(query, k_cache, v_cache, attn_metadata, scale, **options)
    return paged_prefill_attention(query, k_cache, v_cache, attn_metadata, scale, **options)


def _triton_warm_up(num_heads: int, num_kv_heads: int, head_size: int, scale: float, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, max_model_len: int, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, query_dtype: torch.dtype | None = None,
                    has_sinks: bool = False) -> None:
    """Launches every Triton variant a run over these caches can use, on tiny steps that
    write nothing (slot -1) and read block 0: the single-pass decode, the split-K decode with
    a split count for each merge variant (BLOCK_S), the prefill kernel at each BLOCK_M, the
    KV write. Triton compiles a variant at its first launch (seconds each), and the model's
    warm-up steps reach only some of them. Nothing to compile off the GPU (interpreter)."""
    if k_cache.device.type == "cuda":
        launch_every_variant(num_heads, num_kv_heads, head_size, scale, k_cache, v_cache, max_model_len,
                             sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, query_dtype=query_dtype,
                             has_sinks=has_sinks)
        torch.cuda.synchronize(k_cache.device)


def launch_every_variant(num_heads: int, num_kv_heads: int, head_size: int, scale: float, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, max_model_len: int, *, sliding_window: int | None = None,
                         logits_soft_cap: float | None = None, query_dtype: torch.dtype | None = None,
                         has_sinks: bool = False) -> None:
    """What `_triton_warm_up` launches, on any device (the interpreter's tests run it). A
    layer's window, soft cap and whether it has sinks are compile-time constants: each
    combination is a variant of its own.
    query_dtype: the model's (default: the cache's, which an fp8 cache needs given)."""
    from raylm.kernels import triton_decode_attention as decode
    from raylm.kernels import triton_prefill_attention as prefill
    from raylm.kernels.triton_kv_cache import write_kv_cache

    device, block_size = k_cache.device, k_cache.shape[1]
    layer = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                 sinks=torch.zeros(num_heads, dtype=torch.float32, device=device) if has_sinks else None)
    dtype = query_dtype or k_cache.dtype
    assert not is_fp8(dtype), "an fp8 cache's warm-up needs the queries' dtype"
    group = num_heads // num_kv_heads
    split_counts: dict[int, int] = {}
    max_keys = max_model_len if sliding_window is None else min(max_model_len, sliding_window)
    for count in decode.possible_split_counts(max_keys):
        split_counts.setdefault(decode.merge_block_s(count), count)
    for num_splits in [1, *split_counts.values()]:
        # Partitions of one alignment unit: num_splits of them cover seq_len exactly.
        seq_len = num_splits * decode.PARTITION_ALIGN
        query = torch.randn(1, num_heads, head_size, dtype=dtype, device=device)
        decode.paged_decode_attention(query, k_cache, v_cache, _block_zero_step([1], [seq_len], block_size, device),
                                      scale, num_splits=num_splits, **layer)
    for query_len in prefill.variant_query_lens(dtype, group, head_size).values():
        query = torch.randn(query_len, num_heads, head_size, dtype=dtype, device=device)
        step = _block_zero_step([query_len], [query_len], block_size, device)
        keys = torch.randn(query_len, num_kv_heads, head_size, dtype=dtype, device=device)
        write_kv_cache(keys, keys, k_cache, v_cache, step.slot_mapping)
        prefill.paged_prefill_attention(query, k_cache, v_cache, step, scale, **layer)


def _block_zero_step(query_lens: list[int], seq_lens: list[int], block_size: int,
                     device: torch.device) -> AttentionMetadata:
    """A step whose sequences read only block 0 and write nothing."""
    width = -(-max(seq_lens) // block_size)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens))
