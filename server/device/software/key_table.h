// KeyTable: the software device's memory-key table, laid out the way NICs
// lay out theirs (the mlx5 mkey / rxe index+key format):
//
//   key = (index << 8) | key_byte
//
// The 24-bit index names a slot; the 8-bit key byte is drawn from the CSPRNG
// each time the slot is given to an owner and each time the owner asks for a
// new key (fast registration), and always differs from the slot's previous
// byte, so a stale key never matches the slot's next user. Slots are handed
// out in random order so that consecutive registrations do not get
// neighbouring keys. Index 0 is never used: no valid key is below 256.
//
// An owner is an opaque non-zero id (the device stores MrIds). The device
// uses one key per MR for both lkey and rkey.
//
// Thread-compatible: the device serializes calls under its own mutex.
#ifndef MRD_SERVER_DEVICE_SOFTWARE_KEY_TABLE_H_
#define MRD_SERVER_DEVICE_SOFTWARE_KEY_TABLE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "server/device/fault_points.h"
#include "server/device/software/secure_random.h"

namespace mrd::device {

class KeyTable {
 public:
  static constexpr uint32_t kMaxSlots = (1u << 24) - 1;

  // `slots` in [1, kMaxSlots]; `random` must outlive the table, and so must
  // `faults` (tests only; nullptr in production). Fault points, each before
  // anything changes: "keys.allocate" (no free slot), "random.key_slot"
  // (the slot draw) and "random.key_byte" (the key byte draw, in Allocate
  // and Reissue).
  KeyTable(uint32_t slots, SecureRandomPool* random,
           FaultPoints* faults = nullptr);

  // Gives a free slot to `owner` (non-zero) with a fresh key byte and
  // returns the key. Errors: RESOURCE_EXHAUSTED (STATUS_INSUFFICIENT_
  // RESOURCES "KEYS_EXHAUSTED") when every slot is taken.
  absl::StatusOr<uint32_t> Allocate(uint64_t owner);
  // Draws a new key byte for the slot `key` names (which must be held) and
  // returns the new key. The old key stops matching at once.
  absl::StatusOr<uint32_t> Reissue(uint32_t key);
  // Returns the slot of `key` (which must be held) to the free pool. The
  // key byte is remembered so that the next owner's differs.
  void Release(uint32_t key);
  // The owner holding exactly `key` (index and key byte), or 0.
  uint64_t Lookup(uint32_t key) const;

  uint32_t free_slots() const { return static_cast<uint32_t>(free_.size()); }

 private:
  struct Slot {
    uint64_t owner = 0;
    uint8_t key_byte = 0;
  };
  // A byte different from the slot's current one.
  absl::StatusOr<uint8_t> NextKeyByte(const Slot& slot);

  SecureRandomPool* const random_;
  FaultPoints* const faults_;
  std::vector<Slot> slots_;     // [0] unused
  std::vector<uint32_t> free_;  // indices of free slots, unordered
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_KEY_TABLE_H_
