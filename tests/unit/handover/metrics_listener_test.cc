// The metrics listener's handover (Metrics::ServeOn, DuplicateListener):
// a new process serves /metrics on the socket the old one served on, and
// refuses a socket it cannot serve with BAD_METRICS_LISTENER, serving
// nothing.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "server/common/clock.h"
#include "server/common/log.h"
#include "server/common/thread.h"
#include "server/common/tsan.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"
#include "server/metrics/metrics.h"

namespace mrd {
namespace {

// A TCP socket on 127.0.0.1 (port picked by the kernel), listening or not.
UniqueFd TcpSocket(bool listen, int type = SOCK_STREAM) {
  UniqueFd fd(::socket(AF_INET, type | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return fd;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&address),
             sizeof(address)) != 0) {
    return UniqueFd();
  }
  if (listen && ::listen(fd.get(), 16) != 0) return UniqueFd();
  return fd;
}

int PortOf(int fd) {
  sockaddr_in address{};
  socklen_t length = sizeof(address);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return -1;
  }
  return ntohs(address.sin_port);
}

// The body of GET /metrics on 127.0.0.1:`port`, or "" when nobody answers.
std::string Scrape(int port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&address),
                sizeof(address)) != 0) {
    return "";
  }
  const std::string request =
      "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (::send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return "";
  }
  std::string reply;
  char chunk[4096];
  for (;;) {
    const ssize_t n = ::recv(fd.get(), chunk, sizeof(chunk), 0);
    if (n <= 0) break;
    reply.append(chunk, static_cast<size_t>(n));
  }
  return reply;
}

class MetricsListenerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetMinLogLevel(LogLevel::kWarning);
    absl::StatusOr<std::unique_ptr<device::SoftwareDevice>> device =
        device::SoftwareDevice::Create({});
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = std::move(*device);
    ASSERT_TRUE(device_->Start().ok());
    core_ = std::make_unique<core::Core>(device_.get(), RealClock::Get(),
                                         core::CoreOptions{});
  }
  void TearDown() override {
    core_->Shutdown();
    device_->Shutdown();
  }

  std::unique_ptr<device::SoftwareDevice> device_;
  std::unique_ptr<core::Core> core_;
};

TEST_F(MetricsListenerTest, ASocketThatIsNotListeningTcpIsRefused) {
  metrics::Metrics metrics(core_.get());
  auto expect_refused = [&](UniqueFd fd, const char* what) {
    absl::Status s = metrics.ServeOn(std::move(fd));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument)
        << what << ": " << s;
    EXPECT_EQ(GetErrorDetail(s).reason(), "BAD_METRICS_LISTENER") << what;
    // Nothing is served: there is no listener to hand on.
    EXPECT_EQ(GetErrorDetail(metrics.DuplicateListener().status()).reason(),
              "METRICS_NOT_SERVED")
        << what;
  };
  expect_refused(UniqueFd(), "no fd");
  expect_refused(TcpSocket(/*listen=*/false), "bound, not listening");
  expect_refused(TcpSocket(/*listen=*/false, SOCK_DGRAM), "UDP");
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd other(pair[1]);
  expect_refused(UniqueFd(pair[0]), "a Unix socket");
}

// One Metrics serves, hands a duplicate of its socket to the next, which
// serves on the same port once the first stopped.
TEST_F(MetricsListenerTest, TheNextOneServesOnTheSameSocket) {
#ifdef MRD_TSAN
  // Debian's civetweb and prometheus-cpp are not built with TSan: their
  // locks (taken inside the library, released by a tail call TSan
  // attributes to Metrics::Serve) and the joins of their threads in the
  // exposer's destructor are invisible to it, so serving and stopping alone
  // give reports about the libraries' own synchronization. The same code
  // runs in the TSan-built mrd of the integration tests (handover_test's
  // scraper through a takeover), where reports inside those libraries are
  // told apart from mrd's (tests/support/tsan_server.supp).
  GTEST_SKIP() << "civetweb and prometheus-cpp are not instrumented";
#endif
  UniqueFd socket = TcpSocket(/*listen=*/true);
  ASSERT_TRUE(socket.valid());
  const int port = PortOf(socket.get());
  metrics::Metrics old(core_.get());
  ASSERT_TRUE(old.ServeOn(std::move(socket)).ok());
  // The inherited socket is polled from the server's next round (<= 2 s).
  std::string reply;
  for (int i = 0; i < 50 && !absl::StrContains(reply, "200 OK"); ++i) {
    reply = Scrape(port);
    if (!absl::StrContains(reply, "200 OK")) {
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  EXPECT_TRUE(absl::StrContains(reply, "mrd_")) << reply;

  absl::StatusOr<UniqueFd> handed = old.DuplicateListener();
  ASSERT_TRUE(handed.ok()) << handed.status();
  EXPECT_EQ(PortOf(handed->get()), port);
  old.StopServing();
  metrics::Metrics next(core_.get());
  ASSERT_TRUE(next.ServeOn(std::move(*handed)).ok());
  reply.clear();
  for (int i = 0; i < 50 && !absl::StrContains(reply, "200 OK"); ++i) {
    reply = Scrape(port);
    if (!absl::StrContains(reply, "200 OK")) {
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  EXPECT_TRUE(absl::StrContains(reply, "mrd_")) << reply;
}

// A source may arrive once /metrics is served already (mrd serves the
// metrics before it starts its workers, whose queues a scrape reports):
// setting one while a scrape runs is safe (TSan saw this race in a
// handover test against the TSan build's mrd).
TEST_F(MetricsListenerTest, SourcesMayBeSetWhileAScrapeRuns) {
  metrics::Metrics metrics(core_.get());
  std::atomic<bool> done{false};
  std::atomic<int> scrapes{0};
  absl::StatusOr<Thread> scraper = Thread::Start("scraper", [&] {
    while (!done.load()) {
      if (absl::StrContains(metrics.Render(), "mrd_sessions")) ++scrapes;
    }
  });
  ASSERT_TRUE(scraper.ok()) << scraper.status();
  for (int i = 0; i < 200 || scrapes.load() < 2; ++i) {
    metrics.SetSchedulerSource([] { return std::vector<FairQueueStats>{}; });
    metrics.SetHandoverSource([] { return metrics::HandoverGauges{}; });
    metrics.SetPeerPathSource([] { return metrics::PeerPathGauges{}; });
    metrics.SetGrpcConnectionsSource(
        [] { return metrics::GrpcConnectionStats{}; });
    metrics.SetLimits({{"max_sessions", 1.0}});
    metrics::ServerInfo info;
    info.version = "test";
    metrics.SetServerInfo(info);
  }
  done = true;
  scraper->Join();
  EXPECT_TRUE(absl::StrContains(metrics.Render(),
                                "mrd_device_healthy{device=\"software\"} 1"));
}

}  // namespace
}  // namespace mrd
