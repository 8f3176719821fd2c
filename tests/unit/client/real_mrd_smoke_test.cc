// Opt-in smoke test of the client library against a running mrd with the
// software device: set MRD_SMOKE_RUNTIME_DIR to its --runtime_dir. Skipped
// otherwise (the lead's integration tests start mrd themselves).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "client/lib/mrd_client.h"
#include "client/peer/soft_peer.h"
#include "gtest/gtest.h"

namespace mrd::client {
namespace {

class RealMrdSmokeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* dir = std::getenv("MRD_SMOKE_RUNTIME_DIR");
    if (dir == nullptr || *dir == '\0') {
      GTEST_SKIP() << "MRD_SMOKE_RUNTIME_DIR not set";
    }
    ClientOptions options;
    options.socket_path = std::string(dir) + "/mrd.sock";
    options.fd_socket_path = std::string(dir) + "/fd.sock";
    absl::StatusOr<Client> c = Client::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_.emplace(*std::move(c));
    absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    peer_address_ = info->peer_address();
  }

  std::optional<Client> client_;
  std::string peer_address_;
};

TEST_F(RealMrdSmokeTest, FdBufferIsSharedWithRemotePeers) {
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<Buffer> buffer = Buffer::Create(*session, 65536, "smoke");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memcpy(buffer->data(), "local bytes", 11);
  absl::StatusOr<Registration> reg = Registration::Register(
      *session, {.buffer = buffer->id(),
                 .length = 65536,
                 .flags = v1::NDK_MR_FLAG_ALLOW_REMOTE_READ |
                          v1::NDK_MR_FLAG_ALLOW_REMOTE_WRITE});
  ASSERT_TRUE(reg.ok()) << reg.status();
  absl::StatusOr<PeerTicket> ticket = PeerTicket::Create(*session);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  auto peer = peer::SoftPeer::Connect(peer_address_, ticket->ticket());
  ASSERT_TRUE(peer.ok()) << peer.status();
  absl::StatusOr<std::string> read =
      (*peer)->Read(reg->rkey(), reg->base_address(), 11);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "local bytes");
  ASSERT_TRUE(
      (*peer)->Write(reg->rkey(), reg->base_address() + 100, "remote").ok());
  EXPECT_EQ(std::memcmp(static_cast<char*>(buffer->data()) + 100, "remote", 6),
            0);
  // Deregistration revokes the token at once.
  ASSERT_EQ(*reg->Deregister(), 0u);
  EXPECT_EQ((*peer)->Read(reg->rkey(), reg->base_address(), 1).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(RealMrdSmokeTest, ClosedFdAndErrorsKeepTheSessionUsable) {
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  int fd = ::memfd_create("closed", MFD_CLOEXEC);
  ::close(fd);
  absl::StatusOr<Buffer> bad = session->ImportMemfd(fd, false, 0);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(unsealed, 4096), 0);
  absl::StatusOr<Buffer> refused = session->ImportMemfd(unsealed, false, 4096);
  ::close(unsealed);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(SeedStatusOf(refused.status()), v1::SEED_STATUS_UNSPECIFIED)
      << refused.status();
  EXPECT_TRUE(session->Ping().ok());
  absl::StatusOr<Buffer> buffer = Buffer::Create(*session, 4096);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  absl::StatusOr<Registration> zero =
      Registration::Register(*session, {.buffer = buffer->id(), .length = 0});
  EXPECT_EQ(SeedStatusOf(zero.status()), v1::STATUS_INVALID_PARAMETER);
  absl::StatusOr<Registration> small = Registration::Register(
      *session,
      {.buffer = buffer->id(), .length = 64, .descriptor_capacity = 8});
  EXPECT_EQ(SeedStatusOf(small.status()), v1::WSAEFAULT);
  EXPECT_EQ(RequiredSizeOf(small.status()), 24u);
  absl::StatusOr<Registration> write_on_readonly =
      Registration::Register(*session, {.buffer = buffer->id(), .length = 64});
  EXPECT_TRUE(write_on_readonly.ok()) << write_on_readonly.status();
}

TEST_F(RealMrdSmokeTest, ManyAsyncRegistrations) {
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok());
  absl::StatusOr<Buffer> buffer = Buffer::Create(*session, 1 << 20);
  ASSERT_TRUE(buffer.ok());
  constexpr int kCount = 64;
  absl::Mutex mu;
  std::vector<Registration> regs;
  std::vector<absl::Status> errors;
  absl::BlockingCounter pending(kCount);
  for (int i = 0; i < kCount; ++i) {
    Registration::RegisterAsync(*session,
                                {.buffer = buffer->id(),
                                 .offset = static_cast<uint64_t>(i) * 4096,
                                 .length = 4096,
                                 .flags = v1::NDK_MR_FLAG_ALLOW_REMOTE_READ},
                                [&](absl::StatusOr<Registration> r) {
                                  absl::MutexLock l(&mu);
                                  if (r.ok()) {
                                    regs.push_back(*std::move(r));
                                  } else {
                                    errors.push_back(r.status());
                                  }
                                  pending.DecrementCount();
                                });
  }
  pending.Wait();
  EXPECT_TRUE(errors.empty()) << errors.front();
  EXPECT_EQ(regs.size(), static_cast<size_t>(kCount));
  absl::StatusOr<v1::ListRegistrationsResponse> list = session->List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->registrations_size(), kCount);
  regs.clear();
  list = session->List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->registrations_size(), 0);
}

TEST_F(RealMrdSmokeTest, FastRegisterOnAPeerConnection) {
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok());
  CompletionStream stream = CompletionStream::Open(*session);
  absl::StatusOr<Buffer> buffer = Buffer::Create(*session, 3 * 4096);
  ASSERT_TRUE(buffer.ok());
  std::memcpy(static_cast<char*>(buffer->data()) + 4096 + 10, "fast", 4);
  absl::StatusOr<PeerTicket> ticket = PeerTicket::Create(*session);
  ASSERT_TRUE(ticket.ok());
  auto peer = peer::SoftPeer::Connect(peer_address_, ticket->ticket());
  ASSERT_TRUE(peer.ok()) << peer.status();
  const uint64_t connection = (*peer)->connection_id();

  absl::StatusOr<Mr> mr = Mr::Create(*session, /*fast_register=*/true,
                                     /*allow_remote_access=*/true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  {
    absl::StatusOr<Lam> lam = Lam::Build(
        *session, {.buffer = buffer->id(), .offset = 4096 + 10, .length = 100});
    ASSERT_TRUE(lam.ok()) << lam.status();
    FastRegisterOptions fr = FastRegisterOptions::FromLam(*lam);
    fr.connection = connection;
    fr.request_context = 1234;
    fr.base_address = 0x10000000 + lam->fbo();
    fr.flags = v1::NDK_OP_FLAG_ALLOW_REMOTE_READ;
    absl::StatusOr<uint64_t> wr = mr->FastRegister(fr);
    ASSERT_TRUE(wr.ok()) << wr.status();
    absl::StatusOr<v1::Completion> c;
    do {
      c = stream.Next(absl::Seconds(10));
      ASSERT_TRUE(c.ok()) << c.status();
    } while (c->kind() != v1::Completion::FAST_REGISTER);
    EXPECT_EQ(c->request_context(), 1234u);
    EXPECT_EQ(c->status(), v1::STATUS_SUCCESS) << c->message();
    absl::StatusOr<std::string> read =
        (*peer)->Read(c->rkey(), fr.base_address, 4);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, "fast");

    absl::StatusOr<uint64_t> inv = mr->Invalidate(connection, 99);
    ASSERT_TRUE(inv.ok()) << inv.status();
    do {
      c = stream.Next(absl::Seconds(10));
      ASSERT_TRUE(c.ok()) << c.status();
    } while (c->kind() != v1::Completion::INVALIDATE);
    EXPECT_EQ(c->request_context(), 99u);
  }
  EXPECT_TRUE(mr->Close().ok());
}

}  // namespace
}  // namespace mrd::client
