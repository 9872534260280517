// Linear layers on AVX2 + FMA for decode-sized batches: y = x W^T (+ bias), fp32 accumulation,
// for fp32 weights and for bf16 weights widened to fp32 in registers (AVX2 has no bf16
// arithmetic: a bf16 value is the high half of an fp32 one, so widening is a shift or a mask).
//
// Why: on CPUs without AVX-512 (AMD EPYC up to Zen 3, many desktop and cloud parts) the
// AVX-512 and AMX streaming kernels are not built, and a decode step's GEMMs went to oneDNN
// or F.linear (MKL, which takes no fast path on AMD CPUs). This is the AVX-512 kernel's
// scheme at half the vector width: the weight is packed once into panels of 16 output columns
// in the order the kernel reads them, so a call streams it front to back, the next block
// prefetched into L2 while the current one is multiplied by every row.
//
// Packed layout of W [N, K]: N is padded to a whole number of 16-column panels with zeros;
// panel p holds columns [16 p, 16 p + 16) for every k, one "step" (one k) after another:
//   fp32: step k is W[16 p + j][k] for j = 0..15 (64 bytes, one cache line);
//   bf16: step k is 32 bytes, eight 32-bit lanes: lane i holds W[16 p + i][k] in its low
//         half and W[16 p + 8 + i][k] in its high half, so a shift left by 16 widens the
//         first 8 columns and a mask of the low half the last 8, without shuffles.
// Panels are stored one after another, on transparent huge pages (huge_pages.h).
//
// A thread takes whole panels. For each block of a panel (kBlockBytes of weight, which stays
// in L1 while the rows go through it), it runs the rows through it six at a time: 6 rows x 16
// columns of fp32 accumulators are 12 ymm registers, plus 2 for the step's weight and 1 for
// the broadcast x: 15 of the 16. Activations are fp32 inside (bf16 rows are widened once per
// call); partial sums across blocks stay in a small per-thread buffer.
//
// Gated form (a gate_up projection that SiLU-and-mul follows): avx2_pack_gated_weight puts
// 8 gate columns and the 8 up columns of the same outputs in each panel, so the micro-kernel's
// tile holds both (in bf16 one lane holds an output's gate and up weights), and
// avx2_linear_silu_mul stores silu(gate) * up from the panel's accumulators, never writing the
// [.., 2d] projection out; bit for bit what avx2_linear and silu_and_mul give.
//
// Ops: torch.ops.raylm.avx2_linear_available(dtype), avx2_pack_weight(weight),
// avx2_linear(x, packed_weight, out_features, bias), avx2_pack_gated_weight(weight),
// avx2_linear_silu_mul(x, packed_weight, d); their argument checks and packing loop are
// cpu_gemm_op_shell.h's, shared with the AVX-512 kernel. Where the build has no AVX2 + FMA
// (RAYLM_CPU_ISA=scalar) avx2_linear_available is False and callers keep oneDNN or F.linear.
// AVX-512 builds compile it too (AVX-512 CPUs have AVX2), so their tests run it; cpu_gemm.py
// takes the AVX-512 kernel there.
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_gemm_op_shell.h"
#include "cpu_vec.h"

namespace {

using namespace raylm;

constexpr int64_t kPanelN = 16;  // output columns of one panel: two ymm of fp32
constexpr int kRows = 6;         // rows of x per micro-kernel call: 6 x 2 accumulators
// Weight bytes of one block: it stays in L1 (32 KiB on the CPUs this targets) while every
// row group goes through it, and the next one is prefetched into L2 meanwhile.
constexpr int64_t kBlockBytes = 16 << 10;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

template <typename W>
constexpr int64_t kStepBytes = kPanelN * sizeof(W);  // one k of a panel: 64 bytes fp32, 32 bf16

template <typename W>
constexpr int64_t kBlockSteps = kBlockBytes / kStepBytes<W>;

// Column j of a panel's step sits at this element of the step (see the layout at the top).
template <typename W>
constexpr int64_t position_in_step(int64_t j) {
  return std::is_same_v<W, float> ? j : 2 * (j % 8) + j / 8;
}

#if RAYLM_AVX2
// The step's 16 weights as two vectors of fp32: columns 0-7 and 8-15.
inline void load_step(const float* w, __m256& b0, __m256& b1) {
  b0 = _mm256_loadu_ps(w);
  b1 = _mm256_loadu_ps(w + 8);
}

inline void load_step(const uint16_t* w, __m256& b0, __m256& b1) {
  const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  b0 = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
  b1 = _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// The accumulators of row r: named variables, not an array, so that GCC keeps them in
// registers (with `__m256 acc[R][2]` it stored all 12 to the stack on every step: the
// kernel ran at a third of the FMA rate).
#define RAYLM_FOR_ROWS(DO) DO(0) DO(1) DO(2) DO(3) DO(4) DO(5)
#define RAYLM_DECLARE_ROW(r)                                                                  \
  __m256 lo##r = _mm256_setzero_ps(), hi##r = _mm256_setzero_ps();                           \
  if (R > r && accumulate) {                                                                  \
    lo##r = _mm256_loadu_ps(c + r * kPanelN);                                                 \
    hi##r = _mm256_loadu_ps(c + r * kPanelN + 8);                                             \
  }
#define RAYLM_MULTIPLY_ROW(r)                                                                 \
  if constexpr (R > r) {                                                                      \
    const __m256 a = _mm256_broadcast_ss(x + r * x_stride + s);                               \
    lo##r = _mm256_fmadd_ps(a, b0, lo##r);                                                    \
    hi##r = _mm256_fmadd_ps(a, b1, hi##r);                                                    \
  }
#define RAYLM_STORE_ROW(r)                                                                    \
  if constexpr (R > r) {                                                                      \
    _mm256_storeu_ps(c + r * kPanelN, lo##r);                                                 \
    _mm256_storeu_ps(c + r * kPanelN + 8, hi##r);                                             \
  }

// c[r][0:16] (+)= sum over the block's steps of x[r][s] times the block's step s, for R rows.
// x points at this block's first k of row 0 (rows x_stride floats apart); c's rows are 16
// floats apart; prefetch (null: none) is the next block, brought into L2 a line per 64 bytes
// of weight multiplied here.
template <int R, typename W>
void micro_kernel(const float* x, int64_t x_stride, const W* w, int64_t steps, float* c, bool accumulate,
                  const char* prefetch) {
  static_assert(R >= 1 && R <= kRows);
  RAYLM_FOR_ROWS(RAYLM_DECLARE_ROW)
  constexpr int64_t kStepsPerLine = 64 / kStepBytes<W>;
  for (int64_t s = 0; s < steps; ++s) {
    if (prefetch != nullptr && s % kStepsPerLine == 0) _mm_prefetch(prefetch + s * kStepBytes<W>, _MM_HINT_T1);
    __m256 b0, b1;
    load_step(w + s * kPanelN, b0, b1);
    RAYLM_FOR_ROWS(RAYLM_MULTIPLY_ROW)
  }
  RAYLM_FOR_ROWS(RAYLM_STORE_ROW)
}

#undef RAYLM_FOR_ROWS
#undef RAYLM_DECLARE_ROW
#undef RAYLM_MULTIPLY_ROW
#undef RAYLM_STORE_ROW

template <typename W>
void micro_kernel_rows(int rows, const float* x, int64_t x_stride, const W* w, int64_t steps, float* c,
                       bool accumulate, const char* prefetch) {
  switch (rows) {
    case 6: micro_kernel<6>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    case 5: micro_kernel<5>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    case 4: micro_kernel<4>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    case 3: micro_kernel<3>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    case 2: micro_kernel<2>(x, x_stride, w, steps, c, accumulate, prefetch); break;
    default: micro_kernel<1>(x, x_stride, w, steps, c, accumulate, prefetch); break;
  }
}

// out[0:cols] = c[0:16] + bias, in out's dtype (bf16 rounded to nearest even, as PyTorch).
inline void store_row(const float* c, const float* bias, int64_t cols, float* out) {
  if (cols == kPanelN) {
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(c), _mm256_loadu_ps(bias)));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_loadu_ps(c + 8), _mm256_loadu_ps(bias + 8)));
    return;
  }
  for (int64_t j = 0; j < cols; ++j) out[j] = c[j] + bias[j];
}

inline void store_row(const float* c, const float* bias, int64_t cols, uint16_t* out) {
  if (cols == kPanelN) {
    store8(out, _mm256_add_ps(_mm256_loadu_ps(c), _mm256_loadu_ps(bias)));
    store8(out + 8, _mm256_add_ps(_mm256_loadu_ps(c + 8), _mm256_loadu_ps(bias + 8)));
    return;
  }
  for (int64_t j = 0; j < cols; ++j) out[j] = to_bf16(c[j] + bias[j]);
}

// c[0:M][0:16] = the rows of x [M, K] (fp32, rows x_stride apart) times one packed panel of K
// steps, block by block; next_panel (null: none in this thread) is prefetched during the
// panel's last block.
template <typename W>
void multiply_panel(const float* x, int64_t x_stride, int64_t M, int64_t K, const W* panel, const W* next_panel,
                    float* c) {
  const int64_t row_groups = (M + kRows - 1) / kRows;
  for (int64_t s0 = 0; s0 < K; s0 += kBlockSteps<W>) {
    const int64_t block_steps = std::min(kBlockSteps<W>, K - s0);
    const W* block = panel + s0 * kPanelN;
    const bool last_block = s0 + kBlockSteps<W> >= K;
    const char* next = reinterpret_cast<const char*>(last_block ? next_panel : block + block_steps * kPanelN);
    for (int64_t group = 0; group < row_groups; ++group) {
      const int64_t m0 = group * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      // The first group reads the block from memory (or L2), the others from L1: the first
      // brings in the next block as it goes.
      micro_kernel_rows<W>(rows, x + m0 * x_stride + s0, x_stride, block, block_steps, c + m0 * kPanelN, s0 > 0,
                           group == 0 ? next : nullptr);
    }
  }
}

// The gated epilogue (avx2_linear_silu_mul): a panel's 16 columns are 8 gate columns then the
// 8 up columns of the same outputs, and out[0:cols] = silu(gate) * up for the outputs
// [n0, n0 + cols) of a row. Each half is first stored in out's dtype as avx2_linear's
// store_row would (plus its zero bias: -0 + 0 is +0), and silu_and_mul's (cpu_ops.cpp) own
// formulas follow: vsilu over the row's vector part (its first `vector_end` outputs, whole
// vectors of kVecWidth: 8 lanes, or 16 in an AVX-512 build), its scalar formula past it. vsilu
// works lane by lane, so 8 outputs in a vector of 16 get the lanes silu_and_mul's vector gives
// them: the pair's result bit for bit, in every build.
template <typename W>
inline void store8_as(W* out, __m256 v) {
  if constexpr (std::is_same_v<W, float>) {
    _mm256_storeu_ps(out, v);
  } else {
    store8(out, v);
  }
}

template <typename W>
void store_silu_mul_row(const float* c, int64_t n0, int64_t cols, int64_t vector_end, W* out) {
  constexpr int64_t kHalf = kPanelN / 2;
  const __m256 zero = _mm256_setzero_ps();
  W gate[kVecWidth] = {}, up[kVecWidth] = {};  // as stored; lanes past 8 (AVX-512 builds) zero
  store8_as(gate, _mm256_add_ps(_mm256_loadu_ps(c), zero));
  store8_as(up, _mm256_add_ps(_mm256_loadu_ps(c + kHalf), zero));
  if (kVecWidth == kHalf && cols == kHalf && n0 + kHalf <= vector_end) {  // AVX2 builds, all but a row's tail
    vstore(out, vmul(vsilu(vload(gate)), vload(up)));
    return;
  }
  W vector_result[kVecWidth];
  vstore(vector_result, vmul(vsilu(vload(gate)), vload(up)));
  for (int64_t j = 0; j < cols; ++j) {
    if (n0 + j < vector_end) {
      out[j] = vector_result[j];
    } else {
      const float g = to_float(gate[j]);
      store_scalar(out + j, g / (1.0f + std::exp(-g)) * to_float(up[j]));
    }
  }
}

// The whole GEMM for x [M, K] fp32 (rows x_stride apart, K contiguous) into out [M, N]; with
// kSiluMul, N is d, the packed weight is gated (avx2_pack_gated_weight: ceil(d / 8) panels)
// and out [M, d] gets silu(gate) * up.
template <typename W, bool kSiluMul = false>
void linear_panels(const float* x, int64_t x_stride, int64_t M, int64_t K, const W* packed, int64_t N,
                   const float* bias, W* out) {
  const int64_t panel_elements = K * kPanelN;
  const int64_t panel_outputs = kSiluMul ? kPanelN / 2 : kPanelN;
  const int64_t n_panels = round_up(N, panel_outputs) / panel_outputs;
  const int64_t vector_end = N / kVecWidth * kVecWidth;  // silu_and_mul's vector part of a row
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(M * kPanelN);
    for (int64_t p = begin; p < end; ++p) {
      const W* panel = packed + p * panel_elements;
      multiply_panel<W>(x, x_stride, M, K, panel, p + 1 == end ? nullptr : panel + panel_elements, c.data());
      const int64_t n0 = p * panel_outputs, cols = std::min(panel_outputs, N - n0);
      for (int64_t m = 0; m < M; ++m) {
        if constexpr (kSiluMul) {
          store_silu_mul_row(c.data() + m * kPanelN, n0, cols, vector_end, out + m * N + n0);
        } else {
          store_row(c.data() + m * kPanelN, bias + n0, cols, out + m * N + n0);
        }
      }
    }
  });
}
#endif  // RAYLM_AVX2

bool avx2_linear_available(at::ScalarType dtype) {
  return RAYLM_AVX2 && (dtype == at::kFloat || dtype == at::kBFloat16);
}

constexpr op_shell::KernelDtypes kDtypes{&avx2_linear_available, "this build has no AVX2 + FMA kernel for "};

// The packed sizes for K: [n_panels, K, 16] in the weight's dtype.
auto packed_sizes(int64_t n_panels) {
  return [n_panels](int64_t K, at::ScalarType) { return std::array<int64_t, 3>{n_panels, K, kPanelN}; };
}

// weight [*, K] -> n_panels panels as described at the top, column j of panel p holding weight
// row source_row(p, j) (zeros where that is negative).
template <typename SourceRow>
at::Tensor pack_panels(const char* op, const at::Tensor& weight, int64_t n_panels, SourceRow source_row) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const int64_t K = weight.dim() == 2 ? weight.size(1) : 0;
  return op_shell::pack_panels(op, weight, kDtypes, kPanelN, packed_sizes(n_panels), source_row,
                               [=](int64_t p, int64_t j, int64_t k) {
                                 const int64_t at = bf16 ? position_in_step<uint16_t>(j) : position_in_step<float>(j);
                                 return (p * K + k) * kPanelN + at;
                               });
}

// w [N, K] -> the panels described at the top, [n_panels, K, 16] in the weight's dtype.
at::Tensor avx2_pack_weight(const at::Tensor& weight) {
  const int64_t N = weight.dim() == 2 ? weight.size(0) : 0;
  return pack_panels("avx2_pack_weight", weight, round_up(N, kPanelN) / kPanelN,
                     [N](int64_t p, int64_t j) { return p * kPanelN + j < N ? p * kPanelN + j : -1; });
}

// w [2d, K], gate_proj's d rows then up_proj's (a gate_up projection) -> ceil(d / 8) panels,
// panel p holding gate rows [8 p, 8 p + 8) in its first 8 columns and the up rows of the same
// outputs in its last 8 (in bf16, one lane holds an output's gate and up weights), so that
// one micro-kernel tile holds both, for avx2_linear_silu_mul.
at::Tensor avx2_pack_gated_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0,
              "raylm::avx2_pack_gated_weight takes a weight [2d, in_features] (gate rows, then up rows)");
  const int64_t d = weight.size(0) / 2, half = kPanelN / 2;
  return pack_panels("avx2_pack_gated_weight", weight, round_up(d, half) / half, [d, half](int64_t p, int64_t j) {
    const int64_t output = p * half + j % half;
    return output < d ? output + (j < half ? 0 : d) : -1;
  });
}

// The GEMM of x [..., K] by a packed weight of n_panels panels into out [..., N] (N outputs:
// the weight's rows, or with kSiluMul the gated weight's d), checking what the op was given.
template <bool kSiluMul>
at::Tensor run_linear(const char* op, const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                      int64_t n_panels, const c10::optional<at::Tensor>& bias) {
  return op_shell::run_linear(
      op, kDtypes, x_in, packed, N, n_panels * kPanelN, bias, packed_sizes(n_panels),
      [&](at::Tensor x, const float* bias_f32, at::Tensor& out) {
#if RAYLM_AVX2
        // fp32 rows: bf16 activations are widened once here (exactly), not per panel in the
        // inner loop.
        const bool bf16 = x.scalar_type() == at::kBFloat16;
        if (bf16) x = x.to(at::kFloat);
        const int64_t M = x.size(0), K = x.size(1);
        const float* rows = static_cast<const float*>(x.data_ptr());
        if (bf16) {
          linear_panels<uint16_t, kSiluMul>(rows, x.stride(0), M, K, static_cast<const uint16_t*>(packed.data_ptr()),
                                            N, bias_f32, static_cast<uint16_t*>(out.data_ptr()));
        } else {
          linear_panels<float, kSiluMul>(rows, x.stride(0), M, K, static_cast<const float*>(packed.data_ptr()), N,
                                         bias_f32, static_cast<float*>(out.data_ptr()));
        }
#endif
      });
}

// x [..., K] fp32 or bf16, packed from avx2_pack_weight of W [N, K] of x's dtype, bias [N]
// fp32 or x's dtype or None: returns x W^T + bias [..., N] in x's dtype.
at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const c10::optional<at::Tensor>& bias) {
  return run_linear<false>("avx2_linear", x, packed, N, round_up(std::max<int64_t>(N, 0), kPanelN) / kPanelN, bias);
}

// x [..., K] fp32 or bf16, packed from avx2_pack_gated_weight of a gate_up weight [2d, K]:
// returns silu(x Wg^T) * (x Wu^T) [..., d] in x's dtype, what avx2_linear and then
// silu_and_mul give (bit for bit), in one pass that never writes the [..., 2d] projection out.
at::Tensor avx2_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t d) {
  return run_linear<true>("avx2_linear_silu_mul", x, packed, d,
                          round_up(std::max<int64_t>(d, 0), kPanelN / 2) / (kPanelN / 2), c10::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("avx2_linear_available(ScalarType dtype) -> bool", &avx2_linear_available);  // no tensors: one kernel
  m.def("avx2_pack_weight(Tensor weight) -> Tensor");
  m.def("avx2_pack_gated_weight(Tensor weight) -> Tensor");
  m.def("avx2_linear(Tensor x, Tensor packed_weight, int out_features, Tensor? bias) -> Tensor");
  m.def("avx2_linear_silu_mul(Tensor x, Tensor packed_weight, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("avx2_pack_weight", &avx2_pack_weight);
  m.impl("avx2_pack_gated_weight", &avx2_pack_gated_weight);
  m.impl("avx2_linear", &avx2_linear);
  m.impl("avx2_linear_silu_mul", &avx2_linear_silu_mul);
}
