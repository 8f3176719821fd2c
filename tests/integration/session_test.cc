// Sessions against the real mrd: who may open one on the fd socket, what a
// session reports about its peer, lease expiry and renewal, what ending a
// session (CloseSession, closing the fd socket, SIGTERM) and releasing a
// buffer take with them (W11), and how ListRegistrations describes what a
// session holds.

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/peer/soft_peer.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mrd/v1/fd.pb.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::CompletionStream;
using client::Lam;
using client::Mr;
using client::Registration;
using client::Session;

constexpr uint64_t kFrBase = 0x40000000;

uint64_t HostPageSize() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

// Polls `done` every 10 ms until it holds or `limit` passed (bounded).
template <typename Fn>
bool Eventually(Fn done, absl::Duration limit = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + limit;
  while (true) {
    if (done()) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string Pattern(const std::string& fill, uint64_t offset, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += fill[(offset + i) % fill.size()];
  return out;
}

class SessionTest : public MrdTest {
 protected:
  void SetUp() override {
    MrdTest::SetUp();
    page_ = HostPageSize();
  }

  absl::StatusOr<Registration> Reg(const Session& session, const Buffer& buffer,
                                   uint64_t offset, uint64_t length,
                                   uint32_t flags) {
    client::RegisterOptions o;
    o.buffer = buffer.id();
    o.offset = offset;
    o.length = length;
    o.flags = flags;
    return Registration::Register(session, o);
  }

  absl::StatusOr<Lam> BuildLam(const Session& session, const Buffer& buffer,
                               uint64_t offset, uint64_t length) {
    client::BuildLamOptions o;
    o.buffer = buffer.id();
    o.offset = offset;
    o.length = length;
    return Lam::Build(session, o);
  }

  uint64_t DevicePinned() {
    auto info = client_->GetDeviceInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->pinned_bytes() : 0;
  }

  // Fast-registers `lam` onto `mr` (remote read) on `peer`'s connection and
  // returns the completion (already checked for success).
  v1::Completion FastRegister(const Mr& mr, const Lam& lam,
                              const peer::Peer& peer,
                              CompletionStream& completions, uint64_t context) {
    client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(lam);
    fr.connection = peer.connection_id();
    fr.request_context = context;
    fr.base_address = kFrBase + fr.fbo;
    fr.flags = kOpRemoteRead;
    auto posted = mr.FastRegister(fr);
    EXPECT_TRUE(posted.ok()) << posted.status();
    v1::Completion done =
        NextOfKind(completions, v1::Completion::FAST_REGISTER);
    EXPECT_EQ(done.request_context(), context);
    EXPECT_EQ(done.status(), ::mrd::STATUS_SUCCESS) << done.message();
    return done;
  }

  // Reads completions until the PEER_CONNECTED event of `connection` (the
  // session learns of its peers' connections asynchronously).
  void WaitConnected(CompletionStream& completions, uint64_t connection) {
    for (int i = 0; i < 64; ++i) {
      auto c = completions.Next(absl::Seconds(10));
      ASSERT_TRUE(c.ok()) << c.status();
      if (c->kind() == v1::Completion::PEER_CONNECTED &&
          c->connection() == connection) {
        return;
      }
    }
    ADD_FAILURE() << "no PEER_CONNECTED for connection " << connection;
  }

  // A fresh peer of `session` cannot use (rkey, address): REMOTE_ACCESS_ERROR.
  void ExpectTokenDead(const Session& session, uint32_t rkey,
                       uint64_t address) {
    auto peer = ConnectPeer(session);
    ASSERT_NE(peer, nullptr);
    ExpectRemoteAccessError(peer->Read(rkey, address, 1).status());
  }

  // Reads the stream until it ends (skipping completions still queued):
  // the final status, which must come well before `limit`.
  absl::Status StreamEnd(CompletionStream& stream,
                         absl::Duration limit = absl::Seconds(10)) {
    for (int i = 0; i < 64; ++i) {
      auto c = stream.Next(limit);
      if (!c.ok()) return c.status();
    }
    return absl::InternalError("the stream never ended");
  }

  uint64_t page_ = 0;
};

// --- the fd socket's allow-list
// ------------------------------------------------

uint32_t OtherUid() { return getuid() == 0 ? 4242 : getuid() + 1; }

class SessionAllowListTest : public SessionTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {absl::StrCat("--allowed_uids=", OtherUid())};
    return o;
  }
};

TEST_F(SessionAllowListTest,
       FdSocketRefusesAUidNotOnTheListAndTheLeasePathWorks) {
  auto refused = Session::OpenFd(*client_);
  ExpectError(refused.status(), absl::StatusCode::kPermissionDenied,
              ::mrd::SEED_STATUS_UNSPECIFIED, "PEER_NOT_ALLOWED");
  // Again: the refusal left the socket serving.
  ExpectError(Session::OpenFd(*client_).status(),
              absl::StatusCode::kPermissionDenied,
              ::mrd::SEED_STATUS_UNSPECIFIED, "PEER_NOT_ALLOWED");

  auto lease = Session::OpenLease(*client_, absl::Seconds(60));
  ASSERT_TRUE(lease.ok()) << lease.status();
  auto info = lease->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->kind(), "lease");
  const std::string path = mrd_->shm_dir() + "/allowed";
  ASSERT_TRUE(
      WriteShmFile(mrd_->shm_dir(), "allowed", "lease ok ", page_).ok());
  if (getuid() != 0) {
    // Files must belong to an allowed uid, and only root can give one away.
    ExpectError(Buffer::ImportFile(*lease, "allowed", true).status(),
                absl::StatusCode::kPermissionDenied,
                ::mrd::SEED_STATUS_UNSPECIFIED, "OWNER_NOT_ALLOWED");
    return;
  }
  ASSERT_EQ(chown(path.c_str(), OtherUid(), OtherUid()), 0);
  // The fd socket refused us, so the lease is anonymous: it may open only
  // what any member of mrd's group (who can reach the 0660 socket) could.
  ExpectError(Buffer::ImportFile(*lease, "allowed", true).status(),
              absl::StatusCode::kPermissionDenied,
              ::mrd::SEED_STATUS_UNSPECIFIED, "IDENTITY_DENIES_ACCESS");
  ASSERT_EQ(chown(path.c_str(), OtherUid(), getegid()), 0);
  ASSERT_EQ(chmod(path.c_str(), 0660), 0);
  auto buffer = Buffer::ImportFile(*lease, "allowed", true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto reg = Reg(*lease, *buffer, 0, page_, kRemoteRead | kRemoteWrite);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto peer = ConnectPeer(*lease);
  ASSERT_NE(peer, nullptr);
  auto read = peer->Read(reg->rkey(), reg->base_address(), 8);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "lease ok");
}

// --- SO_PEERCRED
// ---------------------------------------------------------------

TEST_F(SessionTest, FdSessionReportsItsPeersCredentials) {
  Session session = OpenFdSession();
  EXPECT_EQ(session.peer_uid(), getuid());
  EXPECT_EQ(session.peer_pid(), static_cast<uint32_t>(getpid()));
  auto info = session.Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->kind(), "fd");
  EXPECT_EQ(info->session(), session.token());
  EXPECT_EQ(info->peer_uid(), getuid());
  EXPECT_EQ(info->peer_pid(), static_cast<uint32_t>(getpid()));
  EXPECT_EQ(info->ttl_seconds(), 0u);

  // Another process: the credentials are the connecting process's own. The
  // child only connects and hands the welcome datagram back (no gRPC after
  // fork), then waits to be told to go.
  int to_parent[2];
  int to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  const std::string fd_socket = mrd_->fd_socket();
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(to_parent[0]);
    close(to_child[1]);
    int s = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, fd_socket.c_str(), sizeof(addr.sun_path) - 1);
    if (s < 0 ||
        connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      _exit(1);
    }
    char buf[4096];
    ssize_t n = recv(s, buf, sizeof(buf), 0);
    if (n <= 0 || write(to_parent[1], buf, static_cast<size_t>(n)) != n) {
      _exit(2);
    }
    char c;
    (void)!read(to_child[0], &c, 1);
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  char buf[4096];
  ssize_t n = read(to_parent[0], buf, sizeof(buf));
  close(to_parent[0]);
  v1::FdReply welcome;
  const bool parsed = n > 0 && welcome.ParseFromArray(buf, static_cast<int>(n));
  std::optional<v1::SessionInfo> child_info;
  if (parsed && welcome.has_welcome()) {
    v1::GetSessionRequest req;
    req.set_session(welcome.welcome().session());
    auto got = client_->GetSession(req);
    EXPECT_TRUE(got.ok()) << got.status();
    if (got.ok()) child_info = *got;
  }
  close(to_child[1]);  // the child exits
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ASSERT_TRUE(parsed && welcome.has_welcome()) << n;
  EXPECT_EQ(welcome.welcome().peer_pid(), static_cast<uint32_t>(child));
  EXPECT_EQ(welcome.welcome().peer_uid(), getuid());
  ASSERT_TRUE(child_info.has_value());
  EXPECT_EQ(child_info->peer_pid(), static_cast<uint32_t>(child));
  EXPECT_EQ(child_info->peer_uid(), getuid());
  EXPECT_EQ(child_info->kind(), "fd");
  // Our own session still reports us.
  info = session.Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->peer_pid(), static_cast<uint32_t>(getpid()));
}

// --- leases
// ----------------------------------------------------------------------

class SessionLeaseTtlTest : public SessionTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {"--lease_ttl=1s"};
    return o;
  }
};

TEST_F(SessionLeaseTtlTest, LeaseWithoutCallsExpiresAndItsTokensDie) {
  Session other = OpenFdSession();
  auto lease = Session::OpenLease(*client_);  // the server's default TTL
  ASSERT_TRUE(lease.ok()) << lease.status();
  auto info = lease->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->ttl_seconds(), 1u);
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "ttl", "short-lived ", page_).ok());
  auto buffer = Buffer::ImportFile(*lease, "ttl", false);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto reg = Reg(*lease, *buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto ticket = client::PeerTicket::Create(*lease);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  auto peer = peer::SoftPeer::Connect(ticket->peer_address(), ticket->ticket());
  ASSERT_TRUE(peer.ok()) << peer.status();
  const uint32_t rkey = reg->rkey();
  const uint64_t base = reg->base_address();
  auto read = (*peer)->Read(rkey, base, 11);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "short-lived");
  EXPECT_EQ(DevicePinned(), page_);

  // No calls for 2.5 TTLs (the peer path does not renew a lease).
  absl::SleepFor(absl::Milliseconds(2500));

  ExpectError(lease->Info().status(), absl::StatusCode::kFailedPrecondition,
              ::mrd::WSAENOTCONN, "SESSION_NOT_CONNECTED");
  v1::ListRegistrationsRequest list;
  list.set_session(lease->token());
  ExpectError(client_->ListRegistrations(list).status(),
              absl::StatusCode::kFailedPrecondition, ::mrd::WSAENOTCONN,
              "SESSION_NOT_CONNECTED");
  // The reaper ends it (it runs about once a second): the token dies with
  // the session's protection domain, on its own connection too.
  EXPECT_TRUE(Eventually([&] { return !(*peer)->Read(rkey, base, 1).ok(); },
                         absl::Seconds(5)))
      << "the expired lease's token still reads";
  EXPECT_FALSE(
      peer::SoftPeer::Connect(ticket->peer_address(), ticket->ticket()).ok())
      << "the expired lease's ticket still admits peers";
  ExpectTokenDead(other, rkey, base);
  EXPECT_TRUE(Eventually([&] { return DevicePinned() == 0; }));
  reg->Detach();
  buffer->Detach();
}

TEST_F(SessionLeaseTtlTest, CallsEveryHalfSecondKeepALeaseAlive) {
  auto lease = Session::OpenLease(*client_);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(
      WriteShmFile(mrd_->shm_dir(), "kept", "kept alive ", 2 * page_).ok());
  auto buffer = Buffer::ImportFile(*lease, "kept", false);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto reg = Reg(*lease, *buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto peer = ConnectPeer(*lease);
  ASSERT_NE(peer, nullptr);
  int64_t last_expiry = 0;
  const absl::Time start = absl::Now();
  while (absl::Now() - start < absl::Milliseconds(3000)) {
    absl::SleepFor(absl::Milliseconds(500));
    auto info = lease->Info();
    ASSERT_TRUE(info.ok()) << "after " << (absl::Now() - start) << ": "
                           << info.status();
    EXPECT_GT(info->expires_unix_ms(), last_expiry);
    last_expiry = info->expires_unix_ms();
    auto read = peer->Read(reg->rkey(), reg->base_address(), 10);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, "kept alive");
  }
  // Still a working session.
  auto more = Reg(*lease, *buffer, page_, page_, kRemoteRead);
  ASSERT_TRUE(more.ok()) << more.status();
  auto read = peer->Read(more->rkey(), more->base_address(), 4);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, Pattern("kept alive ", page_, 4));
}

// --- ending sessions
// -------------------------------------------------------------

TEST_F(SessionTest, CloseSessionReleasesEverythingAndEndsItsCompletionStream) {
  auto lease = Session::OpenLease(*client_, absl::Seconds(60));
  ASSERT_TRUE(lease.ok()) << lease.status();
  const std::string token = lease->token();
  CompletionStream completions = CompletionStream::Open(*lease);
  ASSERT_TRUE(
      WriteShmFile(mrd_->shm_dir(), "closing", "closing ", 3 * page_).ok());
  auto buffer = Buffer::ImportFile(*lease, "closing", true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto reg = Reg(*lease, *buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto lam = BuildLam(*lease, *buffer, page_, 2 * page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  auto mr = Mr::Create(*lease, true, true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  auto peer = ConnectPeer(*lease);
  ASSERT_NE(peer, nullptr);
  WaitConnected(completions, peer->connection_id());
  v1::Completion fr = FastRegister(*mr, *lam, *peer, completions, 1);
  ASSERT_TRUE(peer->Read(fr.rkey(), kFrBase, 1).ok());
  ASSERT_TRUE(peer->Read(reg->rkey(), reg->base_address(), 1).ok());
  auto info = lease->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->pinned_bytes(), 3 * page_);
  EXPECT_EQ(info->registrations(), 1u);
  EXPECT_EQ(DevicePinned(), 3 * page_);

  v1::CloseSessionRequest close;
  close.set_session(token);
  ASSERT_TRUE(client_->CloseSession(close).ok());
  // Released before the reply.
  EXPECT_EQ(DevicePinned(), 0u);
  // The stream ends (OUT_OF_RANGE: ended normally), it does not hang.
  absl::Status end = StreamEnd(completions);
  EXPECT_EQ(end.code(), absl::StatusCode::kOutOfRange) << end;

  ExpectError(lease->Info().status(), absl::StatusCode::kFailedPrecondition,
              ::mrd::WSAENOTCONN, "SESSION_NOT_CONNECTED");
  ExpectError(client_->CloseSession(close).status(),
              absl::StatusCode::kFailedPrecondition, ::mrd::WSAENOTCONN,
              "SESSION_NOT_CONNECTED");
  EXPECT_FALSE(peer->Read(reg->rkey(), reg->base_address(), 1).ok());
  Session other = OpenFdSession();
  ExpectTokenDead(other, reg->rkey(), reg->base_address());
  ExpectTokenDead(other, fr.rkey(), kFrBase);
  reg->Detach();
  lam->Detach();
  mr->Detach();
  buffer->Detach();
}

// A client whose stream broke opens another before mrd has noticed the
// first one's end (mrctl completions run twice in a row): the new stream
// takes over, the old one ends ABORTED STREAM_REPLACED, and completions go
// to the new one.
TEST_F(SessionTest, ANewCompletionStreamTakesOverFromTheOpenOne) {
  Session session = OpenFdSession();
  CompletionStream first = CompletionStream::Open(session);
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  WaitConnected(first, peer->connection_id());

  CompletionStream second = CompletionStream::Open(session);
  ExpectError(StreamEnd(first), absl::StatusCode::kAborted,
              ::mrd::SEED_STATUS_UNSPECIFIED, "STREAM_REPLACED");
  auto other = ConnectPeer(session);
  ASSERT_NE(other, nullptr);
  WaitConnected(second, other->connection_id());
}

TEST_F(SessionTest, ClosingTheFdSocketReleasesEverythingAndEndsItsStream) {
  Session session = OpenFdSession();
  const std::string token = session.token();
  CompletionStream completions = CompletionStream::Open(session);
  Buffer buffer = NewBuffer(session, 3 * page_, "fd session ");
  auto reg = Reg(session, buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto lam = BuildLam(session, buffer, page_, 2 * page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  auto mr = Mr::Create(session, true, true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  WaitConnected(completions, peer->connection_id());
  v1::Completion fr = FastRegister(*mr, *lam, *peer, completions, 1);
  EXPECT_EQ(DevicePinned(), 3 * page_);

  ASSERT_TRUE(session.Close().ok());
  absl::Status end = StreamEnd(completions);
  EXPECT_EQ(end.code(), absl::StatusCode::kOutOfRange) << end;
  EXPECT_TRUE(Eventually([&] { return DevicePinned() == 0; }))
      << DevicePinned() << " bytes still pinned";
  v1::GetSessionRequest get;
  get.set_session(token);
  ExpectError(client_->GetSession(get).status(),
              absl::StatusCode::kFailedPrecondition, ::mrd::WSAENOTCONN,
              "SESSION_NOT_CONNECTED");
  EXPECT_FALSE(peer->Read(reg->rkey(), reg->base_address(), 1).ok());
  Session other = OpenFdSession();
  ExpectTokenDead(other, reg->rkey(), reg->base_address());
  ExpectTokenDead(other, fr.rkey(), kFrBase);
}

// --- W11: releasing a buffer
// ---------------------------------------------------

TEST_F(SessionTest, ReleaseBufferInvalidatesEverythingOnItFirst) {
  Session session = OpenFdSession();
  CompletionStream completions = CompletionStream::Open(session);
  const std::string fill = "released ";
  Buffer buffer = NewBuffer(session, 4 * page_, fill);
  Buffer kept = NewBuffer(session, 2 * page_, "kept ");

  auto r1 = Reg(session, buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(r1.ok()) << r1.status();
  auto r2 = Reg(session, buffer, page_, page_, kRemoteRead | kRemoteWrite);
  ASSERT_TRUE(r2.ok()) << r2.status();
  auto r2_again =
      Reg(session, buffer, page_, page_, kRemoteRead | kRemoteWrite);
  ASSERT_TRUE(r2_again.ok()) << r2_again.status();
  ASSERT_EQ(r2_again->references(), 2u);
  auto normal = Mr::Create(session, /*fast_register=*/false);
  ASSERT_TRUE(normal.ok()) << normal.status();
  client::RegisterOptions via;
  via.buffer = buffer.id();
  via.offset = 3 * page_;
  via.length = page_;
  via.flags = kRemoteRead;
  auto r3 = normal->Register(via);
  ASSERT_TRUE(r3.ok()) << r3.status();
  auto lam = BuildLam(session, buffer, 2 * page_, page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  auto fast = Mr::Create(session, true, true);
  ASSERT_TRUE(fast.ok()) << fast.status();
  auto kept_reg = Reg(session, kept, 0, page_, kRemoteRead);
  ASSERT_TRUE(kept_reg.ok()) << kept_reg.status();
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  WaitConnected(completions, peer->connection_id());
  v1::Completion fr = FastRegister(*fast, *lam, *peer, completions, 1);
  // Everything works before.
  for (auto [rkey, address] : std::vector<std::pair<uint32_t, uint64_t>>{
           {r1->rkey(), r1->base_address()},
           {r2->rkey(), r2->base_address()},
           {r3->rkey(), r3->base_address()},
           {fr.rkey(), kFrBase}}) {
    ASSERT_TRUE(peer->Read(rkey, address, 1).ok());
  }
  EXPECT_EQ(DevicePinned(), 5 * page_);

  auto released = buffer.Release();
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(released->invalidated_registrations(), 3u);
  EXPECT_EQ(released->released_lams(), 1u);

  // Every token on the buffer is dead on the peer path.
  ExpectTokenDead(session, r1->rkey(), r1->base_address());
  ExpectTokenDead(session, r2->rkey(), r2->base_address());
  ExpectTokenDead(session, r3->rkey(), r3->base_address());
  ExpectTokenDead(session, fr.rkey(), kFrBase);
  EXPECT_EQ(DevicePinned(), page_);  // the kept buffer's registration
  auto list = session.List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->buffers_size(), 1);
  EXPECT_EQ(list->buffers(0).buffer(), kept.id());
  ASSERT_EQ(list->registrations_size(), 1);
  EXPECT_EQ(list->registrations(0).registration(), kept_reg->id());
  EXPECT_EQ(list->lams_size(), 0);
  ASSERT_EQ(list->mrs_size(), 2);
  for (const auto& m : list->mrs()) EXPECT_EQ(m.state(), "free") << m.mr();
  EXPECT_EQ(list->session().pinned_bytes(), page_);

  r1->Detach();
  r2->Detach();
  r2_again->Detach();
  r3->Detach();
  lam->Detach();

  // The kept buffer is untouched, and both MR objects work again on it.
  auto other_peer = ConnectPeer(session);
  ASSERT_NE(other_peer, nullptr);
  // Fast registration needs the session to know the connection.
  WaitConnected(completions, other_peer->connection_id());
  auto read = other_peer->Read(kept_reg->rkey(), kept_reg->base_address(), 4);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "kept");
  client::RegisterOptions on_kept;
  on_kept.buffer = kept.id();
  on_kept.offset = page_;
  on_kept.length = page_;
  on_kept.flags = kRemoteRead;
  auto r4 = normal->Register(on_kept);
  ASSERT_TRUE(r4.ok()) << r4.status();
  auto kept_lam = BuildLam(session, kept, page_, page_);
  ASSERT_TRUE(kept_lam.ok()) << kept_lam.status();
  v1::Completion fr2 =
      FastRegister(*fast, *kept_lam, *other_peer, completions, 2);
  EXPECT_NE(fr2.rkey(), fr.rkey());
  EXPECT_TRUE(other_peer->Read(fr2.rkey(), kFrBase, 1).ok());
  ASSERT_TRUE(fast->Invalidate(other_peer->connection_id(), 3).ok());
  NextOfKind(completions, v1::Completion::INVALIDATE);
}

TEST_F(SessionTest, ReleasingAnUnknownOrReleasedBufferIsNotFound) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_);
  const uint64_t id = buffer.id();
  ASSERT_TRUE(buffer.Release().ok());
  v1::ReleaseBufferRequest req;
  req.set_session(session.token());
  req.set_buffer(id);
  ExpectError(client_->ReleaseBuffer(req).status(), absl::StatusCode::kNotFound,
              ::mrd::SEED_STATUS_UNSPECIFIED, "UNKNOWN_BUFFER");
}

// --- ListRegistrations
// --------------------------------------------------------------

TEST_F(SessionTest, ListRegistrationsDescribesEverythingTheSessionHolds) {
  Session session = OpenFdSession();
  CompletionStream completions = CompletionStream::Open(session);
  Buffer rw = NewBuffer(session, 4 * page_, "rw");
  auto ro = Buffer::Create(session, 2 * page_, "ro", /*writable=*/false);
  ASSERT_TRUE(ro.ok()) << ro.status();

  auto a = Reg(session, rw, 0, page_, kRemoteRead);
  ASSERT_TRUE(a.ok()) << a.status();
  auto a_again = Reg(session, rw, 0, page_, kRemoteRead);
  ASSERT_TRUE(a_again.ok()) << a_again.status();
  client::RegisterOptions mem_form;
  mem_form.buffer = rw.id();
  mem_form.offset = page_;
  mem_form.length = page_;
  mem_form.mem_flags = 3;  // MEM_READWRITE
  mem_form.base_address = 0x5000;
  auto b = Registration::Register(session, mem_form);
  ASSERT_TRUE(b.ok()) << b.status();
  auto normal = Mr::Create(session, /*fast_register=*/false);
  ASSERT_TRUE(normal.ok()) << normal.status();
  client::RegisterOptions via;
  via.buffer = ro->id();
  via.offset = 100;
  via.length = 200;
  via.flags = kRemoteRead;
  auto c = normal->Register(via);
  ASSERT_TRUE(c.ok()) << c.status();
  auto lam = BuildLam(session, rw, 2 * page_ + 10, page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  auto fast = Mr::Create(session, true, /*allow_remote_access=*/true);
  ASSERT_TRUE(fast.ok()) << fast.status();
  auto idle = Mr::Create(session, true, /*allow_remote_access=*/false);
  ASSERT_TRUE(idle.ok()) << idle.status();
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  WaitConnected(completions, peer->connection_id());
  v1::Completion fr = FastRegister(*fast, *lam, *peer, completions, 1);

  auto list = session.List();
  ASSERT_TRUE(list.ok()) << list.status();
  const v1::SessionInfo& info = list->session();
  EXPECT_EQ(info.session(), session.token());
  EXPECT_EQ(info.kind(), "fd");
  EXPECT_EQ(info.peer_pid(), static_cast<uint32_t>(getpid()));
  EXPECT_EQ(info.registrations(), 3u);
  // a: 1 page, b: 1 page, c: 1 page, the LAM: 2 pages.
  EXPECT_EQ(info.pinned_bytes(), 5 * page_);

  std::map<uint64_t, v1::BufferInfo> buffers;
  for (const auto& x : list->buffers()) buffers[x.buffer()] = x;
  ASSERT_EQ(buffers.size(), 2u);
  ASSERT_TRUE(buffers.contains(rw.id()));
  EXPECT_EQ(buffers[rw.id()].size(), 4 * page_);
  EXPECT_TRUE(buffers[rw.id()].writable());
  EXPECT_EQ(buffers[rw.id()].source(), "memfd");
  EXPECT_EQ(buffers[rw.id()].address(), rw.address());
  ASSERT_TRUE(buffers.contains(ro->id()));
  EXPECT_EQ(buffers[ro->id()].size(), 2 * page_);
  EXPECT_FALSE(buffers[ro->id()].writable());
  EXPECT_EQ(buffers[ro->id()].address(), ro->address());

  std::map<uint64_t, v1::RegistrationInfo> regs;
  for (const auto& x : list->registrations()) regs[x.registration()] = x;
  ASSERT_EQ(regs.size(), 3u);
  ASSERT_TRUE(regs.contains(a->id()));
  const v1::RegistrationInfo& ra = regs[a->id()];
  EXPECT_EQ(ra.buffer(), rw.id());
  EXPECT_EQ(ra.offset(), 0u);
  EXPECT_EQ(ra.length(), page_);
  EXPECT_EQ(ra.flags(), kRemoteRead);
  EXPECT_EQ(ra.rkey(), a->rkey());
  EXPECT_EQ(ra.lkey(), a->lkey());
  EXPECT_EQ(ra.base_address(), rw.address());
  EXPECT_EQ(ra.references(), 2u);
  ASSERT_TRUE(regs.contains(b->id()));
  const v1::RegistrationInfo& rb = regs[b->id()];
  EXPECT_EQ(rb.buffer(), rw.id());
  EXPECT_EQ(rb.offset(), page_);
  EXPECT_EQ(rb.length(), page_);
  EXPECT_EQ(rb.flags(), kRemoteRead | kRemoteWrite);  // MEM_READWRITE
  EXPECT_EQ(rb.rkey(), b->rkey());
  EXPECT_EQ(rb.base_address(), 0x5000u);
  EXPECT_EQ(rb.references(), 1u);
  ASSERT_TRUE(regs.contains(c->id()));
  const v1::RegistrationInfo& rc = regs[c->id()];
  EXPECT_EQ(rc.buffer(), ro->id());
  EXPECT_EQ(rc.offset(), 100u);
  EXPECT_EQ(rc.length(), 200u);
  EXPECT_EQ(rc.flags(), kRemoteRead);
  EXPECT_EQ(rc.rkey(), c->rkey());
  EXPECT_EQ(rc.base_address(), ro->address() + 100);
  EXPECT_EQ(rc.references(), 1u);

  ASSERT_EQ(list->lams_size(), 1);
  const v1::LamInfo& l = list->lams(0);
  EXPECT_EQ(l.lam(), lam->id());
  EXPECT_EQ(l.buffer(), rw.id());
  EXPECT_EQ(l.offset(), 2 * page_ + 10);
  EXPECT_EQ(l.length(), page_);
  EXPECT_EQ(l.page_count(), 2u);
  EXPECT_EQ(l.fbo(), 10u);

  std::map<uint64_t, v1::MrInfo> mrs;
  for (const auto& x : list->mrs()) mrs[x.mr()] = x;
  ASSERT_EQ(mrs.size(), 3u);
  ASSERT_TRUE(mrs.contains(normal->id()));
  const v1::MrInfo& mn = mrs[normal->id()];
  EXPECT_FALSE(mn.fast_register());
  EXPECT_EQ(mn.state(), "registered");
  EXPECT_EQ(mn.registration(), c->id());
  EXPECT_EQ(mn.rkey(), c->rkey());
  EXPECT_EQ(mn.base_address(), ro->address() + 100);
  EXPECT_EQ(mn.length(), 200u);
  ASSERT_TRUE(mrs.contains(fast->id()));
  const v1::MrInfo& mf = mrs[fast->id()];
  EXPECT_TRUE(mf.fast_register());
  EXPECT_TRUE(mf.allow_remote_access());
  EXPECT_EQ(mf.state(), "fast_registered");
  EXPECT_EQ(mf.rkey(), fr.rkey());
  EXPECT_EQ(mf.base_address(), kFrBase + 10);
  EXPECT_EQ(mf.length(), page_);
  ASSERT_TRUE(mrs.contains(idle->id()));
  const v1::MrInfo& mi = mrs[idle->id()];
  EXPECT_TRUE(mi.fast_register());
  EXPECT_FALSE(mi.allow_remote_access());
  EXPECT_EQ(mi.state(), "free");
  EXPECT_EQ(mi.rkey(), 0u);

  ASSERT_EQ(list->connections_size(), 1);
  EXPECT_EQ(list->connections(0).connection(), peer->connection_id());
  EXPECT_FALSE(list->connections(0).peer().empty());

  // Taking things away shows too.
  ASSERT_TRUE(fast->Invalidate(peer->connection_id(), 2).ok());
  NextOfKind(completions, v1::Completion::INVALIDATE);
  ASSERT_TRUE(a_again->Deregister().ok());
  ASSERT_TRUE(b->Deregister().ok());
  ASSERT_TRUE(lam->Release().ok());
  peer.reset();
  NextOfKind(completions, v1::Completion::PEER_DISCONNECTED);
  list = session.List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->registrations_size(), 2);
  for (const auto& r : list->registrations()) EXPECT_EQ(r.references(), 1u);
  EXPECT_EQ(list->lams_size(), 0);
  EXPECT_EQ(list->connections_size(), 0);
  for (const auto& m : list->mrs()) {
    if (m.mr() == fast->id()) {
      EXPECT_EQ(m.state(), "free");
    }
  }
  EXPECT_EQ(list->session().pinned_bytes(), 2 * page_);
  EXPECT_EQ(list->session().registrations(), 2u);
}

// --- the client library's channel lifetime
// ---------------------------------------

// The scenario, run by the test below in fresh processes against its mrd
// (MRD_TEST_GRPC_SOCKET; skipped without it): the Client and Session are
// dropped while an asynchronous RegisterMr is in flight, so the callback, on
// a gRPC callback thread, holds the channel's last reference. client.h
// allows this: "the channel lives until the last copy, and the last Session
// or handle made from it, is gone".
TEST(SessionScenario, DISABLED_LastChannelReferenceDroppedByAnAsyncCallback) {
  const char* socket = std::getenv("MRD_TEST_GRPC_SOCKET");
  if (socket == nullptr) GTEST_SKIP() << "run by ClientNeverReleases...";
  client::ClientOptions options;
  options.socket_path = socket;
  for (int i = 0; i < 3; ++i) {
    std::future<absl::StatusOr<Registration>> result;
    {
      auto c = client::Client::Connect(options);
      ASSERT_TRUE(c.ok()) << c.status();
      Session s = Session::Attach(*c, "no-such-session");
      client::RegisterOptions o;
      o.buffer = 1;
      o.length = HostPageSize();
      o.flags = kRemoteRead;
      result = Registration::RegisterFuture(s, o);
    }
    EXPECT_FALSE(result.get().ok());
    // Not synchronization: lets the callback thread finish dropping the
    // reference before the next channel exists (which would hide the bug).
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// gRPC 1.51 (Debian) runs C++ callbacks on a CallbackAlternativeCQ whose
// threads are joined when the last channel goes; if that happens on one of
// those threads, the join fails (EDEADLK, ignored) and the CQ is freed under
// the running thread (grpc/grpc#32584): the process aborts with
// "ref_counted.h: assertion failed: prior > 0". The client library must not
// release the channel on a callback thread. The outcome is undefined
// behaviour, so the scenario runs in ten fresh processes; every one must
// exit cleanly.
TEST_F(SessionTest, ClientNeverReleasesItsChannelOnAGrpcCallbackThread) {
  const std::string socket = mrd_->grpc_socket();
  for (int i = 0; i < 10; ++i) {
    pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      int null_fd = open("/dev/null", O_WRONLY);
      dup2(null_fd, STDOUT_FILENO);
      setenv("MRD_TEST_GRPC_SOCKET", socket.c_str(), 1);
      execl("/proc/self/exe", "session_test",
            "--gtest_filter=SessionScenario."
            "DISABLED_LastChannelReferenceDroppedByAnAsyncCallback",
            "--gtest_also_run_disabled_tests", static_cast<char*>(nullptr));
      _exit(127);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "run " << i << " of the scenario "
        << (WIFSIGNALED(status)
                ? absl::StrCat("died of signal ", WTERMSIG(status))
                : absl::StrCat("exited ", WEXITSTATUS(status)));
  }
}

// --- SIGTERM
// ----------------------------------------------------------------------

TEST_F(SessionTest, SigtermWithLiveSessionsExitsZeroWithNothingPinned) {
  Session session = OpenFdSession();
  CompletionStream completions = CompletionStream::Open(session);
  Buffer buffer = NewBuffer(session, 4 * page_, "sigterm ");
  auto reg = Reg(session, buffer, 0, 2 * page_, kRemoteRead);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto lam = BuildLam(session, buffer, 2 * page_, 2 * page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  auto mr = Mr::Create(session, true, true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  WaitConnected(completions, peer->connection_id());
  FastRegister(*mr, *lam, *peer, completions, 1);
  auto lease = Session::OpenLease(*client_, absl::Seconds(60));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "held", "held", page_).ok());
  auto leased = Buffer::ImportFile(*lease, "held", false);
  ASSERT_TRUE(leased.ok()) << leased.status();
  auto lease_reg = Reg(*lease, *leased, 0, page_, kRemoteRead);
  ASSERT_TRUE(lease_reg.ok()) << lease_reg.status();
  EXPECT_EQ(DevicePinned(), 5 * page_);

  // Watch health across the shutdown.
  auto health = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
      mrd_->grpc_target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(30));
  grpc::health::v1::HealthCheckRequest watch_req;
  auto watch = health->Watch(&watch_ctx, watch_req);
  grpc::health::v1::HealthCheckResponse serving;
  ASSERT_TRUE(watch->Read(&serving));
  EXPECT_EQ(serving.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  // SIGTERM (Stop also checks exit 0 and nothing pinned), while health is
  // watched: it turns NOT_SERVING while mrd is still shutting down.
  absl::Status stopped = absl::UnknownError("not stopped");
  std::thread stopper([&] { stopped = mrd_->Stop(); });
  bool not_serving = false;
  grpc::health::v1::HealthCheckResponse update;
  while (!not_serving && watch->Read(&update)) {
    not_serving =
        update.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING;
  }
  // Stop watching, or mrd waits out its shutdown grace period for us.
  watch_ctx.TryCancel();
  (void)watch->Finish();
  stopper.join();
  EXPECT_TRUE(not_serving) << "health never reported NOT_SERVING";
  EXPECT_TRUE(stopped.ok()) << stopped;
  const std::string log = mrd_->Log();
  EXPECT_TRUE(absl::StrContains(log, "device pinned bytes: 0")) << log;
  EXPECT_TRUE(absl::StrContains(log, "released: server shutting down")) << log;
  mrd_.reset();  // stopped: TearDown has nothing left to stop

  // The session's stream ended with the session.
  absl::Status end = StreamEnd(completions);
  EXPECT_NE(end.code(), absl::StatusCode::kDeadlineExceeded) << end;
  // The handles' own releases now find no server; drop them quietly.
  reg->Detach();
  lam->Detach();
  mr->Detach();
  lease_reg->Detach();
  leased->Detach();
  buffer.Detach();
}

}  // namespace
}  // namespace mrd::testing
