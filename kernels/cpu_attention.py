"""Native CPU paged attention: decode rows read K/V straight from the paged cache.

The PyTorch reference (`raylm.kernels.torch_attention`) gathers every decoding sequence's
whole context into a padded [B, Hkv, L, D] tensor each layer each step before two batched
matmuls: three passes over the context plus the allocations. The C++ kernel here, like
vLLM's CPU backend, walks each sequence's block table instead and reads every key and value
row once: one task per (sequence, KV head) computes all query heads of that KV head
together, with an online softmax in fp32 (fp32 or bf16 cache, fp32 accumulation).

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

_CPP_SOURCE = r"""
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// exp(x) for x <= 0 (scores minus their running max), written without calls or branches so
// the loop around it vectorizes (no memcpy either): Cephes' expf, 2^n built from the
// exponent bits.
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.0f : p * two_n;
}

// A cache row as fp32: fp32 rows are used in place, bf16 rows are widened into `buffer`.
inline const float* as_float(const float* row, float*, int) { return row; }

inline const float* as_float(const uint16_t* row, float* buffer, int head_size) {
#pragma omp simd
  for (int d = 0; d < head_size; ++d) {
    buffer[d] = __builtin_bit_cast(float, static_cast<uint32_t>(row[d]) << 16);
  }
  return buffer;
}

// kHeadSize > 0 fixes the head size at compile time (unrolled inner loops); 0 reads it
// from head_size_arg.
template <typename cache_t, int kHeadSize>
void decode(const float* query, const cache_t* k_cache, const cache_t* v_cache, const int32_t* block_tables,
            const int32_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_size_arg, int64_t block_size, int64_t max_blocks, float scale) {
  const int D = kHeadSize > 0 ? kHeadSize : static_cast<int>(head_size_arg);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * D), acc(group * D), scores(group * block_size), k_row(D), v_row(D);
    std::vector<float> running_max(group), running_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t seq_len = seq_lens[seq];
      const float* q_src = query + (seq * num_heads + kv_head * group) * D;
      float* out_dst = out + (seq * num_heads + kv_head * group) * D;
      if (seq_len <= 0) {
        std::fill(out_dst, out_dst + group * D, 0.0f);
        continue;
      }
      for (int64_t i = 0; i < group * D; ++i) q[i] = q_src[i] * scale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.0f);
      const int32_t* table = block_tables + seq * max_blocks;
      for (int64_t first = 0; first < seq_len; first += block_size) {
        const int64_t n = std::min(block_size, seq_len - first);
        const int64_t offset = table[first / block_size] * block_stride + kv_head * D;
        const cache_t* k_block = k_cache + offset;
        const cache_t* v_block = v_cache + offset;
        if (first + block_size < seq_len) {
          // The next block lies anywhere in the cache, beyond the hardware prefetcher's guess.
          const int64_t next = table[first / block_size + 1] * block_stride + kv_head * D;
          const int64_t next_n = std::min(block_size, seq_len - first - block_size);
          for (int64_t t = 0; t < next_n; ++t) {
            for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(cache_t)); byte += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(k_cache + next + t * token_stride) + byte);
              __builtin_prefetch(reinterpret_cast<const char*>(v_cache + next + t * token_stride) + byte);
            }
          }
        }
        for (int64_t t = 0; t < n; ++t) {
          const float* k = as_float(k_block + t * token_stride, k_row.data(), D);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = q.data() + g * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; ++d) s += qg[d] * k[d];
            scores[g * block_size + t] = s;
          }
        }
        // Online softmax: rescale what was accumulated so far to this block's new maximum.
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * block_size;
          float block_max = running_max[g];
#pragma omp simd reduction(max : block_max)
          for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sg[t]);
          float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = exp_nonpositive(sg[t] - block_max);
            block_sum += sg[t];
          }
          if (block_max != running_max[g]) {
            const float alpha = std::exp(running_max[g] - block_max);
            float* ag = acc.data() + g * D;
            for (int d = 0; d < D; ++d) ag[d] *= alpha;
            running_sum[g] *= alpha;
            running_max[g] = block_max;
          }
          running_sum[g] += block_sum;
        }
        for (int64_t t = 0; t < n; ++t) {
          const float* v = as_float(v_block + t * token_stride, v_row.data(), D);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * block_size + t];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) ag[d] += p * v[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.0f / running_sum[g];
        for (int d = 0; d < D; ++d) out_dst[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
}

template <typename cache_t>
void dispatch_head_size(const float* query, const cache_t* k, const cache_t* v, const int32_t* tables,
                        const int32_t* lens, float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                        int64_t block_size, int64_t max_blocks, float scale) {
  switch (D) {
    case 32: return decode<cache_t, 32>(query, k, v, tables, lens, out, B, Hq, Hkv, D, block_size, max_blocks, scale);
    case 64: return decode<cache_t, 64>(query, k, v, tables, lens, out, B, Hq, Hkv, D, block_size, max_blocks, scale);
    case 128: return decode<cache_t, 128>(query, k, v, tables, lens, out, B, Hq, Hkv, D, block_size, max_blocks, scale);
    default: return decode<cache_t, 0>(query, k, v, tables, lens, out, B, Hq, Hkv, D, block_size, max_blocks, scale);
  }
}

}  // namespace

// query and out [B, Hq, D] fp32; k_cache, v_cache [num_blocks, block_size, Hkv, D] fp32 or
// bf16 (cache_is_bf16); block_tables [B, max_blocks] int32; seq_lens [B] int32; all
// contiguous. Returns 0, or 1 + the first sequence whose table does not hold its seq_len
// tokens in valid blocks (nothing computed), or -1 if the kernel threw.
extern "C" int64_t raylm_paged_decode_attention(const float* query, const void* k_cache, const void* v_cache,
                                                const int32_t* block_tables, const int32_t* seq_lens, float* out,
                                                int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                                                int64_t max_blocks, int64_t num_blocks, float scale,
                                                int32_t cache_is_bf16) {
  // The kernel trusts the tables; check them once here rather than read out of bounds.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (static_cast<int64_t>(seq_lens[b]) + block_size - 1) / block_size;
    if (seq_lens[b] < 0 || used > max_blocks) return b + 1;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t block = block_tables[b * max_blocks + i];
      if (block < 0 || block >= num_blocks) return b + 1;
    }
  }
  try {
    if (cache_is_bf16) {
      dispatch_head_size<uint16_t>(query, static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache),
                                   block_tables, seq_lens, out, B, Hq, Hkv, D, block_size, max_blocks, scale);
    } else {
      dispatch_head_size<float>(query, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
                                block_tables, seq_lens, out, B, Hq, Hkv, D, block_size, max_blocks, scale);
    }
  } catch (...) {
    return -1;
  }
  return 0;
}
"""

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
    key = "\n".join([_CPP_SOURCE, " ".join(_CFLAGS + _LDFLAGS), torch.__version__, platform.machine(), cpu_flags])
    name = "raylm_cpu_attention_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    build_dir = cache_home / "raylm" / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    source = build_dir / "cpu_attention.cpp"
    if not source.exists() or source.read_text() != _CPP_SOURCE:
        partial = source.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(_CPP_SOURCE)
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
