// L7 proved by failure injection: every step of every software-device
// operation where a real device can fail (fault_points.h, the list in
// SoftwareDeviceOptions::fault_points) is failed in turn, on fresh memfd
// memory, and afterwards
//   * the operation returned exactly the injected status, and stopped there;
//   * nothing is pinned that was not before: the device's PinnedBytes and the
//     kernel's pins (VmLck + VmPin, /proc/self/status) are unchanged, even when
//     the failure came after some runs of pages had been mlocked (partial
//     pins);
//   * nothing is held that was not before: PDs, MRs, LAMs, key-table slots,
//     logical address ranges, tickets, LAM references of fast registrations;
//   * the device still works: the same operation on the same memory then
//     succeeds, and what it made works for a real peer (SoftPeer).
// Each sweep prints its steps ("[ STEPS    ]") and checks them by name, so a
// step added to or removed from an operation shows up here.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/peer/soft_peer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "server/device/fault_points.h"
#include "server/device/software/pin_tracker.h"
#include "server/device/software/software_device.h"
#include "tests/support/kernel_pins.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::device {

using ::mrd::test_support::KernelPinnedBytes;
using ::mrd::test_support::KernelPinnedBytesSettled;
namespace {

using ::mrd::device::testing::IsMrdError;
using ::mrd::device::testing::MemfdBuffer;
using ::mrd::device::testing::PageSize;
using ::mrd::device::testing::RecordingSink;
using ::mrd::peer::SoftPeer;
using ::testing::ElementsAre;

constexpr uint32_t kRemoteRw =
    kAccessLocalWrite | kAccessRemoteRead | kAccessRemoteWrite;
constexpr uint64_t kBase = uint64_t{0x6000} << 32;  // page-aligned, non-zero

// What every injected failure returns: an outcome a real device gives, and
// the operation and step number, so that it cannot be mistaken for another
// failure.
absl::Status Injected(absl::string_view op, size_t k) {
  return SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "INJECTED_FAULT",
                   absl::StrCat(op, ": injected failure at step ", k));
}

// ---------------------------------------------------------------------------
// FaultPoints itself.

TEST(FaultPointsTest, RecordsStepsAndFailsOnlyTheArmedOneOnce) {
  FaultPoints faults;
  EXPECT_TRUE(faults.Hit("a").ok());
  EXPECT_TRUE(faults.Hit("b").ok());
  EXPECT_THAT(faults.Steps(), ElementsAre("a", "b"));
  EXPECT_FALSE(faults.Fired());

  const absl::Status injected = absl::UnavailableError("second step");
  faults.Arm(2, injected);
  EXPECT_TRUE(faults.Steps().empty());  // a new recording
  EXPECT_TRUE(faults.Hit("a").ok());
  EXPECT_FALSE(faults.Fired());
  EXPECT_EQ(faults.Hit("b"), injected);
  EXPECT_TRUE(faults.Fired());
  EXPECT_EQ(faults.FiredStep(), "b");
  EXPECT_TRUE(faults.Hit("c").ok());  // fired once, then disarmed
  EXPECT_THAT(faults.Steps(), ElementsAre("a", "b", "c"));
  EXPECT_EQ(faults.StepCount(), 3u);

  faults.Arm(1, injected);
  faults.Reset();  // disarms
  EXPECT_TRUE(faults.Hit("a").ok());
  EXPECT_FALSE(faults.Fired());
  EXPECT_EQ(faults.FiredStep(), "");
}

TEST(FaultPointsTest, NullFaultPointsAlwaysSucceed) {
  EXPECT_TRUE(FaultPoint(nullptr, "pin.mlock").ok());
}

TEST(FaultPointsTest, KeepsABoundedRecordButCountsEveryStep) {
  FaultPoints faults;
  const uint64_t hits = FaultPoints::kMaxRecordedSteps + 10;
  for (uint64_t i = 0; i < hits; ++i) ASSERT_TRUE(faults.Hit("x").ok());
  EXPECT_EQ(faults.Steps().size(), FaultPoints::kMaxRecordedSteps);
  EXPECT_EQ(faults.StepCount(), hits);
  // The count keeps going past the record, and so does arming.
  faults.Arm(static_cast<int>(hits), absl::InternalError("late"));
  for (uint64_t i = 1; i < hits; ++i) ASSERT_TRUE(faults.Hit("x").ok());
  EXPECT_FALSE(faults.Hit("last").ok());
  EXPECT_EQ(faults.FiredStep(), "last");
}

TEST(FaultPointsTest, ConcurrentHitsFireExactlyOnce) {
  FaultPoints faults;
  faults.Arm(500, absl::InternalError("one of many"));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 250; ++i) {
        if (!faults.Hit("step").ok()) failures.fetch_add(1);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 1);
  EXPECT_EQ(faults.StepCount(), 1000u);
}

// ---------------------------------------------------------------------------
// The software device under failure at every step.

// The system's pins (SystemPinOps), noting the most memory the kernel had
// pinned right after any successful Lock: how far a pin got before
// it failed.
class ObservingPinOps final : public PinOps {
 public:
  int Lock(uint64_t address, uint64_t length) override {
    int err = SystemPinOps()->Lock(address, length);
    if (err == 0) {
      uint64_t now = KernelPinnedBytes();
      absl::MutexLock lock(&mu_);
      peak_ = std::max(peak_, now);
    }
    return err;
  }
  int Unlock(uint64_t address, uint64_t length) override {
    return SystemPinOps()->Unlock(address, length);
  }
  void ResetPeak() {
    absl::MutexLock lock(&mu_);
    peak_ = 0;
  }
  uint64_t peak() const {
    absl::MutexLock lock(&mu_);
    return peak_;
  }

 private:
  mutable absl::Mutex mu_;
  uint64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
};

// What the device and the kernel hold at one moment.
struct Snapshot {
  uint64_t pinned = 0;
  uint64_t kernel_pinned = 0;
  SoftwareDevice::ResourceCounts counts;
};

std::string Describe(const Snapshot& s) {
  const SoftwareDevice::ResourceCounts& c = s.counts;
  return absl::StrCat(
      "pinned=", s.pinned, " kernel_pinned=", s.kernel_pinned, " pds=", c.pds,
      " mrs=", c.mrs, " valid_mrs=", c.valid_mrs, " lams=", c.lams,
      " keys=", c.keys, " iova_ranges=", c.iova_ranges, " tickets=", c.tickets,
      " lam_fast_register_refs=", c.lam_fast_register_refs,
      " pd_objects=", c.pd_objects);
}

// One run of an operation on fresh memory. The constructor prepares (outside
// the armed window), the destructor undoes the preparation.
class Trial {
 public:
  virtual ~Trial() = default;
  // The operation: OK, or how it failed.
  virtual absl::Status Run() = 0;
  // Right after a failed Run: checks of its own (beyond the snapshot).
  virtual void CheckFailed() {}
  // After a successful Run: what it made works for a peer; then releases it
  // (back to the state right after the constructor).
  virtual void UseAndRelease() = 0;
};

class DeviceFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    kernel_pinned_before_ = KernelPinnedBytesSettled(0);
    SoftwareDeviceOptions options;
    options.fault_points = &faults_;
    options.pin_ops = &pin_ops_;
    absl::StatusOr<std::unique_ptr<SoftwareDevice>> device =
        SoftwareDevice::Create(options);
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = std::move(*device);
    ASSERT_TRUE(device_->Start().ok());
    absl::StatusOr<PdId> pd = device_->AllocatePd(&sink_);
    ASSERT_TRUE(pd.ok()) << pd.status();
    pd_ = *pd;
    // Both tickets exist before any snapshot: a ticket lives as long as its
    // PD, so one made during a sweep would read as held.
    absl::StatusOr<std::string> ticket = device_->CreatePeerTicket(pd_);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    absl::StatusOr<std::unique_ptr<SoftPeer>> peer =
        SoftPeer::Connect(device_->Attributes().peer_address, *ticket);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = std::move(*peer);
    ASSERT_TRUE(sink_.WaitFor(RecordingSink::Event::Kind::kConnected, 1));
    absl::StatusOr<std::string> probe = device_->CreatePeerTicket(pd_);
    ASSERT_TRUE(probe.ok()) << probe.status();
    probe_ticket_ = *probe;
    faults_.Reset();
  }

  void TearDown() override {
    peer_.reset();
    if (device_ != nullptr) {
      EXPECT_TRUE(device_->DeallocatePd(pd_).ok());
      EXPECT_EQ(device_->PinnedBytes(), 0u);
      EXPECT_EQ(device_->CountResources().keys, 0u);
      EXPECT_EQ(device_->CountResources().iova_ranges, 0u);
    }
    device_.reset();
    EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_),
              kernel_pinned_before_);
  }

  // Public: the trials, local classes of the tests, use these.
 public:
  Snapshot Take() const {
    Snapshot s;
    s.pinned = device_->PinnedBytes();
    // The kernel holds the baseline and what the device counts (older
    // kernels release io_uring pins a moment later).
    s.kernel_pinned =
        KernelPinnedBytesSettled(kernel_pinned_before_ + s.pinned);
    s.counts = device_->CountResources();
    return s;
  }

  // A buffer owned by the fixture (it outlives the device's use of it).
  MemfdBuffer& NewBuffer(uint64_t pages) {
    buffers_.push_back(MemfdBuffer::Create(pages, ++seed_));
    EXPECT_NE(buffers_.back(), nullptr);
    return *buffers_.back();
  }

  // Posts a fast registration of `pages` on the peer's connection and waits
  // for its completion: the new rkey, or why the post or the work failed.
  absl::StatusOr<uint32_t> FastRegister(MrId mr, std::vector<uint64_t> pages,
                                        uint32_t fbo, uint64_t length) {
    const size_t before = sink_.Completions().size();
    FastRegisterWork work;
    work.mr = mr;
    work.pages = std::move(pages);
    work.fbo = fbo;
    work.length = length;
    work.base_address = kBase + fbo;
    work.access = kRemoteRw;
    work.request_context = 7000 + before;
    MRD_RETURN_IF_ERROR(
        device_->PostFastRegister(peer_->connection_id(), work).status());
    if (!sink_.WaitForCompletions(before + 1)) {
      return absl::DeadlineExceededError("no fast-register completion");
    }
    WorkCompletion completion = sink_.Completions()[before];
    EXPECT_EQ(completion.request_context, work.request_context);
    EXPECT_EQ(completion.kind, WorkCompletion::Kind::kFastRegister);
    MRD_RETURN_IF_ERROR(completion.status);
    return completion.rkey;
  }

  // Invalidates a fast-registered MR and waits for the completion.
  void Invalidate(MrId mr) {
    const size_t before = sink_.Completions().size();
    InvalidateWork work;
    work.mr = mr;
    work.request_context = 8000 + before;
    absl::StatusOr<uint64_t> posted =
        device_->PostInvalidate(peer_->connection_id(), work);
    ASSERT_TRUE(posted.ok()) << posted.status();
    ASSERT_TRUE(sink_.WaitForCompletions(before + 1));
    WorkCompletion completion = sink_.Completions()[before];
    EXPECT_EQ(completion.kind, WorkCompletion::Kind::kInvalidate);
    EXPECT_TRUE(completion.status.ok()) << completion.status;
  }

  // A peer reads [base, base + length) with `rkey` and gets `expected`.
  void ExpectPeerReads(SoftPeer& peer, uint32_t rkey, uint64_t base,
                       const std::string& expected) {
    absl::StatusOr<std::string> read = peer.Read(rkey, base, expected.size());
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_TRUE(*read == expected) << "peer read other bytes than the memfd's";
  }

  // A peer on a connection of its own (an access error closes it) finds no
  // region behind `rkey` at `base`.
  void ExpectNoPeerAccess(uint32_t rkey, uint64_t base) {
    absl::StatusOr<std::unique_ptr<SoftPeer>> probe =
        SoftPeer::Connect(device_->Attributes().peer_address, probe_ticket_);
    ASSERT_TRUE(probe.ok()) << probe.status();
    EXPECT_THAT(
        (*probe)->Read(rkey, base, 8).status(),
        IsMrdError(absl::StatusCode::kPermissionDenied, "REMOTE_ACCESS_ERROR"));
  }

  // The sweep. One clean run learns the operation's steps; then, for each
  // step k, a fresh trial fails at step k and is checked (see the top of
  // the file), and the same trial then succeeds. Returns the steps.
  std::vector<std::string> Sweep(
      absl::string_view op, const std::function<std::unique_ptr<Trial>()>& make,
      const std::function<void(const std::vector<std::string>& steps, size_t k,
                               const Snapshot& before)>& after_fault =
          nullptr) {
    const Snapshot start = Take();
    std::vector<std::string> steps;
    {
      std::unique_ptr<Trial> trial = make();
      const Snapshot before = Take();
      faults_.Reset();
      absl::Status status = trial->Run();
      steps = faults_.Steps();
      EXPECT_TRUE(status.ok()) << op << " without faults: " << status;
      if (!status.ok()) return steps;
      trial->UseAndRelease();
      EXPECT_EQ(Describe(Take()), Describe(before));
    }
    EXPECT_EQ(Describe(Take()), Describe(start));
    EXPECT_FALSE(steps.empty()) << op << " reached no fault point";

    for (size_t k = 1; k <= steps.size(); ++k) {
      SCOPED_TRACE(
          absl::StrCat(op, " failing at step ", k, " (", steps[k - 1], ")"));
      std::unique_ptr<Trial> trial = make();
      const Snapshot before = Take();
      const absl::Status injected = Injected(op, k);
      pin_ops_.ResetPeak();
      faults_.Arm(static_cast<int>(k), injected);
      absl::Status status = trial->Run();
      // The failure surfaces as it was injected, where it was injected, and
      // the operation went no further.
      EXPECT_EQ(status, injected);
      EXPECT_TRUE(faults_.Fired());
      EXPECT_EQ(faults_.FiredStep(), steps[k - 1]);
      EXPECT_THAT(faults_.Steps(), ::testing::ElementsAreArray(
                                       steps.begin(), steps.begin() + k));
      // L7: nothing pinned, mapped or held.
      EXPECT_EQ(Describe(Take()), Describe(before));
      trial->CheckFailed();
      if (after_fault) after_fault(steps, k, before);
      // And the device still works: the same request succeeds now.
      faults_.Reset();
      absl::Status retry = trial->Run();
      EXPECT_TRUE(retry.ok()) << "retry: " << retry;
      if (retry.ok()) trial->UseAndRelease();
      EXPECT_EQ(Describe(Take()), Describe(before));
    }
    EXPECT_EQ(Describe(Take()), Describe(start));
    std::cout << "[ STEPS    ] " << op << " (" << steps.size()
              << "): " << absl::StrJoin(steps, ", ") << std::endl;
    return steps;
  }

  // Declared before device_: they outlive it.
  FaultPoints faults_;
  ObservingPinOps pin_ops_;
  RecordingSink sink_;
  std::vector<std::unique_ptr<MemfdBuffer>> buffers_;
  std::unique_ptr<SoftwareDevice> device_;
  PdId pd_ = 0;
  std::unique_ptr<SoftPeer> peer_;
  std::string probe_ticket_;
  uint64_t kernel_pinned_before_ = 0;
  uint8_t seed_ = 0;
};

// An 8-page memfd whose pages 2 and 5 are already pinned by registrations of
// their own, so that pinning all 8 pages takes three mlock calls
// ([0,2), [3,5), [6,8)) and a failure at the second or third leaves runs
// locked that the pin must undo. The span starts and ends inside a page.
class PartlyPinnedMemory {
 public:
  static constexpr uint64_t kPages = 8;
  static constexpr uint64_t kOffset = 100;
  static constexpr uint64_t kRunPages = 2;  // each of the three runs

  PartlyPinnedMemory(SoftwareDevice& device, PdId pd, MemfdBuffer& buffer)
      : device_(device), buffer_(buffer) {
    const uint64_t ps = PageSize();
    for (uint64_t page : {2, 5}) {
      absl::StatusOr<MrKeys> keys = device_.RegisterMr(
          pd, buffer_.Span(page * ps, ps), kBase, kAccessRemoteRead);
      EXPECT_TRUE(keys.ok()) << keys.status();
      if (keys.ok()) pre_pins_.push_back(keys->mr);
    }
  }
  ~PartlyPinnedMemory() {
    for (MrId mr : pre_pins_) EXPECT_TRUE(device_.DeregisterMr(mr).ok());
  }

  uint64_t length() const { return kPages * PageSize() - 2 * kOffset; }
  MemorySpan span() const { return buffer_.Span(kOffset, length()); }
  std::string bytes() const { return buffer_.Bytes(kOffset, length()); }

 private:
  SoftwareDevice& device_;
  MemfdBuffer& buffer_;
  std::vector<MrId> pre_pins_;
};

// After a failure at the k-th mlock, the pin had really locked k runs in
// the kernel before it failed: the undo had something to undo.
void ExpectPartialPinWasUndone(const std::vector<std::string>& steps, size_t k,
                               const Snapshot& before, uint64_t peak) {
  if (steps[k - 1] != "pin.mlock") return;
  const uint64_t runs = static_cast<uint64_t>(
      std::count(steps.begin(), steps.begin() + k, "pin.mlock"));
  EXPECT_EQ(peak - before.kernel_pinned,
            runs * PartlyPinnedMemory::kRunPages * PageSize())
      << "mlock calls before the failure did not lock what they should";
}

TEST_F(DeviceFaultTest, RegisterMrFailingAtAnyStepLeavesNothing) {
  class RegisterTrial final : public Trial {
   public:
    explicit RegisterTrial(DeviceFaultTest& t)
        : t_(t),
          memory_(*t.device_, t.pd_, t.NewBuffer(PartlyPinnedMemory::kPages)) {}
    absl::Status Run() override {
      absl::StatusOr<MrKeys> keys =
          t_.device_->RegisterMr(t_.pd_, memory_.span(), kBase, kRemoteRw);
      if (keys.ok()) keys_ = *keys;
      return keys.status();
    }
    void UseAndRelease() override {
      t_.ExpectPeerReads(*t_.peer_, keys_.rkey, kBase, memory_.bytes());
      EXPECT_TRUE(t_.device_->DeregisterMr(keys_.mr).ok());
    }

   private:
    DeviceFaultTest& t_;
    PartlyPinnedMemory memory_;
    MrKeys keys_;
  };
  std::vector<std::string> steps = Sweep(
      "RegisterMr", [&] { return std::make_unique<RegisterTrial>(*this); },
      [&](const std::vector<std::string>& swept, size_t k,
          const Snapshot& before) {
        ExpectPartialPinWasUndone(swept, k, before, pin_ops_.peak());
      });
  EXPECT_THAT(
      steps, ElementsAre("pin.mlock", "pin.mlock", "pin.mlock", "keys.allocate",
                         "random.key_slot", "random.key_byte", "mr.insert"));
}

TEST_F(DeviceFaultTest, BuildLamFailingAtAnyStepLeavesNothing) {
  class LamTrial final : public Trial {
   public:
    explicit LamTrial(DeviceFaultTest& t)
        : t_(t),
          memory_(*t.device_, t.pd_, t.NewBuffer(PartlyPinnedMemory::kPages)) {}
    absl::Status Run() override {
      absl::StatusOr<LogicalMapping> lam =
          t_.device_->BuildLam(t_.pd_, memory_.span());
      if (lam.ok()) lam_ = *lam;
      return lam.status();
    }
    void UseAndRelease() override {
      // The logical pages work: fast-registered, a peer reads the memfd
      // through them.
      EXPECT_EQ(lam_.pages.size(), PartlyPinnedMemory::kPages);
      EXPECT_EQ(lam_.fbo, PartlyPinnedMemory::kOffset);
      absl::StatusOr<MrKeys> mr = t_.device_->AllocateFastRegisterMr(
          t_.pd_, true, PartlyPinnedMemory::kPages);
      ASSERT_TRUE(mr.ok()) << mr.status();
      absl::StatusOr<uint32_t> rkey =
          t_.FastRegister(mr->mr, lam_.pages, lam_.fbo, memory_.length());
      EXPECT_TRUE(rkey.ok()) << rkey.status();
      if (rkey.ok()) {
        t_.ExpectPeerReads(*t_.peer_, *rkey, kBase + lam_.fbo, memory_.bytes());
      }
      EXPECT_TRUE(t_.device_->FreeFastRegisterMr(mr->mr).ok());
      EXPECT_TRUE(t_.device_->ReleaseLam(lam_.lam).ok());
    }

   private:
    DeviceFaultTest& t_;
    PartlyPinnedMemory memory_;
    LogicalMapping lam_;
  };
  std::vector<std::string> steps = Sweep(
      "BuildLam", [&] { return std::make_unique<LamTrial>(*this); },
      [&](const std::vector<std::string>& swept, size_t k,
          const Snapshot& before) {
        ExpectPartialPinWasUndone(swept, k, before, pin_ops_.peak());
      });
  EXPECT_THAT(steps,
              ElementsAre("pin.mlock", "pin.mlock", "pin.mlock",
                          "random.iova_guard", "iova.allocate", "keys.allocate",
                          "random.key_slot", "random.key_byte", "lam.insert"));
}

// A 4-page memfd mapped by a LAM: what fast registrations map.
class MappedMemory {
 public:
  static constexpr uint64_t kPages = 4;

  MappedMemory(SoftwareDevice& device, PdId pd, MemfdBuffer& buffer)
      : device_(device), buffer_(buffer) {
    absl::StatusOr<LogicalMapping> lam =
        device_.BuildLam(pd, buffer_.Span(0, length()));
    EXPECT_TRUE(lam.ok()) << lam.status();
    if (lam.ok()) lam_ = *lam;
  }
  ~MappedMemory() { EXPECT_TRUE(device_.ReleaseLam(lam_.lam).ok()); }

  uint64_t length() const { return kPages * PageSize(); }
  const std::vector<uint64_t>& pages() const { return lam_.pages; }
  std::string bytes() const { return buffer_.Bytes(0, length()); }

 private:
  SoftwareDevice& device_;
  MemfdBuffer& buffer_;
  LogicalMapping lam_;
};

TEST_F(DeviceFaultTest, AllocateFastRegisterMrFailingAtAnyStepLeavesNothing) {
  class AllocateTrial final : public Trial {
   public:
    explicit AllocateTrial(DeviceFaultTest& t)
        : t_(t),
          memory_(*t.device_, t.pd_, t.NewBuffer(MappedMemory::kPages)) {}
    absl::Status Run() override {
      absl::StatusOr<MrKeys> mr =
          t_.device_->AllocateFastRegisterMr(t_.pd_, true, 8);
      if (mr.ok()) mr_ = *mr;
      return mr.status();
    }
    void UseAndRelease() override {
      absl::StatusOr<uint32_t> rkey =
          t_.FastRegister(mr_.mr, memory_.pages(), 0, memory_.length());
      EXPECT_TRUE(rkey.ok()) << rkey.status();
      if (rkey.ok())
        t_.ExpectPeerReads(*t_.peer_, *rkey, kBase, memory_.bytes());
      EXPECT_TRUE(t_.device_->FreeFastRegisterMr(mr_.mr).ok());
    }

   private:
    DeviceFaultTest& t_;
    MappedMemory memory_;
    MrKeys mr_;
  };
  std::vector<std::string> steps = Sweep("AllocateFastRegisterMr", [&] {
    return std::make_unique<AllocateTrial>(*this);
  });
  EXPECT_THAT(steps, ElementsAre("keys.allocate", "random.key_slot",
                                 "random.key_byte", "mr.insert"));
}

TEST_F(DeviceFaultTest, FastRegistrationFailingAtAnyStepLeavesTheMrFree) {
  class FastRegisterTrial final : public Trial {
   public:
    explicit FastRegisterTrial(DeviceFaultTest& t)
        : t_(t), memory_(*t.device_, t.pd_, t.NewBuffer(MappedMemory::kPages)) {
      absl::StatusOr<MrKeys> mr =
          t_.device_->AllocateFastRegisterMr(t_.pd_, true, 8);
      EXPECT_TRUE(mr.ok()) << mr.status();
      if (mr.ok()) mr_ = *mr;
    }
    ~FastRegisterTrial() override {
      EXPECT_TRUE(t_.device_->FreeFastRegisterMr(mr_.mr).ok());
    }
    // The post, then the work on the device's worker: a failure of either
    // is the status returned (the latter through the completion).
    absl::Status Run() override {
      // The key the MR holds now: a fast registration never gives it again
      // (a failed one may have replaced the constructor's already; keys
      // are drawn anew each time, so an older one may come back).
      absl::StatusOr<MrKeys> held = t_.device_->QueryMr(mr_.mr);
      EXPECT_TRUE(held.ok()) << held.status();
      if (held.ok()) held_rkey_ = held->rkey;
      absl::StatusOr<uint32_t> rkey =
          t_.FastRegister(mr_.mr, memory_.pages(), 0, memory_.length());
      if (rkey.ok()) rkey_ = *rkey;
      return rkey.status();
    }
    void CheckFailed() override {
      // The MR object is still free: its key, old or new, reaches nothing.
      absl::StatusOr<MrKeys> now = t_.device_->QueryMr(mr_.mr);
      ASSERT_TRUE(now.ok()) << now.status();
      t_.ExpectNoPeerAccess(now->rkey, kBase);
      t_.ExpectNoPeerAccess(mr_.rkey, kBase);
    }
    void UseAndRelease() override {
      EXPECT_NE(rkey_, held_rkey_);
      t_.ExpectPeerReads(*t_.peer_, rkey_, kBase, memory_.bytes());
      t_.Invalidate(mr_.mr);  // free again, as the constructor left it
      t_.ExpectNoPeerAccess(rkey_, kBase);
    }

   private:
    DeviceFaultTest& t_;
    MappedMemory memory_;
    MrKeys mr_;
    uint32_t held_rkey_ = 0;
    uint32_t rkey_ = 0;
  };
  std::vector<std::string> steps = Sweep("FastRegister", [&] {
    return std::make_unique<FastRegisterTrial>(*this);
  });
  EXPECT_THAT(steps, ElementsAre("work.post", "fast_register.execute",
                                 "random.key_byte", "fast_register.map"));
}

// A protection domain of its own, for the operations that add to a PD what
// only its deallocation takes away.
class OwnPd {
 public:
  OwnPd(SoftwareDevice& device, RecordingSink& sink) : device_(device) {
    absl::StatusOr<PdId> pd = device_.AllocatePd(&sink);
    EXPECT_TRUE(pd.ok()) << pd.status();
    pd_ = pd.value_or(0);
  }
  ~OwnPd() { EXPECT_TRUE(device_.DeallocatePd(pd_).ok()); }
  PdId pd() const { return pd_; }

  // A peer connected with `ticket` reaches this PD's memory, and only it.
  static void ExpectTicketWorks(SoftwareDevice& device, PdId pd,
                                MemfdBuffer& buffer,
                                const std::string& ticket) {
    absl::StatusOr<std::unique_ptr<SoftPeer>> peer =
        SoftPeer::Connect(device.Attributes().peer_address, ticket);
    ASSERT_TRUE(peer.ok()) << peer.status();
    absl::StatusOr<MrKeys> keys = device.RegisterMr(
        pd, buffer.Span(0, PageSize()), kBase, kAccessRemoteRead);
    ASSERT_TRUE(keys.ok()) << keys.status();
    absl::StatusOr<std::string> read =
        (*peer)->Read(keys->rkey, kBase, PageSize());
    EXPECT_TRUE(read.ok()) << read.status();
    EXPECT_TRUE(read.ok() && *read == buffer.Bytes(0, PageSize()));
    EXPECT_TRUE(device.DeregisterMr(keys->mr).ok());
  }

 private:
  SoftwareDevice& device_;
  PdId pd_ = 0;
};

TEST_F(DeviceFaultTest, CreatePeerTicketFailingAtAnyStepLeavesNoTicket) {
  class TicketTrial final : public Trial {
   public:
    explicit TicketTrial(DeviceFaultTest& t)
        : t_(t),
          buffer_(t.NewBuffer(1)),
          pd_(std::make_unique<OwnPd>(*t.device_, sink_)) {}
    absl::Status Run() override {
      absl::StatusOr<std::string> ticket =
          t_.device_->CreatePeerTicket(pd_->pd());
      if (ticket.ok()) ticket_ = *ticket;
      return ticket.status();
    }
    void UseAndRelease() override {
      OwnPd::ExpectTicketWorks(*t_.device_, pd_->pd(), buffer_, ticket_);
      // A ticket lives until its PD goes: a new PD takes the old one's
      // place, and the ticket goes with the old one.
      pd_ = std::make_unique<OwnPd>(*t_.device_, sink_);
    }

   private:
    DeviceFaultTest& t_;
    MemfdBuffer& buffer_;
    RecordingSink sink_;  // outlives the PDs
    std::unique_ptr<OwnPd> pd_;
    std::string ticket_;
  };
  const Snapshot start = Take();
  std::vector<std::string> steps = Sweep(
      "CreatePeerTicket", [&] { return std::make_unique<TicketTrial>(*this); });
  EXPECT_THAT(steps, ElementsAre("random.ticket", "ticket.insert"));
  EXPECT_EQ(Describe(Take()), Describe(start));
}

TEST_F(DeviceFaultTest, AllocatePdFailingLeavesNoPd) {
  class PdTrial final : public Trial {
   public:
    explicit PdTrial(DeviceFaultTest& t) : t_(t), buffer_(t.NewBuffer(1)) {}
    absl::Status Run() override {
      absl::StatusOr<PdId> pd = t_.device_->AllocatePd(&sink_);
      if (pd.ok()) pd_ = *pd;
      return pd.status();
    }
    void UseAndRelease() override {
      absl::StatusOr<std::string> ticket = t_.device_->CreatePeerTicket(pd_);
      ASSERT_TRUE(ticket.ok()) << ticket.status();
      OwnPd::ExpectTicketWorks(*t_.device_, pd_, buffer_, *ticket);
      EXPECT_TRUE(t_.device_->DeallocatePd(pd_).ok());
    }

   private:
    DeviceFaultTest& t_;
    MemfdBuffer& buffer_;
    RecordingSink sink_;
    PdId pd_ = 0;
  };
  std::vector<std::string> steps =
      Sweep("AllocatePd", [&] { return std::make_unique<PdTrial>(*this); });
  EXPECT_THAT(steps, ElementsAre("pd.allocate"));
}

// Posting an invalidation has one step of its own; failing it leaves the
// fast registration in place.
TEST_F(DeviceFaultTest, FailedInvalidatePostLeavesTheRegistration) {
  MemfdBuffer& buffer = NewBuffer(MappedMemory::kPages);
  {
    MappedMemory memory(*device_, pd_, buffer);
    absl::StatusOr<MrKeys> mr = device_->AllocateFastRegisterMr(pd_, true, 8);
    ASSERT_TRUE(mr.ok()) << mr.status();
    absl::StatusOr<uint32_t> rkey =
        FastRegister(mr->mr, memory.pages(), 0, memory.length());
    ASSERT_TRUE(rkey.ok()) << rkey.status();
    const Snapshot before = Take();
    const absl::Status injected = Injected("InvalidateMr", 1);
    faults_.Arm(1, injected);
    InvalidateWork work;
    work.mr = mr->mr;
    EXPECT_EQ(device_->PostInvalidate(peer_->connection_id(), work).status(),
              injected);
    EXPECT_EQ(faults_.FiredStep(), "work.post");
    EXPECT_EQ(Describe(Take()), Describe(before));
    ExpectPeerReads(*peer_, *rkey, kBase, memory.bytes());
    Invalidate(mr->mr);
    ExpectNoPeerAccess(*rkey, kBase);
    EXPECT_TRUE(device_->FreeFastRegisterMr(mr->mr).ok());
  }
  EXPECT_EQ(device_->PinnedBytes(), 0u);
}

}  // namespace
}  // namespace mrd::device
