// The verbs device lost under a running mrd (inside the Soft-RoCE VM only:
// ctest label "verbs"). The test makes its own Soft-RoCE device on its own
// dummy netdev, so that deleting it does not disturb the tests that share
// rxe0, starts mrd on it, then deletes the link: mrd must notice (async
// event), report it in GetDeviceInfo and in readiness (health of
// "mrd.v1.MemoryRegistration") while liveness (health of "", the process
// serves) stays SERVING, so that a kubelet does not restart mrd and end every
// session on the node for a port flap; fail new requests with UNAVAILABLE
// "DEVICE_LOST", keep serving gRPC, let sessions close, and stop cleanly.

#include <grpcpp/grpcpp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::Registration;
using client::Session;

// Runs a shell command; returns its exit status.
int Sh(const std::string& command) {
  int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

constexpr char kReadiness[] = "mrd.v1.MemoryRegistration";

class DeviceLossTest : public MrdTest {
 protected:
  // Per-process names, so two runs never collide.
  std::string Netdev() const {
    return absl::StrCat("mrdloss", getpid() % 1000);
  }
  std::string Rdma() const { return absl::StrCat("rxeloss", getpid() % 1000); }
  std::string Address() const {
    return absl::StrCat("10.78.", getpid() % 250, ".1");
  }

  MrdProcessOptions ServerOptions() override {
    // Before mrd starts: the device it will lose.
    EXPECT_EQ(TestDeviceKind(), "verbs")
        << "DeviceLossTest needs the verbs device (run it in the VM)";
    EXPECT_EQ(Sh(absl::StrCat("ip link add ", Netdev(), " type dummy && ",
                              "ip addr add ", Address(), "/24 dev ", Netdev(),
                              " && ip link set ", Netdev(), " up && ",
                              "rdma link add ", Rdma(), " type rxe netdev ",
                              Netdev())),
              0);
    MrdProcessOptions o;
    // Later flags win: this mrd runs on the test's own device.
    o.extra_flags = {"--verbs_device=" + Rdma(),
                     "--peer_address=" + Address() + ":0"};
    return o;
  }

  void TearDown() override {
    MrdTest::TearDown();
    Sh(absl::StrCat("rdma link delete ", Rdma(), " 2>/dev/null; ip link del ",
                    Netdev(), " 2>/dev/null"));
  }
};

TEST_F(DeviceLossTest, LostDeviceIsReportedAndRequestsFailClearly) {
  auto info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->name(), Rdma());
  EXPECT_TRUE(info->healthy());
  EXPECT_EQ(Health(""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(kReadiness), grpc::health::v1::HealthCheckResponse::SERVING);

  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 2 * 4096, "lost");
  Registration before = Register(session, buffer, 0, 4096, kRemoteRead);
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  ASSERT_TRUE(peer->Read(before.rkey(), before.base_address(), 4).ok());

  ASSERT_EQ(Sh("rdma link delete " + Rdma()), 0);

  bool reported = false;
  for (int i = 0; i < 300 && !reported; ++i) {
    info = client_->GetDeviceInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    reported = !info->healthy();
    if (!reported) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(reported) << "mrd did not notice the device going away";
  EXPECT_FALSE(info->status_message().empty());
  // Readiness follows within its polling period; liveness does not.
  bool not_serving = false;
  for (int i = 0; i < 50 && !not_serving; ++i) {
    not_serving = Health(kReadiness) ==
                  grpc::health::v1::HealthCheckResponse::NOT_SERVING;
    if (!not_serving)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(not_serving);
  EXPECT_EQ(Health(""), grpc::health::v1::HealthCheckResponse::SERVING)
      << "liveness must not follow the device";

  client::RegisterOptions o;
  o.buffer = buffer.id();
  o.offset = 4096;
  o.length = 4096;
  o.flags = kRemoteRead;
  auto after = Registration::Register(session, o);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable)
      << after.status();
  EXPECT_EQ(GetErrorDetail(after.status()).reason(), "DEVICE_LOST")
      << after.status();

  // gRPC still answers, the session still closes, and mrd stops cleanly
  // (TearDown checks exit status 0 and nothing left pinned).
  before.Detach();
  EXPECT_TRUE(session.Close().ok());
}

}  // namespace
}  // namespace mrd::testing
