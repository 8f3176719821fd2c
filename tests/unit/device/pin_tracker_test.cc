#include "server/device/software/pin_tracker.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/kernel_pins.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::device {

using ::mrd::test_support::KernelPinnedBytesSettled;
namespace {

using ::mrd::device::testing::IsSeedError;
using ::mrd::device::testing::PageSize;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;

// Records calls; fails a Lock whose range starts at `fail_lock_at`.
class FakePinOps final : public PinOps {
 public:
  int Lock(uint64_t address, uint64_t length) override {
    absl::MutexLock lock(&mu_);
    locks_.emplace_back(address, length);
    return address == fail_lock_at_ ? ENOMEM : 0;
  }
  int LockHugePages(uint64_t address, uint64_t length) override {
    {
      absl::MutexLock lock(&mu_);
      ++huge_locks_;
    }
    return Lock(address, length);
  }
  int LockInPieces(uint64_t address, uint64_t length,
                   uint64_t piece_bytes) override {
    {
      absl::MutexLock lock(&mu_);
      piece_locks_.push_back(piece_bytes);
    }
    return Lock(address, length);
  }
  int Unlock(uint64_t address, uint64_t length) override {
    absl::MutexLock lock(&mu_);
    unlocks_.emplace_back(address, length);
    return 0;
  }
  std::vector<uint64_t> TakePieceLocks() {
    absl::MutexLock lock(&mu_);
    return std::exchange(piece_locks_, {});
  }
  int huge_locks() {
    absl::MutexLock lock(&mu_);
    return huge_locks_;
  }
  void FailLockAt(uint64_t address) {
    absl::MutexLock lock(&mu_);
    fail_lock_at_ = address;
  }
  std::vector<std::pair<uint64_t, uint64_t>> TakeLocks() {
    absl::MutexLock lock(&mu_);
    return std::exchange(locks_, {});
  }
  std::vector<std::pair<uint64_t, uint64_t>> TakeUnlocks() {
    absl::MutexLock lock(&mu_);
    return std::exchange(unlocks_, {});
  }

 private:
  absl::Mutex mu_;
  uint64_t fail_lock_at_ ABSL_GUARDED_BY(mu_) = 0;
  int huge_locks_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> piece_locks_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, uint64_t>> locks_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, uint64_t>> unlocks_ ABSL_GUARDED_BY(mu_);
};

class PinTrackerTest : public ::testing::Test {
 protected:
  // Page n of a fake address space (never dereferenced).
  static uint64_t P(uint64_t n) { return kBase + n * PageSize(); }

  void TearDown() override { EXPECT_EQ(tracker_.PinnedBytes(), 0u); }

  static constexpr uint64_t kBase = uint64_t{1} << 40;
  FakePinOps ops_;
  PinTracker tracker_{PageSize(), &ops_};
};

TEST_F(PinTrackerTest, FirstPinLocksAndLastUnpinUnlocks) {
  ASSERT_TRUE(tracker_.Pin(P(0), 2 * PageSize()).ok());
  ASSERT_TRUE(tracker_.Pin(P(0), 2 * PageSize()).ok());
  EXPECT_THAT(ops_.TakeLocks(), ElementsAre(Pair(P(0), 2 * PageSize())));
  EXPECT_EQ(tracker_.RefCount(P(1)), 2u);
  EXPECT_EQ(tracker_.PinnedBytes(), 2 * PageSize());

  tracker_.Unpin(P(0), 2 * PageSize());
  EXPECT_THAT(ops_.TakeUnlocks(), IsEmpty());
  EXPECT_EQ(tracker_.PinnedBytes(), 2 * PageSize());
  tracker_.Unpin(P(0), 2 * PageSize());
  EXPECT_THAT(ops_.TakeUnlocks(), ElementsAre(Pair(P(0), 2 * PageSize())));
}

TEST_F(PinTrackerTest, HugePageMemoryIsLockedThroughLockHugePages) {
  ASSERT_TRUE(tracker_.Pin(P(0), 2 * PageSize(), /*huge_pages=*/true).ok());
  EXPECT_EQ(ops_.huge_locks(), 1);
  ASSERT_TRUE(tracker_.Pin(P(4), PageSize()).ok());
  EXPECT_EQ(ops_.huge_locks(), 1);  // not for ordinary memory
  EXPECT_THAT(ops_.TakeLocks(),
              ElementsAre(Pair(P(0), 2 * PageSize()), Pair(P(4), PageSize())));
  tracker_.Unpin(P(0), 2 * PageSize());
  tracker_.Unpin(P(4), PageSize());
}

// A batch's pin ahead (PinInPieces) locks the pages no one pins yet in
// pieces; the items pinned within it then only count their pages, and once
// it goes each page stays pinned as long as an item holds it.
TEST_F(PinTrackerTest, PinInPiecesLocksNewPagesInPiecesAndItemsOnlyCount) {
  const uint64_t ps = PageSize();
  ASSERT_TRUE(tracker_.Pin(P(2), ps).ok());
  (void)ops_.TakeLocks();
  ASSERT_TRUE(tracker_.PinInPieces(P(0), 8 * ps, 4 * ps).ok());
  EXPECT_THAT(ops_.TakeLocks(),
              ElementsAre(Pair(P(0), 2 * ps), Pair(P(3), 5 * ps)));
  EXPECT_THAT(ops_.TakePieceLocks(), ElementsAre(4 * ps, 4 * ps));
  for (uint64_t page = 0; page < 8; ++page) {
    ASSERT_TRUE(tracker_.Pin(P(page), ps).ok());
  }
  EXPECT_THAT(ops_.TakeLocks(), IsEmpty());  // the items only count
  EXPECT_EQ(tracker_.RefCount(P(5)), 2u);
  EXPECT_EQ(tracker_.RefCount(P(2)), 3u);
  // Item 7 is refused (its registration undone): its page goes with the
  // pin ahead, the others stay.
  tracker_.Unpin(P(7), ps);
  tracker_.Unpin(P(0), 8 * ps);
  EXPECT_THAT(ops_.TakeUnlocks(), ElementsAre(Pair(P(7), ps)));
  EXPECT_EQ(tracker_.PinnedBytes(), 7 * ps);
  EXPECT_THAT(ops_.TakePieceLocks(), IsEmpty());  // a plain Pin is a Lock
  for (uint64_t page = 0; page < 7; ++page) tracker_.Unpin(P(page), ps);
  tracker_.Unpin(P(2), ps);
  EXPECT_THAT(ops_.TakeUnlocks(),
              ElementsAre(Pair(P(0), ps), Pair(P(1), ps), Pair(P(3), ps),
                          Pair(P(4), ps), Pair(P(5), ps), Pair(P(6), ps),
                          Pair(P(2), ps)));
}

TEST_F(PinTrackerTest, OverlapLocksOnlyNewPagesAndUnlocksOnlyReleasedOnes) {
  ASSERT_TRUE(tracker_.Pin(P(0), 4 * PageSize()).ok());
  ASSERT_TRUE(tracker_.Pin(P(2), 4 * PageSize()).ok());
  EXPECT_THAT(ops_.TakeLocks(), ElementsAre(Pair(P(0), 4 * PageSize()),
                                            Pair(P(4), 2 * PageSize())));
  EXPECT_EQ(tracker_.PinnedBytes(), 6 * PageSize());
  EXPECT_EQ(tracker_.RefCount(P(1)), 1u);
  EXPECT_EQ(tracker_.RefCount(P(3)), 2u);
  EXPECT_EQ(tracker_.RefCount(P(5)), 1u);

  // munlock of the first range must keep the pages the second still pins.
  tracker_.Unpin(P(0), 4 * PageSize());
  EXPECT_THAT(ops_.TakeUnlocks(), ElementsAre(Pair(P(0), 2 * PageSize())));
  EXPECT_EQ(tracker_.PinnedBytes(), 4 * PageSize());
  EXPECT_EQ(tracker_.RefCount(P(2)), 1u);

  tracker_.Unpin(P(2), 4 * PageSize());
  EXPECT_THAT(ops_.TakeUnlocks(), ElementsAre(Pair(P(2), 4 * PageSize())));
}

TEST_F(PinTrackerTest, PinInsideAHoleLocksEveryGap) {
  ASSERT_TRUE(tracker_.Pin(P(1), PageSize()).ok());
  ASSERT_TRUE(tracker_.Pin(P(3), PageSize()).ok());
  ops_.TakeLocks();
  ASSERT_TRUE(tracker_.Pin(P(0), 5 * PageSize()).ok());
  EXPECT_THAT(ops_.TakeLocks(),
              ElementsAre(Pair(P(0), PageSize()), Pair(P(2), PageSize()),
                          Pair(P(4), PageSize())));
  tracker_.Unpin(P(0), 5 * PageSize());
  // Pages 1 and 3 are still pinned by their own pins.
  EXPECT_THAT(ops_.TakeUnlocks(),
              ElementsAre(Pair(P(0), PageSize()), Pair(P(2), PageSize()),
                          Pair(P(4), PageSize())));
  tracker_.Unpin(P(1), PageSize());
  tracker_.Unpin(P(3), PageSize());
}

TEST_F(PinTrackerTest, SubPageRangesRoundOutToWholePages) {
  ASSERT_TRUE(tracker_.Pin(P(0) + 100, 10).ok());
  EXPECT_EQ(tracker_.PinnedBytes(), PageSize());
  ASSERT_TRUE(tracker_.Pin(P(1) - 1, 2).ok());  // straddles pages 0 and 1
  EXPECT_EQ(tracker_.PinnedBytes(), 2 * PageSize());
  EXPECT_EQ(tracker_.RefCount(P(0)), 2u);
  EXPECT_EQ(tracker_.RefCount(P(1)), 1u);
  tracker_.Unpin(P(1) - 1, 2);
  tracker_.Unpin(P(0) + 100, 10);
}

TEST_F(PinTrackerTest, RunsWithEqualCountsMerge) {
  ASSERT_TRUE(tracker_.Pin(P(0), 2 * PageSize()).ok());
  ASSERT_TRUE(tracker_.Pin(P(2), 2 * PageSize()).ok());
  EXPECT_EQ(tracker_.Runs(), 1u);
  ASSERT_TRUE(tracker_.Pin(P(1), 2 * PageSize()).ok());
  EXPECT_EQ(tracker_.Runs(), 3u);  // 1 | 2 2 | 1
  tracker_.Unpin(P(1), 2 * PageSize());
  EXPECT_EQ(tracker_.Runs(), 1u);
  tracker_.Unpin(P(0), 2 * PageSize());
  tracker_.Unpin(P(2), 2 * PageSize());
  EXPECT_EQ(tracker_.Runs(), 0u);
}

TEST_F(PinTrackerTest, LargeSpanIsOneRun) {
  const uint64_t gib = uint64_t{1} << 30;
  ASSERT_TRUE(tracker_.Pin(P(0), gib).ok());
  ASSERT_TRUE(tracker_.Pin(P(0) + gib / 2, gib).ok());
  EXPECT_EQ(tracker_.Runs(), 3u);
  EXPECT_EQ(tracker_.PinnedBytes(), gib + gib / 2);
  tracker_.Unpin(P(0), gib);
  tracker_.Unpin(P(0) + gib / 2, gib);
}

TEST_F(PinTrackerTest, FailedLockUndoesEveryGapAndKeepsOtherPins) {
  ASSERT_TRUE(tracker_.Pin(P(2), PageSize()).ok());
  ops_.TakeLocks();
  ops_.FailLockAt(P(3));  // the second gap of [0, 6)
  absl::Status status = tracker_.Pin(P(0), 6 * PageSize());
  EXPECT_THAT(status,
              IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED"));
  EXPECT_THAT(ops_.TakeLocks(), ElementsAre(Pair(P(0), 2 * PageSize()),
                                            Pair(P(3), 3 * PageSize())));
  // The failed gap (mlock may have locked a prefix) and the earlier gap.
  EXPECT_THAT(ops_.TakeUnlocks(), ElementsAre(Pair(P(3), 3 * PageSize()),
                                              Pair(P(0), 2 * PageSize())));
  EXPECT_EQ(tracker_.PinnedBytes(), PageSize());
  EXPECT_EQ(tracker_.RefCount(P(0)), 0u);
  EXPECT_EQ(tracker_.RefCount(P(2)), 1u);
  tracker_.Unpin(P(2), PageSize());
}

TEST_F(PinTrackerTest, EmptyAndWrappingRangesAreRefused) {
  EXPECT_THAT(tracker_.Pin(P(0), 0),
              IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "SPAN_OVERFLOW"));
  EXPECT_THAT(tracker_.Pin(UINT64_MAX - 10, 100),
              IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "SPAN_OVERFLOW"));
  EXPECT_THAT(ops_.TakeLocks(), IsEmpty());
}

TEST(PinTrackerDeathTest, UnpinningWhatWasNeverPinnedAborts) {
  FakePinOps ops;
  PinTracker tracker(PageSize(), &ops);
  EXPECT_DEATH(tracker.Unpin(uint64_t{1} << 40, PageSize()), "check failed");
}

// The same accounting against the kernel: its pins follow the tracker.
TEST(PinTrackerSystemTest, RealPinsAreReferenceCountedInTheKernel) {
  const uint64_t ps = PageSize();
  void* map = mmap(nullptr, 4 * ps, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  const uint64_t base = reinterpret_cast<uint64_t>(map);
  const uint64_t before = KernelPinnedBytesSettled(0);
  {
    PinTracker tracker(ps, SystemPinOps());
    ASSERT_TRUE(tracker.Pin(base, 3 * ps).ok());
    ASSERT_TRUE(tracker.Pin(base + ps, 3 * ps).ok());
    EXPECT_EQ(KernelPinnedBytesSettled(before + 4 * ps) - before, 4 * ps);
    tracker.Unpin(base, 3 * ps);
    // A plain munlock of the first range would have dropped pages 1-2 too.
    EXPECT_EQ(KernelPinnedBytesSettled(before + 3 * ps) - before, 3 * ps);
    EXPECT_EQ(tracker.PinnedBytes(), 3 * ps);
    tracker.Unpin(base + ps, 3 * ps);
    EXPECT_EQ(KernelPinnedBytesSettled(before), before);
  }
  munmap(map, 4 * ps);
}

TEST(PinTrackerSystemTest, PinOverAHoleLeavesNothingLocked) {
  const uint64_t ps = PageSize();
  void* map = mmap(nullptr, 3 * ps, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  const uint64_t base = reinterpret_cast<uint64_t>(map);
  ASSERT_EQ(munmap(reinterpret_cast<void*>(base + ps), ps), 0);
  const uint64_t before = KernelPinnedBytesSettled(0);
  {
    PinTracker tracker(ps, SystemPinOps());
    EXPECT_THAT(
        tracker.Pin(base, 3 * ps),
        IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED"));
    // mlock itself locked page 0 before failing on the hole.
    EXPECT_EQ(KernelPinnedBytesSettled(before), before);
    EXPECT_EQ(tracker.PinnedBytes(), 0u);
  }
  munmap(map, ps);
  munmap(reinterpret_cast<void*>(base + 2 * ps), ps);
}

// mlock over file pages past the end of the file fails, yet leaves the
// whole range locked; the tracker must undo that.
TEST(PinTrackerSystemTest, PinPastEndOfFileLeavesNothingLocked) {
  const uint64_t ps = PageSize();
  std::unique_ptr<testing::MemfdBuffer> buffer =
      testing::MemfdBuffer::Create(3);
  ASSERT_NE(buffer, nullptr);
  ASSERT_EQ(ftruncate(buffer->fd(), static_cast<off_t>(ps)), 0);
  const uint64_t before = KernelPinnedBytesSettled(0);
  PinTracker tracker(ps, SystemPinOps());
  EXPECT_THAT(tracker.Pin(reinterpret_cast<uint64_t>(buffer->data()), 3 * ps),
              IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED"));
  EXPECT_EQ(KernelPinnedBytesSettled(before), before);
  EXPECT_EQ(tracker.PinnedBytes(), 0u);
}

// A long pin goes kLockStep at a time (the lock let go in between),
// counting pages others pinned at once, and reports every byte by the end.
TEST_F(PinTrackerTest, PinWithProgressGoesInStepsAndCountsEveryByte) {
  const uint64_t pages_per_step = kLockStep / PageSize();
  const uint64_t start = kBase;  // step-aligned (kBase is 1 TiB)
  ASSERT_TRUE(tracker_.Pin(start, PageSize()).ok());  // pinned by another
  ops_.TakeLocks();
  const uint64_t steps = 2 * kPinStep / kLockStep;
  const uint64_t length = 2 * kPinStep + 3 * PageSize();
  WorkProgress progress(length);
  ASSERT_TRUE(tracker_.Pin(start, length, false, &progress).ok());
  std::vector<std::pair<uint64_t, uint64_t>> expected = {
      {P(1), kLockStep - PageSize()}};
  for (uint64_t i = 1; i < steps; ++i) {
    expected.emplace_back(P(i * pages_per_step), kLockStep);
  }
  expected.emplace_back(P(steps * pages_per_step), 3 * PageSize());
  EXPECT_EQ(ops_.TakeLocks(), expected);
  EXPECT_EQ(progress.pinned(), length);
  tracker_.Unpin(start, length);
  tracker_.Unpin(start, PageSize());
  // The unpin went a step at a time as well (the steps, the tail, then the
  // other pin's page).
  EXPECT_EQ(ops_.TakeUnlocks().size(), steps + 2);
}

// Cancelled between steps: CANCELLED, every step pinned is unpinned again,
// and pages others pin keep their pins.
TEST_F(PinTrackerTest, CancelledPinUndoesEveryStep) {
  ASSERT_TRUE(tracker_.Pin(P(0), PageSize()).ok());
  ops_.TakeLocks();
  const uint64_t length = 3 * kPinStep;
  int asked = 0;
  WorkProgress progress(length, [&asked] { return ++asked >= 2; });
  absl::Status s = tracker_.Pin(P(0), length, false, &progress);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  // Two progress steps (each kPinStep of lock steps), then the answer.
  EXPECT_EQ(ops_.TakeLocks().size(), 2 * kPinStep / kLockStep);
  // Each step was counted when pinned; the undo releases both at once
  // (their pages are one run by then): every page the pin locked.
  uint64_t unlocked = 0;
  for (const auto& [address, bytes] : ops_.TakeUnlocks()) unlocked += bytes;
  EXPECT_EQ(unlocked, 2 * kPinStep - PageSize());
  EXPECT_EQ(tracker_.PinnedBytes(), PageSize());
  EXPECT_EQ(tracker_.RefCount(P(0)), 1u);
  EXPECT_EQ(tracker_.RefCount(P(1)), 0u);
  tracker_.Unpin(P(0), PageSize());
  ops_.TakeUnlocks();
}

// Pins whose kernel calls may be held: a Lock or Unlock of a range starting
// at the gate's address waits in the "kernel" until the gate opens. It also
// checks what the tracker promises its PinOps: no two calls in flight at
// once touch the same page.
class GatedPinOps final : public PinOps {
 public:
  int Lock(uint64_t address, uint64_t length) override {
    return Call(address, length, /*lock=*/true);
  }
  int Unlock(uint64_t address, uint64_t length) override {
    return Call(address, length, /*lock=*/false);
  }
  void Gate(uint64_t address) {
    absl::MutexLock lock(&mu_);
    gate_at_ = address;
    gate_open_ = false;
  }
  // Waits until a call is held at the gate.
  void AwaitHeld() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&held_));
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    gate_open_ = true;
  }
  std::vector<std::string> Calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  int overlaps() {
    absl::MutexLock lock(&mu_);
    return overlaps_;
  }

 private:
  int Call(uint64_t address, uint64_t length, bool lock_call) {
    absl::MutexLock lock(&mu_);
    for (const auto& [from, to] : in_flight_) {
      if (from < address + length && address < to) ++overlaps_;
    }
    in_flight_.emplace_back(address, address + length);
    if (address == gate_at_) {
      held_ = true;
      mu_.Await(absl::Condition(&gate_open_));
      held_ = false;
      gate_at_ = 0;
    }
    in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(),
                               std::make_pair(address, address + length)));
    calls_.push_back(
        absl::StrCat(lock_call ? "lock " : "unlock ", address, "+", length));
    return 0;
  }

  absl::Mutex mu_;
  uint64_t gate_at_ ABSL_GUARDED_BY(mu_) = 0;
  bool gate_open_ ABSL_GUARDED_BY(mu_) = false;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  int overlaps_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<uint64_t, uint64_t>> in_flight_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
};

class PinTrackerConcurrencyTest : public ::testing::Test {
 protected:
  static uint64_t P(uint64_t n) { return (uint64_t{1} << 40) + n * PageSize(); }
  // Runs `fn` on a thread of its own; the thread is joined by the fixture.
  void Spawn(std::function<void()> fn) { threads_.emplace_back(std::move(fn)); }
  void TearDown() override {
    ops_.Open();
    for (std::thread& thread : threads_) thread.join();
    EXPECT_EQ(ops_.overlaps(), 0);
  }

  GatedPinOps ops_;
  PinTracker tracker_{PageSize(), &ops_};
  std::vector<std::thread> threads_;
};

// Issue 24: a 16 MiB step held in the kernel used to hold the tracker's lock,
// so another tenant's 4 KiB pin (and its unpin) of other pages waited for it.
// Now they go by while the big one is still in the kernel.
TEST_F(PinTrackerConcurrencyTest, ALongKernelLockDoesNotHoldUpAnotherPin) {
  ops_.Gate(P(0));
  absl::Notification big_done;
  Spawn([&] {
    EXPECT_TRUE(tracker_.Pin(P(0), kLockStep).ok());
    big_done.Notify();
  });
  ops_.AwaitHeld();
  absl::Notification small_done;
  Spawn([&] {
    const uint64_t small = P(2 * kLockStep / PageSize());
    EXPECT_TRUE(tracker_.Pin(small, PageSize()).ok());
    EXPECT_EQ(tracker_.RefCount(small), 1u);
    tracker_.Unpin(small, PageSize());
    small_done.Notify();
  });
  // The gate stays shut until the small pair is done (or a minute passed,
  // so that a tracker that still serializes fails instead of hanging).
  EXPECT_TRUE(small_done.WaitForNotificationWithTimeout(absl::Minutes(1)));
  EXPECT_FALSE(big_done.HasBeenNotified());
  // The page being locked is not counted yet.
  EXPECT_EQ(tracker_.PinnedBytes(), 0u);
  ops_.Open();
  big_done.WaitForNotification();
  EXPECT_EQ(tracker_.PinnedBytes(), kLockStep);
  tracker_.Unpin(P(0), kLockStep);
  EXPECT_EQ(tracker_.PinnedBytes(), 0u);
}

// A pin that needs pages another pin is locking waits for that lock, then
// takes its reference: the pages are locked once.
TEST_F(PinTrackerConcurrencyTest, APinOfPagesBeingLockedWaitsForThatLock) {
  ops_.Gate(P(0));
  Spawn([&] { EXPECT_TRUE(tracker_.Pin(P(0), 8 * PageSize()).ok()); });
  ops_.AwaitHeld();
  absl::Notification second_done;
  Spawn([&] {
    EXPECT_TRUE(tracker_.Pin(P(4), 8 * PageSize()).ok());
    second_done.Notify();
  });
  ops_.Open();
  second_done.WaitForNotification();
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
  // [0, 8) locked once, then [8, 12) by the second pin after it.
  EXPECT_THAT(ops_.Calls(),
              ElementsAre(absl::StrCat("lock ", P(0), "+", 8 * PageSize()),
                          absl::StrCat("lock ", P(8), "+", 4 * PageSize())));
  EXPECT_EQ(tracker_.RefCount(P(5)), 2u);
  EXPECT_EQ(tracker_.RefCount(P(0)), 1u);
  tracker_.Unpin(P(0), 8 * PageSize());
  tracker_.Unpin(P(4), 8 * PageSize());
  EXPECT_EQ(tracker_.PinnedBytes(), 0u);
}

// A pin of pages whose last unpin is still in the kernel waits for it and
// locks them again afterwards, never while they are being unlocked.
TEST_F(PinTrackerConcurrencyTest, APinOfPagesBeingUnlockedLocksThemAfterwards) {
  ASSERT_TRUE(tracker_.Pin(P(0), 4 * PageSize()).ok());
  ops_.Gate(P(0));
  Spawn([&] { tracker_.Unpin(P(0), 4 * PageSize()); });
  ops_.AwaitHeld();
  EXPECT_EQ(tracker_.PinnedBytes(), 0u);  // released, being unlocked
  absl::Notification pinned;
  Spawn([&] {
    EXPECT_TRUE(tracker_.Pin(P(2), PageSize()).ok());
    pinned.Notify();
  });
  ops_.Open();
  pinned.WaitForNotification();
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
  EXPECT_THAT(ops_.Calls(),
              ElementsAre(absl::StrCat("lock ", P(0), "+", 4 * PageSize()),
                          absl::StrCat("unlock ", P(0), "+", 4 * PageSize()),
                          absl::StrCat("lock ", P(2), "+", PageSize())));
  EXPECT_EQ(tracker_.RefCount(P(2)), 1u);
  tracker_.Unpin(P(2), PageSize());
}

}  // namespace
}  // namespace mrd::device
