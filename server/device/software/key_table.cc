#include "server/device/software/key_table.h"

#include <algorithm>
#include <new>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::device {

KeyTable::KeyTable(uint32_t slots, SecureRandomPool* random,
                   FaultPoints* faults, uint32_t chunk_slots)
    : random_(random),
      faults_(faults),
      capacity_(slots),
      chunk_slots_(chunk_slots) {
  MRD_CHECK(slots >= 1 && slots <= kMaxSlots);
  MRD_CHECK(chunk_slots >= 1);
}

KeyTable::Slot* KeyTable::Find(uint32_t index) {
  if (index == 0 || index > grown_) return nullptr;
  return &chunks_[index / chunk_slots_][index % chunk_slots_];
}

const KeyTable::Slot* KeyTable::Find(uint32_t index) const {
  if (index == 0 || index > grown_) return nullptr;
  return &chunks_[index / chunk_slots_][index % chunk_slots_];
}

size_t KeyTable::MemoryBytes() const {
  size_t chunk_bytes = 0;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    uint64_t first = uint64_t{c} * chunk_slots_;
    uint64_t end =
        std::min<uint64_t>(first + chunk_slots_, uint64_t{capacity_} + 1);
    chunk_bytes += static_cast<size_t>(end - first) * sizeof(Slot);
  }
  return chunk_bytes + free_.capacity() * sizeof(uint32_t) +
         chunks_.capacity() * sizeof(chunks_[0]);
}

bool KeyTable::Grow() {
  // The next chunk starts right after the last index grown (index 0 belongs
  // to chunk 0 and is skipped).
  const uint64_t first = uint64_t{chunks_.size()} * chunk_slots_;
  const uint64_t end =
      std::min<uint64_t>(first + chunk_slots_, uint64_t{capacity_} + 1);
  const size_t count = static_cast<size_t>(end - first);
  std::unique_ptr<Slot[]> chunk(new (std::nothrow) Slot[count]);
  if (chunk == nullptr) return false;
  // No shuffle is needed: Allocate draws uniformly from the whole pool, so
  // the pool's order never shows in the keys.
  free_.reserve(free_.size() + count);
  for (uint64_t index = std::max<uint64_t>(first, 1); index < end; ++index) {
    free_.push_back(static_cast<uint32_t>(index));
    chunk[index - first].pooled = true;
  }
  chunks_.push_back(std::move(chunk));
  grown_ = static_cast<uint32_t>(end - 1);
  return true;
}

absl::StatusOr<uint8_t> KeyTable::NextKeyByte(const Slot& slot) {
  // Uniform over the 255 bytes that differ from the current one.
  MRD_RETURN_IF_ERROR(FaultPoint(faults_, "random.key_byte"));
  MRD_ASSIGN_OR_RETURN(uint8_t draw, random_->Byte());
  while (draw == 255) {  // 255 values wanted: reject one to stay uniform
    MRD_ASSIGN_OR_RETURN(draw, random_->Byte());
  }
  return static_cast<uint8_t>(slot.key_byte + 1 + draw);
}

absl::StatusOr<uint32_t> KeyTable::Allocate(uint32_t owner) {
  MRD_CHECK(owner != 0);
  MRD_RETURN_IF_ERROR(FaultPoint(faults_, "keys.allocate"));
  if (in_use_ >= capacity_) {
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED",
        absl::StrCat("all ", capacity_, " memory-key slots are in use"));
  }
  // Keep the pool wide enough that the slot draw stays spread out: grow
  // before it runs dry, not only when it is empty.
  const size_t low_water = std::max(chunk_slots_ / 16, 1u);
  while (grown_ < capacity_ && LiveFree() < low_water) {
    if (!Grow()) break;
  }
  if (LiveFree() == 0) {
    return SeedError(STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED",
                     absl::StrCat("out of memory growing the memory-key "
                                  "table beyond ",
                                  grown_, " slots"));
  }
  MRD_RETURN_IF_ERROR(FaultPoint(faults_, "random.key_slot"));
  // Rejection sampling: a draw that lands on a claimed slot's stale entry
  // discards it and draws again, so the pick is uniform over the free
  // slots, and each stale entry costs one draw in all.
  size_t at = 0;
  Slot* slot = nullptr;
  while (true) {
    MRD_ASSIGN_OR_RETURN(uint64_t pick, random_->Uint64());
    at = static_cast<size_t>(pick % free_.size());
    slot = Find(free_[at]);
    if (slot->owner == 0) break;
    slot->pooled = false;
    free_[at] = free_.back();
    free_.pop_back();
    --stale_;
  }
  const uint32_t index = free_[at];
  MRD_ASSIGN_OR_RETURN(uint8_t key_byte, NextKeyByte(*slot));
  free_[at] = free_.back();
  free_.pop_back();
  slot->pooled = false;
  slot->owner = owner;
  slot->key_byte = key_byte;
  ++in_use_;
  return (index << 8) | key_byte;
}

absl::StatusOr<uint32_t> KeyTable::Claim(uint32_t key, uint32_t owner) {
  MRD_CHECK(owner != 0);
  const uint32_t index = key >> 8;
  if (index == 0 || index > capacity_) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_KEY",
        absl::StrCat("key 0x", absl::Hex(key), " names slot ", index,
                     ", outside the table's slots 1..", capacity_));
  }
  while (grown_ < index) {
    if (!Grow()) {
      return SeedError(
          STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED",
          absl::StrCat("out of memory growing the memory-key "
                       "table beyond ",
                       grown_, " slots to claim key 0x", absl::Hex(key)));
    }
  }
  Slot& slot = *Find(index);
  if (slot.owner != 0) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "KEY_IN_USE",
                    absl::StrCat("key slot ", index, " (key 0x", absl::Hex(key),
                                 ") is already held"));
  }
  // Every free grown slot is pooled: its entry turns stale, for Allocate
  // (or a Release) to deal with.
  MRD_CHECK(slot.pooled);
  ++stale_;
  slot.owner = owner;
  slot.key_byte = static_cast<uint8_t>(key & 0xff);
  ++in_use_;
  return key;
}

absl::StatusOr<uint32_t> KeyTable::Reissue(uint32_t key) {
  Slot* slot = Find(key >> 8);
  MRD_CHECK(slot != nullptr && slot->owner != 0);
  MRD_ASSIGN_OR_RETURN(slot->key_byte, NextKeyByte(*slot));
  return (key & ~0xffu) | slot->key_byte;
}

void KeyTable::Release(uint32_t key) {
  Slot* slot = Find(key >> 8);
  MRD_CHECK(slot != nullptr && slot->owner != 0);
  slot->owner = 0;
  if (slot->pooled) {
    --stale_;  // a claimed slot's entry is still there: live again
  } else {
    free_.push_back(key >> 8);
    slot->pooled = true;
  }
  --in_use_;
}

uint32_t KeyTable::Lookup(uint32_t key) const {
  const Slot* slot = Find(key >> 8);
  if (slot == nullptr) return 0;
  if (slot->owner == 0 || slot->key_byte != (key & 0xff)) return 0;
  return slot->owner;
}

}  // namespace mrd::device
