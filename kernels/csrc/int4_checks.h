// The argument checks the int4 ops share (the dense int4_linear, cpu_int4_linear.cpp, and the
// MoE experts' dequantize_int4_experts, cpu_int4_experts.cpp): the code width, each tensor's
// device, dtype, rank, sizes and contiguity against the layout the kernel reads, and index
// tensors (groups, experts) inside what they index, so that no kernel reads outside its
// tensors. Each error names the op, the argument, what it must be and what it got.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>

namespace raylm::int4 {

// Any size along a dimension (check_tensor's `sizes`).
constexpr int64_t kAnySize = -1;

// The codes a 32-bit word packs (32 / bits): 4-bit codes, or 8-bit ones in GPTQ's layout
// (AWQ packs 4-bit codes only).
inline int64_t checked_codes_per_word(const char* op, int64_t bits, bool awq) {
  TORCH_CHECK(bits == 4 || (bits == 8 && !awq), op, ": bits must be 4", awq ? " for AWQ" : " or 8", ", got ", bits);
  return 32 / bits;
}

// `t` must be a contiguous CPU tensor of `dtype` whose sizes are `sizes` (kAnySize: any),
// named `name` with its `layout` ("[E, groups, out]") in the error.
inline void check_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                         std::initializer_list<int64_t> sizes, const char* layout) {
  bool fits = t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
              t.dim() == static_cast<int64_t>(sizes.size());
  int64_t d = 0;
  for (const int64_t size : sizes) {
    fits = fits && (size == kAnySize || t.size(d) == size);
    ++d;
  }
  TORCH_CHECK(fits, op, ": ", name, " must be a contiguous ", layout, " ", dtype, " CPU tensor, got ",
              t.is_contiguous() ? "" : "a non-contiguous ", t.sizes(), " ", t.scalar_type(), " on ", t.device());
}

// index[0 .. n) must lie in [0, count): `name` of `row` (or of the whole index when row < 0).
template <typename index_t>
inline void check_indices(const char* op, const char* name, const index_t* index, int64_t n, int64_t count,
                          int64_t row = -1) {
  for (int64_t i = 0; i < n; ++i) {
    if (index[i] >= 0 && index[i] < count) continue;
    if (row >= 0) {
      TORCH_CHECK_VALUE(false, op, ": ", name, "[", row, ", ", i, "] = ", index[i], " is outside 0 to ", count - 1);
    }
    TORCH_CHECK_VALUE(false, op, ": ", name, "[", i, "] = ", index[i], " is outside 0 to ", count - 1);
  }
}

}  // namespace raylm::int4
