"""Native CPU paged attention: decode rows read K/V straight from the paged cache.

The PyTorch reference (`raylm.kernels.torch_attention`) gathers every decoding sequence's
whole context into a padded [B, Hkv, L, D] tensor each layer each step before two batched
matmuls: three passes over the context plus the allocations. The C++ kernel
(`csrc/cpu_attention.cpp`), like vLLM's CPU backend, walks each sequence's block table
instead and reads every key and value row once: one task per sequence computes all its
query heads block by block (one task per KV head when there are few sequences), with an
online softmax in fp32 (fp32 or bf16 cache, fp32 accumulation), register-blocked with AVX2
where the CPU has it.

`paged_attention` keeps the reference's contract: decode rows (query_len 1) take the
kernel, prefill rows take the reference's per-sequence path, padding rows are zero.
`write_kv_cache` is the reference's. The kernel is compiled at first use with
`torch.utils.cpp_extension.load` (needs a C++ compiler and ninja) into a build directory
under ~/.cache keyed by source, flags, torch version and CPU, so later processes only load
it. If it cannot be built, everything falls back to the reference after one warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from raylm.kernels import torch_attention
from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.torch_attention import write_kv_cache  # noqa: F401  (the backend's writer)

logger = logging.getLogger(__name__)

# The kernel's C++ source, next to this file.
_CPP_SOURCE_PATH = Path(__file__).parent / "csrc" / "cpu_attention.cpp"

_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

# None: not tried yet; False: the build failed (warned once); else the kernel's entry point.
_kernel = None


def load_kernel():
    """The compiled kernel (a ctypes function), built on first call or loaded from the build
    cache; None when it cannot be built, after one warning."""
    global _kernel
    if _kernel is None:
        try:
            _kernel = _build()
        except Exception as error:  # no compiler, no ninja, a compile error: keep serving
            logger.warning("The native CPU attention kernel could not be built (%s: %s); using the PyTorch "
                           "reference attention instead.", type(error).__name__, str(error).strip()[-2000:])
            _kernel = False
    return _kernel or None


def is_available() -> bool:
    """Whether the native kernel builds (or is already built) on this machine."""
    return load_kernel() is not None


def _build():
    from torch.utils.cpp_extension import load

    # -march=native code must not be reused on another CPU, nor a build against another torch.
    cpu_flags = ""
    try:
        cpu_flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    cpp_source = _CPP_SOURCE_PATH.read_text()
    key = "\n".join([cpp_source, " ".join(_CFLAGS + _LDFLAGS), torch.__version__, platform.machine(), cpu_flags])
    name = "raylm_cpu_attention_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    build_dir = cache_home / "raylm" / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    source = build_dir / "cpu_attention.cpp"
    if not source.exists() or source.read_text() != cpp_source:
        partial = source.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(cpp_source)
        partial.replace(source)  # atomic: concurrent workers never compile half a file
    start = time.perf_counter()
    # A plain shared library behind a C entry point rather than a pybind module: the source
    # then includes only ATen/Parallel.h, not torch/extension.h, which cuts the first build
    # from minutes to seconds on a small machine.
    load(name=name, sources=[str(source)], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
         build_directory=str(build_dir), is_python_module=False, verbose=False)
    kernel = ctypes.CDLL(str(build_dir / f"{name}.so")).raylm_paged_decode_attention
    kernel.restype = ctypes.c_int64
    kernel.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int32])
    logger.info("Native CPU attention kernel ready in %.1f s (%s).", time.perf_counter() - start, build_dir)
    return kernel


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


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference's `paged_attention` contract (see `raylm.kernels.torch_attention`),
    with the decode rows on the native kernel. Falls back to the reference when the kernel
    is unavailable or the cache is not an fp32/bf16 CPU tensor."""
    md = attn_metadata
    if (k_cache.device.type != "cpu" or k_cache.dtype not in (torch.float32, torch.bfloat16)
            or load_kernel() is None):
        return torch_attention.paged_attention(query, k_cache, v_cache, md, scale)
    num_tokens = query.shape[0]
    if md.max_query_len == 1 and md.num_seqs == num_tokens:
        return paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens, scale)

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
