// A linear layer over GPTQ / AWQ integer weights (4 or 8 bits, a scale and zero per group of
// input features and output column) for decode-sized batches on the CPU, the codes read
// packed and widened in registers (raylm/kernels/int4_linear.py repacks both formats at load
// into the one layout below and sorts act-order rows into contiguous groups).
//
// Layout: output columns in blocks of kBlockColumns (32); `weight` [blocks, K / pack, 32] int32,
// word [b, r, j] holding the codes of column 32 b + j at inputs pack r + i in bits
// [bits i, bits (i + 1)) (pack = 32 / bits: GPTQ's own qweight order, made contiguous per
// column block so each thread streams its blocks front to back). `scales` and `zero_scales`
// [blocks, groups, 32] fp32: the group's scale s and zero z times it. The inputs are cut into
// chunks (`chunk_starts`, each inside one group, `chunk_groups`, of at most kChunkRows rows,
// multiples of pack), so that, with codes q:
//   out[t, n] = sum over chunks c of s[g_c, n] * (sum_{k in c} x[t, k] q[k, n]) - (z s)[g_c, n] * sum_{k in c} x[t, k]
// which is sum_k x[t, k] (q[k, n] - z) s: the zero never touches the inner loop, which is a
// shift, a mask, an int -> float conversion and one FMA per token for each vector of codes.
//
// Vectors run along the output columns (kLanes of vfloat, cpu_vec.h: 16 with AVX-512, 8 with
// AVX2 + FMA, 1 in the scalar fallback). Up to kWordsTokens tokens widen the codes straight
// into registers; more tokens widen a chunk once into an L1 tile of floats and multiply it by
// kTileTokens tokens at a time, so the widening is paid once per chunk, not once per token.
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp (or a narrower ISA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_vec.h"
#include "int4_checks.h"
#include "int4_codes.h"

namespace {

using raylm::vfloat;
using raylm::vfmadd;
using raylm::vload;
using raylm::vmul;
using raylm::vset1;
using raylm::vstore;
using raylm::vsub;
using raylm::int4::check_indices;
using raylm::int4::check_tensor;
using raylm::int4::checked_codes_per_word;
using raylm::int4::codes_at;
using raylm::int4::for_each_code;
using raylm::int4::kAnySize;
using raylm::int4::load_words;
using raylm::int4::vwords;

constexpr int kBlockColumns = 32;  // python: int4_linear.BLOCK_COLUMNS
constexpr int kChunkRows = 128;    // python: int4_linear.CHUNK_ROWS (a tile of 16 KiB)
constexpr int kSlabTokens = 256;
constexpr int kLanes = raylm::kVecWidth;
constexpr int kVectors = kBlockColumns / kLanes;
static_assert(kBlockColumns % kLanes == 0, "a column block is whole vectors");

// Tokens multiplied together: the accumulators (tokens x kVectors vectors) plus the codes or
// widened weights must fit the registers (32 zmm; 16 ymm with AVX2, which has 4 vectors a
// block). Up to kWordsTokens tokens widen the codes in registers; more go through the tile,
// kTileTokens at a time.
#if RAYLM_AVX512
constexpr int kWordsTokens = 6;
constexpr int kTileTokens = 6;
#elif RAYLM_AVX2
constexpr int kWordsTokens = 2;
constexpr int kTileTokens = 3;
#else
constexpr int kWordsTokens = 2;
constexpr int kTileTokens = 2;
#endif

// One chunk's contribution for TR tokens: sums[t][:] += s * acc[t] - zs * xsum[t].
template <int TR>
inline void fold_chunk(const vfloat (&acc)[TR][kVectors], const float* scale, const float* zero_scale,
                       const float* xsum, int64_t ldxsum, float* sums) {
  for (int t = 0; t < TR; ++t) {
    const vfloat token_sum = vset1(xsum[t * ldxsum]);
    for (int v = 0; v < kVectors; ++v) {
      float* total = sums + t * kBlockColumns + v * kLanes;
      const vfloat scaled = vfmadd(vload(scale + v * kLanes), acc[t][v], vload(total));
      vstore(total, vsub(scaled, vmul(vload(zero_scale + v * kLanes), token_sum)));
    }
  }
}

// TR tokens x one chunk, the codes widened straight from the packed words.
template <int kBits, int TR>
void chunk_from_words(const float* x, int64_t ldx, const int32_t* words, int rows, const float* scale,
                      const float* zero_scale, const float* xsum, int64_t ldxsum, float* sums) {
  constexpr int pack = 32 / kBits, mask = (1 << kBits) - 1;
  vfloat acc[TR][kVectors];
  for (int t = 0; t < TR; ++t)
    for (int v = 0; v < kVectors; ++v) acc[t][v] = vset1(0.0f);
  for (int r = 0; r < rows / pack; ++r) {
    vwords packed[kVectors];
    for (int v = 0; v < kVectors; ++v) packed[v] = load_words(words + r * kBlockColumns + v * kLanes);
    const float* xr = x + r * pack;
    for_each_code<pack>([&](auto i) {
      for (int v = 0; v < kVectors; ++v) {
        const vfloat w = codes_at<decltype(i)::value * kBits, mask>(packed[v]);
        for (int t = 0; t < TR; ++t) acc[t][v] = vfmadd(vset1(xr[t * ldx + i]), w, acc[t][v]);
      }
    });
  }
  fold_chunk<TR>(acc, scale, zero_scale, xsum, ldxsum, sums);
}

// tile[k * kBlockColumns + j]: the chunk's codes as floats.
template <int kBits>
void widen_chunk(const int32_t* words, int rows, float* tile) {
  constexpr int pack = 32 / kBits, mask = (1 << kBits) - 1;
  for (int r = 0; r < rows / pack; ++r) {
    for (int v = 0; v < kVectors; ++v) {
      const vwords packed = load_words(words + r * kBlockColumns + v * kLanes);
      for_each_code<pack>([&](auto i) {
        vstore(tile + (r * pack + decltype(i)::value) * kBlockColumns + v * kLanes,
               codes_at<decltype(i)::value * kBits, mask>(packed));
      });
    }
  }
}

// TR tokens x one chunk, from the widened tile.
template <int TR>
void chunk_from_tile(const float* x, int64_t ldx, const float* tile, int rows, const float* scale,
                     const float* zero_scale, const float* xsum, int64_t ldxsum, float* sums) {
  vfloat acc[TR][kVectors];
  for (int t = 0; t < TR; ++t)
    for (int v = 0; v < kVectors; ++v) acc[t][v] = vset1(0.0f);
  for (int k = 0; k < rows; ++k) {
    vfloat w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = vload(tile + k * kBlockColumns + v * kLanes);
    for (int t = 0; t < TR; ++t) {
      const vfloat xv = vset1(x[t * ldx + k]);
      for (int v = 0; v < kVectors; ++v) acc[t][v] = vfmadd(xv, w[v], acc[t][v]);
    }
  }
  fold_chunk<TR>(acc, scale, zero_scale, xsum, ldxsum, sums);
}

using WordsFn = void (*)(const float*, int64_t, const int32_t*, int, const float*, const float*, const float*,
                         int64_t, float*);
using TileFn = void (*)(const float*, int64_t, const float*, int, const float*, const float*, const float*, int64_t,
                        float*);

// [tokens - 1]: the function for a tile of that many tokens.
template <int kBits, int... TR>
constexpr std::array<WordsFn, sizeof...(TR)> words_table(std::integer_sequence<int, TR...>) {
  return {&chunk_from_words<kBits, TR + 1>...};
}
template <int... TR>
constexpr std::array<TileFn, sizeof...(TR)> tile_table(std::integer_sequence<int, TR...>) {
  return {&chunk_from_tile<TR + 1>...};
}

template <int kBits>
void int4_linear_blocks(const float* x, int64_t T, int64_t K, const int32_t* weight, const float* scales,
                        const float* zero_scales, int64_t groups, const int32_t* chunk_starts,
                        const int32_t* chunk_groups, int64_t chunks, const float* xsum, int64_t blocks, int64_t N,
                        float* out) {
  constexpr int pack = 32 / kBits;
  constexpr auto from_words = words_table<kBits>(std::make_integer_sequence<int, kWordsTokens>{});
  constexpr auto from_tile = tile_table(std::make_integer_sequence<int, kTileTokens>{});
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float tile[kChunkRows * kBlockColumns];
    std::vector<float> sums(T * kBlockColumns);
    for (int64_t b = begin; b < end; ++b) {
      std::fill(sums.begin(), sums.end(), 0.0f);
      const int32_t* block_words = weight + b * (K / pack) * kBlockColumns;
      for (int64_t c = 0; c < chunks; ++c) {
        const int start = chunk_starts[c], rows = chunk_starts[c + 1] - start;
        const int32_t* words = block_words + (start / pack) * kBlockColumns;
        const int64_t at = (b * groups + chunk_groups[c]) * kBlockColumns;
        const float *scale = scales + at, *zero_scale = zero_scales + at;
        if (T <= kWordsTokens) {
          from_words[T - 1](x + start, K, words, rows, scale, zero_scale, xsum + c, chunks, sums.data());
          continue;
        }
        widen_chunk<kBits>(words, rows, tile);
        for (int64_t t0 = 0; t0 < T; t0 += kTileTokens) {
          const int tokens = static_cast<int>(std::min<int64_t>(kTileTokens, T - t0));
          from_tile[tokens - 1](x + t0 * K + start, K, tile, rows, scale, zero_scale, xsum + t0 * chunks + c, chunks,
                                sums.data() + t0 * kBlockColumns);
        }
      }
      const int64_t n0 = b * kBlockColumns, columns = std::min<int64_t>(kBlockColumns, N - n0);
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(out + t * N + n0, sums.data() + t * kBlockColumns, columns * sizeof(float));
    }
  });
}

// x [T, K] fp32 (K: the repacked, padded inputs), weight [blocks, K / pack, 32] int32, scales
// and zero_scales [blocks, groups, 32] fp32, chunk_starts [chunks + 1] and chunk_groups [chunks]
// int32 -> [T, out_features] fp32.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& zero_scales, const at::Tensor& chunk_starts, const at::Tensor& chunk_groups,
                       int64_t bits, int64_t out_features) {
  constexpr const char* op = "raylm::int4_linear";
  const int64_t pack = checked_codes_per_word(op, bits, /*awq=*/false);  // AWQ's codes come repacked as GPTQ's
  check_tensor(op, "x", x, at::kFloat, {kAnySize, kAnySize}, "[T, K]");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % pack == 0, op, ": x's K (", K, ", the repacked inputs) must be whole words of ", pack, " codes");
  check_tensor(op, "weight", weight, at::kInt, {kAnySize, K / pack, kBlockColumns}, "[blocks, K / (32 / bits), 32]");
  const int64_t blocks = weight.size(0);
  TORCH_CHECK(out_features > (blocks - 1) * kBlockColumns && out_features <= blocks * kBlockColumns, op,
              ": out_features (", out_features, ") must fill the last of the ", blocks, " blocks of 32 columns");
  check_tensor(op, "scales", scales, at::kFloat, {blocks, kAnySize, kBlockColumns}, "[blocks, groups, 32]");
  const int64_t groups = scales.size(1);
  check_tensor(op, "zero_scales", zero_scales, at::kFloat, {blocks, groups, kBlockColumns}, "[blocks, groups, 32]");
  check_tensor(op, "chunk_groups", chunk_groups, at::kInt, {kAnySize}, "[chunks]");
  const int64_t chunks = chunk_groups.numel();
  check_tensor(op, "chunk_starts", chunk_starts, at::kInt, {chunks + 1}, "[chunks + 1]");
  const int32_t* starts = chunk_starts.data_ptr<int32_t>();
  const int32_t* chunk_group = chunk_groups.data_ptr<int32_t>();
  check_indices(op, "chunk_groups", chunk_group, chunks, groups);
  TORCH_CHECK(starts[0] == 0 && starts[chunks] == K, op, ": the chunks must cover K (", K, "), got rows ", starts[0],
              " to ", starts[chunks]);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t rows = starts[c + 1] - starts[c];
    TORCH_CHECK(rows > 0 && rows <= kChunkRows && rows % pack == 0, op, ": chunk ", c, " must be 1 to ", kChunkRows,
                " rows in whole words of ", pack, " codes, got ", rows);
  }
  at::Tensor out = at::empty({T, out_features}, x.options());
  if (T == 0) return out;
  const float* xs = x.data_ptr<float>();
  // Each token's sum over each chunk: what the chunk's zero times its scale multiplies.
  std::vector<float> xsum(T * chunks);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < chunks; ++c) {
      float sum = 0.0f;
      for (int32_t k = starts[c]; k < starts[c + 1]; ++k) sum += xs[t * K + k];
      xsum[t * chunks + c] = sum;
    }
  auto run = bits == 4 ? &int4_linear_blocks<4> : &int4_linear_blocks<8>;
  // Slabs of kSlabTokens tokens: every column block reads the slab's x again, which then
  // stays in L2 (x [2048, 1024] read whole by each block ran a prefill GEMM ~1.6x slower).
  for (int64_t t0 = 0; t0 < T; t0 += kSlabTokens) {
    const int64_t tokens = std::min<int64_t>(kSlabTokens, T - t0);
    run(xs + t0 * K, tokens, K, weight.data_ptr<int32_t>(), scales.data_ptr<float>(), zero_scales.data_ptr<float>(),
        groups, starts, chunk_group, chunks, xsum.data() + t0 * chunks, blocks, out_features,
        out.data_ptr<float>() + t0 * out_features);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("int4_linear(Tensor x, Tensor weight, Tensor scales, Tensor zero_scales, Tensor chunk_starts, "
        "Tensor chunk_groups, int bits, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("int4_linear", &int4_linear); }
