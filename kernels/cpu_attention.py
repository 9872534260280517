"""Native CPU paged attention: keys and values read straight from the paged cache.

The PyTorch reference (`raylm.kernels.torch_attention`) gathers every decoding sequence's
whole context into a padded [B, Hkv, L, D] tensor each layer each step before two batched
matmuls, and runs each prefilling sequence through its own gather and SDPA call. Two C++
kernels, like vLLM's CPU backend, walk each sequence's block table instead, with an online
softmax in fp32 over fp32 or bf16 queries and an fp32, bf16 or fp8 cache (outputs in the
query's dtype). They are PyTorch operators, `torch.ops.raylm.paged_decode_attention` and `paged_prefill_attention`:

- decode rows (query_len 1), `csrc/cpu_attention.cpp`: read every key and value row once;
  one task per sequence computes all its query heads block by block (one task per KV head
  when there are few sequences), register-blocked with AVX2 where the CPU has it.
- prefill rows (query_len > 1: prompts, chunks of a chunked prefill, prompts whose prefix
  is cached), `csrc/cpu_prefill_attention.cpp`: flash-attention tiles of queries over the
  query heads that share a KV head, causal mask on the diagonal chunks only, AVX-512 or
  AVX2 microkernels (portable loops elsewhere), threads taking tiles from a shared counter.

Both take the reference's sliding window (keys before a query's window are not read, from
the window's first block on), Gemma 2's soft cap and gpt-oss's attention sinks (each head's
sink joins the softmax's denominator when the output is normalised, relative to the same
running maximum, on every ISA path).

`paged_attention` keeps the reference's contract: padding rows are zero, decode rows of a
mixed batch go to the decode kernel (which runs them about 1.6x faster than the prefill
kernel would). `write_kv_cache` is the fused C++ copy of `cpu_ops`
(the reference's where it cannot run). An fp8 cache (`kv_cache_dtype`, E4M3 or E5M2) is read
by the kernels directly: each fp8 byte widened to fp32 in registers as it is loaded (exactly,
`csrc/cpu_vec.h`), k_scale applied to the scores and v_scale to the outputs; its writes go
through the reference, which quantizes. The kernels are compiled at first use
(`raylm.kernels.native_build`); one that cannot be built is reported once and its rows fall
back to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.kernels import cpu_ops, torch_attention
from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.kv_cache_dtype import FP8_CACHE_DTYPES
from raylm.kernels.native_build import load_native_library

_DTYPES = (torch.float32, torch.bfloat16)
_CACHE_DTYPES = (*_DTYPES, *FP8_CACHE_DTYPES)

# None: not tried yet; False: the build failed (warned once); else the kernel's operator.
_kernel = None
_prefill_kernel = None


def load_kernel():
    """The decode kernel, `torch.ops.raylm.paged_decode_attention`, built on first call or
    loaded from the build cache; None when it cannot be built, after one warning."""
    global _kernel
    if _kernel is None:
        _kernel = load_native_library("cpu_attention") is not None and torch.ops.raylm.paged_decode_attention
    return _kernel or None


def load_prefill_kernel():
    """The prefill kernel, `torch.ops.raylm.paged_prefill_attention`, as `load_kernel`."""
    global _prefill_kernel
    if _prefill_kernel is None:
        _prefill_kernel = (load_native_library("cpu_prefill_attention") is not None
                           and torch.ops.raylm.paged_prefill_attention)
    return _prefill_kernel or None


def is_available() -> bool:
    """Whether the native kernel builds (or is already built) on this machine."""
    return load_kernel() is not None


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The reference's `write_kv_cache` contract, in one C++ pass for fp32 and bf16 caches
    (the reference's for fp8 caches, which it quantizes)."""
    if (key.dtype == k_cache.dtype and value.dtype == k_cache.dtype and cpu_ops.usable(key, value, k_cache, v_cache)
            and k_cache.is_contiguous() and v_cache.is_contiguous() and key.stride(-1) == 1 and value.stride(-1) == 1
            and key.stride(-2) == key.shape[-1] and value.stride(-2) == value.shape[-1]):
        cpu_ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    else:
        torch_attention.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           sliding_window: int | None = None, logits_soft_cap: float | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per sequence, query [B, Hq, D] (fp32 or bf16), over its seq_lens[b]
    cached tokens (the last sliding_window of them, when set) at block_tables[b] of k_cache,
    v_cache [num_blocks, block_size, Hkv, D] (fp32, bf16 or fp8 read as fp8 * k_scale and
    fp8 * v_scale; CPU); returns [B, Hq, D] in the query's dtype. sinks [Hq]: attention
    sinks (the reference's). A table that does not hold
    the tokens read is a ValueError. Needs the kernel (see `is_available`)."""
    kernel = load_kernel()
    assert kernel is not None, "paged_decode_attention needs the native kernel; check is_available()"
    return kernel(query, k_cache, v_cache, _int32(block_tables), _int32(seq_lens), scale, sliding_window or 0,
                  logits_soft_cap or 0.0, k_scale, v_scale, _fp32(sinks))


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            attn_metadata: AttentionMetadata, scale: float, min_query_len: int = 1, *,
                            sliding_window: int | None = None, logits_soft_cap: float | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's `paged_attention` contract for the sequences with at least
    min_query_len queries; the rows of the others, and of padding tokens, are zero.
    k_cache, v_cache fp32, bf16 or fp8 (with its scales) on the CPU; returns [T, Hq, D] in
    the query's dtype. Needs the prefill kernel (see `load_prefill_kernel`)."""
    kernel = load_prefill_kernel()
    assert kernel is not None, "paged_prefill_attention needs the native kernel; check load_prefill_kernel()"
    md = attn_metadata
    return kernel(query, k_cache, v_cache, _int32(md.block_tables), _int32(md.seq_lens), _int32(md.query_start_loc),
                  scale, min_query_len, sliding_window or 0, logits_soft_cap or 0.0, k_scale, v_scale, _fp32(sinks))


def _fp32(sinks: torch.Tensor | None) -> torch.Tensor | None:
    return None if sinks is None else sinks.detach().float().contiguous()


def _int32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.int32 and tensor.is_contiguous() else tensor.to(torch.int32).contiguous()


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's `paged_attention` contract (see `raylm.kernels.torch_attention`),
    on the native kernels: decode rows on the decode kernel, the other sequences' rows on
    the prefill kernel; an fp8 cache read as fp8 * k_scale and fp8 * v_scale. Falls back to
    the reference when the decode kernel is unavailable or the query is not an fp32/bf16 CPU
    tensor or the cache an fp32/bf16/fp8 one, and for prefill rows when only the prefill
    kernel is unavailable. `sinks` (gpt-oss) go to every kernel."""
    md = attn_metadata
    options = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
    if (k_cache.device.type != "cpu" or k_cache.dtype not in _CACHE_DTYPES or query.dtype not in _DTYPES
            or load_kernel() is None):
        return torch_attention.paged_attention(query, k_cache, v_cache, md, scale, k_scale=k_scale, v_scale=v_scale,
                                               **options)
    options.update(k_scale=k_scale, v_scale=v_scale)
    num_tokens = query.shape[0]
    if md.max_query_len == 1 and md.num_seqs == num_tokens:
        return paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, scale, **options)

    if md.max_query_len > 1 and load_prefill_kernel() is not None:
        out = paged_prefill_attention(query, k_cache, v_cache, md, scale, min_query_len=2, **options)
    else:
        out = torch_attention.paged_prefill_attention(query, k_cache, v_cache, md, scale, **options)
    plan = _decode_rows(md)
    if plan is not None:
        out[plan.rows] = paged_decode_attention(query[plan.rows], k_cache, v_cache, plan.block_tables,
                                                plan.seq_lens, scale, **options)
    return out


@dataclass
class _DecodeRows:
    """The decoding sequences (query_len 1) of a step that is not decode-only, or has
    padding rows: the same for every layer, so found once per step."""

    rows: torch.Tensor | slice
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def _decode_rows(md: AttentionMetadata) -> _DecodeRows | None:
    # Cached on the metadata object, which lives exactly one step; not a dataclass field.
    if "_cpu_decode_rows" not in md.__dict__:
        seqs, rows = md.decode_seqs_and_rows()
        plan = None
        if len(seqs) == md.num_seqs:  # decode-only with padding rows after the sequences
            plan = _DecodeRows(slice(0, md.num_seqs), md.block_tables, md.seq_lens)
        elif seqs:
            index = torch.tensor(seqs)
            plan = _DecodeRows(torch.tensor(rows), md.block_tables[index], md.seq_lens[index])
        md.__dict__["_cpu_decode_rows"] = plan
    return md.__dict__["_cpu_decode_rows"]

