#include "server/device/software/software_device.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/peer/soft_peer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mrd/net.h"
#include "mrd/peer_frame.h"
#include "tests/support/kernel_pins.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::device {

using ::mrd::test_support::KernelPinnedBytesSettled;
namespace {

using ::mrd::device::testing::IsMrdError;
using ::mrd::device::testing::IsSeedError;
using ::mrd::device::testing::MemfdBuffer;
using ::mrd::device::testing::PageSize;
using ::mrd::device::testing::RecordingSink;
using ::mrd::peer::SoftPeer;
using Event = RecordingSink::Event;

constexpr uint32_t kRemoteRw =
    kAccessLocalWrite | kAccessRemoteRead | kAccessRemoteWrite;
constexpr uint64_t kBase = uint64_t{0x5000} << 32;  // page-aligned, non-zero

::testing::Matcher<absl::Status> IsAccessError() {
  return IsMrdError(absl::StatusCode::kPermissionDenied, "REMOTE_ACCESS_ERROR");
}
// Closed by the device: an orderly end of stream, or a reset when the
// request raced the close. Either way the connection is gone.
::testing::Matcher<absl::Status> IsGone() {
  return ::testing::Property(&absl::Status::code,
                             absl::StatusCode::kUnavailable);
}
::testing::Matcher<absl::Status> IsConnectionInvalid() {
  return IsSeedError(::mrd::STATUS_CONNECTION_INVALID, "CONNECTION_INVALID");
}

// Lets the first peer I/O in, then holds it until Open().
class Gate {
 public:
  void Pass() {
    absl::MutexLock lock(&mu_);
    if (used_) return;
    used_ = true;
    entered_ = true;
    mu_.Await(absl::Condition(&open_));
  }
  void WaitEntered() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&entered_));
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }

 private:
  absl::Mutex mu_;
  bool used_ ABSL_GUARDED_BY(mu_) = false;
  bool entered_ ABSL_GUARDED_BY(mu_) = false;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
};

class SoftwareDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    kernel_pinned_before_ = KernelPinnedBytesSettled(0);
    StartDevice(SoftwareDeviceOptions{});
  }

  // Every test is a leak test: after its PDs go, nothing stays pinned, for
  // the device's accounting and for the kernel's.
  void TearDown() override {
    for (PdId pd : pds_) {
      absl::Status status = device_->DeallocatePd(pd);
      EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kNotFound)
          << status;
    }
    EXPECT_EQ(device_->PinnedBytes(), 0u);
    device_.reset();
    EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_),
              kernel_pinned_before_);
  }

  void StartDevice(const SoftwareDeviceOptions& options) {
    if (device_ != nullptr) {
      for (PdId pd : std::exchange(pds_, {})) {
        ASSERT_TRUE(device_->DeallocatePd(pd).ok());
      }
      device_.reset();
    }
    absl::StatusOr<std::unique_ptr<SoftwareDevice>> device =
        SoftwareDevice::Create(options);
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = std::move(*device);
    ASSERT_TRUE(device_->Start().ok());
  }

  PdId NewPd(RecordingSink** sink = nullptr) {
    sinks_.push_back(std::make_unique<RecordingSink>());
    absl::StatusOr<PdId> pd = device_->AllocatePd(sinks_.back().get());
    EXPECT_TRUE(pd.ok()) << pd.status();
    pds_.push_back(*pd);
    if (sink != nullptr) *sink = sinks_.back().get();
    return *pd;
  }

  MemfdBuffer& NewBuffer(uint64_t pages, uint8_t seed = 1) {
    buffers_.push_back(MemfdBuffer::Create(pages, seed));
    EXPECT_NE(buffers_.back(), nullptr);
    return *buffers_.back();
  }

  absl::StatusOr<std::unique_ptr<SoftPeer>> TryConnect(PdId pd) {
    MRD_ASSIGN_OR_RETURN(std::string ticket, device_->CreatePeerTicket(pd));
    return SoftPeer::Connect(device_->Attributes().peer_address, ticket);
  }
  std::unique_ptr<SoftPeer> Connect(PdId pd) {
    absl::StatusOr<std::unique_ptr<SoftPeer>> peer = TryConnect(pd);
    EXPECT_TRUE(peer.ok()) << peer.status();
    return peer.ok() ? std::move(*peer) : nullptr;
  }

  MrKeys Register(PdId pd, const MemfdBuffer& buffer, uint64_t offset,
                  uint64_t length, uint32_t access, uint64_t base = kBase) {
    absl::StatusOr<MrKeys> keys =
        device_->RegisterMr(pd, buffer.Span(offset, length), base, access);
    EXPECT_TRUE(keys.ok()) << keys.status();
    return keys.value_or(MrKeys{});
  }

  LogicalMapping Lam(PdId pd, const MemfdBuffer& buffer, uint64_t offset,
                     uint64_t length) {
    absl::StatusOr<LogicalMapping> lam =
        device_->BuildLam(pd, buffer.Span(offset, length));
    EXPECT_TRUE(lam.ok()) << lam.status();
    return lam.value_or(LogicalMapping{});
  }

  // A fast registration of `pages` at `base`, executed; returns the rkey.
  uint32_t FastRegister(ConnectionId connection, RecordingSink& sink, MrId mr,
                        std::vector<uint64_t> pages, uint32_t fbo,
                        uint64_t length, uint64_t base,
                        uint32_t access = kRemoteRw) {
    size_t before = sink.Completions().size();
    FastRegisterWork work;
    work.mr = mr;
    work.pages = std::move(pages);
    work.fbo = fbo;
    work.length = length;
    work.base_address = base;
    work.access = access;
    work.request_context = 1000 + before;
    absl::StatusOr<uint64_t> posted =
        device_->PostFastRegister(connection, work);
    EXPECT_TRUE(posted.ok()) << posted.status();
    EXPECT_TRUE(sink.WaitForCompletions(before + 1));
    WorkCompletion completion = sink.Completions().back();
    EXPECT_TRUE(completion.status.ok()) << completion.status;
    EXPECT_EQ(completion.request_context, work.request_context);
    return completion.rkey;
  }

  absl::StatusOr<uint64_t> Invalidate(ConnectionId connection, MrId mr,
                                      uint32_t flags, uint64_t context) {
    InvalidateWork work;
    work.mr = mr;
    work.flags = flags;
    work.request_context = context;
    return device_->PostInvalidate(connection, work);
  }

  // Declared before device_: the device goes first.
  std::vector<std::unique_ptr<RecordingSink>> sinks_;
  std::vector<std::unique_ptr<MemfdBuffer>> buffers_;
  std::unique_ptr<SoftwareDevice> device_;
  std::vector<PdId> pds_;
  uint64_t kernel_pinned_before_ = 0;
};

// ---------------------------------------------------------------------------
// Attributes and lifecycle.

TEST_F(SoftwareDeviceTest, AttributesDescribeTheSoftwareDevice) {
  const DeviceAttributes& attributes = device_->Attributes();
  EXPECT_EQ(attributes.kind, "software");
  EXPECT_EQ(attributes.name, "software");
  EXPECT_EQ(attributes.page_size, PageSize());
  EXPECT_EQ(attributes.max_mr_size, uint64_t{1} << 40);
  EXPECT_EQ(attributes.max_page_list_length, 4096u);
  EXPECT_EQ(attributes.adapter_flags, kAdapterFlagReadSinkNotRequired);
  EXPECT_THAT(attributes.peer_address, ::testing::StartsWith("127.0.0.1:"));
  EXPECT_NE(attributes.peer_address, "127.0.0.1:0");
  EXPECT_TRUE(device_->Health().healthy);
  EXPECT_THAT(
      device_->Start(),
      IsMrdError(absl::StatusCode::kFailedPrecondition, "ALREADY_STARTED"));
}

// The software devices of one mrd share their pins: a page registered on
// two devices is pinned once for the kernel, and stays pinned until the
// last of them lets it go; each device's keys work only on its own peer
// path.
TEST_F(SoftwareDeviceTest, DevicesThatSharePinsPinAPageOnce) {
  SoftwareDeviceOptions options;
  options.name = "software1";
  options.share_pins_with = device_.get();
  absl::StatusOr<std::unique_ptr<SoftwareDevice>> second =
      SoftwareDevice::Create(options);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE((*second)->Start().ok());
  RecordingSink second_sink;
  absl::StatusOr<PdId> second_pd = (*second)->AllocatePd(&second_sink);
  ASSERT_TRUE(second_pd.ok()) << second_pd.status();
  const PdId pd = NewPd();
  const MemfdBuffer& buffer = NewBuffer(8);
  const uint64_t size = 8 * PageSize();

  const MrKeys first_keys = Register(pd, buffer, 0, size, kRemoteRw);
  ASSERT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_ + size),
            kernel_pinned_before_ + size);
  absl::StatusOr<MrKeys> second_keys =
      (*second)->RegisterMr(*second_pd, buffer.Span(0, size), kBase, kRemoteRw);
  ASSERT_TRUE(second_keys.ok()) << second_keys.status();
  EXPECT_EQ(test_support::KernelPinnedBytes(), kernel_pinned_before_ + size);
  EXPECT_EQ((*second)->PinnedBytes(), size);

  ASSERT_TRUE(device_->DeregisterMr(first_keys.mr).ok());
  // The second device still holds the pages, pinned, and serves them.
  EXPECT_EQ(device_->PinnedBytes(), size);
  EXPECT_EQ(test_support::KernelPinnedBytes(), kernel_pinned_before_ + size);
  absl::StatusOr<std::string> ticket = (*second)->CreatePeerTicket(*second_pd);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  absl::StatusOr<std::unique_ptr<SoftPeer>> peer =
      SoftPeer::Connect((*second)->Attributes().peer_address, *ticket);
  ASSERT_TRUE(peer.ok()) << peer.status();
  absl::StatusOr<std::string> read =
      (*peer)->Read(second_keys->rkey, kBase, 16);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, buffer.Bytes(0, 16));

  ASSERT_TRUE((*second)->DeregisterMr(second_keys->mr).ok());
  EXPECT_EQ((*second)->PinnedBytes(), 0u);
  ASSERT_TRUE((*second)->DeallocatePd(*second_pd).ok());
  second->reset();
}

TEST_F(SoftwareDeviceTest, BadOptionsAreRefused) {
  SoftwareDeviceOptions options;
  options.max_keys = 0;
  EXPECT_THAT(SoftwareDevice::Create(options).status(),
              IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_OPTION"));
  options = SoftwareDeviceOptions{};
  options.peer_listen_address = "nowhere";
  EXPECT_THAT(SoftwareDevice::Create(options).status(),
              IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_HOST_PORT"));
}

TEST_F(SoftwareDeviceTest, ShutdownClosesPeersAndIsIdempotent) {
  RecordingSink* sink;
  PdId pd = NewPd(&sink);
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, 64, kRemoteRw);
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  ASSERT_TRUE(peer->Read(keys.rkey, kBase, 8).ok());
  device_->Shutdown();
  EXPECT_THAT(peer->Read(keys.rkey, kBase, 8).status(), IsGone());
  EXPECT_EQ(sink->CountOf(Event::Kind::kDisconnected), 1u);
  EXPECT_FALSE(device_->Health().healthy);
  device_->Shutdown();
  EXPECT_THAT(TryConnect(pd).status(), IsGone());
}

TEST_F(SoftwareDeviceTest, ConnectionsOverTheLimitAreClosedOnAccept) {
  SoftwareDeviceOptions options;
  options.max_connections = 1;
  StartDevice(options);
  RecordingSink* sink;
  PdId pd = NewPd(&sink);
  std::unique_ptr<SoftPeer> first = Connect(pd);
  EXPECT_THAT(TryConnect(pd).status(), IsGone());
  first.reset();
  ASSERT_TRUE(sink->WaitFor(Event::Kind::kDisconnected, 1));
  // The slot frees once the listener has seen the first one close.
  absl::StatusOr<std::unique_ptr<SoftPeer>> second = TryConnect(pd);
  for (int i = 0; i < 100 && !second.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    second = TryConnect(pd);
  }
  EXPECT_TRUE(second.ok()) << second.status();
}

// ---------------------------------------------------------------------------
// Peer path under hostile peers (docs/RELIABILITY.md, "Peer path").

// True when the other end has closed `fd` (EOF or reset) within `limit`.
bool ClosedWithin(int fd, absl::Duration limit) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    char byte;
    ssize_t n = ::recv(fd, &byte, 1, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

// The listener publishes its stats once per reactor round, which may come
// just after a peer saw the effect: polls `holds` for up to 3 s.
template <typename Fn>
bool StatsSoon(const SoftwareDevice& device, Fn holds) {
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  while (!holds(device.PeerStats())) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}
using PeerPathStats = SoftwareDevice::PeerPathStats;

// A raw connection that has said hello with a valid ticket.
UniqueFd HelloConnection(SoftwareDevice& device, PdId pd) {
  absl::StatusOr<std::string> ticket = device.CreatePeerTicket(pd);
  EXPECT_TRUE(ticket.ok()) << ticket.status();
  absl::StatusOr<UniqueFd> fd =
      mrd::peer::ConnectTcp(device.Attributes().peer_address);
  EXPECT_TRUE(fd.ok()) << fd.status();
  if (!fd.ok() || !ticket.ok()) return UniqueFd();
  v1::PeerRequest hello;
  hello.mutable_hello()->set_ticket(*ticket);
  EXPECT_TRUE(mrd::peer::WriteFrame(fd->get(), hello).ok());
  v1::PeerResponse response;
  EXPECT_TRUE(mrd::peer::ReadFrame(fd->get(), 4096, &response).ok());
  EXPECT_EQ(response.status(), v1::PEER_SUCCESS);
  return std::move(*fd);
}

TEST_F(SoftwareDeviceTest, StartReportsAThreadThatCannotBeCreated) {
  // Threads: the device worker, each peer worker, the peer reactor. Each
  // failing is a Status from Start, never an abort, and the device is then
  // shut down cleanly (no thread left behind, no peer admitted).
  const absl::Status injected = absl::ResourceExhaustedError("no threads");
  for (int nth = 1; nth <= 4; ++nth) {
    FaultPoints faults;
    SoftwareDeviceOptions options;
    options.peer_workers = 2;
    options.fault_points = &faults;
    absl::StatusOr<std::unique_ptr<SoftwareDevice>> device =
        SoftwareDevice::Create(options);
    ASSERT_TRUE(device.ok()) << device.status();
    faults.Arm(nth, injected);
    EXPECT_EQ((*device)->Start(), injected) << "thread " << nth;
    EXPECT_EQ(faults.FiredStep(), "thread.create");
    EXPECT_FALSE((*device)->Health().healthy);
    EXPECT_EQ((*device)->PeerStats().listener.threads, 0u);
  }
}

TEST_F(SoftwareDeviceTest, ThreadCountDoesNotGrowWithConnections) {
  SoftwareDeviceOptions options;
  options.peer_workers = 2;
  StartDevice(options);
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, 64, kRemoteRw);
  std::vector<std::unique_ptr<SoftPeer>> peers;
  for (int i = 0; i < 64; ++i) peers.push_back(Connect(pd));
  for (auto& peer : peers) ASSERT_TRUE(peer->Read(keys.rkey, kBase, 8).ok());
  EXPECT_EQ(device_->PeerStats().listener.threads, 3u);  // reactor + 2
  EXPECT_TRUE(StatsSoon(*device_, [](const PeerPathStats& s) {
    return s.listener.connections == 64 && s.listener.unauthenticated == 0;
  }));
}

TEST_F(SoftwareDeviceTest, HelloDeadlineClosesSilentConnections) {
  SoftwareDeviceOptions options;
  options.peer_hello_timeout = absl::Milliseconds(300);
  StartDevice(options);
  absl::StatusOr<UniqueFd> idle =
      mrd::peer::ConnectTcp(device_->Attributes().peer_address);
  ASSERT_TRUE(idle.ok()) << idle.status();
  EXPECT_TRUE(ClosedWithin(idle->get(), absl::Seconds(3)));
  EXPECT_TRUE(StatsSoon(*device_, [](const PeerPathStats& s) {
    return s.listener.hello_timeouts == 1;
  }));
  // A peer that said hello is never subject to it.
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, 64, kRemoteRw);
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  absl::SleepFor(absl::Milliseconds(600));
  EXPECT_TRUE(peer->Read(keys.rkey, kBase, 8).ok());
}

TEST_F(SoftwareDeviceTest, UnauthenticatedCapShedsTheOldestForAValidPeer) {
  SoftwareDeviceOptions options;
  options.max_unauthenticated_connections = 3;
  StartDevice(options);
  std::vector<UniqueFd> strangers;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<UniqueFd> fd =
        mrd::peer::ConnectTcp(device_->Attributes().peer_address);
    ASSERT_TRUE(fd.ok()) << fd.status();
    strangers.push_back(std::move(*fd));
  }
  ASSERT_FALSE(ClosedWithin(strangers[0].get(), absl::Milliseconds(1)));
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, 64, kRemoteRw);
  std::unique_ptr<SoftPeer> peer = Connect(pd);  // sheds strangers[0]
  ASSERT_NE(peer, nullptr);
  EXPECT_TRUE(peer->Read(keys.rkey, kBase, 8).ok());
  EXPECT_TRUE(ClosedWithin(strangers[0].get(), absl::Seconds(2)));
  EXPECT_FALSE(ClosedWithin(strangers[2].get(), absl::Milliseconds(50)));
  EXPECT_TRUE(StatsSoon(
      *device_, [](const PeerPathStats& s) { return s.listener.shed >= 1; }));
}

TEST_F(SoftwareDeviceTest, TotalCapRefusesOnlyWhenNobodyCanBeShed) {
  SoftwareDeviceOptions options;
  options.max_connections = 2;
  StartDevice(options);
  PdId pd = NewPd();
  std::unique_ptr<SoftPeer> a = Connect(pd);
  absl::StatusOr<UniqueFd> stranger =
      mrd::peer::ConnectTcp(device_->Attributes().peer_address);
  ASSERT_TRUE(stranger.ok());
  std::unique_ptr<SoftPeer> b = Connect(pd);  // sheds the stranger
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(ClosedWithin(stranger->get(), absl::Seconds(2)));
  EXPECT_THAT(TryConnect(pd).status(), IsGone());  // both past hello
  EXPECT_TRUE(StatsSoon(*device_, [](const PeerPathStats& s) {
    return s.listener.refused >= 1;
  }));
}

TEST_F(SoftwareDeviceTest, SessionConnectionCapRefusesHelloWithTheLimit) {
  SoftwareDeviceOptions options;
  options.max_session_connections = 2;
  StartDevice(options);
  PdId pd = NewPd();
  std::unique_ptr<SoftPeer> a = Connect(pd);
  std::unique_ptr<SoftPeer> b = Connect(pd);
  EXPECT_THAT(TryConnect(pd).status(),
              IsMrdError(absl::StatusCode::kResourceExhausted,
                         "LIMIT_PEER_CONNECTIONS"));
  EXPECT_NE(Connect(NewPd()), nullptr);  // another session is not affected
  EXPECT_EQ(device_->PeerStats().session_limit_refusals, 1u);
  b.reset();  // a slot frees once the device has seen the close
  absl::StatusOr<std::unique_ptr<SoftPeer>> c = TryConnect(pd);
  for (int i = 0; i < 100 && !c.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    c = TryConnect(pd);
  }
  EXPECT_TRUE(c.ok()) << c.status();
}

TEST_F(SoftwareDeviceTest, StalledFrameIsClosedAndCommitsNoMemory) {
  SoftwareDeviceOptions options;
  options.peer_stall_timeout = absl::Milliseconds(300);
  StartDevice(options);
  PdId pd = NewPd();
  UniqueFd fd = HelloConnection(*device_, pd);
  ASSERT_TRUE(fd.valid());
  // A header announcing 16 MiB and 10 bytes of body, then silence.
  const uint32_t length = 16u << 20;
  char frame[14] = {};
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>(length >> (8 * i));
  ASSERT_EQ(::send(fd.get(), frame, sizeof(frame), MSG_NOSIGNAL), 14);
  absl::SleepFor(absl::Milliseconds(100));
  // Charged: what arrived rounded up to one growth step, not 16 MiB.
  EXPECT_LE(device_->PeerStats().listener.buffered_bytes, 64u << 10);
  EXPECT_TRUE(ClosedWithin(fd.get(), absl::Seconds(3)));
  EXPECT_TRUE(StatsSoon(*device_, [](const PeerPathStats& s) {
    return s.listener.stall_timeouts == 1 && s.listener.buffered_bytes == 0;
  }));
}

TEST_F(SoftwareDeviceTest, BufferBudgetHoldsFramesBackUntilMemoryFrees) {
  // Budget for one largest frame and a hello: a second large frame waits
  // unread until the first is handled, and then goes through.
  SoftwareDeviceOptions options;
  options.max_message_size = 256 << 10;
  options.peer_buffer_bytes = (256 << 10) + 1024 + 4096;
  StartDevice(options);
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer((256 << 10) / PageSize());
  MrKeys keys = Register(pd, buffer, 0, 256 << 10, kRemoteRw);
  std::unique_ptr<SoftPeer> a = Connect(pd);
  std::unique_ptr<SoftPeer> b = Connect(pd);
  std::string data(256 << 10, 'x');
  std::atomic<int> ok{0};
  std::thread ta([&] { ok += a->Write(keys.rkey, kBase, data).ok(); });
  std::thread tb([&] { ok += b->Write(keys.rkey, kBase, data).ok(); });
  ta.join();
  tb.join();
  EXPECT_EQ(ok.load(), 2);
  EXPECT_EQ(device_->PeerStats().listener.max_buffer_bytes,
            options.peer_buffer_bytes);
  EXPECT_TRUE(StatsSoon(*device_, [](const PeerPathStats& s) {
    return s.listener.buffered_bytes == 0;
  }));
}

// ---------------------------------------------------------------------------
// Registration and pinning.

TEST_F(SoftwareDeviceTest, OverlappingRegistrationsPinEachPageOnce) {
  const uint64_t ps = PageSize();
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(6);
  MrKeys a = Register(pd, buffer, 0, 4 * ps, kAccessRemoteRead);
  MrKeys b = Register(pd, buffer, 2 * ps, 4 * ps, kAccessRemoteRead);
  EXPECT_EQ(device_->PinnedBytes(), 6 * ps);
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_ + 6 * ps) -
                kernel_pinned_before_,
            6 * ps);

  ASSERT_TRUE(device_->DeregisterMr(a.mr).ok());
  // Pages 2-5 stay locked for b: mlock is not counted by the kernel.
  EXPECT_EQ(device_->PinnedBytes(), 4 * ps);
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_ + 4 * ps) -
                kernel_pinned_before_,
            4 * ps);

  ASSERT_TRUE(device_->DeregisterMr(b.mr).ok());
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_),
            kernel_pinned_before_);
}

TEST_F(SoftwareDeviceTest, SameRangeRegisteredTwiceStaysPinnedUntilBothGo) {
  const uint64_t ps = PageSize();
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(2);
  MrKeys a = Register(pd, buffer, 10, ps, kAccessRemoteRead);
  MrKeys b = Register(pd, buffer, 10, ps, kAccessRemoteRead);
  EXPECT_NE(a.rkey, b.rkey);
  EXPECT_EQ(device_->PinnedBytes(), 2 * ps);  // 10 + ps straddles two pages
  ASSERT_TRUE(device_->DeregisterMr(b.mr).ok());
  EXPECT_EQ(device_->PinnedBytes(), 2 * ps);
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_ + 2 * ps) -
                kernel_pinned_before_,
            2 * ps);
  ASSERT_TRUE(device_->DeregisterMr(a.mr).ok());
  EXPECT_THAT(device_->DeregisterMr(a.mr),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR"));
}

TEST_F(SoftwareDeviceTest, RegisterMrValidatesItsArguments) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MemorySpan span = buffer.Span(0, 100);
  EXPECT_THAT(
      device_->RegisterMr(pd, span, 0, kAccessRemoteRead).status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "ZERO_BASED_ADDRESS"));
  EXPECT_THAT(device_->RegisterMr(pd, buffer.Span(0, 0), kBase, 0).status(),
              IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "ZERO_LENGTH"));
  EXPECT_THAT(
      device_->RegisterMr(pd, span, kBase, 0x100).status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_ACCESS_BITS"));
  EXPECT_THAT(
      device_->RegisterMr(pd, span, UINT64_MAX - 10, 0).status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "BASE_ADDRESS_OVERFLOW"));
  MemorySpan huge = span;
  huge.length = (uint64_t{1} << 40) + 1;
  EXPECT_THAT(
      device_->RegisterMr(pd, huge, kBase, 0).status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "LENGTH_OVER_MAX_MR_SIZE"));
  MemorySpan no_fd = span;
  no_fd.fd = -1;
  EXPECT_THAT(device_->RegisterMr(pd, no_fd, kBase, 0).status(),
              IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "INVALID_SPAN"));
  EXPECT_THAT(device_->RegisterMr(pd + 1000, span, kBase, 0).status(),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD"));
  EXPECT_EQ(device_->PinnedBytes(), 0u);
}

TEST_F(SoftwareDeviceTest, PinFailureIsInsufficientResourcesAndPinsNothing) {
  const uint64_t ps = PageSize();
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(3);
  // Pages 1-2 of the mapping now lie beyond the end of the file: mlock
  // fails on them (ENOMEM), after locking the whole range in the kernel.
  ASSERT_EQ(ftruncate(buffer.fd(), static_cast<off_t>(ps)), 0);
  EXPECT_THAT(
      device_->RegisterMr(pd, buffer.Span(0, 3 * ps), kBase, 0).status(),
      IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED"));
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_),
            kernel_pinned_before_);
}

// ---------------------------------------------------------------------------
// Keys.

TEST_F(SoftwareDeviceTest, KeyByteChangesEveryTimeASlotIsReused) {
  SoftwareDeviceOptions options;
  options.max_keys = 1;  // every registration reuses the same slot
  StartDevice(options);
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys previous = Register(pd, buffer, 0, 64, kAccessRemoteRead);
  EXPECT_EQ(previous.lkey, previous.rkey);
  EXPECT_EQ(previous.rkey >> 8, 1u);
  EXPECT_THAT(
      device_->RegisterMr(pd, buffer.Span(0, 64), kBase, 0).status(),
      IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED"));
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE(device_->DeregisterMr(previous.mr).ok());
    MrKeys next = Register(pd, buffer, 0, 64, kAccessRemoteRead);
    EXPECT_EQ(next.rkey >> 8, previous.rkey >> 8);
    EXPECT_NE(next.rkey & 0xff, previous.rkey & 0xff) << "iteration " << i;
    previous = next;
  }
}

// Issue 8 item 5: the key table had 65,536 slots, as many as one session's
// registrations, so one session took every key. The default key space now
// covers the core's global limits: one PD holding a whole session's worth
// (65,536) leaves keys for everyone else, and the table grew only as used.
TEST_F(SoftwareDeviceTest,
       OnePdHoldingASessionsWorthOfKeysLeavesKeysForOthers) {
  constexpr size_t kSessionRegistrations = 65536;  // the core's default cap
  PdId greedy = NewPd();
  PdId bystander = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  std::vector<MrId> mrs;
  mrs.reserve(kSessionRegistrations);
  for (size_t i = 0; i < kSessionRegistrations; ++i) {
    absl::StatusOr<MrKeys> keys = device_->RegisterMr(
        greedy, buffer.Span(0, 64), kBase, kAccessRemoteRead);
    ASSERT_TRUE(keys.ok()) << "registration " << i << ": " << keys.status();
    mrs.push_back(keys->mr);
  }
  for (int i = 0; i < 1000; ++i) {
    absl::StatusOr<MrKeys> keys = device_->RegisterMr(
        bystander, buffer.Span(0, 64), kBase, kAccessRemoteRead);
    ASSERT_TRUE(keys.ok()) << "bystander " << i << ": " << keys.status();
  }
  absl::StatusOr<LogicalMapping> lam =
      device_->BuildLam(bystander, buffer.Span(0, 64));
  EXPECT_TRUE(lam.ok()) << lam.status();
  SoftwareDevice::ResourceCounts counts = device_->CountResources();
  EXPECT_EQ(counts.keys, kSessionRegistrations + 1001);
  // Lazy: grown in 64 Ki chunks, nowhere near the 1.5 Mi capacity.
  EXPECT_LE(counts.key_slots_grown, counts.keys + 2 * 65536);
  EXPECT_LT(counts.key_slots_grown, kDefaultMaxKeys / 4);
  for (MrId mr : mrs) ASSERT_TRUE(device_->DeregisterMr(mr).ok());
}

// With a small key space (slots = N), keys run out at exactly N across all
// PDs, and what one PD gives back another PD gets.
TEST_F(SoftwareDeviceTest, KeySpaceIsSharedAndExhaustsAtItsCapacity) {
  SoftwareDeviceOptions options;
  options.max_keys = 300;
  options.key_chunk_slots = 64;  // several growth steps
  StartDevice(options);
  PdId a = NewPd();
  PdId b = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  std::vector<MrId> a_mrs;
  std::set<uint32_t> keys;
  for (int i = 0; i < 200; ++i) {
    MrKeys k = Register(a, buffer, 0, 64, kAccessRemoteRead);
    a_mrs.push_back(k.mr);
    keys.insert(k.rkey);
  }
  for (int i = 0; i < 100; ++i) {
    keys.insert(Register(b, buffer, 0, 64, kAccessRemoteRead).rkey);
  }
  EXPECT_EQ(keys.size(), 300u);
  for (uint32_t key : keys) {
    EXPECT_GE(key >> 8, 1u);
    EXPECT_LE(key >> 8, 300u);
  }
  EXPECT_THAT(
      device_->RegisterMr(b, buffer.Span(0, 64), kBase, 0).status(),
      IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED"));
  EXPECT_THAT(
      device_->AllocateFastRegisterMr(b, true, 1).status(),
      IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED"));
  ASSERT_TRUE(device_->DeregisterMr(a_mrs.back()).ok());
  EXPECT_TRUE(device_->RegisterMr(b, buffer.Span(0, 64), kBase, 0).ok());
  EXPECT_EQ(device_->CountResources().key_slots_grown, 300u);
}

TEST_F(SoftwareDeviceTest, RkeysAreNotSequential) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  std::vector<uint32_t> rkeys;
  for (int i = 0; i < 16; ++i) {
    rkeys.push_back(Register(pd, buffer, 0, 64, kAccessRemoteRead).rkey);
  }
  EXPECT_EQ(std::set<uint32_t>(rkeys.begin(), rkeys.end()).size(), 16u);
  int neighbours = 0;
  for (size_t i = 1; i < rkeys.size(); ++i) {
    EXPECT_GE(rkeys[i], 256u);
    uint32_t step = rkeys[i] - rkeys[i - 1];
    neighbours +=
        (step == 1 || step == 256 || (rkeys[i] >> 8) == (rkeys[i - 1] >> 8) + 1)
            ? 1
            : 0;
  }
  EXPECT_LT(neighbours, 5);
}

// ---------------------------------------------------------------------------
// The peer data path.

TEST_F(SoftwareDeviceTest, PeerReadReturnsTheMemfdContents) {
  const uint64_t ps = PageSize();
  RecordingSink* sink;
  PdId pd = NewPd(&sink);
  MemfdBuffer& buffer = NewBuffer(3);
  MrKeys keys = Register(pd, buffer, ps + 100, ps, kAccessRemoteRead);
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  absl::StatusOr<std::string> data = peer->Read(keys.rkey, kBase + 10, 300);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, buffer.Bytes(ps + 110, 300));
  // Changes to the memory show up in the next READ.
  buffer.data()[ps + 110] = 'Z';
  EXPECT_EQ(peer->Read(keys.rkey, kBase + 10, 1).value_or(""), "Z");
  ASSERT_TRUE(sink->WaitFor(Event::Kind::kConnected, 1));
  EXPECT_EQ(sink->Events().front().connection, peer->connection_id());
  EXPECT_THAT(sink->last_peer(), ::testing::StartsWith("127.0.0.1:"));
}

TEST_F(SoftwareDeviceTest, PeerWriteShowsUpInTheMemfdMapping) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(2);
  MrKeys keys = Register(pd, buffer, 0, 2 * PageSize(), kRemoteRw);
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  std::string data(PageSize() + 7, 'w');
  data[0] = 'A';
  ASSERT_TRUE(peer->Write(keys.rkey, kBase + 5, data).ok());
  EXPECT_EQ(buffer.Bytes(5, data.size()), data);
}

TEST_F(SoftwareDeviceTest, BoundsAreEnforcedToTheByte) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, 1000, kRemoteRw);
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  EXPECT_TRUE(peer->Read(keys.rkey, kBase + 990, 10).ok());  // last 10 bytes
  EXPECT_TRUE(peer->Write(keys.rkey, kBase + 999, "x").ok());
  EXPECT_THAT(peer->Read(keys.rkey, kBase + 990, 11).status(), IsAccessError());

  peer = Connect(pd);
  EXPECT_THAT(peer->Write(keys.rkey, kBase + 1000, "x"), IsAccessError());
  peer = Connect(pd);
  EXPECT_THAT(peer->Read(keys.rkey, kBase - 1, 2).status(), IsAccessError());
  peer = Connect(pd);
  // address + length wraps around 2^64: still refused.
  EXPECT_THAT(peer->Read(keys.rkey, UINT64_MAX - 3, 16).status(),
              IsAccessError());
  EXPECT_EQ(buffer.Bytes(999, 1), "x");
}

TEST_F(SoftwareDeviceTest, ReadOnlyRegionRefusesWriteAndWriteOnlyRefusesRead) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  std::string original = buffer.Bytes(0, 16);
  MrKeys read_only = Register(pd, buffer, 0, 64, kAccessRemoteRead);
  MrKeys write_only =
      Register(pd, buffer, 0, 64, kAccessLocalWrite | kAccessRemoteWrite);
  MrKeys local_only = Register(pd, buffer, 0, 64, kAccessLocalWrite);
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  EXPECT_THAT(peer->Write(read_only.rkey, kBase, "nope"), IsAccessError());
  peer = Connect(pd);
  EXPECT_THAT(peer->Read(write_only.rkey, kBase, 4).status(), IsAccessError());
  peer = Connect(pd);
  EXPECT_THAT(peer->Read(local_only.rkey, kBase, 4).status(), IsAccessError());
  peer = Connect(pd);
  EXPECT_TRUE(peer->Write(write_only.rkey, kBase, "ok").ok());
  EXPECT_EQ(buffer.Bytes(0, 2), "ok");
  EXPECT_EQ(buffer.Bytes(2, 14), original.substr(2));
}

TEST_F(SoftwareDeviceTest, AnotherPdsConnectionIsRefused) {
  PdId mine = NewPd();
  PdId other = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(mine, buffer, 0, 64, kRemoteRw);
  std::unique_ptr<SoftPeer> stranger = Connect(other);
  absl::Status status = stranger->Read(keys.rkey, kBase, 8).status();
  EXPECT_THAT(status, IsAccessError());
  // The answer does not tell the stranger that the key exists elsewhere.
  EXPECT_THAT(std::string(status.message()),
              ::testing::HasSubstr("not valid on this connection"));
  EXPECT_TRUE(Connect(mine)->Read(keys.rkey, kBase, 8).ok());
}

TEST_F(SoftwareDeviceTest, AWrongKeyByteIsRefused) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, 64, kAccessRemoteRead);
  EXPECT_THAT(Connect(pd)->Read(keys.rkey ^ 0x01, kBase, 8).status(),
              IsAccessError());
  EXPECT_THAT(Connect(pd)->Read(keys.rkey ^ 0x80, kBase, 8).status(),
              IsAccessError());
  EXPECT_THAT(Connect(pd)->Read(0, kBase, 8).status(), IsAccessError());
}

TEST_F(SoftwareDeviceTest, DeregisterRevokesTheKeyBeforeItReturns) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, 64, kAccessRemoteRead);
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  ASSERT_TRUE(peer->Read(keys.rkey, kBase, 8).ok());
  ASSERT_TRUE(device_->DeregisterMr(keys.mr).ok());
  EXPECT_THAT(peer->Read(keys.rkey, kBase, 8).status(), IsAccessError());
}

// MR ids name a slot of the model's MR table (low 24 bits) and a sequence
// number: a new MR may take a freed slot, never a freed id, and the key of
// the MR that had the slot before reaches nothing.
TEST_F(SoftwareDeviceTest, AnMrThatReusesASlotGetsANewIdAndKey) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys first = Register(pd, buffer, 0, 64, kAccessRemoteRead);
  ASSERT_TRUE(device_->DeregisterMr(first.mr).ok());
  MrKeys second = Register(pd, buffer, 0, 64, kAccessRemoteRead);
  constexpr uint64_t kSlotMask = (uint64_t{1} << 24) - 1;
  EXPECT_EQ(second.mr & kSlotMask, first.mr & kSlotMask);
  EXPECT_NE(second.mr, first.mr);
  EXPECT_NE(second.rkey, first.rkey);
  EXPECT_THAT(device_->DeregisterMr(first.mr),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR"));
  EXPECT_THAT(device_->QueryMr(first.mr).status(),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR"));
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  EXPECT_THAT(peer->Read(first.rkey, kBase, 8).status(), IsAccessError());
  std::unique_ptr<SoftPeer> again = Connect(pd);
  EXPECT_EQ(*again->Read(second.rkey, kBase, 8), buffer.Bytes(0, 8));
}

TEST_F(SoftwareDeviceTest, DeregisterWaitsForAPeerReadInFlight) {
  Gate gate;
  SoftwareDeviceOptions options;
  options.peer_io_hook_for_test = [&gate] { gate.Pass(); };
  StartDevice(options);
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, 64, kAccessRemoteRead);
  std::unique_ptr<SoftPeer> peer = Connect(pd);

  absl::StatusOr<std::string> in_flight;
  std::thread reader([&] { in_flight = peer->Read(keys.rkey, kBase, 64); });
  gate.WaitEntered();  // the READ passed its checks and is inside the MR
  std::atomic<bool> deregistered{false};
  std::thread deregister([&] {
    EXPECT_TRUE(device_->DeregisterMr(keys.mr).ok());
    deregistered = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(deregistered) << "DeregisterMr returned with a READ inside";
  gate.Open();
  reader.join();
  deregister.join();
  ASSERT_TRUE(in_flight.ok()) << in_flight.status();
  EXPECT_EQ(*in_flight, buffer.Bytes(0, 64));
  EXPECT_THAT(peer->Read(keys.rkey, kBase, 64).status(), IsAccessError());
}

TEST_F(SoftwareDeviceTest, TruncatedBackingFileIsAnAccessErrorNotSigbus) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(2);
  MrKeys keys = Register(pd, buffer, 0, 2 * PageSize(), kRemoteRw);
  ASSERT_EQ(ftruncate(buffer.fd(), 0), 0);
  EXPECT_THAT(Connect(pd)->Read(keys.rkey, kBase, 16).status(),
              IsAccessError());
  EXPECT_THAT(Connect(pd)->Write(keys.rkey, kBase, "data"), IsAccessError());
  // The write did not grow the file back.
  EXPECT_EQ(lseek(buffer.fd(), 0, SEEK_END), 0);
  ASSERT_EQ(ftruncate(buffer.fd(), static_cast<off_t>(buffer.size())), 0);
}

TEST_F(SoftwareDeviceTest, BadTicketIsUnauthenticated) {
  PdId pd = NewPd();
  absl::StatusOr<std::string> ticket = device_->CreatePeerTicket(pd);
  ASSERT_TRUE(ticket.ok());
  EXPECT_EQ(ticket->size(), 32u);  // 128 bits, hex
  EXPECT_NE(*ticket, *device_->CreatePeerTicket(pd));
  const std::string& address = device_->Attributes().peer_address;
  EXPECT_THAT(SoftPeer::Connect(address, "not-a-ticket").status(),
              IsMrdError(absl::StatusCode::kUnauthenticated, "BAD_TICKET"));
  EXPECT_TRUE(SoftPeer::Connect(address, *ticket).ok());
  ASSERT_TRUE(device_->DeallocatePd(pd).ok());
  EXPECT_THAT(SoftPeer::Connect(address, *ticket).status(),
              IsMrdError(absl::StatusCode::kUnauthenticated, "BAD_TICKET"));
}

TEST_F(SoftwareDeviceTest, AnAccessErrorClosesTheConnection) {
  RecordingSink* sink;
  PdId pd = NewPd(&sink);
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, 64, kAccessRemoteRead);
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  ASSERT_TRUE(peer->Read(keys.rkey, kBase, 8).ok());
  EXPECT_THAT(peer->Read(keys.rkey, kBase + 64, 1).status(), IsAccessError());
  // The very read that worked before now finds the connection gone.
  EXPECT_THAT(peer->Read(keys.rkey, kBase, 8).status(), IsGone());
  ASSERT_TRUE(sink->WaitFor(Event::Kind::kDisconnected, 1));
  std::vector<Event> events = sink->Events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Event::Kind::kConnected);
  EXPECT_EQ(events[1].kind, Event::Kind::kDisconnected);
  EXPECT_EQ(events[1].connection, peer->connection_id());
}

TEST_F(SoftwareDeviceTest, OverlongAndEmptyRequestsAreInvalidAndKeepTheLink) {
  SoftwareDeviceOptions options;
  options.max_message_size = 4096;
  StartDevice(options);
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(2);
  MrKeys keys = Register(pd, buffer, 0, 2 * PageSize(), kRemoteRw);
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  EXPECT_EQ(peer->max_message_size(), 4096u);
  auto invalid =
      IsMrdError(absl::StatusCode::kInvalidArgument, "REMOTE_INVALID_REQUEST");
  EXPECT_THAT(peer->Read(keys.rkey, kBase, 4097).status(), invalid);
  EXPECT_THAT(peer->Read(keys.rkey, kBase, 0).status(), invalid);
  EXPECT_THAT(peer->Write(keys.rkey, kBase, std::string(4097, 'x')), invalid);
  EXPECT_THAT(peer->Write(keys.rkey, kBase, ""), invalid);
  EXPECT_TRUE(peer->Read(keys.rkey, kBase, 4096).ok());
}

// The wire protocol as a hand-written peer speaks it.
class RawPeer {
 public:
  explicit RawPeer(const std::string& address)
      : fd_(std::move(*peer::ConnectTcp(address))) {}
  v1::PeerResponse Call(const v1::PeerRequest& request) {
    EXPECT_TRUE(peer::WriteFrame(fd_.get(), request).ok());
    return Receive();
  }
  v1::PeerResponse Receive() {
    v1::PeerResponse response;
    last_ = peer::ReadFrame(fd_.get(), 1 << 24, &response);
    return response;
  }
  void SendRaw(const std::string& bytes) {
    ASSERT_EQ(write(fd_.get(), bytes.data(), bytes.size()),
              static_cast<ssize_t>(bytes.size()));
  }
  const absl::Status& last() const { return last_; }

 private:
  UniqueFd fd_;
  absl::Status last_;
};

v1::PeerRequest Hello(uint64_t id, const std::string& ticket) {
  v1::PeerRequest request;
  request.set_id(id);
  request.mutable_hello()->set_ticket(ticket);
  return request;
}

TEST_F(SoftwareDeviceTest, WireProtocolRefusesMalformedRequests) {
  SoftwareDeviceOptions options;
  options.max_message_size = 4096;
  StartDevice(options);
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(2);
  MrKeys keys = Register(pd, buffer, 0, 2 * PageSize(), kRemoteRw);
  std::string ticket = *device_->CreatePeerTicket(pd);
  const std::string& address = device_->Attributes().peer_address;

  {  // A READ before hello: invalid, then closed.
    RawPeer raw(address);
    v1::PeerRequest read;
    read.set_id(5);
    read.mutable_read()->set_rkey(keys.rkey);
    read.mutable_read()->set_address(kBase);
    read.mutable_read()->set_length(8);
    v1::PeerResponse response = raw.Call(read);
    EXPECT_EQ(response.id(), 5u);
    EXPECT_EQ(response.status(), v1::PEER_REMOTE_INVALID_REQUEST);
    raw.Receive();
    EXPECT_THAT(raw.last(), IsMrdError(absl::StatusCode::kUnavailable,
                                       "PEER_CONNECTION_CLOSED"));
  }
  {  // Oversize WRITE within the frame limit, second hello, empty request:
     // each invalid, and the connection still serves a good READ after.
    RawPeer raw(address);
    v1::PeerResponse hello = raw.Call(Hello(1, ticket));
    ASSERT_EQ(hello.status(), v1::PEER_SUCCESS);
    EXPECT_NE(hello.connection(), 0u);
    EXPECT_EQ(hello.max_message_size(), 4096u);
    v1::PeerRequest write;
    write.set_id(2);
    write.mutable_write()->set_rkey(keys.rkey);
    write.mutable_write()->set_address(kBase);
    write.mutable_write()->set_data(std::string(4097, 'x'));
    v1::PeerResponse response = raw.Call(write);
    EXPECT_EQ(response.id(), 2u);
    EXPECT_EQ(response.status(), v1::PEER_REMOTE_INVALID_REQUEST);
    EXPECT_NE(buffer.Bytes(0, 1), "x");
    EXPECT_EQ(raw.Call(Hello(3, ticket)).status(),
              v1::PEER_REMOTE_INVALID_REQUEST);
    v1::PeerRequest empty;
    empty.set_id(4);
    EXPECT_EQ(raw.Call(empty).status(), v1::PEER_REMOTE_INVALID_REQUEST);
    v1::PeerRequest read;
    read.set_id(6);
    read.mutable_read()->set_rkey(keys.rkey);
    read.mutable_read()->set_address(kBase);
    read.mutable_read()->set_length(8);
    response = raw.Call(read);
    EXPECT_EQ(response.status(), v1::PEER_SUCCESS);
    EXPECT_EQ(response.data(), buffer.Bytes(0, 8));
  }
  {  // A frame over the limit: invalid, then closed.
    RawPeer raw(address);
    ASSERT_EQ(raw.Call(Hello(1, ticket)).status(), v1::PEER_SUCCESS);
    raw.SendRaw(std::string("\x00\x00\x10\x00", 4));  // 1 MiB announced
    EXPECT_EQ(raw.Receive().status(), v1::PEER_REMOTE_INVALID_REQUEST);
    raw.Receive();
    EXPECT_THAT(raw.last(), IsMrdError(absl::StatusCode::kUnavailable,
                                       "PEER_CONNECTION_CLOSED"));
  }
  {  // Before hello even a moderate frame is too large.
    RawPeer raw(address);
    raw.SendRaw(std::string("\x00\x20\x00\x00", 4));  // 8 KiB announced
    EXPECT_EQ(raw.Receive().status(), v1::PEER_REMOTE_INVALID_REQUEST);
  }
}

// ---------------------------------------------------------------------------
// Logical address mappings.

TEST_F(SoftwareDeviceTest, BuildLamMapsAlignedPagesWithFboAndReleaseUnpins) {
  const uint64_t ps = PageSize();
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(4);
  LogicalMapping lam = Lam(pd, buffer, ps + 100, 2 * ps);
  EXPECT_EQ(lam.fbo, 100u);
  ASSERT_EQ(lam.pages.size(), 3u);  // 100 + 2 pages reaches into a third
  for (uint64_t page : lam.pages) {
    EXPECT_NE(page, 0u);
    EXPECT_EQ(page % ps, 0u);
  }
  EXPECT_EQ(lam.pages[1], lam.pages[0] + ps);
  EXPECT_EQ(device_->PinnedBytes(), 3 * ps);
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_ + 3 * ps) -
                kernel_pinned_before_,
            3 * ps);

  LogicalMapping second = Lam(pd, buffer, 0, ps);
  EXPECT_EQ(second.fbo, 0u);
  ASSERT_EQ(second.pages.size(), 1u);
  EXPECT_GT(second.pages[0], lam.pages[2]);  // never overlapping
  EXPECT_EQ(device_->PinnedBytes(), 4 * ps);

  ASSERT_TRUE(device_->ReleaseLam(lam.lam).ok());
  EXPECT_EQ(device_->PinnedBytes(), ps);
  ASSERT_TRUE(device_->ReleaseLam(second.lam).ok());
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_),
            kernel_pinned_before_);
  EXPECT_THAT(device_->ReleaseLam(lam.lam),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_LAM"));
}

TEST_F(SoftwareDeviceTest, BuildLamThatFailsPartWayLeavesNothingPinned) {
  const uint64_t ps = PageSize();
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(4);
  MrKeys kept = Register(pd, buffer, 0, 2 * ps, kAccessRemoteRead);
  // Pages 0-1 are pinned already; pages 2-3 lie beyond the end of the file,
  // where mlock fails after locking them in the kernel.
  ASSERT_EQ(ftruncate(buffer.fd(), static_cast<off_t>(2 * ps)), 0);
  EXPECT_THAT(device_->BuildLam(pd, buffer.Span(0, 4 * ps)).status(),
              IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED"));
  // L7: the LAM left nothing behind, and the registration keeps its pages.
  EXPECT_EQ(device_->PinnedBytes(), 2 * ps);
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_ + 2 * ps) -
                kernel_pinned_before_,
            2 * ps);
  ASSERT_TRUE(device_->DeregisterMr(kept.mr).ok());
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_),
            kernel_pinned_before_);
}

TEST_F(SoftwareDeviceTest, BuildLamRefusesASpanWhosePagesDoNotLineUp) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(2);
  MemorySpan span = buffer.Span(0, 100);
  span.file_offset = 8;
  EXPECT_THAT(device_->BuildLam(pd, span).status(),
              IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "SPAN_MISALIGNED"));
  EXPECT_EQ(device_->PinnedBytes(), 0u);
}

// ---------------------------------------------------------------------------
// Fast registration.

class FastRegisterTest : public SoftwareDeviceTest {
 protected:
  void SetUp() override {
    SoftwareDeviceTest::SetUp();
    pd_ = NewPd(&sink_);
    buffer_ = &NewBuffer(4);
    lam_ = Lam(pd_, *buffer_, 0, 4 * PageSize());
    absl::StatusOr<MrKeys> mr = device_->AllocateFastRegisterMr(pd_, true, 8);
    ASSERT_TRUE(mr.ok()) << mr.status();
    mr_ = *mr;
    peer_ = Connect(pd_);
    ASSERT_NE(peer_, nullptr);
    connection_ = peer_->connection_id();
  }
  void TearDown() override {
    peer_.reset();
    SoftwareDeviceTest::TearDown();
  }

  FastRegisterWork Work(std::vector<uint64_t> pages, uint64_t length,
                        uint64_t base = kBase, uint32_t flags = 0,
                        uint64_t context = 1) {
    FastRegisterWork work;
    work.mr = mr_.mr;
    work.pages = std::move(pages);
    work.length = length;
    work.base_address = base;
    work.access = kRemoteRw;
    work.flags = flags;
    work.request_context = context;
    return work;
  }

  PdId pd_ = 0;
  RecordingSink* sink_ = nullptr;
  MemfdBuffer* buffer_ = nullptr;
  LogicalMapping lam_;
  MrKeys mr_;
  std::unique_ptr<SoftPeer> peer_;
  ConnectionId connection_ = 0;
};

TEST_F(FastRegisterTest, FreeMrObjectGrantsNoAccess) {
  EXPECT_THAT(peer_->Read(mr_.rkey, kBase, 8).status(), IsAccessError());
}

TEST_F(FastRegisterTest, PeerReachesThePagesThroughThePageArray) {
  const uint64_t ps = PageSize();
  // Pages need not be consecutive: VA page 0 is host page 3, VA page 1 is
  // host page 1.
  uint32_t rkey =
      FastRegister(connection_, *sink_, mr_.mr, {lam_.pages[3], lam_.pages[1]},
                   0, 2 * ps, kBase);
  EXPECT_NE(rkey, mr_.rkey);
  EXPECT_EQ(rkey >> 8, mr_.rkey >> 8);
  EXPECT_EQ(device_->QueryMr(mr_.mr)->rkey, rkey);
  absl::StatusOr<std::string> data = peer_->Read(rkey, kBase + ps - 8, 16);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, buffer_->Bytes(4 * ps - 8, 8) + buffer_->Bytes(ps, 8));
  ASSERT_TRUE(peer_->Write(rkey, kBase + ps - 4, "ABCDEFGH").ok());
  EXPECT_EQ(buffer_->Bytes(4 * ps - 4, 4), "ABCD");
  EXPECT_EQ(buffer_->Bytes(ps, 4), "EFGH");
  EXPECT_THAT(peer_->Read(rkey, kBase + 2 * ps - 4, 5).status(),
              IsAccessError());
}

TEST_F(FastRegisterTest, FirstByteOffsetShiftsTheRegionIntoItsFirstPage) {
  const uint64_t ps = PageSize();
  LogicalMapping offset_lam = Lam(pd_, *buffer_, 100, 2 * ps);
  uint32_t rkey = FastRegister(connection_, *sink_, mr_.mr, offset_lam.pages,
                               offset_lam.fbo, 2 * ps, kBase + 100);
  absl::StatusOr<std::string> data = peer_->Read(rkey, kBase + 100, 2 * ps);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, buffer_->Bytes(100, 2 * ps));
}

TEST_F(FastRegisterTest, LamCannotBeReleasedWhileFastRegistered) {
  FastRegister(connection_, *sink_, mr_.mr, {lam_.pages[0]}, 0, 64, kBase);
  EXPECT_THAT(device_->ReleaseLam(lam_.lam),
              IsMrdError(absl::StatusCode::kFailedPrecondition, "LAM_IN_USE"));
  ASSERT_TRUE(Invalidate(connection_, mr_.mr, 0, 2).ok());
  ASSERT_TRUE(sink_->WaitForCompletions(2));
  EXPECT_TRUE(device_->ReleaseLam(lam_.lam).ok());
}

TEST_F(FastRegisterTest, InvalidateRevokesAndReRegistrationDrawsANewRkey) {
  uint32_t first =
      FastRegister(connection_, *sink_, mr_.mr, {lam_.pages[0]}, 0, 64, kBase);
  ASSERT_TRUE(peer_->Read(first, kBase, 8).ok());
  absl::StatusOr<uint64_t> posted = Invalidate(connection_, mr_.mr, 0, 77);
  ASSERT_TRUE(posted.ok()) << posted.status();
  ASSERT_TRUE(sink_->WaitForCompletions(2));
  WorkCompletion done = sink_->Completions().back();
  EXPECT_EQ(done.kind, WorkCompletion::Kind::kInvalidate);
  EXPECT_EQ(done.request_context, 77u);
  EXPECT_EQ(done.work_request, *posted);
  EXPECT_EQ(done.mr, mr_.mr);
  EXPECT_TRUE(done.status.ok()) << done.status;
  // Completion delivered: the old rkey is dead.
  EXPECT_THAT(peer_->Read(first, kBase, 8).status(), IsAccessError());

  std::unique_ptr<SoftPeer> peer = Connect(pd_);
  uint32_t second = FastRegister(peer->connection_id(), *sink_, mr_.mr,
                                 {lam_.pages[1]}, 0, 64, kBase);
  EXPECT_NE(second, first);
  EXPECT_EQ(second >> 8, first >> 8);
  EXPECT_EQ(*peer->Read(second, kBase, 8), buffer_->Bytes(PageSize(), 8));
  EXPECT_THAT(peer->Read(first, kBase, 8).status(), IsAccessError());
}

TEST_F(FastRegisterTest, FastRegisteringAValidMrFailsWithMrNotFree) {
  FastRegister(connection_, *sink_, mr_.mr, {lam_.pages[0]}, 0, 64, kBase);
  uint32_t rkey = device_->QueryMr(mr_.mr)->rkey;
  ASSERT_TRUE(
      device_->PostFastRegister(connection_, Work({lam_.pages[1]}, 64)).ok());
  ASSERT_TRUE(sink_->WaitForCompletions(2));
  EXPECT_THAT(sink_->Completions().back().status,
              IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "MR_NOT_FREE"));
  // The mapping in place is untouched.
  EXPECT_EQ(device_->QueryMr(mr_.mr)->rkey, rkey);
  EXPECT_EQ(*peer_->Read(rkey, kBase, 8), buffer_->Bytes(0, 8));
}

TEST_F(FastRegisterTest, SilentSuccessSuppressesOnlySuccesses) {
  ASSERT_TRUE(device_
                  ->PostFastRegister(
                      connection_,
                      Work({lam_.pages[2]}, 64, kBase, kWorkSilentSuccess, 1))
                  .ok());
  device_->WaitForWorkerIdle();
  EXPECT_TRUE(sink_->Completions().empty());
  // No completion, so the new rkey is read from the MR (F5).
  uint32_t rkey = device_->QueryMr(mr_.mr)->rkey;
  EXPECT_NE(rkey, mr_.rkey);
  EXPECT_EQ(*peer_->Read(rkey, kBase, 8), buffer_->Bytes(2 * PageSize(), 8));

  ASSERT_TRUE(Invalidate(connection_, mr_.mr, kWorkSilentSuccess, 2).ok());
  device_->WaitForWorkerIdle();
  EXPECT_TRUE(sink_->Completions().empty());
  // Invalidating a free MR fails, and a failure completes even when silent.
  ASSERT_TRUE(Invalidate(connection_, mr_.mr, kWorkSilentSuccess, 3).ok());
  ASSERT_TRUE(sink_->WaitForCompletions(1));
  device_->WaitForWorkerIdle();
  std::vector<WorkCompletion> completions = sink_->Completions();
  ASSERT_EQ(completions.size(), 1u);
  EXPECT_EQ(completions[0].request_context, 3u);
  EXPECT_THAT(
      completions[0].status,
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "MR_NOT_FAST_REGISTERED"));
}

TEST_F(FastRegisterTest, DeferredWorkIsHeldUntilTheNextNonDeferredWork) {
  absl::StatusOr<uint64_t> deferred = device_->PostFastRegister(
      connection_, Work({lam_.pages[0]}, 64, kBase, kWorkDefer, 1));
  ASSERT_TRUE(deferred.ok()) << deferred.status();
  device_->WaitForWorkerIdle();
  EXPECT_TRUE(sink_->Completions().empty());
  EXPECT_EQ(device_->QueryMr(mr_.mr)->rkey, mr_.rkey);  // not executed

  absl::StatusOr<uint64_t> next = Invalidate(connection_, mr_.mr, 0, 2);
  ASSERT_TRUE(next.ok());
  ASSERT_TRUE(sink_->WaitForCompletions(2));
  std::vector<WorkCompletion> completions = sink_->Completions();
  EXPECT_EQ(completions[0].request_context, 1u);
  EXPECT_EQ(completions[0].work_request, *deferred);
  EXPECT_EQ(completions[0].kind, WorkCompletion::Kind::kFastRegister);
  EXPECT_TRUE(completions[0].status.ok());
  EXPECT_EQ(completions[1].request_context, 2u);
  EXPECT_TRUE(completions[1].status.ok());

  // The explicit flush hands held work on too.
  ASSERT_TRUE(device_
                  ->PostFastRegister(connection_, Work({lam_.pages[0]}, 64,
                                                       kBase, kWorkDefer, 3))
                  .ok());
  device_->WaitForWorkerIdle();
  EXPECT_EQ(sink_->Completions().size(), 2u);
  ASSERT_TRUE(device_->FlushDeferred(connection_).ok());
  ASSERT_TRUE(sink_->WaitForCompletions(3));
  EXPECT_EQ(sink_->Completions().back().request_context, 3u);
}

TEST_F(FastRegisterTest, RemoteAccessOnALocalOnlyMrIsAnAccessViolation) {
  absl::StatusOr<MrKeys> local = device_->AllocateFastRegisterMr(pd_, false, 4);
  ASSERT_TRUE(local.ok());
  FastRegisterWork work = Work({lam_.pages[0]}, 64);
  work.mr = local->mr;
  for (uint32_t access : {uint32_t{kAccessRemoteRead}, kRemoteRw}) {
    work.access = access;
    EXPECT_THAT(device_->PostFastRegister(connection_, work).status(),
                IsSeedError(::mrd::STATUS_ACCESS_VIOLATION,
                            "REMOTE_ACCESS_NOT_ALLOWED"));
  }
  work.access = kAccessLocalWrite;
  EXPECT_TRUE(device_->PostFastRegister(connection_, work).ok());
  ASSERT_TRUE(sink_->WaitForCompletions(1));
  EXPECT_TRUE(sink_->Completions()[0].status.ok());
  // Fast-registered, but without remote rights: peers still get nothing.
  EXPECT_THAT(peer_->Read(device_->QueryMr(local->mr)->rkey, kBase, 8).status(),
              IsAccessError());
}

TEST_F(FastRegisterTest, BadPageArraysAreInvalidParameters) {
  const uint64_t ps = PageSize();
  auto post = [&](const FastRegisterWork& work) {
    return device_->PostFastRegister(connection_, work).status();
  };
  auto invalid = [](const char* reason) {
    return IsSeedError(::mrd::STATUS_INVALID_PARAMETER, reason);
  };
  EXPECT_THAT(post(Work({lam_.pages[0] + 8}, 64)), invalid("MISALIGNED_PAGE"));
  // Just past the LAM: a guard page, mapped by no one.
  EXPECT_THAT(post(Work({lam_.pages[3] + ps}, 64)), invalid("PAGE_NOT_MAPPED"));
  EXPECT_THAT(post(Work({ps}, 64)), invalid("PAGE_NOT_MAPPED"));
  // Another PD's pages read exactly like unmapped ones.
  PdId other = NewPd();
  LogicalMapping foreign = Lam(other, NewBuffer(1), 0, ps);
  EXPECT_THAT(post(Work({foreign.pages[0]}, 64)), invalid("PAGE_NOT_MAPPED"));
  EXPECT_THAT(post(Work({}, 64)), invalid("EMPTY_PAGE_ARRAY"));
  std::vector<uint64_t> nine(9, lam_.pages[0]);
  EXPECT_THAT(post(Work(nine, 64)), invalid("PAGE_ARRAY_TOO_LONG"));
  EXPECT_THAT(post(Work({lam_.pages[0]}, ps + 1)),
              invalid("LENGTH_EXCEEDS_PAGES"));
  EXPECT_THAT(post(Work({lam_.pages[0]}, 0)), invalid("ZERO_LENGTH"));
  EXPECT_THAT(post(Work({lam_.pages[0]}, 64, 0)),
              invalid("ZERO_BASED_ADDRESS"));
  EXPECT_THAT(post(Work({lam_.pages[0]}, 64, kBase + 1)),
              invalid("BASE_NOT_AT_FBO"));
  FastRegisterWork bad_fbo = Work({lam_.pages[0]}, 64, kBase);
  bad_fbo.fbo = static_cast<uint32_t>(ps);
  EXPECT_THAT(post(bad_fbo), invalid("FBO_TOO_LARGE"));
  EXPECT_THAT(post(Work({lam_.pages[0]}, 64, kBase, 0x4)),
              invalid("UNKNOWN_WORK_FLAGS"));
  device_->WaitForWorkerIdle();
  EXPECT_TRUE(sink_->Completions().empty());
}

TEST_F(FastRegisterTest, PostsNeedAConnectedQueuePairOfTheMrsPd) {
  EXPECT_THAT(
      device_->PostFastRegister(connection_ + 1000, Work({lam_.pages[0]}, 64))
          .status(),
      IsConnectionInvalid());
  PdId other = NewPd();
  std::unique_ptr<SoftPeer> stranger = Connect(other);
  EXPECT_THAT(device_
                  ->PostFastRegister(stranger->connection_id(),
                                     Work({lam_.pages[0]}, 64))
                  .status(),
              IsConnectionInvalid());
  EXPECT_THAT(Invalidate(stranger->connection_id(), mr_.mr, 0, 1).status(),
              IsConnectionInvalid());
  FastRegisterWork unknown = Work({lam_.pages[0]}, 64);
  unknown.mr = mr_.mr + 1000;
  EXPECT_THAT(device_->PostFastRegister(connection_, unknown).status(),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR"));
  // A normal MR is not a fast-register MR object (R4).
  MrKeys normal = Register(pd_, *buffer_, 0, 64, kAccessRemoteRead);
  FastRegisterWork wrong_kind = Work({lam_.pages[0]}, 64);
  wrong_kind.mr = normal.mr;
  EXPECT_THAT(
      device_->PostFastRegister(connection_, wrong_kind).status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "NOT_FAST_REGISTER_MR"));
  EXPECT_THAT(device_->DeregisterMr(mr_.mr),
              IsMrdError(absl::StatusCode::kInvalidArgument, "WRONG_MR_KIND"));
  EXPECT_THAT(device_->FreeFastRegisterMr(normal.mr),
              IsMrdError(absl::StatusCode::kInvalidArgument, "WRONG_MR_KIND"));
  // A connection in the error state is not connected any more.
  EXPECT_THAT(peer_->Read(mr_.rkey, kBase, 8).status(), IsAccessError());
  EXPECT_THAT(device_->PostFastRegister(connection_, Work({lam_.pages[0]}, 64))
                  .status(),
              IsConnectionInvalid());
}

TEST_F(FastRegisterTest, QueuedWorkIsFlushedWhenTheConnectionCloses) {
  absl::StatusOr<uint64_t> posted = device_->PostFastRegister(
      connection_, Work({lam_.pages[0]}, 64, kBase, kWorkDefer, 55));
  ASSERT_TRUE(posted.ok());
  device_->WaitForWorkerIdle();
  peer_.reset();
  ASSERT_TRUE(sink_->WaitFor(Event::Kind::kDisconnected, 1));
  std::vector<Event> events = sink_->Events();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].kind, Event::Kind::kConnected);
  ASSERT_EQ(events[1].kind, Event::Kind::kCompletion);
  EXPECT_EQ(events[1].completion.request_context, 55u);
  EXPECT_EQ(events[1].completion.work_request, *posted);
  EXPECT_THAT(events[1].completion.status,
              IsSeedError(::mrd::STATUS_CONNECTION_INVALID, "FLUSHED"));
  EXPECT_EQ(events[2].kind, Event::Kind::kDisconnected);
  EXPECT_EQ(events[2].connection, connection_);
  // Nothing was mapped.
  EXPECT_EQ(device_->QueryMr(mr_.mr)->rkey, mr_.rkey);
  EXPECT_TRUE(device_->ReleaseLam(lam_.lam).ok());
}

TEST_F(FastRegisterTest, FreeingTheMrObjectRevokesAtOnce) {
  uint32_t rkey =
      FastRegister(connection_, *sink_, mr_.mr, {lam_.pages[0]}, 0, 64, kBase);
  ASSERT_TRUE(peer_->Read(rkey, kBase, 8).ok());
  ASSERT_TRUE(device_->FreeFastRegisterMr(mr_.mr).ok());
  EXPECT_THAT(peer_->Read(rkey, kBase, 8).status(), IsAccessError());
  EXPECT_TRUE(device_->ReleaseLam(lam_.lam).ok());
  EXPECT_THAT(device_->FreeFastRegisterMr(mr_.mr),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR"));
}

TEST_F(FastRegisterTest, DeallocatePdReleasesEverythingAndSilencesTheSink) {
  const uint64_t ps = PageSize();
  uint32_t rkey =
      FastRegister(connection_, *sink_, mr_.mr, {lam_.pages[0]}, 0, 64, kBase);
  MrKeys normal = Register(pd_, NewBuffer(2), 0, 2 * ps, kAccessRemoteRead);
  std::string ticket = *device_->CreatePeerTicket(pd_);
  ASSERT_TRUE(device_
                  ->PostFastRegister(connection_, Work({lam_.pages[1]}, 64,
                                                       kBase, kWorkDefer, 9))
                  .ok());
  ASSERT_TRUE(peer_->Read(rkey, kBase, 8).ok());
  ASSERT_TRUE(peer_->Read(normal.rkey, kBase, 8).ok());
  EXPECT_EQ(device_->PinnedBytes(), 6 * ps);
  device_->WaitForWorkerIdle();
  size_t events = sink_->Events().size();

  ASSERT_TRUE(device_->DeallocatePd(pd_).ok());
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_),
            kernel_pinned_before_);
  EXPECT_THAT(peer_->Read(rkey, kBase, 8).status(), IsGone());
  EXPECT_THAT(
      SoftPeer::Connect(device_->Attributes().peer_address, ticket).status(),
      IsMrdError(absl::StatusCode::kUnauthenticated, "BAD_TICKET"));
  device_->WaitForWorkerIdle();
  EXPECT_EQ(sink_->Events().size(), events);  // no flush, no disconnect
  EXPECT_THAT(device_->DeallocatePd(pd_),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD"));
  EXPECT_THAT(device_->QueryMr(mr_.mr).status(),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR"));
  EXPECT_THAT(device_->ReleaseLam(lam_.lam),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_LAM"));
}

// An invalidation waiting for a peer READ inside the mapping, and a
// FreeFastRegisterMr of the same MR object meanwhile: the free waits for the
// READ too; both finish once it is out, the invalidation is completed and
// the MR object is gone. (The free also waits until the invalidation has
// stopped waiting on the MR, Mr::holders, before giving its slot back.)
TEST_F(SoftwareDeviceTest, FreeingAnMrObjectWhoseInvalidationWaitsForAPeer) {
  Gate gate;
  SoftwareDeviceOptions options;
  options.peer_io_hook_for_test = [&gate] { gate.Pass(); };
  StartDevice(options);
  RecordingSink* sink;
  PdId pd = NewPd(&sink);
  MemfdBuffer& buffer = NewBuffer(1);
  LogicalMapping lam = Lam(pd, buffer, 0, PageSize());
  absl::StatusOr<MrKeys> mr = device_->AllocateFastRegisterMr(pd, true, 1);
  ASSERT_TRUE(mr.ok()) << mr.status();
  std::unique_ptr<SoftPeer> peer = Connect(pd);
  uint32_t rkey = FastRegister(peer->connection_id(), *sink, mr->mr,
                               {lam.pages[0]}, 0, 64, kBase);

  absl::StatusOr<std::string> in_flight;
  std::thread reader([&] { in_flight = peer->Read(rkey, kBase, 64); });
  gate.WaitEntered();  // the READ is inside the mapping
  ASSERT_TRUE(Invalidate(peer->connection_id(), mr->mr, 0, 5).ok());
  absl::SleepFor(absl::Milliseconds(100));  // the worker waits for the READ
  std::atomic<bool> freed{false};
  std::thread free_object([&] {
    EXPECT_TRUE(device_->FreeFastRegisterMr(mr->mr).ok());
    freed = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(freed) << "FreeFastRegisterMr returned with a READ inside";
  gate.Open();
  reader.join();
  free_object.join();
  ASSERT_TRUE(in_flight.ok()) << in_flight.status();
  EXPECT_EQ(*in_flight, buffer.Bytes(0, 64));
  ASSERT_TRUE(sink->WaitForCompletions(2));
  WorkCompletion done = sink->Completions().back();
  EXPECT_EQ(done.kind, WorkCompletion::Kind::kInvalidate);
  EXPECT_EQ(done.request_context, 5u);
  EXPECT_THAT(device_->QueryMr(mr->mr).status(),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR"));
  EXPECT_THAT(peer->Read(rkey, kBase, 8).status(), IsAccessError());
  EXPECT_TRUE(device_->ReleaseLam(lam.lam).ok());
}

// ---------------------------------------------------------------------------
// Concurrency: peers racing registrations (run under TSan too).

TEST_F(SoftwareDeviceTest, PeersRacingDeregistrationSeeDataOrAccessErrors) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(2);
  const std::string expected = buffer.Bytes(0, 256);
  std::atomic<uint32_t> current{0};
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0};
  std::atomic<int> refused{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&] {
      std::unique_ptr<SoftPeer> peer = Connect(pd);
      while (!stop) {
        uint32_t rkey = current;
        if (rkey == 0) continue;
        absl::StatusOr<std::string> data = peer->Read(rkey, kBase, 256);
        if (data.ok()) {
          EXPECT_EQ(*data, expected);
          ++reads;
        } else {
          EXPECT_THAT(data.status(), IsAccessError());
          ++refused;
          peer = Connect(pd);  // the error closed the connection
        }
      }
    });
  }
  std::unique_ptr<SoftPeer> checker = Connect(pd);
  for (int i = 0; i < 30; ++i) {
    MrKeys keys = Register(pd, buffer, 0, 2 * PageSize(), kAccessRemoteRead);
    current = keys.rkey;
    absl::SleepFor(absl::Milliseconds(2));
    ASSERT_TRUE(device_->DeregisterMr(keys.mr).ok());
    // Deregistered means dead, whatever the readers are doing.
    EXPECT_THAT(checker->Read(keys.rkey, kBase, 8).status(), IsAccessError());
    checker = Connect(pd);
  }
  stop = true;
  for (std::thread& reader : readers) reader.join();
  EXPECT_GT(reads + refused, 0);
}

}  // namespace
}  // namespace mrd::device
