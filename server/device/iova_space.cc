#include "server/device/iova_space.h"

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
