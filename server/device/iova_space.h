// IovaSpace: the software device's logical (IO virtual) address space, in
// which BuildLam maps host pages and which fast registration takes page
// arrays from (L1, L5, L8).
//
// Layout: page-granular ranges handed out upwards from a start address the
// device picks at random (non-zero, so no logical address is 0), each range
// preceded by a guard gap of a few unmapped pages, also random. Addresses are
// never reused within a device's lifetime, so a stale logical address from a
// released LAM can never name a later LAM's page; an off-by-one page in a
// page array lands in a gap and is refused.
//
// Thread-compatible: the device serializes calls under its own mutex.
#ifndef MRD_SERVER_DEVICE_IOVA_SPACE_H_
#define MRD_SERVER_DEVICE_IOVA_SPACE_H_

#include <cstdint>
#include <map>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/device/fault_points.h"

namespace mrd::device {

class IovaSpace {
 public:
  // Addresses in [start, limit); both page-aligned, 0 < start < limit.
  // `faults` (tests only; nullptr in production) must outlive the space;
  // Allocate reaches its step "iova.allocate" before changing anything.
  IovaSpace(uint64_t page_size, uint64_t start, uint64_t limit,
            FaultPoints* faults = nullptr);

  // Reserves `pages` (> 0) consecutive pages for `owner` after
  // `guard_pages` unmapped ones; returns the first page's address. Errors:
  // RESOURCE_EXHAUSTED (STATUS_INSUFFICIENT_RESOURCES "IOVA_EXHAUSTED").
  absl::StatusOr<uint64_t> Allocate(uint64_t pages, uint64_t guard_pages,
                                    uint64_t owner);
  // Handover: reserves exactly [start, start + pages * page_size) for
  // `owner` (a range another process's space handed out), with no guard gap
  // of its own, and raises the watermark past it. The range may lie below
  // this space's own random start: only 0 and the limit bound it, since the
  // other process drew its start independently. Errors: INVALID_ARGUMENT
  // "BAD_IOVA" (`start` not page-aligned, 0, the range past the limit, or
  // overlapping an allocated range).
  absl::Status AllocateAt(uint64_t start, uint64_t pages, uint64_t owner);
  // Unmaps the range that starts at `start` (which must be allocated).
  void Free(uint64_t start);

  struct Hit {
    uint64_t owner = 0;
    uint64_t page_index = 0;  // within the owner's range
  };
  // The range and page that `address` falls in, if any.
  std::optional<Hit> Lookup(uint64_t address) const;

  size_t ranges() const { return ranges_.size(); }
  // Every address handed out so far lies below it.
  uint64_t watermark() const { return next_; }
  // Hands out only addresses at or above `watermark` (rounded up to a page,
  // at most the limit) from now on: another process's space handed out
  // those below it, and addresses are never reused across a handover
  // either. Never lowers the watermark.
  void ContinueAbove(uint64_t watermark);

 private:
  struct Range {
    uint64_t pages = 0;
    uint64_t owner = 0;
  };

  const uint64_t page_size_;
  const uint64_t limit_;
  FaultPoints* const faults_;
  uint64_t next_;                     // first address never handed out
  std::map<uint64_t, Range> ranges_;  // by start address
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_IOVA_SPACE_H_
