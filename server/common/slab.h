// Slab<T>: objects addressed by a small index and stored side by side in
// chunks, for tables that hold a million small objects. Allocating each
// object on its own costs, besides the object, a malloc header and a slot
// in some index (plus a control block when shared_ptr owns it) — as much
// as the object again. In a slab the object is the cost: the index is its
// address.
//
// * An object never moves while it lives: a pointer to it stays valid until
//   Free, also while its owner waits with its lock released.
// * A new object takes a free slot of the lowest chunk that has one, and a
//   chunk goes back to the allocator when its last object is freed. So the
//   memory follows the live objects: after a burst, only chunks that still
//   hold one stay.
// * Allocate refuses (nullopt) past max_slots and when a chunk cannot be
//   allocated; nothing throws.
//
// Not thread-safe: the owner's lock guards it.
#ifndef MRD_SERVER_COMMON_SLAB_H_
#define MRD_SERVER_COMMON_SLAB_H_

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <vector>

namespace mrd {

template <typename T, uint32_t kChunkSlots = 4096>
class Slab {
  static_assert(kChunkSlots >= 64 && kChunkSlots % 64 == 0);

 public:
  // At most `max_slots` objects live at once (rounded up to whole chunks).
  explicit Slab(uint32_t max_slots)
      : chunks_((max_slots + kChunkSlots - 1) / kChunkSlots) {}
  ~Slab() {
    for (uint32_t c = 0; c < chunks_.size(); ++c) {
      Chunk* chunk = chunks_[c].get();
      if (chunk == nullptr) continue;
      for (uint32_t i = 0; i < kChunkSlots; ++i) {
        if (chunk->Used(i)) chunk->At(i)->~T();
      }
    }
  }
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;

  // Constructs a T (value-initialized) in a free slot and returns its
  // index; nullopt when the slab is full or a chunk cannot be allocated.
  std::optional<uint32_t> Allocate() {
    for (uint32_t c = lowest_open_; c < chunks_.size(); ++c) {
      if (chunks_[c] == nullptr) {
        chunks_[c].reset(new (std::nothrow) Chunk);
        if (chunks_[c] == nullptr) return std::nullopt;
        ++live_chunks_;
      }
      Chunk& chunk = *chunks_[c];
      if (chunk.live == kChunkSlots) continue;
      lowest_open_ = c;
      for (uint32_t w = 0; w < kWords; ++w) {
        if (chunk.used[w] == ~uint64_t{0}) continue;
        const uint32_t i =
            w * 64 + static_cast<uint32_t>(std::countr_one(chunk.used[w]));
        chunk.used[w] |= uint64_t{1} << (i % 64);
        ++chunk.live;
        ++size_;
        new (chunk.Slot(i)) T();
        return c * kChunkSlots + i;
      }
    }
    return std::nullopt;
  }

  // Constructs a T (value-initialized) in slot `index` itself: an object
  // that must keep the index it had elsewhere (a registration handed over
  // by another mrd process). False when the slot is taken, out of range, or
  // its chunk cannot be allocated.
  bool AllocateAt(uint32_t index) {
    const uint32_t c = index / kChunkSlots;
    const uint32_t i = index % kChunkSlots;
    if (c >= chunks_.size()) return false;
    if (chunks_[c] == nullptr) {
      chunks_[c].reset(new (std::nothrow) Chunk);
      if (chunks_[c] == nullptr) return false;
      ++live_chunks_;
    }
    Chunk& chunk = *chunks_[c];
    if (chunk.Used(i)) return false;
    chunk.used[i / 64] |= uint64_t{1} << (i % 64);
    ++chunk.live;
    ++size_;
    if (chunk.live < kChunkSlots && c < lowest_open_) lowest_open_ = c;
    new (chunk.Slot(i)) T();
    return true;
  }

  // The object at `index`; nullptr when the slot is free or out of range.
  T* Get(uint64_t index) {
    return const_cast<T*>(static_cast<const Slab*>(this)->Get(index));
  }
  const T* Get(uint64_t index) const {
    if (index / kChunkSlots >= chunks_.size()) return nullptr;
    const Chunk* chunk = chunks_[index / kChunkSlots].get();
    const uint32_t i = index % kChunkSlots;
    if (chunk == nullptr || !chunk->Used(i)) return nullptr;
    return chunk->At(i);
  }

  // Destroys the object at `index` (which must live); its chunk goes back
  // to the allocator when it was the chunk's last.
  void Free(uint32_t index) {
    const uint32_t c = index / kChunkSlots;
    const uint32_t i = index % kChunkSlots;
    Chunk* chunk = chunks_[c].get();
    chunk->At(i)->~T();
    chunk->used[i / 64] &= ~(uint64_t{1} << (i % 64));
    --chunk->live;
    --size_;
    if (chunk->live == 0) {
      chunks_[c].reset();
      --live_chunks_;
    }
    if (c < lowest_open_) lowest_open_ = c;
  }

  // Calls f(index, object) for every live object, in index order. `f` must
  // not allocate or free.
  template <typename F>
  void ForEach(F&& f) {
    for (uint32_t c = 0; c < chunks_.size(); ++c) {
      Chunk* chunk = chunks_[c].get();
      if (chunk == nullptr) continue;
      for (uint32_t i = 0; i < kChunkSlots; ++i) {
        if (chunk->Used(i)) f(c * kChunkSlots + i, *chunk->At(i));
      }
    }
  }
  template <typename F>
  void ForEach(F&& f) const {
    for (uint32_t c = 0; c < chunks_.size(); ++c) {
      const Chunk* chunk = chunks_[c].get();
      if (chunk == nullptr) continue;
      for (uint32_t i = 0; i < kChunkSlots; ++i) {
        if (chunk->Used(i)) f(c * kChunkSlots + i, *chunk->At(i));
      }
    }
  }

  size_t size() const { return size_; }
  size_t live_chunks() const { return live_chunks_; }
  uint64_t capacity() const { return uint64_t{chunks_.size()} * kChunkSlots; }

 private:
  static constexpr uint32_t kWords = kChunkSlots / 64;
  struct Chunk {
    std::array<uint64_t, kWords> used{};
    uint32_t live = 0;
    alignas(T) std::byte storage[kChunkSlots * sizeof(T)];

    bool Used(uint32_t i) const { return (used[i / 64] >> (i % 64) & 1) != 0; }
    void* Slot(uint32_t i) { return storage + size_t{i} * sizeof(T); }
    T* At(uint32_t i) {
      return std::launder(
          reinterpret_cast<T*>(storage + size_t{i} * sizeof(T)));
    }
    const T* At(uint32_t i) const {
      return std::launder(
          reinterpret_cast<const T*>(storage + size_t{i} * sizeof(T)));
    }
  };

  // Sized once: Allocate never grows it.
  std::vector<std::unique_ptr<Chunk>> chunks_;
  // No chunk below this one has a free slot.
  uint32_t lowest_open_ = 0;
  size_t size_ = 0;
  size_t live_chunks_ = 0;
};

// Ids of objects kept in a Slab: the slot in the low kSlotBits and a
// sequence number above it, so an id finds its object by index, and an id
// comes back only after 2^40 were made (a stale id names no object before
// that: compare the object's own id). Never 0. Not thread-safe.
class SlabIds {
 public:
  static constexpr int kSlotBits = 24;
  static constexpr uint32_t kMaxSlots = uint32_t{1} << kSlotBits;

  static uint32_t SlotOf(uint64_t id) {
    return static_cast<uint32_t>(id & (kMaxSlots - 1));
  }
  // A new id for `slot` (< kMaxSlots).
  uint64_t Next(uint32_t slot) {
    if (next_ == kSequenceLimit) next_ = 1;
    return (next_++ << kSlotBits) | slot;
  }
  // The sequence the next id gets, and going on from another process's
  // (a handover): ids it made are not made again before the wrap.
  uint64_t next_sequence() const { return next_; }
  void ContinueFrom(uint64_t next_sequence) {
    if (next_sequence > 0 && next_sequence <= kSequenceLimit) {
      next_ = next_sequence;
    }
  }

 private:
  static constexpr uint64_t kSequenceLimit = uint64_t{1} << (64 - kSlotBits);
  uint64_t next_ = 1;
};

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_SLAB_H_
