// KeyTable: the software device's memory-key table, laid out the way NICs
// lay out theirs (the mlx5 mkey / rxe index+key format):
//
//   key = (index << 8) | key_byte
//
// The 24-bit index names a slot; the 8-bit key byte is drawn from the CSPRNG
// each time the slot is given to an owner and each time the owner asks for a
// new key (fast registration), and always differs from the slot's previous
// byte, so a stale key never matches the slot's next user. Slots are handed
// out in random order (each allocation draws uniformly from the whole free
// pool) so that consecutive registrations do not get neighbouring keys.
// Index 0 is never used: no valid key is below 256.
//
// Capacity and memory: the table holds up to `slots` keys (the software
// device sizes it to cover every registration, LAM and fast-register MR the
// core's global limits allow), but memory follows use: slots are added in
// chunks of `chunk_slots` when the free pool runs low, so a table of 1.5 Mi
// slots costs nothing until keys are taken and 8 bytes per slot ever grown
// (plus 4 per free-pool entry) after. Grown chunks are kept.
//
// An owner is an opaque non-zero 32-bit value (the device stores the slot
// of the MR in its MR table, or a LAM tag). The device
// uses one key per MR for both lkey and rkey.
//
// Thread-compatible: the device serializes calls under its own mutex.
#ifndef MRD_SERVER_DEVICE_SOFTWARE_KEY_TABLE_H_
#define MRD_SERVER_DEVICE_SOFTWARE_KEY_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/device/fault_points.h"
#include "server/device/secure_random.h"

namespace mrd::device {

class KeyTable {
 public:
  static constexpr uint32_t kMaxSlots = (1u << 24) - 1;
  static constexpr uint32_t kDefaultChunkSlots = 1u << 16;

  // `slots` in [1, kMaxSlots] is the capacity; `chunk_slots` (> 0) the
  // growth step. `random` must outlive the table, and so must `faults`
  // (tests only; nullptr in production). Fault points, each before anything
  // an owner can see changes: "keys.allocate" (no free slot),
  // "random.key_slot" (the slot draw) and "random.key_byte" (the key byte
  // draw, in Allocate and Reissue). Nothing is allocated here.
  KeyTable(uint32_t slots, SecureRandomPool* random,
           FaultPoints* faults = nullptr,
           uint32_t chunk_slots = kDefaultChunkSlots);

  // Gives a free slot to `owner` (non-zero) with a fresh key byte and
  // returns the key, growing the table by a chunk when the free pool runs
  // low. Errors: RESOURCE_EXHAUSTED (STATUS_INSUFFICIENT_RESOURCES
  // "KEYS_EXHAUSTED") when every slot of the capacity is taken, or when the
  // table must grow and no memory is left for it.
  absl::StatusOr<uint32_t> Allocate(uint32_t owner);
  // Draws a new key byte for the slot `key` names (which must be held) and
  // returns the new key. The old key stops matching at once.
  absl::StatusOr<uint32_t> Reissue(uint32_t key);
  // Returns the slot of `key` (which must be held) to the free pool. The
  // key byte is remembered so that the next owner's differs.
  void Release(uint32_t key);
  // The owner holding exactly `key` (index and key byte), or 0.
  uint32_t Lookup(uint32_t key) const;

  uint32_t capacity() const { return capacity_; }
  uint32_t in_use() const { return in_use_; }
  // Slots not held, counting those not grown yet.
  uint32_t free_slots() const { return capacity_ - in_use_; }
  // Slots grown so far (in_use() + the free pool).
  uint32_t grown_slots() const { return grown_; }
  // Bytes the table holds now (slot chunks and the free pool).
  size_t MemoryBytes() const;

 private:
  struct Slot {
    uint32_t owner = 0;
    uint8_t key_byte = 0;
  };
  static_assert(sizeof(Slot) == 8);
  // A byte different from the slot's current one.
  absl::StatusOr<uint8_t> NextKeyByte(const Slot& slot);
  // Adds the next chunk's slots to the free pool. False when out of memory.
  bool Grow();
  Slot* Find(uint32_t index);
  const Slot* Find(uint32_t index) const;

  SecureRandomPool* const random_;
  FaultPoints* const faults_;
  const uint32_t capacity_;
  const uint32_t chunk_slots_;
  // Chunk c holds indices [c * chunk_slots_, (c + 1) * chunk_slots_); index 0
  // (in chunk 0) is never used. The last chunk may be short.
  std::vector<std::unique_ptr<Slot[]>> chunks_;
  uint32_t grown_ = 0;          // indices 1..grown_ exist
  uint32_t in_use_ = 0;         // slots held
  std::vector<uint32_t> free_;  // indices of free grown slots, unordered
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_KEY_TABLE_H_
