// Giving memory back after a burst. Abseil's flat tables never shrink when
// elements are erased: a table that once held a million registrations keeps
// their slots after the sessions that made them ended. ShrinkIfSparse
// rehashes a table down to its size once it is at most 1/8 full (and past a
// small size), so an erase costs O(1) amortized and the memory a burst used
// goes back. ReturnFreedMemory hands the allocator's free pages back to the
// kernel (glibc keeps them otherwise: a heap that held a million
// registrations stays that big after they are freed).

#ifndef MRD_SERVER_COMMON_MEMORY_H_
#define MRD_SERVER_COMMON_MEMORY_H_

#include <malloc.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace mrd {

template <typename Table>
void ShrinkIfSparse(Table& table) {
  constexpr size_t kSmall = 1024;
  if (table.capacity() > kSmall && table.size() * 8 < table.capacity()) {
    table.rehash(0);  // Abseil: rehash(0) resizes to fit the size
  }
}

// It walks every arena: worth a call after many objects went, not after
// each one (FreedObjects counts them).
inline void ReturnFreedMemory() { malloc_trim(0); }

// Counts objects freed (registrations, LAMs, MR objects, buffers) and calls
// ReturnFreedMemory once every `every` of them, whichever path freed them (a
// session's end, a released buffer, deregistrations one by one or in
// batches).
class FreedObjects {
 public:
  explicit FreedObjects(uint64_t every) : every_(every) {}
  void Add(uint64_t objects) {
    if (objects == 0) return;
    if (count_.fetch_add(objects, std::memory_order_relaxed) + objects <
        every_) {
      return;
    }
    count_.store(0, std::memory_order_relaxed);
    ReturnFreedMemory();
  }
  // Freed since memory last went back.
  uint64_t pending() const { return count_.load(std::memory_order_relaxed); }

 private:
  const uint64_t every_;
  std::atomic<uint64_t> count_{0};
};

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_MEMORY_H_
