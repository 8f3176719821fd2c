// Live handover on the software device: a second SoftwareDevice in this
// process stands for the new mrd process. It re-creates the first one's
// registrations with the same keys (AdoptMr) and tickets (AdoptPeerTicket)
// and takes over its peer listener (StopPeerAccepting, inherited listener),
// and real peers over TCP reach the memory through the old rkeys.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/peer/soft_peer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mrd/net.h"
#include "mrd/peer_frame.h"
#include "server/device/device_handover.h"
#include "server/device/iova_space.h"
#include "server/device/software/kernel_pin_ops.h"
#include "server/device/software/peer_listener.h"
#include "server/device/software/software_device.h"
#include "tests/support/kernel_pins.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::device {
namespace {

using ::mrd::device::testing::IsMrdError;
using ::mrd::device::testing::IsSeedError;
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
    absl::StatusOr<UniqueFd> listener = old.handover().StopPeerAccepting();
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

  // One page registered for remote access at kBase in a new PD, and the
  // PD's ticket.
  struct OnePage {
    MemfdBuffer* buffer = nullptr;
    PdId pd = 0;
    MrKeys keys;
    std::string ticket;
  };
  OnePage RegisterOnePage(SoftwareDevice& device) {
    OnePage out;
    out.buffer = &NewBuffer(1);
    out.pd = NewPd(device);
    absl::StatusOr<MrKeys> keys = device.RegisterMr(
        out.pd, out.buffer->Span(0, PageSize()), kBase, kRemoteRw);
    EXPECT_TRUE(keys.ok()) << keys.status();
    if (keys.ok()) out.keys = *keys;
    out.ticket = Ticket(device, out.pd);
    return out;
  }

  static std::unique_ptr<SoftPeer> Connect(const std::string& address,
                                           const std::string& ticket) {
    absl::StatusOr<std::unique_ptr<SoftPeer>> peer =
        SoftPeer::Connect(address, ticket);
    EXPECT_TRUE(peer.ok()) << peer.status();
    return peer.ok() ? std::move(*peer) : nullptr;
  }

  // A fast registration of `pages` at kBase on `device`, executed; returns
  // the rkey.
  static uint32_t FastRegister(SoftwareDevice& device, ConnectionId connection,
                               RecordingSink& sink, MrId mr,
                               std::vector<uint64_t> pages, uint64_t length) {
    const size_t before = sink.Completions().size();
    FastRegisterWork work;
    work.mr = mr;
    work.pages = std::move(pages);
    work.length = length;
    work.base_address = kBase;
    work.access = kRemoteRw;
    absl::StatusOr<uint64_t> posted = device.PostFastRegister(connection, work);
    EXPECT_TRUE(posted.ok()) << posted.status();
    if (!sink.WaitForCompletions(before + 1)) {
      ADD_FAILURE() << "no completion";
      return 0;
    }
    WorkCompletion completion = sink.Completions().back();
    EXPECT_TRUE(completion.status.ok()) << completion.status;
    return completion.rkey;
  }

  // An invalidation of `mr` on `device`, executed.
  static void Invalidate(SoftwareDevice& device, ConnectionId connection,
                         RecordingSink& sink, MrId mr) {
    const size_t before = sink.Completions().size();
    InvalidateWork work;
    work.mr = mr;
    absl::StatusOr<uint64_t> posted = device.PostInvalidate(connection, work);
    EXPECT_TRUE(posted.ok()) << posted.status();
    ASSERT_TRUE(sink.WaitForCompletions(before + 1));
    EXPECT_TRUE(sink.Completions().back().status.ok())
        << sink.Completions().back().status;
  }

  // Declared before devices_: the devices go first.
  std::vector<std::unique_ptr<RecordingSink>> sinks_;
  std::vector<std::unique_ptr<MemfdBuffer>> buffers_;
  std::vector<std::unique_ptr<PinOps>> pin_ops_;
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

  ASSERT_TRUE(old.handover().CanHandOver().ok());
  SoftwareDevice& next = Successor(old);
  EXPECT_EQ(next.Attributes().peer_address, old.Attributes().peer_address);
  PdId pd = NewPd(next);
  ASSERT_TRUE(next.handover().AdoptPeerTicket(pd, ticket).ok());
  absl::StatusOr<MrKeys> adopted = next.handover().AdoptMr(
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

// A raw peer connection past hello, for frames sent in pieces.
struct RawPeer {
  UniqueFd fd;
  ConnectionId id = 0;
};

RawPeer ConnectRaw(const std::string& address, const std::string& ticket) {
  RawPeer raw;
  absl::StatusOr<UniqueFd> fd = peer::ConnectTcp(address);
  EXPECT_TRUE(fd.ok()) << fd.status();
  if (!fd.ok()) return raw;
  v1::PeerRequest hello;
  hello.set_id(1);
  hello.mutable_hello()->set_ticket(ticket);
  EXPECT_TRUE(peer::WriteFrame(fd->get(), hello).ok());
  v1::PeerResponse reply;
  absl::Status read = peer::ReadFrame(fd->get(), 1 << 20, &reply);
  EXPECT_TRUE(read.ok()) << read;
  EXPECT_EQ(reply.status(), v1::PEER_SUCCESS) << reply.message();
  raw.fd = std::move(*fd);
  raw.id = reply.connection();
  return raw;
}

// The bytes of a WRITE request frame (id 2: after the hello).
std::string WriteFrameBytes(uint32_t rkey, uint64_t address,
                            const std::string& data) {
  v1::PeerRequest write;
  write.set_id(2);
  write.mutable_write()->set_rkey(rkey);
  write.mutable_write()->set_address(address);
  write.mutable_write()->set_data(data);
  std::string frame;
  EXPECT_TRUE(peer::AppendFrame(write, &frame).ok());
  return frame;
}

void SendBytes(int fd, absl::string_view bytes) {
  while (!bytes.empty()) {
    ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    ASSERT_GT(n, 0) << std::strerror(errno);
    bytes.remove_prefix(static_cast<size_t>(n));
  }
}

// A raw peer past hello that has sent the first half of a WRITE frame.
struct HalfWritten {
  RawPeer peer;
  std::string frame;
  size_t half = 0;
};

HalfWritten ConnectAndWriteHalf(const std::string& peer_address,
                                const std::string& ticket, uint32_t rkey,
                                uint64_t address, const std::string& data) {
  HalfWritten out;
  out.peer = ConnectRaw(peer_address, ticket);
  EXPECT_TRUE(out.peer.fd.valid());
  out.frame = WriteFrameBytes(rkey, address, data);
  out.half = out.frame.size() / 2;
  if (out.peer.fd.valid()) {
    SendBytes(out.peer.fd.get(), out.frame.substr(0, out.half));
  }
  return out;
}

// Freezes `device`'s peers until `ready` says the connection of interest is
// in the state the test wants (the listener read the bytes sent, or the
// socket stopped taking a response), thawing in between.
std::vector<DeviceHandover::HandedOverPeer> FreezeWhen(
    SoftwareDevice& device,
    const std::function<
        bool(const std::vector<DeviceHandover::HandedOverPeer>&)>& ready) {
  for (int i = 0; i < 500; ++i) {
    absl::StatusOr<std::vector<DeviceHandover::HandedOverPeer>> frozen =
        device.handover().FreezePeers(absl::Seconds(5));
    EXPECT_TRUE(frozen.ok()) << frozen.status();
    if (!frozen.ok()) return {};
    if (ready(*frozen)) return std::move(*frozen);
    device.handover().ThawPeers();
    absl::SleepFor(absl::Milliseconds(10));
  }
  ADD_FAILURE() << "the connection never got where the test wanted it";
  return {};
}

const DeviceHandover::HandedOverPeer* PeerWithId(
    const std::vector<DeviceHandover::HandedOverPeer>& peers, ConnectionId id) {
  for (const DeviceHandover::HandedOverPeer& p : peers) {
    if (p.id == id) return &p;
  }
  return nullptr;
}

// Established connections move to the new device as they stand: one in the
// middle of a request frame, one in the middle of a response, one idle.
// Each goes on over the same TCP connection with the same connection id,
// without a second PEER_CONNECTED; new ones get ids above the old ones.
TEST_F(HandoverTest, EstablishedConnectionsMoveInsideAFrameWithTheirIds) {
  SoftwareDevice& old = NewDevice();
  constexpr uint64_t kPages = 4096;  // 16 MiB: a response no socket holds
  MemfdBuffer& buffer = NewBuffer(kPages);
  const uint64_t length = kPages * PageSize();
  PdId old_pd = NewPd(old);
  absl::StatusOr<MrKeys> keys =
      old.RegisterMr(old_pd, buffer.Span(0, length), kBase, kRemoteRw);
  ASSERT_TRUE(keys.ok()) << keys.status();
  const std::string ticket = Ticket(old, old_pd);
  const std::string address = old.Attributes().peer_address;
  std::unique_ptr<SoftPeer> idle = Connect(address, ticket);
  ASSERT_NE(idle, nullptr);
  ASSERT_TRUE(idle->Read(keys->rkey, kBase, 16).ok());
  // Half of a WRITE frame.
  HalfWritten half_written = ConnectAndWriteHalf(
      address, ticket, keys->rkey, kBase + 100, "written across the handover");
  ASSERT_FALSE(HasFailure());
  RawPeer& writer = half_written.peer;
  const std::string& frame = half_written.frame;
  const size_t half = half_written.half;
  // A READ of 16 MiB that is not read back yet: its response waits.
  RawPeer reader = ConnectRaw(address, ticket);
  ASSERT_TRUE(reader.fd.valid());
  v1::PeerRequest read;
  read.set_id(2);
  read.mutable_read()->set_rkey(keys->rkey);
  read.mutable_read()->set_address(kBase);
  read.mutable_read()->set_length(length);
  ASSERT_TRUE(peer::WriteFrame(reader.fd.get(), read).ok());

  std::vector<DeviceHandover::HandedOverPeer> frozen = FreezeWhen(
      old, [&](const std::vector<DeviceHandover::HandedOverPeer>& peers) {
        const DeviceHandover::HandedOverPeer* w = PeerWithId(peers, writer.id);
        const DeviceHandover::HandedOverPeer* r = PeerWithId(peers, reader.id);
        return w != nullptr && w->received.size() == half && r != nullptr &&
               !r->unsent.empty();
      });
  ASSERT_EQ(frozen.size(), 3u);
  EXPECT_EQ(PeerWithId(frozen, writer.id)->received, frame.substr(0, half));
  EXPECT_EQ(PeerWithId(frozen, writer.id)->unsent, "");
  EXPECT_EQ(PeerWithId(frozen, reader.id)->received, "");
  ASSERT_NE(PeerWithId(frozen, idle->connection_id()), nullptr);
  for (const DeviceHandover::HandedOverPeer& p : frozen)
    EXPECT_EQ(p.pd, old_pd);

  SoftwareDevice& next = Successor(old);
  PdId pd = NewPd(next);
  RecordingSink& sink = *sinks_.back();
  ASSERT_TRUE(next.handover().AdoptPeerTicket(pd, ticket).ok());
  ASSERT_TRUE(next.handover()
                  .AdoptMr(pd, buffer.Span(0, length), kBase, kRemoteRw,
                           keys->lkey, keys->rkey)
                  .ok());
  next.handover().ContinueConnectionIdsAbove(
      old.handover().ConnectionIdWatermark());
  for (DeviceHandover::HandedOverPeer& p : frozen) {
    ASSERT_TRUE(next.handover().AdoptPeer(pd, std::move(p)).ok());
  }
  // The old device's fds close; the connections live on in the new one.
  old.handover().DropFrozenPeers();
  next.handover().ThawPeers();

  ASSERT_NO_FATAL_FAILURE(SendBytes(writer.fd.get(), frame.substr(half)));
  v1::PeerResponse written;
  ASSERT_TRUE(peer::ReadFrame(writer.fd.get(), 1 << 20, &written).ok());
  EXPECT_EQ(written.status(), v1::PEER_SUCCESS) << written.message();
  EXPECT_EQ(written.id(), 2u);
  EXPECT_EQ(buffer.Bytes(100, 27), "written across the handover");
  v1::PeerResponse bytes;
  ASSERT_TRUE(peer::ReadFrame(reader.fd.get(), 32 << 20, &bytes).ok());
  EXPECT_EQ(bytes.status(), v1::PEER_SUCCESS) << bytes.message();
  EXPECT_EQ(bytes.data().size(), length);
  EXPECT_EQ(bytes.data().substr(0, 100), buffer.Bytes(0, 100));
  EXPECT_EQ(bytes.data().substr(length - 100), buffer.Bytes(length - 100, 100));
  absl::StatusOr<std::string> again = idle->Read(keys->rkey, kBase + 100, 27);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, "written across the handover");
  EXPECT_EQ(sink.CountOf(RecordingSink::Event::Kind::kConnected), 0u);

  std::unique_ptr<SoftPeer> fresh = Connect(address, ticket);
  ASSERT_NE(fresh, nullptr);
  EXPECT_GT(fresh->connection_id(), reader.id);
  EXPECT_GT(fresh->connection_id(), writer.id);
  EXPECT_GT(fresh->connection_id(), idle->connection_id());
  // An adopted connection ends as any other: its PD hears it.
  writer.fd.Reset();
  for (int i = 0;
       i < 500 && sink.CountOf(RecordingSink::Event::Kind::kDisconnected) == 0;
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  std::vector<RecordingSink::Event> events = sink.Events();
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().kind, RecordingSink::Event::Kind::kDisconnected);
  EXPECT_EQ(events.back().connection, writer.id);
}

// A handover called off after the freeze: the old device serves every
// connection again from where it stopped.
TEST_F(HandoverTest, ThawedConnectionsGoOnWhereTheyStopped) {
  SoftwareDevice& old = NewDevice();
  OnePage page = RegisterOnePage(old);
  ASSERT_FALSE(HasFailure());
  MemfdBuffer& buffer = *page.buffer;
  HalfWritten w =
      ConnectAndWriteHalf(old.Attributes().peer_address, page.ticket,
                          page.keys.rkey, kBase + 8, "still the old one");
  ASSERT_FALSE(HasFailure());
  std::vector<DeviceHandover::HandedOverPeer> frozen = FreezeWhen(
      old, [&](const std::vector<DeviceHandover::HandedOverPeer>& peers) {
        const DeviceHandover::HandedOverPeer* held =
            PeerWithId(peers, w.peer.id);
        return held != nullptr && held->received.size() == w.half;
      });
  ASSERT_EQ(frozen.size(), 1u);
  // Frozen: the rest of the frame is not read, nothing is answered.
  ASSERT_NO_FATAL_FAILURE(SendBytes(w.peer.fd.get(), w.frame.substr(w.half)));
  pollfd p{w.peer.fd.get(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 200), 0);
  EXPECT_NE(buffer.Bytes(8, 17), "still the old one");
  frozen.clear();  // the new process's copies are gone
  old.handover().ThawPeers();
  v1::PeerResponse reply;
  ASSERT_TRUE(peer::ReadFrame(w.peer.fd.get(), 1 << 20, &reply).ok());
  EXPECT_EQ(reply.status(), v1::PEER_SUCCESS) << reply.message();
  EXPECT_EQ(buffer.Bytes(8, 17), "still the old one");
}

// A peer operation still running when the freeze is asked for: the freeze
// waits for it, up to its timeout, then refuses HANDOVER_BUSY and leaves
// every connection served as before.
TEST_F(HandoverTest, APeerOperationInFlightRefusesTheFreeze) {
  absl::Notification entered;
  absl::Notification open;
  std::atomic<bool> held{false};
  SoftwareDeviceOptions options;
  options.peer_io_hook_for_test = [&] {
    if (held.exchange(true)) return;
    entered.Notify();
    open.WaitForNotification();
  };
  SoftwareDevice& old = NewDevice(options);
  OnePage page = RegisterOnePage(old);
  ASSERT_FALSE(HasFailure());
  MemfdBuffer& buffer = *page.buffer;
  const MrKeys* keys = &page.keys;
  const std::string& ticket = page.ticket;
  std::unique_ptr<SoftPeer> busy =
      Connect(old.Attributes().peer_address, ticket);
  std::unique_ptr<SoftPeer> other =
      Connect(old.Attributes().peer_address, ticket);
  ASSERT_NE(busy, nullptr);
  ASSERT_NE(other, nullptr);
  absl::StatusOr<std::string> in_flight;
  std::thread reader([&] { in_flight = busy->Read(keys->rkey, kBase, 8); });
  entered.WaitForNotification();
  EXPECT_THAT(old.handover().FreezePeers(absl::Milliseconds(200)).status(),
              IsMrdError(absl::StatusCode::kUnavailable, "HANDOVER_BUSY"));
  // Nothing stayed frozen: the other connection is served meanwhile.
  absl::StatusOr<std::string> read = other->Read(keys->rkey, kBase, 8);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, buffer.Bytes(0, 8));
  open.Notify();
  reader.join();
  ASSERT_TRUE(in_flight.ok()) << in_flight.status();
  // Once it is done, the freeze goes through, with both connections.
  absl::StatusOr<std::vector<DeviceHandover::HandedOverPeer>> frozen =
      old.handover().FreezePeers(absl::Seconds(5));
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  EXPECT_EQ(frozen->size(), 2u);
  old.handover().ThawPeers();
  EXPECT_TRUE(busy->Read(keys->rkey, kBase, 8).ok());
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
  ASSERT_TRUE(next.handover()
                  .AdoptMr(pd, held.Span(0, 64), kBase, kRemoteRw, keys->lkey,
                           keys->rkey)
                  .ok());
  const uint64_t pinned = next.PinnedBytes();
  const SoftwareDevice::ResourceCounts before = next.CountResources();
  ASSERT_EQ(pinned, PageSize());
  ASSERT_EQ(before.keys, 1u);
  const MemorySpan span = other.Span(0, other.size());

  auto expect_refused = [&](uint32_t lkey, uint32_t rkey, absl::StatusCode code,
                            const char* reason) {
    EXPECT_THAT(next.handover()
                    .AdoptMr(pd, span, kBase, kRemoteRw, lkey, rkey)
                    .status(),
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
      next.handover()
          .AdoptMr(pd, span, 0, kRemoteRw, free_key, free_key)
          .status(),
      IsMrdError(absl::StatusCode::kInvalidArgument, "ZERO_BASED_ADDRESS"));
  EXPECT_THAT(next.handover()
                  .AdoptMr(pd + 100, span, kBase, kRemoteRw, free_key, free_key)
                  .status(),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD"));
  EXPECT_EQ(next.PinnedBytes(), pinned);
  // The free key itself is fine.
  absl::StatusOr<MrKeys> adopted =
      next.handover().AdoptMr(pd, span, kBase, kRemoteRw, free_key, free_key);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->rkey, free_key);
  EXPECT_EQ(next.PinnedBytes(), pinned + other.size());
}

// Real kernel pins (io_uring or mlock, as the device would pin), counted.
class CountingPinOps final : public PinOps {
 public:
  CountingPinOps() {
    absl::StatusOr<std::unique_ptr<KernelPinOps>> ops =
        KernelPinOps::Create(KernelPinOptions{});
    EXPECT_TRUE(ops.ok()) << ops.status();
    if (ops.ok()) kernel_ = std::move(*ops);
  }
  int Lock(uint64_t address, uint64_t length) override {
    ++locks;
    return kernel_->Lock(address, length);
  }
  int Unlock(uint64_t address, uint64_t length) override {
    ++unlocks;
    return kernel_->Unlock(address, length);
  }
  std::atomic<int> locks{0};
  std::atomic<int> unlocks{0};

 private:
  std::unique_ptr<KernelPinOps> kernel_;
};

// The new process pins before the old one pauses (PinAhead); adopting the
// same span then takes that pin over and the kernel is not asked again.
TEST_F(HandoverTest, AdoptionsTakeOverThePinsMadeAheadOfThem) {
  const uint64_t ps = PageSize();
  SoftwareDevice& old = NewDevice();
  MemfdBuffer& buffer = NewBuffer(8);
  MemfdBuffer& late = NewBuffer(2, 3);  // registered after the pins ahead
  PdId old_pd = NewPd(old);
  absl::StatusOr<MrKeys> a =
      old.RegisterMr(old_pd, buffer.Span(0, 2 * ps), kBase, kRemoteRw);
  absl::StatusOr<MrKeys> b =
      old.RegisterMr(old_pd, buffer.Span(2 * ps, ps), kBase, kRemoteRw);
  absl::StatusOr<LogicalMapping> lam =
      old.BuildLam(old_pd, buffer.Span(4 * ps, 2 * ps));
  absl::StatusOr<MrKeys> c =
      old.RegisterMr(old_pd, late.Span(0, 2 * ps), kBase, kRemoteRw);
  ASSERT_TRUE(a.ok() && b.ok() && lam.ok() && c.ok());

  auto counting = std::make_unique<CountingPinOps>();
  CountingPinOps& ops = *counting;
  pin_ops_.push_back(std::move(counting));
  SoftwareDeviceOptions options;
  options.pin_ops = &ops;
  SoftwareDevice& next = Successor(old, options);
  // Ahead: a, b, the LAM, and a span the snapshot will no longer name.
  for (const MemorySpan& span :
       {buffer.Span(0, 2 * ps), buffer.Span(2 * ps, ps),
        buffer.Span(4 * ps, 2 * ps), buffer.Span(7 * ps, ps)}) {
    ASSERT_TRUE(next.handover().PinAhead(span).ok());
  }
  EXPECT_EQ(ops.locks, 4);
  EXPECT_EQ(next.handover().PinsAhead(), 4u);
  EXPECT_EQ(next.PinnedBytes(), 6 * ps);
  // Bad spans pin nothing.
  EXPECT_THAT(next.handover().PinAhead(buffer.Span(0, 0)),
              IsMrdError(absl::StatusCode::kInvalidArgument, "ZERO_LENGTH"));
  EXPECT_THAT(next.handover().PinAhead(MemorySpan{nullptr, ps, -1, 0}),
              IsMrdError(absl::StatusCode::kInvalidArgument, "INVALID_SPAN"));
  EXPECT_EQ(next.handover().PinsAhead(), 4u);

  PdId pd = NewPd(next);
  absl::StatusOr<MrKeys> adopted_a = next.handover().AdoptMr(
      pd, buffer.Span(0, 2 * ps), kBase, kRemoteRw, a->lkey, a->rkey);
  absl::StatusOr<MrKeys> adopted_b = next.handover().AdoptMr(
      pd, buffer.Span(2 * ps, ps), kBase, kRemoteRw, b->lkey, b->rkey);
  absl::StatusOr<LogicalMapping> adopted_lam = next.handover().AdoptLam(
      pd, buffer.Span(4 * ps, 2 * ps), lam->pages[0], lam->privileged_key);
  ASSERT_TRUE(adopted_a.ok()) << adopted_a.status();
  ASSERT_TRUE(adopted_b.ok()) << adopted_b.status();
  ASSERT_TRUE(adopted_lam.ok()) << adopted_lam.status();
  EXPECT_EQ(ops.locks, 4);  // taken over, not pinned again
  EXPECT_EQ(next.handover().PinsAhead(), 1u);
  // A registration made after the pins ahead: its adoption pins.
  absl::StatusOr<MrKeys> c_adopted = next.handover().AdoptMr(
      pd, late.Span(0, 2 * ps), kBase, kRemoteRw, c->lkey, c->rkey);
  ASSERT_TRUE(c_adopted.ok()) << c_adopted.status();
  EXPECT_EQ(ops.locks, 5);
  EXPECT_EQ(next.PinnedBytes(), 8 * ps);

  // What no adoption took is unpinned; what was taken stays pinned.
  next.handover().DropPinsAhead();
  EXPECT_EQ(next.handover().PinsAhead(), 0u);
  EXPECT_EQ(next.PinnedBytes(), 7 * ps);
  EXPECT_EQ(ops.unlocks, 1);
  // The adopted MR owns its pin: deregistering it unpins its pages.
  ASSERT_TRUE(next.DeregisterMr(adopted_a->mr).ok());
  EXPECT_EQ(next.PinnedBytes(), 5 * ps);
  next.handover().DropPinsAhead();  // nothing left: a no-op
  EXPECT_EQ(next.PinnedBytes(), 5 * ps);
}

// Pins ahead that nobody takes or drops are given back when the device
// goes (a takeover that died midway).
TEST_F(HandoverTest, ADeviceGoingDropsItsPinsAhead) {
  MemfdBuffer& buffer = NewBuffer(4);
  const uint64_t before = KernelPinnedBytesSettled(0);
  {
    absl::StatusOr<std::unique_ptr<SoftwareDevice>> device =
        SoftwareDevice::Create({});
    ASSERT_TRUE(device.ok()) << device.status();
    ASSERT_TRUE((*device)->Start().ok());
    ASSERT_TRUE((*device)->PinAhead(buffer.Span(0, 4 * PageSize())).ok());
    ASSERT_TRUE((*device)->PinAhead(buffer.Span(0, PageSize())).ok());
    EXPECT_EQ((*device)->PinsAhead(), 2u);
    EXPECT_EQ((*device)->PinnedBytes(), 4 * PageSize());
  }
  EXPECT_EQ(KernelPinnedBytesSettled(before), before);
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
    EXPECT_THAT(next.handover().AdoptPeerTicket(pd, bad),
                IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_TICKET"))
        << bad;
  }
  EXPECT_THAT(next.handover().AdoptPeerTicket(pd + 100, ticket),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD"));
  ASSERT_TRUE(next.handover().AdoptPeerTicket(pd, ticket).ok());
  // Again for the same PD: nothing changes.
  EXPECT_TRUE(next.handover().AdoptPeerTicket(pd, ticket).ok());
  EXPECT_EQ(next.CountModel().tickets, 1u);
  EXPECT_THAT(
      next.handover().AdoptPeerTicket(other_pd, ticket),
      IsMrdError(absl::StatusCode::kFailedPrecondition, "TICKET_IN_USE"));
  // The PD's own tickets stay valid beside the adopted one.
  const std::string own = Ticket(next, pd);
  EXPECT_NE(Connect(next.Attributes().peer_address, own), nullptr);
  EXPECT_NE(Connect(next.Attributes().peer_address, ticket), nullptr);
  // A ticket dies with its PD.
  ASSERT_TRUE(next.DeallocatePd(pd).ok());
  EXPECT_TRUE(next.handover().AdoptPeerTicket(other_pd, ticket).ok());
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
  ASSERT_TRUE(next.handover().AdoptPeerTicket(pd, ticket).ok());
  // Half the key space, adopted.
  std::vector<MrKeys> adopted;
  std::set<uint32_t> adopted_slots;
  for (int i = 0; i < 32; ++i) {
    absl::StatusOr<MrKeys> keys =
        old.RegisterMr(old_pd, buffer.Span(i * 64, 64), kBase, kRemoteRw);
    ASSERT_TRUE(keys.ok()) << keys.status();
    absl::StatusOr<MrKeys> mine = next.handover().AdoptMr(
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

  absl::StatusOr<UniqueFd> listener = device.handover().StopPeerAccepting();
  ASSERT_TRUE(listener.ok()) << listener.status();
  ASSERT_TRUE(listener->valid());
  // Stopped twice: another duplicate, still not accepting.
  absl::StatusOr<UniqueFd> again = device.handover().StopPeerAccepting();
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

  device.handover().ResumePeerAccepting();
  ASSERT_TRUE(Answered(waiting.get(), absl::Seconds(5)));
  EXPECT_EQ(HelloStatus(waiting.get()), v1::PEER_SUCCESS);
  EXPECT_NE(Connect(address, ticket), nullptr);
  device.handover()
      .ResumePeerAccepting();  // accepting already: nothing changes
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
  stopped.handover().ResumePeerAccepting();
  ASSERT_TRUE(Answered(waiting.get(), absl::Seconds(5)));
  EXPECT_EQ(HelloStatus(waiting.get()), v1::PEER_SUCCESS);
}

TEST_F(HandoverTest, AShutDownDeviceHasNoListenerToHandOver) {
  SoftwareDevice& device = NewDevice();
  device.Shutdown();
  EXPECT_THAT(device.handover().StopPeerAccepting().status(),
              IsMrdError(absl::StatusCode::kFailedPrecondition,
                         "PEER_LISTENER_STOPPED"));
  device.handover().ResumePeerAccepting();  // nothing to resume
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

// ---------------------------------------------------------------------------
// LAMs and MR objects.

// A LAM adopted at its logical addresses with its privileged key, then an MR
// object fast-registered over its pages, as DescribeFastMr gave it: a peer
// keeps reaching the memory through the old rkey, and the new device tears
// both down as its own.
TEST_F(HandoverTest, AdoptedLamAndFastRegisteredMrServeThroughTheOldRkey) {
  const uint64_t ps = PageSize();
  SoftwareDevice& old = NewDevice();
  MemfdBuffer& buffer = NewBuffer(4);
  PdId old_pd = NewPd(old);
  RecordingSink& old_sink = *sinks_.back();
  absl::StatusOr<LogicalMapping> lam =
      old.BuildLam(old_pd, buffer.Span(0, 4 * ps));
  ASSERT_TRUE(lam.ok()) << lam.status();
  absl::StatusOr<MrKeys> object = old.AllocateFastRegisterMr(old_pd, true, 8);
  ASSERT_TRUE(object.ok()) << object.status();
  const std::string ticket = Ticket(old, old_pd);
  std::unique_ptr<SoftPeer> old_peer =
      Connect(old.Attributes().peer_address, ticket);
  ASSERT_NE(old_peer, nullptr);
  const std::vector<uint64_t> pages = {lam->pages[3], lam->pages[1]};
  const uint32_t rkey = FastRegister(old, old_peer->connection_id(), old_sink,
                                     object->mr, pages, 2 * ps);
  absl::StatusOr<DeviceHandover::FastMrState> state =
      old.handover().DescribeFastMr(object->mr);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_TRUE(state->allow_remote);
  EXPECT_EQ(state->max_pages, 8u);
  EXPECT_EQ(state->rkey, rkey);
  EXPECT_EQ(state->lkey, old.QueryMr(object->mr)->lkey);
  EXPECT_TRUE(state->valid);
  EXPECT_EQ(state->pages, pages);
  EXPECT_EQ(state->fbo, 0u);
  EXPECT_EQ(state->length, 2 * ps);
  EXPECT_EQ(state->base_address, kBase);
  EXPECT_EQ(state->access, kRemoteRw);

  SoftwareDevice& next = Successor(old);
  PdId pd = NewPd(next);
  RecordingSink& sink = *sinks_.back();
  ASSERT_TRUE(next.handover().AdoptPeerTicket(pd, ticket).ok());
  absl::StatusOr<LogicalMapping> adopted_lam = next.handover().AdoptLam(
      pd, buffer.Span(0, 4 * ps), lam->pages[0], lam->privileged_key);
  ASSERT_TRUE(adopted_lam.ok()) << adopted_lam.status();
  EXPECT_EQ(adopted_lam->pages, lam->pages);
  EXPECT_EQ(adopted_lam->fbo, lam->fbo);
  EXPECT_EQ(adopted_lam->privileged_key, lam->privileged_key);
  absl::StatusOr<MrKeys> adopted =
      next.handover().AdoptFastRegisterMr(pd, *state);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->lkey, state->lkey);
  EXPECT_EQ(adopted->rkey, rkey);
  absl::StatusOr<MrKeys> queried = next.QueryMr(adopted->mr);
  ASSERT_TRUE(queried.ok()) << queried.status();
  EXPECT_EQ(queried->lkey, state->lkey);
  EXPECT_EQ(queried->rkey, rkey);
  // Described again in the new device, it is what it was.
  absl::StatusOr<DeviceHandover::FastMrState> again =
      next.handover().DescribeFastMr(adopted->mr);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->pages, pages);
  EXPECT_EQ(again->rkey, rkey);

  // VA page 0 is host page 3, VA page 1 is host page 1, as in the old one.
  std::unique_ptr<SoftPeer> peer =
      Connect(next.Attributes().peer_address, ticket);
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> data = peer->Read(rkey, kBase + ps - 8, 16);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, buffer.Bytes(4 * ps - 8, 8) + buffer.Bytes(ps, 8));
  ASSERT_TRUE(peer->Write(rkey, kBase + ps - 4, "ABCDEFGH").ok());
  EXPECT_EQ(buffer.Bytes(4 * ps - 4, 4), "ABCD");
  EXPECT_EQ(buffer.Bytes(ps, 4), "EFGH");
  // A remote access error puts the connection in error: another peer
  // checks the bounds.
  EXPECT_THAT(Connect(next.Attributes().peer_address, ticket)
                  ->Read(rkey, kBase + 2 * ps - 4, 5)
                  .status(),
              IsAccessError());

  // The adopted mapping holds the LAM as a fast registration does.
  EXPECT_EQ(next.CountModel().lam_fast_register_refs, 1u);
  EXPECT_THAT(next.ReleaseLam(adopted_lam->lam),
              IsMrdError(absl::StatusCode::kFailedPrecondition, "LAM_IN_USE"));
  Invalidate(next, peer->connection_id(), sink, adopted->mr);
  EXPECT_THAT(peer->Read(rkey, kBase, 8).status(), IsAccessError());
  ASSERT_TRUE(next.ReleaseLam(adopted_lam->lam).ok());
  ASSERT_TRUE(next.FreeFastRegisterMr(adopted->mr).ok());
  EXPECT_EQ(next.PinnedBytes(), 0u);
  const DeviceModel::ModelCounts counts = next.CountModel();
  EXPECT_EQ(counts.mrs, 0u);
  EXPECT_EQ(counts.valid_mrs, 0u);
  EXPECT_EQ(counts.lams, 0u);
  EXPECT_EQ(counts.iova_ranges, 0u);
  EXPECT_EQ(counts.lam_fast_register_refs, 0u);
  EXPECT_EQ(counts.pd_objects, 0u);
  EXPECT_EQ(next.CountResources().keys, 0u);
}

// A free MR object keeps its keys, matches nothing, and its next fast
// registration draws a new rkey as any would.
TEST_F(HandoverTest, AdoptedFreeMrObjectIsFastRegisteredLater) {
  const uint64_t ps = PageSize();
  SoftwareDevice& old = NewDevice();
  SoftwareDevice& next = NewDevice();
  MemfdBuffer& buffer = NewBuffer(2);
  PdId old_pd = NewPd(old);
  absl::StatusOr<MrKeys> object = old.AllocateFastRegisterMr(old_pd, true, 4);
  ASSERT_TRUE(object.ok()) << object.status();
  absl::StatusOr<DeviceHandover::FastMrState> state =
      old.handover().DescribeFastMr(object->mr);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_FALSE(state->valid);
  EXPECT_TRUE(state->pages.empty());
  EXPECT_EQ(state->rkey, object->rkey);

  PdId pd = NewPd(next);
  RecordingSink& sink = *sinks_.back();
  absl::StatusOr<MrKeys> adopted =
      next.handover().AdoptFastRegisterMr(pd, *state);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->lkey, object->lkey);
  EXPECT_EQ(adopted->rkey, object->rkey);
  EXPECT_EQ(next.CountModel().valid_mrs, 0u);
  absl::StatusOr<LogicalMapping> lam =
      next.BuildLam(pd, buffer.Span(0, 2 * ps));
  ASSERT_TRUE(lam.ok()) << lam.status();
  const std::string ticket = Ticket(next, pd);
  std::unique_ptr<SoftPeer> peer =
      Connect(next.Attributes().peer_address, ticket);
  ASSERT_NE(peer, nullptr);
  // Another peer: an access error puts its connection in error.
  EXPECT_THAT(Connect(next.Attributes().peer_address, ticket)
                  ->Read(object->rkey, kBase, 8)
                  .status(),
              IsAccessError());

  const uint32_t rkey = FastRegister(next, peer->connection_id(), sink,
                                     adopted->mr, lam->pages, 2 * ps);
  EXPECT_NE(rkey, object->rkey);
  EXPECT_EQ(rkey >> 8, object->rkey >> 8);
  absl::StatusOr<std::string> data = peer->Read(rkey, kBase + ps, 8);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, buffer.Bytes(ps, 8));
  EXPECT_THAT(peer->Read(object->rkey, kBase, 8).status(), IsAccessError());
  ASSERT_TRUE(next.FreeFastRegisterMr(adopted->mr).ok());
  ASSERT_TRUE(next.ReleaseLam(lam->lam).ok());
  EXPECT_EQ(next.PinnedBytes(), 0u);
  EXPECT_EQ(next.CountModel().mrs, 0u);
}

TEST_F(HandoverTest, RefusedLamAndMrObjectAdoptionsLeaveNothing) {
  const uint64_t ps = PageSize();
  SoftwareDevice& old = NewDevice();
  SoftwareDevice& next = NewDevice();
  MemfdBuffer& held = NewBuffer(2);
  MemfdBuffer& other = NewBuffer(1, 2);
  PdId old_pd = NewPd(old);
  RecordingSink& old_sink = *sinks_.back();
  absl::StatusOr<LogicalMapping> lam =
      old.BuildLam(old_pd, held.Span(0, 2 * ps));
  ASSERT_TRUE(lam.ok()) << lam.status();
  absl::StatusOr<LogicalMapping> lam2 = old.BuildLam(old_pd, other.Span(0, ps));
  ASSERT_TRUE(lam2.ok()) << lam2.status();
  absl::StatusOr<MrKeys> object = old.AllocateFastRegisterMr(old_pd, true, 2);
  ASSERT_TRUE(object.ok()) << object.status();
  std::unique_ptr<SoftPeer> old_peer =
      Connect(old.Attributes().peer_address, Ticket(old, old_pd));
  ASSERT_NE(old_peer, nullptr);
  FastRegister(old, old_peer->connection_id(), old_sink, object->mr,
               {lam->pages[0]}, ps);
  absl::StatusOr<DeviceHandover::FastMrState> state =
      old.handover().DescribeFastMr(object->mr);
  ASSERT_TRUE(state.ok()) << state.status();

  PdId pd = NewPd(next);
  ASSERT_TRUE(next.handover()
                  .AdoptLam(pd, held.Span(0, 2 * ps), lam->pages[0],
                            lam->privileged_key)
                  .ok());
  const uint64_t pinned = next.PinnedBytes();
  const SoftwareDevice::ResourceCounts before = next.CountResources();
  ASSERT_EQ(pinned, 2 * ps);
  const MemorySpan span = other.Span(0, ps);
  const uint32_t key2 = lam2->privileged_key;
  auto expect_nothing_left = [&](const char* what) {
    EXPECT_EQ(next.PinnedBytes(), pinned) << what;
    const SoftwareDevice::ResourceCounts after = next.CountResources();
    EXPECT_EQ(after.keys, before.keys) << what;
    EXPECT_EQ(after.mrs, before.mrs) << what;
    EXPECT_EQ(after.lams, before.lams) << what;
    EXPECT_EQ(after.iova_ranges, before.iova_ranges) << what;
    EXPECT_EQ(after.pd_objects, before.pd_objects) << what;
    EXPECT_EQ(after.lam_fast_register_refs, before.lam_fast_register_refs)
        << what;
  };
  const auto bad_iova =
      IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_IOVA");
  // Overlapping the adopted LAM's range, at its second page.
  EXPECT_THAT(next.handover().AdoptLam(pd, span, lam->pages[1], key2).status(),
              bad_iova);
  expect_nothing_left("overlap");
  EXPECT_THAT(
      next.handover().AdoptLam(pd, span, lam2->pages[0] + 8, key2).status(),
      bad_iova);
  expect_nothing_left("misaligned");
  EXPECT_THAT(next.handover().AdoptLam(pd, span, 0, key2).status(), bad_iova);
  expect_nothing_left("zero");
  EXPECT_THAT(
      next.handover().AdoptLam(pd, span, uint64_t{1} << 63, key2).status(),
      bad_iova);
  expect_nothing_left("past the limit");
  // The adopted LAM holds this key.
  EXPECT_THAT(next.handover()
                  .AdoptLam(pd, span, lam2->pages[0], lam->privileged_key)
                  .status(),
              IsMrdError(absl::StatusCode::kFailedPrecondition, "KEY_IN_USE"));
  expect_nothing_left("key in use");

  // Its page names a LAM this device never adopted.
  DeviceHandover::FastMrState unmapped = *state;
  unmapped.pages = {lam2->pages[0]};
  EXPECT_THAT(next.handover().AdoptFastRegisterMr(pd, unmapped).status(),
              IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "PAGE_NOT_MAPPED"));
  expect_nothing_left("page not mapped");
  DeviceHandover::FastMrState in_use = *state;
  in_use.lkey = in_use.rkey = lam->privileged_key;
  EXPECT_THAT(next.handover().AdoptFastRegisterMr(pd, in_use).status(),
              IsMrdError(absl::StatusCode::kFailedPrecondition, "KEY_IN_USE"));
  expect_nothing_left("MR key in use");
  DeviceHandover::FastMrState two_keys = *state;
  two_keys.lkey ^= 1;
  EXPECT_THAT(next.handover().AdoptFastRegisterMr(pd, two_keys).status(),
              IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_KEY"));
  expect_nothing_left("lkey != rkey");

  // Nothing was left behind: the right ones still go in.
  absl::StatusOr<MrKeys> adopted =
      next.handover().AdoptFastRegisterMr(pd, *state);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->rkey, state->rkey);
  absl::StatusOr<LogicalMapping> adopted2 =
      next.handover().AdoptLam(pd, span, lam2->pages[0], key2);
  ASSERT_TRUE(adopted2.ok()) << adopted2.status();
  EXPECT_EQ(adopted2->pages, lam2->pages);
  // Freeing a fast-registered MR object drops its hold on the LAM.
  ASSERT_TRUE(next.FreeFastRegisterMr(adopted->mr).ok());
  EXPECT_EQ(next.CountModel().lam_fast_register_refs, 0u);
}

TEST_F(HandoverTest, NewLamsGoAboveTheOldDevicesWatermark) {
  const uint64_t ps = PageSize();
  SoftwareDevice& old = NewDevice();
  SoftwareDevice& next = NewDevice();
  MemfdBuffer& buffer = NewBuffer(2);
  PdId old_pd = NewPd(old);
  absl::StatusOr<LogicalMapping> lam =
      old.BuildLam(old_pd, buffer.Span(0, 2 * ps));
  ASSERT_TRUE(lam.ok()) << lam.status();
  const uint64_t watermark = old.handover().LogicalAddressWatermark();
  EXPECT_GT(watermark, lam->pages.back());

  PdId pd = NewPd(next);
  ASSERT_TRUE(next.handover()
                  .AdoptLam(pd, buffer.Span(0, 2 * ps), lam->pages[0],
                            lam->privileged_key)
                  .ok());
  EXPECT_GE(next.handover().LogicalAddressWatermark(), lam->pages.back() + ps);
  next.handover().ContinueLogicalAddressesAbove(watermark);
  EXPECT_GE(next.handover().LogicalAddressWatermark(), watermark);
  // Never lowered.
  next.handover().ContinueLogicalAddressesAbove(ps);
  EXPECT_GE(next.handover().LogicalAddressWatermark(), watermark);
  absl::StatusOr<LogicalMapping> fresh =
      next.BuildLam(pd, buffer.Span(0, 2 * ps));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_GT(fresh->pages[0], watermark);  // after a guard gap
}

TEST_F(HandoverTest, DescribeFastMrKnowsOnlyMrObjects) {
  SoftwareDevice& device = NewDevice();
  MemfdBuffer& buffer = NewBuffer(1);
  PdId pd = NewPd(device);
  absl::StatusOr<MrKeys> keys =
      device.RegisterMr(pd, buffer.Span(0, 64), kBase, kRemoteRw);
  ASSERT_TRUE(keys.ok()) << keys.status();
  const auto unknown = IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR");
  EXPECT_THAT(device.handover().DescribeFastMr(keys->mr).status(), unknown);
  EXPECT_THAT(device.handover().DescribeFastMr(keys->mr + 12345).status(),
              unknown);
  absl::StatusOr<MrKeys> object = device.AllocateFastRegisterMr(pd, false, 1);
  ASSERT_TRUE(object.ok()) << object.status();
  ASSERT_TRUE(device.FreeFastRegisterMr(object->mr).ok());
  EXPECT_THAT(device.handover().DescribeFastMr(object->mr).status(), unknown);
}

// ---------------------------------------------------------------------------
// IovaSpace's handover calls.

// The old device keeps accepting after DuplicatePeerListener: the new
// process opens its device on the copy long before the old one stops.
TEST_F(HandoverTest, DuplicatePeerListenerLeavesTheOldDeviceAccepting) {
  SoftwareDevice& old = NewDevice();
  OnePage page = RegisterOnePage(old);
  ASSERT_FALSE(HasFailure());
  absl::StatusOr<UniqueFd> copy = old.handover().DuplicatePeerListener();
  ASSERT_TRUE(copy.ok()) << copy.status();
  SoftwareDeviceOptions options;
  options.inherited_peer_listener = copy->get();
  absl::StatusOr<std::unique_ptr<SoftwareDevice>> next =
      SoftwareDevice::Create(options);
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE((*next)->StopPeerAccepting().ok());  // as a takeover does
  ASSERT_TRUE((*next)->Start().ok());
  EXPECT_EQ((*next)->Attributes().peer_address, old.Attributes().peer_address);
  // Peers arriving now are the old device's.
  for (int i = 0; i < 3; ++i) {
    std::unique_ptr<SoftPeer> peer =
        Connect(old.Attributes().peer_address, page.ticket);
    ASSERT_NE(peer, nullptr);
    EXPECT_TRUE(peer->Read(page.keys.rkey, kBase, 8).ok());
  }
  (*next)->Shutdown();
  // The new device's end closed only its own fd of the socket.
  std::unique_ptr<SoftPeer> after =
      Connect(old.Attributes().peer_address, page.ticket);
  ASSERT_NE(after, nullptr);
  EXPECT_TRUE(after->Read(page.keys.rkey, kBase, 8).ok());
}

// AdoptPeer needs the connection's socket.
TEST_F(HandoverTest, AdoptPeerWithoutItsSocketIsRefused) {
  SoftwareDevice& next = NewDevice();
  PdId pd = NewPd(next);
  DeviceHandover::HandedOverPeer peer;
  peer.id = 5;
  peer.remote = "127.0.0.1:1";
  EXPECT_THAT(
      next.handover().AdoptPeer(pd, std::move(peer)),
      IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_CONNECTION"));
}

// What PeerListener::AdoptConnection refuses: a connection while the
// listener is not frozen, and one whose bytes in flight no frame can be.
TEST(PeerListenerHandoverTest, AdoptConnectionRefusesWhatItCannotServe) {
  PeerListenerOptions options;
  absl::StatusOr<std::unique_ptr<PeerListener>> listener =
      PeerListener::Bind("127.0.0.1:0", options);
  ASSERT_TRUE(listener.ok()) << listener.status();
  PeerListener::Handler handler;
  handler.open = [](int, const std::string&) -> std::shared_ptr<void> {
    return std::make_shared<int>(0);
  };
  handler.frame = [](const std::shared_ptr<void>&, absl::StatusOr<std::string>,
                     std::string*) { return PeerListener::Verdict{}; };
  handler.close = [](const std::shared_ptr<void>&) {};
  ASSERT_TRUE((*listener)->Start(handler).ok());
  std::vector<UniqueFd> peer_ends;
  // A connected socket to hand in (the test keeps the other end).
  auto held = [&](std::string received, std::string unsent = "") {
    int pair[2] = {-1, -1};
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    peer_ends.emplace_back(pair[1]);
    PeerListener::HeldConnection h;
    h.fd = UniqueFd(pair[0]);
    h.remote = "test";
    h.authenticated = true;
    h.received = std::move(received);
    h.unsent = std::move(unsent);
    return h;
  };
  auto header = [](uint32_t length) {
    std::string h(peer::kFrameHeaderBytes, '\0');
    for (size_t i = 0; i < h.size(); ++i) {
      h[i] = static_cast<char>((length >> (8 * i)) & 0xff);
    }
    return h;
  };
  EXPECT_THAT((*listener)->AdoptConnection(held(""), nullptr),
              IsMrdError(absl::StatusCode::kFailedPrecondition,
                         "PEER_LISTENER_NOT_FROZEN"));
  absl::StatusOr<std::vector<PeerListener::HeldConnection>> frozen =
      (*listener)->FreezeConnections(absl::Seconds(5));
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  EXPECT_TRUE(frozen->empty());
  const auto bad =
      IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_CONNECTION");
  PeerListener::HeldConnection no_socket;
  EXPECT_THAT((*listener)->AdoptConnection(std::move(no_socket), nullptr), bad);
  // A frame of no bytes, one past the limit, one read whole already.
  EXPECT_THAT((*listener)->AdoptConnection(held(header(0)), nullptr), bad);
  EXPECT_THAT((*listener)->AdoptConnection(
                  held(header(options.max_frame_bytes + 1)), nullptr),
              bad);
  EXPECT_THAT((*listener)->AdoptConnection(held(header(3) + "abc"), nullptr),
              bad);
  // A frame both being read and answered.
  EXPECT_THAT(
      (*listener)->AdoptConnection(held(header(8) + "ab", "reply"), nullptr),
      bad);
  EXPECT_EQ((*listener)->Stats().connections, 0u);
  // A frame read in part is fine.
  EXPECT_TRUE(
      (*listener)->AdoptConnection(held(header(8) + "ab"), nullptr).ok());
  EXPECT_EQ((*listener)->Stats().connections, 1u);
  (*listener)->ThawConnections();
  (*listener)->Stop();
}

TEST(IovaSpaceHandoverTest, AllocateAtTakesExactlyTheRangeGiven) {
  constexpr uint64_t kPs = 4096;
  IovaSpace space(kPs, 1000 * kPs, 2000 * kPs);
  // Below the space's own start: the other process drew its own.
  ASSERT_TRUE(space.AllocateAt(10 * kPs, 3, 7).ok());
  EXPECT_EQ(space.ranges(), 1u);
  std::optional<IovaSpace::Hit> hit = space.Lookup(12 * kPs + 5);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->owner, 7u);
  EXPECT_EQ(hit->page_index, 2u);
  EXPECT_FALSE(space.Lookup(13 * kPs).has_value());
  // Below the watermark it changes nothing.
  EXPECT_EQ(space.watermark(), 1000 * kPs);
  // Ranges may touch: an adopted range has no guard of its own.
  EXPECT_TRUE(space.AllocateAt(13 * kPs, 1, 8).ok());
  EXPECT_TRUE(space.AllocateAt(9 * kPs, 1, 9).ok());
  // Above it, the watermark follows: Allocate hands out what lies beyond.
  ASSERT_TRUE(space.AllocateAt(1500 * kPs, 2, 10).ok());
  EXPECT_EQ(space.watermark(), 1502 * kPs);
  absl::StatusOr<uint64_t> next = space.Allocate(1, 1, 11);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, 1503 * kPs);
}

TEST(IovaSpaceHandoverTest, AllocateAtRefusesBadRangesAndChangesNothing) {
  constexpr uint64_t kPs = 4096;
  IovaSpace space(kPs, 1000 * kPs, 2000 * kPs);
  ASSERT_TRUE(space.AllocateAt(100 * kPs, 4, 1).ok());
  const auto bad = IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_IOVA");
  EXPECT_THAT(space.AllocateAt(0, 1, 2), bad);
  EXPECT_THAT(space.AllocateAt(50 * kPs + 1, 1, 2), bad);
  EXPECT_THAT(space.AllocateAt(1999 * kPs, 2, 2), bad);  // past the limit
  EXPECT_THAT(space.AllocateAt(2000 * kPs, 1, 2), bad);
  EXPECT_THAT(space.AllocateAt(~uint64_t{0} / kPs * kPs, 1, 2), bad);
  EXPECT_THAT(space.AllocateAt(100 * kPs, 1, 2), bad);  // same start
  EXPECT_THAT(space.AllocateAt(103 * kPs, 1, 2), bad);  // its last page
  EXPECT_THAT(space.AllocateAt(98 * kPs, 3, 2), bad);   // into its first
  EXPECT_THAT(space.AllocateAt(99 * kPs, 10, 2), bad);  // all around it
  EXPECT_EQ(space.ranges(), 1u);
  EXPECT_EQ(space.watermark(), 1000 * kPs);
}

TEST(IovaSpaceHandoverTest, ContinueAboveRaisesTheWatermarkToAPage) {
  constexpr uint64_t kPs = 4096;
  IovaSpace space(kPs, 1000 * kPs, 2000 * kPs);
  space.ContinueAbove(10 * kPs);  // never lowered
  EXPECT_EQ(space.watermark(), 1000 * kPs);
  space.ContinueAbove(1200 * kPs + 1);
  EXPECT_EQ(space.watermark(), 1201 * kPs);
  absl::StatusOr<uint64_t> start = space.Allocate(1, 1, 1);
  ASSERT_TRUE(start.ok());
  EXPECT_EQ(*start, 1202 * kPs);
  // Beyond the limit: the space is used up, not wrapped around.
  space.ContinueAbove(~uint64_t{0});
  EXPECT_EQ(space.watermark(), 2000 * kPs);
  EXPECT_THAT(
      space.Allocate(1, 0, 2).status(),
      IsSeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "IOVA_EXHAUSTED"));
}

}  // namespace
}  // namespace mrd::device
