// The CPU's peak FLOP/s for one dtype's widest multiply-add, measured: every thread of torch's
// pool runs a loop of independent register-only multiply-adds (no loads, no stores), and the
// op returns the FLOPs done over the wall time, all threads together.
//
// Why: the throughput benchmark's floors (cluster/benchmarks/workload_floors.py) compare the
// engine's GEMM time with the machine's limit. The nominal limit, cores x FLOPs per cycle x
// clock, needs a clock, and /proc/cpuinfo reports the base one: on a 2-core AMD EPYC (Zen 5)
// it said 2.60 GHz, giving 332 GFLOP/s fp32, while this loop ran at 513 (the cores boost to
// ~4 GHz) and oneDNN's large GEMMs at ~500: a "floor" the engine beat. The loop says what the
// FMA units do at the clock they run at, with the thread count the engine uses.
//
// Ops: torch.ops.raylm.cpu_peak_flops(dtype, iterations) -> float FLOP/s, 0.0 where the build
// has no such instruction for dtype; cpu_peak_flops_instruction(dtype) -> the instruction. fp32: AVX-512 vfmadd231ps on zmm (2 x 16 FLOPs each), else
// AVX2 FMA on ymm (2 x 8); bf16: AVX512-BF16 vdpbf16ps on zmm (2 x 32 FLOPs each), else the
// fp32 path (bf16 is then widened to fp32 to be multiplied).
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp.

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace {

// Sixteen independent accumulators: more than the FMA units' latency x ports (4 x 2 on Zen 4/5,
// Sapphire Rapids), so every cycle can issue. The asm touches registers only.
#define RAYLM_SIXTEEN(op, reg) \
  op " %%" reg "30, %%" reg "31, %%" reg "0\n\t" op " %%" reg "30, %%" reg "31, %%" reg "1\n\t" \
  op " %%" reg "30, %%" reg "31, %%" reg "2\n\t" op " %%" reg "30, %%" reg "31, %%" reg "3\n\t" \
  op " %%" reg "30, %%" reg "31, %%" reg "4\n\t" op " %%" reg "30, %%" reg "31, %%" reg "5\n\t" \
  op " %%" reg "30, %%" reg "31, %%" reg "6\n\t" op " %%" reg "30, %%" reg "31, %%" reg "7\n\t" \
  op " %%" reg "30, %%" reg "31, %%" reg "8\n\t" op " %%" reg "30, %%" reg "31, %%" reg "9\n\t" \
  op " %%" reg "30, %%" reg "31, %%" reg "10\n\t" op " %%" reg "30, %%" reg "31, %%" reg "11\n\t" \
  op " %%" reg "30, %%" reg "31, %%" reg "12\n\t" op " %%" reg "30, %%" reg "31, %%" reg "13\n\t" \
  op " %%" reg "30, %%" reg "31, %%" reg "14\n\t" op " %%" reg "30, %%" reg "31, %%" reg "15\n\t"

// AVX2 has sixteen ymm registers: twelve accumulators, two sources.
#define RAYLM_TWELVE_YMM(op)                                                                     \
  op " %%ymm14, %%ymm15, %%ymm0\n\t" op " %%ymm14, %%ymm15, %%ymm1\n\t" op " %%ymm14, %%ymm15, %%ymm2\n\t"    \
  op " %%ymm14, %%ymm15, %%ymm3\n\t" op " %%ymm14, %%ymm15, %%ymm4\n\t" op " %%ymm14, %%ymm15, %%ymm5\n\t"  \
  op " %%ymm14, %%ymm15, %%ymm6\n\t" op " %%ymm14, %%ymm15, %%ymm7\n\t" op " %%ymm14, %%ymm15, %%ymm8\n\t"  \
  op " %%ymm14, %%ymm15, %%ymm9\n\t" op " %%ymm14, %%ymm15, %%ymm10\n\t" op " %%ymm14, %%ymm15, %%ymm11\n\t"

#define RAYLM_CLOBBERS                                                                                        \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
      "xmm13", "xmm14", "xmm15"

enum class Loop { kNone, kAvx512Fp32, kAvx512Bf16, kAvx2Fp32 };

// FLOPs of one loop iteration (sixteen instructions; twelve on AVX2).
double flops_per_iteration(Loop loop) {
  switch (loop) {
    case Loop::kAvx512Fp32: return 16 * 2 * 16;
    case Loop::kAvx512Bf16: return 16 * 2 * 32;
    case Loop::kAvx2Fp32: return 12 * 2 * 8;
    default: return 0;
  }
}

Loop loop_for(c10::ScalarType dtype) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (dtype == c10::ScalarType::BFloat16) return Loop::kAvx512Bf16;
#endif
  if (dtype != c10::ScalarType::Float && dtype != c10::ScalarType::BFloat16) return Loop::kNone;
#if defined(__AVX512F__)
  return Loop::kAvx512Fp32;
#elif defined(__AVX2__) && defined(__FMA__)
  return Loop::kAvx2Fp32;
#else
  return Loop::kNone;
#endif
}

void run_loop(Loop loop, int64_t iterations) {
  for (int64_t i = 0; i < iterations; ++i) {
    switch (loop) {
#if defined(__AVX512F__)
      case Loop::kAvx512Fp32: asm volatile(RAYLM_SIXTEEN("vfmadd231ps", "zmm")::: RAYLM_CLOBBERS); break;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
      case Loop::kAvx512Bf16: asm volatile(RAYLM_SIXTEEN("vdpbf16ps", "zmm")::: RAYLM_CLOBBERS); break;
#endif
#if defined(__AVX2__) && defined(__FMA__)
      case Loop::kAvx2Fp32: asm volatile(RAYLM_TWELVE_YMM("vfmadd231ps")::: RAYLM_CLOBBERS); break;
#endif
      default: return;
    }
  }
}

double cpu_peak_flops(c10::ScalarType dtype, int64_t iterations) {
  TORCH_CHECK(iterations > 0, "cpu_peak_flops: iterations must be positive, got ", iterations);
  const Loop loop = loop_for(dtype);
  if (loop == Loop::kNone) return 0.0;
  const int threads = at::get_num_threads();
  run_loop(loop, iterations / 16 + 1);  // wakes this core from its idle clock
  const auto start = std::chrono::steady_clock::now();
  // One chunk per thread (grain 1), so every thread of the pool runs the loop once.
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) run_loop(loop, iterations);
  });
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
  return threads * static_cast<double>(iterations) * flops_per_iteration(loop) / seconds.count();
}

// The instruction the loop runs for dtype ("" where none).
std::string cpu_peak_flops_instruction(c10::ScalarType dtype) {
  switch (loop_for(dtype)) {
    case Loop::kAvx512Fp32: return "vfmadd231ps zmm";
    case Loop::kAvx512Bf16: return "vdpbf16ps zmm";
    case Loop::kAvx2Fp32: return "vfmadd231ps ymm";
    default: return "";
  }
}

}  // namespace

// No tensor argument to dispatch on: one kernel for every backend.
TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("cpu_peak_flops(ScalarType dtype, int iterations) -> float", &cpu_peak_flops);
  m.def("cpu_peak_flops_instruction(ScalarType dtype) -> str", &cpu_peak_flops_instruction);
}
