#include "server/common/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "server/common/thread.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older headers lack it
#endif

namespace mrd {
namespace {

constexpr uint64_t kChunkAlign = uint64_t{2} << 20;  // whole huge pages

// Threads in all (0: off), and helper threads not in use, process-wide.
std::atomic<uint32_t> g_threads{0};
std::atomic<int64_t> g_allowance{0};
std::atomic<bool> g_configured{false};

uint32_t Threads() {
  if (!g_configured.load(std::memory_order_acquire)) {
    ConfigurePrefault(kDefaultPrefaultThreads);
  }
  return g_threads.load(std::memory_order_relaxed);
}

std::atomic<int64_t>& Allowance() { return g_allowance; }

// Up to `want` helpers from the allowance; how many were taken.
uint32_t TakeHelpers(uint32_t want) {
  std::atomic<int64_t>& allowance = Allowance();
  int64_t free = allowance.load(std::memory_order_relaxed);
  while (free > 0) {
    const int64_t take = std::min<int64_t>(free, want);
    if (allowance.compare_exchange_weak(free, free - take,
                                        std::memory_order_relaxed)) {
      return static_cast<uint32_t>(take);
    }
  }
  return 0;
}

// Steps of one thread's part: between them it reports progress and stops
// if the caller gave up.
constexpr uint64_t kStep = uint64_t{16} << 20;

void Populate(uint64_t start, uint64_t end, WorkProgress* progress) {
  for (uint64_t at = start; at < end;) {
    if (Cancelled(progress)) return;
    const uint64_t to = std::min(end, (at & ~(kStep - 1)) + kStep);
    // Errors are the pin's to report (see the header).
    (void)::madvise(reinterpret_cast<void*>(at), to - at, MADV_POPULATE_READ);
    if (progress != nullptr) progress->AddPopulated(to - at);
    at = to;
  }
}

}  // namespace

void ConfigurePrefault(uint32_t threads) {
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  const uint32_t n = static_cast<uint32_t>(
      std::min<int64_t>(threads, std::max<long>(cpus, 1)));
  g_threads.store(n, std::memory_order_relaxed);
  g_allowance.store(n > 0 ? n - 1 : 0, std::memory_order_relaxed);
  g_configured.store(true, std::memory_order_release);
}

uint32_t Prefault(const void* address, uint64_t length, uint32_t max_threads,
                  WorkProgress* progress) {
  const uint32_t configured = Threads();
  if (length < kPrefaultMinBytes || configured == 0) return 0;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = reinterpret_cast<uint64_t>(address) & ~(page - 1);
  const uint64_t end = reinterpret_cast<uint64_t>(address) + length;
  uint32_t want = static_cast<uint32_t>(
      std::min<uint64_t>(configured, length / (kPrefaultMinBytes / 2)));
  if (max_threads != 0) want = std::min(want, max_threads);
  const uint32_t helpers = want > 1 ? TakeHelpers(want - 1) : 0;
  const uint32_t parts = helpers + 1;
  const uint64_t chunk = (end - start) / parts;
  std::vector<Thread> threads;
  threads.reserve(helpers);
  uint64_t at = start;
  for (uint32_t i = 0; i < helpers && at < end; ++i) {
    // Boundaries on 2 MiB addresses, so that no two threads fault one huge
    // page.
    const uint64_t to =
        std::min(end, (at + chunk + kChunkAlign - 1) & ~(kChunkAlign - 1));
    absl::StatusOr<Thread> t = Thread::Start(
        "mrd-prefault", [at, to, progress] { Populate(at, to, progress); });
    if (!t.ok()) break;  // out of threads: the caller does the rest
    threads.push_back(*std::move(t));
    at = to;
  }
  const uint32_t started = static_cast<uint32_t>(threads.size());
  Allowance().fetch_add(helpers - started, std::memory_order_relaxed);
  Populate(at, end, progress);
  for (Thread& t : threads) t.Join();
  Allowance().fetch_add(started, std::memory_order_relaxed);
  return started + 1;
}

}  // namespace mrd
