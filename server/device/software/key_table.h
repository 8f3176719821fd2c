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
// Handover (Claim): a new mrd process re-creates the registrations of the
// one it takes over from with exactly the keys they had, up to a million in
// a row, so a claim is O(1) amortized: the claimed index stays in the
// unordered free pool as a stale entry (the slot's `pooled` bit says the
// pool holds it), and Allocate discards the stale entries its uniform draw
// lands on and draws again. Each stale entry is discarded at most once, and
// the draw stays uniform over the free slots. A released claimed slot whose
// stale entry is still pooled simply makes that entry live again, so the
// pool never holds an index twice.
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
  // Gives exactly `key` (index key >> 8, key byte key & 0xff) to `owner`
  // (non-zero), growing the table to cover the index: the key another
  // process had, at handover. Afterwards Reissue, Release and Lookup treat
  // it as an allocated key. Errors: INVALID_ARGUMENT "BAD_KEY" (index 0 or
  // beyond the capacity), FAILED_PRECONDITION "KEY_IN_USE" (the slot is
  // held, whatever its key byte), RESOURCE_EXHAUSTED "KEYS_EXHAUSTED" (no
  // memory to grow the table; chunks grown so far are kept). O(1) amortized
  // (plus the growth).
  absl::StatusOr<uint32_t> Claim(uint32_t key, uint32_t owner);
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
  // Slots grown so far (in_use() + the free pool's live entries).
  uint32_t grown_slots() const { return grown_; }
  // Bytes the table holds now (slot chunks and the free pool, stale
  // entries included).
  size_t MemoryBytes() const;

 private:
  struct Slot {
    uint32_t owner = 0;
    uint8_t key_byte = 0;
    // free_ holds this index (live when owner == 0, stale otherwise).
    bool pooled = false;
  };
  static_assert(sizeof(Slot) == 8);
  // A byte different from the slot's current one.
  absl::StatusOr<uint8_t> NextKeyByte(const Slot& slot);
  // Adds the next chunk's slots to the free pool. False when out of memory.
  bool Grow();
  // Free grown slots: the pool less its stale entries.
  size_t LiveFree() const { return free_.size() - stale_; }
  Slot* Find(uint32_t index);
  const Slot* Find(uint32_t index) const;

  SecureRandomPool* const random_;
  FaultPoints* const faults_;
  const uint32_t capacity_;
  const uint32_t chunk_slots_;
  // Chunk c holds indices [c * chunk_slots_, (c + 1) * chunk_slots_); index 0
  // (in chunk 0) is never used. The last chunk may be short.
  std::vector<std::unique_ptr<Slot[]>> chunks_;
  uint32_t grown_ = 0;   // indices 1..grown_ exist
  uint32_t in_use_ = 0;  // slots held
  // Indices of every free grown slot, unordered, plus `stale_` indices of
  // claimed slots that Allocate has not discarded yet (Claim).
  std::vector<uint32_t> free_;
  size_t stale_ = 0;
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_KEY_TABLE_H_
