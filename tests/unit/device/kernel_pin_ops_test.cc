// KernelPinOps against the real kernel: io_uring slots pin pages without
// splitting memory maps, sub-range unpins keep the rest pinned, slots never
// cross their span, rings are added as slots run out, read-only memory falls
// back to mlock, and mlock's map splits are refused past the budget.
#include "server/device/software/kernel_pin_ops.h"

#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/software/pin_tracker.h"
#include "tests/support/huge_pages.h"
#include "tests/support/kernel_pins.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::device {
namespace {

using ::mrd::device::testing::IsSeedError;
using ::mrd::device::testing::MemfdBuffer;
using ::mrd::device::testing::PageSize;
using ::mrd::test_support::KernelPinnedBytes;
using ::mrd::test_support::KernelPinnedBytesSettled;
using ::testing::Pair;

// Memory maps (VMAs) of this process overlapping [begin, end): what pinning
// a buffer may split. Counting only the buffer's own range keeps the
// allocator's and sanitizers' maps, which come and go, out of it.
uint64_t MapsIn(uint64_t begin, uint64_t end) {
  std::ifstream maps("/proc/self/maps");
  uint64_t count = 0;
  std::string line;
  while (std::getline(maps, line)) {
    const size_t dash = line.find('-');
    const size_t space = line.find(' ');
    if (dash == std::string::npos || space == std::string::npos) continue;
    const uint64_t start = std::stoull(line.substr(0, dash), nullptr, 16);
    const uint64_t stop =
        std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
    if (start < end && begin < stop) ++count;
  }
  return count;
}

std::unique_ptr<KernelPinOps> Make(KernelPinOptions options) {
  absl::StatusOr<std::unique_ptr<KernelPinOps>> ops =
      KernelPinOps::Create(options);
  EXPECT_TRUE(ops.ok()) << ops.status();
  return ops.ok() ? std::move(*ops) : nullptr;
}

class KernelPinOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    before_ = KernelPinnedBytesSettled(0);
    ops_ = Make(KernelPinOptions{});
    ASSERT_NE(ops_, nullptr);
    if (!ops_->io_uring_available()) {
      GTEST_SKIP() << "io_uring unavailable here: " << ops_->Describe();
    }
  }
  void TearDown() override {
    ops_.reset();
    EXPECT_EQ(KernelPinnedBytesSettled(before_), before_);
  }
  uint64_t Pinned() { return KernelPinnedBytes() - before_; }
  uint64_t PinnedSettled(uint64_t expected) {
    return KernelPinnedBytesSettled(before_ + expected) - before_;
  }
  // A buffer of `pages` pages, each locked on its own (a slot each); its
  // address, or 0.
  uint64_t LockedPages(uint64_t pages) {
    buffers_.push_back(MemfdBuffer::Create(pages));
    if (buffers_.back() == nullptr) return 0;
    const uint64_t base = reinterpret_cast<uint64_t>(buffers_.back()->data());
    for (uint64_t page = 0; page < pages; ++page) {
      if (ops_->Lock(base + page * PageSize(), PageSize()) != 0) return 0;
    }
    return base;
  }

  // The start of `pages` pages of a new buffer, aligned to `align` pages;
  // 0 if the buffer cannot be made.
  uint64_t AlignedPages(uint64_t pages, uint64_t align) {
    const uint64_t ps = PageSize();
    buffers_.push_back(MemfdBuffer::Create(pages + align));
    if (buffers_.back() == nullptr) return 0;
    const uint64_t base = reinterpret_cast<uint64_t>(buffers_.back()->data());
    return (base + align * ps - 1) & ~(align * ps - 1);
  }
  // Unlocks pages first, first + step, ... before `end` of the range at
  // `start`, one at a time; false at the first that fails.
  bool UnlockEach(uint64_t start, uint64_t first, uint64_t end, uint64_t step) {
    for (uint64_t page = first; page < end; page += step) {
      if (ops_->Unlock(start + page * PageSize(), PageSize()) != 0) {
        return false;
      }
    }
    return true;
  }

  uint64_t before_ = 0;
  std::unique_ptr<KernelPinOps> ops_;
  std::vector<std::unique_ptr<MemfdBuffer>> buffers_;
};

// The failure of issue 8: one pin per other page used to cost two VMAs.
TEST_F(KernelPinOpsTest, EveryOtherPageCostsNoMemoryMap) {
  const uint64_t ps = PageSize();
  constexpr uint64_t kPages = 4096;
  std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(kPages);
  ASSERT_NE(buffer, nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(buffer->data());
  const uint64_t end = base + kPages * ps;
  ASSERT_EQ(MapsIn(base, end), 1u);
  for (uint64_t page = 0; page < kPages; page += 2) {
    ASSERT_EQ(ops_->Lock(base + page * ps, ps), 0) << page;
  }
  EXPECT_EQ(MapsIn(base, end), 1u);  // never a VMA per pin
  EXPECT_EQ(Pinned(), kPages / 2 * ps);
  EXPECT_EQ(ops_->Slots(), kPages / 2);
  EXPECT_EQ(ops_->IoUringBytes(), kPages / 2 * ps);
  EXPECT_EQ(ops_->MlockedBytes(), 0u);
  for (uint64_t page = 0; page < kPages; page += 2) {
    ASSERT_EQ(ops_->Unlock(base + page * ps, ps), 0) << page;
  }
  EXPECT_EQ(ops_->Slots(), 0u);
  EXPECT_EQ(PinnedSettled(0), 0u);
}

// Unlocking parts of one Lock re-pins what stays into new slots: the kernel
// keeps exactly the pages still counted.
TEST_F(KernelPinOpsTest, UnlockingPartOfASlotKeepsTheRestPinned) {
  const uint64_t ps = PageSize();
  std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(8);
  ASSERT_NE(buffer, nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(buffer->data());
  ASSERT_EQ(ops_->Lock(base, 8 * ps), 0);
  EXPECT_EQ(Pinned(), 8 * ps);
  EXPECT_EQ(ops_->Slots(), 1u);
  ASSERT_EQ(ops_->Unlock(base + 2 * ps, 2 * ps), 0);  // [0,2) [4,8) stay
  EXPECT_EQ(ops_->Slots(), 2u);
  EXPECT_EQ(PinnedSettled(6 * ps), 6 * ps);
  ASSERT_EQ(ops_->Unlock(base + 6 * ps, ps), 0);  // [0,2) [4,6) [7,8)
  EXPECT_EQ(ops_->Slots(), 3u);
  EXPECT_EQ(PinnedSettled(5 * ps), 5 * ps);
  EXPECT_EQ(ops_->IoUringBytes(), 5 * ps);
  EXPECT_EQ(ops_->StaleBytes(), 0u);
  // One Unlock over pinned pieces and the holes between them.
  EXPECT_EQ(ops_->Unlock(base, 8 * ps), ENOENT);  // the holes are reported
  EXPECT_EQ(ops_->Slots(), 0u);
  EXPECT_EQ(PinnedSettled(0), 0u);
}

// A page that is pinned cannot be locked again: the tracker owns the counts.
// Huge pages (hugetlbfs) go through mlock, not a ring: io_uring's accounting
// of compound pages walks every slot of its ring for each huge page, which
// made 8 GiB of huge pages register at 5x the 4 KiB floor instead of 190x.
// The kernel keeps hugetlbfs pages in memory whatever happens (they are
// never swapped or reclaimed) and so counts no VmLck for them: nothing in
// the ring (VmPin) either.
TEST_F(KernelPinOpsTest, HugePagesAreMlockedNotRegisteredInARing) {
  constexpr uint64_t kHuge = uint64_t{2} << 20;
  test_support::HugePagePool pool(4);
  if (!pool.ok()) GTEST_SKIP() << "cannot raise vm.nr_hugepages (not root)";
  const int fd = memfd_create("huge", MFD_CLOEXEC | MFD_HUGETLB | MFD_HUGE_2MB);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4 * kHuge), 0);
  void* map =
      mmap(nullptr, 4 * kHuge, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(map, MAP_FAILED);
  const uint64_t base = reinterpret_cast<uint64_t>(map);
  ASSERT_EQ(ops_->LockHugePages(base, 4 * kHuge), 0);
  EXPECT_EQ(ops_->MlockedBytes(), 4 * kHuge);
  EXPECT_EQ(Pinned(), 0u);  // neither VmPin (no ring) nor VmLck (hugetlbfs)
  // A part goes, the rest stays locked.
  ASSERT_EQ(ops_->Unlock(base, kHuge), 0);
  EXPECT_EQ(ops_->MlockedBytes(), 3 * kHuge);
  ASSERT_EQ(ops_->Unlock(base + kHuge, 3 * kHuge), 0);
  EXPECT_EQ(PinnedSettled(0), 0u);
  munmap(map, 4 * kHuge);
  close(fd);
}

// A ClearBatch empties the slots its thread's Unlocks free when it ends:
// meanwhile the pages are no longer counted (they are stale) though the
// kernel still pins them, and a new Lock of them takes a new slot.
TEST_F(KernelPinOpsTest, ClearBatchEmptiesSlotsWhenItEnds) {
  const uint64_t ps = PageSize();
  constexpr uint64_t kPages = 8;
  const uint64_t base = LockedPages(kPages);
  ASSERT_NE(base, 0u);
  const uint64_t calls = ops_->ClearCalls();
  {
    KernelPinOps::ClearBatch batch(ops_.get());
    for (uint64_t page = 0; page < kPages; ++page) {
      ASSERT_EQ(ops_->Unlock(base + page * ps, ps), 0) << page;
    }
    EXPECT_EQ(ops_->Slots(), kPages);  // not emptied yet
    EXPECT_EQ(ops_->ClearCalls(), calls);
    EXPECT_EQ(ops_->Pieces(), 0u);
    EXPECT_EQ(ops_->IoUringBytes(), 0u);
    EXPECT_EQ(ops_->StaleBytes(), kPages * ps);
    EXPECT_EQ(Pinned(), kPages * ps);
    ASSERT_EQ(ops_->Lock(base, ps), 0);  // the same page, a new slot
    EXPECT_EQ(ops_->Slots(), kPages + 1);
    ASSERT_EQ(ops_->Unlock(base, ps), 0);
  }
  EXPECT_EQ(ops_->Slots(), 0u);
  // Nine adjacent slots (the eight and the new one after them): one call.
  EXPECT_EQ(ops_->ClearCalls(), calls + 1);
  EXPECT_EQ(ops_->StaleBytes(), 0u);
  EXPECT_EQ(PinnedSettled(0), 0u);
}

// A batch does not hold more than kClearBatchSlots slots back: it empties
// them as it goes.
TEST_F(KernelPinOpsTest, ClearBatchEmptiesAFullBatchAsItGoes) {
  const uint64_t ps = PageSize();
  constexpr uint64_t kPages = KernelPinOps::kClearBatchSlots + 10;
  const uint64_t base = LockedPages(kPages);
  ASSERT_NE(base, 0u);
  const uint64_t calls = ops_->ClearCalls();
  {
    KernelPinOps::ClearBatch batch(ops_.get());
    for (uint64_t page = kPages; page-- > 0;) {  // slots in reverse order
      ASSERT_EQ(ops_->Unlock(base + page * ps, ps), 0) << page;
    }
    EXPECT_EQ(ops_->Slots(), 10u);
  }
  EXPECT_EQ(ops_->Slots(), 0u);
  // Two runs of adjacent slots, each emptied with one call per
  // kMaxClearRun slots: 1,024 in 16 calls, then 10 in one.
  EXPECT_EQ(
      ops_->ClearCalls(),
      calls + KernelPinOps::kClearBatchSlots / KernelPinOps::kMaxClearRun + 1);
  EXPECT_EQ(PinnedSettled(0), 0u);
}

// Only the outermost batch of a thread defers anything; a batch of no
// object defers nothing.
TEST_F(KernelPinOpsTest, NestedAndNullClearBatchesDeferNothingMore) {
  const uint64_t ps = PageSize();
  const uint64_t base = LockedPages(2);
  ASSERT_NE(base, 0u);
  {
    KernelPinOps::ClearBatch none(nullptr);
    ASSERT_EQ(ops_->Unlock(base + ps, ps), 0);
    EXPECT_EQ(ops_->Slots(), 1u);  // emptied at once
  }
  {
    KernelPinOps::ClearBatch outer(ops_.get());
    {
      KernelPinOps::ClearBatch inner(ops_.get());
      ASSERT_EQ(ops_->Unlock(base, ps), 0);
    }
    EXPECT_EQ(ops_->Slots(), 1u);  // the outer batch still holds it
  }
  EXPECT_EQ(ops_->Slots(), 0u);
}

// LockInPieces pins a range in slots that never cross a multiple of the
// piece size (a batch's pages pinned ahead of its items): releasing one
// page outside a batch re-pins at most its slot's rest.
TEST_F(KernelPinOpsTest, LockInPiecesPinsInSlotsOfThePieceSize) {
  const uint64_t ps = PageSize();
  const uint64_t start = AlignedPages(64, 16);
  ASSERT_NE(start, 0u);
  // 12 pages: rounded up to a power of two, 16.
  ASSERT_EQ(ops_->LockInPieces(start, 64 * ps, 12 * ps), 0);
  EXPECT_EQ(ops_->Slots(), 4u);
  EXPECT_EQ(Pinned(), 64 * ps);
  ASSERT_EQ(ops_->Unlock(start + 20 * ps, ps), 0);  // slot 2: 4 + 11 stay
  EXPECT_EQ(ops_->Slots(), 5u);
  EXPECT_EQ(PinnedSettled(63 * ps), 63 * ps);
  EXPECT_EQ(ops_->StaleBytes(), 0u);
  ASSERT_EQ(ops_->Unlock(start, 20 * ps), 0);
  ASSERT_EQ(ops_->Unlock(start + 21 * ps, 43 * ps), 0);
  EXPECT_EQ(ops_->Slots(), 0u);
  EXPECT_EQ(PinnedSettled(0), 0u);
}

// Within a ClearBatch, releasing part of a slot re-pins nothing: the rest
// stays in the old slot, and when the batch ends it moves to new slots
// (one per piece still pinned) and the old slot is emptied. A batch that
// releases all of a slot a page at a time empties it with no re-pin.
TEST_F(KernelPinOpsTest, ClearBatchMovesWhatStaysOfASlotWhenItEnds) {
  const uint64_t ps = PageSize();
  const uint64_t start = AlignedPages(16, 16);
  ASSERT_NE(start, 0u);
  ASSERT_EQ(ops_->LockInPieces(start, 16 * ps, 16 * ps), 0);
  ASSERT_EQ(ops_->Slots(), 1u);
  {
    KernelPinOps::ClearBatch batch(ops_.get());
    ASSERT_TRUE(UnlockEach(start, 0, 16, 2));  // every other page
    EXPECT_EQ(ops_->Slots(), 1u);              // nothing re-pinned
    EXPECT_EQ(ops_->Pieces(), 8u);
    EXPECT_EQ(ops_->IoUringBytes(), 8 * ps);
    EXPECT_EQ(ops_->StaleBytes(), 8 * ps);
    EXPECT_EQ(Pinned(), 16 * ps);
  }
  // The eight pages left, each in a slot of its own; the old one emptied.
  EXPECT_EQ(ops_->Slots(), 8u);
  EXPECT_EQ(ops_->StaleBytes(), 0u);
  EXPECT_EQ(PinnedSettled(8 * ps), 8 * ps);
  ASSERT_TRUE(UnlockEach(start, 1, 16, 2));
  EXPECT_EQ(ops_->Slots(), 0u);

  ASSERT_EQ(ops_->LockInPieces(start, 16 * ps, 16 * ps), 0);
  const uint64_t calls = ops_->ClearCalls();
  {
    KernelPinOps::ClearBatch batch(ops_.get());
    ASSERT_TRUE(UnlockEach(start, 0, 16, 1));
    EXPECT_EQ(ops_->Slots(), 1u);
    EXPECT_EQ(ops_->Pieces(), 0u);
  }
  EXPECT_EQ(ops_->Slots(), 0u);
  EXPECT_EQ(ops_->ClearCalls(), calls + 1);  // the one slot, emptied once
  EXPECT_EQ(PinnedSettled(0), 0u);
}

TEST_F(KernelPinOpsTest, OverlappingLockIsRefused) {
  const uint64_t ps = PageSize();
  std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(4);
  ASSERT_NE(buffer, nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(buffer->data());
  ASSERT_EQ(ops_->Lock(base + ps, 2 * ps), 0);
  EXPECT_EQ(ops_->Lock(base, 2 * ps), EEXIST);
  EXPECT_EQ(ops_->Lock(base + 2 * ps, 2 * ps), EEXIST);
  EXPECT_EQ(Pinned(), 2 * ps);
  ASSERT_EQ(ops_->Unlock(base + ps, 2 * ps), 0);
}

TEST(KernelPinOptionsTest, SlotSpanIsAPowerOfTwoUpToOneGiB) {
  for (uint64_t span : {uint64_t{0}, uint64_t{3} << 20,
                        KernelPinOps::kMaxSlotSpan * 2, PageSize() / 2}) {
    KernelPinOptions options;
    options.slot_span = span;
    EXPECT_EQ(KernelPinOps::Create(options).status().code(),
              absl::StatusCode::kInvalidArgument)
        << span;
  }
  KernelPinOptions options;
  options.slot_span = KernelPinOps::kMaxSlotSpan;
  EXPECT_TRUE(KernelPinOps::Create(options).ok());
  options.slots_per_ring = KernelPinOps::kMaxSlotsPerRing + 1;
  EXPECT_FALSE(KernelPinOps::Create(options).ok());
  options.slots_per_ring = 8;
  options.parallel_rings = 0;
  absl::StatusOr<std::unique_ptr<KernelPinOps>> no_rings =
      KernelPinOps::Create(options);
  EXPECT_EQ(no_rings.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(no_rings.status().message(), "parallel rings"))
      << no_rings.status();
  EXPECT_FALSE(ParsePinMethod("mmap").ok());
  EXPECT_EQ(*ParsePinMethod("io_uring"), PinMethod::kIoUring);
}

// No slot crosses a multiple of the span (the kernel takes at most 1 GiB
// per slot; a smaller span bounds what a split re-pins).
TEST_F(KernelPinOpsTest, SlotsNeverCrossTheSpan) {
  const uint64_t ps = PageSize();
  KernelPinOptions options;
  options.slot_span = 16 * ps;
  ops_ = Make(options);
  ASSERT_NE(ops_, nullptr);
  std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(64);
  ASSERT_NE(buffer, nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(buffer->data());
  // From 3 pages past a span boundary, 40 pages: 13 + 16 + 11.
  const uint64_t aligned = (base + 16 * ps - 1) & ~(16 * ps - 1);
  const uint64_t start = aligned + 3 * ps;
  ASSERT_LE(start + 40 * ps, base + 64 * ps);
  ASSERT_EQ(ops_->Lock(start, 40 * ps), 0);
  EXPECT_EQ(ops_->Slots(), 3u);
  EXPECT_EQ(Pinned(), 40 * ps);
  // Dropping one page in the middle re-pins only its own slot's rest.
  ASSERT_EQ(ops_->Unlock(start + 20 * ps, ps), 0);
  EXPECT_EQ(ops_->Slots(), 4u);
  EXPECT_EQ(PinnedSettled(39 * ps), 39 * ps);
  ASSERT_EQ(ops_->Unlock(start, 20 * ps), 0);
  ASSERT_EQ(ops_->Unlock(start + 21 * ps, 19 * ps), 0);
  EXPECT_EQ(ops_->Slots(), 0u);
  EXPECT_EQ(PinnedSettled(0), 0u);
}

// Holds a KernelPinOps slot update before the kernel while shut: the one
// whose range starts at `at` (KernelPinOptions::before_update).
class UpdateGate {
 public:
  static void Hook(void* arg, uint64_t address, uint64_t, uint32_t) {
    auto* gate = static_cast<UpdateGate*>(arg);
    absl::MutexLock lock(&gate->mu_);
    if (address != gate->at_) return;
    gate->held_ = true;
    gate->mu_.Await(absl::Condition(&gate->open_));
  }
  void Shut(uint64_t at) {
    absl::MutexLock lock(&mu_);
    at_ = at;
    open_ = false;
    held_ = false;
  }
  void AwaitHeld() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&held_));
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }

 private:
  absl::Mutex mu_;
  uint64_t at_ ABSL_GUARDED_BY(mu_) = 0;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
};

// Issue 24: the system calls used to be made under the object's lock, on
// one ring, so a 4 KiB pin waited for another tenant's 16 MiB registration
// in the kernel. Now the small Lock and its Unlock go by on a ring that is
// not for bulk work while the big one is held.
TEST_F(KernelPinOpsTest, ABigLockInTheKernelDoesNotHoldUpASmallOne) {
  const uint64_t ps = PageSize();
  UpdateGate gate;
  KernelPinOptions options;
  options.before_update = &UpdateGate::Hook;
  options.before_update_arg = &gate;
  ops_ = Make(options);
  ASSERT_NE(ops_, nullptr);
  const uint64_t big_bytes = uint64_t{16} << 20;
  std::unique_ptr<MemfdBuffer> big = MemfdBuffer::Create(big_bytes / ps);
  std::unique_ptr<MemfdBuffer> small = MemfdBuffer::Create(1);
  ASSERT_NE(big, nullptr);
  ASSERT_NE(small, nullptr);
  const uint64_t big_at = reinterpret_cast<uint64_t>(big->data());
  const uint64_t small_at = reinterpret_cast<uint64_t>(small->data());
  gate.Shut(big_at);
  std::thread big_lock([&] { EXPECT_EQ(ops_->Lock(big_at, big_bytes), 0); });
  gate.AwaitHeld();
  int small_ring = -1;
  absl::Notification small_done;
  std::thread small_pair([&] {
    EXPECT_EQ(ops_->Lock(small_at, ps), 0);
    small_ring = ops_->RingOf(small_at);
    EXPECT_EQ(ops_->Unlock(small_at, ps), 0);
    small_done.Notify();
  });
  // Shut until the small pair is done, or a minute passed (so that a
  // KernelPinOps that still serializes fails instead of hanging).
  EXPECT_TRUE(small_done.WaitForNotificationWithTimeout(absl::Minutes(1)));
  const int big_ring = ops_->RingOf(big_at);
  gate.Open();
  big_lock.join();
  small_pair.join();
  EXPECT_NE(small_ring, big_ring);
  EXPECT_FALSE(ops_->BulkRing(static_cast<size_t>(small_ring)));
  EXPECT_TRUE(ops_->BulkRing(static_cast<size_t>(big_ring)));
  EXPECT_EQ(ops_->RingOf(big_at), big_ring);
  EXPECT_EQ(PinnedSettled(big_bytes), big_bytes);
  EXPECT_EQ(ops_->Unlock(big_at, big_bytes), 0);
  EXPECT_EQ(ops_->Slots(), 0u);
}

// Two small Locks at once: the second takes a slot of a new ring, so that it
// never waits for the first's ring in the kernel; with parallel_rings = 1 it
// shares the busy ring.
TEST_F(KernelPinOpsTest, ConcurrentLocksTakeRingsNoOtherCallUses) {
  const uint64_t ps = PageSize();
  for (uint32_t parallel : {4u, 1u}) {
    SCOPED_TRACE(parallel);
    UpdateGate gate;
    KernelPinOptions options;
    options.before_update = &UpdateGate::Hook;
    options.before_update_arg = &gate;
    options.parallel_rings = parallel;
    ops_ = Make(options);
    ASSERT_NE(ops_, nullptr);
    std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(2);
    ASSERT_NE(buffer, nullptr);
    const uint64_t first = reinterpret_cast<uint64_t>(buffer->data());
    gate.Shut(first);
    std::thread held([&] { EXPECT_EQ(ops_->Lock(first, ps), 0); });
    gate.AwaitHeld();
    // The held Lock's ring counts as busy from its reservation on.
    ASSERT_EQ(ops_->Lock(first + ps, ps), 0);
    EXPECT_EQ(ops_->Rings(), parallel > 1 ? 2u : 1u);
    EXPECT_EQ(ops_->RingOf(first + ps), parallel > 1 ? 1 : 0);
    gate.Open();
    held.join();
    EXPECT_EQ(ops_->RingOf(first), 0);
    EXPECT_EQ(ops_->Unlock(first, 2 * ps), 0);
    EXPECT_EQ(ops_->Slots(), 0u);
  }
}

// Emptying a long range's slots goes at most kMaxClearRunBytes per system
// call: the kernel unpins a call's pages in one go, and a kernel without
// preemption runs nothing else on that CPU meanwhile. (One call used to
// unpin a 256 MiB registration's 16 slots at once.)
TEST_F(KernelPinOpsTest, SlotsAreEmptiedAFewMiBPerCall) {
  const uint64_t ps = PageSize();
  KernelPinOptions options;
  options.slot_span = uint64_t{2} << 20;
  ops_ = Make(options);
  ASSERT_NE(ops_, nullptr);
  const uint64_t bytes = uint64_t{8} << 20;
  std::unique_ptr<MemfdBuffer> buffer =
      MemfdBuffer::Create(bytes / ps + options.slot_span / ps);
  ASSERT_NE(buffer, nullptr);
  // Slot-span aligned, so that the range is exactly 4 slots.
  const uint64_t at =
      (reinterpret_cast<uint64_t>(buffer->data()) + options.slot_span - 1) &
      ~(options.slot_span - 1);
  ASSERT_EQ(ops_->Lock(at, bytes), 0);
  ASSERT_EQ(ops_->Slots(), 4u);
  const uint64_t calls = ops_->ClearCalls();
  ASSERT_EQ(ops_->Unlock(at, bytes), 0);
  EXPECT_EQ(ops_->Slots(), 0u);
  EXPECT_EQ(ops_->ClearCalls() - calls,
            bytes / KernelPinOps::kMaxClearRunBytes);
  EXPECT_EQ(PinnedSettled(0), 0u);
}

// More rings are created as slots run out.
TEST_F(KernelPinOpsTest, RingsAreAddedAsSlotsRunOut) {
  const uint64_t ps = PageSize();
  KernelPinOptions options;
  options.slots_per_ring = 8;
  ops_ = Make(options);
  ASSERT_NE(ops_, nullptr);
  std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(40);
  ASSERT_NE(buffer, nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(buffer->data());
  for (uint64_t page = 0; page < 40; page += 2) {
    ASSERT_EQ(ops_->Lock(base + page * ps, ps), 0) << page;
  }
  EXPECT_EQ(ops_->Rings(), 3u);
  EXPECT_EQ(ops_->Slots(), 20u);
  EXPECT_EQ(Pinned(), 20 * ps);
  for (uint64_t page = 0; page < 40; page += 2) {
    ASSERT_EQ(ops_->Unlock(base + page * ps, ps), 0) << page;
  }
  EXPECT_EQ(PinnedSettled(0), 0u);
}

// When the rest of a slot cannot be re-pinned (here: no fd for another
// ring), the old slot stays: nothing still counted is ever unpinned, and
// the released pages go when the rest does.
TEST_F(KernelPinOpsTest, FailedSplitKeepsTheOldSlot) {
  const uint64_t ps = PageSize();
  KernelPinOptions options;
  options.slots_per_ring = 1;
  ops_ = Make(options);
  ASSERT_NE(ops_, nullptr);
  std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(4);
  ASSERT_NE(buffer, nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(buffer->data());
  ASSERT_EQ(ops_->Lock(base, 4 * ps), 0);
  struct rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  const int lowest_free = dup(0);
  ASSERT_GE(lowest_free, 0);
  close(lowest_free);
  struct rlimit tight = saved;
  tight.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &tight), 0);
  const int err = ops_->Unlock(base + ps, ps);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_EQ(err, 0);
  EXPECT_EQ(ops_->StaleBytes(), ps);
  EXPECT_EQ(ops_->IoUringBytes(), 3 * ps);
  EXPECT_EQ(Pinned(), 4 * ps);  // page 1 stays pinned with its slot
  ASSERT_EQ(ops_->Unlock(base, ps), 0);
  ASSERT_EQ(ops_->Unlock(base + 2 * ps, 2 * ps), 0);
  EXPECT_EQ(ops_->StaleBytes(), 0u);
  EXPECT_EQ(ops_->Slots(), 0u);
  EXPECT_EQ(PinnedSettled(0), 0u);
}

// io_uring pins for writing: a read-only mapping falls back to mlock (auto)
// or is refused (io_uring only).
TEST_F(KernelPinOpsTest, ReadOnlyMemoryFallsBackToMlock) {
  const uint64_t ps = PageSize();
  std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(4);
  ASSERT_NE(buffer, nullptr);
  void* map = mmap(nullptr, 4 * ps, PROT_READ, MAP_SHARED, buffer->fd(), 0);
  ASSERT_NE(map, MAP_FAILED);
  const uint64_t base = reinterpret_cast<uint64_t>(map);
  ASSERT_EQ(ops_->Lock(base + ps, 2 * ps), 0);
  EXPECT_EQ(ops_->MlockedBytes(), 2 * ps);
  EXPECT_EQ(ops_->IoUringBytes(), 0u);
  EXPECT_EQ(ops_->MapSplits(), 2u);
  EXPECT_EQ(Pinned(), 2 * ps);
  ASSERT_EQ(ops_->Unlock(base + ps, ps), 0);
  EXPECT_EQ(Pinned(), ps);
  ASSERT_EQ(ops_->Unlock(base + 2 * ps, ps), 0);
  EXPECT_EQ(ops_->MapSplits(), 0u);

  KernelPinOptions options;
  options.method = PinMethod::kIoUring;
  std::unique_ptr<KernelPinOps> strict = Make(options);
  ASSERT_NE(strict, nullptr);
  EXPECT_EQ(strict->Lock(base, ps), EFAULT);
  EXPECT_EQ(PinnedSettled(0), 0u);
  munmap(map, 4 * ps);
}

// With mlock, each maximal locked run may split a map twice; past the
// budget Lock refuses, and the tracker turns that into LIMIT_MEMORY_MAPS.
TEST(KernelPinMlockTest, MapSplitsPastTheBudgetAreRefused) {
  const uint64_t ps = PageSize();
  const uint64_t before = KernelPinnedBytesSettled(0);
  KernelPinOptions options;
  options.method = PinMethod::kMlock;
  options.max_map_splits = 10;
  std::unique_ptr<KernelPinOps> ops = Make(options);
  ASSERT_NE(ops, nullptr);
  EXPECT_FALSE(ops->io_uring_available());
  std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(32);
  ASSERT_NE(buffer, nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(buffer->data());
  {
    PinTracker tracker(ps, ops.get());
    // One round first, so that lazily made allocations do not count.
    ASSERT_TRUE(tracker.Pin(base, ps).ok());
    tracker.Unpin(base, ps);
    const uint64_t end = base + 32 * ps;
    const uint64_t maps = MapsIn(base, end);
    for (uint64_t page = 1; page < 10; page += 2) {  // 5 runs: 10 splits
      ASSERT_TRUE(tracker.Pin(base + page * ps, ps).ok()) << page;
    }
    EXPECT_EQ(ops->MapSplits(), 10u);
    EXPECT_LE(MapsIn(base, end), maps + ops->MapSplits());
    EXPECT_THAT(
        tracker.Pin(base + 11 * ps, ps),
        IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_MEMORY_MAPS"));
    EXPECT_EQ(ops->Lock(base + 11 * ps, ps), kErrMapBudget);
    // Joining two runs costs no new split, so it is allowed.
    ASSERT_TRUE(tracker.Pin(base + 2 * ps, ps).ok());
    EXPECT_EQ(ops->MapSplits(), 8u);
    EXPECT_EQ(KernelPinnedBytes() - before, 6 * ps);
    EXPECT_EQ(tracker.PinnedBytes(), 6 * ps);
    ASSERT_TRUE(tracker.Pin(base + 11 * ps, ps).ok());
    tracker.Unpin(base + 11 * ps, ps);
    tracker.Unpin(base + 2 * ps, ps);
    for (uint64_t page = 1; page < 10; page += 2) {
      tracker.Unpin(base + page * ps, ps);
    }
    EXPECT_EQ(MapsIn(base, end), maps);  // the kernel merged the maps again
  }
  EXPECT_EQ(ops->MapSplits(), 0u);
  EXPECT_EQ(KernelPinnedBytes(), before);
}

// A piece holds at most kMaxPiecePages pages (16 TiB of 4 KiB pages), so a
// longer mlocked run is held as several adjoining pieces; here pieces of 3
// pages stand in for that. The run is still one run: adjoining pieces are
// coalesced and re-cut, an Unlock across pieces reports no hole, and the
// map splits count runs, never pieces.
TEST(KernelPinMlockTest, LongRunsAreHeldAsSeveralPieces) {
  const uint64_t ps = PageSize();
  const uint64_t before = KernelPinnedBytesSettled(0);
  std::unique_ptr<KernelPinOps> ops = Make({.method = PinMethod::kMlock,
                                            .max_map_splits = 100,
                                            .max_piece_pages = 3});
  ASSERT_NE(ops, nullptr);
  std::unique_ptr<MemfdBuffer> buffer = MemfdBuffer::Create(16);
  ASSERT_NE(buffer, nullptr);
  const uint64_t base = reinterpret_cast<uint64_t>(buffer->data());
  auto page = [&](uint64_t n) { return base + n * ps; };
  auto pieces_and_splits = [&] {
    return std::make_pair(ops->Pieces(), ops->MapSplits());
  };

  ASSERT_EQ(ops->Lock(page(0), 10 * ps), 0);  // [0,3) [3,6) [6,9) [9,10)
  EXPECT_THAT(pieces_and_splits(), Pair(4, 2));
  EXPECT_EQ(ops->MlockedBytes(), 10 * ps);
  EXPECT_EQ(KernelPinnedBytes() - before, 10 * ps);
  ASSERT_EQ(ops->Lock(page(10), 2 * ps), 0);  // [9,10) grows to [9,12)
  EXPECT_THAT(pieces_and_splits(), Pair(4, 2));
  ASSERT_EQ(ops->Lock(page(13), ps), 0);  // a second run
  EXPECT_THAT(pieces_and_splits(), Pair(5, 4));
  ASSERT_EQ(ops->Lock(page(12), ps), 0);  // joins them: [9,12) [12,14)
  EXPECT_THAT(pieces_and_splits(), Pair(5, 2));
  EXPECT_EQ(ops->Lock(page(8), 2 * ps), EEXIST);

  // A hole inside a piece: [0,3) [3,4) | [5,6) [6,9) [9,12) [12,14).
  ASSERT_EQ(ops->Unlock(page(4), ps), 0);
  EXPECT_THAT(pieces_and_splits(), Pair(6, 4));
  // A whole piece inside a run still cuts the run in two.
  ASSERT_EQ(ops->Unlock(page(6), 3 * ps), 0);
  EXPECT_THAT(pieces_and_splits(), Pair(5, 6));
  EXPECT_EQ(ops->MlockedBytes(), 10 * ps);
  EXPECT_EQ(KernelPinnedBytes() - before, 10 * ps);
  // One Unlock across two pieces of one run: no hole, one run less.
  ASSERT_EQ(ops->Unlock(page(0), 4 * ps), 0);
  EXPECT_THAT(pieces_and_splits(), Pair(3, 4));
  // The end of a run, across its pieces: [5,6) [9,11) stay.
  ASSERT_EQ(ops->Unlock(page(11), 3 * ps), 0);
  EXPECT_THAT(pieces_and_splits(), Pair(2, 4));
  EXPECT_EQ(ops->MlockedBytes(), 3 * ps);
  // Across the hole [6,9): reported, and the rest is unlocked anyway.
  EXPECT_EQ(ops->Unlock(page(5), 6 * ps), ENOENT);
  EXPECT_THAT(pieces_and_splits(), Pair(0, 0));
  EXPECT_EQ(ops->MlockedBytes(), 0u);
  EXPECT_EQ(KernelPinnedBytesSettled(before), before);

  // What is left locked, in several pieces, is unlocked on destruction.
  ASSERT_EQ(ops->Lock(page(1), 7 * ps), 0);
  EXPECT_EQ(ops->Pieces(), 3u);
  EXPECT_EQ(KernelPinnedBytes() - before, 7 * ps);
  ops.reset();
  EXPECT_EQ(KernelPinnedBytesSettled(before), before);
}

}  // namespace
}  // namespace mrd::device
