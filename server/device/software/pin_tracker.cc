#include "server/device/software/pin_tracker.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/device/software/kernel_pin_ops.h"

namespace mrd::device {
namespace {

std::string AddressText(uint64_t value) {
  return absl::StrCat("0x", absl::Hex(value));
}

}  // namespace

PinOps* SystemPinOps() {
  static PinOps* ops = [] {
    absl::StatusOr<std::unique_ptr<KernelPinOps>> made =
        KernelPinOps::Create(KernelPinOptions{});
    MRD_CHECK(made.ok());  // kAuto with default options cannot fail
    return static_cast<PinOps*>(made->release());
  }();
  return ops;
}

PinTracker::PinTracker(uint64_t page_size, PinOps* ops, FaultPoints* faults)
    : page_size_(page_size), ops_(ops), faults_(faults) {
  MRD_CHECK(page_size > 0 && (page_size & (page_size - 1)) == 0);
  MRD_CHECK(ops != nullptr);
}

PinTracker::~PinTracker() {
  absl::MutexLock lock(&mu_);
  if (runs_.empty()) return;
  LogWarning("pin tracker destroyed with ", pinned_bytes_.load(),
             " bytes still pinned; unlocking them");
  for (const auto& [start, run] : runs_) ops_->Unlock(start, run.end - start);
}

void PinTracker::SplitLocked(uint64_t at) {
  auto it = runs_.upper_bound(at);
  if (it == runs_.begin()) return;
  --it;
  if (it->first < at && at < it->second.end) {
    Run tail{it->second.end, it->second.refs};
    it->second.end = at;
    runs_.emplace_hint(std::next(it), at, tail);
  }
}

void PinTracker::CoalesceLocked(uint64_t from, uint64_t to) {
  auto it = runs_.lower_bound(from);
  if (it != runs_.begin()) --it;
  while (it != runs_.end() && it->first <= to) {
    auto next = std::next(it);
    if (next != runs_.end() && it->second.end == next->first &&
        it->second.refs == next->second.refs) {
      it->second.end = next->second.end;
      runs_.erase(next);
    } else {
      it = next;
    }
  }
}

absl::Status PinTracker::Pin(uint64_t address, uint64_t length, bool huge_pages,
                             WorkProgress* progress) {
  return PinSteps(address, length, huge_pages, progress, /*piece_bytes=*/0);
}

absl::Status PinTracker::PinInPieces(uint64_t address, uint64_t length,
                                     uint64_t piece_bytes) {
  return PinSteps(address, length, /*huge_pages=*/false, nullptr, piece_bytes);
}

absl::Status PinTracker::PinSteps(uint64_t address, uint64_t length,
                                  bool huge_pages, WorkProgress* progress,
                                  uint64_t piece_bytes) {
  uint64_t last = 0;
  if (length == 0 || __builtin_add_overflow(address, length - 1, &last) ||
      last > UINT64_MAX - page_size_) {
    return SeedError(STATUS_INVALID_PARAMETER, "SPAN_OVERFLOW",
                     absl::StrCat("cannot pin ", length, " bytes at ",
                                  AddressText(address)));
  }
  const uint64_t start = address & ~(page_size_ - 1);
  const uint64_t end = (last & ~(page_size_ - 1)) + page_size_;
  // A long pin goes a step (kLockStep) at a time, each step pinned and
  // counted whole. Every kPinStep, progress can be seen, a cancellation
  // takes effect and the worker may serve another tenant first. A step that
  // fails undoes itself; the steps before it are then unpinned.
  for (uint64_t at = start; at < end;) {
    const uint64_t next = std::min(end, (at & ~(kLockStep - 1)) + kLockStep);
    absl::Status status =
        PinStep(at, next, huge_pages, progress, piece_bytes, address, length);
    // What this pin holds counted so far: [start, committed).
    const uint64_t committed = status.ok() ? next : at;
    if (status.ok() && next < end && progress != nullptr &&
        next % kPinStep == 0) {
      if (progress->Cancelled()) {
        status = absl::CancelledError(
            absl::StrCat("pinning ", length, " bytes at ", AddressText(address),
                         " was cancelled after ", progress->pinned(),
                         " bytes; they are unpinned again"));
      } else {
        progress->BetweenSteps(std::min(end, next + kPinStep) - next);
      }
    }
    if (!status.ok()) {
      if (committed > start) Unpin(start, committed - start);
      return status;
    }
    at = next;
  }
  return absl::OkStatus();
}

bool PinTracker::BusyLocked(uint64_t start, uint64_t end) const {
  for (const auto& [from, to] : busy_) {
    if (from < end && start < to) return true;
  }
  return false;
}

void PinTracker::IdleLocked(const Ranges& ranges) {
  for (const auto& range : ranges) {
    auto it = std::find(busy_.begin(), busy_.end(), range);
    MRD_CHECK(it != busy_.end());
    *it = busy_.back();
    busy_.pop_back();
  }
}

absl::Status PinTracker::PinStep(uint64_t start, uint64_t end, bool huge_pages,
                                 WorkProgress* progress, uint64_t piece_bytes,
                                 uint64_t address, uint64_t length) {
  // The parts of [start, end) that no one pins yet: only these need a
  // kernel lock. Usually one gap (a fresh range) or none (a range pinned
  // already).
  Ranges gaps;
  {
    absl::MutexLock lock(&mu_);
    struct Wait {
      const PinTracker* tracker;
      uint64_t start, end;
      bool operator()() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return !tracker->BusyLocked(start, end);
      }
    } idle{this, start, end};
    mu_.Await(absl::Condition(&idle));
    uint64_t cursor = start;
    auto it = runs_.upper_bound(start);
    if (it != runs_.begin() && std::prev(it)->second.end > start) --it;
    for (; it != runs_.end() && it->first < end; ++it) {
      if (it->first > cursor) gaps.emplace_back(cursor, it->first);
      cursor = std::max(cursor, it->second.end);
    }
    if (cursor < end) gaps.emplace_back(cursor, end);
    uint64_t new_bytes = 0;
    for (const auto& [from, to] : gaps) new_bytes += to - from;
    if (progress != nullptr) progress->AddPinned((end - start) - new_bytes);
    // The pages pinned already get their reference now, so that no unpin
    // can release them while the gaps are locked; the gaps are busy.
    SplitLocked(start);
    SplitLocked(end);
    for (auto run = runs_.lower_bound(start);
         run != runs_.end() && run->first < end; ++run) {
      ++run->second.refs;
    }
    CoalesceLocked(start, end);
    if (gaps.empty()) return absl::OkStatus();
    busy_.insert(busy_.end(), gaps.begin(), gaps.end());
  }
  absl::Status status =
      LockGaps(gaps, huge_pages, piece_bytes, address, length);
  {
    absl::MutexLock lock(&mu_);
    IdleLocked(gaps);
    if (status.ok()) {
      for (const auto& [from, to] : gaps) {
        runs_.emplace(from, Run{to, 1});
        pinned_bytes_.fetch_add(to - from, std::memory_order_relaxed);
        if (progress != nullptr) progress->AddPinned(to - from);
      }
      CoalesceLocked(start, end);
      return status;
    }
  }
  // Give back the references taken on the pages pinned already: the parts
  // of [start, end) between the gaps.
  uint64_t cursor = start;
  for (const auto& [from, to] : gaps) {
    if (from > cursor) UnpinStep(cursor, from);
    cursor = to;
  }
  if (cursor < end) UnpinStep(cursor, end);
  return status;
}

absl::Status PinTracker::LockGaps(const Ranges& gaps, bool huge_pages,
                                  uint64_t piece_bytes, uint64_t address,
                                  uint64_t length) {
  for (size_t i = 0; i < gaps.size(); ++i) {
    const auto [gap_start, gap_end] = gaps[i];
    const uint64_t gap = gap_end - gap_start;
    int err = huge_pages ? ops_->LockHugePages(gap_start, gap)
              : piece_bytes != 0
                  ? ops_->LockInPieces(gap_start, gap, piece_bytes)
                  : ops_->Lock(gap_start, gap);
    // An injected failure comes after the kernel locked the run, like a
    // real mlock that locks up to a hole and then fails.
    absl::Status injected =
        err == 0 ? FaultPoint(faults_, "pin.mlock") : absl::OkStatus();
    if (err == 0 && injected.ok()) continue;
    // mlock locks the mappings before a hole and then fails with ENOMEM
    // without undoing them, so the failed gap is unlocked too. Gaps were
    // pinned by no one, so this takes no lock away from another pin.
    ops_->Unlock(gap_start, gap_end - gap_start);
    for (size_t j = 0; j < i; ++j) {
      if (int undo =
              ops_->Unlock(gaps[j].first, gaps[j].second - gaps[j].first);
          undo != 0) {
        LogWarning("munlock of ", AddressText(gaps[j].first), "+",
                   gaps[j].second - gaps[j].first,
                   " while undoing a failed pin: ", std::strerror(undo));
      }
    }
    if (!injected.ok()) return injected;
    if (err == kErrMapBudget) {
      return SeedError(
          STATUS_INSUFFICIENT_RESOURCES, "LIMIT_MEMORY_MAPS",
          absl::StrCat("pinning ", length, " bytes at ", AddressText(address),
                       " would cost more memory maps (VMAs) than mrd allows "
                       "itself below vm.max_map_count (mlock splits a "
                       "mapping; see --pin_method and --pin_max_map_splits)"));
    }
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED",
        absl::StrCat("pinning ", gap_end - gap_start, " bytes at ",
                     AddressText(gap_start), " (pinning ", length, " bytes at ",
                     AddressText(address), ") failed: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

void PinTracker::Unpin(uint64_t address, uint64_t length) {
  uint64_t last = 0;
  MRD_CHECK(length > 0 && !__builtin_add_overflow(address, length - 1, &last) &&
            last <= UINT64_MAX - page_size_);
  const uint64_t start = address & ~(page_size_ - 1);
  const uint64_t end = (last & ~(page_size_ - 1)) + page_size_;
  // A step at a time, each recorded whole (the caller holds every page's
  // reference until its step, so the steps are independent).
  for (uint64_t at = start; at < end;) {
    const uint64_t next = std::min(end, (at & ~(kLockStep - 1)) + kLockStep);
    UnpinStep(at, next);
    at = next;
  }
}

void PinTracker::UnpinStep(uint64_t start, uint64_t end) {
  Ranges released;
  {
    absl::MutexLock lock(&mu_);
    released = UnpinLocked(start, end);
    if (released.empty()) return;
  }
  for (const auto& [from, to] : released) {
    if (int err = ops_->Unlock(from, to - from); err != 0) {
      // The pages may have been unmapped under a registration; the kernel
      // drops the lock with the mapping, so there is nothing left to undo.
      LogWarning("munlock of ", to - from, " bytes at ", AddressText(from),
                 ": ", std::strerror(err));
    }
  }
  absl::MutexLock lock(&mu_);
  IdleLocked(released);
}

PinTracker::Ranges PinTracker::UnpinLocked(uint64_t start, uint64_t end) {
  SplitLocked(start);
  SplitLocked(end);
  // Every page must be pinned: a hole means the caller unpins what it never
  // pinned, and carrying on would unlock someone else's pages.
  uint64_t cursor = start;
  for (auto run = runs_.lower_bound(start);
       run != runs_.end() && run->first < end; ++run) {
    MRD_CHECK(run->first == cursor);
    cursor = run->second.end;
  }
  MRD_CHECK(cursor == end);

  Ranges released;
  for (auto run = runs_.lower_bound(start);
       run != runs_.end() && run->first < end;) {
    if (--run->second.refs > 0) {
      ++run;
      continue;
    }
    if (!released.empty() && released.back().second == run->first) {
      released.back().second = run->second.end;
    } else {
      released.emplace_back(run->first, run->second.end);
    }
    run = runs_.erase(run);
  }
  for (const auto& [from, to] : released) {
    pinned_bytes_.fetch_sub(to - from, std::memory_order_relaxed);
  }
  busy_.insert(busy_.end(), released.begin(), released.end());
  CoalesceLocked(start, end);
  return released;
}

uint64_t PinTracker::PinnedBytes() const {
  return pinned_bytes_.load(std::memory_order_relaxed);
}

uint64_t PinTracker::RefCount(uint64_t address) const {
  absl::MutexLock lock(&mu_);
  auto it = runs_.upper_bound(address);
  if (it == runs_.begin()) return 0;
  --it;
  return address < it->second.end ? it->second.refs : 0;
}

size_t PinTracker::Runs() const {
  absl::MutexLock lock(&mu_);
  return runs_.size();
}

}  // namespace mrd::device
