// Several devices in one mrd (issue 26), against the real binary on two
// software devices (--software_devices=2): GetDeviceInfo lists both, a
// registration on both gives a token per device that a peer on that
// device's peer path reads through, its deregistration kills both tokens
// and unpins both devices, and mrd refuses a device count it cannot serve
// or a handover it cannot make, by name.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

class TwoDevicesTest : public MrdTest {
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
  ASSERT_EQ(r->tokens().size(), 2);
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{4 * page, 4 * page}));

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
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{0, 0}));
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

class DeviceCountTest : public ::testing::Test {};

TEST_F(DeviceCountTest, ACountMrdCannotServeIsRefusedAtStart) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software only";
  for (const char* flag : {"--software_devices=0", "--software_devices=25"}) {
    MrdProcessOptions options;
    options.extra_flags = {flag};
    absl::StatusOr<MrdExit> exit = MrdProcess::RunToExit(options);
    ASSERT_TRUE(exit.ok()) << exit.status();
    EXPECT_NE(exit->status, 0) << flag;
    EXPECT_TRUE(absl::StrContains(exit->log, "--software_devices"))
        << exit->log;
  }
}

}  // namespace
}  // namespace mrd::testing
