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
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "cpu_gemm_avx512_panels.h"
#include "cpu_gemm_op_shell.h"

namespace {

using namespace raylm;
using namespace raylm::panels;

#if RAYLM_AVX512_FP32
// The whole GEMM for x [M, K] (rows x_stride apart, K contiguous; bf16 rows padded to an
// even K) into out [M, N] contiguous; with kSiluMul, N is d, the packed weight is gated
// (avx512_pack_gated_weight: ceil(d / 32) panels) and out [M, d] gets silu(gate) * up.
template <typename T, bool kSiluMul = false>
void linear_panels(const T* x, int64_t x_stride, int64_t M, int64_t K, const T* packed, int64_t N,
                   const float* bias, T* out) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  constexpr int64_t kStepElements = kStepBytes / sizeof(T);
  const int64_t steps = steps_of(K, kBf16);
  const int64_t panel_elements = steps * kStepElements;
  const int64_t panel_outputs = kSiluMul ? kPanelN / 2 : kPanelN;
  const int64_t n_panels = round_up(N, panel_outputs) / panel_outputs;
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(M * kPanelN);
    for (int64_t p = begin; p < end; ++p) {
      const T* panel = packed + p * panel_elements;
      // Past the thread's last panel there is nothing to fetch.
      multiply_panel<T>(x, x_stride, M, steps, panel, p + 1 == end ? nullptr : panel + panel_elements, p == begin,
                        c.data());
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

constexpr op_shell::KernelDtypes kDtypes{&avx512_linear_available, "this build or CPU has no AVX-512 kernel for "};

// The packed sizes for K: [n_panels, steps, 256 bytes of the dtype].
auto packed_sizes(int64_t n_panels) {
  return [n_panels](int64_t K, at::ScalarType dtype) {
    const bool bf16 = dtype == at::kBFloat16;
    return std::array<int64_t, 3>{n_panels, steps_of(K, bf16), kStepBytes / (bf16 ? 2 : 4)};
  };
}

// weight [*, K] -> n_panels panels as described at the top, [n_panels, steps, 256 bytes] in
// the weight's dtype, column j of panel p holding weight row source_row(p, j) (zeros where
// that is negative).
template <typename SourceRow>
at::Tensor pack_panels(const char* op, const at::Tensor& weight, int64_t n_panels, SourceRow source_row) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const int64_t K = weight.dim() == 2 ? weight.size(1) : 0, steps = steps_of(K, bf16);
  const int64_t k_per_step = bf16 ? 2 : 1, step_elements = kStepBytes / (bf16 ? 2 : 4);
  return op_shell::pack_panels(op, weight, kDtypes, kPanelN, packed_sizes(n_panels), source_row,
                               [=](int64_t p, int64_t j, int64_t k) {
                                 const int64_t s = k / k_per_step, h = k % k_per_step;
                                 return (p * steps + s) * step_elements + j * k_per_step + h;
                               });
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
  return op_shell::run_linear(
      op, kDtypes, x_in, packed, N, n_panels * kPanelN, bias, packed_sizes(n_panels),
      [&](at::Tensor x, const float* bias_f32, at::Tensor& out) {
#if RAYLM_AVX512_FP32
        const int64_t M = x.size(0), K = x.size(1);
        const bool bf16 = x.scalar_type() == at::kBFloat16;
        // bf16 rows of odd K are copied with a zero appended, so the kernel's last k pair
        // reads a zero against the packed weight's zero.
        if (bf16 && K % 2 == 1) {
          at::Tensor padded = at::zeros({M, K + 1}, x.options());
          padded.narrow(1, 0, K).copy_(x);
          x = padded;
        }
        if (bf16) {
#if RAYLM_AVX512_BF16
          linear_panels<uint16_t, kSiluMul>(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K,
                                            static_cast<const uint16_t*>(packed.data_ptr()), N, bias_f32,
                                            static_cast<uint16_t*>(out.data_ptr()));
#endif
        } else {
          linear_panels<float, kSiluMul>(static_cast<const float*>(x.data_ptr()), x.stride(0), M, K,
                                         static_cast<const float*>(packed.data_ptr()), N, bias_f32,
                                         static_cast<float*>(out.data_ptr()));
        }
#endif
      });
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
