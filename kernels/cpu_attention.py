"""Native CPU paged attention: keys and values read straight from the paged cache.

The PyTorch reference (`raylm.kernels.torch_attention`) gathers every decoding sequence's
whole context into a padded [B, Hkv, L, D] tensor each layer each step before two batched
matmuls, and runs each prefilling sequence through its own gather and SDPA call. Two C++
kernels, like vLLM's CPU backend, walk each sequence's block table instead, with an online
softmax in fp32 over an fp32 or bf16 cache:

- decode rows (query_len 1), `csrc/cpu_attention.cpp`: read every key and value row once;
  one task per sequence computes all its query heads block by block (one task per KV head
  when there are few sequences), register-blocked with AVX2 where the CPU has it.
- prefill rows (query_len > 1: prompts, chunks of a chunked prefill, prompts whose prefix
  is cached), `csrc/cpu_prefill_attention.cpp`: flash-attention tiles of queries over the
  query heads that share a KV head, causal mask on the diagonal chunks only, AVX-512 or
  AVX2 microkernels (portable loops elsewhere), threads taking tiles from a shared counter.

`paged_attention` keeps the reference's contract: padding rows are zero, decode rows of a
mixed batch go to the decode kernel (which runs them about 1.6x faster than the prefill
kernel would). `write_kv_cache` is the fused C++ copy of `cpu_ops`
(the reference's where it cannot run). The kernels are compiled at first use
(`raylm.kernels.native_build`); one that cannot be built is reported once and its rows fall
back to the reference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from raylm.kernels import cpu_ops, torch_attention
from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.native_build import load_native_library

# None: not tried yet; False: the build failed (warned once); else the kernel's entry point.
_kernel = None
_prefill_kernel = None


def load_kernel():
    """The compiled kernel (a ctypes function), built on first call or loaded from the build
    cache; None when it cannot be built, after one warning."""
    global _kernel
    if _kernel is None:
        library = load_native_library("cpu_attention")
        if library is None:
            _kernel = False
        else:
            _kernel = library.raylm_paged_decode_attention
            _kernel.restype = ctypes.c_int64
            _kernel.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int32]
    return _kernel or None


def load_prefill_kernel():
    """The compiled prefill kernel (a ctypes function), as `load_kernel`."""
    global _prefill_kernel
    if _prefill_kernel is None:
        library = load_native_library("cpu_prefill_attention")
        if library is None:
            _prefill_kernel = False
        else:
            _prefill_kernel = library.raylm_paged_prefill_attention
            _prefill_kernel.restype = ctypes.c_int64
            _prefill_kernel.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8
                                        + [ctypes.c_float, ctypes.c_int32, ctypes.c_int64])
    return _prefill_kernel or None


def is_available() -> bool:
    """Whether the native kernel builds (or is already built) on this machine."""
    return load_kernel() is not None


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """The reference's `write_kv_cache` contract, in one C++ pass for fp32 caches."""
    if cpu_ops.usable(key, value, k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous():
        cpu_ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    else:
        torch_attention.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row per sequence, query [B, Hq, D], over its seq_lens[b] cached tokens at
    block_tables[b] of k_cache, v_cache [num_blocks, block_size, Hkv, D] (fp32 or bf16, CPU);
    returns [B, Hq, D] in the query's dtype. Needs the kernel (see `is_available`)."""
    kernel = load_kernel()
    assert kernel is not None, "paged_decode_attention needs the native kernel; check is_available()"
    batch, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    assert k_cache.dtype in (torch.float32, torch.bfloat16) and k_cache.device.type == "cpu"
    assert k_cache.shape[3] == head_size and num_heads % num_kv_heads == 0
    assert block_tables.shape[0] == batch and seq_lens.shape == (batch,)
    query32 = query.float().contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query32)
    status = kernel(query32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                    seq_lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_size, block_size,
                    block_tables.shape[1], num_blocks, scale, k_cache.dtype == torch.bfloat16)
    if status > 0:
        seq = status - 1
        raise ValueError(f"seq_lens[{seq}] = {int(seq_lens[seq])} does not fit its block table "
                         f"({block_tables.shape[1]} entries of {block_size} tokens, blocks below {num_blocks}).")
    if status < 0:
        raise RuntimeError("the native CPU attention kernel failed")
    return out.to(query.dtype)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            attn_metadata: AttentionMetadata, scale: float, min_query_len: int = 1) -> torch.Tensor:
    """The reference's `paged_attention` contract for the sequences with at least
    min_query_len queries; the rows of the others, and of padding tokens, are zero.
    k_cache, v_cache fp32 or bf16 on the CPU; returns [T, Hq, D] in the query's dtype.
    Needs the prefill kernel (see `load_prefill_kernel`)."""
    kernel = load_prefill_kernel()
    assert kernel is not None, "paged_prefill_attention needs the native kernel; check load_prefill_kernel()"
    md = attn_metadata
    num_tokens, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    assert k_cache.dtype in (torch.float32, torch.bfloat16) and k_cache.device.type == "cpu"
    assert k_cache.shape[3] == head_size and num_heads % num_kv_heads == 0
    num_seqs = md.seq_lens.shape[0]
    assert md.block_tables.shape[0] == num_seqs and md.query_start_loc.shape == (num_seqs + 1,)
    query32 = query.float().contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    block_tables = md.block_tables.to(torch.int32).contiguous()
    seq_lens = md.seq_lens.to(torch.int32).contiguous()
    query_start_loc = md.query_start_loc.to(torch.int32).contiguous()
    out = torch.empty_like(query32)
    status = kernel(query32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                    seq_lens.data_ptr(), query_start_loc.data_ptr(), out.data_ptr(), num_seqs, num_tokens, num_heads,
                    num_kv_heads, head_size, block_size, block_tables.shape[1], num_blocks, scale,
                    k_cache.dtype == torch.bfloat16, min_query_len)
    if status > 0:
        seq = status - 1
        begin, end, seq_len = int(query_start_loc[seq]), int(query_start_loc[seq + 1]), int(seq_lens[seq])
        if not 0 <= begin <= end <= num_tokens or end - begin > seq_len:
            raise ValueError(f"Sequence {seq} has query rows query_start_loc[{seq}:{seq + 2}] = {begin}..{end} "
                             f"of {num_tokens} and seq_lens[{seq}] = {seq_len}; its queries must be rows of the "
                             f"query and at most seq_len of them.")
        raise ValueError(f"seq_lens[{seq}] = {seq_len} does not fit its block table "
                         f"({block_tables.shape[1]} entries of {block_size} tokens, blocks below {num_blocks}).")
    if status < 0:
        raise RuntimeError("the native CPU prefill attention kernel failed")
    return out.to(query.dtype)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference's `paged_attention` contract (see `raylm.kernels.torch_attention`),
    on the native kernels: decode rows on the decode kernel, the other sequences' rows on
    the prefill kernel. Falls back to the reference when the decode kernel is unavailable
    or the cache is not an fp32/bf16 CPU tensor, and for prefill rows when only the prefill
    kernel is unavailable."""
    md = attn_metadata
    if (k_cache.device.type != "cpu" or k_cache.dtype not in (torch.float32, torch.bfloat16)
            or load_kernel() is None):
        return torch_attention.paged_attention(query, k_cache, v_cache, md, scale)
    num_tokens = query.shape[0]
    if md.max_query_len == 1 and md.num_seqs == num_tokens:
        return paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, scale)

    if md.max_query_len > 1 and load_prefill_kernel() is not None:
        out = paged_prefill_attention(query, k_cache, v_cache, md, scale, min_query_len=2)
    else:
        out = query.new_zeros(query.shape)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(md.query_lens_list, md.seq_lens_list)):
            if query_len > 1:
                out[start:start + query_len] = torch_attention._prefill_one(
                    query[start:start + query_len], k_cache, v_cache, md.block_tables[i], seq_len, scale)
            start += query_len
    plan = _decode_rows(md)
    if plan is not None:
        out[plan.rows] = paged_decode_attention(query[plan.rows], k_cache, v_cache, plan.block_tables,
                                                plan.seq_lens, scale)
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
        seqs, rows, start = [], [], 0
        for i, query_len in enumerate(md.query_lens_list):
            if query_len == 1:
                seqs.append(i)
                rows.append(start)
            start += query_len
        plan = None
        if len(seqs) == md.num_seqs:  # decode-only with padding rows after the sequences
            plan = _DecodeRows(slice(0, md.num_seqs), md.block_tables, md.seq_lens)
        elif seqs:
            index = torch.tensor(seqs)
            plan = _DecodeRows(torch.tensor(rows), md.block_tables[index], md.seq_lens[index])
        md.__dict__["_cpu_decode_rows"] = plan
    return md.__dict__["_cpu_decode_rows"]
