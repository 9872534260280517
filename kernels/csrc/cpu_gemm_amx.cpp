// bf16 linear layers on Intel AMX for decode-sized batches: y = x W^T (+ bias), fp32
// accumulation, one rounding to bf16.
//
// Why: at decode batch sizes a linear layer is one pass over its weight, so its floor is the
// weight's bytes at memory bandwidth. oneDNN's bf16 linear reached 8-9 GB/s of weight on
// a 2-core AMX Xeon at 64 tokens, a third of what the cores read (~25 GB/s). Here the weight
// is packed once into AMX tiles laid out in the order they are read, so a call streams it
// front to back (the hardware prefetcher follows, and we prefetch ahead too), while the
// activations, a few rows, are copied into tile order (1 KiB per tile) and stay in L1/L2.
// Measured there: 1.7-2.9x oneDNN's time per call up to 64 tokens, 1.1-1.5x at 256; inside
// the ~100M Llama's decode step, where the layers' weights are partly cached, the gain is
// smaller (GEMM time per step 14.3 -> 11.3 ms): at 64 tokens the tile multiplies and the
// weight stream still add up rather than overlap.
//
// Layout of the packed weight W [N, K]: N is padded to 16 and K to 32 with zeros; block
// (nb, kb) covers columns [16 nb, 16 nb + 16) of y and k in [32 kb, 32 kb + 32) and is the
// 1 KiB B tile of TDPBF16PS: 16 rows of k pairs, each 16 columns x (k, k + 1). Blocks are
// stored nb-major, so one column block's whole K is contiguous.
//
// A task takes one column block (16 outputs) for all rows, four 16-row tiles of x at a time
// (C in tmm0-3, the weight tile in tmm4, x tiles in tmm5-7). The ops are
// torch.ops.raylm.amx_pack_weight / amx_linear / amx_available (registered below); where the
// compiler does not target AMX (or RAYLM_CPU_ISA narrows it off) amx_available() is False
// and callers keep oneDNN.
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"
#include "huge_pages.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__) && defined(__x86_64__)
#define RAYLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define RAYLM_AMX 0
#endif

namespace {

using namespace raylm;

constexpr int64_t kTileN = 16;  // output columns of one block
constexpr int64_t kTileK = 32;  // bf16 k values of one block (16 pairs)
constexpr int64_t kTileM = 16;  // rows of x in one tile
constexpr int64_t kBlockElements = kTileN * kTileK;
// How far ahead (in 1 KiB weight blocks) to prefetch into L2; distances from 2 to 32 and
// L1 or L2 hints measured within noise of each other.
constexpr int64_t kPrefetchBlocks = 8;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

#if RAYLM_AMX
// Linux hands out the AMX register state only to processes that ask for it once.
bool request_amx_permission() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

const bool kAmxPermitted = request_amx_permission();

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {  // C tiles: 16 x 16 fp32; weight and x tiles: 16 x 64 bytes
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// C tiles 0..MB-1 = MB row tiles of x (in tile order) times one column block of the weight.
template <int MB>
void tile_rows(const uint16_t* x_tiles, const uint16_t* w_panel, int64_t k_blocks, float* c_out) {
  static_assert(MB >= 1 && MB <= 4);
  _tile_zero(0);
  if constexpr (MB > 1) _tile_zero(1);
  if constexpr (MB > 2) _tile_zero(2);
  if constexpr (MB > 3) _tile_zero(3);
  const int64_t row_tiles_apart = k_blocks * kBlockElements;  // x tile (i, kb) to (i + 1, kb)
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint16_t* w = w_panel + kb * kBlockElements;
    // The weight is read once, from memory: ask for a whole block kPrefetchBlocks ahead.
    const char* ahead = reinterpret_cast<const char*>(w + kPrefetchBlocks * kBlockElements);
    for (int line = 0; line < 1024; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    _tile_loadd(4, w, 64);
    const uint16_t* a = x_tiles + kb * kBlockElements;
    _tile_loadd(5, a, 64);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (MB > 1) {
      _tile_loadd(6, a + row_tiles_apart, 64);
      _tile_dpbf16ps(1, 6, 4);
    }
    if constexpr (MB > 2) {
      _tile_loadd(7, a + 2 * row_tiles_apart, 64);
      _tile_dpbf16ps(2, 7, 4);
    }
    if constexpr (MB > 3) {
      _tile_loadd(5, a + 3 * row_tiles_apart, 64);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
  _tile_stored(0, c_out, 64);
  if constexpr (MB > 1) _tile_stored(1, c_out + 256, 64);
  if constexpr (MB > 2) _tile_stored(2, c_out + 512, 64);
  if constexpr (MB > 3) _tile_stored(3, c_out + 768, 64);
}

// out[r][0:cols] = bf16(c[r][0:16] + bias[0:16]) for the rows of a stack of C tiles (16
// floats a row): one AVX-512 conversion a row, AVX512-BF16 rounding to nearest even as PyTorch.
void store_rows(const float* c, int64_t rows, int64_t cols, const float* bias, uint16_t* out, int64_t out_stride) {
  const __m512 b = _mm512_loadu_ps(bias);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * kTileN), b));
    _mm256_mask_storeu_epi16(out + r * out_stride, mask, reinterpret_cast<__m256i>(y));
  }
}
#endif

// x [M, K] (rows any stride, last dimension contiguous) -> tile order [M/16][K/32][16][32],
// zero-padded: a copy of 64-byte row pieces, cheaper than a permuting torch copy's dispatch.
[[maybe_unused]] void pack_rows(const at::Tensor& x, int64_t M, int64_t K, int64_t k_blocks, uint16_t* tiles) {
  const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
  const uint16_t* src = static_cast<const uint16_t*>(rows.data_ptr());
  const int64_t row_stride = rows.stride(0);
  const int64_t m_tiles = round_up(M, kTileM) / kTileM;
  for (int64_t mt = 0; mt < m_tiles; ++mt) {
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      uint16_t* tile = tiles + (mt * k_blocks + kb) * kBlockElements;
      const int64_t k0 = kb * kTileK, width = std::min(kTileK, K - k0);
      for (int64_t r = 0; r < kTileM; ++r) {
        const int64_t m = mt * kTileM + r;
        uint16_t* dst = tile + r * kTileK;
        const int64_t copied = m < M ? width : 0;
        if (copied > 0) std::memcpy(dst, src + m * row_stride + k0, copied * sizeof(uint16_t));
        if (copied < kTileK) std::memset(dst + copied, 0, (kTileK - copied) * sizeof(uint16_t));
      }
    }
  }
}

// w [N, K] bf16 -> [ceil(N/16), ceil(K/32), 16, 32] bf16 in the tile layout above.
at::Tensor amx_pack_weight(const at::Tensor& weight_in) {
  TORCH_CHECK(weight_in.device().is_cpu() && weight_in.dim() == 2 && weight_in.scalar_type() == at::kBFloat16,
              "raylm::amx_pack_weight takes a 2-D bf16 CPU weight [out_features, in_features]");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t n_blocks = round_up(N, kTileN) / kTileN, k_blocks = round_up(K, kTileK) / kTileK;
  at::Tensor packed = zeros_on_huge_pages({n_blocks, k_blocks, kTileK / 2, kTileN * 2}, weight.options());
  const uint16_t* w = static_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* p = static_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        uint16_t* block = p + (nb * k_blocks + kb) * kBlockElements;
        for (int64_t pair = 0; pair < kTileK / 2; ++pair) {
          for (int64_t j = 0; j < kTileN; ++j) {
            const int64_t n = nb * kTileN + j;
            for (int64_t half = 0; half < 2; ++half) {
              const int64_t k = kb * kTileK + 2 * pair + half;
              block[pair * kTileN * 2 + j * 2 + half] = (n < N && k < K) ? w[n * K + k] : uint16_t{0};
            }
          }
        }
      }
    }
  });
  return packed;
}

bool amx_available() {
#if RAYLM_AMX
  return kAmxPermitted;
#else
  return false;
#endif
}

// x [..., K] bf16, packed from amx_pack_weight of W [N, K], bias [N] bf16 or fp32 or None:
// returns x W^T + bias [..., N] bf16.
at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_available(), "raylm::amx_linear: this build or CPU has no AMX");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16 && x_in.dim() >= 1,
              "raylm::amx_linear takes bf16 CPU activations [..., K]");
  const int64_t K = x_in.size(-1);
  const int64_t k_blocks = round_up(K, kTileK) / kTileK, n_blocks = round_up(N, kTileN) / kTileN;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == n_blocks && packed.size(1) == k_blocks && packed.size(2) == kTileK / 2 &&
                  packed.size(3) == kTileN * 2,
              "raylm::amx_linear: the packed weight does not match K = ", K, " and N = ", N);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu() &&
                                    (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat)),
              "raylm::amx_linear: bias must be [N] bf16 or fp32");
  std::vector<int64_t> out_sizes(x_in.sizes().begin(), x_in.sizes().end());
  out_sizes.back() = N;
  at::Tensor out = at::empty(out_sizes, x_in.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = x_in.numel() / std::max<int64_t>(K, 1);
  if (M == 0 || N == 0) return out;
#if RAYLM_AMX
  // x goes to tile order, [M/16][K/32][16][32] (zero-padded): each tile a contiguous 1 KiB.
  // Read in place, a tile's 16 rows lie K * 2 bytes apart, which for K a multiple of 1024
  // maps them all to one or two L1 sets, and the x tiles of a step evict each other.
  const int64_t m_tiles = round_up(M, kTileM) / kTileM;
  at::Tensor x_tiles = at::empty({m_tiles, k_blocks, kTileM, kTileK}, x_in.options());
  pack_rows(x_in.reshape({M, K}), M, K, k_blocks, static_cast<uint16_t*>(x_tiles.data_ptr()));
  const uint16_t* xp = static_cast<const uint16_t*>(x_tiles.data_ptr());
  const uint16_t* wp = static_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* op = static_cast<uint16_t*>(out.data_ptr());
  // The bias in fp32, padded to whole column blocks (zeros without one).
  std::vector<float> bias_f32(n_blocks * kTileN, 0.0f);
  if (bias.has_value()) {
    const at::Tensor b = bias->contiguous();
    for (int64_t n = 0; n < N; ++n) {
      bias_f32[n] = b.scalar_type() == at::kBFloat16 ? to_float(static_cast<const uint16_t*>(b.data_ptr())[n])
                                                     : static_cast<const float*>(b.data_ptr())[n];
    }
  }
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[4 * kTileM * kTileN];
    for (int64_t nb = begin; nb < end; ++nb) {
      const uint16_t* panel = wp + nb * k_blocks * kBlockElements;
      const int64_t n0 = nb * kTileN, cols = std::min(kTileN, N - n0);
      const float* bias_row = bias_f32.data() + n0;
      for (int64_t mt = 0; mt < m_tiles; mt += 4) {
        const int mb = static_cast<int>(std::min<int64_t>(4, m_tiles - mt));
        const uint16_t* a = xp + mt * k_blocks * kBlockElements;
        switch (mb) {
          case 4: tile_rows<4>(a, panel, k_blocks, c); break;
          case 3: tile_rows<3>(a, panel, k_blocks, c); break;
          case 2: tile_rows<2>(a, panel, k_blocks, c); break;
          default: tile_rows<1>(a, panel, k_blocks, c); break;
        }
        const int64_t rows = std::min<int64_t>(mb * kTileM, M - mt * kTileM);
        store_rows(c, rows, cols, bias_row, op + mt * kTileM * N + n0, N);
      }
    }
    _tile_release();
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("amx_available() -> bool", &amx_available);  // no tensor arguments: one kernel for all
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed_weight, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("amx_pack_weight", &amx_pack_weight);
  m.impl("amx_linear", &amx_linear);
}
