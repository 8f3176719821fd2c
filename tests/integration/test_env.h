// Shared fixture for integration tests: a real mrd process, a client
// connected to it over its Unix sockets, and small helpers for peers and
// status checks. TearDown stops mrd with SIGTERM and fails the test if mrd
// exited uncleanly or left anything pinned.
#ifndef MRD_TESTS_INTEGRATION_TEST_ENV_H_
#define MRD_TESTS_INTEGRATION_TEST_ENV_H_

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/lib/mrd_client.h"
#include "client/peer/peer.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mrd/status.h"
#include "tests/integration/mrd_process.h"

namespace mrd::testing {

// Flag values of the seeds (R3, F3).
inline constexpr uint32_t kLocalWrite = 0x1;
inline constexpr uint32_t kRemoteRead = 0x2;
inline constexpr uint32_t kRemoteWrite = 0x5;
inline constexpr uint32_t kOpSilentSuccess = 0x1;
inline constexpr uint32_t kOpRemoteRead = 0x8;
inline constexpr uint32_t kOpRemoteWrite = 0x30;

// Waits for the next completion of `kind` on `stream`, skipping peer events
// of other kinds.
inline v1::Completion NextCompletionOfKind(client::CompletionStream& stream,
                                           v1::Completion::Kind kind) {
  for (int i = 0; i < 16; ++i) {
    auto c = stream.Next(absl::Seconds(10));
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return {};
    if (c->kind() == kind) return *c;
  }
  ADD_FAILURE() << "no completion of kind " << kind;
  return {};
}

// Polls `condition` until it holds or `timeout` passes (no fixed sleeps: the
// loop only paces itself while it waits for what mrd does asynchronously).
inline bool WaitFor(const std::function<bool()>& condition,
                    absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return condition();
}

// What ConnectPeer gives when the peer could not connect (the failure is
// recorded there): a peer whose every operation fails with why, so that a
// test goes on to fail its own checks instead of crashing on a null peer.
class UnconnectedPeer final : public peer::Peer {
 public:
  explicit UnconnectedPeer(absl::Status why)
      : why_(absl::FailedPreconditionError(
            absl::StrCat("the peer never connected: ", why.ToString()))) {}
  absl::StatusOr<std::string> Read(uint32_t, uint64_t, uint64_t) override {
    return why_;
  }
  absl::Status Write(uint32_t, uint64_t, absl::string_view) override {
    return why_;
  }
  uint64_t connection_id() const override { return 0; }
  uint64_t max_message_size() const override { return 0; }

 private:
  const absl::Status why_;
};

// RegisterMr options for [offset, offset + length) of `buffer`.
inline client::RegisterOptions Range(const client::Buffer& buffer,
                                     uint64_t offset, uint64_t length,
                                     uint32_t flags = 0) {
  client::RegisterOptions o;
  o.buffer = buffer.id();
  o.offset = offset;
  o.length = length;
  o.flags = flags;
  return o;
}

// mrd reporting the progress of long registrations early and often, with
// one prefault thread so that a 1 GiB registration pins long enough to be
// seen and cancelled (issue 9, part 3).
inline MrdProcessOptions EagerProgressOptions() {
  MrdProcessOptions o;
  o.extra_flags = {"--progress_after=1ms", "--progress_interval=2ms",
                   "--prefault_threads=1"};
  return o;
}

class MrdTest : public ::testing::Test {
 protected:
  virtual MrdProcessOptions ServerOptions() { return {}; }

  void SetUp() override {
    auto mrd = MrdProcess::Start(ServerOptions());
    ASSERT_TRUE(mrd.ok()) << mrd.status();
    mrd_ = std::move(*mrd);
    client::ClientOptions options;
    options.socket_path = mrd_->grpc_socket();
    options.fd_socket_path = mrd_->fd_socket();
    auto c = client::Client::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::make_unique<client::Client>(std::move(*c));
  }

  void TearDown() override {
    client_.reset();
    if (mrd_ && HasFailure()) {
      std::cerr << "---- mrd log ----\n" << mrd_->Log() << "---- end ----\n";
    }
    if (mrd_) {
      absl::Status stopped = mrd_->Stop();
      EXPECT_TRUE(stopped.ok()) << stopped;
    }
  }

  client::Session OpenFdSession() {
    auto s = client::Session::OpenFd(*client_);
    EXPECT_TRUE(s.ok()) << s.status();
    return std::move(*s);
  }

  // What mrd has pinned now (GetDeviceInfo).
  uint64_t PinnedBytes() {
    absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->pinned_bytes() : ~uint64_t{0};
  }

  // Pinned bytes of each device (GetDeviceInfo's devices).
  std::vector<uint64_t> DevicePinnedBytes() {
    absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    std::vector<uint64_t> pinned;
    if (info.ok()) {
      for (const v1::DeviceInfo& d : info->devices()) {
        pinned.push_back(d.pinned_bytes());
      }
    }
    return pinned;
  }

  client::Buffer NewBuffer(const client::Session& session, uint64_t size,
                           const std::string& fill = "") {
    auto b = client::Buffer::Create(session, size);
    EXPECT_TRUE(b.ok()) << b.status();
    if (!fill.empty()) {
      char* data = static_cast<char*>(b->data());
      for (uint64_t i = 0; i < size; ++i) data[i] = fill[i % fill.size()];
    }
    return std::move(*b);
  }

  client::Registration Register(const client::Session& session,
                                const client::Buffer& buffer, uint64_t offset,
                                uint64_t length, uint32_t flags) {
    client::RegisterOptions o;
    o.buffer = buffer.id();
    o.offset = offset;
    o.length = length;
    o.flags = flags;
    auto r = client::Registration::Register(session, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return std::move(*r);
  }

  // A peer of the device under test (software: TCP peer path; verbs: an RC
  // queue pair connected with librdmacm), attached to `session`'s PD.
  // Never null: a peer that could not connect is an UnconnectedPeer (and
  // the test has failed).
  std::unique_ptr<peer::Peer> ConnectPeer(const client::Session& session) {
    auto ticket = client::PeerTicket::Create(session);
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    if (!ticket.ok()) return std::make_unique<UnconnectedPeer>(ticket.status());
    auto p = TryConnectPeer(ticket->peer_address(), ticket->ticket());
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return std::make_unique<UnconnectedPeer>(p.status());
    return std::move(*p);
  }
  absl::StatusOr<std::unique_ptr<peer::Peer>> TryConnectPeer(
      const std::string& peer_address, const std::string& ticket) {
    return peer::ConnectPeer(TestDeviceKind(), peer_address, ticket);
  }

  // mrd's health of `service` ("" liveness, "mrd.v1.MemoryRegistration"
  // readiness, "mrd.v1.MemoryRegistration/<device>" a device's).
  grpc::health::v1::HealthCheckResponse::ServingStatus Health(
      const std::string& service) {
    auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
        mrd_->grpc_target(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status status = stub->Check(&ctx, req, &resp);
    EXPECT_TRUE(status.ok()) << service << ": " << status.error_message();
    return resp.status();
  }

  // Waits for the next completion of `kind`, skipping peer events of other
  // kinds.
  v1::Completion NextOfKind(client::CompletionStream& stream,
                            v1::Completion::Kind kind) {
    return NextCompletionOfKind(stream, kind);
  }

  std::unique_ptr<MrdProcess> mrd_;
  std::unique_ptr<client::Client> client_;
};

// Expects an error with this code, seed outcome and reason.
inline void ExpectError(const absl::Status& status, absl::StatusCode code,
                        ::mrd::SeedStatus seed, const std::string& reason) {
  EXPECT_EQ(status.code(), code) << status;
  ::mrd::ErrorDetail detail = GetErrorDetail(status);
  EXPECT_EQ(detail.seed_status(), seed) << status;
  if (!reason.empty()) {
    EXPECT_EQ(detail.reason(), reason) << status;
  }
}

inline void ExpectRemoteAccessError(const absl::Status& status) {
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  EXPECT_EQ(GetErrorDetail(status).reason(), "REMOTE_ACCESS_ERROR") << status;
}

}  // namespace mrd::testing

#endif  // MRD_TESTS_INTEGRATION_TEST_ENV_H_
