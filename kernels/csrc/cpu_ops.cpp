// The small per-layer ops of a decoder on the CPU, fused: RMSNorm with its residual add,
// SiLU-and-multiply, rotary embedding in place, and the KV-cache write. In PyTorch each is
// several elementwise ops, each a pass over memory plus dispatch overhead, which at decode
// batch sizes costs more than the arithmetic; here each is one pass. Tensors are fp32 or bf16
// (uint16_t here), computed in fp32 and rounded once to the output's dtype. Rows are split
// across threads only when there are enough of them to pay for waking the threads.
//
// The ops are PyTorch operators (`torch.ops.raylm.*`, registered below), so the dispatcher
// calls them with no Python in between and the profiler names them.
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp (or a narrower ISA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_vec.h"
#include "huge_pages.h"

namespace {

using namespace raylm;
using bf16 = uint16_t;

// Rows per thread chunk so that a chunk holds at least ~16K elements.
int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements)); }

// out = x / sqrt(mean(x^2) + eps) * weight for one row of n, accumulated in fp32 as in
// Hugging Face's LlamaRMSNorm. out may be x.
template <typename out_t, typename in_t, typename weight_t>
inline void rms_norm_row(out_t* out, const in_t* x, const weight_t* weight, int64_t n, float eps) {
  vfloat acc = vset1(0.0f);
  int64_t i = 0;
  for (; i + kVecWidth <= n; i += kVecWidth) {
    const vfloat v = vload(x + i);
    acc = vfmadd(v, v, acc);
  }
  float sum_squares = vsum(acc);
  for (; i < n; ++i) sum_squares += to_float(x[i]) * to_float(x[i]);
  const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
  const vfloat scale = vset1(inv_rms);
  for (i = 0; i + kVecWidth <= n; i += kVecWidth) vstore(out + i, vmul(vmul(vload(x + i), scale), vload(weight + i)));
  for (; i < n; ++i) store_scalar(out + i, to_float(x[i]) * inv_rms * to_float(weight[i]));
}

template <typename scalar_t, typename weight_t>
void fused_add_rms_norm_kernel(scalar_t* x, scalar_t* residual, const weight_t* weight, int64_t T, int64_t H,
                               float eps) {
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* xr = x + t * H;
      scalar_t* rr = residual + t * H;
      // The sum is rounded to the residual's dtype before it is normalised, as in PyTorch.
      int64_t i = 0;
      for (; i + kVecWidth <= H; i += kVecWidth) vstore(rr + i, vadd(vload(rr + i), vload(xr + i)));
      for (; i < H; ++i) store_scalar(rr + i, to_float(rr[i]) + to_float(xr[i]));
      rms_norm_row(xr, rr, weight, H, eps);
    }
  });
}

template <typename scalar_t, typename weight_t>
void rms_norm_kernel(scalar_t* out, const scalar_t* x, const weight_t* weight, int64_t T, int64_t H, float eps) {
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(out + t * H, x + t * H, weight, H, eps);
  });
}

template <typename scalar_t>
void silu_and_mul_kernel(scalar_t* out, const scalar_t* x, int64_t T, int64_t d) {
  at::parallel_for(0, T, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* gate = x + t * 2 * d;
      const scalar_t* up = gate + d;
      scalar_t* o = out + t * d;
      int64_t i = 0;
      for (; i + kVecWidth <= d; i += kVecWidth) vstore(o + i, vmul(vsilu(vload(gate + i)), vload(up + i)));
      for (; i < d; ++i) {
        const float g = to_float(gate[i]);
        store_scalar(o + i, g / (1.0f + std::exp(-g)) * to_float(up[i]));
      }
    }
  });
}

// Rotates, in place, the first rot_dim channels of each of the num_heads heads (head_size
// apart) of each of the T rows of x (row_stride apart) by the row's position, in the
// GPT-NeoX layout Llama uses: channel i pairs with i + rot_dim / 2. cos_sin holds, per
// position, rot_dim / 2 cosines then rot_dim / 2 sines.
template <typename scalar_t, typename table_t>
void rotary_embedding_kernel(scalar_t* x, int64_t row_stride, const int64_t* positions, const table_t* cos_sin,
                             int64_t T, int64_t num_heads, int64_t head_size, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  at::parallel_for(0, T, grain_rows(num_heads * head_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const table_t* cos = cos_sin + positions[t] * rot_dim;
      const table_t* sin = cos + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* x1 = x + t * row_stride + h * head_size;
        scalar_t* x2 = x1 + half;
        int64_t i = 0;
        for (; i + kVecWidth <= half; i += kVecWidth) {
          const vfloat a = vload(x1 + i), b = vload(x2 + i), c = vload(cos + i), s = vload(sin + i);
          vstore(x1 + i, vsub(vmul(a, c), vmul(b, s)));
          vstore(x2 + i, vfmadd(a, s, vmul(b, c)));
        }
        for (; i < half; ++i) {
          const float a = to_float(x1[i]), b = to_float(x2[i]), c = to_float(cos[i]), s = to_float(sin[i]);
          store_scalar(x1 + i, a * c - b * s);
          store_scalar(x2 + i, b * c + a * s);
        }
      }
    }
  });
}

// ---- The operators: checks, dtype dispatch, the calls above ----

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

void check_cpu(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu(), "raylm::", op, " takes CPU tensors, got one on ", t->device());
  }
}

// Calls f(scalar_t*, weight_t*) with x's and weight's types (each fp32 or bf16).
template <typename F>
void dispatch_two(const char* op, const at::Tensor& x, const at::Tensor& weight, F&& f) {
  TORCH_CHECK(is_float_or_bf16(x) && is_float_or_bf16(weight), "raylm::", op, " takes fp32 or bf16 tensors, got ",
              x.scalar_type(), " and ", weight.scalar_type());
  const bool x_bf16 = x.scalar_type() == at::kBFloat16, w_bf16 = weight.scalar_type() == at::kBFloat16;
  if (x_bf16 && w_bf16) return f(static_cast<bf16*>(nullptr), static_cast<bf16*>(nullptr));
  if (x_bf16) return f(static_cast<bf16*>(nullptr), static_cast<float*>(nullptr));
  if (w_bf16) return f(static_cast<float*>(nullptr), static_cast<bf16*>(nullptr));
  f(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// residual += x; x = rms_norm(residual) * weight, over the last dimension, in place.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_cpu("fused_add_rms_norm", {&x, &residual, &weight});
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.scalar_type() == residual.scalar_type() && x.dim() >= 1 && weight.numel() == x.size(-1),
              "raylm::fused_add_rms_norm takes contiguous x and residual of one shape and dtype, and a weight of "
              "their last dimension");
  const int64_t H = x.size(-1), T = H ? x.numel() / H : 0;
  dispatch_two("fused_add_rms_norm", x, weight, [&](auto* s, auto* w) {
    using scalar_t = std::remove_pointer_t<decltype(s)>;
    using weight_t = std::remove_pointer_t<decltype(w)>;
    fused_add_rms_norm_kernel(ptr<scalar_t>(x), ptr<scalar_t>(residual), ptr<const weight_t>(weight), T, H,
                              static_cast<float>(eps));
  });
}

// rms_norm(x) * weight over the last dimension, in a new tensor.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  check_cpu("rms_norm", {&x_in, &weight});
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(weight.is_contiguous() && x.dim() >= 1 && weight.numel() == x.size(-1),
              "raylm::rms_norm takes a contiguous weight of x's last dimension");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t H = x.size(-1), T = H ? x.numel() / H : 0;
  dispatch_two("rms_norm", x, weight, [&](auto* s, auto* w) {
    using scalar_t = std::remove_pointer_t<decltype(s)>;
    using weight_t = std::remove_pointer_t<decltype(w)>;
    rms_norm_kernel(ptr<scalar_t>(out), ptr<const scalar_t>(x), ptr<const weight_t>(weight), T, H,
                    static_cast<float>(eps));
  });
  return out;
}

// silu(x[..., :d]) * x[..., d:] for x [..., 2d], in a new tensor.
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  check_cpu("silu_and_mul", {&x_in});
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "raylm::silu_and_mul takes x [..., 2d]");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  const int64_t d = shape.back() / 2;
  shape.back() = d;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t T = d ? x.numel() / (2 * d) : 0;
  dispatch_two("silu_and_mul", x, x, [&](auto* s, auto*) {
    using scalar_t = std::remove_pointer_t<decltype(s)>;
    silu_and_mul_kernel(ptr<scalar_t>(out), ptr<const scalar_t>(x), T, d);
  });
  return out;
}

// Rotates x [T, H * head_size] in place; x's rows may be strided (a column slice of qkv).
void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin_cache, int64_t head_size,
                      int64_t rotary_dim) {
  check_cpu("rotary_embedding", {&x, &positions, &cos_sin_cache});
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && head_size > 0 && x.size(1) % head_size == 0,
              "raylm::rotary_embedding takes x [T, H * head_size] with unit column stride");
  TORCH_CHECK(cos_sin_cache.is_contiguous() && cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == rotary_dim &&
                  rotary_dim % 2 == 0 && rotary_dim <= head_size,
              "raylm::rotary_embedding takes a contiguous cos_sin_cache [max_position, rotary_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "raylm::rotary_embedding takes contiguous int64 positions, one per row of x");
  const int64_t* pos = ptr<const int64_t>(positions);
  const int64_t table_rows = cos_sin_cache.size(0);
  for (int64_t t = 0; t < positions.numel(); ++t) {
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < table_rows, "position ", pos[t], " is beyond the rotary table's ",
                      table_rows, " positions.");
  }
  dispatch_two("rotary_embedding", x, cos_sin_cache, [&](auto* s, auto* c) {
    using scalar_t = std::remove_pointer_t<decltype(s)>;
    using table_t = std::remove_pointer_t<decltype(c)>;
    rotary_embedding_kernel(ptr<scalar_t>(x), x.stride(0), pos, ptr<const table_t>(cos_sin_cache), x.size(0),
                            x.size(1) / head_size, head_size, rotary_dim);
  });
}

// Stores key, value [T, Hkv, D] (rows may be strided) at their flat slots of the caches
// [num_blocks, block_size, Hkv, D]; slot -1 skips a row. A slot out of range is a ValueError
// and nothing is written.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  check_cpu("write_kv_cache", {&key, &value, &k_cache, &v_cache, &slot_mapping});
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "raylm::write_kv_cache takes contiguous caches [num_blocks, block_size, Hkv, D] of one shape");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && is_float_or_bf16(k_cache),
              "raylm::write_kv_cache takes keys, values and caches of one dtype, fp32 or bf16");
  const int64_t rows = key.size(0);
  const int64_t row_size = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(key.numel() == rows * row_size && value.numel() == rows * row_size && value.size(0) == rows,
              "raylm::write_kv_cache takes key and value [T, Hkv, D] matching the caches");
  // A row's Hkv * D elements must be one run of memory (heads and channels contiguous).
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "raylm::write_kv_cache takes key and value rows whose heads are contiguous");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == rows,
              "raylm::write_kv_cache takes contiguous int64 slot_mapping, one per row");
  const int64_t* slots = ptr<const int64_t>(slot_mapping);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK_VALUE(slots[t] >= -1 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                      " is outside the KV cache's ", num_slots, " slots.");
  }
  const int64_t element = k_cache.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < rows; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(kc + slots[t] * row_size * element, k + t * key.stride(0) * element, row_size * element);
    std::memcpy(vc + slots[t] * row_size * element, v + t * value.stride(0) * element, row_size * element);
  }
}

// One draw from softmax(logits / temperature) by inverse CDF, for one row of V logits: the
// first token whose running sum of exp((logit - max) / temperature) exceeds u times the
// total (u in [0, 1)). scratch holds V floats. What the sampler's PyTorch path computes as
// div, softmax, cumsum and searchsorted (four passes and as many tensors), in two passes:
// ~0.3 ms of a ~100M-Llama decode step of 64 rows x 4096 logits on 2 cores. Tokens of zero
// weight (-inf logits) are never drawn: the running sum does not grow at them.
// A row's largest logit, and whether the row can be drawn from: it holds no NaN and has a
// finite maximum.
struct RowMax {
  float max;
  bool holds_nan;
  bool drawable() const { return !holds_nan && std::isfinite(max); }
};

RowMax row_max(const float* logits, int64_t V) {
  // The sum is there to see NaNs: vmax drops a NaN lane on some ISAs, an add never does.
  vfloat max_v = vset1(-std::numeric_limits<float>::infinity()), sum_logits_v = vset1(0.0f);
  int64_t i = 0;
  for (; i + kVecWidth <= V; i += kVecWidth) {
    const vfloat x = vload(logits + i);
    max_v = vmax(max_v, x);
    sum_logits_v = vadd(sum_logits_v, x);
  }
  float max = vmax_all(max_v), sum_logits = vsum(sum_logits_v);
  for (; i < V; ++i) {
    max = std::max(max, logits[i]);
    sum_logits += logits[i];
  }
  return RowMax{max, std::isnan(sum_logits)};
}

// The token drawn for a row with no distribution to draw from (a NaN, or no finite logit:
// weights or an adapter that overflowed, a penalty that pushed a logit to +inf). The caller
// fails that row's request alone; one bad row must not stop the batch.
constexpr int64_t kUndrawable = -1;

// The weights exp((logit - max) / temperature) of one row into scratch; returns their sum.
// The row's maximum has weight 1.
float row_weights(const float* logits, int64_t V, float max, float temperature, float* scratch) {
  // exp(x / T) = 2^(x log2(e) / T); (logit - max) <= 0, so the exponent is too.
  const vfloat scale = vset1(1.44269504088896341f / temperature), max_b = vset1(max);
  vfloat sum_v = vset1(0.0f);
  int64_t i = 0;
  for (; i + kVecWidth <= V; i += kVecWidth) {
    const vfloat weight = vexp2_nonpositive(vmul(vsub(vload(logits + i), max_b), scale));
    vstore(scratch + i, weight);
    sum_v = vadd(sum_v, weight);
  }
  float total = vsum(sum_v);
  for (; i < V; ++i) {
    scratch[i] = exp2_nonpositive((logits[i] - max) * (1.44269504088896341f / temperature));
    total += scratch[i];
  }
  return total;
}

// Inverse CDF over non-negative weights of sum total: the first token whose running sum
// exceeds u times the total (u in [0, 1)). Tokens of weight 0 are never drawn.
int64_t draw_from_weights(const float* weights, int64_t V, float total, float u) {
  const float target = u * total;
  // Whole vectors while their sum stays at or under the target, then token by token.
  float running = 0.0f;
  int64_t i = 0;
  for (; i + kVecWidth <= V; i += kVecWidth) {
    const float chunk = vsum(vload(weights + i));
    if (running + chunk > target) break;
    running += chunk;
  }
  for (; i < V; ++i) {
    running += weights[i];
    if (running > target) return i;
  }
  // The sums of two passes may round differently: with u just under 1 the scan can end at
  // or under the target. The last token of nonzero weight is then the one u points at
  // (there is one: the maximum's weight is 1).
  int64_t last = V - 1;
  while (last > 0 && weights[last] == 0.0f) --last;
  return last;
}

// One draw from softmax(logits / temperature) by inverse CDF, for one row of V logits: the
// first token whose running sum of exp((logit - max) / temperature) exceeds u times the
// total (u in [0, 1)). scratch holds V floats. What the sampler's PyTorch path computes as
// div, softmax, cumsum and searchsorted (four passes and as many tensors), in two passes:
// ~0.3 ms of a ~100M-Llama decode step of 64 rows x 4096 logits on 2 cores. Tokens of zero
// weight (-inf logits) are never drawn: the running sum does not grow at them. kUndrawable
// for a row holding NaN or no finite logit.
int64_t sample_row(const float* logits, int64_t V, float temperature, float u, float* scratch) {
  const RowMax row = row_max(logits, V);
  if (!row.drawable()) return kUndrawable;
  const float total = row_weights(logits, V, row.max, temperature, scratch);
  return draw_from_weights(scratch, V, total, u);
}

// ---- Top-k, top-p and min-p without sorting the vocabulary ----
//
// vLLM (and the sampler's PyTorch path) sort each row to cut it: 64 rows of a 32k vocabulary
// took ~130 ms on one Zen 5 core, 128k ~1.2 s, many times the model's decode step. The cut
// only needs one value, the row's k-th largest logit (top-k) or the logit where the mass of
// the larger ones reaches p (top-p), and a radix select finds it in a few passes: histograms
// of 11, 11 and 10 bits of an order-preserving key of the logit, each narrowing to the
// bucket the cut falls in.

// An unsigned key with the order of the float's value: a < b iff order_key(a) < order_key(b).
inline uint32_t order_key(float x) {
  x += 0.0f;  // -0 becomes +0, so equal values have equal keys
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Where a cut falls: the key of the element it falls in, and the weight (count or mass) of
// the elements with larger keys, which is under the target. key 0 keeps everything (no
// element has it: it is a NaN's).
struct Cut {
  uint32_t key = 0;
  double above = 0.0;
};

// The key v of the elements of `keys` (those with key >= floor) at which the weight of the
// larger keys is under target and with v's own elements reaches it. weight(i) >= 0. When the
// total is under the target (rounding), the cut keeps everything. candidates: scratch.
template <typename Weight>
Cut radix_select(const uint32_t* keys, int64_t V, uint32_t floor, double target, Weight weight,
                 std::vector<int32_t>& candidates) {
  constexpr int kShifts[3] = {21, 10, 0};
  constexpr uint32_t kMasks[3] = {0x7ffu, 0x7ffu, 0x3ffu};
  double histogram[2048];
  Cut cut;
  uint32_t prefix = 0;  // the key bits above the current level, fixed by the levels before
  for (int level = 0; level < 3; ++level) {
    const int shift = kShifts[level];
    const uint32_t mask = kMasks[level];
    std::fill(histogram, histogram + mask + 1, 0.0);
    if (level == 0) {
      for (int64_t i = 0; i < V; ++i) {
        if (keys[i] >= floor) histogram[keys[i] >> shift] += weight(i);
      }
    } else {
      for (const int32_t i : candidates) histogram[(keys[i] >> shift) & mask] += weight(i);
    }
    // From the largest bucket down, until the running weight reaches the target.
    int64_t bucket = mask;
    double running = cut.above;
    for (; bucket >= 0; --bucket) {
      if (running + histogram[bucket] >= target) break;
      running += histogram[bucket];
    }
    if (bucket < 0) return Cut{};  // the total is under the target: keep everything
    cut.above = running;
    prefix |= static_cast<uint32_t>(bucket) << shift;
    // Keep the candidates of that bucket only.
    const uint32_t high_mask = ~((1u << shift) - 1u);
    if (level == 0) {
      candidates.clear();
      for (int64_t i = 0; i < V; ++i) {
        if (keys[i] >= floor && (keys[i] & high_mask) == prefix) candidates.push_back(static_cast<int32_t>(i));
      }
    } else {
      size_t kept = 0;
      for (const int32_t i : candidates) {
        if ((keys[i] & high_mask) == prefix) candidates[kept++] = i;
      }
      candidates.resize(kept);
    }
  }
  cut.key = prefix;
  return cut;
}

// What a row keeps: keys above `key`, the first `ties` elements (in vocabulary order) whose
// key equals it, and weights of at least min_weight.
struct Kept {
  uint32_t key = 0;
  int64_t ties = std::numeric_limits<int64_t>::max();
  float min_weight = 0.0f;
};

// The weights exp((logit - max) / temperature) of one row cut in vLLM's (v1) order: min-p
// first (tokens under min_p times the most likely's probability go), then top-k over what is
// left (k < V cuts; every logit equal to the k-th stays), then top-p over what top-k keeps
// (p < 1 cuts: a token stays while the tokens more likely than it hold less than p of that
// mass; the most likely always stays). Written to weights (cut tokens 0); returns their sum.
// What the PyTorch path computes by masks, sort and softmax, up to rounding. max: the row's
// largest logit (finite); keys holds V uint32 of scratch.
float truncated_weights(const float* logits, int64_t V, float max, float temperature, int64_t top_k, float top_p,
                        float min_p, float* weights, uint32_t* keys, std::vector<int32_t>& candidates) {
  row_weights(logits, V, max, temperature, weights);
  const bool cuts_k = top_k < V, cuts_p = top_p < 1.0f;
  Kept kept;
  kept.min_weight = min_p;  // the most likely token's weight is 1
  // Whether min-p keeps token i: top-k and top-p count and weigh these alone.
  const auto passes_min_p = [&](int64_t i) { return weights[i] >= min_p; };
  if (cuts_k || cuts_p) {
    for (int64_t i = 0; i < V; ++i) keys[i] = order_key(logits[i]);
  }
  if (cuts_k) {
    // The k-th largest logit min-p left (fewer than k left: all of them stay).
    kept.key = radix_select(keys, V, 0, static_cast<double>(top_k),
                            [&](int64_t i) { return passes_min_p(i) ? 1.0 : 0.0; }, candidates).key;
  }
  if (cuts_p) {
    const uint32_t floor = kept.key;
    const auto mass_of = [&](int64_t i) { return passes_min_p(i) ? static_cast<double>(weights[i]) : 0.0; };
    double mass = 0.0;
    for (int64_t i = 0; i < V; ++i) {
      if (keys[i] >= floor) mass += mass_of(i);
    }
    const double target = static_cast<double>(top_p) * mass;
    const Cut cut = radix_select(keys, V, floor, target, mass_of, candidates);
    if (cut.key != 0) {
      // Equal logits at the cut (equal weights) stay while the mass before each is under the
      // target: the first ones in vocabulary order (vLLM's sort is not stable, so which of
      // them it keeps is unspecified).
      kept.key = cut.key;
      const double tie_weight = weights[candidates.front()];
      if (tie_weight > 0.0) {
        kept.ties = std::max<int64_t>(1, static_cast<int64_t>(std::ceil((target - cut.above) / tie_weight)));
      }
    }
  }
  // Zero the weights cut off, summing what stays.
  float kept_total = 0.0f;
  int64_t ties_seen = 0;
  const bool cuts_keys = cuts_k || cuts_p;
  for (int64_t i = 0; i < V; ++i) {
    bool keep = weights[i] >= kept.min_weight;
    if (keep && cuts_keys) {
      keep = keys[i] > kept.key || (keys[i] == kept.key && ties_seen++ < kept.ties);
    }
    if (keep) {
      kept_total += weights[i];
    } else {
      weights[i] = 0.0f;
    }
  }
  return kept_total;
}

// One draw from the cut distribution (truncated_weights) by inverse CDF in vocabulary order:
// the token the PyTorch path (sort, mask, softmax, cumsum, searchsorted) draws for the same u,
// up to the rounding of its sums. kUndrawable for a row holding NaN or no finite logit.
int64_t sample_row_truncated(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p,
                             float min_p, float u, float* weights, uint32_t* keys, std::vector<int32_t>& candidates) {
  const RowMax row = row_max(logits, V);
  if (!row.drawable()) return kUndrawable;
  const float total = truncated_weights(logits, V, row.max, temperature, top_k, top_p, min_p, weights, keys,
                                        candidates);
  return draw_from_weights(weights, V, total, u);
}

// The entries an op reads: entry j is logits row rows[j] (int64 [n], each a row of logits;
// the mixed batch's greedy or random rows, read in place with no gather copy) or, without
// rows, row j of every row.
struct EntryRows {
  const int64_t* rows = nullptr;
  int64_t count = 0;
  int64_t operator()(int64_t j) const { return rows == nullptr ? j : rows[j]; }
};

EntryRows checked_rows(const char* op, const at::Tensor& logits, const std::optional<at::Tensor>& rows) {
  const int64_t N = logits.size(0);
  if (!rows.has_value()) return EntryRows{nullptr, N};
  TORCH_CHECK(rows->device().is_cpu() && rows->dim() == 1 && rows->scalar_type() == at::kLong && rows->is_contiguous(),
              "raylm::", op, ": rows is a contiguous int64 vector on the CPU");
  const EntryRows entries{rows->data_ptr<int64_t>(), rows->numel()};
  for (int64_t j = 0; j < entries.count; ++j) {
    TORCH_CHECK_VALUE(entries.rows[j] >= 0 && entries.rows[j] < N, "raylm::", op, ": row ", entries.rows[j],
                      " is outside the ", N, " rows of logits");
  }
  return entries;
}

// The uniforms of a draw: fp32 [N], each in [0, 1) (a u of 1 would point past the last token).
const float* checked_uniforms(const char* op, const at::Tensor& uniforms, int64_t N) {
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == N && uniforms.scalar_type() == at::kFloat &&
              uniforms.is_contiguous(), "raylm::", op, ": uniforms are fp32 [N], one per row of logits");
  const float* u = uniforms.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r) {
    TORCH_CHECK_VALUE(u[r] >= 0.0f && u[r] < 1.0f, "raylm::", op, ": uniform ", u[r], " of row ", r,
                      " is outside [0, 1)");
  }
  return u;
}

// logits [N, V] fp32 (rows contiguous), temperatures [n] fp32 > 0, uniforms [n] fp32 in
// [0, 1), rows: optional int64 [n] (EntryRows; n = N without) -> [n] int64: each entry's draw
// (sample_row).
at::Tensor random_sample(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms,
                         const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "raylm::random_sample takes fp32 logits [N, V] with contiguous rows");
  const int64_t V = logits.size(1);
  TORCH_CHECK(V > 0, "raylm::random_sample: no logits to sample from");
  const EntryRows entries = checked_rows("random_sample", logits, rows);
  const int64_t n = entries.count;
  TORCH_CHECK(temperatures.dim() == 1 && temperatures.size(0) == n && temperatures.scalar_type() == at::kFloat &&
              temperatures.is_contiguous(), "raylm::random_sample: temperatures are fp32 [n], one per row drawn");
  const float* temperature = temperatures.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK_VALUE(temperature[r] > 0.0f && std::isfinite(temperature[r]), "raylm::random_sample: temperature ",
                      temperature[r], " of row ", r, " is not a positive number");
  }
  const float* u = checked_uniforms("random_sample", uniforms, n);
  at::Tensor tokens = at::empty({n}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* base = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, n, grain_rows(V), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(V);
    for (int64_t r = begin; r < end; ++r) {
      out[r] = sample_row(base + entries(r) * row_stride, V, temperature[r], u[r], scratch.data());
    }
  });
  return tokens;
}

// Each row's cut, as the ops below take it: temperatures [N] fp32 > 0, top_ks [N] int64 (V or
// more: none), top_ps [N] fp32 in (0, 1] (1: none), min_ps [N] fp32 in [0, 1] (0: none).
struct RowCuts {
  const float* temperature;
  const int64_t* top_k;
  const float* top_p;
  const float* min_p;

  bool cuts(int64_t r, int64_t V) const { return top_k[r] < V || top_p[r] < 1.0f || min_p[r] > 0.0f; }
};

// N: the rows cut (the entries of EntryRows).
RowCuts checked_cuts(const char* op, const at::Tensor& logits, int64_t N, const at::Tensor& temperatures,
                     const at::Tensor& top_ks, const at::Tensor& top_ps, const at::Tensor& min_ps) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1, "raylm::", op,
              " takes fp32 logits [N, V] with contiguous rows");
  const int64_t V = logits.size(1);
  TORCH_CHECK(V > 0 && V < std::numeric_limits<int32_t>::max(), "raylm::", op, ": a vocabulary of ", V, " logits");
  for (const at::Tensor* t : {&temperatures, &top_ps, &min_ps}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == N && t->scalar_type() == at::kFloat && t->is_contiguous(), "raylm::",
                op, ": temperatures, top_ps and min_ps are fp32 [N], one per row of logits");
  }
  TORCH_CHECK(top_ks.dim() == 1 && top_ks.size(0) == N && top_ks.scalar_type() == at::kLong && top_ks.is_contiguous(),
              "raylm::", op, ": top_ks is int64 [N], one per row of logits");
  const RowCuts cuts{temperatures.data_ptr<float>(), top_ks.data_ptr<int64_t>(), top_ps.data_ptr<float>(),
                     min_ps.data_ptr<float>()};
  for (int64_t r = 0; r < N; ++r) {
    TORCH_CHECK_VALUE(cuts.temperature[r] > 0.0f && std::isfinite(cuts.temperature[r]), "raylm::", op,
                      ": temperature ", cuts.temperature[r], " of row ", r, " is not a positive number");
    TORCH_CHECK_VALUE(cuts.top_k[r] >= 1, "raylm::", op, ": top_k ", cuts.top_k[r], " of row ", r, " is under 1");
    TORCH_CHECK_VALUE(cuts.top_p[r] > 0.0f && cuts.top_p[r] <= 1.0f, "raylm::", op, ": top_p ", cuts.top_p[r],
                      " of row ", r, " is outside (0, 1]");
    TORCH_CHECK_VALUE(cuts.min_p[r] >= 0.0f && cuts.min_p[r] <= 1.0f, "raylm::", op, ": min_p ", cuts.min_p[r],
                      " of row ", r, " is outside [0, 1]");
  }
  return cuts;
}

// random_sample with each row's cut (RowCuts). A row that cuts nothing is drawn exactly as
// random_sample draws it. rows: as random_sample's.
at::Tensor random_sample_truncated(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms,
                                   const at::Tensor& top_ks, const at::Tensor& top_ps, const at::Tensor& min_ps,
                                   const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(logits.dim() == 2, "raylm::random_sample_truncated takes fp32 logits [N, V] with contiguous rows");
  const EntryRows entries = checked_rows("random_sample_truncated", logits, rows);
  const RowCuts cuts = checked_cuts("random_sample_truncated", logits, entries.count, temperatures, top_ks, top_ps,
                                    min_ps);
  const int64_t N = entries.count, V = logits.size(1);
  const float* u = checked_uniforms("random_sample_truncated", uniforms, N);
  at::Tensor tokens = at::empty({N}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* base = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, N, grain_rows(V), [&](int64_t begin, int64_t end) {
    std::vector<float> weights(V);
    std::vector<uint32_t> keys(V);
    std::vector<int32_t> candidates;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = base + entries(r) * row_stride;
      out[r] = cuts.cuts(r, V) ? sample_row_truncated(row, V, cuts.temperature[r], cuts.top_k[r], cuts.top_p[r],
                                                      cuts.min_p[r], u[r], weights.data(), keys.data(), candidates)
                               : sample_row(row, V, cuts.temperature[r], u[r], weights.data());
    }
  });
  return tokens;
}

// The distribution random_sample_truncated draws from: [N, V] fp32 probabilities, each row
// softmax(logits / temperature) cut by its top-k, top-p and min-p (RowCuts), cut tokens 0.
// For speculative decoding's rejection sampling, which needs the probabilities themselves. A
// row holding NaN or no finite logit comes out NaN, as softmax makes it (its request is
// failed by the caller's check; this op must not stop the others).
at::Tensor truncated_probs(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& top_ks,
                           const at::Tensor& top_ps, const at::Tensor& min_ps) {
  TORCH_CHECK(logits.dim() == 2, "raylm::truncated_probs takes fp32 logits [N, V] with contiguous rows");
  const RowCuts cuts = checked_cuts("truncated_probs", logits, logits.size(0), temperatures, top_ks, top_ps, min_ps);
  const int64_t N = logits.size(0), V = logits.size(1);
  at::Tensor probs = at::empty({N, V}, logits.options());
  float* out = probs.data_ptr<float>();
  const float* base = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, N, grain_rows(V), [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> keys(V);
    std::vector<int32_t> candidates;
    for (int64_t r = begin; r < end; ++r) {
      float* weights = out + r * V;
      const float* row_logits = base + r * row_stride;
      const RowMax row = row_max(row_logits, V);
      if (!row.drawable()) {
        std::fill(weights, weights + V, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const float total = truncated_weights(row_logits, V, row.max, cuts.temperature[r], cuts.top_k[r],
                                            cuts.top_p[r], cuts.min_p[r], weights, keys.data(), candidates);
      const vfloat inverse = vset1(1.0f / total);
      int64_t i = 0;
      for (; i + kVecWidth <= V; i += kVecWidth) vstore(weights + i, vmul(vload(weights + i), inverse));
      for (; i < V; ++i) weights[i] /= total;
    }
  });
  return probs;
}

// For each row r of values [N, V] fp32 (rows contiguous), how many of its values are greater
// than thresholds[r] (fp32 [N]; NaN is greater than nothing, and nothing than NaN): a logprob's
// rank among its row's, less one. One read of the rows; PyTorch's (values > thresholds).sum(-1)
// writes a bool [N, V] and casts it to int64 before summing: 64 rows of a 152k vocabulary
// took 50-80 ms that way on a shared 2-core EPYC, against about a millisecond.
at::Tensor count_greater(const at::Tensor& values, const at::Tensor& thresholds) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kFloat && values.stride(1) == 1,
              "raylm::count_greater takes fp32 values [N, V] with contiguous rows");
  const int64_t N = values.size(0), V = values.size(1);
  TORCH_CHECK(V < std::numeric_limits<int32_t>::max(), "raylm::count_greater: rows of ", V, " values");
  TORCH_CHECK(thresholds.dim() == 1 && thresholds.size(0) == N && thresholds.scalar_type() == at::kFloat &&
              thresholds.is_contiguous(), "raylm::count_greater: thresholds are fp32 [N], one per row of values");
  at::Tensor counts = at::empty({N}, values.options().dtype(at::kLong));
  int64_t* out = counts.data_ptr<int64_t>();
  const float* base = values.data_ptr<float>();
  const float* threshold = thresholds.data_ptr<float>();
  const int64_t row_stride = values.stride(0);
  at::parallel_for(0, N, grain_rows(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = base + r * row_stride;
      const float t = threshold[r];
      int32_t count = 0;  // V < 2^31; a 32-bit count vectorises twice as wide as a 64-bit one
      for (int64_t i = 0; i < V; ++i) count += x[i] > t;
      out[r] = count;
    }
  });
  return counts;
}

// ---- Greedy argmax ----
//
// torch's max(dim=-1).indices over 64 rows of a 152k vocabulary took 4.9-10.9 ms on the shared
// 2-core EPYC, against ~0.9 ms for one plain read of them. Here a row is read in blocks that
// stay in L1: a block's maximum (and whether it holds a NaN) in one vectorised pass, and the
// block is scanned again, from L1, only when it beats the maximum so far.

constexpr int64_t kArgmaxBlock = 2048;  // 8 KiB of fp32: a block's second read hits L1

struct BlockMax {
  float max;
  bool holds_nan;
};

// The largest of x[0:n] (n > 0) and whether any is NaN (vmax drops NaN lanes, so they are
// looked for apart).
BlockMax block_max(const float* x, int64_t n) {
  int64_t i = 0;
  float max = -std::numeric_limits<float>::infinity();
  bool holds_nan = false;
#if RAYLM_AVX512
  __m512 m0 = _mm512_set1_ps(max), m1 = m0, m2 = m0, m3 = m0;
  __mmask16 nan = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16), c = _mm512_loadu_ps(x + i + 32),
                 d = _mm512_loadu_ps(x + i + 48);
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
    m2 = _mm512_max_ps(m2, c);
    m3 = _mm512_max_ps(m3, d);
    nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q);
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i);
    m0 = _mm512_max_ps(m0, a);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  }
  max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  holds_nan = nan != 0;
#elif RAYLM_AVX2
  __m256 m0 = _mm256_set1_ps(max), m1 = m0, m2 = m0, m3 = m0, nan = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8), c = _mm256_loadu_ps(x + i + 16),
                 d = _mm256_loadu_ps(x + i + 24);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    m2 = _mm256_max_ps(m2, c);
    m3 = _mm256_max_ps(m3, d);
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    m0 = _mm256_max_ps(m0, a);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  max = max8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  holds_nan = _mm256_movemask_ps(nan) != 0;
#endif
  for (; i < n; ++i) {
    holds_nan |= std::isnan(x[i]);
    max = x[i] > max ? x[i] : max;
  }
  return BlockMax{max, holds_nan};
}

// The first i of x[0:n] with x[i] == value, or with x[i] NaN when value is NaN (one exists).
int64_t first_index_of(const float* x, int64_t n, float value) {
  const bool nan = std::isnan(value);
  int64_t i = 0;
#if RAYLM_AVX512
  const __m512 target = _mm512_set1_ps(value);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 hits = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hits != 0) return i + __builtin_ctz(hits);
  }
#elif RAYLM_AVX2
  const __m256 target = _mm256_set1_ps(value);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hits != 0) return i + __builtin_ctz(hits);
  }
#endif
  for (; i < n; ++i) {
    if (nan ? std::isnan(x[i]) : x[i] == value) return i;
  }
  return n;  // not reached: the caller found value in x
}

// torch.max(row, dim=-1).indices of one row of V > 0 logits, contiguous: the first index of the
// largest value; a NaN counts as larger than everything, so the first NaN's index (-0 and +0
// are equal, and a row of -inf gives 0).
int64_t argmax_row(const float* x, int64_t V) {
  float best = 0.0f;
  int64_t best_index = -1;
  for (int64_t start = 0; start < V; start += kArgmaxBlock) {
    const int64_t n = std::min(kArgmaxBlock, V - start);
    const BlockMax block = block_max(x + start, n);
    if (block.holds_nan) return start + first_index_of(x + start, n, std::numeric_limits<float>::quiet_NaN());
    if (best_index < 0 || block.max > best) {  // strictly larger: an earlier block keeps a tie
      best = block.max;
      best_index = start + first_index_of(x + start, n, block.max);
    }
  }
  return best_index;
}

// argmax_row for a row whose elements lie `stride` apart (a transposed or column-sliced view).
int64_t argmax_strided_row(const float* x, int64_t V, int64_t stride) {
  float best = x[0];
  int64_t best_index = 0;
  for (int64_t i = 0; i < V && !std::isnan(best); ++i) {
    const float v = x[i * stride];
    if (std::isnan(v) || v > best) {
      best = v;
      best_index = i;
    }
  }
  return best_index;
}

// logits [N, V] fp32 (any strides), rows: optional int64 [n] (EntryRows) -> int64 [n] (N
// without rows): each entry's torch.max(dim=-1).indices, the greedy token.
at::Tensor argmax_rows(const at::Tensor& logits, const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "raylm::argmax_rows takes fp32 logits [N, V] on the CPU");
  const int64_t V = logits.size(1);
  TORCH_CHECK(V > 0, "raylm::argmax_rows: rows of no logits have no argmax");
  const EntryRows entries = checked_rows("argmax_rows", logits, rows);
  at::Tensor tokens = at::empty({entries.count}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* base = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0), column_stride = logits.stride(1);
  at::parallel_for(0, entries.count, grain_rows(V), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* row = base + entries(j) * row_stride;
      out[j] = column_stride == 1 ? argmax_row(row, V) : argmax_strided_row(row, V, column_stride);
    }
  });
  return tokens;
}

// vLLM's penalties, in place, touching only the tokens a row has seen: repetition (a seen
// logit x becomes x / r when positive, x * r otherwise; seen = in the prompt or the output),
// then frequency and presence over the output ((x - f * count) - p). The dense form (masks
// and counts over the whole vocabulary, ~10 passes of [N, V]) cost 25-150 ms a step at batch
// 64 with a 32k-128k vocabulary; a row's work here is its token count.
// logits [*, V] fp32 (rows contiguous); rows [n] int64: the logits row of each entry;
// histories: n int64 vectors, entry j's prompt then output tokens in
// histories[j][0:lengths[j]], its prompt the first prompt_lens[j] of them; repetition,
// frequency, presence [n] fp32. The histories are the workers' own growing buffers (a
// request's, or several entries' one when they score positions after proposals): nothing
// is copied to call this.
void apply_penalties(at::Tensor& logits, const at::Tensor& rows, at::TensorList histories, const at::Tensor& lengths,
                     const at::Tensor& prompt_lens, const at::Tensor& repetition, const at::Tensor& frequency,
                     const at::Tensor& presence) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "raylm::apply_penalties takes fp32 logits [N, V] with contiguous rows");
  const int64_t n = rows.numel(), V = logits.size(1), N = logits.size(0);
  for (const at::Tensor* t : {&rows, &lengths, &prompt_lens}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kLong && t->is_contiguous(),
                "raylm::apply_penalties: rows, lengths and prompt_lens are contiguous int64 [n], one per entry");
  }
  for (const at::Tensor* t : {&repetition, &frequency, &presence}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "raylm::apply_penalties: repetition, frequency and presence are fp32 [n], one per row");
  }
  TORCH_CHECK(static_cast<int64_t>(histories.size()) == n, "raylm::apply_penalties: ", histories.size(),
              " histories for ", n, " entries");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* prompt_len = prompt_lens.data_ptr<int64_t>();
  std::vector<const int64_t*> history(n);
  for (int64_t j = 0; j < n; ++j) {
    const at::Tensor& h = histories[j];
    TORCH_CHECK(h.device().is_cpu() && h.dim() == 1 && h.scalar_type() == at::kLong && h.is_contiguous(),
                "raylm::apply_penalties: history ", j, " is not a contiguous int64 vector on the CPU");
    TORCH_CHECK(row[j] >= 0 && row[j] < N, "raylm::apply_penalties: row ", row[j], " is outside the logits");
    TORCH_CHECK(0 <= prompt_len[j] && prompt_len[j] <= length[j] && length[j] <= h.numel(),
                "raylm::apply_penalties: entry ", j, " reads ", length[j], " tokens (", prompt_len[j],
                " of the prompt) of a history of ", h.numel());
    history[j] = h.data_ptr<int64_t>();
    for (int64_t t = 0; t < length[j]; ++t) {
      TORCH_CHECK_VALUE(history[j][t] >= 0 && history[j][t] < V, "raylm::apply_penalties: token id ", history[j][t],
                        " is outside the vocabulary of ", V);
    }
  }
  const float* rep = repetition.data_ptr<float>();
  const float* freq = frequency.data_ptr<float>();
  const float* pres = presence.data_ptr<float>();
  float* base = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    // Stamps instead of clearing: an entry's tokens are marked with j + 1, unique in this call.
    std::vector<uint32_t> seen(V, 0), counted(V, 0);
    std::vector<int32_t> count(V);
    std::vector<int64_t> seen_tokens, output_tokens;
    for (int64_t j = begin; j < end; ++j) {
      const uint32_t stamp = static_cast<uint32_t>(j + 1);
      seen_tokens.clear();
      output_tokens.clear();
      const int64_t* tokens = history[j];
      for (int64_t t = 0; t < length[j]; ++t) {
        const int64_t token = tokens[t];
        if (seen[token] != stamp) {
          seen[token] = stamp;
          seen_tokens.push_back(token);
        }
        if (t >= prompt_len[j]) {
          if (counted[token] != stamp) {
            counted[token] = stamp;
            count[token] = 0;
            output_tokens.push_back(token);
          }
          ++count[token];
        }
      }
      float* x = base + row[j] * row_stride;
      if (rep[j] != 1.0f) {
        for (const int64_t token : seen_tokens) x[token] = x[token] > 0.0f ? x[token] / rep[j] : x[token] * rep[j];
      }
      if (freq[j] != 0.0f || pres[j] != 0.0f) {
        for (const int64_t token : output_tokens) x[token] = (x[token] - freq[j] * count[token]) - pres[j];
      }
    }
  });
}

// A zeroed tensor on transparent huge pages (huge_pages.h), for the KV cache: a decode step's
// attention reads every sequence's blocks, scattered over the cache, so with 4 KiB pages most
// block reads start with a TLB miss. One layer's cold decode attention call of the ~100M Llama
// (64 sequences of ~190 tokens, bf16, 2-core Zen 4) took 0.59-0.61 ms against 0.66 ms; over
// that model's generate (torch profiler, two runs each) 608-622 ms against 627-697 ms.
at::Tensor zeros_on_huge_pages_op(at::IntArrayRef size, at::ScalarType dtype) {
  return zeros_on_huge_pages(size, at::TensorOptions().dtype(dtype));
}

// The rows `blocks` of an fp8 tensor (its bytes, [num_rows, ...]) in table's dtype (fp32 or
// bf16), byte by byte through `table` (the 256 fp8 values, maybe times a scale): an FP8
// weight's row chunks for the W8A16 GEMM of larger batches (kernels/fp8_linear.py).
// One table load an element; PyTorch's fp8 -> fp32 cast took several times longer.
template <typename out_t>
void dequantize_rows(const uint8_t* src, const int64_t* ids, const out_t* lut, out_t* dst, int64_t n, int64_t row) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* s = src + ids[i] * row;
      out_t* d = dst + i * row;
      for (int64_t j = 0; j < row; ++j) d[j] = lut[s[j]];
    }
  });
}

at::Tensor dequantize_blocks(const at::Tensor& cache, const at::Tensor& blocks, const at::Tensor& table) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kByte && cache.is_contiguous() && cache.dim() >= 1,
              "raylm::dequantize_blocks: cache must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 1 && blocks.is_contiguous(),
              "raylm::dequantize_blocks: blocks must be a contiguous 1-D int64 tensor");
  TORCH_CHECK((table.scalar_type() == at::kFloat || table.scalar_type() == at::kBFloat16) && table.numel() == 256 &&
                  table.is_contiguous(),
              "raylm::dequantize_blocks: table must hold 256 contiguous fp32 or bf16 values");
  const int64_t num_blocks = cache.size(0), n = blocks.numel();
  const int64_t row = num_blocks == 0 ? 0 : cache.numel() / num_blocks;
  const int64_t* ids = blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < num_blocks, "raylm::dequantize_blocks: block ", ids[i],
                      " is outside the cache's ", num_blocks, " blocks");
  }
  std::vector<int64_t> sizes = cache.sizes().vec();
  sizes[0] = n;
  at::Tensor out = at::empty(sizes, at::TensorOptions().dtype(table.scalar_type()));
  const uint8_t* src = cache.data_ptr<uint8_t>();
  if (table.scalar_type() == at::kFloat) {
    dequantize_rows(src, ids, table.data_ptr<float>(), out.data_ptr<float>(), n, row);
  } else {  // bf16 as its 16 bits: a copy, no conversion
    dequantize_rows(src, ids, reinterpret_cast<const uint16_t*>(table.data_ptr<at::BFloat16>()),
                    reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, row);
  }
  return out;
}

// fp32 lanes of cpu_vec.h's vfloat in this build: 16 (AVX-512), 8 (AVX2), 1 (portable).
int64_t vector_width() { return kVecWidth; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("vector_width() -> int", &vector_width);
  m.def("zeros_on_huge_pages(int[] size, ScalarType dtype) -> Tensor", &zeros_on_huge_pages_op);
  m.def("random_sample(Tensor logits, Tensor temperatures, Tensor uniforms, Tensor? rows=None) -> Tensor");
  m.def("random_sample_truncated(Tensor logits, Tensor temperatures, Tensor uniforms, Tensor top_ks, Tensor top_ps, "
        "Tensor min_ps, Tensor? rows=None) -> Tensor");
  m.def("apply_penalties(Tensor(a!) logits, Tensor rows, Tensor[] histories, Tensor lengths, Tensor prompt_lens, "
        "Tensor repetition, Tensor frequency, Tensor presence) -> ()");
  m.def("truncated_probs(Tensor logits, Tensor temperatures, Tensor top_ks, Tensor top_ps, Tensor min_ps) -> Tensor");
  m.def("count_greater(Tensor values, Tensor thresholds) -> Tensor");
  m.def("argmax_rows(Tensor logits, Tensor? rows=None) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos_sin_cache, int head_size, int rotary_dim) -> ()");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("dequantize_blocks(Tensor cache, Tensor blocks, Tensor table) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("dequantize_blocks", &dequantize_blocks);
  m.impl("random_sample", &random_sample);
  m.impl("random_sample_truncated", &random_sample_truncated);
  m.impl("truncated_probs", &truncated_probs);
  m.impl("apply_penalties", &apply_penalties);
  m.impl("count_greater", &count_greater);
  m.impl("argmax_rows", &argmax_rows);
}
