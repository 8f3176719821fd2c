// Live handover on the software device: a second SoftwareDevice in this
// process stands for the new mrd process. It re-creates the first one's
// registrations with the same keys (AdoptMr) and tickets (AdoptPeerTicket)
// and takes over its peer listener (StopPeerAccepting, inherited listener),
// and real peers over TCP reach the memory through the old rkeys.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/peer/soft_peer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mrd/net.h"
#include "mrd/peer_frame.h"
#include "server/device/software/software_device.h"
#include "tests/support/kernel_pins.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::device {
namespace {

using ::mrd::device::testing::IsMrdError;
using ::mrd::device::testing::MemfdBuffer;
using ::mrd::device::testing::PageSize;
using ::mrd::device::testing::RecordingSink;
using ::mrd::peer::SoftPeer;
using ::mrd::test_support::KernelPinnedBytesSettled;

constexpr uint32_t kRemoteRw =
    kAccessLocalWrite | kAccessRemoteRead | kAccessRemoteWrite;
constexpr uint64_t kBase = uint64_t{0x5000} << 32;

::testing::Matcher<absl::Status> IsAccessError() {
  return IsMrdError(absl::StatusCode::kPermissionDenied, "REMOTE_ACCESS_ERROR");
}

// The old and the new process's devices, their PDs and their memory. Every
// test is a leak test: afterwards nothing stays pinned.
class HandoverTest : public ::testing::Test {
 protected:
  void SetUp() override { kernel_pinned_before_ = KernelPinnedBytesSettled(0); }

  void TearDown() override {
    for (auto& [device, pd] : pds_) {
      absl::Status status = device->DeallocatePd(pd);
      EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kNotFound)
          << status;
    }
    pds_.clear();
    for (auto& device : devices_) EXPECT_EQ(device->PinnedBytes(), 0u);
    devices_.clear();
    EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before_),
              kernel_pinned_before_);
  }

  SoftwareDevice& NewDevice(SoftwareDeviceOptions options = {}) {
    absl::StatusOr<std::unique_ptr<SoftwareDevice>> device =
        SoftwareDevice::Create(options);
    EXPECT_TRUE(device.ok()) << device.status();
    EXPECT_TRUE((*device)->Start().ok());
    devices_.push_back(std::move(*device));
    return *devices_.back();
  }

  // The new process's device, on the old one's listening socket.
  SoftwareDevice& Successor(SoftwareDevice& old,
                            SoftwareDeviceOptions options = {}) {
    absl::StatusOr<UniqueFd> listener = old.StopPeerAccepting();
    EXPECT_TRUE(listener.ok()) << listener.status();
    EXPECT_TRUE(listener->valid());
    options.inherited_peer_listener = listener->get();
    // The device keeps its own duplicate; ours closes here.
    return NewDevice(options);
  }

  PdId NewPd(SoftwareDevice& device) {
    sinks_.push_back(std::make_unique<RecordingSink>());
    absl::StatusOr<PdId> pd = device.AllocatePd(sinks_.back().get());
    EXPECT_TRUE(pd.ok()) << pd.status();
    pds_.emplace_back(&device, *pd);
    return *pd;
  }

  MemfdBuffer& NewBuffer(uint64_t pages, uint8_t seed = 1) {
    buffers_.push_back(MemfdBuffer::Create(pages, seed));
    EXPECT_NE(buffers_.back(), nullptr);
    return *buffers_.back();
  }

  static std::string Ticket(SoftwareDevice& device, PdId pd) {
    absl::StatusOr<std::string> ticket = device.CreatePeerTicket(pd);
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return ticket.value_or("");
  }

  static std::unique_ptr<SoftPeer> Connect(const std::string& address,
                                           const std::string& ticket) {
    absl::StatusOr<std::unique_ptr<SoftPeer>> peer =
        SoftPeer::Connect(address, ticket);
    EXPECT_TRUE(peer.ok()) << peer.status();
    return peer.ok() ? std::move(*peer) : nullptr;
  }

  // Declared before devices_: the devices go first.
  std::vector<std::unique_ptr<RecordingSink>> sinks_;
  std::vector<std::unique_ptr<MemfdBuffer>> buffers_;
  std::vector<std::unique_ptr<SoftwareDevice>> devices_;
  std::vector<std::pair<SoftwareDevice*, PdId>> pds_;
  uint64_t kernel_pinned_before_ = 0;
};

TEST_F(HandoverTest, AdoptedMrAndTicketServeAPeerThroughTheOldRkey) {
  SoftwareDevice& old = NewDevice();
  MemfdBuffer& buffer = NewBuffer(2);
  const uint64_t length = 2 * PageSize() - 100;
  PdId old_pd = NewPd(old);
  absl::StatusOr<MrKeys> keys =
      old.RegisterMr(old_pd, buffer.Span(50, length), kBase, kRemoteRw);
  ASSERT_TRUE(keys.ok()) << keys.status();
  const std::string ticket = Ticket(old, old_pd);
  std::unique_ptr<SoftPeer> old_peer =
      Connect(old.Attributes().peer_address, ticket);
  ASSERT_NE(old_peer, nullptr);

  ASSERT_TRUE(old.CanHandOver().ok());
  SoftwareDevice& next = Successor(old);
  EXPECT_EQ(next.Attributes().peer_address, old.Attributes().peer_address);
  PdId pd = NewPd(next);
  ASSERT_TRUE(next.AdoptPeerTicket(pd, ticket).ok());
  absl::StatusOr<MrKeys> adopted = next.AdoptMr(
      pd, buffer.Span(50, length), kBase, kRemoteRw, keys->lkey, keys->rkey);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->lkey, keys->lkey);
  EXPECT_EQ(adopted->rkey, keys->rkey);
  EXPECT_NE(adopted->mr, 0u);
  absl::StatusOr<MrKeys> queried = next.QueryMr(adopted->mr);
  ASSERT_TRUE(queried.ok());
  EXPECT_EQ(queried->rkey, keys->rkey);
  EXPECT_EQ(next.PinnedBytes(), 2 * PageSize());

  // A peer arriving now reaches the new device (the old one no longer
  // accepts), with the old ticket and rkey.
  std::unique_ptr<SoftPeer> peer =
      Connect(next.Attributes().peer_address, ticket);
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> read = peer->Read(keys->rkey, kBase + 10, 4000);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, buffer.Bytes(60, 4000));
  ASSERT_TRUE(peer->Write(keys->rkey, kBase + length - 5, "hello").ok());
  EXPECT_EQ(buffer.Bytes(50 + length - 5, 5), "hello");
  // The old device's peer, connected before, is still served, and sees it.
  absl::StatusOr<std::string> old_read =
      old_peer->Read(keys->rkey, kBase + length - 5, 5);
  ASSERT_TRUE(old_read.ok()) << old_read.status();
  EXPECT_EQ(*old_read, "hello");
  // The new device enforces the adopted MR's bounds as its own.
  EXPECT_THAT(peer->Read(keys->rkey, kBase + length - 4, 5).status(),
              IsAccessError());
}

TEST_F(HandoverTest, RefusedAdoptionsLeaveNothingPinned) {
  SoftwareDeviceOptions options;
  options.max_keys = 1000;
  SoftwareDevice& old = NewDevice(options);
  SoftwareDevice& next = NewDevice(options);
  MemfdBuffer& held = NewBuffer(1);
  MemfdBuffer& other = NewBuffer(4, 2);
  PdId old_pd = NewPd(old);
  PdId pd = NewPd(next);
  absl::StatusOr<MrKeys> keys =
      old.RegisterMr(old_pd, held.Span(0, 64), kBase, kRemoteRw);
  ASSERT_TRUE(keys.ok());
  ASSERT_TRUE(next.AdoptMr(pd, held.Span(0, 64), kBase, kRemoteRw, keys->lkey,
                           keys->rkey)
                  .ok());
  const uint64_t pinned = next.PinnedBytes();
  const SoftwareDevice::ResourceCounts before = next.CountResources();
  ASSERT_EQ(pinned, PageSize());
  ASSERT_EQ(before.keys, 1u);
  const MemorySpan span = other.Span(0, other.size());

  auto expect_refused = [&](uint32_t lkey, uint32_t rkey, absl::StatusCode code,
                            const char* reason) {
    EXPECT_THAT(next.AdoptMr(pd, span, kBase, kRemoteRw, lkey, rkey).status(),
                IsMrdError(code, reason))
        << std::hex << lkey << " " << rkey;
    EXPECT_EQ(next.PinnedBytes(), pinned);
    SoftwareDevice::ResourceCounts after = next.CountResources();
    EXPECT_EQ(after.keys, before.keys);
    EXPECT_EQ(after.mrs, before.mrs);
  };
  // The slot is held: with the same key, or another key byte.
  expect_refused(keys->lkey, keys->rkey, absl::StatusCode::kFailedPrecondition,
                 "KEY_IN_USE");
  expect_refused(keys->lkey ^ 1, keys->rkey ^ 1,
                 absl::StatusCode::kFailedPrecondition, "KEY_IN_USE");
  // The software device's MRs have one key for both.
  const uint32_t free_key = (((keys->rkey >> 8) % 999 + 1) << 8) | 0x42;
  ASSERT_NE(free_key >> 8, keys->rkey >> 8);
  expect_refused(free_key, free_key + 1, absl::StatusCode::kInvalidArgument,
                 "BAD_KEY");
  // No slot 0; none beyond the table's 1000.
  expect_refused(0x42, 0x42, absl::StatusCode::kInvalidArgument, "BAD_KEY");
  expect_refused(1001u << 8, 1001u << 8, absl::StatusCode::kInvalidArgument,
                 "BAD_KEY");
  // RegisterMr's own checks come first.
  EXPECT_THAT(
      next.AdoptMr(pd, span, 0, kRemoteRw, free_key, free_key).status(),
      IsMrdError(absl::StatusCode::kInvalidArgument, "ZERO_BASED_ADDRESS"));
  EXPECT_THAT(next.AdoptMr(pd + 100, span, kBase, kRemoteRw, free_key, free_key)
                  .status(),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD"));
  EXPECT_EQ(next.PinnedBytes(), pinned);
  // The free key itself is fine.
  absl::StatusOr<MrKeys> adopted =
      next.AdoptMr(pd, span, kBase, kRemoteRw, free_key, free_key);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->rkey, free_key);
  EXPECT_EQ(next.PinnedBytes(), pinned + other.size());
}

TEST_F(HandoverTest, AdoptPeerTicketChecksTheTicketAndItsOwner) {
  SoftwareDevice& old = NewDevice();
  SoftwareDevice& next = NewDevice();
  const std::string ticket = Ticket(old, NewPd(old));
  PdId pd = NewPd(next);
  PdId other_pd = NewPd(next);
  for (const std::string& bad :
       {std::string(), std::string("xyz"), ticket.substr(1), ticket + "0",
        absl::AsciiStrToUpper(ticket), std::string(32, 'g')}) {
    EXPECT_THAT(next.AdoptPeerTicket(pd, bad),
                IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_TICKET"))
        << bad;
  }
  EXPECT_THAT(next.AdoptPeerTicket(pd + 100, ticket),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD"));
  ASSERT_TRUE(next.AdoptPeerTicket(pd, ticket).ok());
  // Again for the same PD: nothing changes.
  EXPECT_TRUE(next.AdoptPeerTicket(pd, ticket).ok());
  EXPECT_EQ(next.CountModel().tickets, 1u);
  EXPECT_THAT(
      next.AdoptPeerTicket(other_pd, ticket),
      IsMrdError(absl::StatusCode::kFailedPrecondition, "TICKET_IN_USE"));
  // The PD's own tickets stay valid beside the adopted one.
  const std::string own = Ticket(next, pd);
  EXPECT_NE(Connect(next.Attributes().peer_address, own), nullptr);
  EXPECT_NE(Connect(next.Attributes().peer_address, ticket), nullptr);
  // A ticket dies with its PD.
  ASSERT_TRUE(next.DeallocatePd(pd).ok());
  EXPECT_TRUE(next.AdoptPeerTicket(other_pd, ticket).ok());
}

TEST_F(HandoverTest, AdoptedKeysAreNeverDrawnAndDeregisterRevokesThem) {
  SoftwareDeviceOptions options;
  options.max_keys = 64;
  options.key_chunk_slots = 16;
  SoftwareDevice& old = NewDevice(options);
  SoftwareDevice& next = NewDevice(options);
  MemfdBuffer& buffer = NewBuffer(1);
  PdId old_pd = NewPd(old);
  PdId pd = NewPd(next);
  const std::string ticket = Ticket(old, old_pd);
  ASSERT_TRUE(next.AdoptPeerTicket(pd, ticket).ok());
  // Half the key space, adopted.
  std::vector<MrKeys> adopted;
  std::set<uint32_t> adopted_slots;
  for (int i = 0; i < 32; ++i) {
    absl::StatusOr<MrKeys> keys =
        old.RegisterMr(old_pd, buffer.Span(i * 64, 64), kBase, kRemoteRw);
    ASSERT_TRUE(keys.ok()) << keys.status();
    absl::StatusOr<MrKeys> mine = next.AdoptMr(
        pd, buffer.Span(i * 64, 64), kBase, kRemoteRw, keys->lkey, keys->rkey);
    ASSERT_TRUE(mine.ok()) << mine.status();
    ASSERT_EQ(mine->rkey, keys->rkey);
    adopted.push_back(*mine);
    adopted_slots.insert(mine->rkey >> 8);
  }
  // Registrations of the new device get the other half, then run out.
  MemfdBuffer& more = NewBuffer(1, 3);
  for (int i = 0; i < 32; ++i) {
    absl::StatusOr<MrKeys> keys =
        next.RegisterMr(pd, more.Span(i * 64, 64), kBase, kRemoteRw);
    ASSERT_TRUE(keys.ok()) << i << ": " << keys.status();
    EXPECT_FALSE(adopted_slots.count(keys->rkey >> 8))
        << "RegisterMr handed out adopted key slot " << (keys->rkey >> 8);
  }
  EXPECT_THAT(next.RegisterMr(pd, more.Span(0, 64), kBase, kRemoteRw).status(),
              ::mrd::device::testing::IsSeedError(
                  ::mrd::STATUS_INSUFFICIENT_RESOURCES, "KEYS_EXHAUSTED"));

  std::unique_ptr<SoftPeer> peer =
      Connect(next.Attributes().peer_address, ticket);
  ASSERT_NE(peer, nullptr);
  const MrKeys& victim = adopted[7];
  absl::StatusOr<std::string> read = peer->Read(victim.rkey, kBase, 64);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, buffer.Bytes(7 * 64, 64));
  ASSERT_TRUE(next.DeregisterMr(victim.mr).ok());
  EXPECT_THAT(peer->Read(victim.rkey, kBase, 64).status(), IsAccessError());
  // Its slot is free again: the next registration takes it, with a new key.
  absl::StatusOr<MrKeys> reused =
      next.RegisterMr(pd, more.Span(0, 64), kBase, kRemoteRw);
  ASSERT_TRUE(reused.ok()) << reused.status();
  EXPECT_EQ(reused->rkey >> 8, victim.rkey >> 8);
  EXPECT_NE(reused->rkey, victim.rkey);
}

// True when a response frame arrives on `fd` within `limit`.
bool Answered(int fd, absl::Duration limit) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(limit))) > 0;
}

// A connection that sent hello with `ticket` (not yet answered).
UniqueFd SendHello(const std::string& address, const std::string& ticket) {
  absl::StatusOr<UniqueFd> fd = mrd::peer::ConnectTcp(address);
  EXPECT_TRUE(fd.ok()) << fd.status();
  if (!fd.ok()) return UniqueFd();
  v1::PeerRequest hello;
  hello.mutable_hello()->set_ticket(ticket);
  EXPECT_TRUE(mrd::peer::WriteFrame(fd->get(), hello).ok());
  return std::move(*fd);
}

v1::PeerStatus HelloStatus(int fd) {
  v1::PeerResponse response;
  absl::Status status = mrd::peer::ReadFrame(fd, 4096, &response);
  EXPECT_TRUE(status.ok()) << status;
  return response.status();
}

TEST_F(HandoverTest, TheNewDeviceAcceptsOnTheInheritedListener) {
  SoftwareDevice& old = NewDevice();
  MemfdBuffer& buffer = NewBuffer(1);
  PdId old_pd = NewPd(old);
  absl::StatusOr<MrKeys> keys =
      old.RegisterMr(old_pd, buffer.Span(0, 64), kBase, kRemoteRw);
  ASSERT_TRUE(keys.ok());
  const std::string address = old.Attributes().peer_address;
  std::unique_ptr<SoftPeer> old_peer = Connect(address, Ticket(old, old_pd));
  ASSERT_NE(old_peer, nullptr);

  SoftwareDevice& next = Successor(old);
  EXPECT_EQ(next.Attributes().peer_address, address);
  PdId pd = NewPd(next);
  const std::string ticket = Ticket(next, pd);
  // Every new connection lands at the new device: the old one would refuse
  // the new device's ticket.
  std::vector<std::unique_ptr<SoftPeer>> peers;
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<std::unique_ptr<SoftPeer>> peer =
        SoftPeer::Connect(address, ticket);
    ASSERT_TRUE(peer.ok()) << "connection " << i << ": " << peer.status();
    peers.push_back(std::move(*peer));
  }
  // The old device's connection is served as before.
  EXPECT_TRUE(old_peer->Read(keys->rkey, kBase, 64).ok());

  // The old process ends: its listener fd closes, the socket stays up.
  old.Shutdown();
  EXPECT_FALSE(old_peer->Read(keys->rkey, kBase, 64).ok());
  std::unique_ptr<SoftPeer> late = Connect(address, ticket);
  ASSERT_NE(late, nullptr);
  // Stats are published once per reactor round: wait for it.
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  while (next.PeerStats().listener.accepted < 9 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(next.PeerStats().listener.accepted, 9u);
  EXPECT_EQ(old.PeerStats().listener.accepted, 1u);

  // Handing over again: the third device takes it from the second.
  SoftwareDevice& third = Successor(next);
  EXPECT_EQ(third.Attributes().peer_address, address);
  PdId third_pd = NewPd(third);
  EXPECT_NE(Connect(address, Ticket(third, third_pd)), nullptr);
}

TEST_F(HandoverTest, ResumeAcceptingServesWhatWaitedInTheBacklog) {
  SoftwareDevice& device = NewDevice();
  PdId pd = NewPd(device);
  const std::string ticket = Ticket(device, pd);
  const std::string address = device.Attributes().peer_address;
  std::unique_ptr<SoftPeer> before = Connect(address, ticket);
  ASSERT_NE(before, nullptr);

  absl::StatusOr<UniqueFd> listener = device.StopPeerAccepting();
  ASSERT_TRUE(listener.ok()) << listener.status();
  ASSERT_TRUE(listener->valid());
  // Stopped twice: another duplicate, still not accepting.
  absl::StatusOr<UniqueFd> again = device.StopPeerAccepting();
  ASSERT_TRUE(again.ok()) << again.status();
  // The kernel completes the TCP handshake, but nobody accepts: the hello
  // waits in the backlog.
  UniqueFd waiting = SendHello(address, ticket);
  ASSERT_TRUE(waiting.valid());
  EXPECT_FALSE(Answered(waiting.get(), absl::Milliseconds(500)));
  EXPECT_EQ(device.PeerStats().listener.accepted, 1u);
  // Connections made before are served meanwhile.
  MemfdBuffer& buffer = NewBuffer(1);
  absl::StatusOr<MrKeys> keys =
      device.RegisterMr(pd, buffer.Span(0, 64), kBase, kRemoteRw);
  ASSERT_TRUE(keys.ok());
  EXPECT_TRUE(before->Read(keys->rkey, kBase, 64).ok());

  device.ResumePeerAccepting();
  ASSERT_TRUE(Answered(waiting.get(), absl::Seconds(5)));
  EXPECT_EQ(HelloStatus(waiting.get()), v1::PEER_SUCCESS);
  EXPECT_NE(Connect(address, ticket), nullptr);
  device.ResumePeerAccepting();  // accepting already: nothing changes
  EXPECT_NE(Connect(address, ticket), nullptr);
}

TEST_F(HandoverTest, StopPeerAcceptingBeforeStartStartsWithoutAccepting) {
  absl::StatusOr<std::unique_ptr<SoftwareDevice>> device =
      SoftwareDevice::Create(SoftwareDeviceOptions{});
  ASSERT_TRUE(device.ok());
  absl::StatusOr<UniqueFd> listener = (*device)->StopPeerAccepting();
  ASSERT_TRUE(listener.ok()) << listener.status();
  ASSERT_TRUE((*device)->Start().ok());
  devices_.push_back(std::move(*device));
  SoftwareDevice& stopped = *devices_.back();
  PdId pd = NewPd(stopped);
  UniqueFd waiting =
      SendHello(stopped.Attributes().peer_address, Ticket(stopped, pd));
  EXPECT_FALSE(Answered(waiting.get(), absl::Milliseconds(300)));
  stopped.ResumePeerAccepting();
  ASSERT_TRUE(Answered(waiting.get(), absl::Seconds(5)));
  EXPECT_EQ(HelloStatus(waiting.get()), v1::PEER_SUCCESS);
}

TEST_F(HandoverTest, AShutDownDeviceHasNoListenerToHandOver) {
  SoftwareDevice& device = NewDevice();
  device.Shutdown();
  EXPECT_THAT(device.StopPeerAccepting().status(),
              IsMrdError(absl::StatusCode::kFailedPrecondition,
                         "PEER_LISTENER_STOPPED"));
  device.ResumePeerAccepting();  // nothing to resume
}

TEST_F(HandoverTest, AnInheritedListenerMustBeAListeningTcpSocket) {
  SoftwareDeviceOptions options;
  // Not a socket.
  options.inherited_peer_listener = NewBuffer(1).fd();
  EXPECT_THAT(
      SoftwareDevice::Create(options).status(),
      IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_LISTENER"));
  // A TCP socket that does not listen.
  UniqueFd unbound(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(unbound.valid());
  options.inherited_peer_listener = unbound.get();
  EXPECT_THAT(
      SoftwareDevice::Create(options).status(),
      IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_LISTENER"));
  // A UDP socket.
  UniqueFd datagram(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(datagram.valid());
  options.inherited_peer_listener = datagram.get();
  EXPECT_THAT(
      SoftwareDevice::Create(options).status(),
      IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_LISTENER"));
  // Closed.
  const int closed = ::dup(unbound.get());
  ::close(closed);
  options.inherited_peer_listener = closed;
  EXPECT_THAT(
      SoftwareDevice::Create(options).status(),
      IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_LISTENER"));
}

}  // namespace
}  // namespace mrd::device
