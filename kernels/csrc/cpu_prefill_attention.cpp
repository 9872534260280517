// Paged prefill attention on the CPU: the queries of sequences that add several tokens in a
// step (a prompt, a chunk of a chunked prefill, the uncached tail of a prefix-cached prompt),
// each attending causally to its whole context (or, in a sliding-window layer, to its last
// `window` positions), read straight from the paged cache.
//
// Flash-attention style. A task is one tile of a sequence's queries for one KV head: rows
// are (query position, query head) pairs over the query heads that share the KV head, so
// every key and value read serves all of them. The task walks the block table kChunk keys
// at a time: copies the chunk's keys and values to fp32 scratch (which also converts a bf16
// cache), scores the chunk against the tile and folds it into an online softmax in fp32.
// Only keys up to the tile's last position are read, so cache slots past seq_len and padded
// table entries never are; chunks that cross the tile's diagonal are masked, and rows whose
// position lies before a chunk skip it. With a window, keys start at the tile's first row's
// window (the blocks before it are never read: the engine may have freed them), chunks that
// cross a row's window start are masked there too, and rows whose window starts after a chunk
// skip it. Gemma 2's soft cap maps each score s to cap * tanh(s / cap) before the softmax.
//
// The tile's queries are kept transposed, [D][rows], so scores come out [keys][rows] with the
// rows along the vector lanes: the score microkernel broadcasts a key element against vectors
// of rows, the softmax runs lane-wise (a lane is a row), and the value microkernel broadcasts
// a probability against vectors of channels. Each microkernel holds a block of accumulators
// in registers. Scores are kept in log2 units (the queries are scaled by log2(e)) for a
// cheaper exp2. All of it is written once over `vfloat` (cpu_vec.h): 16 lanes with AVX-512,
// 8 with AVX2, plain floats elsewhere.
//
// Causal tiles at the end of a long sequence cost many times those at its start, so threads
// take tiles from a shared counter, in an order that keeps the keys and values they read
// in cache (see make_tasks).
//
// Queries and outputs are fp32 or bf16 (converted when a tile copies its queries and writes
// its rows); the cache fp32, bf16 or fp8 (E4M3 or E5M2, widened exactly as the chunk is copied;
// k_scale folded into the queries' scale, v_scale into the outputs'). The kernel is the PyTorch operator torch.ops.raylm.paged_prefill_attention
// (registered below).
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp (or a narrower ISA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace raylm;

constexpr int W = kVecWidth;

// Unrolls a register block's loop completely, so its accumulators live in registers.
#define RAYLM_UNROLL _Pragma("GCC unroll 16")
// Accumulator registers a microkernel may hold: of AVX-512's 32 registers (AVX2's 16), the
// rest hold the operands.
constexpr int kAccumulators = W == 16 ? 24 : 12;
// Vectors per microkernel row: 64 lanes with AVX-512, 16 with AVX2.
constexpr int kVectors = W == 16 ? 4 : W == 8 ? 2 : 4;
constexpr int kChunk = 64;     // keys per step of the online softmax
constexpr int kTileRows = 128;  // rows of a query tile, when there are enough tasks

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Calls f(std::integral_constant<int, count>) for a count in 1..N known only at run time.
template <int N, typename F>
inline void with_count(int count, F&& f) {
  if constexpr (N > 1) {
    if (count < N) return with_count<N - 1>(count, f);
  }
  f(std::integral_constant<int, N>{});
}

// scores[t][0:NV*W] = sum_d keys[t][d] * qt[d][0:NV*W] for T keys; keys rows are D apart,
// qt and scores rows `stride` apart.
template <int T, int NV>
inline void score_block(const float* keys, const float* qt, int D, int64_t stride, float* scores) {
  vfloat acc[T][NV];
  RAYLM_UNROLL
  for (int t = 0; t < T; ++t)
    RAYLM_UNROLL
    for (int j = 0; j < NV; ++j) acc[t][j] = vset1(0.0f);
  for (int d = 0; d < D; ++d) {
    vfloat q[NV];
    RAYLM_UNROLL
    for (int j = 0; j < NV; ++j) q[j] = vload(qt + d * stride + j * W);
    RAYLM_UNROLL
    for (int t = 0; t < T; ++t) {
      const vfloat k = vset1(keys[t * D + d]);
      RAYLM_UNROLL
      for (int j = 0; j < NV; ++j) acc[t][j] = vfmadd(k, q[j], acc[t][j]);
    }
  }
  RAYLM_UNROLL
  for (int t = 0; t < T; ++t)
    RAYLM_UNROLL
    for (int j = 0; j < NV; ++j) vstore(scores + t * stride + j * W, acc[t][j]);
}

template <int NV>
void score_keys(const float* keys, int n, const float* qt, int D, int64_t stride, float* scores) {
  constexpr int T = std::min(12, kAccumulators / NV);
  int t = 0;
  for (; t + T <= n; t += T) score_block<T, NV>(keys + t * D, qt, D, stride, scores + t * stride);
  if (t < n) {
    with_count<T - 1>(n - t, [&](auto rest) {
      score_block<decltype(rest)::value, NV>(keys + t * D, qt, D, stride, scores + t * stride);
    });
  }
}

// scores[t][r] = keys[t] . queries[r] for keys t < n and rows r of vectors [first_vector,
// num_vectors).
void score_chunk(const float* keys, int n, const float* qt, int D, int64_t stride, int first_vector, int num_vectors,
                 float* scores) {
  int v = first_vector;
  for (; v + kVectors <= num_vectors; v += kVectors) score_keys<kVectors>(keys, n, qt + v * W, D, stride, scores + v * W);
  if (v < num_vectors) {
    with_count<kVectors - 1>(num_vectors - v, [&](auto rest) {
      score_keys<decltype(rest)::value>(keys, n, qt + v * W, D, stride, scores + v * W);
    });
  }
}

// The chunk's step of the online softmax for the rows of vectors [first_vector, num_vectors):
// caps the scores (soft_cap > 0, in the scores' log2 units), masks the scores of keys past each
// row's position (only on the diagonal) and, with a window, of keys before each row's window
// (only on a window's edge), raises the running maxima, turns scores into exp(score - max) in
// place, and leaves in alpha the factor that rescales what each row accumulated so far. A row
// that has seen no key yet (its window starts later) keeps a -inf maximum: its exponentials are
// then taken against 0, so that no lane computes -inf - -inf, and all come out 0.
void softmax_chunk(float* scores, int64_t stride, int n, int64_t first_key, bool diagonal, bool window_edge,
                   int64_t window, float soft_cap, const float* positions, int first_vector, int num_vectors,
                   float* running_max, float* running_sum, float* alpha) {
  const vfloat minus_inf = vset1(-std::numeric_limits<float>::infinity());
  for (int v = first_vector; v < num_vectors; ++v) {
    float* s = scores + v * W;
    if (soft_cap > 0.0f) {
      for (int t = 0; t < n; ++t) vstore(s + t * stride, vsoft_cap(vload(s + t * stride), soft_cap));
    }
    const vfloat old_max = vload(running_max + v * W);
    vfloat new_max = old_max;
    if (diagonal || window_edge) {
      const vfloat position = vload(positions + v * W);
      // Key k is in the row's window when k > position - window, i.e. window_end > k.
      const vfloat window_end = vsub(position, vset1(static_cast<float>(window - 1)));
      for (int t = 0; t < n; ++t) {
        const vfloat key = vset1(static_cast<float>(first_key + t));
        vfloat x = vselect_greater(key, position, minus_inf, vload(s + t * stride));
        if (window_edge) x = vselect_greater(window_end, key, minus_inf, x);
        vstore(s + t * stride, x);
        new_max = vmax(new_max, x);
      }
    } else {
      // Four chains: one vmax waits for the last, so a single chain runs at its latency.
      vfloat partial[4] = {new_max, new_max, new_max, new_max};
      int t = 0;
      for (; t + 4 <= n; t += 4)
        for (int u = 0; u < 4; ++u) partial[u] = vmax(partial[u], vload(s + (t + u) * stride));
      for (; t < n; ++t) partial[0] = vmax(partial[0], vload(s + t * stride));
      new_max = vmax(vmax(partial[0], partial[1]), vmax(partial[2], partial[3]));
    }
    const vfloat shift = vselect_greater(new_max, minus_inf, new_max, vset1(0.0f));
    vfloat sum = vset1(0.0f);
    for (int t = 0; t < n; ++t) {
      const vfloat p = vexp2_nonpositive(vsub(vload(s + t * stride), shift));
      vstore(s + t * stride, p);
      sum = vadd(sum, p);
    }
    const vfloat rescale = vexp2_nonpositive(vsub(old_max, shift));
    vstore(alpha + v * W, rescale);
    vstore(running_sum + v * W, vfmadd(vload(running_sum + v * W), rescale, sum));
    vstore(running_max + v * W, new_max);
  }
}

// out[r][0:NV*W] = alpha[r] * out[r][0:NV*W] + sum_t probs[t][r] * values[t][0:NV*W] for R
// rows and n keys; probs rows are `stride` apart, values and out rows `value_stride`.
template <int R, int NV>
inline void accumulate_block(const float* probs, int64_t stride, int n, const float* values, int64_t value_stride,
                             const float* alpha, float* out) {
  vfloat acc[R][NV];
  RAYLM_UNROLL
  for (int r = 0; r < R; ++r) {
    const vfloat a = vset1(alpha[r]);
    RAYLM_UNROLL
    for (int j = 0; j < NV; ++j) acc[r][j] = vmul(vload(out + r * value_stride + j * W), a);
  }
  for (int t = 0; t < n; ++t) {
    vfloat v[NV];
    RAYLM_UNROLL
    for (int j = 0; j < NV; ++j) v[j] = vload(values + t * value_stride + j * W);
    RAYLM_UNROLL
    for (int r = 0; r < R; ++r) {
      const vfloat p = vset1(probs[t * stride + r]);
      RAYLM_UNROLL
      for (int j = 0; j < NV; ++j) acc[r][j] = vfmadd(p, v[j], acc[r][j]);
    }
  }
  RAYLM_UNROLL
  for (int r = 0; r < R; ++r)
    RAYLM_UNROLL
    for (int j = 0; j < NV; ++j) vstore(out + r * value_stride + j * W, acc[r][j]);
}

template <int NV>
void accumulate_rows(const float* probs, int64_t stride, int n, const float* values, int64_t value_stride,
                     const float* alpha, int first_row, int rows, float* out) {
  constexpr int R = std::min(12, kAccumulators / NV);
  int r = first_row;
  for (; r + R <= rows; r += R) {
    accumulate_block<R, NV>(probs + r, stride, n, values, value_stride, alpha + r, out + r * value_stride);
  }
  if (r < rows) {
    with_count<R - 1>(rows - r, [&](auto rest) {
      accumulate_block<decltype(rest)::value, NV>(probs + r, stride, n, values, value_stride, alpha + r,
                                                  out + r * value_stride);
    });
  }
}

// out[r] = alpha[r] * out[r] + sum_t probs[t][r] * values[t] for rows [first_row, rows); the
// rows and values are padded_d = D rounded up to W channels wide.
void accumulate_chunk(const float* probs, int64_t stride, int n, const float* values, int padded_d, const float* alpha,
                      int first_row, int rows, float* out) {
  const int channel_vectors = padded_d / W;
  int v = 0;
  for (; v + kVectors <= channel_vectors; v += kVectors) {
    accumulate_rows<kVectors>(probs, stride, n, values + v * W, padded_d, alpha, first_row, rows, out + v * W);
  }
  if (v < channel_vectors) {
    with_count<kVectors - 1>(channel_vectors - v, [&](auto rest) {
      accumulate_rows<decltype(rest)::value>(probs, stride, n, values + v * W, padded_d, alpha, first_row, rows,
                                            out + v * W);
    });
  }
}

template <typename cache_t>
inline void copy_row(const cache_t* src, int D, float* dst) {
  int d = 0;
  for (; d + W <= D; d += W) vstore(dst + d, vload(src + d));
  for (; d < D; ++d) dst[d] = to_float(src[d]);
}

struct Task {
  int64_t seq;
  int64_t kv_head;
  int64_t first_query;  // the tile's first query, counted within its sequence
  int64_t seq_cost;     // the sequence's causal (query, key) pairs: its work per KV head
};

struct Problem {
  const void* query;  // fp32, or bf16 when io_bf16, rows query_stride apart; out as query, contiguous
  int64_t query_stride;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  void* out;
  bool io_bf16;
  int64_t num_heads, num_kv_heads, block_size, max_blocks;
  int head_size;
  float scale;
  int64_t window;  // > 0: each query attends to its last `window` positions
  float soft_cap;  // > 0: scores s become soft_cap * tanh(s / soft_cap)
  float k_scale, v_scale;  // an fp8 cache's: they multiply the scores and the outputs (1 otherwise)
  const float* sinks;  // null, or [num_heads]: each head's attention sink (a logit with no value)
};

// The first position that any of a sequence's queries from first_position on attends to.
inline int64_t window_start(int64_t first_position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
}

template <typename cache_t>
class TileWorker {
 public:
  TileWorker(const Problem& p, const cache_t* k_cache, const cache_t* v_cache, int tile_positions)
      : p_(p), k_cache_(k_cache), v_cache_(v_cache), tile_positions_(tile_positions) {
    const int D = p.head_size;
    group_ = static_cast<int>(p.num_heads / p.num_kv_heads);
    padded_d_ = static_cast<int>(round_up(D, W));
    const int64_t max_stride = round_up(static_cast<int64_t>(tile_positions) * group_, W);
    qt_.resize(D * max_stride);
    scores_.resize(kChunk * max_stride);
    keys_.resize(kChunk * D);
    values_.assign(kChunk * padded_d_, 0.0f);  // channels D.. stay zero
    acc_.resize(max_stride * padded_d_);
    positions_.resize(max_stride);
    running_max_.resize(max_stride);
    running_sum_.resize(max_stride);
    alpha_.resize(max_stride);
  }

  void run(const Task& task) {
    const int D = p_.head_size;
    const int64_t query_begin = p_.query_start_loc[task.seq];
    const int64_t query_len = p_.query_start_loc[task.seq + 1] - query_begin;
    const int64_t seq_len = p_.seq_lens[task.seq];
    const int positions = static_cast<int>(std::min<int64_t>(tile_positions_, query_len - task.first_query));
    const int64_t first_position = seq_len - query_len + task.first_query;
    const int64_t first_token = query_begin + task.first_query;  // its row of query and out
    const int64_t first_head = task.kv_head * group_;
    const int rows = positions * group_;
    const int row_vectors = static_cast<int>(round_up(rows, W) / W);
    const int64_t stride = static_cast<int64_t>(row_vectors) * W;

    // Scores in log2 units, for exp2.
    const float scale = p_.scale * p_.k_scale * 1.44269504088896341f;
    // Rows are position-major: row i * group + g is position first_position + i, head g.
    std::fill(qt_.begin(), qt_.begin() + D * stride, 0.0f);
    for (int i = 0; i < positions; ++i) {
      for (int g = 0; g < group_; ++g) {
        const int64_t first_element = (first_token + i) * p_.query_stride + (first_head + g) * D;
        const int r = i * group_ + g;
        if (p_.io_bf16) {
          const uint16_t* src = static_cast<const uint16_t*>(p_.query) + first_element;
          for (int d = 0; d < D; ++d) qt_[d * stride + r] = to_float(src[d]) * scale;
        } else {
          const float* src = static_cast<const float*>(p_.query) + first_element;
          for (int d = 0; d < D; ++d) qt_[d * stride + r] = src[d] * scale;
        }
        positions_[r] = static_cast<float>(first_position + i);
      }
    }
    // Padding lanes score 0 against every key: finite, never masked, never written out.
    std::fill(positions_.begin() + rows, positions_.begin() + stride, std::numeric_limits<float>::max());
    std::fill(running_max_.begin(), running_max_.begin() + stride, -std::numeric_limits<float>::infinity());
    std::fill(running_sum_.begin(), running_sum_.begin() + stride, 0.0f);
    std::fill(acc_.begin(), acc_.begin() + rows * padded_d_, 0.0f);

    const int32_t* table = p_.block_tables + task.seq * p_.max_blocks;
    const int64_t end = first_position + positions;  // keys up to the tile's last position
    const int64_t window = p_.window;
    // The soft cap in the scores' log2 units: log2(e) * cap * tanh(s / cap).
    const float soft_cap = p_.soft_cap * 1.44269504088896341f;
    for (int64_t first_key = window_start(first_position, window); first_key < end; first_key += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, end - first_key));
      for_each_key(table, task.kv_head, first_key, n, [&](int t, int64_t offset) {
        copy_row(k_cache_ + offset, D, keys_.data() + t * D);
        copy_row(v_cache_ + offset, D, values_.data() + t * padded_d_);
      });
      const bool diagonal = first_key + n - 1 > first_position;
      // Some row's window starts after the chunk's first key.
      const bool window_edge = window > 0 && first_key <= end - 1 - window;
      // Rows at positions before this chunk see none of it, nor do rows whose window starts
      // after it: leave them as they are.
      const int first_row = static_cast<int>(std::max<int64_t>(0, first_key - first_position) * group_);
      const int last_row = window > 0 ? static_cast<int>(std::clamp<int64_t>(
                                            first_key + n - 1 + window - first_position, 0, positions) * group_)
                                      : rows;
      if (first_row >= last_row) continue;
      const int first_vector = first_row / W;
      const int last_vector = static_cast<int>(round_up(last_row, W) / W);
      score_chunk(keys_.data(), n, qt_.data(), D, stride, first_vector, last_vector, scores_.data());
      softmax_chunk(scores_.data(), stride, n, first_key, diagonal, window_edge, window, soft_cap, positions_.data(),
                    first_vector, last_vector, running_max_.data(), running_sum_.data(), alpha_.data());
      accumulate_chunk(scores_.data(), stride, n, values_.data(), padded_d_, alpha_.data(), first_row, last_row,
                       acc_.data());
    }

    for (int i = 0; i < positions; ++i) {
      for (int g = 0; g < group_; ++g) {
        const int r = i * group_ + g;
        // The sink joins the denominator relative to the row's maximum (log2 units, as the
        // scores here; k_scale is in the scores already, not in the sink).
        const float sink_term = p_.sinks == nullptr
                                    ? 0.0f
                                    : std::exp2(p_.sinks[first_head + g] * 1.44269504088896341f - running_max_[r]);
        const float inv = p_.v_scale / (running_sum_[r] + sink_term);
        const int64_t first_element = ((first_token + i) * p_.num_heads + first_head + g) * D;
        if (p_.io_bf16) {
          uint16_t* dst = static_cast<uint16_t*>(p_.out) + first_element;
          for (int d = 0; d < D; ++d) dst[d] = to_bf16(acc_[r * padded_d_ + d] * inv);
        } else {
          float* dst = static_cast<float*>(p_.out) + first_element;
          for (int d = 0; d < D; ++d) dst[d] = acc_[r * padded_d_ + d] * inv;
        }
      }
    }
  }

 private:
  // Calls f(t, offset) for the keys first_key + t, t < n, with the offset of the key's row
  // for this KV head in the cache. One division, not one per key.
  template <typename F>
  void for_each_key(const int32_t* table, int64_t kv_head, int64_t first_key, int n, F&& f) const {
    const int64_t token_stride = p_.num_kv_heads * p_.head_size;
    int64_t block = first_key / p_.block_size, in_block = first_key % p_.block_size;
    for (int t = 0; t < n; ++t) {
      f(t, (table[block] * p_.block_size + in_block) * token_stride + kv_head * p_.head_size);
      if (++in_block == p_.block_size) {
        in_block = 0;
        ++block;
      }
    }
  }

  const Problem& p_;
  const cache_t* k_cache_;
  const cache_t* v_cache_;
  int tile_positions_, group_ = 1, padded_d_ = 0;
  // qt_ [D][stride]: the tile's queries, scaled; scores_ [kChunk][stride]; keys_ [kChunk][D];
  // values_ [kChunk][padded_d_]; acc_ [rows][padded_d_]; the rest one float per row.
  std::vector<float> qt_, scores_, keys_, values_, acc_, positions_, running_max_, running_sum_, alpha_;
};

// The tiles in the order threads take them: the costliest sequence first, and within it one KV
// head after the other, its last tile (the costliest) first. A thread's next tile then mostly
// reads the keys and values its last one left in cache, and the last tiles handed out are
// small ones, which evens out the threads' finishing times.
std::vector<Task> make_tasks(const Problem& p, int64_t num_seqs, int64_t min_query_len, int tile_positions) {
  std::vector<Task> tasks;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
    if (query_len < std::max<int64_t>(1, min_query_len)) continue;
    const int64_t context = p.seq_lens[seq] - query_len;  // keys before the first query
    const int64_t seq_cost = p.window > 0 ? query_len * std::min<int64_t>(p.window, p.seq_lens[seq])
                                          : query_len * context + query_len * (query_len + 1) / 2;
    const int64_t last_tile = (query_len - 1) / tile_positions * tile_positions;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t first = last_tile; first >= 0; first -= tile_positions) tasks.push_back({seq, h, first, seq_cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.seq_cost > b.seq_cost; });
  return tasks;
}

template <typename cache_t>
void prefill(const Problem& p, const cache_t* k_cache, const cache_t* v_cache, int64_t num_seqs,
             int64_t min_query_len) {
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int64_t threads = at::get_num_threads();
  // Tiles of kTileRows rows, halved (down to one vector of rows) while that leaves fewer
  // than two tasks per thread.
  int tile_positions = std::max(1, kTileRows / group);
  std::vector<Task> tasks = make_tasks(p, num_seqs, min_query_len, tile_positions);
  while (tile_positions > 1 && tile_positions / 2 * group >= W && static_cast<int64_t>(tasks.size()) < 2 * threads) {
    tile_positions /= 2;
    tasks = make_tasks(p, num_seqs, min_query_len, tile_positions);
  }
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min(threads, num_tasks), 1, [&](int64_t, int64_t) {
    TileWorker<cache_t> worker(p, k_cache, v_cache, tile_positions);
    for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) worker.run(tasks[i]);
  });
}

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

bool is_fp8(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

// query [T, Hq, D] fp32 or bf16; k_cache, v_cache [num_blocks, block_size, Hkv, D] fp32, bf16
// or fp8 (e4m3fn, e5m2: read as fp8 * k_scale and fp8 * v_scale, the scales applied to the
// scores and outputs as in paged_decode_attention; other caches ignore them); block_tables [S, max_blocks], seq_lens [S] and query_start_loc [S + 1] int32. Returns
// [T, Hq, D] in the query's dtype: the rows of every sequence with at least min_query_len
// queries, zeros in all other rows (other sequences', padding tokens'). sliding_window > 0:
// each query attends to its last sliding_window positions, and the blocks before the first
// query's window are not read; logits_soft_cap > 0 caps the scores (0 turns either off);
// sinks [Hq] (or None): each query head's attention sink, one more logit in its softmax. A
// sequence whose query rows or seq_len do not fit (rows outside 0..T, more queries than
// seq_len, a block table too short or naming a block outside the cache where it is read) is a
// ValueError, and nothing is computed.
at::Tensor paged_prefill_attention(const at::Tensor& query_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                   const at::Tensor& query_start_loc, double scale, int64_t min_query_len,
                                   int64_t sliding_window, double logits_soft_cap, double k_scale, double v_scale,
                                   const c10::optional<at::Tensor>& sinks_in) {
  // Rows may be strided (q, a column slice of the qkv projection): no copy.
  const bool rows_packed = query_in.dim() == 3 && query_in.stride(2) == 1 && query_in.stride(1) == query_in.size(2);
  const at::Tensor query = rows_packed ? query_in : query_in.contiguous();
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu() && query_start_loc.device().is_cpu(),
              "raylm::paged_prefill_attention takes CPU tensors");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "raylm::paged_prefill_attention takes query [T, Hq, D] and contiguous caches [num_blocks, block_size, "
              "Hkv, D] of one dtype");
  TORCH_CHECK(is_float_or_bf16(query) && (is_float_or_bf16(k_cache) || is_fp8(k_cache)),
              "raylm::paged_prefill_attention takes fp32 or bf16 queries and fp32, bf16 or fp8 caches");
  TORCH_CHECK_VALUE(std::isfinite(k_scale) && k_scale > 0.0 && std::isfinite(v_scale) && v_scale > 0.0,
                    "raylm::paged_prefill_attention: k_scale (", k_scale, ") and v_scale (", v_scale,
                    ") must be positive and finite");
  const int64_t T = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0,
              "raylm::paged_prefill_attention: the caches' head size must be the query's, Hq a multiple of Hkv");
  const int64_t S = seq_lens.numel();
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous() && query_start_loc.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == S && query_start_loc.numel() == S + 1,
              "raylm::paged_prefill_attention takes contiguous int32 block_tables [S, max_blocks], seq_lens [S] and "
              "query_start_loc [S + 1]");
  TORCH_CHECK_VALUE(sliding_window >= 0 && logits_soft_cap >= 0.0, "raylm::paged_prefill_attention: sliding_window (",
                    sliding_window, ") and logits_soft_cap (", logits_soft_cap, ") must be >= 0 (0: off)");
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(sinks.device().is_cpu() && sinks.dim() == 1 && sinks.size(0) == Hq,
                      "raylm::paged_prefill_attention: sinks must be one value per query head [", Hq, "], got ",
                      sinks.sizes());
  }
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = static_cast<const int32_t*>(block_tables.data_ptr());
  const int32_t* lens = static_cast<const int32_t*>(seq_lens.data_ptr());
  const int32_t* starts = static_cast<const int32_t*>(query_start_loc.data_ptr());
  // The kernel trusts the metadata; check it once here rather than read out of bounds.
  for (int64_t s = 0; s < S; ++s) {
    const int64_t begin = starts[s], end = starts[s + 1];
    TORCH_CHECK_VALUE(0 <= begin && begin <= end && end <= T && end - begin <= lens[s], "Sequence ", s,
                      " has query rows query_start_loc[", s, ":", s + 2, "] = ", begin, "..", end, " of ", T,
                      " and seq_lens[", s, "] = ", lens[s],
                      "; its queries must be rows of the query and at most seq_len of them.");
    const int64_t used = (static_cast<int64_t>(lens[s]) + block_size - 1) / block_size;
    bool fits = used <= max_blocks;
    for (int64_t i = window_start(lens[s] - (end - begin), sliding_window) / block_size; fits && i < used; ++i)
      fits = tables[s * max_blocks + i] >= 0 && tables[s * max_blocks + i] < num_blocks;
    TORCH_CHECK_VALUE(fits, "seq_lens[", s, "] = ", lens[s], " does not fit its block table (", max_blocks,
                      " entries of ", block_size, " tokens, blocks below ", num_blocks, ").");
  }
  // Rows no task computes (sequences below min_query_len, padding tokens) are zero.
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t row_bytes = Hq * D * query.element_size();
  char* out_bytes = static_cast<char*>(out.data_ptr());
  int64_t computed_until = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t begin = starts[s], end = starts[s + 1];
    if (end - begin >= std::max<int64_t>(1, min_query_len)) {
      std::fill(out_bytes + computed_until * row_bytes, out_bytes + begin * row_bytes, 0);
      computed_until = end;
    }
  }
  std::fill(out_bytes + computed_until * row_bytes, out_bytes + T * row_bytes, 0);
  const Problem problem{query.data_ptr(), query.stride(0), tables, lens, starts, out.data_ptr(), query.scalar_type() == at::kBFloat16,
                        Hq, Hkv, block_size, max_blocks, static_cast<int>(D), static_cast<float>(scale),
                        sliding_window, static_cast<float>(logits_soft_cap),
                        is_fp8(k_cache) ? static_cast<float>(k_scale) : 1.0f,
                        is_fp8(k_cache) ? static_cast<float>(v_scale) : 1.0f,
                        sinks.defined() ? sinks.data_ptr<float>() : nullptr};
  const auto run = [&](auto element) {
    using cache_t = decltype(element);
    prefill(problem, static_cast<const cache_t*>(k_cache.data_ptr()), static_cast<const cache_t*>(v_cache.data_ptr()),
            S, min_query_len);
  };
  switch (k_cache.scalar_type()) {
    case at::kBFloat16: run(uint16_t{}); break;
    case at::kFloat8_e4m3fn: run(fp8_e4m3{}); break;
    case at::kFloat8_e5m2: run(fp8_e5m2{}); break;
    default: run(float{}); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("paged_prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int min_query_len, int sliding_window=0, "
        "float logits_soft_cap=0.0, float k_scale=1.0, float v_scale=1.0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
