// WarmPinSet: exact-range takes, the per-session and total byte caps with
// least-recently-kept eviction, drops by buffer and session, the owner kept
// alive exactly as long as the pin, counters, and concurrent use.
#include "server/cache/warm_pins.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace mrd::cache {
namespace {

constexpr uint64_t kPage = 4096;

WarmKey KeyOf(uint64_t session, uint64_t buffer, uint64_t offset,
              uint64_t length = kPage) {
  return WarmKey{session, buffer, offset, length};
}

WarmPin Pin(const WarmKey& key, uint64_t lam) {
  WarmPin pin;
  pin.key = key;
  pin.device_lam = lam;
  pin.pinned_bytes = key.length;
  pin.owner = std::make_shared<int>(static_cast<int>(lam));
  return pin;
}

std::set<uint64_t> Lams(const std::vector<WarmPin>& pins) {
  std::set<uint64_t> lams;
  for (const WarmPin& p : pins) lams.insert(p.device_lam);
  return lams;
}

TEST(WarmPinSetTest, TakeReturnsThePinOfExactlyThatRange) {
  WarmPinSet set({8 * kPage, 16 * kPage});
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 0, 2 * kPage), 100)).empty());
  // Not the same pages: another offset, another length, another buffer
  // (another file, or another import of the same one), another session.
  EXPECT_FALSE(set.Take(KeyOf(1, 1, kPage, 2 * kPage)).has_value());
  EXPECT_FALSE(set.Take(KeyOf(1, 1, 0, kPage)).has_value());
  EXPECT_FALSE(set.Take(KeyOf(1, 2, 0, 2 * kPage)).has_value());
  EXPECT_FALSE(set.Take(KeyOf(2, 1, 0, 2 * kPage)).has_value());
  std::optional<WarmPin> pin = set.Take(KeyOf(1, 1, 0, 2 * kPage));
  ASSERT_TRUE(pin.has_value());
  EXPECT_EQ(pin->device_lam, 100u);
  EXPECT_EQ(pin->pinned_bytes, 2 * kPage);
  EXPECT_FALSE(set.Take(KeyOf(1, 1, 0, 2 * kPage)).has_value()) << "taken once";
  WarmPinStats stats = set.Stats();
  EXPECT_EQ(stats.hits, 1u);
  EXPECT_EQ(stats.kept, 1u);
  EXPECT_EQ(stats.pins, 0u);
  EXPECT_EQ(stats.bytes, 0u);
}

TEST(WarmPinSetTest, KeptListsEveryPinLeastRecentlyKeptFirst) {
  WarmPinSet set({10 * kPage, 10 * kPage});
  EXPECT_TRUE(set.Kept().empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 0), 1)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(2, 1, 0, 2 * kPage), 2)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 2, kPage), 3)).empty());
  // Kept again: now the most recent.
  std::vector<WarmPin> back = set.Put(Pin(KeyOf(1, 1, 0), 4));
  ASSERT_EQ(back.size(), 1u);
  std::vector<std::pair<WarmKey, uint64_t>> kept = set.Kept();
  ASSERT_EQ(kept.size(), 3u);
  EXPECT_EQ(kept[0].first, KeyOf(2, 1, 0, 2 * kPage));
  EXPECT_EQ(kept[0].second, 2 * kPage);
  EXPECT_EQ(kept[1].first, KeyOf(1, 2, kPage));
  EXPECT_EQ(kept[2].first, KeyOf(1, 1, 0));
  EXPECT_EQ(kept[2].second, kPage);
  // Listing takes nothing out.
  EXPECT_EQ(set.Stats().pins, 3u);
}

TEST(WarmPinSetTest, ZeroCapsKeepNothing) {
  WarmPinSet off({0, 0});
  EXPECT_FALSE(off.Admissible(kPage));
  std::vector<WarmPin> back = off.Put(Pin(KeyOf(1, 1, 0), 1));
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].device_lam, 1u);
  EXPECT_EQ(off.Stats().pins, 0u);
  EXPECT_EQ(off.Stats().drops, 1u);
  WarmPinSet no_total({kPage, 0});
  EXPECT_FALSE(no_total.Admissible(kPage));
}

TEST(WarmPinSetTest, APinLargerThanACapIsHandedBack) {
  WarmPinSet set({2 * kPage, 3 * kPage});
  EXPECT_TRUE(set.Admissible(2 * kPage));
  EXPECT_FALSE(set.Admissible(3 * kPage));  // over the session's cap
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 0), 1)).empty());
  std::vector<WarmPin> back = set.Put(Pin(KeyOf(1, 1, 0, 3 * kPage), 2));
  EXPECT_EQ(Lams(back), std::set<uint64_t>{2});
  // The pin already kept was not evicted for one that could never fit.
  EXPECT_EQ(set.Stats().pins, 1u);
  EXPECT_EQ(set.Stats().evictions, 0u);
}

TEST(WarmPinSetTest, SessionCapEvictsThatSessionsLeastRecentlyKept) {
  WarmPinSet set({3 * kPage, 100 * kPage});
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 0), 1)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(2, 1, 0), 20)).empty());  // another session
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, kPage), 2)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 2 * kPage), 3)).empty());
  EXPECT_EQ(set.SessionBytes(1), 3 * kPage);
  // A fourth page in session 1 evicts its oldest, not session 2's.
  EXPECT_EQ(Lams(set.Put(Pin(KeyOf(1, 1, 3 * kPage), 4))),
            std::set<uint64_t>{1});
  // Two pages at once evict the next two oldest.
  EXPECT_EQ(Lams(set.Put(Pin(KeyOf(1, 1, 4 * kPage, 2 * kPage), 5))),
            (std::set<uint64_t>{2, 3}));
  EXPECT_EQ(set.SessionBytes(1), 3 * kPage);
  EXPECT_EQ(set.SessionBytes(2), kPage);
  EXPECT_TRUE(set.Take(KeyOf(2, 1, 0)).has_value());
  WarmPinStats stats = set.Stats();
  EXPECT_EQ(stats.evictions, 3u);
  EXPECT_EQ(stats.pins, 2u);
  EXPECT_EQ(stats.bytes, 3 * kPage);
}

TEST(WarmPinSetTest, TotalCapEvictsTheLeastRecentlyKeptOfAnySession) {
  WarmPinSet set({10 * kPage, 3 * kPage});
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 0), 1)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(2, 1, 0), 2)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(3, 1, 0), 3)).empty());
  EXPECT_EQ(Lams(set.Put(Pin(KeyOf(3, 1, kPage), 4))), std::set<uint64_t>{1});
  EXPECT_FALSE(set.Take(KeyOf(1, 1, 0)).has_value());
  EXPECT_TRUE(set.Take(KeyOf(2, 1, 0)).has_value());
  EXPECT_EQ(set.Stats().bytes, 2 * kPage);
}

TEST(WarmPinSetTest, KeepingARangeAlreadyWarmKeepsOneAndRefreshesIt) {
  WarmPinSet set({2 * kPage, 100 * kPage});
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 0), 1)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, kPage), 2)).empty());
  // The same pages again (say, released by a registration with another
  // access): the newcomer is handed back, the old pin becomes the newest.
  EXPECT_EQ(Lams(set.Put(Pin(KeyOf(1, 1, 0), 3))), std::set<uint64_t>{3});
  EXPECT_EQ(set.Stats().pins, 2u);
  // So the next eviction takes the pin at kPage, not the refreshed one.
  EXPECT_EQ(Lams(set.Put(Pin(KeyOf(1, 1, 2 * kPage), 4))),
            std::set<uint64_t>{2});
  std::optional<WarmPin> kept = set.Take(KeyOf(1, 1, 0));
  ASSERT_TRUE(kept.has_value());
  EXPECT_EQ(kept->device_lam, 1u);
}

TEST(WarmPinSetTest, EvictOldestPicksBySessionOrOverall) {
  WarmPinSet set({10 * kPage, 10 * kPage});
  EXPECT_FALSE(set.EvictOldest(std::nullopt).has_value());
  EXPECT_FALSE(set.EvictOldest(1).has_value());
  EXPECT_TRUE(set.Put(Pin(KeyOf(2, 1, 0), 1)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 0), 2)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, kPage), 3)).empty());
  std::optional<WarmPin> mine = set.EvictOldest(1);
  ASSERT_TRUE(mine.has_value());
  EXPECT_EQ(mine->device_lam, 2u);
  std::optional<WarmPin> anyone = set.EvictOldest(std::nullopt);
  ASSERT_TRUE(anyone.has_value());
  EXPECT_EQ(anyone->device_lam, 1u);
  EXPECT_FALSE(set.EvictOldest(2).has_value());
  EXPECT_EQ(set.Stats().evictions, 2u);
}

TEST(WarmPinSetTest, DropBufferTakesOnlyThatBuffersPins) {
  WarmPinSet set({10 * kPage, 10 * kPage});
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 0), 1)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 2, 0), 2)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 2, kPage, 2 * kPage), 3)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 3, 0), 4)).empty());
  EXPECT_TRUE(
      set.Put(Pin(KeyOf(2, 2, 0), 5)).empty());  // same id, other session
  EXPECT_EQ(Lams(set.DropBuffer(1, 2)), (std::set<uint64_t>{2, 3}));
  EXPECT_TRUE(set.DropBuffer(1, 2).empty());
  EXPECT_EQ(set.Stats().pins, 3u);
  EXPECT_EQ(set.Stats().drops, 2u);
  EXPECT_EQ(set.SessionBytes(1), 2 * kPage);
  EXPECT_TRUE(set.Take(KeyOf(2, 2, 0)).has_value());
}

TEST(WarmPinSetTest, DropSessionTakesAllItsPinsAndNothingElse) {
  WarmPinSet set({10 * kPage, 10 * kPage});
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 1, 0), 1)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(1, 2, 0), 2)).empty());
  EXPECT_TRUE(set.Put(Pin(KeyOf(2, 1, 0), 3)).empty());
  EXPECT_EQ(Lams(set.DropSession(1)), (std::set<uint64_t>{1, 2}));
  EXPECT_EQ(set.SessionBytes(1), 0u);
  EXPECT_EQ(set.Stats().pins, 1u);
  EXPECT_EQ(set.Stats().bytes, kPage);
  // The session's eviction order is gone with it.
  EXPECT_FALSE(set.EvictOldest(1).has_value());
}

TEST(WarmPinSetTest, TheOwnerLivesExactlyAsLongAsThePin) {
  WarmPinSet set({10 * kPage, 10 * kPage});
  WarmPin pin = Pin(KeyOf(1, 1, 0), 1);
  std::weak_ptr<void> owner = pin.owner;
  EXPECT_TRUE(set.Put(std::move(pin)).empty());
  EXPECT_FALSE(owner.expired()) << "the set must keep the mapping alive";
  {
    std::vector<WarmPin> dropped = set.DropBuffer(1, 1);
    ASSERT_EQ(dropped.size(), 1u);
    EXPECT_FALSE(owner.expired()) << "until the caller released the pin";
  }
  EXPECT_TRUE(owner.expired());
}

// Many threads keep, take, evict and drop at once; the set's accounting
// must stay exact and within its caps (run under TSan as well).
TEST(WarmPinSetTest, ConcurrentUseKeepsTheAccountingExact) {
  constexpr uint64_t kSessionCap = 8 * kPage;
  constexpr uint64_t kTotalCap = 20 * kPage;
  WarmPinSet set({kSessionCap, kTotalCap});
  std::atomic<uint64_t> next_lam{1};
  std::atomic<int64_t> outside{0};  // pins handed out
  std::atomic<bool> over_cap{false};
  constexpr int kThreads = 4;
  constexpr int kOps = 4000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(static_cast<uint32_t>(t));
      for (int i = 0; i < kOps; ++i) {
        const uint64_t session = 1 + random() % 3;
        const uint64_t buffer = 1 + random() % 2;
        const uint64_t offset = (random() % 8) * kPage;
        const uint64_t length = (1 + random() % 3) * kPage;
        const WarmKey key = KeyOf(session, buffer, offset, length);
        switch (random() % 6) {
          case 0:
          case 1:
          case 2: {
            ++outside;
            outside -= static_cast<int64_t>(
                set.Put(Pin(key, next_lam.fetch_add(1))).size());
            break;
          }
          case 3:
            if (set.Take(key).has_value()) --outside;
            break;
          case 4:
            if (set.EvictOldest(random() % 2 ? std::optional<uint64_t>(session)
                                             : std::nullopt)
                    .has_value()) {
              --outside;
            }
            break;
          case 5:
            outside -= static_cast<int64_t>(
                (random() % 4 == 0 ? set.DropSession(session)
                                   : set.DropBuffer(session, buffer))
                    .size());
            break;
        }
        WarmPinStats stats = set.Stats();
        if (stats.bytes > kTotalCap ||
            set.SessionBytes(session) > kSessionCap) {
          over_cap = true;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(over_cap.load());
  WarmPinStats stats = set.Stats();
  EXPECT_EQ(static_cast<int64_t>(stats.pins), outside.load());
  uint64_t session_sum = 0;
  for (uint64_t s = 1; s <= 3; ++s) session_sum += set.SessionBytes(s);
  EXPECT_EQ(session_sum, stats.bytes);
  // Emptying it returns exactly what it holds.
  uint64_t bytes = 0;
  uint64_t pins = 0;
  for (uint64_t s = 1; s <= 3; ++s) {
    for (const WarmPin& p : set.DropSession(s)) {
      bytes += p.pinned_bytes;
      ++pins;
    }
  }
  EXPECT_EQ(pins, stats.pins);
  EXPECT_EQ(bytes, stats.bytes);
  EXPECT_EQ(set.Stats().pins, 0u);
  EXPECT_EQ(set.Stats().bytes, 0u);
}

}  // namespace
}  // namespace mrd::cache
