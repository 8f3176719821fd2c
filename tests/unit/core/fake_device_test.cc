// The fake device has to be right for the core tests to mean anything: these
// tests pin down its keys, pinning, LAMs, fast-register states, posted work,
// peers, failure injection and PD teardown.
#include "tests/unit/core/fake_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using fake::FakeDevice;

class RecordingSink final : public device::PdEventSink {
 public:
  void OnCompletion(const device::WorkCompletion& c) override {
    absl::MutexLock lock(&mu_);
    completions_.push_back(c);
  }
  void OnPeerConnected(device::ConnectionId connection,
                       const std::string& /*peer*/) override {
    absl::MutexLock lock(&mu_);
    connected_.push_back(connection);
  }
  void OnPeerDisconnected(device::ConnectionId connection) override {
    absl::MutexLock lock(&mu_);
    disconnected_.push_back(connection);
  }
  std::vector<device::WorkCompletion> completions() const {
    absl::MutexLock lock(&mu_);
    return completions_;
  }
  std::vector<device::ConnectionId> connected() const {
    absl::MutexLock lock(&mu_);
    return connected_;
  }
  std::vector<device::ConnectionId> disconnected() const {
    absl::MutexLock lock(&mu_);
    return disconnected_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<device::WorkCompletion> completions_ ABSL_GUARDED_BY(mu_);
  std::vector<device::ConnectionId> connected_ ABSL_GUARDED_BY(mu_);
  std::vector<device::ConnectionId> disconnected_ ABSL_GUARDED_BY(mu_);
};

// A sealed memfd mapped shared, as MapMemfd would map it.
class Mapping {
 public:
  explicit Mapping(uint64_t size) : fd_(MakeSealedMemfd(size)), size_(size) {
    address_ =
        ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
    EXPECT_NE(address_, MAP_FAILED);
  }
  ~Mapping() {
    if (address_ != MAP_FAILED) ::munmap(address_, size_);
  }
  device::MemorySpan Span(uint64_t offset, uint64_t length) const {
    device::MemorySpan span;
    span.host_address = static_cast<char*>(address_) + offset;
    span.length = length;
    span.fd = fd_.get();
    span.file_offset = offset;
    return span;
  }
  void Unmap() {
    ::munmap(address_, size_);
    address_ = MAP_FAILED;
  }

 private:
  UniqueFd fd_;
  uint64_t size_;
  void* address_ = MAP_FAILED;
};

class FakeDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK(fake_.Start());
    absl::StatusOr<device::PdId> pd = fake_.AllocatePd(&sink_);
    ASSERT_TRUE(pd.ok()) << pd.status();
    pd_ = *pd;
  }
  void TearDown() override {
    if (fake_.LivePdCount() != 0) {
      for (device::PdId pd : fake_.LivePds()) EXPECT_OK(fake_.DeallocatePd(pd));
    }
    EXPECT_EQ(fake_.PinnedBytes(), 0u);
    EXPECT_EQ(fake_.LiveMrCount(), 0u);
    EXPECT_EQ(fake_.LiveLamCount(), 0u);
  }

  // A LAM of `pages` pages and a connected fast-register MR, ready to post.
  struct Ready {
    device::LogicalMapping lam;
    device::MrKeys mr;
    device::ConnectionId connection = 0;
  };
  Ready MakeReady(const Mapping& m, bool allow_remote) {
    Ready r;
    absl::StatusOr<device::LogicalMapping> lam =
        fake_.BuildLam(pd_, m.Span(0, 2 * page_));
    EXPECT_TRUE(lam.ok()) << lam.status();
    if (lam.ok()) r.lam = *lam;
    absl::StatusOr<device::MrKeys> mr =
        fake_.AllocateFastRegisterMr(pd_, allow_remote, 8);
    EXPECT_TRUE(mr.ok()) << mr.status();
    if (mr.ok()) r.mr = *mr;
    absl::StatusOr<device::ConnectionId> c = fake_.ConnectPeer(pd_);
    EXPECT_TRUE(c.ok()) << c.status();
    if (c.ok()) r.connection = *c;
    return r;
  }
  device::FastRegisterWork Work(const Ready& r, uint32_t access,
                                uint32_t flags = 0) {
    device::FastRegisterWork w;
    w.mr = r.mr.mr;
    w.pages = r.lam.pages;
    w.fbo = 0;
    w.length = 2 * page_;
    w.base_address = 4 * page_;
    w.access = access;
    w.flags = flags;
    w.request_context = 77;
    return w;
  }

  const uint64_t page_ = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  FakeDevice fake_;
  RecordingSink sink_;
  device::PdId pd_ = 0;
};

TEST_F(FakeDeviceTest, EveryRegistrationGetsAFreshKeyAndDeregisterRevokesIt) {
  Mapping m(4 * page_);
  absl::StatusOr<device::MrKeys> a = fake_.RegisterMr(
      pd_, m.Span(0, page_), 0x10000, device::kAccessRemoteRead);
  absl::StatusOr<device::MrKeys> b = fake_.RegisterMr(
      pd_, m.Span(0, page_), 0x10000, device::kAccessRemoteRead);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->rkey, b->rkey);
  EXPECT_NE(a->mr, b->mr);
  EXPECT_TRUE(fake_.IsKeyValid(a->rkey));
  EXPECT_OK(fake_.DeregisterMr(a->mr));
  EXPECT_FALSE(fake_.IsKeyValid(a->rkey));
  EXPECT_TRUE(fake_.IsKeyValid(b->rkey));
  EXPECT_EQ(fake_.DeregisterMr(a->mr).code(), absl::StatusCode::kNotFound);
  EXPECT_OK(fake_.DeregisterMr(b->mr));
}

TEST_F(FakeDeviceTest, RegisterMrEnforcesTheDeviceRules) {
  Mapping m(page_);
  EXPECT_TRUE(
      IsSeedError(fake_.RegisterMr(pd_, m.Span(0, page_), 0, 0).status(),
                  absl::StatusCode::kInvalidArgument,
                  ::mrd::STATUS_INVALID_PARAMETER, "ZERO_BASED_ADDRESS"));
  EXPECT_EQ(
      fake_
          .RegisterMr(pd_, m.Span(0, page_), 0x1000, device::kAccessRemoteWrite)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      fake_.RegisterMr(pd_ + 1000, m.Span(0, page_), 0x1000, 0).status().code(),
      absl::StatusCode::kNotFound);
  device::MemorySpan bad = m.Span(0, page_);
  bad.fd = -1;
  EXPECT_EQ(fake_.RegisterMr(pd_, bad, 0x1000, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fake_.LiveMrCount(), 0u);
}

TEST_F(FakeDeviceTest, UnmappedMemoryCannotBeRegisteredAndIsDetectedLater) {
  Mapping m(2 * page_);
  absl::StatusOr<device::MrKeys> mr =
      fake_.RegisterMr(pd_, m.Span(0, page_), 0x1000, 0);
  ASSERT_TRUE(mr.ok());
  EXPECT_OK(fake_.CheckLiveMemory());
  device::MemorySpan span = m.Span(0, page_);
  m.Unmap();
  EXPECT_FALSE(fake_.CheckLiveMemory().ok());
  EXPECT_TRUE(IsSeedError(fake_.RegisterMr(pd_, span, 0x1000, 0).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "SPAN_NOT_MAPPED"));
  EXPECT_OK(fake_.DeregisterMr(mr->mr));
}

TEST_F(FakeDeviceTest, PinnedBytesAreWholePagesOfLiveMrsAndLams) {
  Mapping m(4 * page_);
  absl::StatusOr<device::MrKeys> mr =
      fake_.RegisterMr(pd_, m.Span(100, page_), 0x1000, 0);  // spans 2 pages
  ASSERT_TRUE(mr.ok());
  EXPECT_EQ(fake_.PinnedBytes(), 2 * page_);
  absl::StatusOr<device::LogicalMapping> lam =
      fake_.BuildLam(pd_, m.Span(0, 1));
  ASSERT_TRUE(lam.ok());
  EXPECT_EQ(fake_.PinnedBytes(), 3 * page_);
  EXPECT_OK(fake_.DeregisterMr(mr->mr));
  EXPECT_OK(fake_.ReleaseLam(lam->lam));
  EXPECT_EQ(fake_.PinnedBytes(), 0u);
}

TEST_F(FakeDeviceTest, BuildLamReturnsAlignedLogicalPagesAndFbo) {
  Mapping m(4 * page_);
  absl::StatusOr<device::LogicalMapping> lam =
      fake_.BuildLam(pd_, m.Span(page_ + 24, 2 * page_));
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_EQ(lam->fbo, 24u);
  ASSERT_EQ(lam->pages.size(), 3u);
  for (uint64_t p : lam->pages) EXPECT_EQ(p % page_, 0u);
  EXPECT_EQ(fake_.LiveLamCount(), 1u);
  EXPECT_OK(fake_.ReleaseLam(lam->lam));
  EXPECT_EQ(fake_.ReleaseLam(lam->lam).code(), absl::StatusCode::kNotFound);
}

TEST_F(FakeDeviceTest, FastRegisterRunsOnlyWhenPostedWorkRuns) {
  Mapping m(2 * page_);
  Ready r = MakeReady(m, /*allow_remote=*/true);
  absl::StatusOr<uint64_t> wr =
      fake_.PostFastRegister(r.connection, Work(r, device::kAccessRemoteRead));
  ASSERT_TRUE(wr.ok()) << wr.status();
  EXPECT_TRUE(sink_.completions().empty());
  EXPECT_FALSE(fake_.IsFastRegistered(r.mr.mr));
  EXPECT_EQ(fake_.RunPostedWork(), 1);
  std::vector<device::WorkCompletion> c = sink_.completions();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_OK(c[0].status);
  EXPECT_EQ(c[0].request_context, 77u);
  EXPECT_EQ(c[0].work_request, *wr);
  EXPECT_NE(c[0].rkey, r.mr.rkey);
  EXPECT_TRUE(fake_.IsKeyValid(c[0].rkey));
  EXPECT_TRUE(fake_.IsFastRegistered(r.mr.mr));
  EXPECT_OK(fake_.PeerAccess(c[0].rkey, 4 * page_, page_, /*write=*/false));
  EXPECT_FALSE(fake_.PeerAccess(c[0].rkey, 4 * page_, page_, true).ok());
  EXPECT_FALSE(fake_.PeerAccess(c[0].rkey, 6 * page_, 1, false).ok());
  // Its LAM cannot go while it is mapped.
  EXPECT_EQ(fake_.ReleaseLam(r.lam.lam).code(),
            absl::StatusCode::kFailedPrecondition);

  device::InvalidateWork inv;
  inv.mr = r.mr.mr;
  inv.request_context = 78;
  ASSERT_TRUE(fake_.PostInvalidate(r.connection, inv).ok());
  EXPECT_EQ(fake_.RunPostedWork(), 1);
  EXPECT_FALSE(fake_.IsKeyValid(c[0].rkey));
  EXPECT_FALSE(fake_.IsFastRegistered(r.mr.mr));
  EXPECT_EQ(sink_.completions().size(), 2u);
  EXPECT_OK(fake_.ReleaseLam(r.lam.lam));
  EXPECT_OK(fake_.FreeFastRegisterMr(r.mr.mr));
}

TEST_F(FakeDeviceTest, SilentSuccessDeliversNoCompletionButFailuresDo) {
  Mapping m(2 * page_);
  Ready r = MakeReady(m, true);
  ASSERT_TRUE(fake_
                  .PostFastRegister(r.connection,
                                    Work(r, 0, device::kWorkSilentSuccess))
                  .ok());
  fake_.RunPostedWork();
  EXPECT_TRUE(sink_.completions().empty());
  EXPECT_TRUE(fake_.IsFastRegistered(r.mr.mr));
  // A second fast registration on a registered MR fails, silently or not.
  ASSERT_TRUE(fake_
                  .PostFastRegister(r.connection,
                                    Work(r, 0, device::kWorkSilentSuccess))
                  .ok());
  fake_.RunPostedWork();
  ASSERT_EQ(sink_.completions().size(), 1u);
  EXPECT_FALSE(sink_.completions()[0].status.ok());
}

TEST_F(FakeDeviceTest, PostFastRegisterChecksConnectionPagesAndAccess) {
  Mapping m(2 * page_);
  Ready r = MakeReady(m, /*allow_remote=*/false);
  EXPECT_EQ(
      fake_.PostFastRegister(r.connection + 999, Work(r, 0)).status().code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(IsSeedError(
      fake_.PostFastRegister(r.connection, Work(r, device::kAccessRemoteRead))
          .status(),
      absl::StatusCode::kPermissionDenied, ::mrd::STATUS_ACCESS_VIOLATION,
      "MR_NOT_REMOTE"));
  device::FastRegisterWork w = Work(r, 0);
  w.pages[0] += page_ * 1000;
  EXPECT_EQ(fake_.PostFastRegister(r.connection, w).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A connection of another PD.
  RecordingSink other_sink;
  absl::StatusOr<device::PdId> other = fake_.AllocatePd(&other_sink);
  ASSERT_TRUE(other.ok());
  absl::StatusOr<device::ConnectionId> other_conn = fake_.ConnectPeer(*other);
  ASSERT_TRUE(other_conn.ok());
  EXPECT_EQ(fake_.PostFastRegister(*other_conn, Work(r, 0)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fake_.PendingWorkCount(), 0u);
}

TEST_F(FakeDeviceTest, FailNextFailsTheNextCallsInOrderAndChangesNothing) {
  Mapping m(page_);
  fake_.FailNext(FakeDevice::Op::kRegisterMr,
                 absl::ResourceExhaustedError("1"));
  fake_.FailNext(FakeDevice::Op::kRegisterMr, absl::UnavailableError("2"));
  EXPECT_EQ(fake_.RegisterMr(pd_, m.Span(0, page_), 0x1000, 0).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fake_.RegisterMr(pd_, m.Span(0, page_), 0x1000, 0).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(fake_.LiveMrCount(), 0u);
  EXPECT_EQ(fake_.PinnedBytes(), 0u);
  absl::StatusOr<device::MrKeys> ok =
      fake_.RegisterMr(pd_, m.Span(0, page_), 0x1000, 0);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(fake_.Calls(FakeDevice::Op::kRegisterMr), 3u);
  EXPECT_OK(fake_.DeregisterMr(ok->mr));
}

TEST_F(FakeDeviceTest, PeersConnectWithTicketsAndDisconnectFlushesWork) {
  Mapping m(2 * page_);
  absl::StatusOr<std::string> ticket = fake_.CreatePeerTicket(pd_);
  ASSERT_TRUE(ticket.ok());
  absl::StatusOr<device::ConnectionId> c = fake_.ConnectPeerWithTicket(*ticket);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(sink_.connected(), std::vector<device::ConnectionId>{*c});
  EXPECT_EQ(fake_.ConnectPeerWithTicket("nope").status().code(),
            absl::StatusCode::kNotFound);
  Ready r = MakeReady(m, false);
  ASSERT_TRUE(fake_.PostFastRegister(*c, Work(r, 0)).ok());
  EXPECT_OK(fake_.DisconnectPeer(*c));
  EXPECT_EQ(sink_.disconnected(), std::vector<device::ConnectionId>{*c});
  fake_.RunPostedWork();
  ASSERT_EQ(sink_.completions().size(), 1u);
  EXPECT_FALSE(sink_.completions()[0].status.ok());
  EXPECT_FALSE(fake_.IsFastRegistered(r.mr.mr));
}

TEST_F(FakeDeviceTest, DeallocatePdReleasesEverythingAndSilencesItsSink) {
  Mapping m(2 * page_);
  Ready r = MakeReady(m, true);
  ASSERT_TRUE(fake_.RegisterMr(pd_, m.Span(0, page_), 0x1000, 0).ok());
  ASSERT_TRUE(fake_.PostFastRegister(r.connection, Work(r, 0)).ok());
  EXPECT_OK(fake_.DeallocatePd(pd_));
  EXPECT_EQ(fake_.LiveMrCount(), 0u);
  EXPECT_EQ(fake_.LiveLamCount(), 0u);
  EXPECT_EQ(fake_.PinnedBytes(), 0u);
  EXPECT_EQ(fake_.LiveConnectionCount(), 0u);
  fake_.RunPostedWork();
  EXPECT_TRUE(sink_.completions().empty());
  EXPECT_EQ(fake_.DeallocatePd(pd_).code(), absl::StatusCode::kNotFound);
}

TEST(FakeDeviceThreadTest, DeviceThreadDeliversCompletionsOnItsOwn) {
  fake::FakeDeviceOptions options;
  options.run_work_on_device_thread = true;
  FakeDevice fake(options);
  ASSERT_OK(fake.Start());
  const uint64_t page = fake.Attributes().page_size;
  RecordingSink sink;
  absl::StatusOr<device::PdId> pd = fake.AllocatePd(&sink);
  ASSERT_TRUE(pd.ok());
  Mapping m(page);
  absl::StatusOr<device::LogicalMapping> lam =
      fake.BuildLam(*pd, m.Span(0, page));
  absl::StatusOr<device::MrKeys> mr = fake.AllocateFastRegisterMr(*pd, true, 4);
  absl::StatusOr<device::ConnectionId> c = fake.ConnectPeer(*pd);
  ASSERT_TRUE(lam.ok() && mr.ok() && c.ok());
  device::FastRegisterWork w;
  w.mr = mr->mr;
  w.pages = lam->pages;
  w.length = page;
  w.base_address = page;
  ASSERT_TRUE(fake.PostFastRegister(*c, w).ok());
  for (int i = 0; i < 500 && sink.completions().empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(sink.completions().size(), 1u);
  EXPECT_OK(sink.completions()[0].status);
  EXPECT_OK(fake.DeallocatePd(*pd));
  fake.Shutdown();
  EXPECT_EQ(fake.PinnedBytes(), 0u);
}

}  // namespace
}  // namespace mrd::core_test
