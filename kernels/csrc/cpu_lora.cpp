// Batched LoRA on the CPU, gather style (punica's BGMV): each token of a step that runs under
// an adapter slot adds its own adapter's (x A^T) B^T to the base layer's output, reading only
// that slot's A and B; tokens of the base model (slot -1) are left alone. The layout is
// raylm/kernels/lora_ops.py's: lora_a [K, n * S * R] (A transposed; columns by output slice,
// slot, rank), lora_b[i] [S * R, N_i] (B transposed, scaled), out [T, sum N_i]; R, the slots'
// width, a multiple of the vector width (raylm rounds it up to 16).
//
// The tokens are grouped by slot and taken eight (AVX2: four) at a time. The shrink runs over the ranks in
// vectors: for each k, one load of A^T's row serves the block's tokens, whose x[k] is broadcast
// (no horizontal sums, which at K of a few hundred cost as much as the multiply-adds); the
// expand adds R scaled rows of B^T to the block's output rows, each load of B^T serving them all.
// h stays in fp32. At the benchmark Llamas' decode batches this does S times less arithmetic
// than the masked GEMM over every slot (`add_lora_masked_gemm`) and no gather copies
// (bench_lora.py ops).
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp (or a narrower ISA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace raylm;
using bf16 = uint16_t;

// The largest rank the kernel takes (raylm's MAX_SUPPORTED_LORA_RANK).
constexpr int64_t kMaxRank = 512;

// The tokens of one slot are taken up to kTokens at a time, so that each row of the slot's A
// and B^T that is loaded serves every token of the block: 8 where the 32 vector registers of
// AVX-512 hold the block's accumulators, 4 with the 16 of AVX2.
constexpr int kTokens = kVecWidth >= 16 ? 8 : 4;

// h[t][0:R] = x_t A^T for the M tokens, A^T the slot's columns of at ([K, ld], R columns
// from c0; R a multiple of kVecWidth): one vector of ranks at a time, each row of A^T loaded
// once for the M tokens, whose x values are broadcast; two accumulators per token (even and
// odd k) so that the multiply-adds do not wait on each other. No horizontal sums.
template <int M, typename T>
inline void shrink_block(const T* a_t, int64_t ld, int64_t c0, const float* const* x, int64_t K, int64_t R,
                         float (*h)[kMaxRank]) {
  for (int64_t r = 0; r < R; r += kVecWidth) {
    vfloat acc[2][M];
    for (int t = 0; t < M; ++t) acc[0][t] = acc[1][t] = vset1(0.0f);
    const T* column = a_t + c0 + r;
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      const vfloat a0 = vload(column + k * ld), a1 = vload(column + (k + 1) * ld);
      for (int t = 0; t < M; ++t) {
        acc[0][t] = vfmadd(vset1(x[t][k]), a0, acc[0][t]);
        acc[1][t] = vfmadd(vset1(x[t][k + 1]), a1, acc[1][t]);
      }
    }
    if (k < K) {
      const vfloat a0 = vload(column + k * ld);
      for (int t = 0; t < M; ++t) acc[0][t] = vfmadd(vset1(x[t][k]), a0, acc[0][t]);
    }
    for (int t = 0; t < M; ++t) vstore(h[t] + r, vadd(acc[0][t], acc[1][t]));
  }
}

// out_t[0:N] += sum_r h[t][r] * bt[r * N : r * N + N] for the M tokens.
template <int M, typename T>
inline void expand_block(T* const* out, const T* bt, const float (*h)[kMaxRank], int64_t R, int64_t N) {
  int64_t n = 0;
  for (; n + 2 * kVecWidth <= N; n += 2 * kVecWidth) {
    vfloat acc[M][2];
    for (int t = 0; t < M; ++t) {
      acc[t][0] = vload(out[t] + n);
      acc[t][1] = vload(out[t] + n + kVecWidth);
    }
    for (int64_t r = 0; r < R; ++r) {
      const vfloat b0 = vload(bt + r * N + n), b1 = vload(bt + r * N + n + kVecWidth);
      for (int t = 0; t < M; ++t) {
        const vfloat hr = vset1(h[t][r]);
        acc[t][0] = vfmadd(hr, b0, acc[t][0]);
        acc[t][1] = vfmadd(hr, b1, acc[t][1]);
      }
    }
    for (int t = 0; t < M; ++t) {
      vstore(out[t] + n, acc[t][0]);
      vstore(out[t] + n + kVecWidth, acc[t][1]);
    }
  }
  for (; n < N; ++n) {
    for (int t = 0; t < M; ++t) {
      float sum = to_float(out[t][n]);
      for (int64_t r = 0; r < R; ++r) sum += h[t][r] * to_float(bt[r * N + n]);
      store_scalar(out[t] + n, sum);
    }
  }
}

// One block of M tokens of one slot through every output slice. x_rows are fp32 (bf16 rows
// widened once by the caller, as every slice reads them).
template <int M, typename T>
void block(T* const* out_rows, const float* const* x_rows, const T* a_t, int64_t ld,
           const std::vector<const T*>& b_base, const std::vector<int64_t>& widths,
           const std::vector<int64_t>& offsets, int64_t slot, int64_t S, int64_t R, int64_t K) {
  float h[M][kMaxRank];
  T* out[M];
  for (int64_t piece = 0; piece < static_cast<int64_t>(widths.size()); ++piece) {
    shrink_block<M>(a_t, ld, (piece * S + slot) * R, x_rows, K, R, h);
    const int64_t N = widths[piece];
    for (int t = 0; t < M; ++t) out[t] = out_rows[t] + offsets[piece];
    expand_block<M>(out, b_base[piece] + slot * R * N, h, R, N);
  }
}

// block<count> for a count of 1 to kTokens tokens.
template <typename T, int M = kTokens>
void run_block(int64_t count, T* const* out_rows, const float* const* x_rows, const T* a_t, int64_t ld,
               const std::vector<const T*>& b_base, const std::vector<int64_t>& widths,
               const std::vector<int64_t>& offsets, int64_t slot, int64_t S, int64_t R, int64_t K) {
  if constexpr (M > 1) {
    if (count < M) {
      run_block<T, M - 1>(count, out_rows, x_rows, a_t, ld, b_base, widths, offsets, slot, S, R, K);
      return;
    }
  }
  block<M>(out_rows, x_rows, a_t, ld, b_base, widths, offsets, slot, S, R, K);
}

template <typename T>
void lora_bgmv_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
                      const std::vector<at::Tensor>& lora_b, const std::vector<int64_t>& offsets,
                      const int32_t* slots, int64_t R) {
  const int64_t tokens = x.size(0), K = x.size(1), pieces = static_cast<int64_t>(lora_b.size());
  const int64_t ld = lora_a.size(1), S = ld / (pieces * R);
  T* out_base = reinterpret_cast<T*>(out.data_ptr());
  const T* x_base = reinterpret_cast<const T*>(x.data_ptr());
  const T* a_t = reinterpret_cast<const T*>(lora_a.data_ptr());
  std::vector<const T*> b_base;
  std::vector<int64_t> widths;
  for (const at::Tensor& b : lora_b) {
    b_base.push_back(reinterpret_cast<const T*>(b.data_ptr()));
    widths.push_back(b.size(1));
  }
  const int64_t out_stride = out.stride(0), x_stride = x.stride(0);
  // The tokens of each slot, in blocks of up to kTokens: (slot, first index into `order`, count).
  std::vector<std::vector<int64_t>> by_slot(S);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) by_slot[slots[t]].push_back(t);
  std::vector<int64_t> order;
  std::vector<std::array<int64_t, 3>> blocks;
  for (int64_t s = 0; s < S; ++s) {
    for (size_t i = 0; i < by_slot[s].size(); i += kTokens) {
      blocks.push_back({s, static_cast<int64_t>(order.size()),
                        std::min<int64_t>(kTokens, static_cast<int64_t>(by_slot[s].size() - i))});
      order.insert(order.end(), by_slot[s].begin() + i, by_slot[s].begin() + i + blocks.back()[2]);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(kTokens * K);
    for (int64_t index = begin; index < end; ++index) {
      const auto [slot, first, count] = blocks[index];
      T* out_rows[kTokens];
      const float* x_rows[kTokens];
      for (int64_t t = 0; t < count; ++t) {
        out_rows[t] = out_base + order[first + t] * out_stride;
        const T* row = x_base + order[first + t] * x_stride;
        if constexpr (std::is_same_v<T, float>) {
          x_rows[t] = row;
        } else {
          float* target = widened.data() + t * K;
          for (int64_t k = 0; k < K; ++k) target[k] = to_float(row[k]);
          x_rows[t] = target;
        }
      }
      run_block(count, out_rows, x_rows, a_t, ld, b_base, widths, offsets, slot, S, R, K);
    }
  });
}

void lora_bgmv(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, at::TensorList lora_b,
               at::IntArrayRef offsets, const at::Tensor& token_slots, int64_t rank) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "raylm::lora_bgmv takes fp32 or bf16 tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.scalar_type() == dtype,
              "raylm::lora_bgmv: x [T, K] and out [T, N] with contiguous rows, of one dtype");
  TORCH_CHECK(rank > 0 && rank <= kMaxRank && !lora_b.empty() && static_cast<int64_t>(offsets.size()) == static_cast<int64_t>(lora_b.size()),
              "raylm::lora_bgmv: a positive rank and one offset per output slice");
  TORCH_CHECK(rank % kVecWidth == 0, "raylm::lora_bgmv: the slots' rank ", rank, " must be a multiple of ",
              kVecWidth, " (raylm rounds it up to 16)");
  TORCH_CHECK(lora_a.dim() == 2 && lora_a.is_contiguous() && lora_a.scalar_type() == dtype &&
                  lora_a.size(0) == x.size(1) && lora_a.size(1) % (static_cast<int64_t>(lora_b.size()) * rank) == 0,
              "raylm::lora_bgmv: lora_a [K, n * S * R] contiguous, of x's dtype");
  const int64_t slots_rows = lora_a.size(1) / static_cast<int64_t>(lora_b.size());
  std::vector<at::Tensor> pieces(lora_b.begin(), lora_b.end());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const at::Tensor& b = pieces[i];
    TORCH_CHECK(b.dim() == 2 && b.is_contiguous() && b.scalar_type() == dtype && b.size(0) == slots_rows &&
                    offsets[i] >= 0 && offsets[i] <= out.size(1) - b.size(1),  // no sum to overflow
                "raylm::lora_bgmv: lora_b[", i, "] must be [S * R, N_i] contiguous, within out's columns");
  }
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == x.size(0) && token_slots.scalar_type() == at::kInt &&
                  token_slots.is_contiguous(),
              "raylm::lora_bgmv: token_slots int32 [T]");
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  const int64_t num_slots = slots_rows / rank;
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(slots[t] < num_slots, "raylm::lora_bgmv: token ", t, " names slot ", slots[t], " of ", num_slots);
  }
  std::vector<int64_t> offset_list(offsets.begin(), offsets.end());
  if (dtype == at::kFloat) {
    lora_bgmv_kernel<float>(out, x, lora_a, pieces, offset_list, slots, rank);
  } else {
    lora_bgmv_kernel<bf16>(out, x, lora_a, pieces, offset_list, slots, rank);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("lora_bgmv(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor[] lora_b, int[] offsets, Tensor token_slots, "
        "int rank) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("lora_bgmv", &lora_bgmv); }
