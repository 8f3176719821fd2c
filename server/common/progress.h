// WorkProgress: how far one long piece of work (pinning a large registration
// or LAM) has got, and whether its caller gave up on it.
//
// The code doing the work adds the bytes it finished as it goes: bytes whose
// page tables it filled (prefault.h) and bytes it pinned (the device). A
// watcher on another thread reads them at any time (core/progress.h reports
// them on the session's completion stream). Between steps the work asks
// Cancelled(); once it says yes, the work stops at that step, undoes what it
// did and fails with CANCELLED, so a call abandoned midway leaves nothing
// pinned.
//
// Thread-safe: the adds, reads and Cancelled() may come from any threads
// (prefault helpers add concurrently).
#ifndef MRD_SERVER_COMMON_PROGRESS_H_
#define MRD_SERVER_COMMON_PROGRESS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <utility>

#include "server/common/fair_scheduler.h"

namespace mrd {

// What work on `bytes` of memory costs the fair scheduler: one unit per
// 4 KiB page, at least 1.
inline uint64_t WorkCost(uint64_t bytes) {
  return std::max<uint64_t>(1, (bytes + 4095) / 4096);
}

// Whether the caller of a piece of work gave up on it (a gRPC call's
// IsCancelled). Thread-safe and cheap; empty: never.
using CancelCheck = std::function<bool()>;

class WorkProgress {
 public:
  explicit WorkProgress(uint64_t total, CancelCheck cancelled = nullptr)
      : total_(total), cancelled_(std::move(cancelled)) {}
  WorkProgress(const WorkProgress&) = delete;
  WorkProgress& operator=(const WorkProgress&) = delete;

  uint64_t total() const { return total_; }

  void AddPopulated(uint64_t bytes) {
    populated_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void AddPinned(uint64_t bytes) {
    pinned_.fetch_add(bytes, std::memory_order_relaxed);
  }
  // Everything is pinned (a device that pins in one step says so at the end).
  void SetAllPinned() { pinned_.store(total_, std::memory_order_relaxed); }
  // Both at most total(): the work may count whole pages around the range.
  uint64_t populated() const {
    return std::min(total_, populated_.load(std::memory_order_relaxed));
  }
  uint64_t pinned() const {
    return std::min(total_, pinned_.load(std::memory_order_relaxed));
  }

  // Called by the work between two of its steps, `next_bytes` being the
  // size of the next: a worker shared between tenants may serve others
  // first (FairScheduler::YieldCurrent). Returns when the work may go on.
  void BetweenSteps(uint64_t next_bytes) const {
    FairScheduler::YieldCurrent(WorkCost(next_bytes));
  }

  // Whether the caller gave up; once true, always true.
  bool Cancelled() const {
    if (seen_cancelled_.load(std::memory_order_relaxed)) return true;
    if (!cancelled_ || !cancelled_()) return false;
    seen_cancelled_.store(true, std::memory_order_relaxed);
    return true;
  }

 private:
  const uint64_t total_;
  const CancelCheck cancelled_;
  std::atomic<uint64_t> populated_{0};
  std::atomic<uint64_t> pinned_{0};
  mutable std::atomic<bool> seen_cancelled_{false};
};

// Cancelled() of a possibly absent progress.
inline bool Cancelled(const WorkProgress* progress) {
  return progress != nullptr && progress->Cancelled();
}

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_PROGRESS_H_
