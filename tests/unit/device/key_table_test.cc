#include "server/device/software/key_table.h"

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/iova_space.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::device {
namespace {

// The software device's default key capacity (kDefaultMaxKeys, 1.5 Mi).
constexpr uint32_t kDefaultMaxKeysForTest =
    (1u << 20) + (1u << 18) + (1u << 18);

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
  EXPECT_THAT(
      table.Allocate(3).status(),
      IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED"));
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

// Issue 8 item 5: the key space must cover the core's 1 Mi total
// registrations (plus LAMs and fast-register MRs), yet cost memory only as
// keys are taken.
TEST(KeyTableTest, LazyTableTakesMoreThanOneMiKeysWithMemoryFollowingUse) {
  SecureRandomPool random;
  KeyTable table(KeyTable::kMaxSlots, &random);
  EXPECT_EQ(table.MemoryBytes(), 0u);
  EXPECT_EQ(table.free_slots(), KeyTable::kMaxSlots);

  ASSERT_TRUE(table.Allocate(1).ok());
  // One chunk of 64 Ki slots, not 16 Mi.
  EXPECT_EQ(table.grown_slots(), KeyTable::kDefaultChunkSlots - 1);
  EXPECT_LT(table.MemoryBytes(), size_t{2} << 20);

  constexpr uint32_t kKeys = (1u << 20) + 4096;
  std::vector<uint32_t> keys;
  keys.reserve(kKeys);
  std::vector<bool> seen(KeyTable::kMaxSlots + 1);
  for (uint32_t i = 2; i <= kKeys; ++i) {
    absl::StatusOr<uint32_t> key = table.Allocate(i);
    ASSERT_TRUE(key.ok()) << "key " << i << ": " << key.status();
    uint32_t index = *key >> 8;
    ASSERT_GE(index, 1u);
    ASSERT_FALSE(seen[index]) << "index handed out twice: " << index;
    seen[index] = true;
    keys.push_back(*key);
  }
  EXPECT_EQ(table.in_use(), kKeys);
  EXPECT_EQ(table.free_slots(), KeyTable::kMaxSlots - kKeys);
  // Grown by whole chunks as needed, at most one chunk (and the low-water
  // margin) ahead of use.
  EXPECT_LE(table.grown_slots(), kKeys + KeyTable::kDefaultChunkSlots + 4096);
  // ~16 bytes a slot plus the free pool: under 40 bytes per grown slot,
  // where the full 16 Mi table would take 256 MiB.
  EXPECT_LT(table.MemoryBytes(), size_t{table.grown_slots()} * 40);
  std::printf("key table: %u keys held, %u slots grown, %zu bytes\n",
              table.in_use(), table.grown_slots(), table.MemoryBytes());
  for (size_t i = 0; i < keys.size(); i += 4099) {
    EXPECT_EQ(table.Lookup(keys[i]), i + 2);
  }
  // Released keys are reused before anything grows.
  const uint32_t grown = table.grown_slots();
  for (size_t i = 0; i < 100000; ++i) table.Release(keys[i]);
  for (uint32_t i = 0; i < 100000; ++i) {
    ASSERT_TRUE(table.Allocate(kKeys + 1 + i).ok());
  }
  EXPECT_EQ(table.grown_slots(), grown);
}

TEST(KeyTableTest, GrowsChunkByChunkAndExhaustsAtExactlyTheCapacity) {
  SecureRandomPool random;
  KeyTable table(1000, &random, nullptr, /*chunk_slots=*/128);
  EXPECT_EQ(table.grown_slots(), 0u);
  std::set<uint32_t> indices;
  for (uint64_t owner = 1; owner <= 1000; ++owner) {
    absl::StatusOr<uint32_t> key = table.Allocate(owner);
    ASSERT_TRUE(key.ok()) << owner << ": " << key.status();
    EXPECT_LE(table.grown_slots(), owner + 128 + 8);
    indices.insert(*key >> 8);
  }
  EXPECT_EQ(indices.size(), 1000u);
  EXPECT_EQ(*indices.begin(), 1u);
  EXPECT_EQ(*indices.rbegin(), 1000u);
  EXPECT_EQ(table.grown_slots(), 1000u);
  EXPECT_THAT(
      table.Allocate(1001).status(),
      IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED"));
}

TEST(KeyTableTest, ChunksOfOneSlotStillWork) {
  SecureRandomPool random;
  KeyTable table(5, &random, nullptr, /*chunk_slots=*/1);
  std::set<uint32_t> indices;
  for (uint64_t owner = 1; owner <= 5; ++owner) {
    indices.insert(*table.Allocate(owner) >> 8);
  }
  EXPECT_EQ(indices, (std::set<uint32_t>{1, 2, 3, 4, 5}));
  EXPECT_FALSE(table.Allocate(6).ok());
}

TEST(KeyTableTest, FaultPointsFailWithoutTakingASlot) {
  SecureRandomPool random;
  FaultPoints faults;
  KeyTable table(4, &random, &faults);
  faults.Reset();
  uint32_t first = *table.Allocate(1);
  table.Release(first);
  std::vector<std::string> steps = faults.Steps();
  EXPECT_EQ(steps, (std::vector<std::string>{"keys.allocate", "random.key_slot",
                                             "random.key_byte"}));
  for (size_t k = 1; k <= steps.size(); ++k) {
    faults.Arm(static_cast<int>(k), absl::InternalError("injected"));
    EXPECT_EQ(table.Allocate(2).status(), absl::InternalError("injected"));
    EXPECT_EQ(faults.FiredStep(), steps[k - 1]);
    EXPECT_EQ(table.in_use(), 0u);
    EXPECT_EQ(table.free_slots(), 4u);
  }
  faults.Reset();
  EXPECT_TRUE(table.Allocate(2).ok());
}

// Handover: a new process re-creates the keys the old one issued.
TEST(KeyTableTest, ClaimGivesExactlyTheKeyWhichThenBehavesAsAllocated) {
  using ::mrd::device::testing::IsMrdError;
  SecureRandomPool random;
  KeyTable table(1000, &random, nullptr, /*chunk_slots=*/64);
  // Beyond the first chunk: the table grows to cover it.
  const uint32_t key = (700u << 8) | 0x5a;
  absl::StatusOr<uint32_t> claimed = table.Claim(key, 9);
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  EXPECT_EQ(*claimed, key);
  EXPECT_GE(table.grown_slots(), 700u);
  EXPECT_EQ(table.in_use(), 1u);
  EXPECT_EQ(table.free_slots(), 999u);
  EXPECT_EQ(table.Lookup(key), 9u);
  EXPECT_EQ(table.Lookup(key ^ 0x01), 0u);
  // Held, whatever the key byte asked for.
  EXPECT_THAT(table.Claim(key, 10).status(),
              IsMrdError(absl::StatusCode::kFailedPrecondition, "KEY_IN_USE"));
  EXPECT_THAT(table.Claim(key ^ 0x33, 10).status(),
              IsMrdError(absl::StatusCode::kFailedPrecondition, "KEY_IN_USE"));
  // Reissue draws a new byte as for an allocated key.
  absl::StatusOr<uint32_t> next = table.Reissue(key);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next >> 8, 700u);
  EXPECT_NE(*next & 0xff, 0x5au);
  EXPECT_EQ(table.Lookup(key), 0u);
  EXPECT_EQ(table.Lookup(*next), 9u);
  table.Release(*next);
  EXPECT_EQ(table.Lookup(*next), 0u);
  EXPECT_EQ(table.in_use(), 0u);
  // Free again: it can be claimed again, and only once.
  EXPECT_TRUE(table.Claim(key, 11).ok());
  EXPECT_EQ(table.Lookup(key), 11u);
  table.Release(key);
  // Claiming and releasing a slot over and over costs nothing more: the
  // free pool holds each index once.
  const size_t memory = table.MemoryBytes();
  for (int i = 0; i < 10000; ++i) {
    ASSERT_TRUE(table.Claim(key, 12).ok());
    table.Release(key);
  }
  EXPECT_EQ(table.MemoryBytes(), memory);
  // Allocate hands out every slot exactly once, that one included, with a
  // key byte other than the one it last had.
  std::set<uint32_t> indices;
  for (uint32_t owner = 1; owner <= 1000; ++owner) {
    absl::StatusOr<uint32_t> allocated = table.Allocate(owner);
    ASSERT_TRUE(allocated.ok()) << owner << ": " << allocated.status();
    ASSERT_TRUE(indices.insert(*allocated >> 8).second) << (*allocated >> 8);
    if ((*allocated >> 8) == 700u) {
      EXPECT_NE(*allocated & 0xff, 0x5au);
    }
  }
  EXPECT_THAT(
      table.Allocate(1001).status(),
      IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED"));
}

TEST(KeyTableTest, ClaimRefusesKeysOutsideTheTable) {
  using ::mrd::device::testing::IsMrdError;
  SecureRandomPool random;
  KeyTable table(1000, &random);
  for (uint32_t key : {0u, 0xffu, 1001u << 8, (1001u << 8) | 7, ~0u}) {
    EXPECT_THAT(table.Claim(key, 1).status(),
                IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_KEY"))
        << key;
  }
  EXPECT_EQ(table.in_use(), 0u);
  EXPECT_EQ(table.grown_slots(), 0u);
  EXPECT_EQ(table.MemoryBytes(), 0u);
  EXPECT_TRUE(table.Claim((1000u << 8) | 7, 1).ok());  // the last slot
}

TEST(KeyTableTest, ClaimedAndAllocatedKeysNeverCollide) {
  SecureRandomPool random;
  KeyTable table(4096, &random, nullptr, /*chunk_slots=*/256);
  // Every other slot claimed; then Allocate must return exactly the rest.
  std::vector<bool> claimed(4097);
  for (uint32_t index = 2; index <= 4096; index += 2) {
    ASSERT_TRUE(table.Claim((index << 8) | (index & 0xff), index).ok());
    claimed[index] = true;
  }
  // A claimed slot released again goes back to the pool once.
  table.Release((100u << 8) | 100u);
  claimed[100] = false;
  std::set<uint32_t> indices;
  for (uint32_t owner = 1; table.free_slots() > 0; ++owner) {
    absl::StatusOr<uint32_t> key = table.Allocate(owner);
    ASSERT_TRUE(key.ok()) << key.status();
    const uint32_t index = *key >> 8;
    ASSERT_FALSE(claimed[index]) << "claimed index handed out: " << index;
    ASSERT_TRUE(indices.insert(index).second) << "handed out twice: " << index;
  }
  EXPECT_EQ(indices.size(), 2048u + 1);
  EXPECT_TRUE(indices.count(100));
  for (uint32_t index = 2; index <= 4096; index += 2) {
    if (index != 100) {
      EXPECT_EQ(table.Lookup((index << 8) | (index & 0xff)), index);
    }
  }
}

// A new process claims up to about a million keys in a row: each claim is
// O(1) amortized, and Allocate afterwards still never returns a claimed key.
TEST(KeyTableTest, AMillionClaimsInARowThenAllocateAvoidsThem) {
  SecureRandomPool random;
  KeyTable table(kDefaultMaxKeysForTest, &random);
  constexpr uint32_t kClaims = 1u << 20;
  // Spread over the whole table as an old process's random draws were.
  std::vector<bool> claimed(kDefaultMaxKeysForTest + 1);
  uint32_t done = 0;
  for (uint32_t i = 0; done < kClaims; ++i) {
    const uint32_t index =
        1 + static_cast<uint32_t>((uint64_t{i} * 2654435761u) %
                                  kDefaultMaxKeysForTest);
    if (claimed[index]) continue;
    ASSERT_TRUE(table.Claim((index << 8) | (i & 0xff), index).ok()) << index;
    claimed[index] = true;
    ++done;
  }
  EXPECT_EQ(table.in_use(), kClaims);
  // Stale entries are memory the table holds: counted.
  EXPECT_GE(table.MemoryBytes(), size_t{table.grown_slots()} * 12);
  EXPECT_LT(table.MemoryBytes(), size_t{table.grown_slots()} * 40);
  std::printf("key table: %u keys claimed, %u slots grown, %zu bytes\n",
              table.in_use(), table.grown_slots(), table.MemoryBytes());
  uint32_t allocated = 0;
  for (uint32_t owner = 1; table.free_slots() > 0; ++owner) {
    absl::StatusOr<uint32_t> key = table.Allocate(owner);
    ASSERT_TRUE(key.ok()) << key.status();
    ASSERT_FALSE(claimed[*key >> 8]) << "claimed index handed out";
    claimed[*key >> 8] = true;
    ++allocated;
  }
  EXPECT_EQ(allocated, kDefaultMaxKeysForTest - kClaims);
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
  EXPECT_THAT(
      space.Allocate(1, 1, 2).status(),
      IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "IOVA_EXHAUSTED"));
}

}  // namespace
}  // namespace mrd::device
