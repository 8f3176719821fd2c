// PinTracker: page-granular reference counts of pinned host memory.
//
// The kernel's pins are not reference-counted the way mrd needs: one munlock
// undoes any number of mlocks of the same page, and an io_uring slot pins
// exactly the range it was given (kernel_pin_ops.h). Registrations and LAMs
// overlap freely (the same buffer registered twice, a LAM over a registered
// range), so the device pins through this tracker: a page is pinned
// (PinOps::Lock) when its count goes 0 -> 1 and unpinned when it goes 1 -> 0.
// Counts are kept as an interval map of [start, end) runs with equal counts, so
// an operation costs O(log n + runs it touches), not O(pages): a 1 GiB span is
// one run.
//
// Pin is all-or-nothing (L7): if any Lock fails, every page it locked is
// unlocked again before the error returns.
//
// Thread-safe. The kernel's part (PinOps::Lock, which faults pages in, and
// Unlock) runs outside the tracker's lock: the pages it locks or unlocks are
// marked busy under the lock first, and a pin that needs a busy page waits
// for it, so that one tenant's 16 MiB step never holds up another's 4 KiB
// pin of other pages. Pins and unpins go a step (kLockStep) at a time.
// Callers must not hold locks of their own that the data path needs.
#ifndef MRD_SERVER_DEVICE_SOFTWARE_PIN_TRACKER_H_
#define MRD_SERVER_DEVICE_SOFTWARE_PIN_TRACKER_H_

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/common/progress.h"
#include "server/device/fault_points.h"

namespace mrd::device {

// A pin with progress is made in steps of at most this many bytes (whole
// io_uring slots: kernel_pin_ops.h).
inline constexpr uint64_t kPinStep = uint64_t{64} << 20;
// Pins and unpins go at most this many bytes at a time (a whole io_uring
// slot span: kernel_pin_ops.h), each step recorded whole.
inline constexpr uint64_t kLockStep = uint64_t{16} << 20;

// Lock's error when pinning would cost more memory maps (VMAs) than the
// pinning method's budget; the tracker refuses with LIMIT_MEMORY_MAPS.
inline constexpr int kErrMapBudget = EMLINK;

// How the tracker pins and unpins pages in the kernel, so that tests can
// watch and fail it. Implementations must be thread-safe.
class PinOps {
 public:
  virtual ~PinOps() = default;
  // Pins [address, address + length) (pages no one pins yet): 0 or the
  // errno (kErrMapBudget: see above). On error nothing stays pinned.
  virtual int Lock(uint64_t address, uint64_t length) = 0;
  // Lock for memory in huge pages (hugetlbfs), which the kernel never swaps
  // or moves on its own: an implementation may pin it a cheaper way.
  virtual int LockHugePages(uint64_t address, uint64_t length) {
    return Lock(address, length);
  }
  // Lock of a range whose pages are about to be released a few at a time
  // (a batch's pages pinned ahead of its items): an implementation may pin
  // it in pieces of about `piece_bytes`, so that releasing a part costs at
  // most one piece's rest.
  virtual int LockInPieces(uint64_t address, uint64_t length,
                           uint64_t piece_bytes) {
    (void)piece_bytes;
    return Lock(address, length);
  }
  // Unpins [address, address + length), all or a part of earlier Locks:
  // 0 or the errno.
  virtual int Unlock(uint64_t address, uint64_t length) = 0;
};

// The kernel's pins (kernel_pin_ops.h: io_uring fixed buffers, mlock where
// io_uring cannot pin) with default options. Process-wide, never destroyed;
// one tracker at a time may use it, since it refuses to pin a page twice.
// The software device makes its own (SoftwareDeviceOptions::pin_method).
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
  // (STATUS_INSUFFICIENT_RESOURCES "PIN_FAILED") when the kernel refuses
  // (ENOMEM: RLIMIT_MEMLOCK or an unmapped page; EPERM; EAGAIN), or
  // "LIMIT_MEMORY_MAPS" when pinning would cost more memory maps than the
  // budget (kErrMapBudget). On error no page's
  // count or lock state has changed. `huge_pages`: the memory is in huge
  // pages (hugetlbfs); new runs are pinned with PinOps::LockHugePages.
  // With `progress`: pins kPinStep at a time, each step counted when it is
  // pinned and the lock let go in between (progress->BetweenSteps: other
  // work may go first), adding the bytes pinned (pages others pin count
  // at once), and once progress->Cancelled() between steps unpins what it
  // pinned and fails with CANCELLED.
  absl::Status Pin(uint64_t address, uint64_t length, bool huge_pages = false,
                   WorkProgress* progress = nullptr);
  // Pin of a range whose pages will be released a few at a time (a batch's
  // adjacent ranges pinned ahead of its items): its new runs are locked
  // with PinOps::LockInPieces, in pieces of about `piece_bytes`.
  absl::Status PinInPieces(uint64_t address, uint64_t length,
                           uint64_t piece_bytes);
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
  using Ranges = absl::InlinedVector<std::pair<uint64_t, uint64_t>, 2>;

  // Pin of the page-aligned [start, end), one step (`address` and `length`
  // are the caller's range, for messages).
  // `piece_bytes`: see PinInPieces (0: a plain Lock).
  absl::Status PinSteps(uint64_t address, uint64_t length, bool huge_pages,
                        WorkProgress* progress, uint64_t piece_bytes);
  absl::Status PinStep(uint64_t start, uint64_t end, bool huge_pages,
                       WorkProgress* progress, uint64_t piece_bytes,
                       uint64_t address, uint64_t length)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Locks `gaps` in the kernel, all or none.
  absl::Status LockGaps(const Ranges& gaps, bool huge_pages,
                        uint64_t piece_bytes, uint64_t address, uint64_t length)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Unpin of the page-aligned [start, end), one step.
  void UnpinStep(uint64_t start, uint64_t end) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops a reference on every page of [start, end) and returns the runs
  // that reached zero, marked busy (the caller unlocks them, then Idle).
  Ranges UnpinLocked(uint64_t start, uint64_t end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a page of [start, end) is busy.
  bool BusyLocked(uint64_t start, uint64_t end) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `ranges` off the busy list.
  void IdleLocked(const Ranges& ranges) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Merges touching runs with equal counts between `from` and `to`.
  void CoalesceLocked(uint64_t from, uint64_t to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t page_size_;
  PinOps* const ops_;
  FaultPoints* const faults_;
  mutable absl::Mutex mu_;
  RunMap runs_ ABSL_GUARDED_BY(mu_);  // disjoint, refs >= 1
  // Pages being locked or unlocked in the kernel, outside the lock: in no
  // run (a page being locked is counted once it is locked), and no pin
  // touches them until they are idle again. A few ranges per pin or unpin
  // under way.
  std::vector<std::pair<uint64_t, uint64_t>> busy_ ABSL_GUARDED_BY(mu_);
  // Written under mu_; read without it (GetDeviceInfo answers inline).
  std::atomic<uint64_t> pinned_bytes_{0};
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_PIN_TRACKER_H_
