// Fused Mixture-of-Experts on the CPU: every expert's gated MLP over the tokens routed to it,
// weighted by the router and summed per token, in one call.
//
// The (token, k) assignments are counting-sorted by expert, so each expert's tokens form one
// contiguous group; each expert's gate/up GEMM (SiLU-and-mul applied as the products are
// stored) and its down GEMM run over its group only. No Python runs between experts: a MoE
// layer costs one op call whatever its number of experts.
//
// Two GEMM paths, the same grouping:
//   avx512_fused_moe: the AVX-512 panel kernels of csrc/cpu_gemm_avx512.cpp on weights packed
//     per expert (gate_up by avx512_pack_gated_weight, down by avx512_pack_weight, stacked
//     [E, panels, steps, 256 bytes]). Work items are (expert, panel) pairs of all experts at
//     once, split over the threads, so a decode step's many small groups keep every core busy
//     with one fork-join per GEMM rather than one per expert.
//   dense_fused_moe: ATen's GEMM (oneDNN / BLAS) per expert group on the weights as loaded,
//     [E, 2I, H] and [E, H, I], for CPUs without AVX-512 and dtypes the panels do not take.
// Both compute in fp32 from the routing weights on: each assignment's down projection is
// scaled in fp32 and a token's k contributions are summed in fp32, then rounded once.
//
// Expert parallelism: expert_map [E_global] gives each global expert id its row in this
// rank's weights, or -1 for experts another rank holds, whose assignments are skipped (the
// caller all-reduces the ranks' partial sums).
//
// Ops: torch.ops.raylm.avx512_fused_moe_available(dtype), avx512_fused_moe(x, w13_packed,
// w2_packed, topk_weights, topk_ids, expert_map, intermediate_size), dense_fused_moe(x, w13,
// w2, topk_weights, topk_ids, expert_map, w13_bias=None, w2_bias=None, swiglu_limit=0,
// swiglu_alpha=1.702). dense_fused_moe also runs gpt-oss's experts: biases w13_bias [E, 2I] and
// w2_bias [E, H] added to each expert's products, and with swiglu_limit > 0 its clamped SwiGLU
// ((up + 1) * gate * sigmoid(alpha * gate), gate clamped above at the limit, up to
// [-limit, limit]) in place of SiLU-and-mul.
//
// dequantize_fp8_experts(weight, experts, scale, row_group, column_group, dtype): FP8 experts
// (kernels/fp8_fused_moe.py) widened for those kernels, one pass over the bytes: element
// (r, c) of expert e is fp8(weight[e, r, c]) * scale[e, r / row_group, c / column_group],
// computed in fp32 and rounded once to fp32 or bf16 (per-row scales: groups of 1 row and
// every column; block scales: the block's rows and columns).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_gemm_avx512_panels.h"
#include "cpu_vec.h"

namespace {

using namespace raylm;
using namespace raylm::panels;

// The assignments grouped by expert: group e holds sorted positions [offsets[e], offsets[e+1]),
// `assignment` maps a sorted position to its flat (token * top_k + k) index, `position` the
// other way (-1: routed to an expert this rank does not hold).
struct ExpertGroups {
  std::vector<int64_t> offsets;
  std::vector<int64_t> assignment;
  std::vector<int64_t> position;

  int64_t count(int64_t e) const { return offsets[e + 1] - offsets[e]; }
  int64_t total() const { return offsets.back(); }
};

ExpertGroups group_by_expert(const char* op, const at::Tensor& topk_ids_in, const c10::optional<at::Tensor>& expert_map_in,
                             int64_t num_local_experts) {
  const at::Tensor topk_ids = topk_ids_in.to(at::kLong).contiguous();
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const int64_t n = topk_ids.numel();
  std::vector<int64_t> local(n);
  if (expert_map_in.has_value()) {
    const at::Tensor expert_map = expert_map_in->to(at::kLong).contiguous();
    const int64_t* map = expert_map.data_ptr<int64_t>();
    const int64_t num_global = expert_map.numel();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < num_global, "raylm::", op, ": topk_ids holds expert ", ids[i],
                  ", outside [0, ", num_global, ")");
      local[i] = map[ids[i]];
      TORCH_CHECK(local[i] >= -1 && local[i] < num_local_experts, "raylm::", op, ": expert_map maps expert ", ids[i],
                  " to ", local[i], ", outside [-1, ", num_local_experts, ")");
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < num_local_experts, "raylm::", op, ": topk_ids holds expert ", ids[i],
                  ", outside [0, ", num_local_experts, ")");
      local[i] = ids[i];
    }
  }
  ExpertGroups groups;
  groups.offsets.assign(num_local_experts + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (local[i] >= 0) ++groups.offsets[local[i] + 1];
  }
  for (int64_t e = 0; e < num_local_experts; ++e) groups.offsets[e + 1] += groups.offsets[e];
  groups.assignment.resize(groups.total());
  groups.position.assign(n, -1);
  std::vector<int64_t> next(groups.offsets.begin(), groups.offsets.end() - 1);
  for (int64_t i = 0; i < n; ++i) {  // stable: a group keeps its tokens in order
    if (local[i] < 0) continue;
    const int64_t p = next[local[i]]++;
    groups.assignment[p] = i;
    groups.position[i] = p;
  }
  return groups;
}

void check_routing(const char* op, const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "raylm::", op, " takes CPU activations [T, hidden]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && !c10::isFloatingType(topk_ids.scalar_type()),
              "raylm::", op, ": topk_ids must be integer [T, top_k] with T = ", x.size(0));
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat,
              "raylm::", op, ": topk_weights must be fp32 of topk_ids' shape");
}

// out[t] = sum over k of contributions[position[t * top_k + k]] (fp32 rows of `hidden`),
// rounded once to out's dtype; a token with no assignment here gets zeros.
template <typename T>
void sum_contributions(const float* contributions, const ExpertGroups& groups, int64_t num_tokens, int64_t top_k,
                       int64_t hidden, T* out) {
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t p = groups.position[t * top_k + k];
        if (p < 0) continue;
        const float* row = contributions + p * hidden;
        for (int64_t h = 0; h < hidden; ++h) sum[h] += row[h];
      }
      for (int64_t h = 0; h < hidden; ++h) store_scalar(out + t * hidden + h, sum[h]);
    }
  });
}

#if RAYLM_AVX512_FP32
// out[0:cols] = c[0:cols] * scale, in fp32 (a down projection's panel, weighted by the router).
inline void store_scaled_row(const float* c, float scale, int64_t cols, float* out) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int j = 0; j < 4; ++j) {
    const int64_t left = std::clamp<int64_t>(cols - 16 * j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
    _mm512_mask_storeu_ps(out + 16 * j, mask, _mm512_mul_ps(_mm512_loadu_ps(c + 16 * j), s));
  }
}

// One grouped GEMM: for every (expert with tokens, panel) item, the expert's rows of `in`
// (contiguous from its group's offset, in_stride apart) times that panel of its packed weight,
// handed to store(group_row, panel, c) row by row. Items are split over the threads.
template <typename T, typename Store>
void grouped_panels(const ExpertGroups& groups, const T* in, int64_t in_stride, const T* packed, int64_t n_panels,
                    int64_t steps, Store store) {
  constexpr int64_t kStepElements = kStepBytes / sizeof(T);
  const int64_t panel_elements = steps * kStepElements;
  const int64_t num_experts = static_cast<int64_t>(groups.offsets.size()) - 1;
  std::vector<int64_t> items;  // expert * n_panels + panel
  int64_t max_rows = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (groups.count(e) == 0) continue;
    max_rows = std::max(max_rows, groups.count(e));
    for (int64_t p = 0; p < n_panels; ++p) items.push_back(e * n_panels + p);
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(max_rows * kPanelN);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = items[i] / n_panels, p = items[i] % n_panels;
      const T* panel = packed + items[i] * panel_elements;
      const T* next = i + 1 < end ? packed + items[i + 1] * panel_elements : nullptr;
      const int64_t rows = groups.count(e), first_row = groups.offsets[e];
      multiply_panel<T>(in + first_row * in_stride, in_stride, rows, steps, panel, next, i == begin, c.data());
      for (int64_t m = 0; m < rows; ++m) store(first_row + m, p, c.data() + m * kPanelN);
    }
  });
}

template <typename T>
void fused_moe_panels(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const float* weights,
                      const ExpertGroups& groups, int64_t top_k, int64_t intermediate, at::Tensor& out) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  const int64_t num_tokens = x.size(0), hidden = x.size(1), rows = groups.total();
  // The panels read k pairs in bf16: rows padded to an even length with a zero.
  const int64_t x_stride = kBf16 ? round_up(hidden, 2) : hidden;
  const int64_t act_stride = kBf16 ? round_up(intermediate, 2) : intermediate;
  at::Tensor xs = at::empty({rows, x_stride}, x.options());
  at::Tensor act = at::empty({rows, act_stride}, x.options());
  at::Tensor contributions = at::empty({rows, hidden}, x.options().dtype(at::kFloat));
  const T* x_data = static_cast<const T*>(x.data_ptr());
  T* xs_data = static_cast<T*>(xs.data_ptr());
  T* act_data = static_cast<T*>(act.data_ptr());
  float* contributions_data = contributions.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      std::memcpy(xs_data + r * x_stride, x_data + groups.assignment[r] / top_k * hidden, hidden * sizeof(T));
      if (x_stride != hidden) xs_data[r * x_stride + hidden] = T{};
      if (act_stride != intermediate) act_data[r * act_stride + intermediate] = T{};
    }
  });
  // gate_up with SiLU-and-mul: a gated panel holds 32 outputs of the activation.
  const int64_t half = kPanelN / 2;
  grouped_panels<T>(groups, xs_data, x_stride, static_cast<const T*>(w13.data_ptr()), w13.size(1), w13.size(2),
                    [&](int64_t r, int64_t p, const float* c) {
                      store_silu_mul_row(c, std::min(half, intermediate - p * half), act_data + r * act_stride + p * half);
                    });
  grouped_panels<T>(groups, act_data, act_stride, static_cast<const T*>(w2.data_ptr()), w2.size(1), w2.size(2),
                    [&](int64_t r, int64_t p, const float* c) {
                      store_scaled_row(c, weights[groups.assignment[r]], std::min(kPanelN, hidden - p * kPanelN),
                                       contributions_data + r * hidden + p * kPanelN);
                    });
  sum_contributions<T>(contributions_data, groups, num_tokens, top_k, hidden, static_cast<T*>(out.data_ptr()));
}
#endif  // RAYLM_AVX512_FP32

bool avx512_fused_moe_available(at::ScalarType dtype) {
  if (dtype == at::kFloat) return RAYLM_AVX512_FP32;
  if (dtype == at::kBFloat16) return RAYLM_AVX512_BF16;
  return false;
}

// x [T, H] fp32 or bf16; w13_packed [E, P13, S13, 256 bytes] (each expert's gate_up [2I, H]
// packed by avx512_pack_gated_weight), w2_packed [E, P2, S2, 256 bytes] (each down [H, I] by
// avx512_pack_weight), of x's dtype; topk_weights [T, k] fp32, topk_ids [T, k] integer,
// expert_map [E_global] or None (ids are rows of the weights). Returns [T, H] in x's dtype.
at::Tensor avx512_fused_moe(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights_in, const at::Tensor& topk_ids,
                            const c10::optional<at::Tensor>& expert_map, int64_t intermediate) {
  const char* op = "avx512_fused_moe";
  check_routing(op, x_in, topk_weights_in, topk_ids);
  const at::ScalarType dtype = x_in.scalar_type();
  TORCH_CHECK(avx512_fused_moe_available(dtype), "raylm::", op, ": this build or CPU has no AVX-512 kernel for ", dtype);
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t hidden = x_in.size(1), step_elements = kStepBytes / x_in.element_size();
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(0) == w2.size(0) && w13.scalar_type() == dtype &&
                  w2.scalar_type() == dtype && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.size(1) == round_up(intermediate, kPanelN / 2) / (kPanelN / 2) &&
                  w13.size(2) == steps_of(hidden, bf16) && w13.size(3) == step_elements &&
                  w2.size(1) == round_up(hidden, kPanelN) / kPanelN && w2.size(2) == steps_of(intermediate, bf16) &&
                  w2.size(3) == step_elements,
              "raylm::", op, ": the packed expert weights do not match hidden = ", hidden, ", intermediate = ",
              intermediate, " and ", dtype);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor topk_weights = topk_weights_in.contiguous();
  at::Tensor out = at::empty({x.size(0), hidden}, x.options());
  if (x.size(0) == 0) return out;
  const ExpertGroups groups = group_by_expert(op, topk_ids, expert_map, w13.size(0));
#if RAYLM_AVX512_FP32
  if (bf16) {
#if RAYLM_AVX512_BF16
    fused_moe_panels<uint16_t>(x, w13, w2, topk_weights.data_ptr<float>(), groups, topk_ids.size(1), intermediate, out);
#endif
  } else {
    fused_moe_panels<float>(x, w13, w2, topk_weights.data_ptr<float>(), groups, topk_ids.size(1), intermediate, out);
  }
#endif
  return out;
}

// The same on the weights as loaded, w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]
// of x's dtype, with ATen's GEMM per expert group: any dtype, any CPU.
at::Tensor dense_fused_moe(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                           const at::Tensor& topk_weights_in, const at::Tensor& topk_ids,
                           const c10::optional<at::Tensor>& expert_map, const c10::optional<at::Tensor>& w13_bias,
                           const c10::optional<at::Tensor>& w2_bias, double swiglu_limit, double swiglu_alpha) {
  const char* op = "dense_fused_moe";
  check_routing(op, x_in, topk_weights_in, topk_ids);
  const int64_t hidden = x_in.size(1);
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.size(2) == hidden &&
                  w2.size(1) == hidden && w13.size(1) == 2 * w2.size(2) && w13.scalar_type() == x_in.scalar_type() &&
                  w2.scalar_type() == x_in.scalar_type(),
              "raylm::", op, ": weights must be w13 [E, 2I, ", hidden, "] and w2 [E, ", hidden, ", I] of x's dtype");
  TORCH_CHECK(!w13_bias.has_value() || (w13_bias->dim() == 2 && w13_bias->size(0) == w13.size(0) &&
                                         w13_bias->size(1) == w13.size(1)),
              "raylm::", op, ": w13_bias must be [E, 2I] as w13's rows");
  TORCH_CHECK(!w2_bias.has_value() || (w2_bias->dim() == 2 && w2_bias->size(0) == w2.size(0) &&
                                        w2_bias->size(1) == hidden),
              "raylm::", op, ": w2_bias must be [E, ", hidden, "]");
  TORCH_CHECK(swiglu_limit >= 0.0, "raylm::", op, ": swiglu_limit must be >= 0 (0: SiLU-and-mul)");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor topk_weights = topk_weights_in.contiguous();
  const int64_t top_k = topk_ids.size(1), intermediate = w2.size(2);
  at::Tensor out = at::empty({x.size(0), hidden}, x.options());
  if (x.size(0) == 0) return out;
  const ExpertGroups groups = group_by_expert(op, topk_ids, expert_map, w13.size(0));
  at::Tensor token_rows = at::empty({groups.total()}, x.options().dtype(at::kLong));
  at::Tensor row_weights = at::empty({groups.total(), 1}, x.options().dtype(at::kFloat));
  for (int64_t r = 0; r < groups.total(); ++r) {
    token_rows.data_ptr<int64_t>()[r] = groups.assignment[r] / top_k;
    row_weights.data_ptr<float>()[r] = topk_weights.data_ptr<float>()[groups.assignment[r]];
  }
  const at::Tensor xs = x.index_select(0, token_rows);
  at::Tensor contributions = at::empty({groups.total(), hidden}, x.options().dtype(at::kFloat));
  for (int64_t e = 0; e < w13.size(0); ++e) {
    if (groups.count(e) == 0) continue;
    const int64_t first = groups.offsets[e], rows = groups.count(e);
    const at::Tensor gate_up = w13_bias.has_value() ? at::linear(xs.narrow(0, first, rows), w13[e], (*w13_bias)[e])
                                                    : at::linear(xs.narrow(0, first, rows), w13[e]);
    const at::Tensor gate = gate_up.narrow(1, 0, intermediate), up = gate_up.narrow(1, intermediate, intermediate);
    at::Tensor activation;
    if (swiglu_limit > 0.0) {  // gpt-oss, in Hugging Face's order of operations
      const at::Tensor clamped_gate = at::clamp(gate, c10::nullopt, swiglu_limit);
      const at::Tensor glu = clamped_gate.mul(at::sigmoid(clamped_gate.mul(swiglu_alpha)));
      activation = at::clamp(up, -swiglu_limit, swiglu_limit).add(1).mul(glu);
    } else {
      activation = at::silu(gate).mul_(up);
    }
    const at::Tensor down = w2_bias.has_value() ? at::linear(activation, w2[e], (*w2_bias)[e]) : at::linear(activation, w2[e]);
    contributions.narrow(0, first, rows).copy_(down.to(at::kFloat).mul_(row_weights.narrow(0, first, rows)));
  }
  // Each token's k contributions summed in fp32, in k's order (zeros where none is here).
  at::Tensor by_assignment = at::zeros({x.size(0) * top_k, hidden}, contributions.options());
  by_assignment.index_copy_(0, at::tensor(groups.assignment, x.options().dtype(at::kLong)), contributions);
  out.copy_(by_assignment.view({x.size(0), top_k, hidden}).sum(1));
  return out;
}

template <typename out_t>
void dequantize_fp8_rows(const uint8_t* codes, const int64_t* experts, const float* scale, out_t* out, int64_t n,
                         int64_t rows, int64_t columns, int64_t scale_rows, int64_t scale_columns, int64_t row_group,
                         int64_t column_group) {
  float lut[256];  // every e4m3 code's value, exact in fp32
  for (int code = 0; code < 256; ++code) lut[code] = raylm::to_float(raylm::fp8_e4m3{static_cast<uint8_t>(code)});
  at::parallel_for(0, n * rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t i = index / rows, r = index % rows, e = experts[i];
      const uint8_t* src = codes + (e * rows + r) * columns;
      const float* row_scale = scale + (e * scale_rows + r / row_group) * scale_columns;
      out_t* dst = out + index * columns;
      for (int64_t g = 0; g < scale_columns; ++g) {
        const float s = row_scale[g];
        const raylm::vfloat vs = raylm::vset1(s);
        const int64_t stop = std::min(columns, (g + 1) * column_group);
        int64_t c = g * column_group;
        // Widened in registers (exactly, NaN codes NaN), as the fp8 KV cache's loads are.
        for (; c + raylm::kVecWidth <= stop; c += raylm::kVecWidth) {
          raylm::vstore(dst + c, raylm::vmul(raylm::vload(reinterpret_cast<const raylm::fp8_e4m3*>(src + c)), vs));
        }
        for (; c < stop; ++c) raylm::store_scalar(dst + c, lut[src[c]] * s);
      }
    }
  });
}

at::Tensor dequantize_fp8_experts(const at::Tensor& weight, const at::Tensor& experts, const at::Tensor& scale,
                                  int64_t row_group, int64_t column_group, at::ScalarType dtype) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 3 &&
                  weight.is_contiguous(), "raylm::dequantize_fp8_experts: weight must be a contiguous uint8 [E, R, C] "
              "CPU tensor (the fp8 bytes)");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 1 && experts.is_contiguous(),
              "raylm::dequantize_fp8_experts: experts must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "raylm::dequantize_fp8_experts: dtype must be fp32 or bf16");
  const int64_t num_experts = weight.size(0), rows = weight.size(1), columns = weight.size(2);
  TORCH_CHECK(row_group > 0 && column_group > 0, "raylm::dequantize_fp8_experts: groups must be positive");
  const int64_t scale_rows = (rows + row_group - 1) / row_group;
  const int64_t scale_columns = (columns + column_group - 1) / column_group;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 3 &&
                  scale.size(0) == num_experts && scale.size(1) == scale_rows && scale.size(2) == scale_columns,
              "raylm::dequantize_fp8_experts: scale must be a contiguous fp32 [E, ceil(R / row_group), "
              "ceil(C / column_group)] tensor");
  const int64_t n = experts.numel();
  const int64_t* ids = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < num_experts, "raylm::dequantize_fp8_experts: expert ", ids[i],
                      " is outside the weight's ", num_experts, " experts");
  }
  at::Tensor out = at::empty({n, rows, columns}, weight.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantize_fp8_rows(weight.data_ptr<uint8_t>(), ids, scale.data_ptr<float>(), out.data_ptr<float>(), n, rows,
                        columns, scale_rows, scale_columns, row_group, column_group);
  } else {
    dequantize_fp8_rows(weight.data_ptr<uint8_t>(), ids, scale.data_ptr<float>(),
                        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, rows, columns, scale_rows,
                        scale_columns, row_group, column_group);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("avx512_fused_moe_available(ScalarType dtype) -> bool", &avx512_fused_moe_available);  // no tensors: one kernel
  m.def("avx512_fused_moe(Tensor x, Tensor w13_packed, Tensor w2_packed, Tensor topk_weights, Tensor topk_ids, "
        "Tensor? expert_map, int intermediate_size) -> Tensor");
  m.def("dense_fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, Tensor? expert_map, "
        "Tensor? w13_bias=None, Tensor? w2_bias=None, float swiglu_limit=0.0, float swiglu_alpha=1.702) -> Tensor");
  m.def("dequantize_fp8_experts(Tensor weight, Tensor experts, Tensor scale, int row_group, int column_group, "
        "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("avx512_fused_moe", &avx512_fused_moe);
  m.impl("dense_fused_moe", &dense_fused_moe);
  m.impl("dequantize_fp8_experts", &dequantize_fp8_experts);
}
