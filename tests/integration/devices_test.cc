// Several devices in one mrd (issue 26), against the real binary. On two
// software devices (--software_devices=2): GetDeviceInfo lists both, a
// registration on both gives a token per device that a peer on that
// device's peer path reads through, its deregistration kills both tokens
// and unpins both devices, and mrd refuses a device count it cannot serve
// or a handover it cannot make, by name. Inside the Soft-RoCE VM
// (MRD_VERBS_DEVICE2 set by tests/vm/run.sh; ctest test devices.verbs,
// label verbs), the same on two verbs devices (--verbs_devices): each with
// its own peer address and link layer, a token only on its own device's
// connections, a registration the second device refuses leaving nothing on
// the first, and --verbs_devices values mrd cannot serve refused by name.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

// Peers on a device of mrd's choosing, and what each device has pinned.
class DevicesTest : public MrdTest {
 protected:
  // A peer on `device`'s peer path, attached to `session`.
  std::unique_ptr<peer::Peer> PeerOn(const client::Session& session,
                                     const std::string& device) {
    auto ticket = client::PeerTicket::Create(session, device);
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    if (!ticket.ok()) return nullptr;
    EXPECT_EQ(ticket->device(), device);
    auto p = TryConnectPeer(ticket->peer_address(), ticket->ticket());
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  // A registration on every device: a token per device (in `devices`'
  // order) that a peer on that device's peer path reads the right bytes
  // through; deregistered, every token is dead and nothing stays pinned.
  void ExpectPeersReadThroughEachTokenUntilDeregistered(
      const std::vector<std::string>& devices) {
    client::Session session = OpenFdSession();
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    client::Buffer buffer = NewBuffer(session, 4 * page, "two devices ");
    client::RegisterOptions o;
    o.buffer = buffer.id();
    o.length = 4 * page;
    o.flags = kRemoteRead;
    o.all_devices = true;
    absl::StatusOr<client::Registration> r =
        client::Registration::Register(session, o);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->tokens().size(), static_cast<int>(devices.size()));
    for (size_t i = 0; i < devices.size(); ++i) {
      EXPECT_EQ(r->tokens()[static_cast<int>(i)].device(), devices[i]);
    }
    EXPECT_EQ(DevicePinnedBytes(),
              std::vector<uint64_t>(devices.size(), 4 * page));

    std::vector<std::unique_ptr<peer::Peer>> peers;
    for (const v1::DeviceToken& token : r->tokens()) {
      peers.push_back(PeerOn(session, token.device()));
      ASSERT_NE(peers.back(), nullptr);
      absl::StatusOr<std::string> read =
          peers.back()->Read(token.rkey(), r->base_address() + page, 12);
      ASSERT_TRUE(read.ok()) << token.device() << ": " << read.status();
      EXPECT_EQ(*read,
                std::string("two devices two devices ").substr(page % 12, 12));
    }
    const std::vector<v1::DeviceToken> tokens(r->tokens().begin(),
                                              r->tokens().end());
    const uint64_t base = r->base_address();
    ASSERT_TRUE(r->Deregister().ok());
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::unique_ptr<peer::Peer> peer = PeerOn(session, tokens[i].device());
      ASSERT_NE(peer, nullptr);
      EXPECT_FALSE(peer->Read(tokens[i].rkey(), base, 12).ok())
          << tokens[i].device();
    }
    EXPECT_EQ(DevicePinnedBytes(), std::vector<uint64_t>(devices.size(), 0));
  }
};

class TwoDevicesTest : public DevicesTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions options;
    options.extra_flags = {"--software_devices=2"};
    return options;
  }
  void SetUp() override {
    if (TestDeviceKind() != "software") {
      GTEST_SKIP() << "software devices only; the VM has its own test";
    }
    MrdTest::SetUp();
  }
};

TEST_F(TwoDevicesTest, GetDeviceInfoListsBothWithPeerPathsOfTheirOwn) {
  absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->devices_size(), 2);
  EXPECT_EQ(info->name(), "software");
  EXPECT_EQ(info->devices(0).name(), "software");
  EXPECT_EQ(info->devices(1).name(), "software1");
  EXPECT_TRUE(info->devices(1).healthy());
  EXPECT_NE(info->devices(0).peer_address(), info->devices(1).peer_address());
  // Readiness as a whole and per device.
  for (const char* service :
       {"mrd.v1.MemoryRegistration", "mrd.v1.MemoryRegistration/software",
        "mrd.v1.MemoryRegistration/software1"}) {
    EXPECT_EQ(Health(service), grpc::health::v1::HealthCheckResponse::SERVING)
        << service;
  }
}

TEST_F(TwoDevicesTest, PeersReadThroughEachDevicesTokenUntilItIsDeregistered) {
  ExpectPeersReadThroughEachTokenUntilDeregistered({"software", "software1"});
}

TEST_F(TwoDevicesTest, ASessionsDefaultDevicesServeCallsThatNameNone) {
  client::Session session = OpenFdSession();
  v1::SetDefaultDevicesRequest set;
  set.set_session(session.token());
  set.mutable_devices()->add_names("software1");
  absl::StatusOr<v1::SessionInfo> info = client_->SetDefaultDevices(set);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->default_devices().names_size(), 1);
  client::Buffer buffer = NewBuffer(session, 4096, "default");
  client::RegisterOptions o;
  o.buffer = buffer.id();
  o.length = 4096;
  o.flags = kRemoteRead;
  absl::StatusOr<client::Registration> r =
      client::Registration::Register(session, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->tokens().size(), 1);
  EXPECT_EQ(r->tokens()[0].device(), "software1");
  std::unique_ptr<peer::Peer> peer = PeerOn(session, "software1");
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> read =
      peer->Read(r->tokens()[0].rkey(), r->base_address(), 7);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "default");
  ASSERT_TRUE(r->Deregister().ok());
}

TEST_F(TwoDevicesTest, AnUnknownDeviceIsRefusedByName) {
  client::Session session = OpenFdSession();
  client::Buffer buffer = NewBuffer(session, 4096);
  client::RegisterOptions o;
  o.buffer = buffer.id();
  o.length = 4096;
  o.devices = {"software1", "mlx5_7"};
  absl::StatusOr<client::Registration> r =
      client::Registration::Register(session, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(GetErrorDetail(r.status()).reason(), "UNKNOWN_DEVICE");
  EXPECT_TRUE(absl::StrContains(r.status().message(), "mlx5_7"));
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{0, 0}));
}

// An MR object and a LAM of the second device (through the C++ client's
// Mr::Create and Lam::Build): each says its device, as ListRegistrations
// does; a fast registration of the one over the other's pages on a
// connection of that device gives a token its peer reads through.
TEST_F(TwoDevicesTest, AnMrAndALamOfTheSecondDeviceFastRegisterOnItsPeers) {
  client::Session session = OpenFdSession();
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  client::Buffer buffer = NewBuffer(session, 3 * page, "second device ");
  client::CompletionStream stream = client::CompletionStream::Open(session);

  absl::StatusOr<client::Mr> mr =
      client::Mr::Create(session, /*fast_register=*/true,
                         /*allow_remote_access=*/true, "software1");
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_EQ(mr->device(), "software1");
  EXPECT_EQ(mr->info().device(), "software1");
  client::BuildLamOptions lo;
  lo.buffer = buffer.id();
  lo.offset = 10;
  lo.length = 2 * page;
  lo.device = "software1";
  absl::StatusOr<client::Lam> lam = client::Lam::Build(session, lo);
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_EQ(lam->device(), "software1");
  EXPECT_EQ(lam->pages().size(), 3u);

  v1::ListRegistrationsRequest list_request;
  list_request.set_session(session.token());
  absl::StatusOr<v1::ListRegistrationsResponse> list =
      client_->ListRegistrations(list_request);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->mrs_size(), 1);
  EXPECT_EQ(list->mrs(0).device(), "software1");
  ASSERT_EQ(list->lams_size(), 1);
  EXPECT_EQ(list->lams(0).device(), "software1");
  // An adopted handle has the device of the reply it adopts.
  client::Mr adopted = client::Mr::Adopt(session, mr->info());
  EXPECT_EQ(adopted.device(), "software1");
  adopted.Detach();

  std::unique_ptr<peer::Peer> peer = PeerOn(session, "software1");
  ASSERT_NE(peer, nullptr);
  EXPECT_EQ(NextOfKind(stream, v1::Completion::PEER_CONNECTED).connection(),
            peer->connection_id());
  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  fr.connection = peer->connection_id();
  fr.request_context = 26;
  fr.base_address = 0x10000000 + fr.fbo;
  fr.flags = kOpRemoteRead;
  absl::StatusOr<uint64_t> wr = mr->FastRegister(fr);
  ASSERT_TRUE(wr.ok()) << wr.status();
  v1::Completion done = NextOfKind(stream, v1::Completion::FAST_REGISTER);
  ASSERT_EQ(done.status(), ::mrd::STATUS_SUCCESS) << done.message();
  EXPECT_EQ(done.work_request(), *wr);
  absl::StatusOr<std::string> read =
      peer->Read(done.rkey(), fr.base_address, 13);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "ice second de");

  absl::StatusOr<uint64_t> inv = mr->Invalidate(peer->connection_id(), 27);
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(NextOfKind(stream, v1::Completion::INVALIDATE).work_request(),
            *inv);
  EXPECT_FALSE(peer->Read(done.rkey(), fr.base_address, 13).ok());
  EXPECT_TRUE(lam->Release().ok());
  EXPECT_TRUE(mr->Close().ok());
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{0, 0}));
}

// An MR object or a LAM is of one device ("": the first, whatever the
// session's default devices): the other device's connections refuse an MR
// object of the first (MR_ON_ANOTHER_DEVICE) and the first's logical
// addresses (UNKNOWN_LOGICAL_ADDRESS); unknown device names are refused.
TEST_F(TwoDevicesTest, AnMrOrALamOfOneDeviceIsRefusedOnTheOthersConnections) {
  client::Session session = OpenFdSession();
  v1::SetDefaultDevicesRequest set;
  set.set_session(session.token());
  set.mutable_devices()->add_names("software1");
  ASSERT_TRUE(client_->SetDefaultDevices(set).ok());
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  client::Buffer buffer = NewBuffer(session, 2 * page, "first ");
  client::CompletionStream stream = client::CompletionStream::Open(session);

  absl::StatusOr<client::Mr> first = client::Mr::Create(session, true, true);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->device(), "software");
  absl::StatusOr<client::Mr> second =
      client::Mr::Create(session, true, true, "software1");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->device(), "software1");
  client::BuildLamOptions lo;
  lo.buffer = buffer.id();
  lo.length = page;
  absl::StatusOr<client::Lam> first_lam = client::Lam::Build(session, lo);
  ASSERT_TRUE(first_lam.ok()) << first_lam.status();
  EXPECT_EQ(first_lam->device(), "software");

  std::unique_ptr<peer::Peer> peer = PeerOn(session, "software1");
  ASSERT_NE(peer, nullptr);
  EXPECT_EQ(NextOfKind(stream, v1::Completion::PEER_CONNECTED).connection(),
            peer->connection_id());
  client::FastRegisterOptions fr =
      client::FastRegisterOptions::FromLam(*first_lam);
  fr.connection = peer->connection_id();
  fr.base_address = 0x10000000;
  fr.flags = kOpRemoteRead;
  // The second device's MR over the first's LAM: the second device has no
  // LAM at those logical addresses.
  ExpectError(second->FastRegister(fr).status(),
              absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_LOGICAL_ADDRESS");

  lo.device = "software1";
  absl::StatusOr<client::Lam> second_lam = client::Lam::Build(session, lo);
  ASSERT_TRUE(second_lam.ok()) << second_lam.status();
  EXPECT_EQ(second_lam->device(), "software1");
  client::FastRegisterOptions fr2 =
      client::FastRegisterOptions::FromLam(*second_lam);
  fr2.connection = peer->connection_id();
  fr2.base_address = 0x10000000;
  fr2.flags = kOpRemoteRead;
  // The first device's MR on the second device's connection.
  absl::Status refused = first->FastRegister(fr2).status();
  ExpectError(refused, absl::StatusCode::kFailedPrecondition,
              ::mrd::STATUS_CONNECTION_INVALID, "MR_ON_ANOTHER_DEVICE");
  EXPECT_TRUE(
      absl::StrContains(refused.message(), "belongs to device software;"))
      << refused;
  // Refused when asked: both MR objects stay free.
  v1::ListRegistrationsRequest list_request;
  list_request.set_session(session.token());
  absl::StatusOr<v1::ListRegistrationsResponse> list =
      client_->ListRegistrations(list_request);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->mrs_size(), 2);
  for (const v1::MrInfo& m : list->mrs()) EXPECT_EQ(m.state(), "free");

  // Names mrd does not serve.
  absl::StatusOr<client::Mr> unknown_mr =
      client::Mr::Create(session, true, true, "mlx5_7");
  ASSERT_FALSE(unknown_mr.ok());
  EXPECT_EQ(GetErrorDetail(unknown_mr.status()).reason(), "UNKNOWN_DEVICE");
  lo.device = "mlx5_7";
  absl::StatusOr<client::Lam> unknown_lam = client::Lam::Build(session, lo);
  ASSERT_FALSE(unknown_lam.ok());
  EXPECT_EQ(GetErrorDetail(unknown_lam.status()).reason(), "UNKNOWN_DEVICE");
  EXPECT_TRUE(absl::StrContains(unknown_lam.status().message(), "mlx5_7"));

  EXPECT_TRUE(first_lam->Release().ok());
  EXPECT_TRUE(second_lam->Release().ok());
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{0, 0}));
}

// mrd with `flag` must refuse to start, its log saying `says`.
void ExpectRefusedAtStart(const std::string& flag, const std::string& says) {
  MrdProcessOptions options;
  options.extra_flags = {flag};
  absl::StatusOr<MrdExit> exit = MrdProcess::RunToExit(options, 60000);
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_NE(exit->status, 0) << flag;
  EXPECT_TRUE(absl::StrContains(exit->log, says))
      << flag << " should say: " << says << "\n"
      << exit->log;
}

class DeviceCountTest : public ::testing::Test {};

TEST_F(DeviceCountTest, ACountMrdCannotServeIsRefusedAtStart) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software only";
  for (const char* flag : {"--software_devices=0", "--software_devices=25"}) {
    ExpectRefusedAtStart(flag, "--software_devices");
  }
}

TEST_F(DeviceCountTest, VerbsDevicesWithTheSoftwareDeviceAreRefused) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software only";
  ExpectRefusedAtStart("--verbs_devices=rxe1",
                       "--verbs_devices=rxe1 needs the verbs device");
}

// Several verbs devices: inside the Soft-RoCE VM only, where
// tests/vm/run.sh makes a second device beside the first.
std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

bool HaveTwoVerbsDevices() {
  return TestDeviceKind() == "verbs" && !Env("MRD_VERBS_DEVICE2").empty();
}

// Runs a shell command; returns its exit status.
int Sh(const std::string& command) {
  int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A Soft-RoCE device of the test's own, on a dummy netdev of its own
// (`address` empty: none), so that deleting it disturbs no other test; gone
// with the object.
class OwnRxeDevice {
 public:
  OwnRxeDevice(const std::string& tag, const std::string& address)
      : netdev_(absl::StrCat("mrd", tag, getpid() % 1000)),
        name_(absl::StrCat("rxe", tag, getpid() % 1000)) {
    std::string command = absl::StrCat("ip link add ", netdev_, " type dummy");
    if (!address.empty()) {
      absl::StrAppend(&command, " && ip addr add ", address, "/24 dev ",
                      netdev_);
    }
    absl::StrAppend(&command, " && ip link set ", netdev_,
                    " up && rdma link add ", name_, " type rxe netdev ",
                    netdev_);
    EXPECT_EQ(Sh(command), 0) << command;
    const std::string port = "/sys/class/infiniband/" + name_ + "/ports/1";
    // Its port up, and its address in the GID table.
    EXPECT_TRUE(WaitFor([&] {
      return Sh(absl::StrCat("grep -qs ACTIVE ", port, "/state")) == 0 &&
             (address.empty() ||
              Sh(absl::StrCat("grep -qs :ffff: ", port, "/gids/*")) == 0);
    })) << name_;
  }
  ~OwnRxeDevice() {
    Sh(absl::StrCat("timeout 60 rdma link delete ", name_,
                    " 2>/dev/null; ip link del ", netdev_, " 2>/dev/null"));
  }
  const std::string& name() const { return name_; }

 private:
  const std::string netdev_;
  const std::string name_;
};

// mrd on the VM's first verbs device (MRD_VERBS_DEVICE) and its second
// (MRD_VERBS_DEVICE2, --verbs_devices).
class TwoVerbsDevicesTest : public DevicesTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions options;
    options.extra_flags = {"--verbs_devices=" + Env("MRD_VERBS_DEVICE2")};
    return options;
  }
  void SetUp() override {
    if (!HaveTwoVerbsDevices()) {
      GTEST_SKIP() << "two verbs devices: inside the Soft-RoCE VM only";
    }
    MrdTest::SetUp();
  }
  const std::string first_ = Env("MRD_VERBS_DEVICE");
  const std::string second_ = Env("MRD_VERBS_DEVICE2");
};

TEST_F(TwoVerbsDevicesTest, GetDeviceInfoListsBothWithTheirOwnPeerAddresses) {
  absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->devices_size(), 2);
  EXPECT_EQ(info->name(), first_);
  EXPECT_EQ(info->link_layer(), "Ethernet");
  const std::string names[] = {first_, second_};
  const std::string addresses[] = {Env("MRD_VERBS_ADDRESS"),
                                   Env("MRD_VERBS_ADDRESS2")};
  for (int i = 0; i < 2; ++i) {
    const v1::DeviceInfo& d = info->devices(i);
    EXPECT_EQ(d.name(), names[i]);
    EXPECT_EQ(d.kind(), "verbs");
    EXPECT_TRUE(d.healthy()) << d.status_message();
    EXPECT_EQ(d.link_layer(), "Ethernet") << d.name();
    // Soft-RoCE on a dummy netdev: no adapter, so no PCI function or node.
    EXPECT_EQ(d.pci_address(), "") << d.name();
    EXPECT_EQ(d.numa_node(), -1) << d.name();
    EXPECT_TRUE(absl::StartsWith(d.peer_address(), addresses[i] + ":"))
        << d.name() << " " << d.peer_address();
  }
}

TEST_F(TwoVerbsDevicesTest, PeersReadThroughEachDevicesTokenUntilDeregistered) {
  ExpectPeersReadThroughEachTokenUntilDeregistered({first_, second_});
}

// A registration on one device has a token only there: a peer of the other
// device cannot use it, and the other device pins nothing for it.
TEST_F(TwoVerbsDevicesTest, ATokenWorksOnlyOnItsOwnDevicesConnections) {
  client::Session session = OpenFdSession();
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  client::Buffer buffer = NewBuffer(session, 2 * page, "one device ");
  for (const std::string& device : {first_, second_}) {
    SCOPED_TRACE(device);
    const std::string other = device == first_ ? second_ : first_;
    client::RegisterOptions o = Range(buffer, 0, 2 * page, kRemoteRead);
    o.devices = {device};
    absl::StatusOr<client::Registration> r =
        client::Registration::Register(session, o);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->tokens().size(), 1);
    EXPECT_EQ(r->tokens()[0].device(), device);
    EXPECT_EQ(DevicePinnedBytes(), device == first_
                                       ? (std::vector<uint64_t>{2 * page, 0})
                                       : (std::vector<uint64_t>{0, 2 * page}));
    std::unique_ptr<peer::Peer> own = PeerOn(session, device);
    std::unique_ptr<peer::Peer> foreign = PeerOn(session, other);
    ASSERT_NE(own, nullptr);
    ASSERT_NE(foreign, nullptr);
    absl::StatusOr<std::string> read =
        own->Read(r->tokens()[0].rkey(), r->base_address(), 11);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, "one device ");
    EXPECT_FALSE(
        foreign->Read(r->tokens()[0].rkey(), r->base_address(), 11).ok());
    ASSERT_TRUE(r->Deregister().ok());
  }
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{0, 0}));
}

// mrd on the VM's first verbs device and one of the test's own, which the
// test deletes under it.
class SecondVerbsDeviceLostTest : public DevicesTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    own_ = std::make_unique<OwnRxeDevice>(
        "lost", absl::StrCat("10.81.", getpid() % 250, ".1"));
    MrdProcessOptions options;
    options.extra_flags = {"--verbs_devices=" + own_->name()};
    return options;
  }
  void SetUp() override {
    if (!HaveTwoVerbsDevices()) {
      GTEST_SKIP() << "two verbs devices: inside the Soft-RoCE VM only";
    }
    MrdTest::SetUp();
  }
  void TearDown() override {
    MrdTest::TearDown();
    own_.reset();
  }
  std::unique_ptr<OwnRxeDevice> own_;
};

TEST_F(SecondVerbsDeviceLostTest, ARefusalOfTheSecondLeavesNothingOnTheFirst) {
  const std::string first = Env("MRD_VERBS_DEVICE");
  client::Session session = OpenFdSession();
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  client::Buffer buffer = NewBuffer(session, 4 * page, "first only ");
  client::Registration kept = Register(session, buffer, 0, page, kRemoteRead);
  const std::vector<uint64_t> before = DevicePinnedBytes();
  ASSERT_EQ(before, (std::vector<uint64_t>{page, 0}));

  // Blocks until mrd has let go of the device.
  ASSERT_EQ(Sh("timeout 60 rdma link delete " + own_->name()), 0);
  ASSERT_TRUE(WaitFor([&] {
    absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
    return info.ok() && info->devices_size() == 2 &&
           !info->devices(1).healthy();
  })) << "mrd did not notice "
      << own_->name() << " going away";

  client::RegisterOptions o = Range(buffer, 0, 4 * page, kRemoteRead);
  o.all_devices = true;
  absl::StatusOr<client::Registration> both =
      client::Registration::Register(session, o);
  ASSERT_FALSE(both.ok());
  EXPECT_TRUE(absl::StrContains(both.status().message(), own_->name()))
      << both.status();
  EXPECT_EQ(DevicePinnedBytes()[0], before[0]);

  // The first device serves on: a new registration, and peers that read
  // through it and through the one from before.
  client::Registration alone =
      Register(session, buffer, page, 2 * page, kRemoteRead);
  ASSERT_TRUE(alone.valid());
  EXPECT_EQ(DevicePinnedBytes()[0], before[0] + 2 * page);
  std::unique_ptr<peer::Peer> peer = PeerOn(session, first);
  ASSERT_NE(peer, nullptr);
  for (const client::Registration* r : {&kept, &alone}) {
    absl::StatusOr<std::string> read =
        peer->Read(r->rkey(), r->base_address(), 11);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, std::string("first only first only ")
                         .substr(r == &kept ? 0 : page % 11, 11));
  }
}

// --verbs_devices values mrd cannot serve, refused at start by name; and
// `all`.
class VerbsDevicesFlagTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveTwoVerbsDevices()) {
      GTEST_SKIP() << "two verbs devices: inside the Soft-RoCE VM only";
    }
  }
  const std::string first_ = Env("MRD_VERBS_DEVICE");
  const std::string second_ = Env("MRD_VERBS_DEVICE2");
};

TEST_F(VerbsDevicesFlagTest, WhatMrdCannotServeIsRefusedByName) {
  ExpectRefusedAtStart("--verbs_devices=" + first_,
                       "--verbs_devices names " + first_ +
                           ", which is already mrd's first device");
  ExpectRefusedAtStart("--verbs_devices=" + second_ + "," + second_,
                       "--verbs_devices names " + second_ + " twice");
  ExpectRefusedAtStart("--verbs_devices=" + second_ + ",mlx5_7",
                       "--verbs_devices: no RDMA device named 'mlx5_7'");
  ExpectRefusedAtStart("--software_devices=2",
                       "--software_devices=2 needs the software device");
  // A device whose interface has no IPv4 address leaves its peers nowhere
  // to connect.
  OwnRxeDevice bare("bare", "");
  ExpectRefusedAtStart(
      "--verbs_devices=" + bare.name(),
      "RDMA device " + bare.name() + " port 1 has no IPv4 address");
}

TEST_F(VerbsDevicesFlagTest, AllIsEveryDeviceOfTheNodeOnce) {
  MrdProcessOptions options;
  options.extra_flags = {"--verbs_devices=all"};
  absl::StatusOr<std::unique_ptr<MrdProcess>> mrd = MrdProcess::Start(options);
  ASSERT_TRUE(mrd.ok()) << mrd.status();
  client::ClientOptions client_options;
  client_options.socket_path = (*mrd)->grpc_socket();
  client_options.fd_socket_path = (*mrd)->fd_socket();
  absl::StatusOr<client::Client> client =
      client::Client::Connect(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<v1::DeviceInfo> info = client->GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  std::vector<std::string> names;
  for (const v1::DeviceInfo& d : info->devices()) names.push_back(d.name());
  ASSERT_GE(names.size(), 2u);
  EXPECT_EQ(names[0], first_);
  EXPECT_EQ(std::count(names.begin(), names.end(), first_), 1);
  EXPECT_EQ(std::count(names.begin(), names.end(), second_), 1);
  {
    const absl::Status stopped = (*mrd)->Stop();
    EXPECT_TRUE(stopped.ok()) << stopped;
  }
}

}  // namespace
}  // namespace mrd::testing
