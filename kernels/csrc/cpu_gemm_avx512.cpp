// Linear layers on AVX-512 for decode-sized batches: y = x W^T (+ bias), fp32 accumulation,
// in fp32 (FMA) or bf16 (AVX512-BF16's vdpbf16ps, one rounding of the output to bf16).
//
// Why: on a 2-core AMD EPYC (Zen 4) oneDNN's packed linear ran the ~100M Llama's decode
// GEMMs (64 rows) at 330-400 GFLOP/s in bf16 against the ~460 the cores reach in a register
// loop of vdpbf16ps, with its weights cold (the engine reads each layer's weights from memory
// every step). Here the weight is packed once into panels of 64 output columns laid out in
// the order the kernel reads them, so a call streams the weight front to back, prefetching
// the next block into L2 while the current one, already there, is multiplied by the rows.
//
// Packed layout of W [N, K]: N is padded to a whole number of 64-column panels with zeros;
// panel p holds columns [64 p, 64 p + 64) for every k, one "step" after another:
//   fp32: step k is W[64 p + j][k] for j = 0..63 (256 bytes);
//   bf16: step s is the k pair (2 s, 2 s + 1): W[64 p + j][2 s + h] at 2 j + h (256 bytes),
//         K padded to even with a zero;
// so one step is four zmm loads. Panels are stored one after another.
// The packed copy sits on transparent huge pages (huge_pages.h): 2-4% faster for a step's
// chain of cold decode GEMMs, ~2% over the ~100M Llama's decode GEMMs in the engine.
//
// A thread takes whole panels. For each block of kBlockSteps steps of a panel (128 KiB of
// weight, which stays in L2), it runs the rows through it six at a time: 6 rows x 64 columns
// of fp32 accumulators are 24 zmm registers, and a step is 24 FMAs against 4 weight loads and
// 6 broadcasts of x. Partial sums across blocks stay in a small per-thread buffer.
//
// Ops: torch.ops.raylm.avx512_linear_available(dtype), avx512_pack_weight(weight),
// avx512_linear(x, packed_weight, out_features, bias). Where the build has no AVX-512 (or, for
// bf16, no AVX512-BF16: RAYLM_CPU_ISA can narrow it off) avx512_linear_available is False and
// callers keep oneDNN.
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"
#include "huge_pages.h"

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

namespace {

using namespace raylm;

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

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Steps of a packed panel: k for fp32, k pairs for bf16.
int64_t steps_of(int64_t K, bool bf16) { return bf16 ? (K + 1) / 2 : K; }

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
void store_row(const float* c, const float* bias, int64_t cols, float* out) {
  for (int j = 0; j < 4; ++j) {
    const int64_t left = std::clamp<int64_t>(cols - 16 * j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
    _mm512_mask_storeu_ps(out + 16 * j, mask, _mm512_add_ps(_mm512_loadu_ps(c + 16 * j), _mm512_loadu_ps(bias + 16 * j)));
  }
}

void store_row(const float* c, const float* bias, int64_t cols, uint16_t* out) {
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
Prefetch prefetch_share(const char* next_block, int64_t group, int64_t groups) {
  if (groups == 1) return {next_block, 0, 4};
  const int64_t sharing = std::min<int64_t>(4, groups - 1);
  if (group < 1 || group > sharing) return {};
  return {next_block, static_cast<int>((group - 1) * 4 / sharing), static_cast<int>(group * 4 / sharing)};
}

// The whole GEMM for x [M, K] (rows x_stride apart, K contiguous; bf16 rows padded to an
// even K) into out [M, N] contiguous; with kSiluMul, N is d, the packed weight is gated
// (avx512_pack_gated_weight: ceil(d / 32) panels) and out [M, d] gets silu(gate) * up.
template <typename T, bool kSiluMul = false>
void linear_panels(const T* x, int64_t x_stride, int64_t M, int64_t K, const T* packed, int64_t N,
                   const float* bias, T* out) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  constexpr int64_t kStepElements = kStepBytes / sizeof(T);
  constexpr int64_t kKPerStep = kBf16 ? 2 : 1;
  const int64_t steps = steps_of(K, kBf16);
  const int64_t panel_elements = steps * kStepElements;
  const int64_t panel_outputs = kSiluMul ? kPanelN / 2 : kPanelN;
  const int64_t n_panels = round_up(N, panel_outputs) / panel_outputs;
  const int64_t row_groups = (M + kRows - 1) / kRows;
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(M * kPanelN);
    for (int64_t p = begin; p < end; ++p) {
      const T* panel = packed + p * panel_elements;
      for (int64_t s0 = 0; s0 < steps; s0 += kBlockSteps) {
        const int64_t block_steps = std::min(kBlockSteps, steps - s0);
        const T* block = panel + s0 * kStepElements;
        // The next block follows this one in memory (within the panel or in the next panel);
        // past the thread's last one there is nothing to fetch.
        const bool last = p + 1 == end && s0 + kBlockSteps >= steps;
        const char* next = last ? nullptr : reinterpret_cast<const char*>(block + block_steps * kStepElements);
        for (int64_t group = 0; group < row_groups; ++group) {
          const int64_t m0 = group * kRows;
          const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
          // The thread's first block was fetched by no one: the first group reads it from
          // memory, asking for each step kLeadSteps ahead of the one it multiplies.
          const bool cold = p == begin && s0 == 0 && group == 0 && row_groups > 1;
          const Prefetch prefetch = cold ? Prefetch{reinterpret_cast<const char*>(block) + kLeadSteps * kStepBytes, 0, 4}
                                         : prefetch_share(next, group, row_groups);
          micro_kernel_rows<T>(rows, x + m0 * x_stride + s0 * kKPerStep, x_stride, block, block_steps,
                               c.data() + m0 * kPanelN, s0 > 0, prefetch);
        }
      }
      const int64_t n0 = p * panel_outputs, cols = std::min(panel_outputs, N - n0);
      for (int64_t m = 0; m < M; ++m) {
        if constexpr (kSiluMul) {
          store_silu_mul_row(c.data() + m * kPanelN, cols, out + m * N + n0);
        } else {
          store_row(c.data() + m * kPanelN, bias + n0, cols, out + m * N + n0);
        }
      }
    }
  });
}
#endif  // RAYLM_AVX512_FP32

bool avx512_linear_available(at::ScalarType dtype) {
  if (dtype == at::kFloat) return RAYLM_AVX512_FP32;
  if (dtype == at::kBFloat16) return RAYLM_AVX512_BF16;
  return false;
}

void check_dtype(const char* op, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "raylm::", op, " takes fp32 or bf16, not ", dtype);
  TORCH_CHECK(avx512_linear_available(dtype), "raylm::", op, ": this build or CPU has no AVX-512 kernel for ", dtype);
}

// weight [*, K] -> n_panels panels as described at the top, [n_panels, steps, 256 bytes] in
// the weight's dtype, column j of panel p holding weight row source_row(p, j) (zeros where
// that is negative).
template <typename SourceRow>
at::Tensor pack_panels(const char* op, const at::Tensor& weight_in, int64_t n_panels, SourceRow source_row) {
  TORCH_CHECK(weight_in.device().is_cpu() && weight_in.dim() == 2,
              "raylm::", op, " takes a 2-D CPU weight [out_features, in_features]");
  check_dtype(op, weight_in.scalar_type());
  const at::Tensor weight = weight_in.contiguous();
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const int64_t K = weight.size(1), steps = steps_of(K, bf16);
  const int64_t element = weight.element_size(), step_elements = kStepBytes / element;
  at::Tensor packed = zeros_on_huge_pages({n_panels, steps, step_elements}, weight.options());
  const char* w = static_cast<const char*>(weight.data_ptr());
  char* out = static_cast<char*>(packed.data_ptr());
  const int64_t k_per_step = bf16 ? 2 : 1;
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanelN; ++j) {
        const int64_t n = source_row(p, j);
        if (n < 0) continue;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t s = k / k_per_step, h = k % k_per_step;
          std::memcpy(out + ((p * steps + s) * step_elements + j * k_per_step + h) * element,
                      w + (n * K + k) * element, element);
        }
      }
    }
  });
  return packed;
}

// w [N, K] -> the panels described at the top.
at::Tensor avx512_pack_weight(const at::Tensor& weight) {
  const int64_t N = weight.dim() == 2 ? weight.size(0) : 0;
  return pack_panels("avx512_pack_weight", weight, round_up(N, kPanelN) / kPanelN,
                     [N](int64_t p, int64_t j) { return p * kPanelN + j < N ? p * kPanelN + j : -1; });
}

// w [2d, K], gate_proj's d rows then up_proj's (a gate_up projection) -> ceil(d / 32) panels,
// panel p holding gate rows [32 p, 32 p + 32) in its first 32 columns and the up rows of the
// same outputs in its last 32, for avx512_linear_silu_mul.
at::Tensor avx512_pack_gated_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0,
              "raylm::avx512_pack_gated_weight takes a weight [2d, in_features] (gate rows, then up rows)");
  const int64_t d = weight.size(0) / 2, half = kPanelN / 2;
  return pack_panels("avx512_pack_gated_weight", weight, round_up(d, half) / half, [d, half](int64_t p, int64_t j) {
    const int64_t output = p * half + j % half;
    return output < d ? output + (j < half ? 0 : d) : -1;
  });
}

// The GEMM of x [..., K] by a packed weight of n_panels panels into out [..., N] (N outputs:
// the weight's rows, or with kSiluMul the gated weight's d), checking what the op was given.
template <bool kSiluMul>
at::Tensor run_linear(const char* op, const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                      int64_t n_panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() >= 1, "raylm::", op, " takes CPU activations [..., K]");
  const at::ScalarType dtype = x_in.scalar_type();
  check_dtype(op, dtype);
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t K = x_in.size(-1), steps = steps_of(K, bf16);
  TORCH_CHECK(N >= 0 && packed.scalar_type() == dtype && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == n_panels && packed.size(1) == steps && packed.size(2) == kStepBytes / x_in.element_size(),
              "raylm::", op, ": the packed weight does not match K = ", K, ", N = ", N, " and ", dtype);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu() &&
                                    (bias->scalar_type() == dtype || bias->scalar_type() == at::kFloat)),
              "raylm::", op, ": bias must be [N] fp32 or of x's dtype");
  std::vector<int64_t> out_sizes(x_in.sizes().begin(), x_in.sizes().end());
  out_sizes.back() = N;
  at::Tensor out = at::empty(out_sizes, x_in.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = x_in.numel() / std::max<int64_t>(K, 1);
  if (M == 0 || N == 0) return out;
  if (K == 0) {  // every product is zero
    out.zero_();
    if constexpr (!kSiluMul) out.add_(bias.has_value() ? *bias : at::zeros({N}, out.options()));
    return out;
  }
#if RAYLM_AVX512_FP32
  // Rows with K contiguous; bf16 rows of odd K are copied with a zero appended, so the
  // kernel's last k pair reads a zero against the packed weight's zero.
  at::Tensor x = x_in.reshape({M, K});
  if (x.stride(1) != 1) x = x.contiguous();
  if (bf16 && K % 2 == 1) {
    at::Tensor padded = at::zeros({M, K + 1}, x.options());
    padded.narrow(1, 0, K).copy_(x);
    x = padded;
  }
  // The bias in fp32, padded to whole panels (zeros without one).
  std::vector<float> bias_f32(n_panels * kPanelN, 0.0f);
  if (bias.has_value()) {
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    std::memcpy(bias_f32.data(), b.data_ptr(), N * sizeof(float));
  }
  if (bf16) {
#if RAYLM_AVX512_BF16
    linear_panels<uint16_t, kSiluMul>(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K,
                                      static_cast<const uint16_t*>(packed.data_ptr()), N, bias_f32.data(),
                                      static_cast<uint16_t*>(out.data_ptr()));
#endif
  } else {
    linear_panels<float, kSiluMul>(static_cast<const float*>(x.data_ptr()), x.stride(0), M, K,
                                   static_cast<const float*>(packed.data_ptr()), N, bias_f32.data(),
                                   static_cast<float*>(out.data_ptr()));
  }
#endif
  return out;
}

// x [..., K] fp32 or bf16, packed from avx512_pack_weight of W [N, K] of x's dtype, bias [N]
// fp32 or x's dtype or None: returns x W^T + bias [..., N] in x's dtype.
at::Tensor avx512_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias) {
  return run_linear<false>("avx512_linear", x, packed, N, round_up(N, kPanelN) / kPanelN, bias);
}

// x [..., K] fp32 or bf16, packed from avx512_pack_gated_weight of a gate_up weight [2d, K]:
// returns silu(x Wg^T) * (x Wu^T) [..., d] in x's dtype, what avx512_linear and then
// silu_and_mul give, in one pass that never writes the [..., 2d] projection out.
at::Tensor avx512_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t d) {
  return run_linear<true>("avx512_linear_silu_mul", x, packed, d, round_up(d, kPanelN / 2) / (kPanelN / 2),
                          c10::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("avx512_linear_available(ScalarType dtype) -> bool", &avx512_linear_available);  // no tensors: one kernel
  m.def("avx512_pack_weight(Tensor weight) -> Tensor");
  m.def("avx512_pack_gated_weight(Tensor weight) -> Tensor");
  m.def("avx512_linear(Tensor x, Tensor packed_weight, int out_features, Tensor? bias) -> Tensor");
  m.def("avx512_linear_silu_mul(Tensor x, Tensor packed_weight, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("avx512_pack_weight", &avx512_pack_weight);
  m.impl("avx512_pack_gated_weight", &avx512_pack_gated_weight);
  m.impl("avx512_linear", &avx512_linear);
  m.impl("avx512_linear_silu_mul", &avx512_linear_silu_mul);
}
