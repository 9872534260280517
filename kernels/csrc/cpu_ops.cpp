// The small per-layer ops of a decoder on the CPU, fused: RMSNorm with its residual add,
// SiLU-and-multiply, rotary embedding in place, and the KV-cache write. In PyTorch each is
// several elementwise ops, each a pass over memory plus dispatch overhead, which at decode
// batch sizes costs more than the arithmetic; here each is one pass. fp32 only (the Python
// side keeps PyTorch for other dtypes). Rows are split across threads only when there are
// enough of them to pay for waking the threads.
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

namespace {

using namespace raylm;

// Rows per thread chunk so that a chunk holds at least ~16K elements.
int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements)); }

// out = x / sqrt(mean(x^2) + eps) * weight for one row of n, accumulated in fp32 as in
// Hugging Face's LlamaRMSNorm.
inline void rms_norm_row(float* out, const float* x, const float* weight, int64_t n, float eps) {
  float sum_squares = 0.0f;
  int64_t i = 0;
#if RAYLM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  sum_squares = sum8(acc);
#endif
  for (; i < n; ++i) sum_squares += x[i] * x[i];
  const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] * inv_rms * weight[j];
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

// residual[t] += x[t]; x[t] = rms_norm(residual[t]) * weight, for T rows of H (contiguous).
extern "C" void raylm_fused_add_rms_norm(float* x, float* residual, const float* weight, int64_t T, int64_t H,
                                         float eps) {
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = x + t * H;
      float* rr = residual + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) rr[i] += xr[i];
      rms_norm_row(xr, rr, weight, H, eps);
    }
  });
}

// out[t] = rms_norm(x[t]) * weight, for T rows of H (contiguous).
extern "C" void raylm_rms_norm(float* out, const float* x, const float* weight, int64_t T, int64_t H, float eps) {
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(out + t * H, x + t * H, weight, H, eps);
  });
}

// out[t, :d] = silu(x[t, :d]) * x[t, d:2d], for T rows of x [T, 2d] (contiguous).
extern "C" void raylm_silu_and_mul(float* out, const float* x, int64_t T, int64_t d) {
  at::parallel_for(0, T, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = x + t * 2 * d;
      const float* up = gate + d;
      float* o = out + t * d;
      int64_t i = 0;
#if RAYLM_AVX2
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= d; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < d; ++i) o[i] = silu(gate[i]) * up[i];
    }
  });
}

// Rotates, in place, the first rot_dim channels of each of the num_heads heads (head_size
// apart) of each of the T rows of x (row_stride apart) by the row's position, in the
// GPT-NeoX layout Llama uses: channel i pairs with i + rot_dim / 2. cos_sin holds, per
// position, rot_dim / 2 cosines then rot_dim / 2 sines.
extern "C" void raylm_rotary_embedding(float* x, int64_t row_stride, const int64_t* positions, const float* cos_sin,
                                       int64_t T, int64_t num_heads, int64_t head_size, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  at::parallel_for(0, T, grain_rows(num_heads * head_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + positions[t] * rot_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x1 = x + t * row_stride + h * head_size;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * cos[i] - b * sin[i];
          x2[i] = b * cos[i] + a * sin[i];
        }
      }
    }
  });
}

// Copies each of the T rows of key and value (row_size floats, key_stride / value_stride
// apart) to its flat slot of k_cache / v_cache (num_slots rows of row_size); slot -1 skips
// the row. Returns 0, or 1 + the first row whose slot is out of range (nothing written).
extern "C" int64_t raylm_write_kv_cache(const float* key, int64_t key_stride, const float* value,
                                        int64_t value_stride, float* k_cache, float* v_cache,
                                        const int64_t* slot_mapping, int64_t T, int64_t row_size, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t) {
    if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return t + 1;
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    std::memcpy(k_cache + slot * row_size, key + t * key_stride, row_size * sizeof(float));
    std::memcpy(v_cache + slot * row_size, value + t * value_stride, row_size * sizeof(float));
  }
  return 0;
}
