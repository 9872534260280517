// Collectives between the tensor-parallel ranks of one machine, through a shared-memory
// segment that every rank has mapped (`raylm/parallel/shm_communicator.py` makes it).
//
// gloo moves each all-reduce over TCP loopback: a send, a receive and a wake-up per rank,
// hundreds of microseconds on a loaded machine, several times per layer. Here a rank copies
// its tensor into its own slot, publishes a sequence number, and waits until every rank has
// published the same one; the data is then read straight out of the other ranks' slots.
//
// Segment layout: kMaxRanks cache lines of arrival counters, then two sets of `world_size`
// slots of `slot_bytes`. Collective number `seq` (1, 2, ...) uses set `seq & 1`. A rank
// writes set s at `seq` only after every rank has arrived at `seq - 1`, that is, after every
// rank has finished reading set s at `seq - 2` (ranks read a collective's slots before they
// start the next one): two sets are enough, and no collective waits twice.
//
// The ops are PyTorch operators (`torch.ops.raylm.shm_*`), registered below.
//
// Built by raylm/kernels/native_build.py with -O3 -march=native -fopenmp (or a narrower ISA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RAYLM_CPU_RELAX() _mm_pause()
#else
#define RAYLM_CPU_RELAX() ((void)0)
#endif

#include "cpu_vec.h"

namespace {

using namespace raylm;

constexpr int64_t kMaxRanks = 64;
constexpr int64_t kCacheLine = 64;
constexpr int64_t kHeaderBytes = kMaxRanks * kCacheLine;
// Busy polls before a waiting rank starts giving its core away: a peer on another core
// usually arrives within them; on a machine with fewer cores than processes, yielding is
// what lets the peer run at all.
constexpr int kSpinsBeforeYield = 256;
// A rank still waiting after this long has a peer that is stuck, dead or descheduled (a
// peer's share of a step arrives in microseconds to milliseconds): it then sleeps between
// polls instead of yielding, so that a rank waiting out worker_timeout_s for a peer that
// never comes does not hold a core for all of it.
constexpr std::chrono::milliseconds kYieldFor{20};
constexpr std::chrono::microseconds kSleepBetweenPolls{500};

static_assert(sizeof(std::atomic<int64_t>) == 8 && std::atomic<int64_t>::is_always_lock_free,
              "arrival counters must be lock-free 8-byte atomics to live in shared memory");

std::atomic<int64_t>* arrival(uint8_t* segment, int64_t rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(segment + rank * kCacheLine);
}

int64_t header_bytes() { return kHeaderBytes; }

void check_segment(const at::Tensor& segment, int64_t rank, int64_t world_size, int64_t slot_bytes) {
  TORCH_CHECK(world_size >= 1 && world_size <= kMaxRanks, "shm collectives: world_size must be in [1, ",
              kMaxRanks, "], got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "shm collectives: rank ", rank, " outside [0, ", world_size, ")");
  TORCH_CHECK(segment.device().is_cpu() && segment.scalar_type() == at::kByte && segment.is_contiguous(),
              "shm collectives: the segment must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % kCacheLine == 0, "shm collectives: slot_bytes must be a positive "
              "multiple of ", kCacheLine, ", got ", slot_bytes);
  TORCH_CHECK(segment.numel() >= kHeaderBytes + 2 * world_size * slot_bytes, "shm collectives: a segment of ",
              segment.numel(), " bytes is too small for ", world_size, " ranks of ", slot_bytes, "-byte slots");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(segment.data_ptr()) % kCacheLine == 0,
              "shm collectives: the segment must be cache-line aligned");
}

// Waits until every rank has arrived at `seq`; raises naming the late ranks after timeout_s.
void wait_for_all(uint8_t* segment, int64_t world_size, int64_t seq, double timeout_s, int64_t self) {
  using clock = std::chrono::steady_clock;
  clock::time_point deadline{}, waiting_since{};
  bool deadline_set = false;
  for (int64_t r = 0; r < world_size; ++r) {
    std::atomic<int64_t>* counter = arrival(segment, r);
    int spins = 0;
    bool sleeping = false;
    while (counter->load(std::memory_order_acquire) < seq) {
      if (++spins < kSpinsBeforeYield) {
        RAYLM_CPU_RELAX();
        continue;
      }
      if (sleeping) {
        std::this_thread::sleep_for(kSleepBetweenPolls);
      } else {
        sched_yield();
        if ((spins & 255) != 0) continue;
      }
      const auto now = clock::now();
      if (!deadline_set) {
        waiting_since = now;
        deadline = now + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
        deadline_set = true;
      } else if (!sleeping && now - waiting_since > kYieldFor) {
        sleeping = true;
      } else if (now > deadline) {
        std::string late;
        for (int64_t q = 0; q < world_size; ++q) {
          if (arrival(segment, q)->load(std::memory_order_acquire) < seq) late += (late.empty() ? "" : ", ") + std::to_string(q);
        }
        TORCH_CHECK(false, "shared-memory collective #", seq, ": tensor-parallel rank(s) [", late,
                    "] did not arrive within ", timeout_s, " s (seen from rank ", self, ")");
      }
    }
  }
}

uint8_t* slot(uint8_t* segment, int64_t seq, int64_t world_size, int64_t rank, int64_t slot_bytes) {
  return segment + kHeaderBytes + ((seq & 1) * world_size + rank) * slot_bytes;
}

// Publishes `x` (contiguous, at most slot_bytes) as this rank's part of collective `seq` and
// waits for every rank's part. Afterwards every rank's part can be read from its slot until
// this rank starts collective seq + 1.
void shm_exchange(const at::Tensor& x, const at::Tensor& segment, int64_t rank, int64_t world_size, int64_t seq,
                  int64_t slot_bytes, double timeout_s) {
  check_segment(segment, rank, world_size, slot_bytes);
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "shm_exchange: x must be a contiguous CPU tensor");
  const int64_t nbytes = x.numel() * static_cast<int64_t>(x.element_size());
  TORCH_CHECK(nbytes <= slot_bytes, "shm_exchange: ", nbytes, " bytes do not fit a ", slot_bytes, "-byte slot");
  TORCH_CHECK(seq >= 1, "shm_exchange: seq must be at least 1, got ", seq);
  uint8_t* base = segment.data_ptr<uint8_t>();
  // Every rank has read set (seq & 1) of collective seq - 2 once it has arrived at seq - 1.
  wait_for_all(base, world_size, seq - 1, timeout_s, rank);
  if (nbytes > 0) std::memcpy(slot(base, seq, world_size, rank, slot_bytes), x.data_ptr(), nbytes);
  arrival(base, rank)->store(seq, std::memory_order_release);
  wait_for_all(base, world_size, seq, timeout_s, rank);
}

template <typename scalar_t>
void sum_slots(scalar_t* out, uint8_t* base, int64_t seq, int64_t world_size, int64_t slot_bytes, int64_t n) {
  const scalar_t* parts[kMaxRanks];
  for (int64_t r = 0; r < world_size; ++r) parts[r] = reinterpret_cast<const scalar_t*>(slot(base, seq, world_size, r, slot_bytes));
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kVecWidth <= end; i += kVecWidth) {
      vfloat acc = vload(parts[0] + i);
      for (int64_t r = 1; r < world_size; ++r) acc = vadd(acc, vload(parts[r] + i));
      vstore(out + i, acc);
    }
    for (; i < end; ++i) {
      float acc = to_float(parts[0][i]);
      for (int64_t r = 1; r < world_size; ++r) acc += to_float(parts[r][i]);
      store_scalar(out + i, acc);
    }
  });
}

// x (fp32 or bf16, contiguous, at most slot_bytes) becomes the sum over ranks, added in rank
// order in fp32 and rounded once, so every rank holds bit-identical results.
void shm_all_reduce(at::Tensor& x, const at::Tensor& segment, int64_t rank, int64_t world_size, int64_t seq,
                    int64_t slot_bytes, double timeout_s) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "shm_all_reduce: x must be float32 or bfloat16, got ", x.scalar_type());
  shm_exchange(x, segment, rank, world_size, seq, slot_bytes, timeout_s);
  uint8_t* base = segment.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    sum_slots(x.data_ptr<float>(), base, seq, world_size, slot_bytes, x.numel());
  } else {
    sum_slots(reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>()), base, seq, world_size, slot_bytes, x.numel());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("shm_header_bytes() -> int", &header_bytes);
  m.def("shm_exchange(Tensor x, Tensor segment, int rank, int world_size, int seq, int slot_bytes, float timeout_s) -> ()");
  m.def("shm_all_reduce(Tensor(a!) x, Tensor segment, int rank, int world_size, int seq, int slot_bytes, "
        "float timeout_s) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("shm_exchange", &shm_exchange);
  m.impl("shm_all_reduce", &shm_all_reduce);
}
