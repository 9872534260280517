// Zeroed tensors on transparent huge pages, for the packed weights of the streaming GEMMs.
//
// Why: a decode step reads every weight once, front to back: ~200 MB for a ~100M-parameter
// bf16 model, far more than the TLB maps with 4 KiB pages (Zen 4's L2 TLB: 3,072 entries,
// 12 MiB), so each new page costs a page walk on the kernel's critical path, prefetches
// included. On 2 MiB pages, on a 2-core AMD EPYC (Zen 4) with THP in `madvise` mode (where
// a plain allocation never gets them), the ~100M Llama's 33 decode GEMMs of a step (64 rows,
// weights cold) ran at 415-434 GFLOP/s against 402-416, and that model's decode GEMMs over a
// whole generate took 3.69-3.70 s against 3.74-3.81 s.
//
// The mapping starts on a 2 MiB boundary and ends at the tensor's last 4 KiB page, so only
// whole 2 MiB stretches become huge pages and nothing is allocated beyond the tensor. Where
// the kernel has THP off (or mmap fails) the tensor is ordinary memory, as at::zeros would
// give; small tensors (under one huge page) are left to at::zeros.
// RAYLM_CPU_HUGE_PAGES=0 leaves every tensor to at::zeros: a huge page may have to be
// assembled (compacted) when memory is fragmented, which slows loading on a crowded machine.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/accumulate.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace raylm {

inline at::Tensor zeros_on_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options) {
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t bytes = static_cast<uintptr_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  const char* const wanted = std::getenv("RAYLM_CPU_HUGE_PAGES");
  if (bytes < kHugePage || (wanted != nullptr && std::strcmp(wanted, "0") == 0)) return at::zeros(sizes, options);
#ifdef MADV_HUGEPAGE
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t length = (bytes + page - 1) / page * page;
  // Over-allocate by one huge page, then give back what lies outside the aligned stretch.
  void* const raw = mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return at::zeros(sizes, options);
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t tail = start + length + kHugePage - (aligned + length);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + length), tail);
  void* const data = reinterpret_cast<void*>(aligned);
  madvise(data, length, MADV_HUGEPAGE);  // a failure (THP off) leaves ordinary pages: still correct
  // Anonymous mappings read as zeros, as at::zeros would give.
  return at::from_blob(data, sizes, [length](void* p) { munmap(p, length); }, options);
#else
  return at::zeros(sizes, options);
#endif
}

}  // namespace raylm
