// Tests of the verbs device against a real RDMA device, with VerbsPeer as the
// remote side. They need an RDMA device: run them inside the Soft-RoCE VM
//   tests/vm/run.sh --rw BUILD -- BUILD/tests/unit/device/verbs_device_test
// which sets MRD_VERBS_DEVICE (rxe0) and MRD_VERBS_ADDRESS (10.77.0.1). With
// no device, or without MRD_VERBS_ADDRESS, every test FAILS (never skips):
// ctest runs them only under the "verbs" label, which the host run excludes.
//
// Peers connect to the device's own address (loopback through rxe). Any
// access error breaks a peer's queue pair, so tests post fast registrations
// on one peer's connection and probe with separate, disposable peers.
#include "server/device/verbs/verbs_device.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/peer/verbs_peer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mrd/unique_fd.h"
#include "server/device/device_handover.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::device {
namespace {

using ::mrd::device::testing::IsMrdError;
using ::mrd::device::testing::IsSeedError;
using ::mrd::device::testing::MemfdBuffer;
using ::mrd::device::testing::PageSize;
using ::mrd::device::testing::RecordingSink;
using ::mrd::peer::VerbsPeer;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Property;
using Event = RecordingSink::Event;

constexpr uint32_t kRemoteRw =
    kAccessLocalWrite | kAccessRemoteRead | kAccessRemoteWrite;
constexpr uint64_t kBase = uint64_t{0x5000} << 32;  // page-aligned, non-zero

::testing::Matcher<absl::Status> IsAccessError() {
  return IsMrdError(absl::StatusCode::kPermissionDenied, "REMOTE_ACCESS_ERROR");
}
::testing::Matcher<absl::Status> IsConnectionInvalid() {
  return IsSeedError(::mrd::STATUS_CONNECTION_INVALID, "CONNECTION_INVALID");
}
// A token that no longer works: refused by the adapter, or the connection
// is already gone.
::testing::Matcher<absl::Status> IsDead() {
  return AnyOf(IsAccessError(),
               Property(&absl::Status::code, absl::StatusCode::kUnavailable));
}

// Pinned memory as the kernel accounts it for ibv_reg_mr (VmPin in
// /proc/self/status), in bytes.
uint64_t VmPinBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmPin:", 0) != 0) continue;
    std::vector<std::string> parts =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t kib = 0;
    if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kib)) {
      return kib * 1024;
    }
  }
  return ~uint64_t{0};
}

// The network interface under `device`'s port 1 (Soft-RoCE: mrd0), or "".
std::string PortNetdev(const std::string& device) {
  std::ifstream in("/sys/class/infiniband/" + device +
                   "/ports/1/gid_attrs/ndevs/0");
  std::string name;
  std::getline(in, name);
  return name;
}

// Polls `healthy()` of the device until it equals `want` (10 s at most).
template <typename Device>
bool WaitForHealth(const Device& device, bool want) {
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (device.Health().healthy != want) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

class VerbsDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    vm_pin_before_ = VmPinBytes();
    StartDevice(VerbsDeviceOptions{});
  }

  // Every test is a leak test: after its PDs go, nothing stays pinned, for
  // the device's accounting and for the kernel's.
  void TearDown() override {
    peers_.clear();
    if (device_ != nullptr) {
      for (PdId pd : pds_) {
        absl::Status status = device_->DeallocatePd(pd);
        EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kNotFound)
            << status;
      }
      EXPECT_EQ(device_->PinnedBytes(), 0u);
      device_.reset();
    }
    EXPECT_EQ(VmPinBytes(), vm_pin_before_);
  }

  void StartDevice(VerbsDeviceOptions options) {
    peers_.clear();
    if (device_ != nullptr) {
      for (PdId pd : std::exchange(pds_, {})) {
        ASSERT_TRUE(device_->DeallocatePd(pd).ok());
      }
      device_.reset();
    }
    const char* name = std::getenv("MRD_VERBS_DEVICE");
    const char* address = std::getenv("MRD_VERBS_ADDRESS");
    ASSERT_NE(address, nullptr)
        << "MRD_VERBS_ADDRESS is not set: run this test in the Soft-RoCE VM "
           "(tests/vm/run.sh), which sets it";
    ASSERT_FALSE(ListVerbsDevices().empty())
        << "no RDMA device: run this test in the Soft-RoCE VM "
           "(tests/vm/run.sh)";
    options.device_name = name != nullptr ? name : "";
    options.peer_address = absl::StrCat(address, ":0");
    absl::StatusOr<std::unique_ptr<VerbsDevice>> device =
        VerbsDevice::Create(options);
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

  absl::StatusOr<std::unique_ptr<VerbsPeer>> TryConnect(PdId pd) {
    MRD_ASSIGN_OR_RETURN(std::string ticket, device_->CreatePeerTicket(pd));
    return VerbsPeer::Connect(device_->Attributes().peer_address, ticket);
  }
  // A connected peer, owned by the fixture; waits for OnPeerConnected.
  VerbsPeer* Connect(PdId pd, RecordingSink* sink) {
    size_t before = sink->CountOf(Event::Kind::kConnected);
    absl::StatusOr<std::unique_ptr<VerbsPeer>> peer = TryConnect(pd);
    EXPECT_TRUE(peer.ok()) << peer.status();
    if (!peer.ok()) return nullptr;
    EXPECT_TRUE(sink->WaitFor(Event::Kind::kConnected, before + 1));
    peers_.push_back(std::move(*peer));
    return peers_.back().get();
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

  std::vector<std::unique_ptr<RecordingSink>> sinks_;
  std::vector<std::unique_ptr<MemfdBuffer>> buffers_;
  std::unique_ptr<VerbsDevice> device_;
  std::vector<std::unique_ptr<VerbsPeer>> peers_;  // go before the device
  std::vector<PdId> pds_;
  uint64_t vm_pin_before_ = 0;
};

// ---------------------------------------------------------------------------
// Attributes and lifecycle.

TEST_F(VerbsDeviceTest, AttributesDescribeTheAdapter) {
  const DeviceAttributes& attributes = device_->Attributes();
  const char* name = std::getenv("MRD_VERBS_DEVICE");
  if (name != nullptr && *name != '\0') {
    EXPECT_EQ(attributes.name, name);
  }
  EXPECT_EQ(attributes.kind, "verbs");
  EXPECT_EQ(attributes.page_size, PageSize());
  EXPECT_GE(attributes.max_mr_size, uint64_t{1} << 30);
  EXPECT_GT(attributes.max_page_list_length, 0u);
  EXPECT_EQ(attributes.adapter_flags, kAdapterFlagReadSinkNotRequired);
  EXPECT_THAT(attributes.peer_address,
              HasSubstr(absl::StrCat(std::getenv("MRD_VERBS_ADDRESS"), ":")));
  EXPECT_FALSE(absl::EndsWith(attributes.peer_address, ":0"));
  // The GID peers address, as the directory's Mooncake layout writes it.
  EXPECT_THAT(attributes.gid,
              ::testing::MatchesRegex("([0-9a-f]{2}:){15}[0-9a-f]{2}"))
      << "lid " << attributes.lid;
  // rdma_cm's source GID: RoCE's for the address mrd listens on, IPv4
  // mapped.
  in_addr ip{};
  ASSERT_EQ(inet_pton(AF_INET, std::getenv("MRD_VERBS_ADDRESS"), &ip), 1);
  const auto* b = reinterpret_cast<const uint8_t*>(&ip.s_addr);
  EXPECT_EQ(attributes.gid,
            absl::StrFormat("00:00:00:00:00:00:00:00:00:00:ff:ff:%02x:%02x:"
                            "%02x:%02x",
                            b[0], b[1], b[2], b[3]));
  EXPECT_GT(device_->max_message_size(), 0u);
  DeviceHealth health = device_->Health();
  EXPECT_TRUE(health.healthy) << health.message;
  EXPECT_EQ(device_->PinnedBytes(), 0u);
}

// Live handover: verbs objects cannot outlive this process, so every
// handover call is refused with one reason, and pins nothing.
TEST_F(VerbsDeviceTest, HandoverIsRefusedAsUnsupported) {
  const auto unsupported = IsMrdError(absl::StatusCode::kFailedPrecondition,
                                      "HANDOVER_UNSUPPORTED_DEVICE");
  EXPECT_THAT(device_->handover().CanHandOver(), unsupported);
  EXPECT_THAT(device_->handover().CanHandOver().message(),
              HasSubstr("ibv_import_device"));
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  EXPECT_THAT(
      device_
          ->AdoptMr(pd, buffer.Span(0, 64), kBase,
                    kAccessLocalWrite | kAccessRemoteRead, 0x1234, 0x1234)
          .status(),
      unsupported);
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  absl::StatusOr<std::string> ticket = device_->CreatePeerTicket(pd);
  ASSERT_TRUE(ticket.ok());
  EXPECT_THAT(device_->handover().AdoptPeerTicket(pd, *ticket), unsupported);
  absl::StatusOr<MrKeys> object = device_->AllocateFastRegisterMr(pd, true, 1);
  ASSERT_TRUE(object.ok()) << object.status();
  EXPECT_THAT(device_->handover().DescribeFastMr(object->mr).status(),
              unsupported);
  EXPECT_THAT(
      device_
          ->AdoptLam(pd, buffer.Span(0, PageSize()), uint64_t{1} << 40, 0x1234)
          .status(),
      unsupported);
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  DeviceHandover::FastMrState state;
  state.max_pages = 1;
  state.lkey = state.rkey = 0x1234;
  EXPECT_THAT(device_->handover().AdoptFastRegisterMr(pd, state).status(),
              unsupported);
  ASSERT_TRUE(device_->FreeFastRegisterMr(object->mr).ok());
  EXPECT_THAT(device_->handover().StopPeerAccepting().status(), unsupported);
  device_->handover().ResumePeerAccepting();  // nothing to resume
  // Still accepting peers.
  EXPECT_TRUE(TryConnect(pd).ok());
}

TEST_F(VerbsDeviceTest, UnknownDeviceNameIsNotFoundAndNamesTheDevices) {
  VerbsDeviceOptions options;
  options.device_name = "no-such-rdma-device";
  options.peer_address = absl::StrCat(std::getenv("MRD_VERBS_ADDRESS"), ":0");
  absl::StatusOr<std::unique_ptr<VerbsDevice>> device =
      VerbsDevice::Create(options);
  EXPECT_THAT(device.status(),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_VERBS_DEVICE"));
  EXPECT_THAT(std::string(device.status().message()),
              HasSubstr(ListVerbsDevices().front()));
}

TEST_F(VerbsDeviceTest, ShutdownClosesPeersAndIsIdempotent) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, PageSize(), kRemoteRw);
  VerbsPeer* peer = Connect(pd, sink);
  ASSERT_NE(peer, nullptr);
  ASSERT_TRUE(peer->Read(keys.rkey, kBase, 8).ok());
  device_->Shutdown();
  device_->Shutdown();
  EXPECT_FALSE(device_->Health().healthy);
  EXPECT_TRUE(sink->WaitFor(Event::Kind::kDisconnected, 1));
  EXPECT_THAT(peer->Read(keys.rkey, kBase, 8).status(),
              Property(&absl::Status::code, absl::StatusCode::kUnavailable));
}

// A Soft-RoCE device of the test's own, on a dummy interface of its own,
// deleted with it at the end of the test: a test that takes a port down or
// deletes a device leaves rxe0, which the tests beside it use, alone. (An
// rdma_cm connect made while an rxe device's interface is down breaks every
// later connect on that device until it is deleted and added again:
// Debian's 6.1 rdma_rxe, with plain rping too.) `prefix` and `subnet` keep
// the tests that make one apart; the pid keeps processes apart.
struct OwnRxeDevice {
  std::string netdev;
  std::string rdma;
  std::string address;
  std::unique_ptr<VerbsDevice> device;

  // Adds the interface and the rxe device and opens and starts a
  // VerbsDevice on it (fatal failures on error; `device` null then).
  void Create(absl::string_view prefix, int subnet) {
    const int tag = static_cast<int>(getpid() % 250);
    netdev = absl::StrCat("mrd", prefix, tag);
    rdma = absl::StrCat("rxe", prefix, tag);
    address = absl::StrCat("10.", subnet, ".", tag, ".1");
    ASSERT_EQ(std::system(absl::StrCat("ip link add ", netdev,
                                       " type dummy && ip addr add ", address,
                                       "/24 dev ", netdev, " && ip link set ",
                                       netdev, " up && rdma link add ", rdma,
                                       " type rxe netdev ", netdev)
                              .c_str()),
              0);
    VerbsDeviceOptions options;
    options.device_name = rdma;
    options.peer_address = address + ":0";
    absl::StatusOr<std::unique_ptr<VerbsDevice>> created =
        VerbsDevice::Create(options);
    ASSERT_TRUE(created.ok()) << created.status();
    ASSERT_TRUE((*created)->Start().ok());
    device = std::move(*created);
    ASSERT_TRUE(WaitForHealth(*device, true)) << device->Health().message;
  }
  // The device's deletion waits until every process has closed its
  // context, and librdmacm keeps this process's open until it exits (or
  // the device is removed under it): the device and then its interface go
  // in the background, once this process has exited (at once when a test
  // deleted the device itself).
  ~OwnRxeDevice() {
    if (device != nullptr) device->Shutdown();
    device.reset();
    if (netdev.empty()) return;
    (void)std::system(absl::StrCat("(rdma link delete ", rdma, "; ip link del ",
                                   netdev, ") >/dev/null 2>&1 &")
                          .c_str());
  }
};

// The async-event thread: PORT_ERR makes the device unhealthy, PORT_ACTIVE
// healthy again. Takes the port's interface down and up (root, as in the
// VM), on a device of the test's own: no peer connects while it is down.
TEST_F(VerbsDeviceTest, PortDownMakesTheDeviceUnhealthyUntilItIsUpAgain) {
  ASSERT_EQ(geteuid(), 0u) << "needs root to take the interface down";
  RecordingSink sink;  // outlives the device
  OwnRxeDevice own;
  ASSERT_NO_FATAL_FAILURE(own.Create("pd", 80));
  VerbsDevice& device = *own.device;
  ASSERT_EQ(PortNetdev(own.rdma), own.netdev);
  ASSERT_EQ(std::system(("ip link set dev " + own.netdev + " down").c_str()),
            0);
  bool went_down = WaitForHealth(device, false);
  DeviceHealth down = device.Health();
  // Up again before any assertion can end the test.
  ASSERT_EQ(std::system(("ip link set dev " + own.netdev + " up").c_str()), 0);
  EXPECT_TRUE(went_down);
  EXPECT_THAT(down.message, HasSubstr("port 1 is down"));
  EXPECT_TRUE(WaitForHealth(device, true)) << device.Health().message;
  // Registration works throughout; the port is back for peers.
  absl::StatusOr<PdId> pd = device.AllocatePd(&sink);
  ASSERT_TRUE(pd.ok()) << pd.status();
  MemfdBuffer& buffer = NewBuffer(1);
  absl::StatusOr<MrKeys> keys =
      device.RegisterMr(*pd, buffer.Span(0, PageSize()), kBase, kRemoteRw);
  ASSERT_TRUE(keys.ok()) << keys.status();
  absl::StatusOr<std::string> ticket = device.CreatePeerTicket(*pd);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  absl::StatusOr<std::unique_ptr<VerbsPeer>> peer =
      VerbsPeer::Connect(device.Attributes().peer_address, *ticket);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_TRUE((*peer)->Read(keys->rkey, kBase, 8).ok());
  peer->reset();
  EXPECT_TRUE(device.DeregisterMr(keys->mr).ok());
  EXPECT_TRUE(device.DeallocatePd(*pd).ok());
}

// Device loss: a Soft-RoCE device of the test's own (so that rxe0 stays)
// deleted under a device that has a connection, an MR, a LAM and a fast
// registration on it. The deletion completes only once every process has
// let go of the device, so it finishing at all shows the release.
TEST_F(VerbsDeviceTest, RemovedDeviceIsLostAndReleasedSoTheRemovalCompletes) {
  ASSERT_EQ(geteuid(), 0u) << "needs root to create and delete a device";
  RecordingSink sink;  // outlives the device
  OwnRxeDevice own;
  ASSERT_NO_FATAL_FAILURE(own.Create("vt", 79));
  const std::string rdma = own.rdma;
  std::unique_ptr<VerbsDevice>& device = own.device;

  const uint64_t ps = PageSize();
  absl::StatusOr<PdId> pd = device->AllocatePd(&sink);
  ASSERT_TRUE(pd.ok()) << pd.status();
  MemfdBuffer& buffer = NewBuffer(4);
  absl::StatusOr<MrKeys> keys =
      device->RegisterMr(*pd, buffer.Span(0, ps), kBase, kRemoteRw);
  ASSERT_TRUE(keys.ok()) << keys.status();
  absl::StatusOr<LogicalMapping> lam =
      device->BuildLam(*pd, buffer.Span(ps, 2 * ps));
  ASSERT_TRUE(lam.ok()) << lam.status();
  absl::StatusOr<MrKeys> fast = device->AllocateFastRegisterMr(*pd, true, 4);
  ASSERT_TRUE(fast.ok()) << fast.status();
  absl::StatusOr<std::string> ticket = device->CreatePeerTicket(*pd);
  ASSERT_TRUE(ticket.ok());
  absl::StatusOr<std::unique_ptr<VerbsPeer>> peer =
      VerbsPeer::Connect(device->Attributes().peer_address, *ticket);
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE(sink.WaitFor(Event::Kind::kConnected, 1));
  FastRegisterWork work;
  work.mr = fast->mr;
  work.pages = lam->pages;
  work.length = 2 * ps;
  work.base_address = kBase + 16 * ps;
  work.access = kRemoteRw;
  ASSERT_TRUE(device->PostFastRegister((*peer)->connection_id(), work).ok());
  ASSERT_TRUE(sink.WaitForCompletions(1));
  ASSERT_TRUE(sink.Completions()[0].status.ok());
  ASSERT_TRUE((*peer)->Read(keys->rkey, kBase, 8).ok());
  EXPECT_GT(device->PinnedBytes(), 0u);

  // Blocks until every holder of the device (this process's device and
  // peer included) has let go of it.
  ASSERT_EQ(
      std::system(absl::StrCat("timeout 60 rdma link delete ", rdma).c_str()),
      0);
  EXPECT_FALSE(device->Health().healthy);
  EXPECT_THAT(device->Health().message, HasSubstr("device lost"));
  EXPECT_EQ(device->PinnedBytes(), 0u);
  EXPECT_TRUE(sink.WaitFor(Event::Kind::kDisconnected, 1));
  EXPECT_THAT((*peer)->Read(keys->rkey, kBase, 8).status(),
              Property(&absl::Status::code, absl::StatusCode::kUnavailable));
  EXPECT_THAT(
      device->RegisterMr(*pd, buffer.Span(0, ps), kBase, kRemoteRw).status(),
      IsMrdError(absl::StatusCode::kUnavailable, "DEVICE_LOST"));
  EXPECT_THAT(device->AllocatePd(&sink).status(),
              IsMrdError(absl::StatusCode::kUnavailable, "DEVICE_LOST"));
  // What was there is released again without complaint.
  EXPECT_TRUE(device->DeregisterMr(keys->mr).ok());
  EXPECT_TRUE(device->FreeFastRegisterMr(fast->mr).ok());
  EXPECT_TRUE(device->ReleaseLam(lam->lam).ok());
  EXPECT_TRUE(device->DeallocatePd(*pd).ok());
  peer->reset();
  device->Shutdown();
  device.reset();
}

// ---------------------------------------------------------------------------
// Registration and the peer data path.

TEST_F(VerbsDeviceTest, PeerReadsAndWritesTheMemfdThroughTheRegistration) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  const uint64_t ps = PageSize();
  MemfdBuffer& buffer = NewBuffer(4);
  // Offset 100: the registration spans 4 pages, all of them pinned. The
  // base address is at the same offset within its page.
  const uint64_t base = kBase + 100;
  MrKeys keys = Register(pd, buffer, 100, 3 * ps, kRemoteRw, base);
  EXPECT_EQ(device_->PinnedBytes(), 4 * ps);
  EXPECT_EQ(VmPinBytes() - vm_pin_before_, 4 * ps);
  VerbsPeer* peer = Connect(pd, sink);
  ASSERT_NE(peer, nullptr);
  EXPECT_NE(peer->connection_id(), 0u);
  EXPECT_EQ(peer->max_message_size(), device_->max_message_size());
  EXPECT_THAT(sink->last_peer(), HasSubstr(std::getenv("MRD_VERBS_ADDRESS")));

  absl::StatusOr<std::string> data = peer->Read(keys.rkey, base + 10, 1000);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, buffer.Bytes(110, 1000));
  data = peer->Read(keys.rkey, base, 3 * ps);  // all of it
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, buffer.Bytes(100, 3 * ps));

  ASSERT_TRUE(peer->Write(keys.rkey, base + ps - 2, "RDMA!").ok());
  EXPECT_EQ(buffer.Bytes(100 + ps - 2, 5), "RDMA!");
  data = peer->Read(keys.rkey, base + ps - 2, 5);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, "RDMA!");
}

// Memory that mrd maps read-only (a buffer imported read-only) registers
// for remote read, and LAMs build on it: through a writable view of the file
// on kernels that cannot pin read-only shared mappings.
TEST_F(VerbsDeviceTest, ReadOnlyMappingsRegisterForRemoteRead) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  const uint64_t ps = PageSize();
  MemfdBuffer& buffer = NewBuffer(2);
  void* read_only =
      mmap(nullptr, 2 * ps, PROT_READ, MAP_SHARED, buffer.fd(), 0);
  ASSERT_NE(read_only, MAP_FAILED);
  MemorySpan span{read_only, 2 * ps, buffer.fd(), 0};
  absl::StatusOr<MrKeys> keys =
      device_->RegisterMr(pd, span, kBase, kAccessRemoteRead);
  ASSERT_TRUE(keys.ok()) << keys.status();
  absl::StatusOr<LogicalMapping> lam = device_->BuildLam(pd, span);
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_NE(lam->privileged_key, 0u);
  VerbsPeer* peer = Connect(pd, sink);
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> data = peer->Read(keys->rkey, kBase, 2 * ps);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, buffer.Bytes(0, 2 * ps));
  // Later writes to the file show: the registration pins the file's pages.
  buffer.data()[5] = 'Z';
  data = peer->Read(keys->rkey, kBase + 5, 1);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, "Z");
  // The privileged token is local-only.
  VerbsPeer* prober = Connect(pd, sink);
  ASSERT_NE(prober, nullptr);
  EXPECT_THAT(prober->Read(lam->privileged_key, lam->pages[0], 8).status(),
              IsAccessError());
  ASSERT_TRUE(device_->ReleaseLam(lam->lam).ok());
  ASSERT_TRUE(device_->DeregisterMr(keys->mr).ok());
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  munmap(read_only, 2 * ps);
}

// A file open read-only cannot be mapped writable: on kernels that cannot
// pin read-only shared mappings the registration is refused by name, with
// nothing pinned; on newer kernels it succeeds.
TEST_F(VerbsDeviceTest, ReadOnlyFileIsRegisteredOrRefusedClearly) {
  PdId pd = NewPd();
  const uint64_t ps = PageSize();
  MemfdBuffer& buffer = NewBuffer(1);
  UniqueFd fd(
      open(absl::StrCat("/proc/self/fd/", buffer.fd()).c_str(), O_RDONLY));
  ASSERT_TRUE(fd.valid());
  void* read_only = mmap(nullptr, ps, PROT_READ, MAP_SHARED, fd.get(), 0);
  ASSERT_NE(read_only, MAP_FAILED);
  absl::StatusOr<MrKeys> keys = device_->RegisterMr(
      pd, MemorySpan{read_only, ps, fd.get(), 0}, kBase, kAccessRemoteRead);
  if (keys.ok()) {
    EXPECT_EQ(device_->PinnedBytes(), ps);
    EXPECT_TRUE(device_->DeregisterMr(keys->mr).ok());
  } else {
    EXPECT_THAT(keys.status(), IsSeedError(::mrd::STATUS_INVALID_PARAMETER,
                                           "READ_ONLY_MEMORY_NOT_PINNABLE"));
  }
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  munmap(read_only, ps);
}

TEST_F(VerbsDeviceTest, OverlongAndEmptyRequestsAreRefusedByThePeer) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, PageSize(), kRemoteRw);
  VerbsPeer* peer = Connect(pd, sink);
  ASSERT_NE(peer, nullptr);
  EXPECT_THAT(
      peer->Read(keys.rkey, kBase, 0).status(),
      IsMrdError(absl::StatusCode::kInvalidArgument, "REMOTE_INVALID_REQUEST"));
  EXPECT_THAT(
      peer->Read(keys.rkey, kBase, peer->max_message_size() + 1).status(),
      IsMrdError(absl::StatusCode::kInvalidArgument, "REMOTE_INVALID_REQUEST"));
  EXPECT_TRUE(peer->Read(keys.rkey, kBase, 8).ok());  // still connected
}

TEST_F(VerbsDeviceTest, AWrongRkeyIsAnAccessErrorAndBreaksThePeer) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys keys = Register(pd, buffer, 0, PageSize(), kRemoteRw);
  VerbsPeer* peer = Connect(pd, sink);
  ASSERT_NE(peer, nullptr);
  EXPECT_THAT(peer->Read(keys.rkey ^ 0xff, kBase, 8).status(), IsAccessError());
  // The QP is in error: the peer is done, and the device hears of it.
  EXPECT_THAT(
      peer->Read(keys.rkey, kBase, 8).status(),
      IsMrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_BROKEN"));
  EXPECT_TRUE(sink->WaitFor(Event::Kind::kDisconnected, 1));
  // A new connection works.
  VerbsPeer* again = Connect(pd, sink);
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(again->Read(keys.rkey, kBase, 8).ok());
}

TEST_F(VerbsDeviceTest, BoundsAreEnforced) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  const uint64_t ps = PageSize();
  MemfdBuffer& buffer = NewBuffer(2);
  MrKeys keys = Register(pd, buffer, 0, ps, kRemoteRw);
  VerbsPeer* peer = Connect(pd, sink);
  ASSERT_NE(peer, nullptr);
  EXPECT_TRUE(peer->Read(keys.rkey, kBase + ps - 8, 8).ok());
  EXPECT_THAT(peer->Read(keys.rkey, kBase + ps - 8, 9).status(),
              IsAccessError());
}

TEST_F(VerbsDeviceTest, ReadNeedsRemoteReadAndWriteNeedsRemoteWrite) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  const uint64_t ps = PageSize();
  MemfdBuffer& buffer = NewBuffer(2);
  MrKeys read_only = Register(pd, buffer, 0, ps, kAccessRemoteRead);
  MrKeys write_only = Register(
      pd, buffer, ps, ps, kAccessRemoteWrite | kAccessLocalWrite, kBase + ps);
  VerbsPeer* reader = Connect(pd, sink);
  ASSERT_NE(reader, nullptr);
  EXPECT_TRUE(reader->Read(read_only.rkey, kBase, 8).ok());
  EXPECT_THAT(reader->Write(read_only.rkey, kBase, "x"), IsAccessError());
  VerbsPeer* writer = Connect(pd, sink);
  ASSERT_NE(writer, nullptr);
  ASSERT_TRUE(writer->Write(write_only.rkey, kBase + ps, "w").ok());
  EXPECT_EQ(buffer.Bytes(ps, 1), "w");
  EXPECT_THAT(writer->Read(write_only.rkey, kBase + ps, 1).status(),
              IsAccessError());
}

TEST_F(VerbsDeviceTest, AnotherPdsKeyIsRefused) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  RecordingSink* other_sink = nullptr;
  PdId other = NewPd(&other_sink);
  MemfdBuffer& buffer = NewBuffer(1);
  MrKeys other_keys = Register(other, buffer, 0, PageSize(), kRemoteRw);
  VerbsPeer* peer = Connect(pd, sink);
  ASSERT_NE(peer, nullptr);
  EXPECT_THAT(peer->Read(other_keys.rkey, kBase, 8).status(), IsAccessError());
}

TEST_F(VerbsDeviceTest, DeregisterKillsTheTokenBeforeItReturns) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  MemfdBuffer& buffer = NewBuffer(2);
  MrKeys keys = Register(pd, buffer, 0, 2 * PageSize(), kRemoteRw);
  VerbsPeer* peer = Connect(pd, sink);
  ASSERT_NE(peer, nullptr);
  ASSERT_TRUE(peer->Read(keys.rkey, kBase, 64).ok());
  ASSERT_TRUE(device_->DeregisterMr(keys.mr).ok());
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_THAT(peer->Read(keys.rkey, kBase, 64).status(), IsAccessError());
  EXPECT_THAT(device_->DeregisterMr(keys.mr),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR"));
}

TEST_F(VerbsDeviceTest, DeallocatePdKillsTokensConnectionsAndTickets) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  MemfdBuffer& buffer = NewBuffer(2);
  MrKeys keys = Register(pd, buffer, 0, 2 * PageSize(), kRemoteRw);
  LogicalMapping lam = Lam(pd, buffer, 0, 2 * PageSize());
  absl::StatusOr<std::string> ticket = device_->CreatePeerTicket(pd);
  ASSERT_TRUE(ticket.ok());
  VerbsPeer* peer = Connect(pd, sink);
  ASSERT_NE(peer, nullptr);
  ASSERT_TRUE(peer->Read(keys.rkey, kBase, 64).ok());
  EXPECT_GT(device_->PinnedBytes(), 0u);

  ASSERT_TRUE(device_->DeallocatePd(pd).ok());
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_THAT(peer->Read(keys.rkey, kBase, 64).status(), IsDead());
  // The sink heard nothing after DeallocatePd returned.
  device_->WaitForWorkerIdle();
  EXPECT_EQ(sink->CountOf(Event::Kind::kDisconnected), 0u);
  EXPECT_THAT(
      VerbsPeer::Connect(device_->Attributes().peer_address, *ticket).status(),
      IsMrdError(absl::StatusCode::kUnauthenticated, "BAD_TICKET"));
  EXPECT_THAT(device_->ReleaseLam(lam.lam),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_LAM"));
  EXPECT_THAT(device_->DeallocatePd(pd),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD"));
}

TEST_F(VerbsDeviceTest, BadTicketIsUnauthenticated) {
  EXPECT_THAT(VerbsPeer::Connect(device_->Attributes().peer_address,
                                 "00112233445566778899aabbccddeeff")
                  .status(),
              IsMrdError(absl::StatusCode::kUnauthenticated, "BAD_TICKET"));
}

TEST_F(VerbsDeviceTest, OverMaxMrSizeIsRefusedNamingBothSizes) {
  const uint64_t ps = PageSize();
  VerbsDeviceOptions options;
  options.max_mr_size_limit = 4 * ps;
  StartDevice(options);
  EXPECT_EQ(device_->Attributes().max_mr_size, 4 * ps);
  EXPECT_EQ(device_->Attributes().max_page_list_length, 4u);
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(5);
  absl::StatusOr<MrKeys> keys =
      device_->RegisterMr(pd, buffer.Span(0, 5 * ps), kBase, kRemoteRw);
  EXPECT_THAT(keys.status(), IsSeedError(::mrd::STATUS_INVALID_PARAMETER,
                                         "LENGTH_OVER_MAX_MR_SIZE"));
  EXPECT_THAT(std::string(keys.status().message()),
              HasSubstr(absl::StrCat(5 * ps)));
  EXPECT_THAT(std::string(keys.status().message()),
              HasSubstr(absl::StrCat(4 * ps)));
  EXPECT_THAT(
      device_->BuildLam(pd, buffer.Span(0, 5 * ps)).status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "LENGTH_OVER_MAX_MR_SIZE"));
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_TRUE(
      device_->RegisterMr(pd, buffer.Span(0, 4 * ps), kBase, kRemoteRw).ok());
}

TEST_F(VerbsDeviceTest, RegisterMrValidatesItsArguments) {
  PdId pd = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  EXPECT_THAT(
      device_->RegisterMr(pd, buffer.Span(0, PageSize()), 0, kRemoteRw)
          .status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "ZERO_BASED_ADDRESS"));
  EXPECT_THAT(
      device_->RegisterMr(pd, buffer.Span(0, PageSize()), kBase, 0x100)
          .status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_ACCESS_BITS"));
  // Pages are translated whole: the base must share the memory's offset
  // within its page.
  EXPECT_THAT(
      device_->RegisterMr(pd, buffer.Span(0, PageSize()), kBase + 8, kRemoteRw)
          .status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "BASE_ADDRESS_MISALIGNED"));
  EXPECT_THAT(
      device_
          ->RegisterMr(pd + 1000, buffer.Span(0, PageSize()), kBase, kRemoteRw)
          .status(),
      IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD"));
  // Memory that is not mapped cannot be pinned.
  void* hole =
      mmap(nullptr, PageSize(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(hole, MAP_FAILED);
  ASSERT_EQ(munmap(hole, PageSize()), 0);
  EXPECT_FALSE(device_
                   ->RegisterMr(pd,
                                MemorySpan{hole, PageSize(), buffer.fd(), 0},
                                kBase, kRemoteRw)
                   .ok());
  EXPECT_EQ(device_->PinnedBytes(), 0u);
}

TEST_F(VerbsDeviceTest, PostsNeedAConnectedQueuePairOfTheMrsPd) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  RecordingSink* other_sink = nullptr;
  PdId other = NewPd(&other_sink);
  absl::StatusOr<MrKeys> mr = device_->AllocateFastRegisterMr(pd, true, 4);
  ASSERT_TRUE(mr.ok()) << mr.status();
  InvalidateWork work;
  work.mr = mr->mr;
  EXPECT_THAT(device_->PostInvalidate(999999, work).status(),
              IsConnectionInvalid());
  VerbsPeer* other_peer = Connect(other, other_sink);
  ASSERT_NE(other_peer, nullptr);
  EXPECT_THAT(
      device_->PostInvalidate(other_peer->connection_id(), work).status(),
      IsConnectionInvalid());
}

TEST_F(VerbsDeviceTest, PeerDisconnectIsReportedAndEndsPosting) {
  RecordingSink* sink = nullptr;
  PdId pd = NewPd(&sink);
  absl::StatusOr<MrKeys> mr = device_->AllocateFastRegisterMr(pd, true, 4);
  ASSERT_TRUE(mr.ok()) << mr.status();
  absl::StatusOr<std::unique_ptr<VerbsPeer>> peer = TryConnect(pd);
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE(sink->WaitFor(Event::Kind::kConnected, 1));
  const ConnectionId connection = (*peer)->connection_id();
  peer->reset();
  ASSERT_TRUE(sink->WaitFor(Event::Kind::kDisconnected, 1));
  std::vector<Event> events = sink->Events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].connection, connection);
  EXPECT_EQ(events[1].connection, connection);
  InvalidateWork work;
  work.mr = mr->mr;
  EXPECT_THAT(device_->PostInvalidate(connection, work).status(),
              IsConnectionInvalid());
}

// ---------------------------------------------------------------------------
// LAMs and fast registration.

class VerbsFastRegisterTest : public VerbsDeviceTest {
 protected:
  void SetUp() override {
    VerbsDeviceTest::SetUp();
    if (HasFatalFailure()) return;
    pd_ = NewPd(&sink_);
    a_ = &NewBuffer(4, 1);
    b_ = &NewBuffer(4, 99);
    lam_a_ = Lam(pd_, *a_, 0, 4 * PageSize());
    lam_b_ = Lam(pd_, *b_, 0, 4 * PageSize());
    absl::StatusOr<MrKeys> mr = device_->AllocateFastRegisterMr(pd_, true, 8);
    ASSERT_TRUE(mr.ok()) << mr.status();
    mr_ = *mr;
    poster_ = Connect(pd_, sink_);
    ASSERT_NE(poster_, nullptr);
    connection_ = poster_->connection_id();
  }

  FastRegisterWork Work(std::vector<uint64_t> pages, uint64_t length,
                        uint64_t base = kBase, uint32_t flags = 0,
                        uint64_t context = 1, uint32_t fbo = 0) {
    FastRegisterWork work;
    work.mr = mr_.mr;
    work.pages = std::move(pages);
    work.fbo = fbo;
    work.length = length;
    work.base_address = base;
    work.access = kRemoteRw;
    work.flags = flags;
    work.request_context = context;
    return work;
  }

  // Posts, waits for the completion, and returns its rkey.
  uint32_t FastRegister(const FastRegisterWork& work) {
    size_t before = sink_->Completions().size();
    absl::StatusOr<uint64_t> posted =
        device_->PostFastRegister(connection_, work);
    EXPECT_TRUE(posted.ok()) << posted.status();
    EXPECT_TRUE(sink_->WaitForCompletions(before + 1));
    WorkCompletion completion = sink_->Completions().back();
    EXPECT_TRUE(completion.status.ok()) << completion.status;
    EXPECT_EQ(completion.kind, WorkCompletion::Kind::kFastRegister);
    EXPECT_EQ(completion.request_context, work.request_context);
    EXPECT_EQ(completion.work_request, *posted);
    EXPECT_EQ(completion.connection, connection_);
    return completion.rkey;
  }

  void Invalidate(uint64_t context) {
    size_t before = sink_->Completions().size();
    InvalidateWork work;
    work.mr = mr_.mr;
    work.request_context = context;
    ASSERT_TRUE(device_->PostInvalidate(connection_, work).ok());
    ASSERT_TRUE(sink_->WaitForCompletions(before + 1));
    WorkCompletion completion = sink_->Completions().back();
    EXPECT_TRUE(completion.status.ok()) << completion.status;
    EXPECT_EQ(completion.kind, WorkCompletion::Kind::kInvalidate);
    EXPECT_EQ(completion.request_context, context);
  }

  // A fresh peer for probes that may fail (and so break it).
  VerbsPeer* Prober() { return Connect(pd_, sink_); }

  PdId pd_ = 0;
  RecordingSink* sink_ = nullptr;
  MemfdBuffer* a_ = nullptr;
  MemfdBuffer* b_ = nullptr;
  LogicalMapping lam_a_;
  LogicalMapping lam_b_;
  MrKeys mr_;
  VerbsPeer* poster_ = nullptr;
  ConnectionId connection_ = 0;
};

TEST_F(VerbsFastRegisterTest, LamsPinTheirPagesAndReleaseUnpins) {
  const uint64_t ps = PageSize();
  EXPECT_EQ(lam_a_.pages.size(), 4u);
  EXPECT_EQ(lam_a_.fbo, 0u);
  for (size_t i = 1; i < lam_a_.pages.size(); ++i) {
    EXPECT_EQ(lam_a_.pages[i], lam_a_.pages[0] + i * ps);
  }
  EXPECT_EQ(device_->PinnedBytes(), 8 * ps);
  LogicalMapping offset = Lam(pd_, *a_, 100, 2 * ps);
  EXPECT_EQ(offset.fbo, 100u);
  EXPECT_EQ(offset.pages.size(), 3u);
  EXPECT_EQ(device_->PinnedBytes(), 11 * ps);
  ASSERT_TRUE(device_->ReleaseLam(offset.lam).ok());
  EXPECT_EQ(device_->PinnedBytes(), 8 * ps);
  EXPECT_THAT(device_->ReleaseLam(offset.lam),
              IsMrdError(absl::StatusCode::kNotFound, "UNKNOWN_LAM"));
}

TEST_F(VerbsFastRegisterTest, FreeMrObjectHasNoToken) {
  EXPECT_EQ(mr_.rkey, 0u);
  absl::StatusOr<MrKeys> keys = device_->QueryMr(mr_.mr);
  ASSERT_TRUE(keys.ok());
  EXPECT_EQ(keys->rkey, 0u);
}

TEST_F(VerbsFastRegisterTest, PeerReachesThePagesThroughThePageArray) {
  const uint64_t ps = PageSize();
  // VA page 0 = B's page 2, page 1 = A's page 0, page 2 = A's page 3.
  uint32_t rkey = FastRegister(
      Work({lam_b_.pages[2], lam_a_.pages[0], lam_a_.pages[3]}, 3 * ps, kBase));
  EXPECT_NE(rkey, 0u);
  EXPECT_EQ(device_->QueryMr(mr_.mr)->rkey, rkey);
  // The remap pins the registered pages once more.
  EXPECT_EQ(device_->PinnedBytes(), 8 * ps + 3 * ps);

  absl::StatusOr<std::string> data = poster_->Read(rkey, kBase, 3 * ps);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data,
            b_->Bytes(2 * ps, ps) + a_->Bytes(0, ps) + a_->Bytes(3 * ps, ps));
  ASSERT_TRUE(poster_->Write(rkey, kBase + 2 * ps - 4, "ABCDEFGH").ok());
  EXPECT_EQ(a_->Bytes(ps - 4, 4), "ABCD");
  EXPECT_EQ(a_->Bytes(3 * ps, 4), "EFGH");
  VerbsPeer* prober = Prober();
  ASSERT_NE(prober, nullptr);
  EXPECT_THAT(prober->Read(rkey, kBase + 3 * ps - 4, 5).status(),
              IsAccessError());
}

TEST_F(VerbsFastRegisterTest, ReadOnlyAndLocalOnlyFastRegistrations) {
  const uint64_t ps = PageSize();
  FastRegisterWork read_only = Work({lam_a_.pages[1], lam_a_.pages[2]}, 2 * ps);
  read_only.access = kAccessRemoteRead;
  uint32_t rkey = FastRegister(read_only);
  absl::StatusOr<std::string> data = poster_->Read(rkey, kBase, 2 * ps);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, a_->Bytes(ps, 2 * ps));
  VerbsPeer* prober = Prober();
  ASSERT_NE(prober, nullptr);
  EXPECT_THAT(prober->Write(rkey, kBase, "no"), IsAccessError());
  Invalidate(2);

  absl::StatusOr<MrKeys> local = device_->AllocateFastRegisterMr(pd_, false, 4);
  ASSERT_TRUE(local.ok());
  FastRegisterWork local_work = Work({lam_b_.pages[0]}, ps, kBase, 0, 3);
  local_work.mr = local->mr;
  local_work.access = kAccessLocalWrite;
  ASSERT_TRUE(device_->PostFastRegister(connection_, local_work).ok());
  ASSERT_TRUE(sink_->WaitForCompletions(3));
  WorkCompletion done = sink_->Completions().back();
  ASSERT_TRUE(done.status.ok()) << done.status;
  VerbsPeer* other = Prober();
  ASSERT_NE(other, nullptr);
  EXPECT_THAT(other->Read(done.rkey, kBase, 8).status(), IsAccessError());
}

TEST_F(VerbsFastRegisterTest, FirstByteOffsetShiftsTheRegionIntoItsFirstPage) {
  const uint64_t ps = PageSize();
  LogicalMapping offset = Lam(pd_, *a_, 100, 2 * ps);
  uint32_t rkey =
      FastRegister(Work(offset.pages, 2 * ps, kBase + 100, 0, 1, offset.fbo));
  absl::StatusOr<std::string> data = poster_->Read(rkey, kBase + 100, 2 * ps);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, a_->Bytes(100, 2 * ps));
}

TEST_F(VerbsFastRegisterTest,
       InvalidateKillsTheKeyAndReRegistrationDrawsANewOne) {
  const uint64_t ps = PageSize();
  uint32_t first = FastRegister(Work({lam_a_.pages[1]}, ps, kBase, 0, 1));
  ASSERT_TRUE(poster_->Read(first, kBase, 16).ok());
  EXPECT_THAT(device_->ReleaseLam(lam_a_.lam),
              IsMrdError(absl::StatusCode::kFailedPrecondition, "LAM_IN_USE"));
  Invalidate(2);
  EXPECT_EQ(device_->PinnedBytes(), 8 * ps);
  VerbsPeer* prober = Prober();
  ASSERT_NE(prober, nullptr);
  EXPECT_THAT(prober->Read(first, kBase, 16).status(), IsAccessError());

  uint32_t second = FastRegister(Work({lam_a_.pages[2]}, ps, kBase, 0, 3));
  EXPECT_NE(second, first);
  absl::StatusOr<std::string> data = poster_->Read(second, kBase, 16);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, a_->Bytes(2 * ps, 16));
  Invalidate(4);
  EXPECT_TRUE(device_->ReleaseLam(lam_a_.lam).ok());
}

TEST_F(VerbsFastRegisterTest, FastRegisteringAValidMrCompletesWithMrNotFree) {
  const uint64_t ps = PageSize();
  uint32_t rkey = FastRegister(Work({lam_a_.pages[0]}, ps, kBase, 0, 1));
  ASSERT_TRUE(device_
                  ->PostFastRegister(connection_,
                                     Work({lam_a_.pages[1]}, ps, kBase, 0, 2))
                  .ok());
  ASSERT_TRUE(sink_->WaitForCompletions(2));
  WorkCompletion failed = sink_->Completions().back();
  EXPECT_THAT(failed.status,
              IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "MR_NOT_FREE"));
  EXPECT_EQ(failed.request_context, 2u);
  EXPECT_EQ(device_->QueryMr(mr_.mr)->rkey, rkey);  // unchanged
  EXPECT_TRUE(poster_->Read(rkey, kBase, 8).ok());
}

TEST_F(VerbsFastRegisterTest, SilentSuccessSuppressesOnlySuccesses) {
  const uint64_t ps = PageSize();
  ASSERT_TRUE(device_
                  ->PostFastRegister(
                      connection_,
                      Work({lam_b_.pages[0]}, ps, kBase, kWorkSilentSuccess, 1))
                  .ok());
  device_->WaitForWorkerIdle();
  EXPECT_TRUE(sink_->Completions().empty());
  // QueryMr tells the new key (F5).
  absl::StatusOr<MrKeys> keys = device_->QueryMr(mr_.mr);
  ASSERT_TRUE(keys.ok());
  ASSERT_NE(keys->rkey, 0u);
  absl::StatusOr<std::string> data = poster_->Read(keys->rkey, kBase, 32);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, b_->Bytes(0, 32));
  // A failure completes even when silent.
  ASSERT_TRUE(device_
                  ->PostFastRegister(
                      connection_,
                      Work({lam_b_.pages[1]}, ps, kBase, kWorkSilentSuccess, 2))
                  .ok());
  ASSERT_TRUE(sink_->WaitForCompletions(1));
  EXPECT_THAT(sink_->Completions()[0].status,
              IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "MR_NOT_FREE"));
  EXPECT_EQ(sink_->Completions()[0].request_context, 2u);
}

TEST_F(VerbsFastRegisterTest, DeferredWorkIsHeldUntilTheNextNonDeferredPost) {
  const uint64_t ps = PageSize();
  absl::StatusOr<uint64_t> deferred = device_->PostFastRegister(
      connection_, Work({lam_a_.pages[0]}, ps, kBase, kWorkDefer, 1));
  ASSERT_TRUE(deferred.ok()) << deferred.status();
  device_->WaitForWorkerIdle();
  EXPECT_TRUE(sink_->Completions().empty());
  EXPECT_EQ(device_->QueryMr(mr_.mr)->rkey, 0u);  // not executed yet
  // The next non-deferred post releases it, ahead of itself.
  InvalidateWork invalidate;
  invalidate.mr = mr_.mr;
  invalidate.request_context = 2;
  absl::StatusOr<uint64_t> posted =
      device_->PostInvalidate(connection_, invalidate);
  ASSERT_TRUE(posted.ok()) << posted.status();
  ASSERT_TRUE(sink_->WaitForCompletions(2));
  std::vector<WorkCompletion> completions = sink_->Completions();
  EXPECT_EQ(completions[0].work_request, *deferred);
  EXPECT_EQ(completions[0].kind, WorkCompletion::Kind::kFastRegister);
  EXPECT_TRUE(completions[0].status.ok()) << completions[0].status;
  EXPECT_NE(completions[0].rkey, 0u);
  EXPECT_EQ(completions[1].work_request, *posted);
  EXPECT_EQ(completions[1].kind, WorkCompletion::Kind::kInvalidate);
  EXPECT_TRUE(completions[1].status.ok()) << completions[1].status;
}

TEST_F(VerbsFastRegisterTest, QueuedWorkIsFlushedWhenTheConnectionCloses) {
  const uint64_t ps = PageSize();
  ASSERT_TRUE(device_
                  ->PostFastRegister(connection_, Work({lam_a_.pages[0]}, ps,
                                                       kBase, kWorkDefer, 7))
                  .ok());
  peers_.clear();  // the poster disconnects
  ASSERT_TRUE(sink_->WaitFor(Event::Kind::kDisconnected, 1));
  std::vector<Event> events = sink_->Events();
  ASSERT_EQ(events.size(), 3u);  // connected, flushed completion, disconnect
  EXPECT_EQ(events[1].kind, Event::Kind::kCompletion);
  EXPECT_THAT(events[1].completion.status,
              IsSeedError(::mrd::STATUS_CONNECTION_INVALID, "FLUSHED"));
  EXPECT_EQ(events[1].completion.request_context, 7u);
  EXPECT_EQ(events[2].kind, Event::Kind::kDisconnected);
}

TEST_F(VerbsFastRegisterTest, RemoteAccessOnALocalOnlyMrIsAnAccessViolation) {
  absl::StatusOr<MrKeys> local = device_->AllocateFastRegisterMr(pd_, false, 4);
  ASSERT_TRUE(local.ok());
  FastRegisterWork work = Work({lam_a_.pages[0]}, PageSize());
  work.mr = local->mr;
  EXPECT_THAT(
      device_->PostFastRegister(connection_, work).status(),
      IsSeedError(::mrd::STATUS_ACCESS_VIOLATION, "REMOTE_ACCESS_NOT_ALLOWED"));
}

TEST_F(VerbsFastRegisterTest, BadPageArraysAreInvalidParameters) {
  const uint64_t ps = PageSize();
  EXPECT_THAT(
      device_->PostFastRegister(connection_, Work({lam_a_.pages[0] + 8}, ps))
          .status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "MISALIGNED_PAGE"));
  EXPECT_THAT(
      device_->PostFastRegister(connection_, Work({lam_a_.pages[3] + ps}, ps))
          .status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "PAGE_NOT_MAPPED"));
  std::vector<uint64_t> nine(9, lam_a_.pages[0]);
  EXPECT_THAT(
      device_->PostFastRegister(connection_, Work(nine, 9 * ps)).status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "PAGE_ARRAY_TOO_LONG"));
  // Another PD's pages read like unmapped ones.
  PdId other = NewPd();
  MemfdBuffer& buffer = NewBuffer(1);
  LogicalMapping foreign = Lam(other, buffer, 0, ps);
  EXPECT_THAT(
      device_->PostFastRegister(connection_, Work({foreign.pages[0]}, ps))
          .status(),
      IsSeedError(::mrd::STATUS_INVALID_PARAMETER, "PAGE_NOT_MAPPED"));
}

TEST_F(VerbsFastRegisterTest, FreeingTheMrObjectRevokesAtOnce) {
  const uint64_t ps = PageSize();
  uint32_t rkey = FastRegister(Work({lam_a_.pages[0]}, ps));
  ASSERT_TRUE(poster_->Read(rkey, kBase, 8).ok());
  ASSERT_TRUE(device_->FreeFastRegisterMr(mr_.mr).ok());
  EXPECT_EQ(device_->PinnedBytes(), 8 * ps);
  VerbsPeer* prober = Prober();
  ASSERT_NE(prober, nullptr);
  EXPECT_THAT(prober->Read(rkey, kBase, 8).status(), IsAccessError());
  EXPECT_TRUE(device_->ReleaseLam(lam_a_.lam).ok());
}

TEST_F(VerbsFastRegisterTest, DeallocatePdReleasesFastRegistrations) {
  const uint64_t ps = PageSize();
  uint32_t rkey =
      FastRegister(Work({lam_a_.pages[0], lam_b_.pages[1]}, 2 * ps));
  ASSERT_TRUE(poster_->Read(rkey, kBase, 8).ok());
  ASSERT_TRUE(device_->DeallocatePd(pd_).ok());
  EXPECT_EQ(device_->PinnedBytes(), 0u);
  EXPECT_THAT(poster_->Read(rkey, kBase, 8).status(), IsDead());
  // The kernel agrees once the peers (which pin their bounce buffers in
  // this same process) are gone too.
  peers_.clear();
  EXPECT_EQ(VmPinBytes(), vm_pin_before_);
}

}  // namespace
}  // namespace mrd::device
