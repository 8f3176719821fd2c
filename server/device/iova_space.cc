#include "server/device/iova_space.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::device {

IovaSpace::IovaSpace(uint64_t page_size, uint64_t start, uint64_t limit,
                     FaultPoints* faults)
    : page_size_(page_size), limit_(limit), faults_(faults), next_(start) {
  MRD_CHECK(page_size > 0 && start > 0 && start < limit);
  MRD_CHECK(start % page_size == 0 && limit % page_size == 0);
}

absl::StatusOr<uint64_t> IovaSpace::Allocate(uint64_t pages,
                                             uint64_t guard_pages,
                                             uint64_t owner) {
  MRD_CHECK(pages > 0);
  MRD_RETURN_IF_ERROR(FaultPoint(faults_, "iova.allocate"));
  uint64_t room_pages = (limit_ - next_) / page_size_;
  if (guard_pages > room_pages || pages > room_pages - guard_pages) {
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES, "IOVA_EXHAUSTED",
        absl::StrCat("logical address space has room for ", room_pages,
                     " more pages, ", pages, " requested"));
  }
  uint64_t start = next_ + guard_pages * page_size_;
  next_ = start + pages * page_size_;
  ranges_.emplace(start, Range{pages, owner});
  return start;
}

absl::Status IovaSpace::AllocateAt(uint64_t start, uint64_t pages,
                                   uint64_t owner) {
  MRD_CHECK(pages > 0);
  const uint64_t room_pages =
      start < limit_ ? (limit_ - start) / page_size_ : 0;
  if (start == 0 || start % page_size_ != 0 || pages > room_pages) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_IOVA",
        absl::StrCat("logical range of ", pages, " pages at 0x",
                     absl::Hex(start),
                     " is not page-aligned or not inside the logical "
                     "address space (0, 0x",
                     absl::Hex(limit_), ")"));
  }
  const uint64_t end = start + pages * page_size_;
  // The first range at or after `start`, and the one before it.
  auto after = ranges_.lower_bound(start);
  bool overlaps = after != ranges_.end() && after->first < end;
  if (!overlaps && after != ranges_.begin()) {
    auto before = std::prev(after);
    overlaps = before->first + before->second.pages * page_size_ > start;
  }
  if (overlaps) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_IOVA",
        absl::StrCat("logical range of ", pages, " pages at 0x",
                     absl::Hex(start), " overlaps a range already mapped"));
  }
  ranges_.emplace(start, Range{pages, owner});
  next_ = std::max(next_, end);
  return absl::OkStatus();
}

void IovaSpace::ContinueAbove(uint64_t watermark) {
  // Rounded up without overflowing: a watermark past the limit just
  // exhausts the space.
  uint64_t above = limit_;
  if (watermark <= limit_) {
    above = (watermark + page_size_ - 1) / page_size_ * page_size_;
  }
  next_ = std::max(next_, above);
}

void IovaSpace::Free(uint64_t start) {
  size_t erased = ranges_.erase(start);
  MRD_CHECK(erased == 1);
}

std::optional<IovaSpace::Hit> IovaSpace::Lookup(uint64_t address) const {
  auto it = ranges_.upper_bound(address);
  if (it == ranges_.begin()) return std::nullopt;
  --it;
  uint64_t page_index = (address - it->first) / page_size_;
  if (page_index >= it->second.pages) return std::nullopt;
  return Hit{it->second.owner, page_index};
}

}  // namespace mrd::device
