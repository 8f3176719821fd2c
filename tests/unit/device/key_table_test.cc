#include "server/device/software/key_table.h"

#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/software/iova_space.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::device {
namespace {

using ::mrd::device::testing::IsSeedError;

TEST(KeyTableTest, KeyIsIndexAndKeyByteAndMatchesOnlyExactly) {
  SecureRandomPool random;
  KeyTable table(16, &random);
  absl::StatusOr<uint32_t> key = table.Allocate(42);
  ASSERT_TRUE(key.ok());
  uint32_t index = *key >> 8;
  EXPECT_GE(index, 1u);
  EXPECT_LE(index, 16u);
  EXPECT_EQ(table.Lookup(*key), 42u);
  EXPECT_EQ(table.Lookup(*key ^ 0x01), 0u);   // other key byte
  EXPECT_EQ(table.Lookup(*key ^ 0x100), 0u);  // other index
  EXPECT_EQ(table.Lookup(0), 0u);
  table.Release(*key);
  EXPECT_EQ(table.Lookup(*key), 0u);
}

TEST(KeyTableTest, ReissueChangesTheKeyByteAndKillsTheOldKey) {
  SecureRandomPool random;
  KeyTable table(4, &random);
  uint32_t key = *table.Allocate(7);
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<uint32_t> next = table.Reissue(key);
    ASSERT_TRUE(next.ok());
    EXPECT_EQ(*next >> 8, key >> 8);
    EXPECT_NE(*next & 0xff, key & 0xff);
    EXPECT_EQ(table.Lookup(key), 0u);
    EXPECT_EQ(table.Lookup(*next), 7u);
    key = *next;
  }
  table.Release(key);
}

TEST(KeyTableTest, ReusedSlotNeverRepeatsTheKeyByteAndCoversAllBytes) {
  SecureRandomPool random;
  KeyTable table(1, &random);
  std::set<uint32_t> bytes;
  uint32_t previous = *table.Allocate(1);
  table.Release(previous);
  for (int i = 0; i < 10000; ++i) {
    uint32_t key = *table.Allocate(1);
    ASSERT_EQ(key >> 8, 1u);
    ASSERT_NE(key & 0xff, previous & 0xff) << "draw " << i;
    bytes.insert(key & 0xff);
    table.Release(key);
    previous = key;
  }
  // Uniform over the 255 other bytes: after 10000 draws all 256 appear
  // (a missing one has probability below 1e-15).
  EXPECT_EQ(bytes.size(), 256u);
}

TEST(KeyTableTest, ExhaustionIsInsufficientResources) {
  SecureRandomPool random;
  KeyTable table(2, &random);
  uint32_t a = *table.Allocate(1);
  uint32_t b = *table.Allocate(2);
  EXPECT_NE(a >> 8, b >> 8);
  EXPECT_THAT(table.Allocate(3).status(),
              IsSeedError(v1::STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED"));
  table.Release(a);
  EXPECT_TRUE(table.Allocate(3).ok());
  EXPECT_EQ(table.free_slots(), 0u);
}

TEST(KeyTableTest, SlotsAreHandedOutInNoFixedOrder) {
  SecureRandomPool random;
  KeyTable table(1024, &random);
  int ascending = 0;
  uint32_t previous = *table.Allocate(1);
  for (uint64_t owner = 2; owner <= 64; ++owner) {
    uint32_t key = *table.Allocate(owner);
    ascending += (key >> 8) == (previous >> 8) + 1 ? 1 : 0;
    previous = key;
  }
  EXPECT_LT(ascending, 10);
}

TEST(IovaSpaceTest, RangesArePageAlignedDisjointAndSeparatedByGuards) {
  const uint64_t ps = 4096;
  IovaSpace space(ps, 1000 * ps, 1 << 30);
  absl::StatusOr<uint64_t> a = space.Allocate(3, 2, 11);
  absl::StatusOr<uint64_t> b = space.Allocate(1, 1, 12);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, 1002 * ps);  // after two guard pages
  EXPECT_EQ(*b, *a + 4 * ps);
  std::optional<IovaSpace::Hit> hit = space.Lookup(*a + 2 * ps + 5);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->owner, 11u);
  EXPECT_EQ(hit->page_index, 2u);
  EXPECT_FALSE(space.Lookup(*a + 3 * ps).has_value());  // the guard page
  EXPECT_FALSE(space.Lookup(*a - ps).has_value());
  EXPECT_FALSE(space.Lookup(0).has_value());
  space.Free(*a);
  EXPECT_FALSE(space.Lookup(*a).has_value());
  // Addresses are not reused.
  EXPECT_GT(*space.Allocate(3, 1, 13), *b);
}

TEST(IovaSpaceTest, ExhaustionIsInsufficientResources) {
  const uint64_t ps = 4096;
  IovaSpace space(ps, ps, 10 * ps);
  EXPECT_TRUE(space.Allocate(8, 1, 1).ok());
  EXPECT_THAT(space.Allocate(1, 1, 2).status(),
              IsSeedError(v1::STATUS_INSUFFICIENT_RESOURCES, "IOVA_EXHAUSTED"));
}

}  // namespace
}  // namespace mrd::device
