#include "server/common/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "server/common/fair_scheduler.h"
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
  while (free > 0 && want > 0) {
    const int64_t take = std::min<int64_t>(free, want);
    if (allowance.compare_exchange_weak(free, free - take,
                                        std::memory_order_relaxed)) {
      return static_cast<uint32_t>(take);
    }
  }
  return 0;
}

// Who holds the helpers: the tenant of each prefault running now (the
// fair scheduler's key of the calling worker; "" outside it), and how many
// helpers it holds. A tenant takes at most its share of the helpers while
// other tenants prefault too, and a helper of a tenant over its share stops
// between steps once another tenant waits for one (its caller finishes its
// part): the helpers are shared as the workers are.
class HelperShares {
 public:
  // Enters a prefault of `key` wanting `want` helpers; how many it got, and
  // whether it got fewer than its share allows (then the helpers of
  // tenants over their share stop between steps until it leaves).
  uint32_t Take(const std::string& key, uint32_t want, bool* short_of_share)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    Entry& e = tenants_[key];
    ++e.calls;
    const uint32_t cap = CapLocked();
    const uint32_t room = e.held < cap ? cap - e.held : 0;
    const uint32_t got = TakeHelpers(std::min(want, room));
    *short_of_share = got < std::min(want, room);
    if (*short_of_share) ++waiting_;
    e.held += got;
    return got;
  }
  // Gives back `n` helpers of `key` and leaves the prefault.
  void Leave(const std::string& key, uint32_t n, bool short_of_share)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (short_of_share && waiting_ > 0) --waiting_;
    auto it = tenants_.find(key);
    if (it == tenants_.end()) return;
    it->second.held -= std::min(it->second.held, n);
    if (--it->second.calls == 0) tenants_.erase(it);
  }
  // A helper of `key` between steps: true when it should stop (its tenant
  // holds more than its share and another tenant waits for a helper).
  bool ShouldStop(const std::string& key) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (waiting_ == 0) return false;
    auto it = tenants_.find(key);
    return it != tenants_.end() && it->second.held > CapLocked();
  }

 private:
  struct Entry {
    uint32_t calls = 0;  // prefaults of the tenant running now
    uint32_t held = 0;   // helpers they hold
  };
  // A tenant's share: the helpers divided among the tenants prefaulting.
  uint32_t CapLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint32_t threads = g_threads.load(std::memory_order_relaxed);
    const uint32_t helpers = threads > 0 ? threads - 1 : 0;
    const uint32_t tenants =
        std::max<uint32_t>(1, static_cast<uint32_t>(tenants_.size()));
    return std::max<uint32_t>(1, helpers / tenants);
  }

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> tenants_ ABSL_GUARDED_BY(mu_);
  uint32_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

HelperShares& Shares() {
  static HelperShares* shares = new HelperShares();
  return *shares;
}

// Steps of one thread's part: between them it reports progress and stops
// if the caller gave up.
constexpr uint64_t kStep = uint64_t{16} << 20;
// One madvise call: MADV_POPULATE_READ holds the address space's lock (for
// reading) for the whole call, and a map or unmap anywhere in mrd waits for
// it, and every later fault of every thread waits behind that (the lock
// lets a waiting writer go first). 2 MiB keeps each hold to a fraction of
// a millisecond; a step costs 8 calls instead of 1.
constexpr uint64_t kLockHold = uint64_t{2} << 20;

// Fills [start, end) a step at a time; returns where it stopped: `end`, or
// earlier when the caller gave up or `stop` (a helper giving way to another
// tenant's prefault) said so.
template <typename Stop>
uint64_t Populate(uint64_t start, uint64_t end, WorkProgress* progress,
                  bool huge_pages, Stop stop) {
  const uint64_t hold = huge_pages ? kStep : kLockHold;
  for (uint64_t at = start; at < end;) {
    if (Cancelled(progress) || (at != start && stop())) return at;
    const uint64_t to = std::min(end, (at & ~(kStep - 1)) + kStep);
    // Errors are the pin's to report (see the header).
    for (uint64_t piece = at; piece < to;) {
      const uint64_t piece_end = std::min(to, (piece & ~(hold - 1)) + hold);
      (void)::madvise(reinterpret_cast<void*>(piece), piece_end - piece,
                      MADV_POPULATE_READ);
      piece = piece_end;
    }
    if (progress != nullptr) progress->AddPopulated(to - at);
    at = to;
  }
  return end;
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
                  WorkProgress* progress, bool huge_pages) {
  const uint32_t configured = Threads();
  if (length < kPrefaultMinBytes || configured == 0) return 0;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = reinterpret_cast<uint64_t>(address) & ~(page - 1);
  const uint64_t end = reinterpret_cast<uint64_t>(address) + length;
  uint32_t want = static_cast<uint32_t>(
      std::min<uint64_t>(configured, length / (kPrefaultMinBytes / 2)));
  if (max_threads != 0) want = std::min(want, max_threads);
  const std::string tenant(FairScheduler::CurrentKey());
  HelperShares& shares = Shares();
  bool short_of_share = false;
  const uint32_t helpers =
      want > 1 ? shares.Take(tenant, want - 1, &short_of_share) : 0;
  const uint32_t parts = helpers + 1;
  const uint64_t chunk = (end - start) / parts;
  std::vector<Thread> threads;
  threads.reserve(helpers);
  // Where each helper's part ends and where it stopped (a helper that gave
  // way leaves the rest of its part to the caller).
  struct Part {
    uint64_t end = 0;
    std::atomic<uint64_t> stopped{0};
  };
  std::vector<std::unique_ptr<Part>> helper_parts;
  helper_parts.reserve(helpers);
  uint64_t at = start;
  for (uint32_t i = 0; i < helpers && at < end; ++i) {
    // Boundaries on 2 MiB addresses, so that no two threads fault one huge
    // page.
    const uint64_t to =
        std::min(end, (at + chunk + kChunkAlign - 1) & ~(kChunkAlign - 1));
    auto part = std::make_unique<Part>();
    part->end = to;
    part->stopped.store(at, std::memory_order_relaxed);
    Part* p = part.get();
    absl::StatusOr<Thread> t = Thread::Start(
        "mrd-prefault", [at, to, progress, p, &tenant, &shares, huge_pages] {
          p->stopped.store(Populate(at, to, progress, huge_pages,
                                    [&] { return shares.ShouldStop(tenant); }),
                           std::memory_order_relaxed);
        });
    if (!t.ok()) break;  // out of threads: the caller does the rest
    threads.push_back(*std::move(t));
    helper_parts.push_back(std::move(part));
    at = to;
  }
  const uint32_t started = static_cast<uint32_t>(threads.size());
  Allowance().fetch_add(helpers - started, std::memory_order_relaxed);
  auto never = [] { return false; };
  Populate(at, end, progress, huge_pages, never);
  for (size_t i = 0; i < threads.size(); ++i) {
    threads[i].Join();
    const Part& part = *helper_parts[i];
    Populate(part.stopped.load(std::memory_order_relaxed), part.end, progress,
             huge_pages, never);
  }
  Allowance().fetch_add(started, std::memory_order_relaxed);
  shares.Leave(tenant, helpers, short_of_share);
  return started + 1;
}

}  // namespace mrd
