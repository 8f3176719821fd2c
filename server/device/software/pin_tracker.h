// PinTracker: page-granular reference counts of pinned host memory.
//
// mlock(2) is not reference-counted by the kernel: one munlock undoes any
// number of mlocks of the same page. Registrations and LAMs overlap freely
// (the same buffer registered twice, a LAM over a registered range), so the
// device pins through this tracker: a page is mlocked when its count goes
// 0 -> 1 and munlocked when it goes 1 -> 0. Counts are kept as an interval
// map of [start, end) runs with equal counts, so an operation costs
// O(log n + runs it touches), not O(pages): a 1 GiB span is one run.
//
// Pin is all-or-nothing (L7): if any mlock fails, every page it locked is
// unlocked again before the error returns, including a prefix that a
// failing mlock may itself have locked before reaching a hole.
//
// Thread-safe. Pin holds the tracker's lock across mlock, which faults pages
// in, so callers must not hold locks of their own that the data path needs.
#ifndef MRD_SERVER_DEVICE_SOFTWARE_PIN_TRACKER_H_
#define MRD_SERVER_DEVICE_SOFTWARE_PIN_TRACKER_H_

#include <cstdint>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/device/fault_points.h"

namespace mrd::device {

// The two system calls the tracker makes, so that tests can watch and fail
// them. Implementations must be thread-safe.
class PinOps {
 public:
  virtual ~PinOps() = default;
  // mlock(2) of [address, address + length): 0 or the errno.
  virtual int Lock(uint64_t address, uint64_t length) = 0;
  // munlock(2) of [address, address + length): 0 or the errno.
  virtual int Unlock(uint64_t address, uint64_t length) = 0;
};

// mlock/munlock. Process-wide, stateless, never destroyed.
PinOps* SystemPinOps();

class PinTracker {
 public:
  // `page_size` a power of two; `ops` must outlive the tracker, and so
  // must `faults` (tests only; nullptr in production). Its step
  // "pin.mlock" is reached after each successful mlock of a run of pages;
  // failing it fails the pin when that run and every run before it are
  // locked, which the all-or-nothing undo then unlocks.
  PinTracker(uint64_t page_size, PinOps* ops, FaultPoints* faults = nullptr);
  // Unlocks whatever is still pinned (the device releases everything first;
  // this is a backstop) and logs it.
  ~PinTracker();
  PinTracker(const PinTracker&) = delete;
  PinTracker& operator=(const PinTracker&) = delete;

  // Takes one reference on every page of [address, address + length).
  // Errors: INVALID_ARGUMENT (STATUS_INVALID_PARAMETER "SPAN_OVERFLOW") for
  // an empty range or one that wraps; RESOURCE_EXHAUSTED
  // (STATUS_INSUFFICIENT_RESOURCES "PIN_FAILED") when mlock fails (ENOMEM:
  // RLIMIT_MEMLOCK or an unmapped page; EPERM; EAGAIN). On error no page's
  // count or lock state has changed.
  absl::Status Pin(uint64_t address, uint64_t length);
  // Drops the references a successful Pin of the same range took. Unpinning
  // a page that is not pinned is a caller bug and aborts.
  void Unpin(uint64_t address, uint64_t length);

  // Bytes of distinct pinned pages.
  uint64_t PinnedBytes() const;
  // The count of the page containing `address` (0 if not pinned).
  uint64_t RefCount(uint64_t address) const;
  // Number of runs in the map (tests check that adjacent equal runs merge).
  size_t Runs() const;

 private:
  struct Run {
    uint64_t end = 0;
    uint64_t refs = 0;
  };
  using RunMap = std::map<uint64_t, Run>;

  // Splits the run that strictly contains `at` into two with equal counts.
  void SplitLocked(uint64_t at) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Merges touching runs with equal counts between `from` and `to`.
  void CoalesceLocked(uint64_t from, uint64_t to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t page_size_;
  PinOps* const ops_;
  FaultPoints* const faults_;
  mutable absl::Mutex mu_;
  RunMap runs_ ABSL_GUARDED_BY(mu_);  // disjoint, refs >= 1
  uint64_t pinned_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_PIN_TRACKER_H_
