// File-descriptor exhaustion against the real mrd, started under
// `prlimit --nofile=1024` (issue 8, item 4): a client that imports the same
// memfd over and over, or opens fd-socket connections by the thousand, is
// refused with RESOURCE_EXHAUSTED naming the limit (LIMIT_SESSION_FDS,
// LIMIT_TOTAL_FDS) long before mrd runs out of fds, while a bystander fd
// session and a gRPC lease session keep working, and every fd comes back
// when the attacker goes.

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mrd/v1/fd.pb.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

template <typename Fn>
bool Eventually(Fn done, absl::Duration limit = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + limit;
  while (true) {
    if (done()) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

size_t CountFds(pid_t pid) {
  size_t n = 0;
  std::error_code ec;
  std::filesystem::directory_iterator it(absl::StrCat("/proc/", pid, "/fd"),
                                         ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// This test process opens a thousand sockets: lift its own soft limit.
void RaiseOwnFdLimit() {
  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
  rl.rlim_cur = rl.rlim_max;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &rl), 0);
}

UniqueFd SealedMemfd(uint64_t size) {
  UniqueFd fd(memfd_create("fd-limit", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(ftruncate(fd.get(), static_cast<off_t>(size)), 0);
  EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

// The fd socket spoken by hand: welcome, imports, replies.
class RawFdSocket {
 public:
  explicit RawFdSocket(const std::string& path) {
    sock_.Reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    connected_ = sock_.valid() &&
                 connect(sock_.get(), reinterpret_cast<sockaddr*>(&addr),
                         sizeof(addr)) == 0;
  }
  bool connected() const { return connected_; }

  bool SendImport(uint64_t sequence, int fd) {
    v1::FdRequest request;
    request.set_sequence(sequence);
    request.mutable_import_memfd()->set_writable(true);
    const std::string bytes = request.SerializeAsString();
    iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    return sendmsg(sock_.get(), &msg, MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }

  // The next reply; nullopt on timeout, EOF or junk.
  std::optional<v1::FdReply> Receive(
      absl::Duration timeout = absl::Seconds(10)) {
    pollfd p{sock_.get(), POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) !=
        1) {
      return std::nullopt;
    }
    char data[8192];
    const ssize_t n = recv(sock_.get(), data, sizeof(data), 0);
    if (n <= 0) return std::nullopt;
    v1::FdReply reply;
    if (!reply.ParseFromArray(data, static_cast<int>(n))) return std::nullopt;
    return reply;
  }

  void Close() { sock_.Reset(); }

 private:
  UniqueFd sock_;
  bool connected_ = false;
};

// Imports `memfd` on `attacker` (already welcomed) until a refusal or
// `max_imports`; returns the refusal (nullopt if none came) and counts the
// imports that succeeded.
std::optional<v1::FdError> ImportUntilRefused(RawFdSocket& attacker, int memfd,
                                              int max_imports, int* imported) {
  *imported = 0;
  for (int i = 1; i <= max_imports; ++i) {
    if (!attacker.SendImport(static_cast<uint64_t>(i), memfd)) {
      ADD_FAILURE() << "sendmsg failed after " << *imported << " imports";
      return std::nullopt;
    }
    std::optional<v1::FdReply> reply = attacker.Receive();
    if (!reply.has_value()) {
      ADD_FAILURE() << "no reply after " << *imported << " imports";
      return std::nullopt;
    }
    if (reply->has_error()) return reply->error();
    ++*imported;
  }
  return std::nullopt;
}

// A fresh gRPC connection (so the server must accept() a new one) that asks
// for health, and device info through the client library.
absl::Status FreshGrpcWorks(const MrdProcess& mrd) {
  client::ClientOptions options;
  options.socket_path = mrd.grpc_socket();
  options.fd_socket_path = mrd.fd_socket();
  options.rpc_timeout = absl::Seconds(5);
  auto c = client::Client::Connect(options);
  if (!c.ok()) return c.status();
  auto info = c->GetDeviceInfo();
  if (!info.ok()) return info.status();
  return HealthCheckOnNewConnection(mrd);
}

class FdLimitTest : public MrdTest {
 protected:
  // Imports and registers a 4 KiB buffer in `session` (no abort on error,
  // unlike NewBuffer: the old server fails here).
  absl::Status UseBuffer(const client::Session& session) {
    auto b = client::Buffer::Create(session, 4096);
    if (!b.ok()) return b.status();
    client::RegisterOptions o;
    o.buffer = b->id();
    o.offset = 0;
    o.length = 4096;
    o.flags = kLocalWrite;
    return client::Registration::Register(session, o).status();
  }

  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.nofile = "1024";  // the common default, soft and hard
    o.metrics = true;
    // One uid plays every session here: the fd budget, not the tenant's
    // share of sessions (tenant_test), is what these tests reach.
    o.extra_flags = {"--tenant_default_percent=100"};
    return o;
  }
  void SetUp() override {
    RaiseOwnFdLimit();
    MrdTest::SetUp();
  }
};

// One session imports the same 4 KiB memfd again and again: it is refused
// with LIMIT_SESSION_FDS (naming the flag and its value) long before mrd's
// 1,024 fds are gone; a bystander fd session and a gRPC lease session keep
// working during and after; closing the attacker gives every fd back.

// fds the TSan build's mrd (MRD_TEST_MRD_BINARY) may open for its runtime
// after the baseline is taken: the report file and the pipes to its
// symbolizer, at its first (library-only) report.
size_t RuntimeFds() { return MrdBinaryIsForeign() ? 4 : 0; }

TEST_F(FdLimitTest, OneSessionImportingOneMemfdIsRefusedNotFatal) {
  client::Session bystander = OpenFdSession();
  auto lease = client::Session::OpenLease(*client_);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(UseBuffer(bystander).ok());
  const size_t baseline = CountFds(mrd_->pid());

  RawFdSocket attacker(mrd_->fd_socket());
  ASSERT_TRUE(attacker.connected());
  auto welcome = attacker.Receive();
  ASSERT_TRUE(welcome.has_value() && welcome->has_welcome());
  UniqueFd memfd = SealedMemfd(4096);
  int imported = 0;
  std::optional<v1::FdError> refusal =
      ImportUntilRefused(attacker, memfd.get(), 4096, &imported);
  ASSERT_TRUE(refusal.has_value())
      << "4096 imports of one memfd were all accepted";
  ExpectError(client::StatusFromFdError(*refusal),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_FDS");
  EXPECT_TRUE(absl::StrContains(refusal->message(), "--max_session_fds="))
      << refusal->message();
  EXPECT_GT(imported, 100);
  EXPECT_LT(CountFds(mrd_->pid()), 1024u - 200u);

  // While the attacker holds everything it could get.
  {
    EXPECT_TRUE(UseBuffer(bystander).ok()) << UseBuffer(bystander);
    EXPECT_TRUE(lease->Info().ok());
    EXPECT_TRUE(FreshGrpcWorks(*mrd_).ok()) << FreshGrpcWorks(*mrd_);
    auto other = client::Session::OpenFd(*client_);
    EXPECT_TRUE(other.ok()) << other.status();
  }

  attacker.Close();
  EXPECT_TRUE(Eventually([&] {
    return CountFds(mrd_->pid()) <= baseline + RuntimeFds();
  })) << CountFds(mrd_->pid())
      << " fds open, " << baseline << " before";
  EXPECT_TRUE(FreshGrpcWorks(*mrd_).ok());
  auto after = client::Session::OpenFd(*client_);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(UseBuffer(*after).ok()) << UseBuffer(*after);
  EXPECT_TRUE(lease->Info().ok());
  // The refusal is counted and exported.
  EXPECT_TRUE(absl::StrContains(mrd_->Log(), "fd budget: limit 1024"))
      << mrd_->Log();
}

// Several sessions together fill the whole budget: the next import is
// refused with LIMIT_TOTAL_FDS, and gRPC (which needs fds of its own for
// every new connection) keeps answering.
TEST_F(FdLimitTest, SessionsTogetherHitTheTotalBudgetAndGrpcSurvives) {
  client::Session bystander = OpenFdSession();
  auto lease = client::Session::OpenLease(*client_);
  ASSERT_TRUE(lease.ok()) << lease.status();
  const size_t baseline = CountFds(mrd_->pid());
  UniqueFd memfd = SealedMemfd(4096);

  std::vector<std::unique_ptr<RawFdSocket>> attackers;
  bool total_refused = false;
  for (int s = 0; s < 16 && !total_refused; ++s) {
    auto a = std::make_unique<RawFdSocket>(mrd_->fd_socket());
    ASSERT_TRUE(a->connected());
    auto welcome = a->Receive();
    ASSERT_TRUE(welcome.has_value());
    if (welcome->has_error()) {
      ExpectError(client::StatusFromFdError(welcome->error()),
                  absl::StatusCode::kResourceExhausted,
                  ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_FDS");
      total_refused = true;
      break;
    }
    int imported = 0;
    auto refusal = ImportUntilRefused(*a, memfd.get(), 4096, &imported);
    ASSERT_TRUE(refusal.has_value());
    const std::string reason = refusal->detail().reason();
    ASSERT_TRUE(reason == "LIMIT_SESSION_FDS" || reason == "LIMIT_TOTAL_FDS")
        << refusal->DebugString();
    if (reason == "LIMIT_TOTAL_FDS") {
      EXPECT_TRUE(absl::StrContains(refusal->message(), "--fd_reserve="))
          << refusal->message();
      total_refused = true;
    }
    attackers.push_back(std::move(a));
  }
  ASSERT_TRUE(total_refused);
  EXPECT_LT(CountFds(mrd_->pid()), 1024u - 128u);

  // gRPC: many fresh connections, and the sessions it serves.
  for (int i = 0; i < 20; ++i) {
    absl::Status s = FreshGrpcWorks(*mrd_);
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(lease->Info().ok());
  EXPECT_TRUE(bystander.Info().ok());
  // Metrics are served too (the metrics listener needs an fd per scrape).
  auto info = client_->GetDeviceInfo();
  EXPECT_TRUE(info.ok()) << info.status();

  attackers.clear();
  EXPECT_TRUE(Eventually([&] {
    return CountFds(mrd_->pid()) <= baseline + RuntimeFds();
  })) << CountFds(mrd_->pid())
      << " fds open, " << baseline << " before";
  auto after = client::Session::OpenFd(*client_);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(UseBuffer(*after).ok()) << UseBuffer(*after);
  EXPECT_TRUE(FreshGrpcWorks(*mrd_).ok());
}

// 1,100 fd-socket connections (more than mrd's open-file limit): those
// beyond the budget are refused with a reason, gRPC keeps answering, and
// everything comes back when they close.
TEST_F(FdLimitTest, FdSocketConnectionsBeyondTheBudgetAreRefused) {
  auto lease = client::Session::OpenLease(*client_);
  ASSERT_TRUE(lease.ok()) << lease.status();
  const size_t baseline = CountFds(mrd_->pid());
  std::vector<std::unique_ptr<RawFdSocket>> conns;
  int welcomed = 0;
  int refused = 0;
  for (int i = 0; i < 1100; ++i) {
    auto c = std::make_unique<RawFdSocket>(mrd_->fd_socket());
    if (!c->connected()) continue;  // a full backlog: also a refusal
    auto reply = c->Receive(absl::Seconds(5));
    ASSERT_TRUE(reply.has_value()) << "no answer to connection " << i;
    if (reply->has_welcome()) {
      ++welcomed;
    } else {
      const std::string reason = reply->error().detail().reason();
      EXPECT_TRUE(reason == "LIMIT_TOTAL_FDS" || reason == "LIMIT_SESSIONS" ||
                  reason == "TOO_MANY_SESSIONS")
          << reply->DebugString();
      ++refused;
    }
    conns.push_back(std::move(c));
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(welcomed, 500);
  EXPECT_LT(CountFds(mrd_->pid()), 1024u - 128u);
  for (int i = 0; i < 10; ++i) {
    absl::Status s = FreshGrpcWorks(*mrd_);
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(lease->Info().ok());

  conns.clear();
  EXPECT_TRUE(Eventually([&] {
    return CountFds(mrd_->pid()) <= baseline + RuntimeFds();
  })) << CountFds(mrd_->pid())
      << " fds open, " << baseline << " before";
  auto after = client::Session::OpenFd(*client_);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(UseBuffer(*after).ok()) << UseBuffer(*after);
  EXPECT_TRUE(FreshGrpcWorks(*mrd_).ok());
}

class FdLimitRaiseTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.nofile = "512:2048";
    return o;
  }
};

// mrd raises its soft open-file limit to the hard limit and budgets that.
TEST_F(FdLimitRaiseTest, SoftLimitIsRaisedToTheHardLimit) {
  rlimit rl{};
  ASSERT_EQ(prlimit(mrd_->pid(), RLIMIT_NOFILE, nullptr, &rl), 0);
  EXPECT_EQ(rl.rlim_cur, 2048u);
  EXPECT_EQ(rl.rlim_max, 2048u);
  EXPECT_TRUE(absl::StrContains(mrd_->Log(), "soft 512 -> 2048"))
      << mrd_->Log();
  EXPECT_TRUE(absl::StrContains(mrd_->Log(),
                                "fd budget: limit 2048, reserve "
                                "256"))
      << mrd_->Log();
}

}  // namespace
}  // namespace mrd::testing
