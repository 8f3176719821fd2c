#include "server/device/software/key_table.h"

#include "absl/strings/str_cat.h"
#include "server/common/log.h"
#include "server/common/status.h"

namespace mrd::device {

KeyTable::KeyTable(uint32_t slots, SecureRandomPool* random,
                   FaultPoints* faults)
    : random_(random), faults_(faults), slots_(static_cast<size_t>(slots) + 1) {
  MRD_CHECK(slots >= 1 && slots <= kMaxSlots);
  free_.reserve(slots);
  for (uint32_t index = slots; index >= 1; --index) free_.push_back(index);
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

absl::StatusOr<uint32_t> KeyTable::Allocate(uint64_t owner) {
  MRD_CHECK(owner != 0);
  MRD_RETURN_IF_ERROR(FaultPoint(faults_, "keys.allocate"));
  if (free_.empty()) {
    return SeedError(v1::STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED",
                     absl::StrCat("all ", slots_.size() - 1,
                                  " memory-key slots are in use"));
  }
  MRD_RETURN_IF_ERROR(FaultPoint(faults_, "random.key_slot"));
  MRD_ASSIGN_OR_RETURN(uint64_t pick, random_->Uint64());
  size_t at = static_cast<size_t>(pick % free_.size());
  uint32_t index = free_[at];
  Slot& slot = slots_[index];
  MRD_ASSIGN_OR_RETURN(uint8_t key_byte, NextKeyByte(slot));
  free_[at] = free_.back();
  free_.pop_back();
  slot.owner = owner;
  slot.key_byte = key_byte;
  return (index << 8) | key_byte;
}

absl::StatusOr<uint32_t> KeyTable::Reissue(uint32_t key) {
  uint32_t index = key >> 8;
  MRD_CHECK(index >= 1 && index < slots_.size() && slots_[index].owner != 0);
  Slot& slot = slots_[index];
  MRD_ASSIGN_OR_RETURN(slot.key_byte, NextKeyByte(slot));
  return (index << 8) | slot.key_byte;
}

void KeyTable::Release(uint32_t key) {
  uint32_t index = key >> 8;
  MRD_CHECK(index >= 1 && index < slots_.size() && slots_[index].owner != 0);
  slots_[index].owner = 0;
  free_.push_back(index);
}

uint64_t KeyTable::Lookup(uint32_t key) const {
  uint32_t index = key >> 8;
  if (index == 0 || index >= slots_.size()) return 0;
  const Slot& slot = slots_[index];
  if (slot.owner == 0 || slot.key_byte != (key & 0xff)) return 0;
  return slot.owner;
}

}  // namespace mrd::device
