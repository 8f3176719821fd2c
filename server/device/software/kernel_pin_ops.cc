#include "server/device/software/kernel_pin_ops.h"

#include <linux/io_uring.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/fair_scheduler.h"
#include "server/common/log.h"

namespace mrd::device {
namespace {

std::string Hex(uint64_t value) { return absl::StrCat("0x", absl::Hex(value)); }

// Sets slots [first, first + count) of `ring` to `iovs` in one call: how
// many the kernel set (from `first` on), or -errno when it set none.
long UpdateSlots(int ring, uint32_t first, const struct iovec* iovs,
                 uint32_t count) {
  struct io_uring_rsrc_update2 update;
  std::memset(&update, 0, sizeof(update));
  update.offset = first;
  update.data = reinterpret_cast<uint64_t>(iovs);
  update.nr = count;
  for (;;) {
    long rc =
        ::syscall(__NR_io_uring_register, ring, IORING_REGISTER_BUFFERS_UPDATE,
                  &update, sizeof(update));
    if (rc >= 0) return rc;
    if (errno != EINTR) return -errno;
  }
}

// Sets slot `slot` of `ring` to [address, address + length), or empties it
// (address 0, length 0): 0 or the errno.
int UpdateSlot(int ring, uint32_t slot, uint64_t address, uint64_t length) {
  struct iovec iov = {reinterpret_cast<void*>(address),
                      static_cast<size_t>(length)};
  const long rc = UpdateSlots(ring, slot, &iov, 1);
  if (rc == 1) return 0;
  return rc < 0 ? static_cast<int>(-rc) : EIO;
}

// Empties slots [first, first + count) of `ring` in one call: how many the
// kernel emptied (from `first` on), or -errno when it emptied none.
long ClearRun(int ring, uint32_t first, uint32_t count) {
  std::vector<struct iovec> empty(count, iovec{nullptr, 0});
  return UpdateSlots(ring, first, empty.data(), count);
}

// The ClearBatch open on this thread, if any.
struct OpenClearBatch {
  const KernelPinOps* ops = nullptr;
  std::vector<uint32_t>* slots = nullptr;
  std::vector<KernelPinOps::ClearBatch::Split>* splits = nullptr;
};
thread_local OpenClearBatch open_clear_batch;

// The Unlock running on this thread, if any: the slots it empties once it
// lets the lock go.
struct OpenUnlock {
  const KernelPinOps* ops = nullptr;
  std::vector<uint32_t>* slots = nullptr;
};
thread_local OpenUnlock open_unlock;

// Lines of /proc/self/maps: the process's VMA count.
uint64_t MapCount() {
  std::ifstream maps("/proc/self/maps");
  uint64_t lines = 0;
  std::string line;
  while (std::getline(maps, line)) ++lines;
  return lines;
}

uint64_t MaxMapCount() {
  std::ifstream file("/proc/sys/vm/max_map_count");
  uint64_t value = 0;
  if (!(file >> value) || value == 0) value = 65530;  // the kernel default
  return value;
}

}  // namespace

absl::StatusOr<PinMethod> ParsePinMethod(absl::string_view name) {
  if (name == "auto") return PinMethod::kAuto;
  if (name == "io_uring") return PinMethod::kIoUring;
  if (name == "mlock") return PinMethod::kMlock;
  return MrdError(absl::StatusCode::kInvalidArgument, "BAD_OPTION",
                  absl::StrCat("pin method must be auto, io_uring or mlock, "
                               "not '",
                               name, "'"));
}

KernelPinOps::KernelPinOps(const KernelPinOptions& options, uint64_t page_size)
    : options_(options),
      page_size_(page_size),
      max_piece_bytes_(uint64_t{options.max_piece_pages != 0
                                    ? options.max_piece_pages
                                    : kMaxPiecePages} *
                       page_size) {}

absl::StatusOr<std::unique_ptr<KernelPinOps>> KernelPinOps::Create(
    const KernelPinOptions& options, bool log) {
  const long page = ::sysconf(_SC_PAGESIZE);
  const uint64_t ps = page > 0 ? static_cast<uint64_t>(page) : 4096;
  if (options.slot_span < ps || options.slot_span > kMaxSlotSpan ||
      (options.slot_span & (options.slot_span - 1)) != 0 ||
      options.slots_per_ring == 0 ||
      options.slots_per_ring > kMaxSlotsPerRing ||
      options.parallel_rings == 0) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_OPTION",
        absl::StrCat("pin slot span ", options.slot_span,
                     " (a power of two from the page size to 1 "
                     "GiB), slots per ring ",
                     options.slots_per_ring, " (1 to ", kMaxSlotsPerRing,
                     ") or parallel rings ", options.parallel_rings,
                     " (at least 1) out of range"));
  }
  std::unique_ptr<KernelPinOps> ops(new KernelPinOps(options, ps));
  if (options.method != PinMethod::kMlock) {
    absl::MutexLock lock(&ops->mu_);
    if (int err = ops->AddRingLocked(/*bulk=*/false); err != 0) {
      ops->io_uring_error_ = std::strerror(err);
      if (options.method == PinMethod::kIoUring) {
        return MrdError(absl::StatusCode::kFailedPrecondition,
                        "IO_URING_UNAVAILABLE",
                        absl::StrCat("--pin_method=io_uring, but no io_uring "
                                     "ring with fixed buffers can be set up: ",
                                     ops->io_uring_error_));
      }
    } else {
      ops->io_uring_ok_ = true;
    }
  } else {
    ops->io_uring_error_ = "--pin_method=mlock";
  }
  const uint64_t max_maps = MaxMapCount();
  const uint64_t maps = MapCount();
  ops->max_map_splits_ = options.max_map_splits != 0
                             ? options.max_map_splits
                             : (max_maps > maps ? (max_maps - maps) / 2 : 0);
  if (log) LogInfo("pinning memory with ", ops->Describe());
  return ops;
}

KernelPinOps::~KernelPinOps() {
  absl::MutexLock lock(&mu_);
  for (const auto& entry : pieces_) {
    if (entry.second.mlocked()) {
      ::syscall(SYS_munlock, entry.first, End(entry) - entry.first);
    }
  }
  for (const Ring& ring : rings_) ::close(ring.fd);
}

std::string KernelPinOps::Describe() const {
  const std::string budget =
      absl::StrCat("mlock may split at most ", max_map_splits_,
                   " VMAs (vm.max_map_count ", MaxMapCount(), ")");
  if (!io_uring_ok_) {
    return absl::StrCat("mlock (io_uring not used: ", io_uring_error_, "); ",
                        budget);
  }
  if (options_.method == PinMethod::kIoUring) {
    return absl::StrCat("io_uring fixed buffers (slots of at most ",
                        options_.slot_span, " bytes)");
  }
  return absl::StrCat(
      "io_uring fixed buffers (slots of at most ", options_.slot_span,
      " bytes), mlock for read-only or refused memory; ", budget);
}

int KernelPinOps::AddRingLocked(bool bulk) {
  // Slot ids stay below kMlocked (4 billion slots: never in practice).
  if (slots_.size() + options_.slots_per_ring > kMlocked) return ENOSPC;
  struct io_uring_params params;
  std::memset(&params, 0, sizeof(params));
  const long fd = ::syscall(__NR_io_uring_setup, 1, &params);
  if (fd < 0) return errno;
  struct io_uring_rsrc_register reg;
  std::memset(&reg, 0, sizeof(reg));
  reg.nr = options_.slots_per_ring;
  reg.flags = IORING_RSRC_REGISTER_SPARSE;
  if (::syscall(__NR_io_uring_register, fd, IORING_REGISTER_BUFFERS2, &reg,
                sizeof(reg)) != 0) {
    const int err = errno;
    ::close(static_cast<int>(fd));
    return err;
  }
  const uint32_t first = static_cast<uint32_t>(slots_.size());
  Ring ring;
  ring.fd = static_cast<int>(fd);
  ring.bulk = bulk;
  ring.free.reserve(options_.slots_per_ring);
  // Handed out lowest first.
  for (uint32_t i = options_.slots_per_ring; i-- > 0;) {
    ring.free.push_back(first + i);
  }
  rings_.push_back(std::move(ring));
  slots_.resize(slots_.size() + options_.slots_per_ring);
  free_slots_ += options_.slots_per_ring;
  return 0;
}

bool KernelPinOps::BulkLock(uint64_t length) {
  return length >= kBigLock || FairScheduler::CurrentIsBulk();
}

int KernelPinOps::TakeSlotLocked(bool bulk, uint32_t* slot, size_t same) {
  // The ring of the caller's previous slot, while it has a free one: the
  // caller's own calls on it are made one after the other.
  auto take = [&](Ring& ring) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    *slot = ring.free.back();
    ring.free.pop_back();
    --free_slots_;
    // A full ring gives its list's memory back (64 KiB a ring: a million
    // registrations fill 62 rings).
    if (ring.free.empty()) std::vector<uint32_t>().swap(ring.free);
  };
  if (same < rings_.size() && !rings_[same].free.empty()) {
    take(rings_[same]);
    return 0;
  }
  // Of this class: the first idle ring with a free slot, the count of
  // rings with free slots, and the least busy of them.
  size_t idle = rings_.size();
  size_t least = rings_.size();
  uint32_t with_free = 0;
  for (size_t i = 0; i < rings_.size(); ++i) {
    const Ring& ring = rings_[i];
    if (ring.bulk != bulk || ring.free.empty()) continue;
    ++with_free;
    if (ring.calls == 0) {
      idle = i;
      break;
    }
    if (least == rings_.size() || ring.calls < rings_[least].calls) least = i;
  }
  size_t chosen = idle;
  if (chosen == rings_.size() &&
      (with_free < options_.parallel_rings || least == rings_.size())) {
    const int err = AddRingLocked(bulk);
    if (err == 0) {
      chosen = rings_.size() - 1;
    } else if (least == rings_.size()) {
      // No ring of this class has a free slot and none can be made: any
      // ring with a free slot will do.
      for (size_t i = 0; i < rings_.size() && least == rings_.size(); ++i) {
        if (!rings_[i].free.empty()) least = i;
      }
      if (least == rings_.size()) return err;
    }
  }
  if (chosen == rings_.size()) chosen = least;
  take(rings_[chosen]);
  return 0;
}

int KernelPinOps::RegisterLocked(uint64_t start, uint64_t end, uint32_t* slot) {
  uint32_t id = 0;
  if (int err = TakeSlotLocked(BulkLock(end - start), &id); err != 0) {
    return err;
  }
  const uint32_t per_ring = options_.slots_per_ring;
  if (int err = UpdateSlot(rings_[id / per_ring].fd, id % per_ring, start,
                           end - start);
      err != 0) {
    FreeSlotLocked(id);
    return err;
  }
  slots_[id] = Slot{static_cast<uint32_t>(end - start), 1};
  registered_bytes_ += end - start;
  *slot = id;
  return 0;
}

KernelPinOps::ClearBatch::ClearBatch(KernelPinOps* ops) {
  if (ops == nullptr || open_clear_batch.ops != nullptr) return;
  ops_ = ops;
  slots_.reserve(kClearBatchSlots);
  open_clear_batch = OpenClearBatch{ops, &slots_, &splits_};
}

KernelPinOps::ClearBatch::~ClearBatch() {
  if (ops_ == nullptr) return;
  ops_->FlushClearBatch();
  open_clear_batch = OpenClearBatch();
}

void KernelPinOps::FlushClearBatch() {
  std::vector<uint32_t> slots;
  {
    absl::MutexLock lock(&mu_);
    // The old slots this empties join the batch's list.
    RepinSplitsLocked(*open_clear_batch.splits);
    open_clear_batch.splits->clear();
    slots = std::exchange(*open_clear_batch.slots, {});
  }
  ClearSlots(std::move(slots));
}

void KernelPinOps::RepinSplitsLocked(
    const std::vector<ClearBatch::Split>& splits) {
  for (const ClearBatch::Split& split : splits) {
    // Emptied meanwhile (its last piece went), or moved for an earlier
    // entry of the same slot.
    if (slots_[split.slot].pieces == 0) continue;
    for (auto it = pieces_.lower_bound(split.start);
         it != pieces_.end() && it->first < split.end;) {
      const uint64_t start = it->first;
      const uint64_t end = End(*it);
      // Another slot's piece, or one whose Lock is still in the kernel
      // (the slot was emptied by another thread and taken again: its
      // length is set once the kernel has it).
      if (it->second.slot != split.slot || slots_[split.slot].length == 0) {
        ++it;
        continue;
      }
      uint32_t fresh = 0;
      if (int err = RegisterLocked(start, end, &fresh); err != 0) {
        // As a failed split: the old slot keeps the released pages pinned
        // until this piece goes too.
        LogWarning("could not re-pin ", Hex(start), "+", end - start,
                   " of io_uring slot ", split.slot, ": ", std::strerror(err),
                   "; the slot's released pages stay pinned until it goes");
        ++it;
        continue;
      }
      it->second.slot = fresh;
      ReleaseSlotLocked(split.slot);
      it = pieces_.lower_bound(end);
    }
  }
}

void KernelPinOps::FreeSlotLocked(uint32_t slot) {
  registered_bytes_ -= slots_[slot].length;
  slots_[slot] = Slot{};
  rings_[slot / options_.slots_per_ring].free.push_back(slot);
  ++free_slots_;
}

void KernelPinOps::ClearSlots(std::vector<uint32_t> slots) {
  if (slots.empty()) return;
  std::sort(slots.begin(), slots.end());
  const uint32_t per_ring = options_.slots_per_ring;
  // Runs of adjacent slots of one ring: (first index into slots, count).
  absl::InlinedVector<std::pair<size_t, uint32_t>, 4> runs;
  absl::InlinedVector<Update, 4> updates;
  {
    absl::MutexLock lock(&mu_);
    size_t i = 0;
    while (i < slots.size()) {
      const uint32_t first = slots[i];
      uint32_t n = 1;
      uint64_t bytes = slots_[first].length;
      while (i + n < slots.size() && n < kMaxClearRun &&
             slots[i + n] == first + n && (first + n) % per_ring != 0 &&
             bytes + slots_[first + n].length <= kMaxClearRunBytes) {
        bytes += slots_[first + n].length;
        ++n;
      }
      const uint32_t ring = first / per_ring;
      ++rings_[ring].calls;
      runs.emplace_back(i, n);
      updates.push_back(Update{0, 0, first, ring, rings_[ring].fd});
      i += n;
    }
  }
  absl::InlinedVector<long, 4> cleared;
  for (size_t r = 0; r < runs.size(); ++r) {
    cleared.push_back(
        ClearRun(updates[r].fd, updates[r].slot % per_ring, runs[r].second));
  }
  absl::MutexLock lock(&mu_);
  for (size_t r = 0; r < runs.size(); ++r) {
    const auto [i, n] = runs[r];
    --rings_[updates[r].ring].calls;
    ++clear_calls_;
    const size_t done = cleared[r] > 0 ? static_cast<size_t>(cleared[r]) : 0;
    for (size_t j = 0; j < std::min<size_t>(done, n); ++j) {
      FreeSlotLocked(slots[i + j]);
    }
    // What the kernel did not empty (it stops at a slot it cannot update)
    // goes a slot at a time.
    for (size_t j = done; j < n; ++j) ClearNowLocked(slots[i + j]);
  }
}

void KernelPinOps::ClearLocked(uint32_t slot) {
  slots_[slot].pieces = 0;
  if (open_clear_batch.ops == this) {
    open_clear_batch.slots->push_back(slot);
    return;
  }
  if (open_unlock.ops == this) {
    open_unlock.slots->push_back(slot);
    return;
  }
  ClearNowLocked(slot);
}

void KernelPinOps::ClearNowLocked(uint32_t slot) {
  const uint32_t per_ring = options_.slots_per_ring;
  ++clear_calls_;
  if (int err = UpdateSlot(rings_[slot / per_ring].fd, slot % per_ring, 0, 0);
      err != 0) {
    // Emptying a slot only fails if the ring is gone; keep it out of use.
    LogWarning("emptying io_uring slot ", slot, ": ", std::strerror(err));
    return;
  }
  FreeSlotLocked(slot);
}

void KernelPinOps::AddPieceLocked(uint64_t start, uint64_t end, uint32_t slot) {
  pieces_.emplace(
      start, Piece{static_cast<uint32_t>((end - start) / page_size_), slot});
}

void KernelPinOps::ReleaseSlotLocked(uint32_t slot) {
  if (--slots_[slot].pieces == 0) ClearLocked(slot);
}

int KernelPinOps::LockIoUring(uint64_t start, uint64_t end, uint64_t span) {
  // One slot per span the range touches; one for a range within one.
  absl::InlinedVector<Update, 2> updates;
  const uint32_t per_ring = options_.slots_per_ring;
  int err = 0;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t at = start; at < end;) {
      const uint64_t boundary = (at & ~(span - 1)) + span;
      const uint64_t to = boundary != 0 ? std::min(end, boundary) : end;
      uint32_t slot = 0;
      if (err = TakeSlotLocked(
              BulkLock(end - start), &slot,
              updates.empty() ? rings_.size() : updates.back().ring);
          err != 0) {
        break;
      }
      // The piece marks the range as taken while its slot is registered.
      AddPieceLocked(at, to, slot);
      slots_[slot].pieces = 1;
      const uint32_t ring = slot / per_ring;
      ++rings_[ring].calls;
      updates.push_back(Update{at, to, slot, ring, rings_[ring].fd});
      at = to;
    }
    if (err != 0) {
      for (const Update& update : updates) {
        pieces_.erase(update.start);
        --rings_[update.ring].calls;
        FreeSlotLocked(update.slot);
      }
      return err;
    }
  }
  // Adjacent slots of one ring go to the kernel together, up to
  // kMaxUpdateRunBytes a call (a call pins them all before it returns).
  size_t done = 0;
  absl::InlinedVector<struct iovec, 4> iovs;
  while (done < updates.size()) {
    size_t n = 1;
    uint64_t bytes = updates[done].end - updates[done].start;
    while (done + n < updates.size()) {
      const Update& next = updates[done + n];
      if (next.ring != updates[done].ring ||
          next.slot != updates[done].slot + n ||
          bytes + (next.end - next.start) > kMaxUpdateRunBytes) {
        break;
      }
      bytes += next.end - next.start;
      ++n;
    }
    iovs.clear();
    for (size_t i = done; i < done + n; ++i) {
      const Update& update = updates[i];
      if (options_.before_update != nullptr) {
        options_.before_update(options_.before_update_arg, update.start,
                               update.end - update.start, update.ring);
      }
      iovs.push_back(iovec{reinterpret_cast<void*>(update.start),
                           static_cast<size_t>(update.end - update.start)});
    }
    const long rc = UpdateSlots(updates[done].fd, updates[done].slot % per_ring,
                                iovs.data(), static_cast<uint32_t>(n));
    if (rc <= 0) {
      err = rc < 0 ? static_cast<int>(-rc) : EIO;
      break;
    }
    // Set in part: the rest is tried again, and the kernel says why.
    done += std::min<size_t>(static_cast<size_t>(rc), n);
  }
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < updates.size(); ++i) {
    const Update& update = updates[i];
    --rings_[update.ring].calls;
    if (i < done) {
      slots_[update.slot].length =
          static_cast<uint32_t>(update.end - update.start);
      registered_bytes_ += update.end - update.start;
    }
    if (err == 0) {
      io_uring_bytes_ += update.end - update.start;
      continue;
    }
    pieces_.erase(update.start);
    if (i < done) {
      ClearNowLocked(update.slot);
    } else {
      FreeSlotLocked(update.slot);
    }
  }
  return err;
}

uint64_t KernelPinOps::MlockNeighboursLocked(uint64_t start,
                                             uint64_t end) const {
  uint64_t neighbours = 0;
  auto next = pieces_.lower_bound(start);
  if (next != pieces_.end() && next->first == end && next->second.mlocked()) {
    ++neighbours;
  }
  if (next != pieces_.begin()) {
    auto prev = std::prev(next);
    if (End(*prev) == start && prev->second.mlocked()) ++neighbours;
  }
  return neighbours;
}

int KernelPinOps::LockMlockLocked(uint64_t start, uint64_t end) {
  // Each maximal mlocked run can split a VMA at both ends; refuse before the
  // runs could cost more VMAs than the budget.
  const uint64_t runs = mlock_runs_ + 1 - MlockNeighboursLocked(start, end);
  if (2 * runs > max_map_splits_ && runs > mlock_runs_) return kErrMapBudget;
  if (::syscall(SYS_mlock, start, end - start) != 0) {
    // mlock locks the mappings before a hole and then fails without undoing
    // them; the range was pinned by no one, so unlock all of it.
    const int err = errno;
    ::syscall(SYS_munlock, start, end - start);
    return err;
  }
  mlock_runs_ = runs;
  mlocked_bytes_ += end - start;
  // Coalesce with the adjoining mlocked pieces, so that a run is one piece
  // unless it is longer than a piece can be.
  uint64_t from = start;
  uint64_t to = end;
  auto next = pieces_.lower_bound(start);
  if (next != pieces_.end() && next->first == end && next->second.mlocked()) {
    to = End(*next);
    next = pieces_.erase(next);
  }
  if (next != pieces_.begin()) {
    auto prev = std::prev(next);
    if (End(*prev) == start && prev->second.mlocked()) {
      from = prev->first;
      pieces_.erase(prev);
    }
  }
  AddMlockedLocked(from, to);
  return 0;
}

void KernelPinOps::AddMlockedLocked(uint64_t start, uint64_t end) {
  for (uint64_t at = start; at < end;) {
    const uint64_t to =
        end - at > max_piece_bytes_ ? at + max_piece_bytes_ : end;
    AddPieceLocked(at, to, kMlocked);
    at = to;
  }
}

int KernelPinOps::Lock(uint64_t address, uint64_t length) {
  return LockAny(address, length, /*huge_pages=*/false, options_.slot_span);
}

int KernelPinOps::LockHugePages(uint64_t address, uint64_t length) {
  return LockAny(address, length, /*huge_pages=*/true, options_.slot_span);
}

int KernelPinOps::LockInPieces(uint64_t address, uint64_t length,
                               uint64_t piece_bytes) {
  uint64_t span = page_size_;
  while (span < piece_bytes && span < options_.slot_span) span <<= 1;
  return LockAny(address, length, /*huge_pages=*/false, span);
}

int KernelPinOps::LockAny(uint64_t address, uint64_t length, bool huge_pages,
                          uint64_t span) {
  if (length == 0 || address + length < address) return EINVAL;
  const uint64_t start = address & ~(page_size_ - 1);
  const uint64_t end = (address + length + page_size_ - 1) & ~(page_size_ - 1);
  // The tracker locks only pages no one pins; an overlap is a caller bug.
  auto overlaps = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = pieces_.lower_bound(start);
    return (it != pieces_.end() && it->first < end) ||
           (it != pieces_.begin() && End(*std::prev(it)) > start);
  };
  {
    absl::MutexLock lock(&mu_);
    if (overlaps()) return EEXIST;
    if (huge_pages && options_.method != PinMethod::kIoUring) {
      const int err = LockMlockLocked(start, end);
      if (err == 0 || !io_uring_ok_) return err;
    }
    if (!io_uring_ok_) return LockMlockLocked(start, end);
  }
  const int err = LockIoUring(start, end, span);
  if (err == 0 || options_.method == PinMethod::kIoUring) return err;
  // EFAULT: a read-only mapping (io_uring pins for writing) or a hole;
  // EOPNOTSUPP: memory io_uring does not pin long-term; EMFILE: no fd for
  // another ring. mlock tells a hole from the rest.
  if (huge_pages) return err;  // mlock was refused already
  absl::MutexLock lock(&mu_);
  if (overlaps()) return EEXIST;
  return LockMlockLocked(start, end);
}

int KernelPinOps::UnlockPieceLocked(PieceMap::iterator it, uint64_t from,
                                    uint64_t to) {
  const uint64_t start = it->first;
  const uint64_t end = End(*it);
  const Piece piece = it->second;
  from = std::max(from, start);
  to = std::min(to, end);
  absl::InlinedVector<std::pair<uint64_t, uint64_t>, 2> rest;
  if (start < from) rest.emplace_back(start, from);
  if (to < end) rest.emplace_back(to, end);
  pieces_.erase(it);

  if (piece.mlocked()) {
    int err = 0;
    if (::syscall(SYS_munlock, from, to - from) != 0) err = errno;
    mlocked_bytes_ -= to - from;
    for (const auto& [a, b] : rest) AddMlockedLocked(a, b);
    // The piece's run leaves a run on each side of the hole that still has
    // mlocked pages next to it: what is left of the piece, or the run's
    // other pieces (the exact inverse of LockMlockLocked's count).
    mlock_runs_ = mlock_runs_ - 1 + MlockNeighboursLocked(from, to);
    return err;
  }

  io_uring_bytes_ -= to - from;
  if (open_clear_batch.ops == this && !rest.empty()) {
    // Within a batch the rest stays in the old slot, re-pinned (if any of
    // it is still there) when the batch ends: its items often release all
    // of the slot, one after another.
    for (const auto& [a, b] : rest) {
      AddPieceLocked(a, b, piece.slot);
      ++slots_[piece.slot].pieces;
    }
    std::vector<ClearBatch::Split>& splits = *open_clear_batch.splits;
    if (splits.empty() || splits.back().slot != piece.slot) {
      splits.push_back(ClearBatch::Split{piece.slot, start, end});
    }
    ReleaseSlotLocked(piece.slot);
    return 0;
  }
  // Pin what stays into new slots before the old one lets go of anything.
  absl::InlinedVector<uint32_t, 2> fresh;
  int err = 0;
  for (const auto& [a, b] : rest) {
    uint32_t slot = 0;
    if (err = RegisterLocked(a, b, &slot); err != 0) break;
    fresh.push_back(slot);
  }
  if (err != 0) {
    for (uint32_t slot : fresh) ReleaseSlotLocked(slot);
    // Keep the old slot: the rest stays pinned through it, and so do the
    // released pages until the rest goes too.
    LogWarning("could not re-pin ", rest.size(), " pieces of io_uring slot ",
               piece.slot, " (", Hex(start), "+", end - start,
               "): ", std::strerror(err), "; ", to - from, " bytes at ",
               Hex(from), " stay pinned until the rest is released");
    for (const auto& [a, b] : rest) {
      AddPieceLocked(a, b, piece.slot);
      ++slots_[piece.slot].pieces;
    }
    ReleaseSlotLocked(piece.slot);
    return 0;
  }
  for (size_t i = 0; i < rest.size(); ++i) {
    AddPieceLocked(rest[i].first, rest[i].second, fresh[i]);
  }
  ReleaseSlotLocked(piece.slot);
  return 0;
}

int KernelPinOps::Unlock(uint64_t address, uint64_t length) {
  if (length == 0 || address + length < address) return EINVAL;
  const uint64_t start = address & ~(page_size_ - 1);
  const uint64_t end = (address + length + page_size_ - 1) & ~(page_size_ - 1);
  // The slots this Unlock empties, outside the lock (ClearLocked).
  std::vector<uint32_t> emptied;
  int first_err = 0;
  {
    absl::MutexLock lock(&mu_);
    const bool own = open_unlock.ops == nullptr;
    if (own) open_unlock = OpenUnlock{this, &emptied};
    uint64_t cursor = start;
    auto it = pieces_.upper_bound(start);
    if (it != pieces_.begin() && End(*std::prev(it)) > start) --it;
    while (it != pieces_.end() && it->first < end) {
      if (it->first > cursor && first_err == 0) first_err = ENOENT;
      const uint64_t next_start = End(*it);
      cursor = next_start;
      int err = UnlockPieceLocked(it, start, end);
      if (err != 0 && first_err == 0) first_err = err;
      it = pieces_.lower_bound(next_start);
    }
    if (cursor < end && first_err == 0) first_err = ENOENT;
    if (own) open_unlock = OpenUnlock();
  }
  ClearSlots(std::move(emptied));
  // A ClearBatch of this thread empties its slots as it fills.
  if (open_clear_batch.ops == this &&
      (open_clear_batch.slots->size() >= kClearBatchSlots ||
       open_clear_batch.splits->size() >= kClearBatchSlots)) {
    FlushClearBatch();
    open_clear_batch.slots->reserve(kClearBatchSlots);
  }
  return first_err;
}

size_t KernelPinOps::Rings() const {
  absl::MutexLock lock(&mu_);
  return rings_.size();
}

size_t KernelPinOps::Slots() const {
  absl::MutexLock lock(&mu_);
  return slots_.size() - free_slots_;
}

int KernelPinOps::RingOf(uint64_t address) const {
  absl::MutexLock lock(&mu_);
  auto it = pieces_.upper_bound(address);
  if (it == pieces_.begin()) return -1;
  --it;
  if (End(*it) <= address || it->second.mlocked()) return -1;
  return static_cast<int>(it->second.slot / options_.slots_per_ring);
}

bool KernelPinOps::BulkRing(size_t ring) const {
  absl::MutexLock lock(&mu_);
  return ring < rings_.size() && rings_[ring].bulk;
}

uint64_t KernelPinOps::IoUringBytes() const {
  absl::MutexLock lock(&mu_);
  return io_uring_bytes_;
}

uint64_t KernelPinOps::MlockedBytes() const {
  absl::MutexLock lock(&mu_);
  return mlocked_bytes_;
}

uint64_t KernelPinOps::StaleBytes() const {
  absl::MutexLock lock(&mu_);
  return registered_bytes_ - io_uring_bytes_;
}

uint64_t KernelPinOps::MapSplits() const {
  absl::MutexLock lock(&mu_);
  return 2 * mlock_runs_;
}

uint64_t KernelPinOps::ClearCalls() const {
  absl::MutexLock lock(&mu_);
  return clear_calls_;
}

size_t KernelPinOps::Pieces() const {
  absl::MutexLock lock(&mu_);
  return pieces_.size();
}

}  // namespace mrd::device
