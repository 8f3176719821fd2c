#include "server/common/slab.h"

#include <cstdint>
#include <optional>
#include <vector>

#include "gtest/gtest.h"

namespace mrd {
namespace {

// Counts constructions and destructions, to catch a leaked or doubly
// destroyed object.
struct Tracked {
  static inline int live = 0;
  Tracked() { ++live; }
  ~Tracked() { --live; }
  Tracked(const Tracked&) = delete;
  Tracked& operator=(const Tracked&) = delete;
  uint64_t value = 0;
};

using SmallSlab = Slab<Tracked, 64>;

TEST(SlabTest, AllocatesValueInitializedObjectsThatStayPut) {
  SmallSlab slab(1000);
  std::vector<Tracked*> objects;
  for (uint32_t n = 0; n < 200; ++n) {
    std::optional<uint32_t> index = slab.Allocate();
    ASSERT_TRUE(index.has_value());
    EXPECT_EQ(*index, n);  // the lowest free slot
    Tracked* t = slab.Get(*index);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->value, 0u);
    t->value = n + 1;
    objects.push_back(t);
  }
  // Later allocations never moved the earlier objects.
  for (uint32_t n = 0; n < 200; ++n) {
    EXPECT_EQ(slab.Get(n), objects[n]);
    EXPECT_EQ(slab.Get(n)->value, n + 1);
  }
  EXPECT_EQ(slab.size(), 200u);
  EXPECT_EQ(slab.live_chunks(), 4u);  // 200 objects, 64 a chunk
  EXPECT_EQ(Tracked::live, 200);
}

TEST(SlabTest, FreeSlotsAreReusedLowestFirst) {
  SmallSlab slab(1000);
  for (int n = 0; n < 130; ++n) ASSERT_TRUE(slab.Allocate().has_value());
  slab.Free(129);
  slab.Free(5);
  slab.Free(70);
  EXPECT_EQ(slab.Get(5), nullptr);
  EXPECT_EQ(slab.Get(70), nullptr);
  EXPECT_EQ(slab.Allocate(), 5u);
  EXPECT_EQ(slab.Allocate(), 70u);
  EXPECT_EQ(slab.Allocate(), 129u);
  EXPECT_EQ(slab.Allocate(), 130u);
  EXPECT_EQ(slab.size(), 131u);
}

TEST(SlabTest, EmptyChunksGoBackAndDestructorsRun) {
  {
    SmallSlab slab(1000);
    for (int n = 0; n < 640; ++n) ASSERT_TRUE(slab.Allocate().has_value());
    EXPECT_EQ(slab.live_chunks(), 10u);
    // Empty every chunk but the first and the last.
    for (uint32_t i = 64; i < 576; ++i) slab.Free(i);
    EXPECT_EQ(slab.live_chunks(), 2u);
    EXPECT_EQ(Tracked::live, 128);
    EXPECT_EQ(slab.Get(100), nullptr);
    EXPECT_NE(slab.Get(600), nullptr);
    // The next object goes into the lowest open chunk, allocated anew.
    EXPECT_EQ(slab.Allocate(), 64u);
    EXPECT_EQ(slab.live_chunks(), 3u);
  }
  EXPECT_EQ(Tracked::live, 0);  // the slab's destructor destroyed the rest
}

TEST(SlabTest, RefusesPastItsCapacity) {
  SmallSlab slab(100);  // rounded up to two chunks
  EXPECT_EQ(slab.capacity(), 128u);
  for (int n = 0; n < 128; ++n) ASSERT_TRUE(slab.Allocate().has_value());
  EXPECT_EQ(slab.Allocate(), std::nullopt);
  EXPECT_EQ(slab.size(), 128u);
  slab.Free(77);
  EXPECT_EQ(slab.Allocate(), 77u);
  EXPECT_EQ(slab.Get(128), nullptr);
  EXPECT_EQ(slab.Get(uint64_t{1} << 40), nullptr);
}

TEST(SlabTest, ForEachVisitsLiveObjectsInIndexOrder) {
  SmallSlab slab(1000);
  for (int n = 0; n < 300; ++n) ASSERT_TRUE(slab.Allocate().has_value());
  for (uint32_t i = 0; i < 300; i += 3) slab.Free(i);
  std::vector<uint32_t> seen;
  slab.ForEach([&](uint32_t index, Tracked& t) {
    t.value = index;
    seen.push_back(index);
  });
  ASSERT_EQ(seen.size(), 200u);
  for (size_t k = 1; k < seen.size(); ++k) EXPECT_LT(seen[k - 1], seen[k]);
  for (uint32_t i : seen) EXPECT_NE(i % 3, 0u);
  const SmallSlab& view = slab;
  uint64_t sum = 0;
  view.ForEach([&](uint32_t index, const Tracked& t) {
    EXPECT_EQ(t.value, index);
    sum += 1;
  });
  EXPECT_EQ(sum, 200u);
}

TEST(SlabIdsTest, AnIdNamesItsSlotAndIsNeverRepeatedOrZero) {
  SlabIds ids;
  const uint64_t first = ids.Next(5);
  const uint64_t second = ids.Next(5);
  const uint64_t last_slot = ids.Next(SlabIds::kMaxSlots - 1);
  EXPECT_NE(first, 0u);
  EXPECT_NE(first, second);
  EXPECT_EQ(SlabIds::SlotOf(first), 5u);
  EXPECT_EQ(SlabIds::SlotOf(second), 5u);
  EXPECT_EQ(SlabIds::SlotOf(last_slot), SlabIds::kMaxSlots - 1);
  EXPECT_NE(ids.Next(0), 0u);  // slot 0 too
}

TEST(SlabTest, AllocateAtTakesThatSlotOnlyWhenFree) {
  SmallSlab slab(1000);
  ASSERT_TRUE(slab.AllocateAt(700));  // a chunk of its own
  EXPECT_FALSE(slab.AllocateAt(700));
  // Past the last chunk (capacity: 16 chunks of 64).
  EXPECT_FALSE(slab.AllocateAt(static_cast<uint32_t>(slab.capacity())));
  ASSERT_NE(slab.Get(700), nullptr);
  EXPECT_EQ(slab.size(), 1u);
  EXPECT_EQ(slab.live_chunks(), 1u);
  // Allocate still starts at the lowest free slot, and skips 700.
  for (uint32_t i = 0; i < 700; ++i) ASSERT_EQ(slab.Allocate(), i);
  EXPECT_EQ(slab.Allocate(), 701u);
  slab.Free(700);
  EXPECT_EQ(slab.Allocate(), 700u);
}

TEST(SlabIdsTest, AnotherProcessesSequenceGoesOn) {
  SlabIds old_ids;
  for (int i = 0; i < 10; ++i) old_ids.Next(3);
  SlabIds ids;
  ids.ContinueFrom(old_ids.next_sequence());
  EXPECT_EQ(ids.Next(3), old_ids.Next(3));
  ids.ContinueFrom(0);  // nonsense is ignored
  EXPECT_GT(ids.next_sequence(), 1u);
}

}  // namespace
}  // namespace mrd
