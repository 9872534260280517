// The AVX-512 GEMM's panel machinery, shared by the libraries that multiply by weights packed
// with avx512_pack_weight / avx512_pack_gated_weight (csrc/cpu_gemm_avx512.cpp, which defines
// the layout and the packing, and csrc/cpu_fused_moe.cpp): the micro-kernels, the stores of
// a panel's accumulators, and `multiply_panel`, one panel of weight against M rows of x with
// the next block prefetched. See cpu_gemm_avx512.cpp for the layout and the measurements.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_vec.h"

#if RAYLM_AVX512
#define RAYLM_AVX512_FP32 1
#else
#define RAYLM_AVX512_FP32 0
#endif
#if RAYLM_AVX512 && defined(__AVX512BF16__)
#define RAYLM_AVX512_BF16 1
#else
#define RAYLM_AVX512_BF16 0
#endif

namespace raylm {
namespace panels {

constexpr int64_t kPanelN = 64;      // output columns of one panel: four zmm of fp32
constexpr int kRows = 6;             // rows of x per micro-kernel call: 6 x 4 accumulators
constexpr int64_t kStepBytes = 256;  // one step of a panel, fp32 or bf16
// Steps of one block: 128 KiB of weight, which stays in L2 while every row goes through it.
constexpr int64_t kBlockSteps = 512;
// How far ahead the first group of a thread's first block asks for its steps: ~100 ns of
// memory latency at ~7 ns a step (6 rows x 4 FMAs). Left to the hardware prefetcher, that
// block cost the ~100M Llama's 64-row decode GEMMs (single calls, weights cold, 2-core Zen 4
// EPYC) 40-70 us a call over the warm time; with it 20-50 us. In that model's generate the
// gain was within the machine's noise (bf16 medians of 6: 7.99 -> 7.95 s).
constexpr int64_t kLeadSteps = 32;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Steps of a packed panel: k for fp32, k pairs for bf16.
inline int64_t steps_of(int64_t K, bool bf16) { return bf16 ? (K + 1) / 2 : K; }

#if RAYLM_AVX512_FP32
// Prefetch of the next block into L2, shared among the row groups that multiply the current
// block: a group prefetches lines [first_line, end_line) of each step (a step is four lines)
// as it does its own step, so the next block arrives at a pace the memory keeps up with.
struct Prefetch {
  const char* next_block = nullptr;  // null: nothing to fetch
  int first_line = 0;
  int end_line = 0;
};

inline void prefetch_step(const Prefetch& prefetch, int64_t step) {
  const char* line = prefetch.next_block + step * kStepBytes;
  for (int i = prefetch.first_line; i < prefetch.end_line; ++i) _mm_prefetch(line + 64 * i, _MM_HINT_T1);
}

inline int32_t load_pair(const uint16_t* p) {  // two bf16, as one 32-bit lane (p may be unaligned)
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

// c[r][0:64] (+)= sum over the block's steps of x[r] times the panel block, for R rows.
// x points at this block's first k of row 0 (rows x_stride elements apart); c's rows are 64
// floats apart; prefetch says which part of the next block to bring into L2.
template <int R, typename T>
void micro_kernel(const T* x, int64_t x_stride, const T* w, int64_t steps, float* c, bool accumulate,
                  const Prefetch& prefetch) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = accumulate ? _mm512_loadu_ps(c + r * kPanelN + 16 * j) : _mm512_setzero_ps();
  }
  constexpr int64_t kStepElements = kStepBytes / sizeof(T);
  for (int64_t s = 0; s < steps; ++s) {
    if (prefetch.next_block != nullptr) prefetch_step(prefetch, s);
    const T* ws = w + s * kStepElements;
    if constexpr (std::is_same_v<T, float>) {
      const __m512 b0 = _mm512_loadu_ps(ws), b1 = _mm512_loadu_ps(ws + 16), b2 = _mm512_loadu_ps(ws + 32),
                   b3 = _mm512_loadu_ps(ws + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * x_stride + s]);
        acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
      }
    } else {
#if RAYLM_AVX512_BF16
      const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(ws));
      const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(ws + 32));
      const __m512bh b2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(ws + 64));
      const __m512bh b3 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(ws + 96));
      for (int r = 0; r < R; ++r) {
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(load_pair(x + r * x_stride + 2 * s)));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
      }
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(c + r * kPanelN + 16 * j, acc[r][j]);
  }
}

template <typename T>
void micro_kernel_rows(int rows, const T* x, int64_t x_stride, const T* w, int64_t steps, float* c, bool accumulate,
                       const Prefetch& prefetch) {
  switch (rows) {
    case 6: micro_kernel<6>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    case 5: micro_kernel<5>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    case 4: micro_kernel<4>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    case 3: micro_kernel<3>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    case 2: micro_kernel<2>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    default: micro_kernel<1>(x, x_stride, w, steps, c, accumulate, prefetch); break;
  }
}

// out[r][0:cols] = c[r][0:64] + bias, in out's dtype (bf16 rounded to nearest even).
inline void store_row(const float* c, const float* bias, int64_t cols, float* out) {
  for (int j = 0; j < 4; ++j) {
    const int64_t left = std::clamp<int64_t>(cols - 16 * j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
    _mm512_mask_storeu_ps(out + 16 * j, mask, _mm512_add_ps(_mm512_loadu_ps(c + 16 * j), _mm512_loadu_ps(bias + 16 * j)));
  }
}

inline void store_row(const float* c, const float* bias, int64_t cols, uint16_t* out) {
#if RAYLM_AVX512_BF16
  for (int j = 0; j < 4; ++j) {
    const int64_t left = std::clamp<int64_t>(cols - 16 * j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
    const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + 16 * j), _mm512_loadu_ps(bias + 16 * j)));
    _mm256_mask_storeu_epi16(out + 16 * j, mask, reinterpret_cast<__m256i>(y));
  }
#endif
}

// The gated epilogue (avx512_linear_silu_mul): a panel's 64 columns are 32 gate columns then
// the 32 up columns of the same outputs, and out[0:cols] = silu(gate) * up. Each half is
// first rounded to out's dtype, as avx512_linear's output would be before silu_and_mul
// (cpu_ops.cpp) reads it, and the same vsilu follows: the pair gives those two ops' result
// bit for bit (but in silu_and_mul's scalar tail, past the last 16 of a row of d % 16 != 0).
inline __m512 as_stored(__m512 v, float) { return v; }

inline __m512 as_stored(__m512 v, uint16_t) {
#if RAYLM_AVX512_BF16
  const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
  return v;
#endif
}

inline void store_masked(float* out, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(out, mask, v); }

inline void store_masked(uint16_t* out, __mmask16 mask, __m512 v) {  // vstore's rounding (vcvtneps2bf16)
#if RAYLM_AVX512_BF16
  _mm256_mask_storeu_epi16(out, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#endif
}

template <typename T>
void store_silu_mul_row(const float* c, int64_t cols, T* out) {
  const __m512 zero = _mm512_setzero_ps();  // avx512_linear's bias without one: -0 + 0 is +0
  for (int j = 0; j < 2; ++j) {
    const int64_t left = std::clamp<int64_t>(cols - 16 * j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
    const __m512 gate = as_stored(_mm512_add_ps(_mm512_loadu_ps(c + 16 * j), zero), T{});
    const __m512 up = as_stored(_mm512_add_ps(_mm512_loadu_ps(c + kPanelN / 2 + 16 * j), zero), T{});
    store_masked(out + 16 * j, mask, vmul(vsilu(gate), up));
  }
}

// The part of the next block that row group `group` of `groups` prefetches. The block being
// multiplied came in while the previous one was (except a thread's first, which the first
// group reads from memory), so groups 1-4 bring in the next one, a quarter each (fetching it
// all within one group's pass measured slower: that pace is more than one core's share of
// the memory's bandwidth); a single group fetches it all.
inline Prefetch prefetch_share(const char* next_block, int64_t group, int64_t groups) {
  if (groups == 1) return {next_block, 0, 4};
  const int64_t sharing = std::min<int64_t>(4, groups - 1);
  if (group < 1 || group > sharing) return {};
  return {next_block, static_cast<int>((group - 1) * 4 / sharing), static_cast<int>(group * 4 / sharing)};
}

// c[0:M][0:64] = the rows of x [M, K] (rows x_stride apart, K contiguous; bf16 rows padded to
// an even K) times one packed panel of `steps` steps, block by block. next_panel is the block
// to prefetch after this panel's last one (null: nothing follows in this thread); first says
// the panel is its thread's first, whose first block no one prefetched.
template <typename T>
void multiply_panel(const T* x, int64_t x_stride, int64_t M, int64_t steps, const T* panel, const T* next_panel,
                    bool first, float* c) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  constexpr int64_t kStepElements = kStepBytes / sizeof(T);
  constexpr int64_t kKPerStep = kBf16 ? 2 : 1;
  const int64_t row_groups = (M + kRows - 1) / kRows;
  for (int64_t s0 = 0; s0 < steps; s0 += kBlockSteps) {
    const int64_t block_steps = std::min(kBlockSteps, steps - s0);
    const T* block = panel + s0 * kStepElements;
    // The next block follows this one within the panel, or is the next panel's first.
    const bool last_block = s0 + kBlockSteps >= steps;
    const char* next = reinterpret_cast<const char*>(last_block ? next_panel : block + block_steps * kStepElements);
    for (int64_t group = 0; group < row_groups; ++group) {
      const int64_t m0 = group * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      // The thread's first block was fetched by no one: the first group reads it from
      // memory, asking for each step kLeadSteps ahead of the one it multiplies.
      const bool cold = first && s0 == 0 && group == 0 && row_groups > 1;
      const Prefetch prefetch = cold ? Prefetch{reinterpret_cast<const char*>(block) + kLeadSteps * kStepBytes, 0, 4}
                                     : prefetch_share(next, group, row_groups);
      micro_kernel_rows<T>(rows, x + m0 * x_stride + s0 * kKPerStep, x_stride, block, block_steps,
                           c + m0 * kPanelN, s0 > 0, prefetch);
    }
  }
}
#endif  // RAYLM_AVX512_FP32

}  // namespace panels
}  // namespace raylm
