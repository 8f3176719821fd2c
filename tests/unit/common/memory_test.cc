// server/common/memory.h: tables shrink once sparse, and freed objects are
// counted towards giving memory back.
#include "server/common/memory.h"

#include <gtest/gtest.h>

#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace mrd {
namespace {

TEST(ShrinkIfSparseTest, ATableEmptiedByErasesGivesItsSlotsBack) {
  absl::flat_hash_map<uint64_t, uint64_t> table;
  for (uint64_t i = 0; i < 100000; ++i) table[i] = i;
  const size_t full = table.capacity();
  ASSERT_GE(full, 100000u);
  for (uint64_t i = 0; i < 100000; ++i) {
    table.erase(i);
    ShrinkIfSparse(table);
  }
  EXPECT_TRUE(table.empty());
  EXPECT_LE(table.capacity(), 1024u);  // down to a small table at most
}

TEST(ShrinkIfSparseTest, KeepsEveryElementAndTheTableStillFindsThem) {
  absl::flat_hash_set<uint64_t> table;
  for (uint64_t i = 0; i < 50000; ++i) table.insert(i);
  for (uint64_t i = 0; i < 50000; ++i) {
    if (i % 100 != 0) {
      table.erase(i);
      ShrinkIfSparse(table);
    }
  }
  EXPECT_EQ(table.size(), 500u);
  EXPECT_LT(table.capacity(), 50000u / 8);
  for (uint64_t i = 0; i < 50000; i += 100) EXPECT_TRUE(table.contains(i));
}

TEST(ShrinkIfSparseTest, LeavesSmallAndDenseTablesAlone) {
  absl::flat_hash_set<uint64_t> small;
  for (uint64_t i = 0; i < 600; ++i) small.insert(i);
  const size_t small_capacity = small.capacity();
  for (uint64_t i = 0; i < 590; ++i) small.erase(i);
  ShrinkIfSparse(small);
  EXPECT_EQ(small.capacity(), small_capacity);  // under 1,024 slots: kept

  absl::flat_hash_set<uint64_t> dense;
  for (uint64_t i = 0; i < 10000; ++i) dense.insert(i);
  const size_t dense_capacity = dense.capacity();
  for (uint64_t i = 0; i < 5000; ++i) dense.erase(i);
  ShrinkIfSparse(dense);
  EXPECT_EQ(dense.capacity(), dense_capacity);  // half full: no rehash
}

TEST(FreedObjectsTest, CountsAcrossCallsAndStartsOverAfterReturning) {
  FreedObjects freed(4096);
  EXPECT_EQ(freed.pending(), 0u);
  freed.Add(0);
  freed.Add(4000);
  EXPECT_EQ(freed.pending(), 4000u);
  freed.Add(95);
  EXPECT_EQ(freed.pending(), 4095u);
  freed.Add(1);  // reaches 4,096: memory goes back, the count restarts
  EXPECT_EQ(freed.pending(), 0u);
  freed.Add(10000);  // one big release returns at once
  EXPECT_EQ(freed.pending(), 0u);
}

}  // namespace
}  // namespace mrd
