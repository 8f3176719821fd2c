// mrd's gRPC socket under a flood of connections (issue 8: no lock-out, fd
// exhaustion never fatal), and the bound on each connection's open calls
// (issue 24: one client's backlog stays out of gRPC's shared queue). gRPC
// 1.51 accepts its own sockets without any limit and stops accepting for good
// after accept4 fails with EMFILE; mrd accepts on its socket itself
// (server/service/grpc_acceptor.h), caps the connections in total and per uid,
// and refuses with an HTTP/2 GOAWAY whose text names the limit.
#include <grp.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/lib/mrd_client.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "tests/integration/mrd_process.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

// One connection to mrd's gRPC socket, spoken to by hand: whether mrd
// refused it (its GOAWAY text, or the socket closed at once).
struct RawConnection {
  UniqueFd fd;
  bool connected = false;
  bool refused = false;
  std::string text;  // what mrd sent, if anything
};

RawConnection Connect(const std::string& path) {
  RawConnection c;
  c.fd.Reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  c.connected =
      c.fd.valid() && ::connect(c.fd.get(), reinterpret_cast<sockaddr*>(&addr),
                                sizeof(addr)) == 0;
  return c;
}

// Reads what mrd sends within `wait`: a refusal is a GOAWAY naming a limit
// followed by the end of the stream. An accepted connection gets gRPC's
// SETTINGS at most, and stays open.
void Probe(RawConnection& c, absl::Duration wait) {
  const absl::Time deadline = absl::Now() + wait;
  while (true) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return;
    pollfd p{c.fd.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) != 1) return;
    char buf[4096];
    const ssize_t n = ::recv(c.fd.get(), buf, sizeof(buf), 0);
    if (n <= 0) {
      c.refused = true;  // closed
      return;
    }
    c.text.append(buf, static_cast<size_t>(n));
    if (absl::StrContains(c.text, "mrd: LIMIT_")) c.refused = true;
  }
}

template <typename Fn>
bool Eventually(Fn done, absl::Duration limit = absl::Seconds(15)) {
  const absl::Time deadline = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return true;
}

// Opens connections until mrd refuses one (at most `most`); the refused one
// is last. Then, once mrd has looked for closed connections again (it counts
// ones closed in the last second, e.g. MrdProcess's health check, until it
// looks), tops up the same way: every slot is then held by `conns`.
std::vector<RawConnection> OpenUntilRefused(const std::string& path, int most) {
  std::vector<RawConnection> conns;
  for (int round = 0; round < 2; ++round) {
    if (round == 1) absl::SleepFor(absl::Milliseconds(1500));
    for (int i = 0; i < most; ++i) {
      RawConnection c = Connect(path);
      EXPECT_TRUE(c.connected) << i;
      Probe(c, absl::Milliseconds(500));
      const bool refused = c.refused;
      conns.push_back(std::move(c));
      if (refused) break;
    }
  }
  return conns;
}

// How many of `conns` mrd accepted.
size_t Accepted(const std::vector<RawConnection>& conns) {
  size_t n = 0;
  for (const RawConnection& c : conns) n += c.refused ? 0 : 1;
  return n;
}

class GrpcConnectionsTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {"--grpc_max_connections=12",
                     "--grpc_max_connections_per_tenant=6",
                     "--socket_mode=0666"};
    return o;
  }
  void SetUp() override {
    MrdTest::SetUp();
    if (HasFatalFailure()) return;
    // The test's runtime dir is 0700; another uid must reach the socket.
    ASSERT_EQ(::chmod(mrd_->runtime_dir().c_str(), 0755), 0);
  }
};

// One uid past its share is refused, with the limit named, while another uid
// still gets in; once the flood closes, the first uid gets in again.
TEST_F(GrpcConnectionsTest, AUidPastItsShareIsRefusedAndOthersGetIn) {
  std::vector<RawConnection> flood = OpenUntilRefused(mrd_->grpc_socket(), 20);
  ASSERT_FALSE(flood.empty());
  ASSERT_TRUE(flood.back().refused) << "never refused";
  // The test's own channel holds one of the uid's six.
  EXPECT_EQ(Accepted(flood), 5u);
  EXPECT_TRUE(
      absl::StrContains(flood.back().text, "LIMIT_TENANT_GRPC_CONNECTIONS"))
      << flood.back().text;
  EXPECT_TRUE(absl::StrContains(flood.back().text,
                                "--grpc_max_connections_per_tenant=6"))
      << flood.back().text;
  absl::Status same_uid = HealthCheckOnNewConnection(*mrd_);
  EXPECT_FALSE(same_uid.ok());
  std::cout << "a new channel of the flooding uid: " << same_uid << "\n";

  if (getuid() == 0) {
    // uid 65534 connects from a child (system calls only after fork) and
    // reports whether it was refused.
    int report[2];
    ASSERT_EQ(::pipe(report), 0);
    const std::string path = mrd_->grpc_socket();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(report[0]);
      if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 ||
          ::setuid(65534) != 0) {
        _exit(125);
      }
      RawConnection c = Connect(path);
      if (!c.connected) _exit(124);
      Probe(c, absl::Milliseconds(1000));
      const char verdict = c.refused ? 'R' : 'A';
      (void)::write(report[1], &verdict, 1);
      _exit(0);
    }
    ::close(report[1]);
    char verdict = 0;
    ASSERT_EQ(::read(report[0], &verdict, 1), 1);
    ::close(report[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_EQ(verdict, 'A') << "uid 65534 was refused while root flooded";
  }

  flood.clear();
  EXPECT_TRUE(Eventually([&] {
    return HealthCheckOnNewConnection(*mrd_).ok();
  })) << HealthCheckOnNewConnection(*mrd_);
}

class GrpcTotalConnectionsTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.metrics = true;
    o.extra_flags = {"--grpc_max_connections=6",
                     "--grpc_max_connections_per_tenant=100"};
    return o;
  }
};

TEST_F(GrpcTotalConnectionsTest, ConnectionsPastTheTotalAreRefused) {
  std::vector<RawConnection> flood = OpenUntilRefused(mrd_->grpc_socket(), 20);
  ASSERT_FALSE(flood.empty());
  ASSERT_TRUE(flood.back().refused) << "never refused";
  EXPECT_EQ(Accepted(flood), 5u);  // and the test's own channel
  EXPECT_FALSE(HealthCheckOnNewConnection(*mrd_).ok());
  EXPECT_TRUE(absl::StrContains(flood.back().text, "LIMIT_GRPC_CONNECTIONS"))
      << flood.back().text;
  EXPECT_TRUE(absl::StrContains(flood.back().text, "--grpc_max_connections=6"))
      << flood.back().text;
  absl::StatusOr<std::string> metrics = ScrapeMetrics(mrd_->metrics_address());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_TRUE(absl::StrContains(*metrics, "\nmrd_grpc_connections 6\n"))
      << *metrics;
  EXPECT_TRUE(absl::StrContains(*metrics, "\nmrd_grpc_max_connections 6\n"))
      << *metrics;
  EXPECT_FALSE(
      absl::StrContains(*metrics, "\nmrd_grpc_connections_refused_total 0\n"))
      << *metrics;
  flood.clear();
  EXPECT_TRUE(Eventually([&] {
    return HealthCheckOnNewConnection(*mrd_).ok();
  })) << HealthCheckOnNewConnection(*mrd_);
}

// Connections past mrd's open-file limit (1,024 here, caps set above it):
// mrd refuses what it cannot hold and keeps accepting. gRPC accepting on its
// own socket stopped for good at the first EMFILE.
class GrpcConnectionsOutOfFdsTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.nofile = "1024";
    o.extra_flags = {"--grpc_max_connections=4000",
                     "--grpc_max_connections_per_tenant=4000"};
    return o;
  }
  void SetUp() override {
    rlimit rl{};
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
    rl.rlim_cur = rl.rlim_max;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &rl), 0);
    MrdTest::SetUp();
  }
};

TEST_F(GrpcConnectionsOutOfFdsTest,
       MrdRefusesWhatItCannotHoldAndKeepsAccepting) {
  std::vector<RawConnection> flood;
  for (int i = 0; i < 1100; ++i) {
    RawConnection c = Connect(mrd_->grpc_socket());
    if (!c.connected) break;  // a full backlog
    flood.push_back(std::move(c));
  }
  ASSERT_GT(flood.size(), 1000u);
  // mrd ran out of fds on the way and said so.
  EXPECT_TRUE(Eventually([&] {
    return absl::StrContains(mrd_->Log(), "out of file descriptors");
  })) << mrd_->Log();
  flood.clear();
  EXPECT_TRUE(Eventually([&] { return HealthCheckOnNewConnection(*mrd_).ok(); },
                         absl::Seconds(30)))
      << HealthCheckOnNewConnection(*mrd_);
}

// The bound on one connection's open calls (--grpc_max_streams_per_connection,
// here 2): the client holds a third call until one of the two ends, while a
// call on another connection goes through. The two are StreamCompletions
// streams, open until cancelled; the third is a health check.
class GrpcStreamsTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {"--grpc_max_streams_per_connection=2"};
    return o;
  }
};

grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                         absl::Duration timeout) {
  bool serving = false;
  return CheckHealth(channel, timeout, &serving);
}

TEST_F(GrpcStreamsTest, AConnectionsCallsPastTheBoundWaitForOneToEnd) {
  std::shared_ptr<grpc::Channel> channel = NewConnection(*mrd_);
  // A first call's answer: mrd's SETTINGS (the bound) have arrived.
  ASSERT_TRUE(HealthCheck(channel, absl::Seconds(10)).ok());
  auto stub = v1::MemoryRegistration::NewStub(channel);
  client::Session first = OpenFdSession();
  client::Session second = OpenFdSession();
  struct Stream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::Completion>> reader;
  };
  Stream streams[2];
  const client::Session* sessions[2] = {&first, &second};
  for (int i = 0; i < 2; ++i) {
    v1::StreamCompletionsRequest req;
    req.set_session(sessions[i]->token());
    streams[i].reader = stub->StreamCompletions(&streams[i].context, req);
  }
  // Both streams are open: a third call on the connection waits for its
  // deadline; on another connection, one goes through.
  const grpc::Status held = HealthCheck(channel, absl::Milliseconds(500));
  EXPECT_EQ(held.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << held.error_message();
  EXPECT_TRUE(HealthCheckOnNewConnection(*mrd_).ok());
  // One stream ends: the next call on the connection goes through.
  streams[0].context.TryCancel();
  EXPECT_EQ(streams[0].reader->Finish().error_code(),
            grpc::StatusCode::CANCELLED);
  const grpc::Status after = HealthCheck(channel, absl::Seconds(10));
  EXPECT_TRUE(after.ok()) << after.error_message();
  streams[1].context.TryCancel();
  (void)streams[1].reader->Finish();
}

}  // namespace
}  // namespace mrd::testing
