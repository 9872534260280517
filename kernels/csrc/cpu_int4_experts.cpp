// GPTQ / AWQ MoE experts (raylm/kernels/int4_fused_moe.py) dequantized for the fused-experts
// kernels in one pass: the selected experts' [out, in] weights in fp32 or bf16, straight from
// the checkpoint's packed tensors, stacked over the experts as the method holds them:
//   qweight  GPTQ [E, in / pack, out] (codes along the input), AWQ [E, in, out / 8] (along the
//            output, in AWQ's nibble order); pack = 32 / bits
//   qzeros   [E, groups, out / pack] (GPTQ's order, or AWQ's), scales [E, groups, out] fp32
//   g_idx    [E, in] int32 under desc_act (each input row's group), else row / group_size.
// Element (n, k) of expert e is (code - (zero + zero_offset)) * scale of k's group and column
// n, computed in fp32 (the codes and zeros are small integers, so only the product rounds)
// and rounded once to the output dtype: bit for bit what the PyTorch fallback computes.
//
// Work items are (expert, output rows) pairs, split over the threads. Each writes whole output
// rows front to back: vectors of kVecWidth consecutive inputs k (cpu_vec.h: 16 with AVX-512,
// 8 with AVX2 + FMA), their codes widened in registers with int4_codes.h's helpers. A GPTQ
// row's vector takes its codes from kVecWidth / pack words of that column (one word for
// 4 bits with AVX2: broadcast, each lane its own shift); an AWQ word column holds 8 output
// rows, so its vector of kVecWidth words (one per input, gathered) gives all 8 rows' codes.
// A vector within one run of group_size rows takes the run's zero and scale (broadcast, once
// per run); under desc_act (or across two runs) each lane's are gathered. The scalar build
// (and inputs past the last whole vector) widen one code at a time.
//
// Op: torch.ops.raylm.dequantize_int4_experts(qweight, qzeros, scales, g_idx, experts, bits,
// awq, zero_offset, group_size, dtype) -> [n, out, in].
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp (or a narrower ISA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"
#include "int4_checks.h"
#include "int4_codes.h"

namespace {

using namespace raylm;
using namespace raylm::int4;

constexpr int kLanes = kVecWidth;
// AWQ packs columns 0..7 of a word at nibbles (0, 2, 4, 6, 1, 3, 5, 7) (python:
// int4_linear.AWQ_PACK_ORDER): column j's nibble, and the column at each nibble.
constexpr int kAwqNibbleOfColumn[8] = {0, 4, 1, 5, 2, 6, 3, 7};
constexpr int kAwqColumnAtNibble[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// One stacked projection's tensors and shapes.
struct PackedExperts {
  const int32_t* qweight;
  const int32_t* qzeros;
  const float* scales;
  const int32_t* g_idx;  // nullptr: groups of group_size rows
  int64_t in, out, groups, group_size;
  int bits, zero_offset;
  bool awq;

  int pack() const { return 32 / bits; }
  int32_t mask() const { return (1 << bits) - 1; }
  int64_t group_of(int64_t e, int64_t k) const { return g_idx != nullptr ? g_idx[e * in + k] : k / group_size; }
};

// Column n's zero (plus zero_offset) and scale of every group of expert e.
void column_groups(const PackedExperts& w, int64_t e, int64_t n, float* zeros, float* scales) {
  const int shift = (w.awq ? kAwqNibbleOfColumn[n % 8] : n % w.pack()) * w.bits;
  const int64_t zero_columns = w.out / w.pack();
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint32_t word = static_cast<uint32_t>(w.qzeros[(e * w.groups + g) * zero_columns + n / w.pack()]);
    zeros[g] = static_cast<float>(static_cast<int32_t>((word >> shift) & w.mask()) + w.zero_offset);
    scales[g] = w.scales[(e * w.groups + g) * w.out + n];
  }
}

// The groups of one vector of kLanes inputs: all in run `run` of group_size rows, or each
// lane's own (`lanes`: under desc_act, or a vector across two runs).
struct VectorGroups {
  bool one_run;
  int64_t run;
  vwords lanes;

  // The lanes' zero and scale from a column's [groups] zeros and scales.
  void of(const float* zeros, const float* scales, vfloat& zero, vfloat& scale) const {
    if (one_run) {
      zero = vset1(zeros[run]);
      scale = vset1(scales[run]);
    } else {
      zero = gather_floats(zeros, lanes);
      scale = gather_floats(scales, lanes);
    }
  }
};

// Calls f(k0, groups) for the whole vectors of a row's inputs, k0 = 0, kLanes, ..., the runs
// of group_size rows followed without a division per vector (row_groups: the expert's g_idx
// row under desc_act, else nullptr); returns where the vectors end.
template <typename F>
int64_t for_each_vector(const PackedExperts& w, const int32_t* row_groups, F&& f) {
  int64_t k0 = 0;
  if (row_groups != nullptr) {
    for (; k0 + kLanes <= w.in; k0 += kLanes) f(k0, VectorGroups{false, 0, load_words(row_groups + k0)});
    return k0;
  }
  for (int64_t run = 0, start = 0; k0 + kLanes <= w.in; ++run, start += w.group_size) {
    const int64_t stop = std::min(start + w.group_size, w.in);
    for (; k0 + kLanes <= stop; k0 += kLanes) f(k0, VectorGroups{true, run, vwords{}});
    if (k0 < stop && k0 + kLanes <= w.in) {  // across runs
      alignas(64) int32_t lanes[kLanes];
      for (int l = 0; l < kLanes; ++l) lanes[l] = static_cast<int32_t>((k0 + l) / w.group_size);
      f(k0, VectorGroups{false, 0, load_words(lanes)});
      k0 += kLanes;
    }
  }
  return k0;
}

inline int32_t code_of(const PackedExperts& w, int64_t e, int64_t n, int64_t k) {
  uint32_t word;
  int shift;
  if (w.awq) {
    word = static_cast<uint32_t>(w.qweight[(e * w.in + k) * (w.out / 8) + n / 8]);
    shift = kAwqNibbleOfColumn[n % 8] * w.bits;
  } else {
    word = static_cast<uint32_t>(w.qweight[(e * (w.in / w.pack()) + k / w.pack()) * w.out + n]);
    shift = static_cast<int>(k % w.pack()) * w.bits;
  }
  return static_cast<int32_t>((word >> shift) & w.mask());
}

// Inputs [k0, in) of row n, one code at a time.
template <typename out_t>
void scalar_tail(const PackedExperts& w, int64_t e, int64_t n, int64_t k0, const float* zeros, const float* scales,
                 out_t* dst) {
  for (int64_t k = k0; k < w.in; ++k) {
    const int64_t g = w.group_of(e, k);
    store_scalar(dst + k, (static_cast<float>(code_of(w, e, n, k)) - zeros[g]) * scales[g]);
  }
}

// Whole vectors of inputs: the scalar build has none (its codes come one at a time).
constexpr bool kVectorCodes = kLanes > 1;

// Row n of GPTQ expert e into dst [in].
template <int kBits, typename out_t>
void gptq_row(const PackedExperts& w, int64_t e, int64_t n, float* zeros, float* scales, out_t* dst) {
  constexpr int pack = 32 / kBits;
  column_groups(w, e, n, zeros, scales);
  int64_t k0 = 0;
  if constexpr (kVectorCodes && kLanes % pack == 0) {
    alignas(64) int32_t offsets[kLanes], shifts[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      offsets[l] = static_cast<int32_t>((l / pack) * w.out);
      shifts[l] = (l % pack) * kBits;
    }
    const vwords lane_offsets = load_words(offsets), lane_shifts = load_words(shifts);
    const int32_t* column = w.qweight + e * (w.in / pack) * w.out + n;
    k0 = for_each_vector(w, w.g_idx == nullptr ? nullptr : w.g_idx + e * w.in, [&](int64_t k, VectorGroups groups) {
      const int32_t* words = column + (k / pack) * w.out;
      const vwords packed = kLanes == pack ? broadcast_word(*words) : gather_words(words, lane_offsets);
      vfloat zero, scale;
      groups.of(zeros, scales, zero, scale);
      vstore(dst + k, vmul(vsub(codes_shifted(packed, lane_shifts, (1 << kBits) - 1), zero), scale));
    });
  }
  scalar_tail(w, e, n, k0, zeros, scales, dst);
}

// The 8 rows of AWQ word column c of expert e into out_rows (row stride in). zeros and scales:
// [8][groups] each.
template <typename out_t>
void awq_rows(const PackedExperts& w, int64_t e, int64_t c, float* zeros, float* scales, out_t* out_rows) {
  for (int j = 0; j < 8; ++j) column_groups(w, e, 8 * c + j, zeros + j * w.groups, scales + j * w.groups);
  int64_t k0 = 0;
  if constexpr (kVectorCodes) {
    alignas(64) int32_t offsets[kLanes];
    for (int l = 0; l < kLanes; ++l) offsets[l] = static_cast<int32_t>(l * (w.out / 8));
    const vwords lane_offsets = load_words(offsets);
    const int32_t* column = w.qweight + e * w.in * (w.out / 8) + c;
    k0 = for_each_vector(w, w.g_idx == nullptr ? nullptr : w.g_idx + e * w.in, [&](int64_t k, VectorGroups groups) {
      const vwords packed = gather_words(column + k * (w.out / 8), lane_offsets);
      for_each_code<8>([&](auto nibble) {
        constexpr int i = decltype(nibble)::value;
        constexpr int j = kAwqColumnAtNibble[i];
        vfloat zero, scale;
        groups.of(zeros + j * w.groups, scales + j * w.groups, zero, scale);
        vstore(out_rows + j * w.in + k, vmul(vsub(codes_at<4 * i, 15>(packed), zero), scale));
      });
    });
  }
  for (int j = 0; j < 8; ++j)
    scalar_tail(w, e, 8 * c + j, k0, zeros + j * w.groups, scales + j * w.groups, out_rows + j * w.in);
}

template <typename out_t>
void dequantize_experts(const PackedExperts& w, const int64_t* experts, int64_t n, out_t* out) {
  // Work units: a GPTQ row, or an AWQ word column of 8 rows.
  const int64_t rows_per_unit = w.awq ? 8 : 1, units = w.out / rows_per_unit;
  at::parallel_for(0, n * units, w.awq ? 2 : 16, [&](int64_t begin, int64_t end) {
    std::vector<float> zeros(rows_per_unit * w.groups), scales(rows_per_unit * w.groups);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t i = index / units, unit = index % units;
      out_t* dst = out + (i * w.out + unit * rows_per_unit) * w.in;
      if (w.awq) {
        awq_rows(w, experts[i], unit, zeros.data(), scales.data(), dst);
      } else if (w.bits == 4) {
        gptq_row<4>(w, experts[i], unit, zeros.data(), scales.data(), dst);
      } else {
        gptq_row<8>(w, experts[i], unit, zeros.data(), scales.data(), dst);
      }
    }
  });
}

at::Tensor dequantize_int4_experts(const at::Tensor& qweight, const at::Tensor& qzeros, const at::Tensor& scales,
                                   const c10::optional<at::Tensor>& g_idx, const at::Tensor& experts, int64_t bits,
                                   bool awq, int64_t zero_offset, int64_t group_size, at::ScalarType dtype) {
  constexpr const char* op = "raylm::dequantize_int4_experts";
  const int64_t pack = checked_codes_per_word(op, bits, awq);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": dtype must be fp32 or bf16, got ", dtype);
  check_tensor(op, "scales", scales, at::kFloat, {kAnySize, kAnySize, kAnySize}, "[E, groups, out]");
  const int64_t num_experts = scales.size(0), groups = scales.size(1), out_features = scales.size(2);
  TORCH_CHECK(groups > 0 && out_features % pack == 0, op, ": scales [E, groups, out] must have groups > 0 and out a "
              "multiple of ", pack, ", got ", scales.sizes());
  if (awq) {
    check_tensor(op, "qweight", qweight, at::kInt, {num_experts, kAnySize, out_features / 8}, "AWQ [E, in, out / 8]");
  } else {
    check_tensor(op, "qweight", qweight, at::kInt, {num_experts, kAnySize, out_features}, "GPTQ [E, in / pack, out]");
  }
  const int64_t in_features = awq ? qweight.size(1) : qweight.size(1) * pack;
  check_tensor(op, "qzeros", qzeros, at::kInt, {num_experts, groups, out_features / pack}, "[E, groups, out / pack]");
  check_tensor(op, "experts", experts, at::kLong, {kAnySize}, "[n]");
  const int64_t n = experts.numel();
  const int64_t* ids = experts.data_ptr<int64_t>();
  check_indices(op, "experts", ids, n, num_experts);
  const int32_t* g_idx_data = nullptr;
  if (g_idx.has_value()) {
    check_tensor(op, "g_idx", *g_idx, at::kInt, {num_experts, in_features}, "[E, in]");
    g_idx_data = g_idx->data_ptr<int32_t>();
    // Only the chosen experts' rows are read: an out-of-range group would read outside the scales.
    for (int64_t i = 0; i < n; ++i)
      check_indices(op, "g_idx", g_idx_data + ids[i] * in_features, in_features, groups, ids[i]);
  } else {
    TORCH_CHECK(group_size > 0 && (in_features + group_size - 1) / group_size == groups, op,
                ": without g_idx, group_size must give the scales' ", groups, " groups of ", in_features,
                " rows, got ", group_size);
  }
  const PackedExperts w{qweight.data_ptr<int32_t>(), qzeros.data_ptr<int32_t>(), scales.data_ptr<float>(),
                        g_idx_data, in_features, out_features, groups, group_size, static_cast<int>(bits),
                        static_cast<int>(zero_offset), awq};
  at::Tensor out = at::empty({n, out_features, in_features}, scales.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantize_experts(w, ids, n, out.data_ptr<float>());
  } else {
    dequantize_experts(w, ids, n, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("dequantize_int4_experts(Tensor qweight, Tensor qzeros, Tensor scales, Tensor? g_idx, Tensor experts, "
        "int bits, bool awq, int zero_offset, int group_size, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("dequantize_int4_experts", &dequantize_int4_experts); }
