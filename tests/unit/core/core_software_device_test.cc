// The core on the real software device, with a real peer on the wire: a warm
// re-registration locks no page anew yet gets a new token, and the token of
// the released registration is refused on the peer path; a range inside a
// registration reuses its pinned pages but its token reaches only that range;
// sessions and buffers that go while warm pins come and go leave nothing
// locked and make no mlock/munlock fail. mlock/munlock are counted through
// the device's PinOps.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/peer/soft_peer.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"
#include "mrd/unique_fd.h"
#include "server/common/clock.h"
#include "server/common/log.h"
#include "server/core/core.h"
#include "server/device/software/pin_tracker.h"
#include "server/device/software/software_device.h"
#include "tests/support/kernel_pins.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {

using ::mrd::test_support::KernelPinnedBytesSettled;
namespace {

// mlock/munlock, counted; a failed call is counted too (munlock fails with
// ENOMEM when the range was unmapped while still pinned).
class CountingPinOps final : public device::PinOps {
 public:
  int Lock(uint64_t address, uint64_t length) override {
    ++locks;
    int rc = device::SystemPinOps()->Lock(address, length);
    if (rc != 0) ++failures;
    return rc;
  }
  int Unlock(uint64_t address, uint64_t length) override {
    ++unlocks;
    int rc = device::SystemPinOps()->Unlock(address, length);
    if (rc != 0) ++failures;
    return rc;
  }
  std::atomic<int> locks{0};
  std::atomic<int> unlocks{0};
  std::atomic<int> failures{0};
};

bool IsRemoteAccessError(const absl::Status& s) {
  return s.code() == absl::StatusCode::kPermissionDenied &&
         GetErrorDetail(s).reason() == "REMOTE_ACCESS_ERROR";
}

class SoftwareCoreTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kPages = 16;

  void SetUp() override { Start(/*warm=*/true); }

  void Start(bool warm, uint64_t warm_per_session = kPages,
             uint64_t warm_total = kPages) {
    SetMinLogLevel(LogLevel::kWarning);
    page_ = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    device::SoftwareDeviceOptions device_options;
    device_options.pin_ops = &ops_;
    auto device = device::SoftwareDevice::Create(device_options);
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = std::move(*device);
    ASSERT_OK(device_->Start());
    core::CoreOptions options;
    if (warm) {
      options.warm_pin_bytes_per_session = warm_per_session * page_;
      options.warm_pin_bytes_total = warm_total * page_;
    }
    options.max_session_pinned_bytes = max_session_pinned_pages_ * page_;
    options.max_total_pinned_bytes = 8 * kPages * page_;
    if (max_session_registrations_ != 0) {
      options.max_session_registrations = max_session_registrations_;
    }
    core_ =
        std::make_unique<core::Core>(device_.get(), RealClock::Get(), options);
    // The test keeps its own descriptor of the memfd to check the bytes.
    absl::StatusOr<SessionWithBuffer> opened =
        OpenSessionWithBuffer(*core_, kPages * page_);
    ASSERT_TRUE(opened.ok()) << opened.status();
    session_ = opened->session;
    memfd_ = std::move(opened->memfd);
    pattern_ = opened->pattern;
    buffer_ = opened->buffer;
    v1::CreatePeerTicketRequest ticket_req;
    ticket_req.set_session(session_);
    ASSERT_OK(core_->CreatePeerTicket(ticket_req, &ticket_));
  }

  void TearDown() override {
    if (core_ != nullptr) core_->Shutdown();
    if (device_ != nullptr) {
      EXPECT_EQ(device_->PinnedBytes(), 0u);
      device_->Shutdown();
    }
  }

  // A fresh peer connection (a refused request puts a connection in the
  // error state, as on an RC queue pair).
  std::unique_ptr<peer::SoftPeer> Peer() {
    absl::StatusOr<std::unique_ptr<peer::SoftPeer>> p =
        peer::SoftPeer::Connect(ticket_.peer_address(), ticket_.ticket());
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  absl::StatusOr<v1::RegisterMrResponse> Register(uint64_t offset,
                                                  uint64_t length) {
    v1::RegisterMrRequest req;
    req.set_session(session_);
    req.set_buffer(buffer_.buffer());
    req.set_offset(offset);
    req.set_length(length);
    req.set_flags(kMrRemoteRead);
    return RegisterOn(*core_, req);
  }
  absl::Status Deregister(uint64_t registration) {
    return DeregisterOn(*core_, session_, registration).status();
  }

  // Limits Start gives the core.
  uint64_t max_session_pinned_pages_ = 4 * kPages;
  uint32_t max_session_registrations_ = 0;  // 0: the core's default
  uint64_t page_ = 0;
  CountingPinOps ops_;
  std::unique_ptr<device::SoftwareDevice> device_;
  std::unique_ptr<core::Core> core_;
  std::string session_;
  UniqueFd memfd_;
  std::string pattern_;
  v1::BufferInfo buffer_;
  v1::PeerTicket ticket_;
};

TEST_F(SoftwareCoreTest, WarmReRegistrationLocksNothingAndTheOldTokenIsDead) {
  absl::StatusOr<v1::RegisterMrResponse> first = Register(0, 4 * page_);
  ASSERT_TRUE(first.ok()) << first.status();
  const uint64_t base = first->base_address();
  std::unique_ptr<peer::SoftPeer> peer = Peer();
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> read = peer->Read(first->rkey(), base, 64);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, pattern_.substr(0, 64));
  const int locks = ops_.locks.load();
  const int unlocks = ops_.unlocks.load();

  ASSERT_OK(Deregister(first->registration()));
  // The token is refused on the wire as soon as DeregisterMr has returned...
  EXPECT_TRUE(
      IsRemoteAccessError(peer->Read(first->rkey(), base, 64).status()));
  // ...while the pages stayed locked: not one munlock.
  EXPECT_EQ(ops_.unlocks.load(), unlocks);
  EXPECT_EQ(device_->PinnedBytes(), 4 * page_);

  absl::StatusOr<v1::RegisterMrResponse> again = Register(0, 4 * page_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->rkey(), first->rkey());
  EXPECT_EQ(again->base_address(), base);
  EXPECT_EQ(core_->Stats().warm.hits, 1u);
  // The re-registration locked no page anew, and giving up the warm pin
  // unlocked none (the registration holds them).
  EXPECT_EQ(ops_.locks.load(), locks);
  EXPECT_EQ(ops_.unlocks.load(), unlocks);
  EXPECT_EQ(device_->PinnedBytes(), 4 * page_);
  // The old token stays dead, on a new connection too, at the same address
  // where a new registration of the same pages now lives.
  std::unique_ptr<peer::SoftPeer> second = Peer();
  ASSERT_NE(second, nullptr);
  EXPECT_TRUE(
      IsRemoteAccessError(second->Read(first->rkey(), base, 64).status()));
  std::unique_ptr<peer::SoftPeer> third = Peer();
  ASSERT_NE(third, nullptr);
  read = third->Read(again->rkey(), base + page_, 64);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, pattern_.substr(page_, 64));

  // Releasing the buffer unlocks everything, warm or not.
  ASSERT_OK(Deregister(again->registration()));
  v1::ReleaseBufferRequest release;
  release.set_session(session_);
  release.set_buffer(buffer_.buffer());
  v1::ReleaseBufferResponse released;
  ASSERT_OK(core_->ReleaseBuffer(release, &released));
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().warm.pins, 0u);
  EXPECT_GT(ops_.unlocks.load(), unlocks);
}

TEST_F(SoftwareCoreTest, InnerRangeReusesThePinButItsTokenReachesOnlyIt) {
  absl::StatusOr<v1::RegisterMrResponse> outer = Register(0, 8 * page_);
  ASSERT_TRUE(outer.ok()) << outer.status();
  const int locks = ops_.locks.load();
  absl::StatusOr<v1::RegisterMrResponse> inner = Register(2 * page_, page_);
  ASSERT_TRUE(inner.ok()) << inner.status();
  EXPECT_EQ(ops_.locks.load(), locks) << "the pages were locked already";
  EXPECT_NE(inner->rkey(), outer->rkey());
  EXPECT_EQ(device_->PinnedBytes(), 8 * page_);
  const uint64_t inner_base = inner->base_address();
  std::unique_ptr<peer::SoftPeer> peer = Peer();
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> read = peer->Read(inner->rkey(), inner_base, 16);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, pattern_.substr(2 * page_, 16));
  // With the inner token, the byte before the range is out of reach...
  EXPECT_TRUE(IsRemoteAccessError(
      peer->Read(inner->rkey(), inner_base - 1, 1).status()));
  // ...and so is the byte after it.
  peer = Peer();
  ASSERT_NE(peer, nullptr);
  EXPECT_TRUE(IsRemoteAccessError(
      peer->Read(inner->rkey(), inner_base + page_, 1).status()));
  // The container goes; its token dies though the inner range lives on.
  ASSERT_OK(Deregister(outer->registration()));
  peer = Peer();
  ASSERT_NE(peer, nullptr);
  EXPECT_TRUE(
      IsRemoteAccessError(peer->Read(outer->rkey(), inner_base, 1).status()));
  peer = Peer();
  ASSERT_NE(peer, nullptr);
  read = peer->Read(inner->rkey(), inner_base, 16);
  EXPECT_TRUE(read.ok()) << read.status();
}

// Sessions end and buffers go while other threads register and deregister
// on them, with warm pins kept, evicted for the caps and the total limit,
// and dropped: no mlock or munlock may fail (a munlock fails when a mapping
// was unmapped while its pages were still pinned), and at the end nothing is
// pinned, for the device and for the kernel.
class SoftwareCoreConcurrentTest : public SoftwareCoreTest {
 protected:
  void SetUp() override {
    kernel_pinned_before_ = KernelPinnedBytesSettled(0);
    Start(/*warm=*/true, /*warm_per_session=*/6, /*warm_total=*/10);
  }
  void TearDown() override {
    SoftwareCoreTest::TearDown();
    core_.reset();
    device_.reset();
    EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_),
              kernel_pinned_before_);
  }
  uint64_t kernel_pinned_before_ = 0;
};

TEST_F(SoftwareCoreConcurrentTest, SessionsAndBuffersGoWhileWarmPinsCome) {
  struct Slot {
    std::string session;
    std::vector<uint64_t> buffers;
  };
  constexpr int kSlots = 3;
  absl::Mutex mu;
  std::vector<Slot> slots(kSlots);
  auto open = [&]() -> Slot {
    Slot slot;
    absl::StatusOr<std::string> token =
        core_->OnConnect({getpid(), getuid(), getgid(), std::nullopt, ""});
    if (!token.ok()) return slot;
    slot.session = *token;
    for (int b = 0; b < 2; ++b) {
      v1::ImportMemfd import;
      import.set_writable(true);
      absl::StatusOr<v1::BufferInfo> info = core_->OnImport(
          slot.session, MakeSealedMemfd(kPages * page_), import);
      if (info.ok()) slot.buffers.push_back(info->buffer());
    }
    return slot;
  };
  for (Slot& slot : slots) slot = open();
  std::atomic<bool> stop{false};
  std::atomic<int> registered{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < 2; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 random(static_cast<uint32_t>(t + 1));
      while (!stop) {
        Slot slot;
        {
          absl::MutexLock lock(&mu);
          slot = slots[random() % kSlots];
        }
        if (slot.buffers.empty()) continue;
        v1::RegisterMrRequest req;
        req.set_session(slot.session);
        req.set_buffer(slot.buffers[random() % slot.buffers.size()]);
        req.set_offset((random() % 4) * page_);
        req.set_length((1 + random() % 6) * page_);
        req.set_flags(kMrRemoteRead);
        v1::RegisterMrResponse out;
        if (!core_->RegisterMr(req, &out).ok()) continue;
        ++registered;
        v1::DeregisterMrRequest dereg;
        dereg.set_session(slot.session);
        dereg.set_registration(out.registration());
        v1::DeregisterMrResponse left;
        (void)core_->DeregisterMr(dereg, &left);
      }
    });
  }
  // The main thread releases buffers and ends sessions under them.
  std::mt19937 random(99);
  // Until both sides have done enough (the workers may start late on a
  // loaded machine), within a bound.
  for (int round = 0; round < 20000 && (round < 300 || registered < 500);
       ++round) {
    const int at = static_cast<int>(random() % kSlots);
    Slot victim;
    {
      absl::MutexLock lock(&mu);
      victim = slots[at];
    }
    if (round % 3 == 0 && !victim.buffers.empty()) {
      v1::ReleaseBufferRequest release;
      release.set_session(victim.session);
      release.set_buffer(victim.buffers.front());
      v1::ReleaseBufferResponse released;
      (void)core_->ReleaseBuffer(release, &released);
    } else {
      core_->OnDisconnect(victim.session);
      Slot fresh = open();
      absl::MutexLock lock(&mu);
      slots[at] = std::move(fresh);
    }
    absl::SleepFor(absl::Microseconds(200));
  }
  stop = true;
  for (std::thread& w : workers) w.join();
  EXPECT_GT(registered.load(), 0);
  const cache::WarmPinStats warm = core_->Stats().warm;
  EXPECT_GT(warm.kept, 0u);
  core_->Shutdown();
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_EQ(ops_.failures.load(), 0) << "an mlock or munlock failed";
  EXPECT_EQ(core_->Stats().warm.pins, 0u);
}

class SoftwareCoreColdTest : public SoftwareCoreTest {
 protected:
  void SetUp() override { Start(/*warm=*/false); }
};

TEST_F(SoftwareCoreColdTest, WithoutWarmPinsEveryCycleLocksAndUnlocks) {
  absl::StatusOr<v1::RegisterMrResponse> first = Register(0, 4 * page_);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_OK(Deregister(first->registration()));
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  const int locks = ops_.locks.load();
  const int unlocks = ops_.unlocks.load();
  absl::StatusOr<v1::RegisterMrResponse> again = Register(0, 4 * page_);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_OK(Deregister(again->registration()));
  EXPECT_GT(ops_.locks.load(), locks);
  EXPECT_GT(ops_.unlocks.load(), unlocks);
}

// Issue 25: a batch's items that register adjacent pages have them pinned
// together, ahead of them: one Lock for the run instead of one per item,
// under the session's budget. Items refused past a limit are refused as
// without it, and nothing of them stays pinned or counted.
class SoftwareCoreBatchTest : public SoftwareCoreTest {
 protected:
  void SetUp() override {}

  // RegisterMrBatch of every page of the buffer, one item each.
  v1::RegisterMrBatchResponse RegisterEveryPage() {
    v1::RegisterMrBatchRequest req;
    req.set_session(session_);
    for (uint64_t page = 0; page < kPages; ++page) {
      v1::RegisterMrRequest* item = req.add_items();
      item->set_buffer(buffer_.buffer());
      item->set_offset(page * page_);
      item->set_length(page_);
      item->set_flags(kMrRemoteRead);
    }
    v1::RegisterMrBatchResponse out;
    EXPECT_OK(core_->RegisterMrBatch(req, &out));
    return out;
  }
  // DeregisterMrBatch of the items of `out` that succeeded.
  void DeregisterAll(const v1::RegisterMrBatchResponse& out) {
    v1::DeregisterMrBatchRequest req;
    req.set_session(session_);
    for (const v1::RegisterMrBatchResult& item : out.items()) {
      if (item.status().code() == 0) {
        req.add_items()->set_registration(item.registration().registration());
      }
    }
    v1::DeregisterMrBatchResponse left;
    ASSERT_OK(core_->DeregisterMrBatch(req, &left));
    for (const auto& item : left.items()) EXPECT_EQ(item.status().code(), 0);
  }
  // Items [0, ok) succeeded; the others were refused for `reason`.
  void ExpectRefusedFrom(const v1::RegisterMrBatchResponse& out, int ok,
                         const std::string& reason) {
    ASSERT_EQ(out.items_size(), static_cast<int>(kPages));
    for (int i = 0; i < out.items_size(); ++i) {
      const absl::Status s = ItemStatusFromProto(out.items(i).status());
      if (i < ok) {
        EXPECT_OK(s) << i;
      } else {
        EXPECT_EQ(GetErrorDetail(s).reason(), reason) << i << ": " << s;
      }
    }
  }
};

TEST_F(SoftwareCoreBatchTest, AdjacentPagesArePinnedOnceAheadOfTheItems) {
  max_session_registrations_ = 12;
  Start(/*warm=*/false);
  const int locks = ops_.locks.load();
  const int unlocks = ops_.unlocks.load();
  const v1::RegisterMrBatchResponse out = RegisterEveryPage();
  ExpectRefusedFrom(out, 12, "LIMIT_SESSION_REGISTRATIONS");
  EXPECT_EQ(ops_.locks.load() - locks, 1);  // the 16 pages at once
  // The four refused items' pages, unpinned together when the run ended.
  EXPECT_EQ(ops_.unlocks.load() - unlocks, 1);
  EXPECT_EQ(device_->PinnedBytes(), 12 * page_);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 12 * page_);
  DeregisterAll(out);
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
  EXPECT_EQ(ops_.failures.load(), 0);
}

// Without room in the budget for the whole run, nothing is pinned ahead:
// each item reserves and pins on its own, and the limit refuses the same
// items it refused before.
TEST_F(SoftwareCoreBatchTest, ARunPastTheBudgetIsPinnedItemByItem) {
  max_session_pinned_pages_ = 10;
  Start(/*warm=*/false);
  const int locks = ops_.locks.load();
  const v1::RegisterMrBatchResponse out = RegisterEveryPage();
  ExpectRefusedFrom(out, 10, "LIMIT_SESSION_PINNED_BYTES");
  EXPECT_EQ(ops_.locks.load() - locks, 10);
  EXPECT_EQ(device_->PinnedBytes(), 10 * page_);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 10 * page_);
  DeregisterAll(out);
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
}

}  // namespace
}  // namespace mrd::core_test
