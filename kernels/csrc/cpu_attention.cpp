// Paged decode attention on the CPU: one query row per sequence, keys and values read
// straight from the paged cache through the sequence's block table.
//
// A task computes all query heads of one sequence (or, with few sequences, the query heads
// of one KV head), block by block, with an online softmax in fp32 (the cache is fp32, bf16 or fp8). On x86 with
// AVX2 and FMA, the two inner products are register-blocked: scores of 8 keys at a time
// (8 accumulators, reduced together by one transposing horizontal sum), and the weighted
// sum of values for two query heads at a time over 32 channels held in registers. Elsewhere
// plain loops that the compiler vectorizes as it can.
//
// With AVX-512 and a head size that is a multiple of 16, both products run 16 lanes wide
// instead: scores in tiles of 4 query heads x 4 keys (vdpbf16ps on bf16 queries and cache
// where the CPU has AVX512-BF16; for those and fp32 caches each key's channels broadcast to
// four 128-bit lanes, one head a lane: score_block_quads), values 4 heads at a time. On a 2-core AMD EPYC (Zen 4) the
// ~100M Llama's decode call (batch 64, ~190 tokens, heads 16/4 x 64, bf16) went from 0.64 to
// 0.47 ms with a warm cache and from 1.24 to 0.97 ms inside the engine. That path also does a
// sequence in two passes, all its scores and then all its values, with no online softmax.
//
// The next block of a sequence is prefetched while the current one is computed. The AVX-512
// path spreads the requests over its scoring, four keys' rows of the next block per four keys
// scored: asked for all at once (256-512 lines), they stalled the core on a full miss queue.
// With a cold cache (the engine's case) that took the ~100M Llama's call from 1.0 to 0.67 ms
// in bf16 and from 1.6 to 1.0 ms in fp32 (the 5M Llama's fp32 call 0.84 -> 0.52 ms), 13-16 ->
// 19-25 GB/s of the ~48 GB/s the two cores read.
//
// Queries and outputs are fp32 or bf16 (converted in the task's own copy of its queries and
// when it writes its rows), the cache fp32, bf16 or fp8 (E4M3 or E5M2, widened to fp32 in
// registers as it is loaded: cpu_vec.h; k_scale folded into the query's scale, v_scale into
// the outputs'); everything is computed in fp32. The
// kernel is the PyTorch operator torch.ops.raylm.paged_decode_attention (registered below).
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp (or a narrower ISA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace raylm;

#if RAYLM_AVX2
// Channel order. With a bf16 cache the AVX2 code reads 16 channels with one load and splits
// them into the even channels (a shift) and the odd ones (a mask), which saves the widening
// shuffle of load8; queries and accumulators are then kept in that order: within each whole
// group of 16 channels the 8 even ones, then the 8 odd ones (a trailing group of 8 stays as
// it is). Dot products do not depend on the order; queries are permuted on the way in and
// outputs back on the way out (kernel_channel).
inline void load16(const float* p, __m256& first, __m256& second) {
  first = _mm256_loadu_ps(p);
  second = _mm256_loadu_ps(p + 8);
}

inline void load16(const uint16_t* p, __m256& even, __m256& odd) {
  // 32-bit lane i holds channel 2i in its low half and 2i + 1 in its high half.
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

template <typename fp8_t, std::enable_if_t<kIsFp8<fp8_t>, int> = 0>
inline void load16(const fp8_t* p, __m256& first, __m256& second) {  // natural order
  first = load8(p);
  second = load8(p + 8);
}

// v[0:W] = the W * 8 channels at p, in kernel order (W even, or 1).
template <int W, typename cache_t>
inline void load_channels(const cache_t* p, __m256* v) {
  if constexpr (W == 1) {
    v[0] = load8(p);
  } else {
    for (int i = 0; i < W; i += 2) load16(p + 8 * i, v[i], v[i + 1]);
  }
}
#endif

// Whether the kernel keeps channels in the split order above: a bf16 cache on the AVX2 path.
template <typename cache_t>
constexpr bool kSplitOrder = RAYLM_AVX2 && std::is_same_v<cache_t, uint16_t>;

// The channel held at position d (of D) in kernel order.
template <typename cache_t>
inline int kernel_channel(int d, int D) {
  if (!kSplitOrder<cache_t> || D % 8 != 0 || d >= D / 16 * 16) return d;
  const int in_group = d % 16;
  return d - in_group + (in_group < 8 ? 2 * in_group : 2 * (in_group - 8) + 1);
}

// scores[t] = q . k_t for the n keys at k (rows token_stride apart). `padded` says that rows
// up to n rounded up to 8 exist (inside the same block), so whole groups of 8 may be read;
// scores beyond n are then garbage that the caller never reads.
template <typename cache_t>
void score_block(const float* q, const cache_t* k, int64_t token_stride, int n, int D, bool padded, float* scores) {
#if RAYLM_AVX2
  if (D % 8 == 0) {
    int t = 0;
    for (; t + 8 <= n || (padded && t < n); t += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      int d = 0;
      for (; d + 16 <= D; d += 16) {
        const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + d + 8);
        for (int j = 0; j < 8; ++j) {
          __m256 k0, k1;
          load16(k + (t + j) * token_stride + d, k0, k1);
          acc[j] = _mm256_fmadd_ps(q1, k1, _mm256_fmadd_ps(q0, k0, acc[j]));
        }
      }
      if (d < D) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k + (t + j) * token_stride + d), acc[j]);
      }
      _mm256_storeu_ps(scores + t, transpose_sum8(acc));
    }
    for (; t < n; ++t) {
      __m256 acc = _mm256_setzero_ps();
      int d = 0;
      for (; d + 16 <= D; d += 16) {
        __m256 k0, k1;
        load16(k + t * token_stride + d, k0, k1);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), k1, _mm256_fmadd_ps(_mm256_loadu_ps(q + d), k0, acc));
      }
      if (d < D) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + t * token_stride + d), acc);
      scores[t] = sum8(acc);
    }
    return;
  }
#endif
  (void)padded;
  for (int t = 0; t < n; ++t) {
    const cache_t* row = k + t * token_stride;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < D; ++d) s += q[d] * to_float(row[d]);
    scores[t] = s;
  }
}

#if RAYLM_AVX2
// out[0:8W] += sum_t probs[t] * v_t[0:8W] for one query head: even and odd keys go to
// separate accumulators, so W = 4 still gives 8 independent FMA chains.
template <int W, typename cache_t>
void accumulate_one_head_chunk(const float* probs, const cache_t* v, int64_t token_stride, int n, float* out) {
  __m256 even[W], odd[W];
  for (int i = 0; i < W; ++i) {
    even[i] = _mm256_loadu_ps(out + 8 * i);
    odd[i] = _mm256_setzero_ps();
  }
  int t = 0;
  for (; t + 2 <= n; t += 2) {
    const __m256 w0 = _mm256_set1_ps(probs[t]), w1 = _mm256_set1_ps(probs[t + 1]);
    const cache_t* row0 = v + t * token_stride;
    const cache_t* row1 = row0 + token_stride;
    __m256 values0[W], values1[W];
    load_channels<W>(row0, values0);
    load_channels<W>(row1, values1);
    for (int i = 0; i < W; ++i) {
      even[i] = _mm256_fmadd_ps(w0, values0[i], even[i]);
      odd[i] = _mm256_fmadd_ps(w1, values1[i], odd[i]);
    }
  }
  if (t < n) {
    const __m256 w = _mm256_set1_ps(probs[t]);
    __m256 values[W];
    load_channels<W>(v + t * token_stride, values);
    for (int i = 0; i < W; ++i) even[i] = _mm256_fmadd_ps(w, values[i], even[i]);
  }
  for (int i = 0; i < W; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(even[i], odd[i]));
}

template <typename cache_t>
void accumulate_values_one_head(const float* probs, const cache_t* v, int64_t token_stride, int n, int D,
                                float* out) {
  int d = 0;
  for (; d + 32 <= D; d += 32) accumulate_one_head_chunk<4>(probs, v + d, token_stride, n, out + d);
  for (; d + 16 <= D; d += 16) accumulate_one_head_chunk<2>(probs, v + d, token_stride, n, out + d);
  if (d < D) accumulate_one_head_chunk<1>(probs, v + d, token_stride, n, out + d);
}
#endif

#if RAYLM_AVX2
// score_block for two query heads sharing the keys: each key row is loaded once for both.
// Needs D % 8 == 0 and rows up to n rounded up to 4 (the caller's `padded`).
template <typename cache_t>
void score_block_pair(const float* q0, const float* q1, const cache_t* k, int64_t token_stride, int n, int D,
                      float* scores0, float* scores1) {
  for (int t = 0; t < n; t += 4) {
    __m256 acc[8];  // acc[j]: key t + j against q0; acc[4 + j]: against q1
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) {
      const __m256 a0 = _mm256_loadu_ps(q0 + d), a1 = _mm256_loadu_ps(q0 + d + 8);
      const __m256 b0 = _mm256_loadu_ps(q1 + d), b1 = _mm256_loadu_ps(q1 + d + 8);
      for (int j = 0; j < 4; ++j) {
        __m256 key0, key1;
        load16(k + (t + j) * token_stride + d, key0, key1);
        acc[j] = _mm256_fmadd_ps(a1, key1, _mm256_fmadd_ps(a0, key0, acc[j]));
        acc[4 + j] = _mm256_fmadd_ps(b1, key1, _mm256_fmadd_ps(b0, key0, acc[4 + j]));
      }
    }
    if (d < D) {
      const __m256 a = _mm256_loadu_ps(q0 + d), b = _mm256_loadu_ps(q1 + d);
      for (int j = 0; j < 4; ++j) {
        const __m256 key = load8(k + (t + j) * token_stride + d);
        acc[j] = _mm256_fmadd_ps(a, key, acc[j]);
        acc[4 + j] = _mm256_fmadd_ps(b, key, acc[4 + j]);
      }
    }
    const __m256 sums = transpose_sum8(acc);
    _mm_storeu_ps(scores0 + t, _mm256_castps256_ps128(sums));
    _mm_storeu_ps(scores1 + t, _mm256_extractf128_ps(sums, 1));
  }
}
#endif

// out_g += sum_t p_g[t] * v_t for each of `count` (1 or 2) query heads g, over the n values
// at v (rows token_stride apart); p_g = probs + g * probs_stride, out_g = out + g * D.
template <typename cache_t>
void accumulate_values(const float* probs, int64_t probs_stride, int count, const cache_t* v, int64_t token_stride,
                       int n, int D, float* out) {
#if RAYLM_AVX2
  if (D % 8 == 0) {
    if (count == 1) {
      accumulate_values_one_head(probs, v, token_stride, n, D, out);
      return;
    }
    const float* p0 = probs;
    const float* p1 = probs + probs_stride;
    float* out1 = out + D;
    int d = 0;
    // 32 channels of two heads: 8 independent accumulators keep both FMA pipes busy.
    for (; d + 32 <= D; d += 32) {
      __m256 a0[4], a1[4];
      for (int i = 0; i < 4; ++i) {
        a0[i] = _mm256_loadu_ps(out + d + 8 * i);
        a1[i] = _mm256_loadu_ps(out1 + d + 8 * i);
      }
      for (int t = 0; t < n; ++t) {
        const __m256 w0 = _mm256_set1_ps(p0[t]), w1 = _mm256_set1_ps(p1[t]);
        __m256 values[4];
        load_channels<4>(v + t * token_stride + d, values);
        for (int i = 0; i < 4; ++i) {
          a0[i] = _mm256_fmadd_ps(w0, values[i], a0[i]);
          a1[i] = _mm256_fmadd_ps(w1, values[i], a1[i]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(out + d + 8 * i, a0[i]);
        _mm256_storeu_ps(out1 + d + 8 * i, a1[i]);
      }
    }
    for (; d + 16 <= D; d += 16) {
      __m256 a0[2], a1[2];
      for (int i = 0; i < 2; ++i) {
        a0[i] = _mm256_loadu_ps(out + d + 8 * i);
        a1[i] = _mm256_loadu_ps(out1 + d + 8 * i);
      }
      for (int t = 0; t < n; ++t) {
        const __m256 w0 = _mm256_set1_ps(p0[t]), w1 = _mm256_set1_ps(p1[t]);
        __m256 values[2];
        load_channels<2>(v + t * token_stride + d, values);
        for (int i = 0; i < 2; ++i) {
          a0[i] = _mm256_fmadd_ps(w0, values[i], a0[i]);
          a1[i] = _mm256_fmadd_ps(w1, values[i], a1[i]);
        }
      }
      for (int i = 0; i < 2; ++i) {
        _mm256_storeu_ps(out + d + 8 * i, a0[i]);
        _mm256_storeu_ps(out1 + d + 8 * i, a1[i]);
      }
    }
    if (d < D) {
      __m256 a0 = _mm256_loadu_ps(out + d), a1 = _mm256_loadu_ps(out1 + d);
      for (int t = 0; t < n; ++t) {
        const __m256 value = load8(v + t * token_stride + d);
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(p0[t]), value, a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(p1[t]), value, a1);
      }
      _mm256_storeu_ps(out + d, a0);
      _mm256_storeu_ps(out1 + d, a1);
    }
    return;
  }
#endif
  for (int g = 0; g < count; ++g) {
    const float* p = probs + g * probs_stride;
    float* o = out + g * D;
    for (int t = 0; t < n; ++t) {
      const cache_t* row = v + t * token_stride;
      const float w = p[t];
#pragma omp simd
      for (int d = 0; d < D; ++d) o[d] += w * to_float(row[d]);
    }
  }
}

// Every cache line of the rows. Prefetching every other line, counting on the hardware's
// adjacent-line prefetch for the rest, measured 1.4x slower with a cold cache (64 sequences
// of 1024 tokens, heads 16/4 x 64, bf16 and fp32, on a 2-core AMX Xeon): that prefetcher
// did not fill the gaps there. The lines go to L2 (prefetcht2), not L1: a block is 256 lines
// of K and V, more than L1's miss buffers track, and on a 2-core AMD EPYC (Zen 4) the
// engine's own decode calls (5M Llama, batch 64, ~190 tokens, cache cold) took 0.80-0.83 ms
// with T2 hints against 0.88-0.98 ms with T0.
// Block `index` of a sequence's table, read from position `from` on (the start of the
// sequence's sliding window; 0 without one): where that row starts in the caches (plus
// head_offset, the task's first KV head), how many rows from there hold the sequence's tokens,
// and how many rows of the block before it are skipped; none past the sequence's last block.
// Callers start at block from / block_size: blocks before it are never read (with a window the
// engine may have freed them and left a placeholder id in the table).
struct BlockRows {
  int64_t offset = 0;
  int n = 0;
  int skipped = 0;
};
inline BlockRows block_rows(const int32_t* table, int64_t index, int64_t from, int64_t seq_len, int64_t block_size,
                            int64_t block_stride, int64_t token_stride, int64_t head_offset) {
  const int64_t start = std::max(index * block_size, from);
  if (start >= seq_len) return {};
  const int64_t skipped = start - index * block_size;
  return {table[index] * block_stride + skipped * token_stride + head_offset,
          static_cast<int>(std::min((index + 1) * block_size, seq_len) - start), static_cast<int>(skipped)};
}

// The first position a sequence's one query (at seq_len - 1) attends to: window 0 is none.
inline int64_t window_start(int64_t seq_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
}

template <typename cache_t>
void prefetch_rows(const cache_t* k, const cache_t* v, int64_t token_stride, int n, int width) {
  for (int t = 0; t < n; ++t) {
    for (int64_t byte = 0; byte < width * static_cast<int64_t>(sizeof(cache_t)); byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k + t * token_stride) + byte, 0, 1);
      __builtin_prefetch(reinterpret_cast<const char*>(v + t * token_stride) + byte, 0, 1);
    }
  }
}

#if RAYLM_AVX512
// ---- AVX-512 (head sizes that are multiples of 16) ----------------------------------------
// Channels stay in their natural order. Scores take 4 query heads x 4 keys at a time: 16
// accumulators whose sums one transposing reduction turns into a vector of 16 scores, so a
// key row is loaded once for 4 heads. With a bf16 cache, bf16 queries and AVX512-BF16, the
// products are vdpbf16ps on the raw bf16 query (the same products as in fp32: a bf16 x bf16
// product is exact in fp32) and the scale is applied to the scores.

// Lane 4i + j of the result: the sum of the lanes of a[4i + j].
inline __m512 transpose_sum16(const __m512* a) {
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) {
    const __m512* g = a + 4 * i;
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(g[0], g[1]), _mm512_unpackhi_ps(g[0], g[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(g[2], g[3]), _mm512_unpackhi_ps(g[2], g[3]));
    // Per 128-bit lane: the partial sums of g[0], g[1], g[2], g[3] over that lane's 4 floats.
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
  }
  // Transpose the 4 x 4 grid of 128-bit lanes and add across it.
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// scores_h[t] = q_h . k_t for `heads` (<= 4) query heads and keys t < n rounded up to 4 (rows
// that exist in the block; scores past n are garbage the caller never reads). q: fp32, scaled,
// heads D apart. q_bf16: the same heads' raw bf16 queries, or null.
template <int D, typename cache_t>
void score_block_wide(const float* q, const uint16_t* q_bf16, float scale, const cache_t* k, int64_t token_stride,
                      int n, int heads, float* scores, int64_t scores_stride, const cache_t* next_k = nullptr,
                      const cache_t* next_v = nullptr, int next_n = 0) {
  const float* qh[4];
  const uint16_t* qbh[4];
  for (int h = 0; h < 4; ++h) {
    qh[h] = q + std::min(h, heads - 1) * D;
    qbh[h] = q_bf16 == nullptr ? nullptr : q_bf16 + std::min(h, heads - 1) * D;
  }
#if defined(__AVX512BF16__)
  const bool dot_bf16 = std::is_same_v<cache_t, uint16_t> && q_bf16 != nullptr && D % 32 == 0;
#else
  const bool dot_bf16 = false;
#endif
  const __m512 score_scale = _mm512_set1_ps(dot_bf16 ? scale : 1.0f);
  for (int t = 0; t < n; t += 4) {
    // The next block's rows of this KV head, four keys' worth per four keys scored: spread
    // over the work rather than asked for at once, the requests keep the memory busy without
    // stalling on a full miss queue.
    const int prefetched = std::min(4, next_n - t);
    if (prefetched > 0) {
      prefetch_rows(next_k + t * token_stride, next_v + t * token_stride, token_stride, prefetched, D);
    }
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<cache_t, uint16_t> && D % 32 == 0) {
      if (dot_bf16) {
        for (int c = 0; c < D; c += 32) {
          __m512bh keys[4];
          for (int j = 0; j < 4; ++j) keys[j] = (__m512bh)_mm512_loadu_si512(k + (t + j) * token_stride + c);
          for (int h = 0; h < 4; ++h) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qbh[h] + c);
            for (int j = 0; j < 4; ++j) acc[4 * h + j] = _mm512_dpbf16_ps(acc[4 * h + j], qv, keys[j]);
          }
        }
      }
    }
#endif
    if (!dot_bf16) {
      for (int c = 0; c < D; c += 16) {
        __m512 keys[4];
        for (int j = 0; j < 4; ++j) keys[j] = vload(k + (t + j) * token_stride + c);
        for (int h = 0; h < 4; ++h) {
          const __m512 qv = _mm512_loadu_ps(qh[h] + c);
          for (int j = 0; j < 4; ++j) acc[4 * h + j] = _mm512_fmadd_ps(qv, keys[j], acc[4 * h + j]);
        }
      }
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, _mm512_mul_ps(transpose_sum16(acc), score_scale));
    for (int h = 0; h < heads; ++h) std::copy_n(sums + 4 * h, 4, scores + h * scores_stride + t);
  }
}

// Queries laid out for score_block_quads: per 128-bit lane one head, so that a key's next 4
// fp32 channels (8 bf16), broadcast to the four lanes, multiply four heads at once. fp32: for
// each 4 channels c, the 16 floats [h0 c..c+3 | h1 c..c+3 | h2 | h3]; bf16: for each 8, the 32
// bf16 [h0 c..c+7 | h1 | h2 | h3]. Heads past `heads` repeat the last. out holds 4 * D.
template <typename T>
inline void arrange_by_lane(const T* q, int D, int heads, T* out) {
  constexpr int kPerLane = 16 / sizeof(T);
  for (int c = 0; c < D; c += kPerLane)
    for (int h = 0; h < 4; ++h) std::copy_n(q + std::min(h, heads - 1) * D + c, kPerLane, out + c * 4 + h * kPerLane);
}

// score_block_wide's contract, for an fp32 cache (q: arrange_by_lane of the scaled fp32
// queries) or a bf16 cache with AVX512-BF16 (q: arrange_by_lane of the raw bf16 queries; the
// scale is applied to the scores). Each key's row is read 16 bytes at a time, broadcast to
// the four 128-bit lanes and multiplied into one accumulator per key whose lane h holds head
// h's partial sums: a tile of 4 keys ends in one 4 x 4 transpose within the lanes (9 ops),
// where score_block_wide's 16 accumulators (one per head and key) need a 16-way one (45).
// The FMAs are as many. On a 2-core Zen 4 EPYC the ~100M Llama's decode call (64 sequences,
// heads 16/4 x 64) went, warm, from 725-763 to 677-690 us in fp32 at ~190 tokens and from
// 389-405 to 372-376 us in bf16; in the engine's fp32 generate (cache cold) from 892 to 845 us
// a call; bf16 generates were level within the machine's noise (memory-bound there).
template <int D, typename cache_t>
void score_block_quads(const void* q_arranged, float scale, const cache_t* k, int64_t token_stride, int n,
                       int heads, float* scores, int64_t scores_stride, const cache_t* next_k,
                       const cache_t* next_v, int next_n) {
  constexpr bool kBf16 = std::is_same_v<cache_t, uint16_t>;
  constexpr int kPerLane = 16 / sizeof(cache_t);  // channels of one 128-bit lane
  constexpr int kVectors = D / kPerLane;
  static_assert(D % kPerLane == 0);
#if defined(__AVX512BF16__)
  using query_vector = std::conditional_t<kBf16, __m512bh, __m512>;
#else
  using query_vector = __m512;  // a bf16 cache never gets here (attend_two_pass's `quads`)
#endif
  query_vector qv[kVectors];  // all of the tile's queries stay in registers
  for (int v = 0; v < kVectors; ++v) {
    if constexpr (kBf16) {
      qv[v] = (query_vector)_mm512_loadu_si512(static_cast<const uint16_t*>(q_arranged) + v * 32);
    } else {
      qv[v] = (query_vector)_mm512_loadu_ps(static_cast<const float*>(q_arranged) + v * 16);
    }
  }
  const __m512 score_scale = _mm512_set1_ps(kBf16 ? scale : 1.0f);
  for (int t = 0; t < n; t += 4) {
    const int prefetched = std::min(4, next_n - t);  // as score_block_wide does
    if (prefetched > 0) {
      prefetch_rows(next_k + t * token_stride, next_v + t * token_stride, token_stride, prefetched, D);
    }
    __m512 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_ps();
    for (int v = 0; v < kVectors; ++v) {
      for (int j = 0; j < 4; ++j) {
        const cache_t* row = k + (t + j) * token_stride + v * kPerLane;
        if constexpr (kBf16) {
#if defined(__AVX512BF16__)
          const __m512bh keys = (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
          acc[j] = _mm512_dpbf16_ps(acc[j], qv[v], keys);
#endif
        } else {
          acc[j] = _mm512_fmadd_ps(qv[v], _mm512_broadcast_f32x4(_mm_loadu_ps(row)), acc[j]);
        }
      }
    }
    // Lane h of acc[j]: head h's partial sums for key t + j; lane 4h + j of the result: their sum.
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
    alignas(64) float sums[16];
    _mm512_store_ps(sums, _mm512_mul_ps(_mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44),
                                                      _mm512_shuffle_ps(s01, s23, 0xEE)), score_scale));
    for (int h = 0; h < heads; ++h) std::copy_n(sums + 4 * h, 4, scores + h * scores_stride + t);
  }
}

// out_h[0:16W] += sum_t p_h[t] * v_t[0:16W] for HC query heads (p_h = probs + h * probs_stride,
// out_h = out + h * D).
template <int W, int HC, typename cache_t>
void accumulate_chunk_wide(const float* probs, int64_t probs_stride, const cache_t* v, int64_t token_stride, int n,
                           int D, float* out) {
  __m512 acc[HC][W];
  for (int h = 0; h < HC; ++h)
    for (int i = 0; i < W; ++i) acc[h][i] = _mm512_loadu_ps(out + h * D + 16 * i);
  for (int t = 0; t < n; ++t) {
    __m512 values[W];
    for (int i = 0; i < W; ++i) values[i] = vload(v + t * token_stride + 16 * i);
    for (int h = 0; h < HC; ++h) {
      const __m512 w = _mm512_set1_ps(probs[h * probs_stride + t]);
      for (int i = 0; i < W; ++i) acc[h][i] = _mm512_fmadd_ps(w, values[i], acc[h][i]);
    }
  }
  for (int h = 0; h < HC; ++h)
    for (int i = 0; i < W; ++i) _mm512_storeu_ps(out + h * D + 16 * i, acc[h][i]);
}

template <int HC, typename cache_t>
void accumulate_heads_wide(const float* probs, int64_t probs_stride, const cache_t* v, int64_t token_stride, int n,
                           int D, float* out) {
  int c = 0;
  for (; c + 64 <= D; c += 64) accumulate_chunk_wide<4, HC>(probs, probs_stride, v + c, token_stride, n, D, out + c);
  switch ((D - c) / 16) {
    case 3: return accumulate_chunk_wide<3, HC>(probs, probs_stride, v + c, token_stride, n, D, out + c);
    case 2: return accumulate_chunk_wide<2, HC>(probs, probs_stride, v + c, token_stride, n, D, out + c);
    case 1: return accumulate_chunk_wide<1, HC>(probs, probs_stride, v + c, token_stride, n, D, out + c);
    default: return;
  }
}

// accumulate_values for `count` heads (any number), 4 at a time; D % 16 == 0.
template <typename cache_t>
void accumulate_values_wide(const float* probs, int64_t probs_stride, int count, const cache_t* v,
                            int64_t token_stride, int n, int D, float* out) {
  int h = 0;
  for (; h + 4 <= count; h += 4)
    accumulate_heads_wide<4>(probs + h * probs_stride, probs_stride, v, token_stride, n, D, out + h * D);
  const float* p = probs + h * probs_stride;
  float* o = out + h * D;
  switch (count - h) {
    case 3: return accumulate_heads_wide<3>(p, probs_stride, v, token_stride, n, D, o);
    case 2: return accumulate_heads_wide<2>(p, probs_stride, v, token_stride, n, D, o);
    case 1: return accumulate_heads_wide<1>(p, probs_stride, v, token_stride, n, D, o);
    default: return;
  }
}
#endif

#if RAYLM_AVX512
// ---- AVX-512: two passes per sequence ------------------------------------------------------
// The wide path takes a sequence in two passes rather than block by block with an online
// softmax: every score first (the 4 x 4 tiles above), one softmax over them (16 lanes wide),
// then the weighted sum of values. The online softmax's work per block goes (a maximum and a
// sum across lanes per head, and rescaling the accumulators whenever the maximum grows), and
// the second pass, whose reads hit the caches, is when the next sequence is fetched. On a
// 2-core Zen 4 EPYC (~100M Llama, batch 64, ~190 tokens, bf16) a call with the cache warm went
// from 0.44-0.47 to 0.41-0.42 ms; the engine's generate (64 x 128/128, cold, alternating runs)
// from 8.91 to 8.71 s in bf16 and 17.9 to 17.4 s in fp32.
// (Products of the values with probabilities rounded to bf16, vdpbf16ps on pairs of value
// rows, took the warm call to 0.36 ms but lose fp32's accuracy, which Hugging Face's bf16
// attention also rounds away; split into two bf16 parts to keep it, they were no faster than
// widening the values.)

// scores[0:n] = exp(scores[t] - max) in place; returns their sum and stores max in *max_out.
// scores has room for n rounded up to 16 (zeros are written past n).
inline float softmax_in_place(float* scores, int64_t n, float* max_out) {
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const auto lanes = [n](int64_t t) -> __mmask16 {
    return t + 16 <= n ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
  };
  __m512 lane_max = minus_infinity;
  for (int64_t t = 0; t < n; t += 16) {
    lane_max = _mm512_max_ps(lane_max, _mm512_mask_loadu_ps(minus_infinity, lanes(t), scores + t));
  }
  *max_out = _mm512_reduce_max_ps(lane_max);
  const __m512 shift = _mm512_set1_ps(*max_out);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 lane_sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __m512 x = _mm512_mask_loadu_ps(minus_infinity, lanes(t), scores + t);
    const __m512 e = vexp2_nonpositive(_mm512_mul_ps(_mm512_sub_ps(x, shift), log2e));  // exp(-inf) = 0
    lane_sum = _mm512_add_ps(lane_sum, e);
    _mm512_storeu_ps(scores + t, e);
  }
  return _mm512_reduce_add_ps(lane_sum);
}
#endif

// The block's part of the online softmax for one query head: raises *running_max to the
// block's maximum score, turns scores[0:n] into exp(score - new max) in place and returns
// their sum. `scores` has room for n rounded up to 8.
inline float exponentiate_block(float* scores, int n, float* running_max) {
#if RAYLM_AVX2
  __m256 lane_max = _mm256_set1_ps(*running_max);
  for (int t = 0; t < n; t += 8) {
    __m256 x = _mm256_loadu_ps(scores + t);
    if (t + 8 > n) x = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), x, lanes_below(n - t));
    lane_max = _mm256_max_ps(lane_max, x);
  }
  const float block_max = max8(lane_max);
  const __m256 shift = _mm256_set1_ps(block_max);
  __m256 lane_sum = _mm256_setzero_ps();
  for (int t = 0; t < n; t += 8) {
    __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
    if (t + 8 > n) e = _mm256_and_ps(e, lanes_below(n - t));
    _mm256_storeu_ps(scores + t, e);
    lane_sum = _mm256_add_ps(lane_sum, e);
  }
  *running_max = block_max;
  return sum8(lane_sum);
#else
  float block_max = *running_max;
#pragma omp simd reduction(max : block_max)
  for (int t = 0; t < n; ++t) block_max = std::max(block_max, scores[t]);
  float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
  for (int t = 0; t < n; ++t) {
    scores[t] = exp_nonpositive(scores[t] - block_max);
    block_sum += scores[t];
  }
  *running_max = block_max;
  return block_sum;
#endif
}

#if RAYLM_AVX512
// Asks for the rows of a task's next sequence (its KV heads, K and V) front to back, a share
// at a time: fetch_until(done, total) brings in the first done/total of its tokens.
template <typename cache_t>
struct SequencePrefetch {
  const cache_t* k_cache = nullptr;
  const cache_t* v_cache = nullptr;
  const int32_t* table = nullptr;  // null: no next sequence
  int64_t seq_len = 0, block_size = 0, block_stride = 0, token_stride = 0, head_offset = 0, heads = 0;
  int D = 0;
  int64_t first = 0;    // the first position read (the window's start)
  int64_t fetched = 0;  // positions asked for so far: first .. fetched - 1

  void fetch_until(int64_t done, int64_t total) {
    if (table == nullptr || total <= 0) return;
    const int64_t span = seq_len - first;
    const int64_t target = first + std::min(span, (span * done + total - 1) / total);
    while (fetched < target) {
      const int64_t block = fetched / block_size, in_block = fetched % block_size;
      const int n = static_cast<int>(std::min(block_size - in_block, target - fetched));
      const int64_t offset = table[block] * block_stride + head_offset + in_block * token_stride;
      for (int64_t h = 0; h < heads; ++h) {
        prefetch_rows(k_cache + offset + h * D, v_cache + offset + h * D, token_stride, n, D);
      }
      fetched += n;
    }
  }
};

// One task's sequence in two passes (see above) for its heads_per_task KV heads from
// first_kv_head: scores of every block, a softmax per query head, then the values. Leaves
// each query head's unnormalised output in acc (natural channel order), its softmax sum in
// running_sum and the maximum score that sum is relative to in running_max. q, q_bf16: the task's queries (fp32 scaled, raw bf16), D apart. Keys from
// position `first` on (the window's start) count; the blocks before its block are not read,
// and the tiles of 4 keys start at first rounded down to 4 (the few keys before first in that
// tile are masked). soft_cap > 0 caps the scores (Gemma 2).
template <int D, typename cache_t>
void attend_two_pass(const float* q, const uint16_t* q_bf16, float scale, const cache_t* k_cache,
                     const cache_t* v_cache, const int32_t* table, int64_t first, int64_t seq_len,
                     int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t first_kv_head,
                     int64_t heads_per_task, int group, float soft_cap, float* scores, int64_t seq_stride,
                     float* acc, float* running_sum, float* running_max, SequencePrefetch<cache_t>& next,
                     void* q_by_lane) {
  const int task_heads = static_cast<int>(heads_per_task * group);
  // score_block_quads takes fp32 caches, and bf16 ones with bf16 queries and AVX512-BF16;
  // q_by_lane holds its queries (arrange_by_lane), 4 * D for each tile of up to 4 heads of a
  // KV head's group: tile (h, g) at by_lane_tile(h, g).
  // An fp8 cache takes score_block_wide: a key's 16 bytes are 16 channels, not a lane's 4.
#if defined(__AVX512BF16__)
  const bool quads = std::is_same_v<cache_t, float> || (std::is_same_v<cache_t, uint16_t> && q_bf16 != nullptr);
#else
  const bool quads = std::is_same_v<cache_t, float>;
#endif
  const int tiles_per_kv_head = (group + 3) / 4;
  const auto by_lane_tile = [&](int64_t h, int g) {
    return (h * tiles_per_kv_head + (g - h * group) / 4) * 4 * D;
  };
  if (quads) {
    for (int64_t h = 0; h < heads_per_task; ++h) {
      for (int g = static_cast<int>(h * group); g < (h + 1) * group; g += 4) {
        const int heads = static_cast<int>(std::min<int64_t>(4, (h + 1) * group - g));
        if constexpr (std::is_same_v<cache_t, float>) {
          arrange_by_lane(q + g * D, D, heads, static_cast<float*>(q_by_lane) + by_lane_tile(h, g));
        } else {
          arrange_by_lane(q_bf16 + g * D, D, heads, static_cast<uint16_t*>(q_by_lane) + by_lane_tile(h, g));
        }
      }
    }
  }
  // Pass 1: scores, block by block, all KV heads of a block before the next block. The scores
  // of position p are at p - base: blocks hold whole tiles of 4 keys from base on.
  const int64_t base = first / 4 * 4;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  const int64_t head_offset = first_kv_head * D;
  for (int64_t block = base / block_size; block < num_blocks; ++block) {
    const BlockRows rows = block_rows(table, block, base, seq_len, block_size, block_stride, token_stride, head_offset);
    const BlockRows own_next =
        block_rows(table, block + 1, base, seq_len, block_size, block_stride, token_stride, head_offset);
    const int64_t score_index = block * block_size + rows.skipped - base;
    for (int64_t h = 0; h < heads_per_task; ++h) {
      for (int g = static_cast<int>(h * group); g < (h + 1) * group; g += 4) {
        // The next block's keys and values are asked for as the first tile scores: the values
        // are read again by pass 2, from the caches, a sequence's worth later.
        const int heads = static_cast<int>(std::min<int64_t>(4, (h + 1) * group - g));
        const cache_t* next_k = k_cache + own_next.offset + h * D;
        const cache_t* next_v = v_cache + own_next.offset + h * D;
        const int next_n = g == h * group ? own_next.n : 0;
        float* tile_scores = scores + g * seq_stride + score_index;
        if constexpr (kIsFp8<cache_t>) {
          score_block_wide<D>(q + g * D, nullptr, scale, k_cache + rows.offset + h * D, token_stride, rows.n, heads,
                              tile_scores, seq_stride, next_k, next_v, next_n);
        } else if (quads) {
          const void* tile_q = std::is_same_v<cache_t, float>
                                   ? static_cast<const void*>(static_cast<const float*>(q_by_lane) + by_lane_tile(h, g))
                                   : static_cast<const void*>(static_cast<const uint16_t*>(q_by_lane) + by_lane_tile(h, g));
          score_block_quads<D>(tile_q, scale, k_cache + rows.offset + h * D, token_stride, rows.n, heads,
                               tile_scores, seq_stride, next_k, next_v, next_n);
        } else {
          score_block_wide<D>(q + g * D, q_bf16 == nullptr ? nullptr : q_bf16 + g * D, scale,
                              k_cache + rows.offset + h * D, token_stride, rows.n, heads, tile_scores,
                              seq_stride, next_k, next_v, next_n);
        }
      }
    }
  }
  for (int g = 0; g < task_heads; ++g) {
    float* head_scores = scores + g * seq_stride;
    if (soft_cap > 0.0f) soft_cap_in_place(head_scores, seq_len - base, soft_cap);
    std::fill(head_scores, head_scores + (first - base), -std::numeric_limits<float>::infinity());
    running_sum[g] = softmax_in_place(head_scores, seq_len - base, &running_max[g]);
  }
  // Pass 2: the values. Its reads hit the caches, so it is when the thread's next sequence
  // (`next`) is fetched, a share after each block of each KV head. Asked for a whole block at
  // a time (256 lines of K and V for the ~100M Llama), the requests filled the miss queue in
  // bursts: spread this finely the call (batch 64, ~190 tokens, heads 16/4 x 64, bf16, cache
  // cold, alternating in one process on a 2-core Zen 4 EPYC) went from 546-636 to 473-568 us,
  // and 64 x ~750 tokens from 2.83 to 2.43 ms; fp32 was level (within 3% either way).
  const int64_t total_units = (seq_len - base) * heads_per_task;
  int64_t units = 0;
  for (int64_t block = base / block_size; block < num_blocks; ++block) {
    const BlockRows rows = block_rows(table, block, base, seq_len, block_size, block_stride, token_stride, head_offset);
    const int64_t score_index = block * block_size + rows.skipped - base;
    for (int64_t h = 0; h < heads_per_task; ++h) {
      accumulate_values_wide(scores + h * group * seq_stride + score_index, seq_stride, group,
                             v_cache + rows.offset + h * D, token_stride, rows.n, D, acc + h * group * D);
      units += rows.n;
      next.fetch_until(units, total_units);
    }
  }
}
#endif

// kHeadSize > 0 fixes the head size at compile time, so the helpers inlined here unroll
// their channel loops; 0 reads it from head_size.
// query and out are fp32, or bf16 when io_bf16; query rows are query_stride apart, out's
// contiguous.
// window > 0: each query attends to its last `window` positions; soft_cap > 0: scores s become
// soft_cap * tanh(s / soft_cap) (0 turns either off). sinks (null: none): one logit per query
// head [num_heads] that joins each softmax's denominator with no value (gpt-oss).
template <typename cache_t, int kHeadSize>
void decode(const void* query, int64_t query_stride, const cache_t* k_cache, const cache_t* v_cache,
            const int32_t* block_tables, const int32_t* seq_lens, void* out, bool io_bf16, int64_t num_seqs,
            int64_t num_heads, int64_t num_kv_heads, int head_size, int64_t block_size, int64_t max_blocks, float scale,
            int64_t window, float soft_cap, float k_scale, float v_scale, const float* sinks) {
  const int D = kHeadSize > 0 ? kHeadSize : head_size;
  // An fp8 cache's k_scale scales the scores: folded into the query's scale, one multiply a
  // query element rather than one a key element; v_scale, the outputs (see the op below).
  scale *= k_scale;
  const int group = static_cast<int>(num_heads / num_kv_heads);
  const int64_t token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  // Whole groups of 8 keys never cross a block's end.
  const bool padded = block_size % 8 == 0;
  const int64_t scores_stride = (block_size + 7) / 8 * 8;
  // The AVX-512 path: head sizes that are multiples of 16 (fixed at compile time), and blocks
  // whose rows come in whole groups of 4 keys. It keeps channels in their natural order.
#if RAYLM_AVX512
  constexpr bool kWideHeadSize = kHeadSize > 0 && kHeadSize % 16 == 0;
#else
  constexpr bool kWideHeadSize = false;
#endif
  const bool wide = kWideHeadSize && block_size % 4 == 0;
  const bool raw_bf16_query = wide && io_bf16 && std::is_same_v<cache_t, uint16_t>;
  // The wide path's room for the scores of any sequence of the batch, 16 at a time.
  const int64_t seq_stride = wide ? (max_blocks * block_size + 15) / 16 * 16 : 0;
  const auto channel = [&](int d) { return wide ? d : kernel_channel<cache_t>(d, D); };
  // A task is one sequence with all its KV heads, so each block is read front to back (the
  // hardware prefetcher follows); with few sequences, one KV head, to use every thread.
  const int64_t heads_per_task = num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
  const int task_heads = static_cast<int>(heads_per_task * group);  // query heads of one task
  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(task_heads * D), acc(task_heads * D), scores(wide ? 0 : task_heads * scores_stride);
    std::vector<uint16_t> q_bf16(raw_bf16_query ? task_heads * D : 0);
    std::vector<float> running_max(task_heads), running_sum(task_heads);
    // Not zeroed: every score is written before it is read (the softmax and values read n).
    const std::unique_ptr<float[]> seq_scores(new float[task_heads * seq_stride]);
    // The wide path's queries by lane (fp32 or bf16: room for fp32), 4 * D a tile of heads.
    std::vector<float> q_by_lane(wide ? heads_per_task * ((group + 3) / 4) * 4 * D : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq;
      const int64_t first_kv_head = task % tasks_per_seq * heads_per_task;
      const int64_t seq_len = seq_lens[seq];
      const int64_t first = window_start(seq_len, window);
      const int64_t first_element = (seq * num_heads + first_kv_head * group) * D;  // of out
      const int64_t first_query = seq * query_stride + first_kv_head * group * D;
      if (seq_len <= 0) {
        if (io_bf16) {
          std::fill_n(static_cast<uint16_t*>(out) + first_element, task_heads * D, uint16_t{0});
        } else {
          std::fill_n(static_cast<float*>(out) + first_element, task_heads * D, 0.0f);
        }
        continue;
      }
      for (int g = 0; g < task_heads; ++g) {
        for (int d = 0; d < D; ++d) {
          const int64_t i = first_query + g * D + channel(d);
          q[g * D + d] = (io_bf16 ? to_float(static_cast<const uint16_t*>(query)[i])
                                  : static_cast<const float*>(query)[i]) * scale;
          if (raw_bf16_query) q_bf16[g * D + d] = static_cast<const uint16_t*>(query)[i];
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.0f);
      const int32_t* table = block_tables + seq * max_blocks;
#if RAYLM_AVX512
      if constexpr (kWideHeadSize) {
        if (wide) {
          // The next task of this thread, when it is another sequence's (same KV heads).
          SequencePrefetch<cache_t> next;
          if (task + 1 < end && tasks_per_seq == 1) {
            const int64_t next_len = std::max<int64_t>(seq_lens[seq + 1], 0);
            next = {k_cache, v_cache, block_tables + (seq + 1) * max_blocks, next_len, block_size, block_stride,
                    token_stride, first_kv_head * D, heads_per_task, D};
            next.first = next.fetched = window_start(next_len, window);
          }
          attend_two_pass<kWideHeadSize ? kHeadSize : 16>(
              q.data(), raw_bf16_query ? q_bf16.data() : nullptr, scale, k_cache, v_cache, table, first, seq_len,
              block_size, block_stride, token_stride, first_kv_head, heads_per_task, group, soft_cap,
              seq_scores.get(), seq_stride, acc.data(), running_sum.data(), running_max.data(), next,
              q_by_lane.data());
        }
      }
#endif
      // Elsewhere block by block from the window's first block, with an online softmax.
      for (int64_t block = first / block_size; !wide && block * block_size < seq_len; ++block) {
        const BlockRows rows =
            block_rows(table, block, first, seq_len, block_size, block_stride, token_stride, first_kv_head * D);
        const BlockRows next =
            block_rows(table, block + 1, first, seq_len, block_size, block_stride, token_stride, first_kv_head * D);
        const int n = rows.n;
        // Whole groups of 8 rows from the block's first row read stay inside the block.
        const bool block_padded = padded && rows.skipped % 8 == 0;
        for (int64_t h = 0; h < heads_per_task; ++h) {
          // The next block lies anywhere in the cache, beyond the hardware prefetcher's guess
          // (prefetching two or three blocks ahead measured no better): its rows are asked for
          // one KV head's at a time.
          prefetch_rows(k_cache + next.offset + h * D, v_cache + next.offset + h * D, token_stride, next.n, D);
          const cache_t* k_block = k_cache + rows.offset + h * D;
          const cache_t* v_block = v_cache + rows.offset + h * D;
          const int64_t head0 = h * group;  // this KV head's first query head within the task
          int64_t scored = head0;  // heads whose scores are computed
#if RAYLM_AVX2
          if (block_padded && D % 8 == 0) {
            for (; scored + 2 <= head0 + group; scored += 2) {
              score_block_pair(q.data() + scored * D, q.data() + (scored + 1) * D, k_block, token_stride, n, D,
                               scores.data() + scored * scores_stride, scores.data() + (scored + 1) * scores_stride);
            }
          }
#endif
          for (int64_t g = head0; g < head0 + group; ++g) {
            float* sg = scores.data() + g * scores_stride;
            if (g >= scored) score_block(q.data() + g * D, k_block, token_stride, n, D, block_padded, sg);
            if (soft_cap > 0.0f) soft_cap_in_place(sg, n, soft_cap);
            // Online softmax: rescale what was accumulated so far to this block's new maximum.
            const float previous_max = running_max[g];
            const float block_sum = exponentiate_block(sg, n, &running_max[g]);
            if (running_max[g] != previous_max) {
              const float alpha = std::exp(previous_max - running_max[g]);
              float* ag = acc.data() + g * D;
#pragma omp simd
              for (int d = 0; d < D; ++d) ag[d] *= alpha;
              running_sum[g] *= alpha;
            }
            running_sum[g] += block_sum;
          }
          for (int64_t g = head0; g < head0 + group; g += 2) {
            accumulate_values(scores.data() + g * scores_stride, scores_stride,
                              static_cast<int>(std::min<int64_t>(2, head0 + group - g)), v_block, token_stride, n, D,
                              acc.data() + g * D);
          }
        }
      }
      for (int g = 0; g < task_heads; ++g) {
        // A sink is one more term of the denominator, relative to the same maximum (exp of a
        // sink far above every score is inf: the output is then 0, its limit). The scores are
        // already in k_scale's units (folded into scale), so the sink compares with them as is.
        const float sink_term = sinks == nullptr ? 0.0f : std::exp(sinks[first_kv_head * group + g] - running_max[g]);
        const float inv = v_scale / (running_sum[g] + sink_term);
        const int64_t first = first_element + g * D;
        for (int d = 0; d < D; ++d) {
          const float value = acc[g * D + d] * inv;
          if (io_bf16) {
            static_cast<uint16_t*>(out)[first + channel(d)] = to_bf16(value);
          } else {
            static_cast<float*>(out)[first + channel(d)] = value;
          }
        }
      }
    }
  });
}

template <typename cache_t>
void dispatch_head_size(const void* query, int64_t query_stride, const cache_t* k, const cache_t* v,
                        const int32_t* tables, const int32_t* lens, void* out, bool io_bf16, int64_t B, int64_t Hq,
                        int64_t Hkv, int D, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                        float soft_cap, float k_scale, float v_scale, const float* sinks) {
  auto run = [&](auto head_size) {
    decode<cache_t, decltype(head_size)::value>(query, query_stride, k, v, tables, lens, out, io_bf16, B, Hq, Hkv, D,
                                                block_size, max_blocks, scale, window, soft_cap, k_scale, v_scale,
                                                sinks);
  };
  switch (D) {
    case 32: return run(std::integral_constant<int, 32>{});
    case 64: return run(std::integral_constant<int, 64>{});
    case 128: return run(std::integral_constant<int, 128>{});
    default: return run(std::integral_constant<int, 0>{});
  }
}

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

bool is_fp8(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

// query [B, Hq, D] fp32 or bf16; k_cache, v_cache [num_blocks, block_size, Hkv, D] fp32, bf16
// or fp8 (e4m3fn, e5m2); block_tables [B, max_blocks] and seq_lens [B] int32; returns [B, Hq, D]
// in the query's dtype. An fp8 cache is read as fp8 * k_scale and fp8 * v_scale
// (kv_cache_dtype.dequantize): k_scale multiplies the scores, v_scale the outputs, so that the
// loads stay a conversion (exact) and the scales cost a multiply a query and an output row;
// the results differ from scaling every element by fp32 rounding only. Other caches ignore
// the scales, as dequantize does. sliding_window > 0: each query attends to its last
// sliding_window positions, and the blocks before that are not read; logits_soft_cap > 0:
// scores s become logits_soft_cap * tanh(s / logits_soft_cap) (0 turns either off); sinks [Hq]
// fp32 (or None): each query head's attention sink, an extra logit in its softmax's
// denominator. A sequence whose table does not hold the tokens it reads in valid blocks is a
// ValueError, and nothing is computed.
at::Tensor paged_decode_attention(const at::Tensor& query_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window, double logits_soft_cap, double k_scale, double v_scale,
                                  const c10::optional<at::Tensor>& sinks_in) {
  // Rows may be strided (q, a column slice of the qkv projection): no copy.
  const bool rows_packed = query_in.dim() == 3 && query_in.stride(2) == 1 && query_in.stride(1) == query_in.size(2);
  const at::Tensor query = rows_packed ? query_in : query_in.contiguous();
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "raylm::paged_decode_attention takes CPU tensors");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "raylm::paged_decode_attention takes query [B, Hq, D] and contiguous caches [num_blocks, block_size, "
              "Hkv, D] of one dtype");
  TORCH_CHECK(is_float_or_bf16(query) && (is_float_or_bf16(k_cache) || is_fp8(k_cache)),
              "raylm::paged_decode_attention takes fp32 or bf16 queries and fp32, bf16 or fp8 caches");
  TORCH_CHECK_VALUE(std::isfinite(k_scale) && k_scale > 0.0 && std::isfinite(v_scale) && v_scale > 0.0,
                    "raylm::paged_decode_attention: k_scale (", k_scale, ") and v_scale (", v_scale,
                    ") must be positive and finite");
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0,
              "raylm::paged_decode_attention: the caches' head size must be the query's, Hq a multiple of Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == B && seq_lens.numel() == B,
              "raylm::paged_decode_attention takes contiguous int32 block_tables [B, max_blocks] and seq_lens [B]");
  TORCH_CHECK_VALUE(sliding_window >= 0 && logits_soft_cap >= 0.0, "raylm::paged_decode_attention: sliding_window (",
                    sliding_window, ") and logits_soft_cap (", logits_soft_cap, ") must be >= 0 (0: off)");
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(sinks.device().is_cpu() && sinks.dim() == 1 && sinks.size(0) == Hq,
                      "raylm::paged_decode_attention: sinks must be one value per query head [", Hq, "], got ",
                      sinks.sizes());
  }
  const float* sinks_data = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = static_cast<const int32_t*>(block_tables.data_ptr());
  const int32_t* lens = static_cast<const int32_t*>(seq_lens.data_ptr());
  // The kernel trusts the tables; check the entries it reads once here rather than read out of bounds.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (static_cast<int64_t>(lens[b]) + block_size - 1) / block_size;
    bool fits = lens[b] >= 0 && used <= max_blocks;
    for (int64_t i = window_start(lens[b], sliding_window) / block_size; fits && i < used; ++i)
      fits = tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks;
    TORCH_CHECK_VALUE(fits, "seq_lens[", b, "] = ", lens[b], " does not fit its block table (", max_blocks,
                      " entries of ", block_size, " tokens, blocks below ", num_blocks, ").");
  }
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  const bool io_bf16 = query.scalar_type() == at::kBFloat16;
  const int head_size = static_cast<int>(D);
  const bool fp8 = is_fp8(k_cache);
  const auto run = [&](auto element) {
    using cache_t = decltype(element);
    dispatch_head_size<cache_t>(query.data_ptr(), query.stride(0), static_cast<const cache_t*>(k_cache.data_ptr()),
                                static_cast<const cache_t*>(v_cache.data_ptr()), tables, lens, out.data_ptr(), io_bf16,
                                B, Hq, Hkv, head_size, block_size, max_blocks, static_cast<float>(scale),
                                sliding_window, static_cast<float>(logits_soft_cap),
                                fp8 ? static_cast<float>(k_scale) : 1.0f, fp8 ? static_cast<float>(v_scale) : 1.0f,
                                sinks_data);
  };
  switch (k_cache.scalar_type()) {
    case at::kBFloat16: run(uint16_t{}); break;
    case at::kFloat8_e4m3fn: run(fp8_e4m3{}); break;
    case at::kFloat8_e5m2: run(fp8_e5m2{}); break;
    default: run(float{}); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int sliding_window=0, float logits_soft_cap=0.0, float k_scale=1.0, "
        "float v_scale=1.0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
