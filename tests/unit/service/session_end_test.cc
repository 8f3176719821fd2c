// A session's end by its fd socket's hang-up, wired as mrd wires it: a real
// FdServer on a real socket, the core on a FakeDevice, and the fair
// scheduler's workers as the core's teardown runner
// (service::TeardownsOnWorkers). The fd socket's one thread answers every
// tenant's connects and imports: a session's release (unpinning, unmapping,
// as long as the session held memory) must not run there.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "mrd/v1/mrd.pb.h"
#include "server/common/fair_scheduler.h"
#include "server/fd_socket/fd_server.h"
#include "server/service/service.h"
#include "tests/unit/core/core_test_util.h"
#include "tests/unit/fd_socket/fd_socket_test_util.h"

namespace mrd::core_test {
namespace {

using fake::FakeDevice;
using fd_socket::testing::RawClient;

constexpr absl::Duration kWait = absl::Seconds(60);

class SessionEndTest : public CoreTest {
 protected:
  SessionEndTest() : dir_("/tmp") {}

  void SetUp() override {
    CoreTest::SetUp();
    FairSchedulerOptions options;
    options.workers = 2;
    options.bulk_nice = 0;
    ASSERT_OK(workers_.Start(options));
    core_->SetTeardownRunner(
        service::TeardownsOnWorkers(&workers_, /*fair=*/true));
    fd_socket::FdServerOptions fd;
    fd.path = dir_.Sub("fd.sock");
    absl::StatusOr<std::unique_ptr<fd_socket::FdServer>> server =
        fd_socket::FdServer::Start(fd, core_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  void TearDown() override {
    if (fake_ != nullptr) fake_->ReleaseCalls(FakeDevice::Op::kDeregisterMr);
    if (server_ != nullptr) server_->Shutdown();
    CoreTest::TearDown();
  }

  // A client of the fd socket past its welcome (its token in `token`) with
  // one imported memfd of `size` bytes (its handle in `buffer`).
  std::unique_ptr<RawClient> ConnectAndImport(uint64_t size, std::string* token,
                                              uint64_t* buffer) {
    auto client = std::make_unique<RawClient>(dir_.Sub("fd.sock"));
    if (!client->valid()) {
      ADD_FAILURE() << "cannot connect to the fd socket";
      return nullptr;
    }
    std::optional<v1::FdWelcome> welcome = client->ReceiveWelcome();
    if (!welcome.has_value()) return nullptr;  // the failure is reported
    *token = welcome->session();
    UniqueFd memfd = fd_socket::testing::MakeSealedMemfd(size);
    if (!client->SendImport(1, memfd.get(), /*writable=*/true)) {
      ADD_FAILURE() << "cannot send the import";
      return nullptr;
    }
    std::optional<v1::FdReply> reply = client->Receive();
    if (!reply.has_value()) return nullptr;
    if (!reply->has_buffer()) {
      ADD_FAILURE() << "import refused: " << reply->DebugString();
      return nullptr;
    }
    *buffer = reply->buffer().buffer();
    return client;
  }

  fd_socket::testing::TempDir dir_;
  FairScheduler workers_;
  std::unique_ptr<fd_socket::FdServer> server_;
};

TEST_F(SessionEndTest, AReleaseStuckInTheDeviceHoldsUpNoOtherClientsImport) {
  std::string alice;
  uint64_t alice_buffer = 0;
  std::unique_ptr<RawClient> alice_client =
      ConnectAndImport(16 * page_, &alice, &alice_buffer);
  ASSERT_NE(alice_client, nullptr);
  absl::StatusOr<v1::RegisterMrResponse> reg =
      Register(alice, alice_buffer, 0, 16 * page_, kMrRemoteRead);
  ASSERT_OK(reg.status());
  v1::GetSessionRequest get;
  get.set_session(alice);
  v1::SessionInfo info;
  ASSERT_OK(core_->GetSession(get, &info));

  // Alice hangs up; her release gets stuck in the device.
  fake_->HoldCalls(FakeDevice::Op::kDeregisterMr);
  alice_client->Close();
  ASSERT_TRUE(fake_->AwaitHeldCalls(FakeDevice::Op::kDeregisterMr, 1, kWait));

  // Another client connects and imports meanwhile (RawClient waits 10 s
  // for each reply): the fd socket's thread is not the one stuck.
  std::string bob;
  uint64_t bob_buffer = 0;
  std::unique_ptr<RawClient> bob_client =
      ConnectAndImport(page_, &bob, &bob_buffer);
  ASSERT_NE(bob_client, nullptr);
  EXPECT_OK(Register(bob, bob_buffer, 0, page_, kMrRemoteRead).status());

  // Until released, alice's session is closing, and what it holds counts.
  EXPECT_TRUE(IsSeedError(core_->GetSession(get, &info),
                          absl::StatusCode::kFailedPrecondition,
                          ::mrd::WSAENOTCONN, "SESSION_NOT_CONNECTED"));
  EXPECT_EQ(core_->Stats().sessions, 2u);
  EXPECT_FALSE(core_->AwaitTeardowns(absl::ZeroDuration()));

  fake_->ReleaseCalls(FakeDevice::Op::kDeregisterMr);
  ASSERT_TRUE(core_->AwaitTeardowns(kWait));
  EXPECT_FALSE(fake_->IsKeyValid(reg->rkey()));
  EXPECT_EQ(core_->Stats().sessions, 1u);
  EXPECT_EQ(fake_->PinnedBytes(), page_);

  // The release ran in alice's tenant's queue, at the cost of her pages
  // (the scheduler counts the task finished once it has returned).
  ASSERT_TRUE(workers_.Drain(kWait));
  bool found = false;
  for (const FairQueueStats& queue : workers_.Stats()) {
    if (queue.key != info.tenant()) continue;
    found = true;
    EXPECT_GE(queue.cost_total, 16u);
    EXPECT_EQ(queue.finished_total, 1u);
  }
  EXPECT_TRUE(found) << "no queue for tenant " << info.tenant();
}

}  // namespace
}  // namespace mrd::core_test
