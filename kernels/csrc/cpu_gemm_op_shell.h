// The torch-op shell of the streaming GEMM kernels (csrc/cpu_gemm_avx512.cpp, csrc/cpu_gemm_avx2.cpp):
// the argument checks, the output's allocation, the cases without products, the activations
// as rows with K contiguous, the bias in fp32, and the packing loop, written once. A kernel
// file says only what is its own: which dtypes it runs, its packed layout (the packed
// tensor's sizes and where weight element (n, k) goes) and its loop over the panels.
//
// ISA-free (ATen only), so that every build compiles it, RAYLM_CPU_ISA=scalar included.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "huge_pages.h"

namespace raylm {
namespace op_shell {

// What a streaming kernel runs: available(dtype) says whether this build has it for fp32 or
// bf16; unavailable is the end of the error where it has not ("this build has no ... kernel").
struct KernelDtypes {
  bool (*available)(at::ScalarType);
  const char* unavailable;
};

inline void check_dtype(const char* op, at::ScalarType dtype, const KernelDtypes& kernel) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "raylm::", op, " takes fp32 or bf16, not ", dtype);
  TORCH_CHECK(kernel.available(dtype), "raylm::", op, ": ", kernel.unavailable, dtype);
}

// weight [*, K] (fp32 or bf16) -> a zeroed packed tensor of `sizes` in the weight's dtype, on
// huge pages, where weight row source_row(p, j) (none where negative) of panel p's column j
// is copied, element k to element offset(p, j, k) of the packed tensor. sizes(K, dtype)
// gives the packed sizes; j runs over [0, panel_columns).
template <typename Sizes, typename SourceRow, typename Offset>
at::Tensor pack_panels(const char* op, const at::Tensor& weight_in, const KernelDtypes& kernel, int64_t panel_columns,
                       Sizes sizes, SourceRow source_row, Offset offset) {
  TORCH_CHECK(weight_in.device().is_cpu() && weight_in.dim() == 2,
              "raylm::", op, " takes a 2-D CPU weight [out_features, in_features]");
  check_dtype(op, weight_in.scalar_type(), kernel);
  const at::Tensor weight = weight_in.contiguous();
  const int64_t K = weight.size(1), element = weight.element_size();
  const std::array<int64_t, 3> packed_sizes = sizes(K, weight.scalar_type());
  at::Tensor packed = zeros_on_huge_pages({packed_sizes[0], packed_sizes[1], packed_sizes[2]}, weight.options());
  const char* w = static_cast<const char*>(weight.data_ptr());
  char* out = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, packed_sizes[0], 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < panel_columns; ++j) {
        const int64_t n = source_row(p, j);
        if (n < 0) continue;
        for (int64_t k = 0; k < K; ++k) {
          std::memcpy(out + offset(p, j, k) * element, w + (n * K + k) * element, element);
        }
      }
    }
  });
  return packed;
}

// The common part of a streaming linear op: x [..., K] fp32 or bf16 by a packed weight of
// `sizes(K, dtype)` into out [..., N] in x's dtype, bias [N] fp32 or of x's dtype (or none;
// with_bias false: the op takes none). Checks what it was given, then calls
// kernel(x [M, K] in x's dtype with K contiguous (rows x.stride(0) apart), bias in fp32
// padded with zeros to padded_N, out [M, N] contiguous) where there are products; with
// K = 0 out is the bias (zeros without one), with M = 0 or N = 0 empty.
template <typename Sizes, typename Kernel>
at::Tensor run_linear(const char* op, const KernelDtypes& kernel_dtypes, const at::Tensor& x_in,
                      const at::Tensor& packed, int64_t N, int64_t padded_N, const c10::optional<at::Tensor>& bias,
                      Sizes sizes, Kernel kernel) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() >= 1, "raylm::", op, " takes CPU activations [..., K]");
  const at::ScalarType dtype = x_in.scalar_type();
  check_dtype(op, dtype, kernel_dtypes);
  const int64_t K = x_in.size(-1);
  const std::array<int64_t, 3> packed_sizes = sizes(K, dtype);
  TORCH_CHECK(N >= 0 && packed.scalar_type() == dtype && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == packed_sizes[0] && packed.size(1) == packed_sizes[1] &&
                  packed.size(2) == packed_sizes[2],
              "raylm::", op, ": the packed weight does not match K = ", K, ", N = ", N, " and ", dtype);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu() &&
                                    (bias->scalar_type() == dtype || bias->scalar_type() == at::kFloat)),
              "raylm::", op, ": bias must be [N] fp32 or of x's dtype");
  std::vector<int64_t> out_sizes(x_in.sizes().begin(), x_in.sizes().end());
  out_sizes.back() = N;
  at::Tensor out = at::empty(out_sizes, x_in.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = c10::multiply_integers(x_in.sizes().begin(), x_in.sizes().end() - 1);  // K may be 0
  if (M == 0 || N == 0) return out;
  if (K == 0) {  // every product is zero (and silu(0) * 0 is 0)
    out.zero_();
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
  at::Tensor x = x_in.reshape({M, K});
  if (x.stride(1) != 1) x = x.contiguous();
  std::vector<float> bias_f32(std::max(padded_N, N), 0.0f);
  if (bias.has_value()) {
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    std::memcpy(bias_f32.data(), b.data_ptr(), N * sizeof(float));
  }
  kernel(x, bias_f32.data(), out);
  return out;
}

}  // namespace op_shell
}  // namespace raylm
