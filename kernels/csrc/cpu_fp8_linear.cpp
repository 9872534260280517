// A linear layer over FP8 (float8_e4m3fn) weights for decode-sized batches on the CPU:
// out[t, n] = scale[n] * sum_k x[t, k] * w[n, k], reading each weight byte once per block of
// tokens and widening it in registers, so the weight streams from memory at one byte an
// element and is never written out in 16 or 32 bits (raylm/kernels/fp8_linear.py).
//
// Dot-product form: a block of up to kTokens tokens and kOutputs output rows keeps
// kTokens x kOutputs fp32 accumulators of 16 lanes; each step of 16 features loads the block's
// x rows once and widens kOutputs x 16 weight bytes (e4m3 -> fp16 bits by shifts, then
// VCVTPH2PS, exact for every e4m3 value, subnormals too), then sums each accumulator's lanes
// at the end. Where AVX-512 (F, BW, VL) is missing, a scalar loop over a 256-entry table.
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp (or a narrower ISA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>

#include "cpu_vec.h"

namespace {

constexpr int kTokens = 8;
constexpr int kOutputs = 3;

// The 256 e4m3 values by bit pattern (0x7f and 0xff, the NaNs, are never quantized to).
std::array<float, 256> make_table() {
  std::array<float, 256> table{};
  for (int b = 0; b < 256; ++b) {
    const int exponent = (b >> 3) & 0xf, mantissa = b & 7;
    const float magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)
                                          : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    table[b] = (b & 0x80) ? -magnitude : magnitude;
  }
  return table;
}

const std::array<float, 256> kTable = make_table();

#if RAYLM_AVX512 && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RAYLM_FP8_AVX512 1

// 16 e4m3 bytes -> 16 floats, each 1/256 of its value: the e4m3 bits shifted into an fp16's
// (exponent bias 15 against 7), which VCVTPH2PS widens exactly.
inline __m512 widen_fp8(__m128i bytes) {
  const __m256i v = _mm256_cvtepu8_epi16(bytes);
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7f)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
  return _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));
}

// out[t * ldo + r] = sum over k of x[t * K + k] * w[r * K + k] / 256, for TR tokens, NR rows.
template <int TR, int NR>
void block_dot(const float* x, const uint8_t* w, int64_t K, float* out, int64_t ldo, const float* scales) {
  __m512 acc[TR][NR];
  for (int t = 0; t < TR; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = widen_fp8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * K + k)));
    for (int t = 0; t < TR; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * K + k);
      for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = widen_fp8(_mm_maskz_loadu_epi8(mask, w + r * K + k));
    for (int t = 0; t < TR; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + t * K + k);
      for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
    }
  }
  for (int t = 0; t < TR; ++t)
    for (int r = 0; r < NR; ++r) out[t * ldo + r] = _mm512_reduce_add_ps(acc[t][r]) * 256.0f * scales[r];
}

using BlockFn = void (*)(const float*, const uint8_t*, int64_t, float*, int64_t, const float*);

template <int TR, int... NR>
constexpr std::array<BlockFn, kOutputs> row_of_blocks(std::integer_sequence<int, NR...>) {
  return {&block_dot<TR, NR + 1>...};
}

template <int... TR>
constexpr std::array<std::array<BlockFn, kOutputs>, kTokens> table_of_blocks(std::integer_sequence<int, TR...>) {
  return {row_of_blocks<TR + 1>(std::make_integer_sequence<int, kOutputs>{})...};
}

// kBlocks[tokens - 1][rows - 1]
constexpr auto kBlocks = table_of_blocks(std::make_integer_sequence<int, kTokens>{});
#else
#define RAYLM_FP8_AVX512 0
#endif

// x [T, K] fp32, weight [N, K] uint8 (e4m3 bytes), scale fp32 (1 or N values) -> [T, N] fp32.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "raylm::fp8_linear: x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "raylm::fp8_linear: weight must be a contiguous [N, K] uint8 tensor with x's K");
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && (scale.numel() == 1 || scale.numel() == N),
              "raylm::fp8_linear: scale must hold 1 or N contiguous fp32 values");
  at::Tensor out = at::empty({T, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const uint8_t* ws = weight.data_ptr<uint8_t>();
  const float* ss = scale.data_ptr<float>();
  const bool per_row = scale.numel() == N && N > 1;
  float* os = out.data_ptr<float>();
  const int64_t groups = (N + kOutputs - 1) / kOutputs;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kOutputs;
      const int rows = static_cast<int>(std::min<int64_t>(kOutputs, N - n0));
      float scales[kOutputs];
      for (int r = 0; r < rows; ++r) scales[r] = per_row ? ss[n0 + r] : ss[0];
      for (int64_t t0 = 0; t0 < T; t0 += kTokens) {
        const int tokens = static_cast<int>(std::min<int64_t>(kTokens, T - t0));
#if RAYLM_FP8_AVX512
        kBlocks[tokens - 1][rows - 1](xs + t0 * K, ws + n0 * K, K, os + t0 * N + n0, N, scales);
#else
        for (int t = 0; t < tokens; ++t) {
          for (int r = 0; r < rows; ++r) {
            const float* xr = xs + (t0 + t) * K;
            const uint8_t* wr = ws + (n0 + r) * K;
            float sum = 0.0f;
            for (int64_t k = 0; k < K; ++k) sum += xr[k] * kTable[wr[k]];
            os[(t0 + t) * N + n0 + r] = sum * scales[r];
          }
        }
#endif
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) { m.def("fp8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("fp8_linear", &fp8_linear); }
