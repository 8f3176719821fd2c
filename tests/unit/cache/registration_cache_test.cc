// RegistrationCache (W5): hits, misses, reference counts, concurrent
// creation, failures, invalidation (W11) and statistics. The create function
// stands in for the device registration.
#include "server/cache/registration_cache.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "mrd/status.h"

namespace mrd::cache {
namespace {

CacheKey Key(uint64_t offset = 0, uint64_t length = 4096, uint32_t access = 0) {
  CacheKey key;
  key.session = 1;
  key.buffer = 20;
  key.offset = offset;
  key.length = length;
  key.access = access;
  key.base_address = 0x100000000 + offset;
  return key;
}

CachedRegistration Reg(uint64_t mr) {
  CachedRegistration reg;
  reg.device_mr = mr;
  reg.lkey = static_cast<uint32_t>(mr * 2);
  reg.rkey = static_cast<uint32_t>(mr * 2 + 1);
  reg.pinned_bytes = 4096;
  return reg;
}

// A create function that counts its calls and returns Reg(next id).
class Creator {
 public:
  absl::StatusOr<CachedRegistration> operator()() {
    if (delay_ > absl::ZeroDuration()) absl::SleepFor(delay_);
    return Reg(++calls_);
  }
  void set_delay(absl::Duration d) { delay_ = d; }
  int calls() const { return calls_.load(); }

 private:
  std::atomic<int> calls_{0};
  absl::Duration delay_;
};

bool IsUnknownRegistration(const absl::Status& s) {
  return s.code() == absl::StatusCode::kNotFound &&
         GetErrorDetail(s).reason() == "UNKNOWN_REGISTRATION";
}

// An Acquire(Key()) on a thread of its own whose creation waits until
// Finish() and then returns `result`; constructed once the creation began.
class BlockedCreate {
 public:
  BlockedCreate(RegistrationCache& cache,
                absl::StatusOr<CachedRegistration> result)
      : result_(std::move(result)) {
    thread_ = std::thread([this, &cache] {
      status_ = cache
                    .Acquire(Key(),
                             [this]() -> absl::StatusOr<CachedRegistration> {
                               creating_.Notify();
                               finish_.WaitForNotification();
                               return result_;
                             })
                    .status();
    });
    creating_.WaitForNotification();
  }
  // Lets the creation return; the creator's Acquire status.
  absl::Status Finish() {
    finish_.Notify();
    thread_.join();
    return status_;
  }

 private:
  const absl::StatusOr<CachedRegistration> result_;
  absl::Notification creating_;
  absl::Notification finish_;
  absl::Status status_;
  std::thread thread_;
};

TEST(RegistrationCacheTest, FirstAcquireMissesAndCreatesOnce) {
  RegistrationCache cache;
  Creator create;
  absl::StatusOr<AcquireResult> r = cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->hit);
  EXPECT_EQ(r->references, 1u);
  EXPECT_NE(r->entry, 0u);
  EXPECT_EQ(r->registration.device_mr, 1u);
  EXPECT_EQ(r->registration.rkey, 3u);
  EXPECT_EQ(create.calls(), 1);
  EXPECT_EQ(cache.References(r->entry), 1u);
}

TEST(RegistrationCacheTest, SecondAcquireOfSameKeyHitsWithoutCreating) {
  RegistrationCache cache;
  Creator create;
  absl::StatusOr<AcquireResult> first = cache.Acquire(Key(), std::ref(create));
  absl::StatusOr<AcquireResult> second = cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_TRUE(second->hit);
  EXPECT_EQ(second->entry, first->entry);
  EXPECT_EQ(second->references, 2u);
  EXPECT_EQ(second->registration.device_mr, first->registration.device_mr);
  EXPECT_EQ(second->registration.rkey, first->registration.rkey);
  EXPECT_EQ(create.calls(), 1);
  EXPECT_EQ(cache.References(first->entry), 2u);
}

TEST(RegistrationCacheTest, EveryKeyFieldDistinguishesEntries) {
  RegistrationCache cache;
  Creator create;
  std::vector<CacheKey> keys(7, Key());
  keys[1].session = 2;
  keys[2].buffer = 21;
  keys[3].offset = 4096;
  keys[4].length = 8192;
  keys[5].access = 1;
  keys[6].base_address = 0x200000000;
  std::set<uint64_t> entries;
  for (const CacheKey& key : keys) {
    absl::StatusOr<AcquireResult> r = cache.Acquire(key, std::ref(create));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->hit);
    entries.insert(r->entry);
  }
  EXPECT_EQ(entries.size(), keys.size());
  EXPECT_EQ(create.calls(), static_cast<int>(keys.size()));
  for (uint64_t e : entries) ASSERT_TRUE(cache.Release(e).ok());
}

TEST(RegistrationCacheTest, OnlyTheLastReleaseReturnsTheRegistration) {
  RegistrationCache cache;
  Creator create;
  uint64_t entry = 0;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<AcquireResult> r = cache.Acquire(Key(), std::ref(create));
    ASSERT_TRUE(r.ok());
    entry = r->entry;
  }
  absl::StatusOr<ReleaseResult> r1 = cache.Release(entry);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->references, 2u);
  EXPECT_FALSE(r1->released.has_value());
  absl::StatusOr<ReleaseResult> r2 = cache.Release(entry);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->references, 1u);
  EXPECT_FALSE(r2->released.has_value());
  absl::StatusOr<ReleaseResult> r3 = cache.Release(entry);
  ASSERT_TRUE(r3.ok());
  EXPECT_EQ(r3->references, 0u);
  ASSERT_TRUE(r3->released.has_value());
  EXPECT_EQ(r3->released->device_mr, 1u);
  EXPECT_EQ(r3->key, Key());
  EXPECT_EQ(cache.References(entry), 0u);
  EXPECT_FALSE(cache.KeyOf(entry).has_value());
  // Nothing is left to release twice.
  EXPECT_TRUE(IsUnknownRegistration(cache.Release(entry).status()));
}

TEST(RegistrationCacheTest, ReleaseOfUnknownEntryIsNotFound) {
  RegistrationCache cache;
  EXPECT_TRUE(IsUnknownRegistration(cache.Release(12345).status()));
  EXPECT_TRUE(IsUnknownRegistration(cache.Invalidate(12345).status()));
  EXPECT_EQ(cache.References(12345), 0u);
}

TEST(RegistrationCacheTest, AcquireAfterLastReleaseMakesANewEntry) {
  RegistrationCache cache;
  Creator create;
  absl::StatusOr<AcquireResult> first = cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(cache.Release(first->entry).ok());
  absl::StatusOr<AcquireResult> second = cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(second.ok());
  EXPECT_FALSE(second->hit);
  EXPECT_NE(second->entry, first->entry);
  EXPECT_NE(second->registration.device_mr, first->registration.device_mr);
  EXPECT_EQ(second->references, 1u);
  EXPECT_EQ(create.calls(), 2);
  ASSERT_TRUE(cache.Release(second->entry).ok());
}

TEST(RegistrationCacheTest, InvalidateDropsTheEntryWhateverItsCount) {
  RegistrationCache cache;
  Creator create;
  uint64_t entry = 0;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<AcquireResult> r = cache.Acquire(Key(), std::ref(create));
    ASSERT_TRUE(r.ok());
    entry = r->entry;
  }
  absl::StatusOr<CachedRegistration> dropped = cache.Invalidate(entry);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->device_mr, 1u);
  EXPECT_EQ(cache.References(entry), 0u);
  EXPECT_TRUE(IsUnknownRegistration(cache.Release(entry).status()));
  EXPECT_TRUE(IsUnknownRegistration(cache.Invalidate(entry).status()));
  absl::StatusOr<AcquireResult> again = cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->hit);
  EXPECT_NE(again->entry, entry);
  EXPECT_EQ(create.calls(), 2);
  ASSERT_TRUE(cache.Release(again->entry).ok());
}

TEST(RegistrationCacheTest, KeyOfNamesTheEntrysKey) {
  RegistrationCache cache;
  Creator create;
  absl::StatusOr<AcquireResult> r =
      cache.Acquire(Key(8192, 100, 3), std::ref(create));
  ASSERT_TRUE(r.ok());
  std::optional<CacheKey> key = cache.KeyOf(r->entry);
  ASSERT_TRUE(key.has_value());
  EXPECT_EQ(*key, Key(8192, 100, 3));
  ASSERT_TRUE(cache.Release(r->entry).ok());
}

TEST(RegistrationCacheTest, StatsCountHitsMissesReleasesInvalidations) {
  RegistrationCache cache;
  Creator create;
  absl::StatusOr<AcquireResult> a = cache.Acquire(Key(0), std::ref(create));
  absl::StatusOr<AcquireResult> a2 = cache.Acquire(Key(0), std::ref(create));
  absl::StatusOr<AcquireResult> a3 = cache.Acquire(Key(0), std::ref(create));
  absl::StatusOr<AcquireResult> b = cache.Acquire(Key(4096), std::ref(create));
  absl::StatusOr<AcquireResult> c = cache.Acquire(Key(8192), std::ref(create));
  ASSERT_TRUE(a.ok() && a2.ok() && a3.ok() && b.ok() && c.ok());
  CacheStats stats = cache.Stats();
  EXPECT_EQ(stats.hits, 2u);
  EXPECT_EQ(stats.misses, 3u);
  EXPECT_EQ(stats.entries, 3u);
  EXPECT_EQ(stats.releases, 0u);
  EXPECT_EQ(stats.invalidations, 0u);

  ASSERT_TRUE(cache.Release(a->entry).ok());  // 3 -> 2: not a release
  ASSERT_TRUE(cache.Release(b->entry).ok());  // last reference
  ASSERT_TRUE(cache.Invalidate(c->entry).ok());
  stats = cache.Stats();
  EXPECT_EQ(stats.releases, 1u);
  EXPECT_EQ(stats.invalidations, 1u);
  EXPECT_EQ(stats.entries, 1u);

  ASSERT_TRUE(cache.Release(a->entry).ok());
  ASSERT_TRUE(cache.Release(a->entry).ok());
  stats = cache.Stats();
  EXPECT_EQ(stats.releases, 2u);
  EXPECT_EQ(stats.entries, 0u);
}

TEST(RegistrationCacheTest, FailedCreateLeavesNoEntryAndIsRetriedNextTime) {
  RegistrationCache cache;
  absl::StatusOr<AcquireResult> failed =
      cache.Acquire(Key(), []() -> absl::StatusOr<CachedRegistration> {
        return SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED",
                         "no memory");
      });
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetErrorDetail(failed.status()).reason(), "PIN_FAILED");
  EXPECT_EQ(cache.Stats().entries, 0u);
  Creator create;
  absl::StatusOr<AcquireResult> retried =
      cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_FALSE(retried->hit);
  EXPECT_EQ(create.calls(), 1);
  ASSERT_TRUE(cache.Release(retried->entry).ok());
}

TEST(RegistrationCacheTest, TryAcquireReadyHitsOnlyAReadyEntry) {
  RegistrationCache cache;
  EXPECT_FALSE(cache.TryAcquireReady(Key()).has_value());
  // An entry being created is not waited for.
  std::optional<AcquireResult> during;
  absl::StatusOr<AcquireResult> first =
      cache.Acquire(Key(), [&]() -> absl::StatusOr<CachedRegistration> {
        during = cache.TryAcquireReady(Key());
        return Reg(5);
      });
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(during.has_value());
  std::optional<AcquireResult> hit = cache.TryAcquireReady(Key());
  ASSERT_TRUE(hit.has_value());
  EXPECT_TRUE(hit->hit);
  EXPECT_EQ(hit->entry, first->entry);
  EXPECT_EQ(hit->references, 2u);
  EXPECT_EQ(hit->registration.device_mr, 5u);
  EXPECT_EQ(cache.Stats().hits, 1u);
  EXPECT_FALSE(cache.TryAcquireReady(Key(4096)).has_value());
  ASSERT_TRUE(cache.Release(first->entry).ok());
  ASSERT_TRUE(cache.Release(first->entry).ok());
}

TEST(RegistrationCacheTest, ReleaseIfNotLastNeverReleasesTheLast) {
  RegistrationCache cache;
  Creator create;
  absl::StatusOr<AcquireResult> first = cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(first.ok());
  uint32_t left = 99;
  EXPECT_FALSE(cache.ReleaseIfNotLast(first->entry, &left));
  EXPECT_EQ(left, 99u);
  EXPECT_EQ(cache.References(first->entry), 1u);
  ASSERT_TRUE(cache.Acquire(Key(), std::ref(create)).ok());
  EXPECT_TRUE(cache.ReleaseIfNotLast(first->entry, &left));
  EXPECT_EQ(left, 1u);
  EXPECT_FALSE(cache.ReleaseIfNotLast(first->entry, &left));
  EXPECT_FALSE(cache.ReleaseIfNotLast(first->entry + 1000, &left));
  absl::StatusOr<ReleaseResult> last = cache.Release(first->entry);
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(last->released.has_value());
  EXPECT_EQ(cache.Stats().entries, 0u);
}

TEST(RegistrationCacheTest, CreateRunsWithoutTheCacheLock) {
  RegistrationCache cache;
  Creator inner;
  uint64_t inner_entry = 0;
  // A create function that uses the cache itself would deadlock if the cache
  // held its lock across it.
  absl::StatusOr<AcquireResult> outer =
      cache.Acquire(Key(0), [&]() -> absl::StatusOr<CachedRegistration> {
        EXPECT_EQ(cache.Stats().entries, 0u);
        absl::StatusOr<AcquireResult> r =
            cache.Acquire(Key(4096), std::ref(inner));
        EXPECT_TRUE(r.ok());
        if (r.ok()) inner_entry = r->entry;
        return Reg(99);
      });
  ASSERT_TRUE(outer.ok()) << outer.status();
  EXPECT_EQ(outer->registration.device_mr, 99u);
  ASSERT_TRUE(cache.Release(outer->entry).ok());
  ASSERT_TRUE(cache.Release(inner_entry).ok());
}

TEST(RegistrationCacheTest, ConcurrentAcquireOfSameKeyCreatesOnce) {
  constexpr int kThreads = 16;
  RegistrationCache cache;
  Creator create;
  create.set_delay(absl::Milliseconds(30));
  std::vector<absl::StatusOr<AcquireResult>> results(
      kThreads, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back(
        [&, i] { results[i] = cache.Acquire(Key(), std::ref(create)); });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(create.calls(), 1);
  int hits = 0;
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->entry, results[0]->entry);
    EXPECT_EQ(r->registration.device_mr, 1u);
    if (r->hit) ++hits;
  }
  EXPECT_EQ(hits, kThreads - 1);
  EXPECT_EQ(cache.References(results[0]->entry),
            static_cast<uint32_t>(kThreads));
  CacheStats stats = cache.Stats();
  EXPECT_EQ(stats.misses, 1u);
  EXPECT_EQ(stats.hits, static_cast<uint64_t>(kThreads - 1));
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_TRUE(cache.Release(results[0]->entry).ok());
  }
  EXPECT_EQ(cache.Stats().entries, 0u);
}

TEST(RegistrationCacheTest, ConcurrentLastReleasesReturnTheRegistrationOnce) {
  constexpr int kThreads = 16;
  RegistrationCache cache;
  Creator create;
  uint64_t entry = 0;
  for (int i = 0; i < kThreads; ++i) {
    absl::StatusOr<AcquireResult> r = cache.Acquire(Key(), std::ref(create));
    ASSERT_TRUE(r.ok());
    entry = r->entry;
  }
  std::atomic<int> released{0};
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      absl::StatusOr<ReleaseResult> r = cache.Release(entry);
      if (!r.ok()) {
        ++errors;
      } else if (r->released.has_value()) {
        ++released;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(released.load(), 1);
  EXPECT_EQ(cache.Stats().releases, 1u);
}

TEST(RegistrationCacheTest, FailedCreateIsReportedToConcurrentWaiters) {
  constexpr int kWaiters = 8;
  RegistrationCache cache;
  BlockedCreate creator(cache, SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES,
                                         "DEVICE_FULL", "the device is full"));
  std::atomic<int> waiter_creates{0};
  std::vector<absl::Status> waiter_results(kWaiters);
  std::vector<std::thread> waiters;
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&, i] {
      waiter_results[i] =
          cache
              .Acquire(Key(),
                       [&]() -> absl::StatusOr<CachedRegistration> {
                         ++waiter_creates;
                         return Reg(1000);
                       })
              .status();
    });
  }
  absl::SleepFor(absl::Milliseconds(200));  // the waiters are blocked now
  const absl::Status creator_result = creator.Finish();
  for (auto& t : waiters) t.join();

  EXPECT_EQ(creator_result.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(waiter_creates.load(), 0) << "a waiter created its own entry";
  for (const absl::Status& s : waiter_results) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_EQ(GetErrorDetail(s).reason(), "DEVICE_FULL");
  }
  CacheStats stats = cache.Stats();
  EXPECT_EQ(stats.entries, 0u);
  EXPECT_EQ(stats.hits, 0u);
  // The key is free again.
  Creator create;
  absl::StatusOr<AcquireResult> r = cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->hit);
  ASSERT_TRUE(cache.Release(r->entry).ok());
}

// A creation its caller gave up on (CANCELLED) says nothing about the
// waiters' calls: one of them creates the registration, the others share it.
TEST(RegistrationCacheTest, WaitersOfACancelledCreateMakeItThemselves) {
  constexpr int kWaiters = 4;
  RegistrationCache cache;
  BlockedCreate creator(cache, absl::CancelledError("the caller gave up"));
  std::atomic<int> waiter_creates{0};
  std::vector<absl::StatusOr<AcquireResult>> results(
      kWaiters, absl::UnknownError("not run"));
  std::vector<std::thread> waiters;
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&, i] {
      results[i] =
          cache.Acquire(Key(), [&]() -> absl::StatusOr<CachedRegistration> {
            ++waiter_creates;
            return Reg(1000);
          });
    });
  }
  absl::SleepFor(absl::Milliseconds(200));  // the waiters are blocked now
  const absl::Status creator_result = creator.Finish();
  for (auto& t : waiters) t.join();

  EXPECT_EQ(creator_result.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(waiter_creates.load(), 1);
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(cache.Stats().entries, 1u);
  for (const auto& r : results) ASSERT_TRUE(cache.Release(r->entry).ok());
  EXPECT_EQ(cache.Stats().entries, 0u);
}

// The header promises that no Acquire is ever handed a registration that is
// being torn down. A waiter that blocked on a creation must therefore not be
// handed that entry if its creator dropped the last reference before the
// waiter woke up: the entry is gone from the maps and its registration is
// being deregistered by the releaser.
TEST(RegistrationCacheTest, WaiterNeverSharesAnEntryReleasedBeforeItWoke) {
  constexpr int kRounds = 100;
  int stale = 0;
  for (int round = 0; round < kRounds; ++round) {
    RegistrationCache cache;
    absl::Notification creating;
    absl::Notification finish;
    bool creator_released = false;
    std::thread creator([&] {
      absl::StatusOr<AcquireResult> r =
          cache.Acquire(Key(), [&]() -> absl::StatusOr<CachedRegistration> {
            creating.Notify();
            finish.WaitForNotification();
            return Reg(1);
          });
      ASSERT_TRUE(r.ok());
      // The creator's caller is done with it at once (e.g. the session
      // closed during the registration): the last reference goes.
      absl::StatusOr<ReleaseResult> rel = cache.Release(r->entry);
      ASSERT_TRUE(rel.ok());
      creator_released = rel->released.has_value();
    });
    creating.WaitForNotification();
    absl::StatusOr<AcquireResult> waiter = absl::UnknownError("not run");
    std::thread waiter_thread(
        [&] { waiter = cache.Acquire(Key(), [] { return Reg(2); }); });
    absl::SleepFor(absl::Milliseconds(5));  // the waiter is blocked now
    finish.Notify();
    creator.join();
    waiter_thread.join();
    ASSERT_TRUE(waiter.ok()) << waiter.status();
    if (waiter->hit && creator_released) {
      // The waiter holds a reference to an entry the cache no longer knows,
      // whose registration the creator's caller is deregistering.
      ++stale;
      EXPECT_EQ(cache.References(waiter->entry), 0u);
    } else {
      EXPECT_GE(cache.References(waiter->entry), 1u);
      (void)cache.Release(waiter->entry);
    }
  }
  EXPECT_EQ(stale, 0) << stale << " of " << kRounds
                      << " waiters were handed a released registration";
}

// A failed creation's status reaches each of its waiters, and only its own:
// the next failed creation of the key (in the same slot) reports its own.
TEST(RegistrationCacheTest, EachFailedCreateReportsItsOwnStatusToItsWaiters) {
  constexpr int kWaiters = 3;
  RegistrationCache cache;
  for (const char* reason : {"FIRST_FAILURE", "SECOND_FAILURE"}) {
    BlockedCreate creator(cache, SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES,
                                           reason, "the device is full"));
    std::vector<absl::Status> results(kWaiters);
    std::vector<std::thread> waiters;
    for (int i = 0; i < kWaiters; ++i) {
      waiters.emplace_back([&, i] {
        results[i] = cache.Acquire(Key(), [] { return Reg(1000); }).status();
      });
    }
    absl::SleepFor(absl::Milliseconds(100));  // the waiters are blocked now
    EXPECT_EQ(GetErrorDetail(creator.Finish()).reason(), reason);
    for (auto& t : waiters) t.join();
    for (const absl::Status& s : results) {
      EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      EXPECT_EQ(GetErrorDetail(s).reason(), reason);
    }
    EXPECT_EQ(cache.Stats().entries, 0u);
  }
}

TEST(RegistrationCacheTest, RestorePutsTheEntryBackUnderItsIdNotItsKey) {
  RegistrationCache cache;
  Creator create;
  auto memory = std::make_shared<int>(7);
  absl::StatusOr<AcquireResult> first =
      cache.Acquire(Key(), [&]() -> absl::StatusOr<CachedRegistration> {
        CachedRegistration reg = Reg(++*memory);
        reg.memory = memory;
        return reg;
      });
  ASSERT_TRUE(first.ok());
  absl::StatusOr<ReleaseResult> released = cache.Release(first->entry);
  ASSERT_TRUE(released.ok() && released->released.has_value());
  EXPECT_EQ(cache.Stats().releases, 1u);
  // The deregistration failed: back with one reference.
  ASSERT_TRUE(
      cache.Restore(first->entry, released->key, *released->released).ok());
  released->released.reset();
  EXPECT_EQ(cache.References(first->entry), 1u);
  EXPECT_EQ(cache.KeyOf(first->entry), Key());
  std::optional<EntryView> view = cache.View(first->entry);
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->rkey, first->registration.rkey);
  EXPECT_EQ(view->references, 1u);
  CacheStats stats = cache.Stats();
  EXPECT_EQ(stats.entries, 1u);
  EXPECT_EQ(stats.releases, 0u);
  // Its id is in use now.
  absl::Status again = cache.Restore(first->entry, Key(), first->registration);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetErrorDetail(again).reason(), "ENTRY_IN_USE");
  // Never handed out by key: a new Acquire makes a new registration.
  absl::StatusOr<AcquireResult> second = cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(second.ok());
  EXPECT_FALSE(second->hit);
  EXPECT_NE(second->entry, first->entry);
  EXPECT_EQ(cache.Stats().entries, 2u);
  // Releasing the restored entry leaves the new one (same key) alone.
  absl::StatusOr<ReleaseResult> last = cache.Release(first->entry);
  ASSERT_TRUE(last.ok() && last->released.has_value());
  EXPECT_EQ(last->released->device_mr, first->registration.device_mr);
  EXPECT_EQ(last->released->memory, memory);
  EXPECT_EQ(cache.References(first->entry), 0u);
  std::optional<AcquireResult> hit = cache.TryAcquireReady(Key());
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->entry, second->entry);
  EXPECT_EQ(cache.References(second->entry), 2u);
  ASSERT_TRUE(cache.Release(second->entry).ok());
  ASSERT_TRUE(cache.Release(second->entry).ok());
  EXPECT_EQ(cache.Stats().entries, 0u);
}

// A handover: entries of another process's cache come in with their ids,
// keys and references, are hits by key, and ids made afterwards are new.
TEST(RegistrationCacheTest, AdoptedEntriesKeepTheirIdsKeysAndReferences) {
  RegistrationCache old_cache;
  Creator create;
  absl::StatusOr<AcquireResult> made =
      old_cache.Acquire(Key(), std::ref(create));
  ASSERT_TRUE(made.ok());
  ASSERT_TRUE(old_cache.Acquire(Key(), std::ref(create)).ok());
  std::optional<EntryView> view = old_cache.View(made->entry);
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->pinned_bytes, made->registration.pinned_bytes);
  EXPECT_FALSE(view->restored);

  RegistrationCache cache;
  ASSERT_TRUE(cache
                  .Adopt(made->entry, view->key, made->registration,
                         view->references, /*restored=*/false)
                  .ok());
  cache.ContinueSequence(old_cache.NextSequence());
  EXPECT_EQ(cache.References(made->entry), 2u);
  std::optional<AcquireResult> hit = cache.TryAcquireReady(Key());
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->entry, made->entry);
  EXPECT_EQ(hit->registration.rkey, made->registration.rkey);
  EXPECT_EQ(hit->references, 3u);
  // Taken: the id, or the key.
  EXPECT_EQ(GetErrorDetail(cache.Adopt(made->entry, view->key,
                                       made->registration, 1, false))
                .reason(),
            "ENTRY_IN_USE");
  EXPECT_EQ(GetErrorDetail(cache.Adopt(made->entry + 1, view->key,
                                       made->registration, 1, false))
                .reason(),
            "ENTRY_IN_USE");
  EXPECT_EQ(GetErrorDetail(cache.Adopt(made->entry + 1, view->key,
                                       made->registration, 0, false))
                .reason(),
            "BAD_ENTRY");
  // A new entry gets an id neither process made.
  CacheKey other = Key();
  other.offset += 4096;
  absl::StatusOr<AcquireResult> fresh = cache.Acquire(other, std::ref(create));
  ASSERT_TRUE(fresh.ok());
  absl::StatusOr<AcquireResult> old_fresh =
      old_cache.Acquire(other, std::ref(create));
  ASSERT_TRUE(old_fresh.ok());
  EXPECT_NE(fresh->entry, made->entry);
  EXPECT_GT(fresh->entry >> 24, made->entry >> 24);
  // A restored entry comes back restored: by id only.
  ASSERT_TRUE(cache
                  .Adopt(uint64_t{99} << 24 | 5, view->key, made->registration,
                         1, /*restored=*/true)
                  .ok());
  EXPECT_TRUE(cache.View(uint64_t{99} << 24 | 5)->restored);
  for (uint64_t id : {made->entry, made->entry, made->entry}) {
    ASSERT_TRUE(cache.Release(id).ok());
  }
  ASSERT_TRUE(cache.Release(fresh->entry).ok());
  ASSERT_TRUE(cache.Release(uint64_t{99} << 24 | 5).ok());
  EXPECT_EQ(cache.Stats().entries, 0u);
}

// A stale id never reaches the entry made after it in its place, and a
// restored entry coexists with the entry made in its place meanwhile.
TEST(RegistrationCacheTest, IdsOfGoneEntriesNeverNameTheirSuccessors) {
  RegistrationCache cache;
  Creator create;
  absl::StatusOr<AcquireResult> first = cache.Acquire(Key(0), std::ref(create));
  ASSERT_TRUE(first.ok());
  absl::StatusOr<ReleaseResult> released = cache.Release(first->entry);
  ASSERT_TRUE(released.ok() && released->released.has_value());
  absl::StatusOr<AcquireResult> next =
      cache.Acquire(Key(4096), std::ref(create));
  ASSERT_TRUE(next.ok());
  EXPECT_NE(next->entry, first->entry);
  EXPECT_NE(next->entry, 0u);
  EXPECT_TRUE(IsUnknownRegistration(cache.Release(first->entry).status()));
  EXPECT_TRUE(IsUnknownRegistration(cache.Invalidate(first->entry).status()));
  uint32_t left = 0;
  ASSERT_TRUE(cache.Acquire(Key(4096), std::ref(create)).ok());
  EXPECT_FALSE(cache.ReleaseIfNotLast(first->entry, &left));
  EXPECT_EQ(cache.References(first->entry), 0u);
  EXPECT_FALSE(cache.KeyOf(first->entry).has_value());
  EXPECT_EQ(cache.References(next->entry), 2u);

  ASSERT_TRUE(
      cache.Restore(first->entry, released->key, *released->released).ok());
  EXPECT_EQ(cache.KeyOf(first->entry), Key(0));
  EXPECT_EQ(cache.KeyOf(next->entry), Key(4096));
  absl::StatusOr<CachedRegistration> dropped = cache.Invalidate(first->entry);
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(dropped->device_mr, first->registration.device_mr);
  EXPECT_EQ(cache.References(next->entry), 2u);
  EXPECT_EQ(cache.Stats().entries, 1u);
  EXPECT_EQ(cache.Stats().invalidations, 1u);
}

// Entries that share a memory hand back the very shared pointer each was
// made with, and the cache keeps the memory alive until the last of them
// is released; shared pointers that differ in address or owner stay apart.
TEST(RegistrationCacheTest, SharedMemoryIsKeptUntilItsLastEntryGoes) {
  RegistrationCache cache;
  auto owner = std::make_shared<std::pair<int, int>>(1, 2);
  std::weak_ptr<const void> watch = owner;
  std::vector<std::shared_ptr<const void>> memories = {
      owner, owner,
      // Same owner, another address.
      std::shared_ptr<const void>(owner, &owner->second),
      // Same address, no owner.
      std::shared_ptr<const void>(std::shared_ptr<const void>(), &owner->first),
      nullptr};
  std::vector<uint64_t> entries;
  for (size_t i = 0; i < memories.size(); ++i) {
    absl::StatusOr<AcquireResult> r = cache.Acquire(
        Key(4096 * i), [&]() -> absl::StatusOr<CachedRegistration> {
          CachedRegistration reg = Reg(i + 1);
          reg.memory = memories[i];
          return reg;
        });
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->registration.memory, memories[i]);
    entries.push_back(r->entry);
  }
  owner.reset();
  for (size_t i = 0; i < memories.size(); ++i) {
    std::optional<AcquireResult> hit = cache.TryAcquireReady(Key(4096 * i));
    ASSERT_TRUE(hit.has_value());
    const std::shared_ptr<const void>& m = hit->registration.memory;
    EXPECT_EQ(m.get(), memories[i].get()) << i;
    EXPECT_FALSE(m.owner_before(memories[i]) || memories[i].owner_before(m))
        << i;
    ASSERT_TRUE(cache.Release(entries[i]).ok());
  }
  std::vector<std::shared_ptr<const void>> released;
  for (size_t i = 0; i < memories.size(); ++i) {
    absl::StatusOr<ReleaseResult> r = cache.Release(entries[i]);
    ASSERT_TRUE(r.ok() && r->released.has_value());
    const std::shared_ptr<const void>& m = r->released->memory;
    EXPECT_EQ(m.get(), memories[i].get()) << i;
    EXPECT_FALSE(m.owner_before(memories[i]) || memories[i].owner_before(m))
        << i;
    released.push_back(m);
  }
  EXPECT_FALSE(watch.expired());  // held by `memories` and `released`
  released.clear();
  memories.clear();
  EXPECT_TRUE(watch.expired()) << "the cache kept the memory after its "
                                  "entries were released";
}

// Past a slab chunk (4,096 entries), over several sessions and buffers:
// every entry found by id and by key.
TEST(RegistrationCacheTest, ManyEntriesAreFoundByIdAndByKey) {
  constexpr int kEntries = 10000;
  auto SpreadKey = [](uint64_t offset, uint64_t length = 4096) {
    CacheKey key = Key(offset, length);
    key.session = 1 + offset / 4096 % 3;
    key.buffer = 20 + offset / 4096 % 5;
    return key;
  };
  RegistrationCache cache;
  Creator create;
  std::vector<uint64_t> entries;
  std::set<uint64_t> distinct;
  for (int i = 0; i < kEntries; ++i) {
    absl::StatusOr<AcquireResult> r =
        cache.Acquire(SpreadKey(4096 * i), std::ref(create));
    ASSERT_TRUE(r.ok());
    entries.push_back(r->entry);
    distinct.insert(r->entry);
  }
  EXPECT_EQ(distinct.size(), entries.size());
  // Free every other one; their slots are reused by new keys.
  for (int i = 0; i < kEntries; i += 2) {
    ASSERT_TRUE(cache.Release(entries[i]).ok());
  }
  for (int i = 0; i < kEntries; i += 2) {
    absl::StatusOr<AcquireResult> r =
        cache.Acquire(SpreadKey(4096 * i, 8192), std::ref(create));
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(distinct.contains(r->entry));
    entries[i] = r->entry;
  }
  for (int i = 0; i < kEntries; ++i) {
    const CacheKey key =
        i % 2 == 0 ? SpreadKey(4096 * i, 8192) : SpreadKey(4096 * i);
    EXPECT_EQ(cache.KeyOf(entries[i]), key) << i;
    std::optional<AcquireResult> hit = cache.TryAcquireReady(key);
    ASSERT_TRUE(hit.has_value()) << i;
    EXPECT_EQ(hit->entry, entries[i]);
    EXPECT_FALSE(cache.TryAcquireReady(SpreadKey(4096 * i, 100)).has_value());
  }
  EXPECT_EQ(cache.Stats().entries, static_cast<uint64_t>(kEntries));
  for (uint64_t e : entries) {
    ASSERT_TRUE(cache.Release(e).ok());
    ASSERT_TRUE(cache.Release(e).ok());
  }
  EXPECT_EQ(cache.Stats().entries, 0u);
}

}  // namespace
}  // namespace mrd::cache
