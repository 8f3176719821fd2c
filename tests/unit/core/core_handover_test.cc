// The core's side of a live handover on the real software device: one core
// exports its sessions (ExportState), a second core on a device of its own
// adopts them (AdoptState). A snapshot that does not add up is refused with
// the error that names what is wrong, and nothing of it stays adopted:
// no session, no registration, no pinned page.
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"
#include "server/common/clock.h"
#include "server/common/log.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd {
namespace {

using ::mrd::core_test::IsMrdError;
using ::mrd::core_test::kMrRemoteRead;
using ::mrd::core_test::MakeSealedMemfd;

constexpr uint64_t kPages = 8;

// A device and a core on it.
struct Node {
  std::unique_ptr<device::SoftwareDevice> device;
  std::unique_ptr<core::Core> core;

  static Node Start() {
    Node node;
    absl::StatusOr<std::unique_ptr<device::SoftwareDevice>> device =
        device::SoftwareDevice::Create({});
    EXPECT_TRUE(device.ok()) << device.status();
    if (!device.ok()) return node;
    node.device = std::move(*device);
    EXPECT_TRUE(node.device->Start().ok());
    node.core = std::make_unique<core::Core>(
        node.device.get(), RealClock::Get(), core::CoreOptions{});
    return node;
  }
  void Stop() {
    if (core != nullptr) core->Shutdown();
    if (device != nullptr) {
      EXPECT_EQ(device->PinnedBytes(), 0u);
      device->Shutdown();
    }
  }
};

class CoreHandoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetMinLogLevel(LogLevel::kWarning);
    page_ = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    old_ = Node::Start();
    next_ = Node::Start();
    ASSERT_NE(old_.core, nullptr);
    ASSERT_NE(next_.core, nullptr);
    absl::StatusOr<std::string> token =
        old_.core->OnConnect({getpid(), getuid(), getgid(), std::nullopt, ""});
    ASSERT_TRUE(token.ok()) << token.status();
    session_ = *token;
    v1::ImportMemfd import;
    import.set_writable(true);
    absl::StatusOr<v1::BufferInfo> buffer =
        old_.core->OnImport(session_, MakeSealedMemfd(kPages * page_), import);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffer_ = buffer->buffer();
    v1::RegisterMrRequest reg;
    reg.set_session(session_);
    reg.set_buffer(buffer_);
    reg.set_length(2 * page_);
    reg.set_flags(kMrRemoteRead);
    v1::RegisterMrResponse registered;
    ASSERT_TRUE(old_.core->RegisterMr(reg, &registered).ok());
    v1::BuildLamRequest lam;
    lam.set_session(session_);
    lam.set_buffer(buffer_);
    lam.set_offset(4 * page_);
    lam.set_length(3 * page_);
    v1::BuildLamResponse built;
    ASSERT_TRUE(old_.core->BuildLam(lam, &built).ok());
    ASSERT_TRUE(old_.core->ExportState(&snapshot_, &fds_).ok());
    ASSERT_EQ(snapshot_.sessions_size(), 1);
    ASSERT_EQ(snapshot_.sessions(0).registrations_size(), 1);
    ASSERT_EQ(snapshot_.sessions(0).lams_size(), 1);
  }

  void TearDown() override {
    next_.Stop();
    old_.Stop();
  }

  // A copy of every fd the snapshot names (adopting takes them).
  std::vector<UniqueFd> Fds() const {
    std::vector<UniqueFd> copies;
    for (const UniqueFd& fd : fds_) {
      copies.emplace_back(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
    }
    return copies;
  }

  // `snapshot` is refused with `reason`, and the new core and device hold
  // nothing afterwards.
  void ExpectRefused(const v1::HandoverSnapshot& snapshot,
                     absl::StatusCode code, const char* reason) {
    std::vector<UniqueFd> fds = Fds();
    EXPECT_TRUE(
        IsMrdError(next_.core->AdoptState(snapshot, fds), code, reason));
    const core::CoreStats stats = next_.core->Stats();
    EXPECT_EQ(stats.sessions, 0u);
    EXPECT_EQ(stats.buffers, 0u);
    EXPECT_EQ(stats.registrations, 0u);
    EXPECT_EQ(stats.lams, 0u);
    EXPECT_EQ(next_.device->PinnedBytes(), 0u);
  }

  v1::HandedOverSession& Session(v1::HandoverSnapshot& s) {
    return *s.mutable_sessions(0);
  }

  uint64_t page_ = 0;
  Node old_;
  Node next_;
  std::string session_;
  uint64_t buffer_ = 0;
  v1::HandoverSnapshot snapshot_;
  std::vector<UniqueFd> fds_;
};

TEST_F(CoreHandoverTest, ALamWhosePagesDoNotMatchIsRefused) {
  v1::HandoverSnapshot bad = snapshot_;
  v1::HandedOverLam& lam = *Session(bad).mutable_lams(0);
  lam.set_page_count(lam.page_count() + 1);
  ExpectRefused(bad, absl::StatusCode::kInvalidArgument,
                "HANDOVER_LAM_MISMATCH");
  bad = snapshot_;
  Session(bad).mutable_lams(0)->set_fbo(8);
  ExpectRefused(bad, absl::StatusCode::kInvalidArgument,
                "HANDOVER_LAM_MISMATCH");
}

TEST_F(CoreHandoverTest, ALamOrRegistrationOfAnUnknownBufferIsRefused) {
  v1::HandoverSnapshot bad = snapshot_;
  Session(bad).mutable_lams(0)->set_buffer(buffer_ + 1000);
  ExpectRefused(bad, absl::StatusCode::kInvalidArgument,
                "HANDOVER_UNKNOWN_BUFFER");
  bad = snapshot_;
  Session(bad).mutable_registrations(0)->set_buffer(buffer_ + 1000);
  ExpectRefused(bad, absl::StatusCode::kInvalidArgument,
                "HANDOVER_UNKNOWN_BUFFER");
}

TEST_F(CoreHandoverTest, AnFdTheSnapshotDoesNotCarryIsRefused) {
  v1::HandoverSnapshot bad = snapshot_;
  Session(bad).mutable_buffers(0)->set_fd(static_cast<int32_t>(fds_.size()));
  ExpectRefused(bad, absl::StatusCode::kInvalidArgument, "HANDOVER_FD");
  // A peer connection whose socket is not among the fds.
  for (const int32_t fd : {-1, static_cast<int32_t>(fds_.size()) + 3}) {
    bad = snapshot_;
    v1::HandedOverPeerConnection* c = Session(bad).add_peer_connections();
    c->set_id(7);
    c->set_remote("127.0.0.1:1");
    c->set_fd(fd);
    ExpectRefused(bad, absl::StatusCode::kInvalidArgument, "HANDOVER_BAD_FD");
  }
}

// After every refusal above the same core adopts the snapshot as it is.
TEST_F(CoreHandoverTest, TheSnapshotAsExportedIsAdoptedAfterARefusal) {
  v1::HandoverSnapshot bad = snapshot_;
  Session(bad).mutable_lams(0)->set_page_count(1);
  ExpectRefused(bad, absl::StatusCode::kInvalidArgument,
                "HANDOVER_LAM_MISMATCH");
  std::vector<UniqueFd> fds = Fds();
  ASSERT_TRUE(next_.core->AdoptState(snapshot_, fds).ok());
  const core::CoreStats stats = next_.core->Stats();
  EXPECT_EQ(stats.sessions, 1u);
  EXPECT_EQ(stats.registrations, 1u);
  EXPECT_EQ(stats.lams, 1u);
  // Two pages registered and three in the LAM, pinned here as well.
  EXPECT_EQ(next_.device->PinnedBytes(), 5 * page_);
}

}  // namespace
}  // namespace mrd
