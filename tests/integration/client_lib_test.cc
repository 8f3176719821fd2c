// The client library (client/lib) against the real mrd: every handle
// releases what it holds (checked with ListRegistrations, GetDeviceInfo's
// pinned bytes and mrd's own gauges), the fd socket with real memfds, async
// registration, completion streams, move semantics, explicit releases and the
// error details that come back through the real channel.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/lib/mrd_client.h"
#include "client/peer/soft_peer.h"
#include "tests/integration/test_env.h"
#include "tests/support/frozen_thread.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::CompletionStream;
using client::Lam;
using client::Mr;
using client::PeerTicket;
using client::RegisterOptions;
using client::Registration;
using client::Session;

// MrdTest with mrd's metrics on, so that each test can also check mrd's own
// count of sessions, buffers, registrations, LAMs and MR objects: each test
// is a leak test of the library.
class ClientLibTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.metrics = true;
    return o;
  }

  void TearDown() override {
    if (mrd_ != nullptr) {
      static constexpr const char* kGauges[] = {
          "mrd_sessions", "mrd_buffers",    "mrd_registrations",
          "mrd_lams",     "mrd_mr_objects", "mrd_pinned_bytes"};
      std::map<std::string, double> seen;
      bool clean = WaitFor([&] {
        std::map<std::string, double> metrics = Metrics();
        bool all_zero = true;
        for (const char* g : kGauges) {
          seen[g] = metrics.count(g) ? metrics[g] : -1;
          all_zero = all_zero && seen[g] == 0;
        }
        return all_zero;
      });
      if (!clean) {
        std::string left;
        for (const auto& [name, value] : seen) {
          absl::StrAppend(&left, " ", name, "=", value);
        }
        ADD_FAILURE() << "mrd still holds something after the test:" << left;
      }
    }
    MrdTest::TearDown();
  }

  // mrd's /metrics, one sample per line ("name{labels} value"), as a map.
  std::map<std::string, double> Metrics() {
    std::map<std::string, double> out;
    std::string text = Scrape();
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (line.empty() || line[0] == '#') continue;
      size_t space = line.rfind(' ');
      if (space == absl::string_view::npos) continue;
      double value = 0;
      if (!absl::SimpleAtod(line.substr(space + 1), &value)) continue;
      out[std::string(line.substr(0, space))] = value;
    }
    return out;
  }

  double Gauge(const std::string& name) {
    std::map<std::string, double> m = Metrics();
    return m.count(name) ? m[name] : -1;
  }

  // Streams mrd has finished serving (whatever their code).
  double FinishedStreams() {
    double n = 0;
    for (const auto& [name, value] : Metrics()) {
      if (absl::StartsWith(name, "grpc_server_handled_total{") &&
          absl::StrContains(name, "grpc_method=\"StreamCompletions\"")) {
        n += value;
      }
    }
    return n;
  }

  std::string Scrape() {
    absl::StatusOr<std::string> text = ScrapeMetrics(mrd_->metrics_address());
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? *text : "";
  }

  v1::ListRegistrationsResponse List(const Session& session) {
    absl::StatusOr<v1::ListRegistrationsResponse> list = session.List();
    EXPECT_TRUE(list.ok()) << list.status();
    return list.ok() ? *list : v1::ListRegistrationsResponse();
  }

  // A file of `size` bytes under mrd's --shm_dir, for lease sessions.
  void ShmFile(const std::string& name, const std::string& content = "file",
               size_t size = 16384) {
    ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), name, content, size).ok());
  }

  Session OpenLease(absl::Duration ttl = absl::ZeroDuration()) {
    absl::StatusOr<Session> s = Session::OpenLease(*client_, ttl);
    EXPECT_TRUE(s.ok()) << s.status();
    return std::move(*s);
  }

  // True if mrd no longer knows the session `token`.
  bool SessionGone(const std::string& token) {
    absl::Status s = Session::Attach(*client_, token).Info().status();
    return s.code() == absl::StatusCode::kFailedPrecondition &&
           client::SeedStatusOf(s) == ::mrd::WSAENOTCONN;
  }
};

// ---- Connecting ----------------------------------------------------------

TEST_F(ClientLibTest, ConnectToMissingSocketIsUnavailableAtOnce) {
  client::ClientOptions o;
  o.socket_path = mrd_->runtime_dir() + "/nothing.sock";
  absl::Time start = absl::Now();
  absl::StatusOr<client::Client> c = client::Client::Connect(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client::ReasonOf(c.status()), "CANNOT_CONNECT");
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));

  // A stale socket file (nobody listens on it) is the same.
  o.socket_path = mrd_->runtime_dir() + "/stale.sock";
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, o.socket_path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  start = absl::Now();
  c = client::Client::Connect(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client::ReasonOf(c.status()), "CANNOT_CONNECT");
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

// Usage and quota of every tenant, by resource, as operators alert on them.
TEST_F(ClientLibTest, TenantUsageAndLimitsAreExported) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 8192);
  Registration reg = Register(session, buffer, 0, 8192, kRemoteRead);
  const std::string tenant = absl::StrCat("tenant=\"uid:", getuid(), "\"");
  auto series = [&](const std::string& name, const std::string& resource) {
    return absl::StrCat(name, "{", tenant, ",resource=\"", resource, "\"}");
  };
  std::map<std::string, double> m = Metrics();
  EXPECT_EQ(m[series("mrd_tenant_usage", "sessions")], 1);
  EXPECT_EQ(m[series("mrd_tenant_usage", "buffers")], 1);
  EXPECT_EQ(m[series("mrd_tenant_usage", "registrations")], 1);
  EXPECT_EQ(m[series("mrd_tenant_usage", "pinned_bytes")], 8192);
  // 25 % of --max_sessions=1024 and of 16 GiB.
  EXPECT_EQ(m[series("mrd_tenant_limit", "sessions")], 256);
  EXPECT_EQ(m[series("mrd_tenant_limit", "pinned_bytes")],
            static_cast<double>(uint64_t{4} << 30));
  EXPECT_EQ(m.count(series("mrd_tenant_refusals_total", "sessions")), 1u);
  // The peer path's limits and its fixed pool of threads, from the start.
  if (TestDeviceKind() == "software") {
    EXPECT_EQ(m["mrd_peer_max_connections"], 4096);
    EXPECT_EQ(m["mrd_peer_max_unauthenticated"], 256);
    EXPECT_GE(m["mrd_peer_threads"], 2);
    EXPECT_EQ(m.count("mrd_peer_shed_total"), 1u);
  }
}

TEST_F(ClientLibTest, DeviceInfoAndHealth) {
  absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->kind(), "software");
  EXPECT_EQ(info->page_size(), 4096u);
  EXPECT_TRUE(info->healthy());
  EXPECT_FALSE(info->peer_address().empty());
  EXPECT_EQ(info->pinned_bytes(), 0u);
  absl::StatusOr<client::ServingStatus> health = client_->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, client::ServingStatus::kServing);
  EXPECT_EQ(client_->Health("no.such.Service").status().code(),
            absl::StatusCode::kNotFound);
}

// ---- The fd socket ---------------------------------------------------------

TEST_F(ClientLibTest,
       BufferCreateHandsOverASealedMemfdAndItsDestructorReleases) {
  Session session = OpenFdSession();
  EXPECT_EQ(session.kind(), Session::Kind::kFd);
  EXPECT_FALSE(session.token().empty());
  EXPECT_EQ(session.peer_uid(), ::getuid());
  EXPECT_EQ(session.peer_pid(), static_cast<uint32_t>(::getpid()));
  absl::StatusOr<v1::SessionInfo> info = session.Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->kind(), "fd");
  EXPECT_EQ(info->peer_uid(), ::getuid());
  EXPECT_EQ(Gauge("mrd_fd_sessions"), 1);
  {
    absl::StatusOr<Buffer> buffer = Buffer::Create(session, 8192, "t");
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_TRUE(buffer->valid());
    EXPECT_EQ(buffer->size(), 8192u);
    EXPECT_NE(buffer->id(), 0u);
    EXPECT_TRUE(buffer->writable());
    EXPECT_EQ(buffer->info().source(), "memfd");
    EXPECT_NE(buffer->address(), 0u);
    ASSERT_NE(buffer->data(), nullptr);
    std::memset(buffer->data(), 0x5a, 8192);
    // What mrd received: a memfd sealed against shrinking and growing.
    int seals = ::fcntl(buffer->fd(), F_GET_SEALS);
    EXPECT_TRUE(seals & F_SEAL_SHRINK);
    EXPECT_TRUE(seals & F_SEAL_GROW);
    v1::ListRegistrationsResponse list = List(session);
    ASSERT_EQ(list.buffers_size(), 1);
    EXPECT_EQ(list.buffers(0).buffer(), buffer->id());
    EXPECT_EQ(list.buffers(0).size(), 8192u);
    EXPECT_EQ(list.buffers(0).source(), "memfd");
    EXPECT_EQ(Gauge("mrd_buffers"), 1);
  }
  // The destructor released it while the session lives on.
  EXPECT_EQ(List(session).buffers_size(), 0);
  EXPECT_EQ(Gauge("mrd_buffers"), 0);
  EXPECT_EQ(Gauge("mrd_fd_sessions"), 1);
  EXPECT_TRUE(session.Ping().ok());
}

TEST_F(ClientLibTest, FdBufferIsSharedWithRemotePeers) {
  Session session = OpenFdSession();
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, 65536, "smoke");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memcpy(buffer->data(), "local bytes", 11);
  absl::StatusOr<Registration> reg = Registration::Register(
      session, Range(*buffer, 0, 65536, kRemoteRead | kRemoteWrite));
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->length(), 65536u);
  EXPECT_EQ(reg->base_address(), buffer->address());
  EXPECT_EQ(PinnedBytes(), 65536u);
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> read =
      peer->Read(reg->rkey(), reg->base_address(), 11);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "local bytes");
  ASSERT_TRUE(
      peer->Write(reg->rkey(), reg->base_address() + 100, "remote").ok());
  EXPECT_EQ(std::memcmp(static_cast<char*>(buffer->data()) + 100, "remote", 6),
            0);
  // Deregistration revokes the token before it returns, and unpins.
  const uint32_t rkey = reg->rkey();
  const uint64_t base = reg->base_address();
  absl::StatusOr<uint32_t> left = reg->Deregister();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u);
  EXPECT_FALSE(reg->valid());
  ExpectRemoteAccessError(peer->Read(rkey, base, 1).status());
  EXPECT_EQ(PinnedBytes(), 0u);
}

TEST_F(ClientLibTest, ClosedFdIsInvalidArgumentAndSessionStaysUsable) {
  Session session = OpenFdSession();
  int fd = ::memfd_create("closed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ::close(fd);
  absl::StatusOr<Buffer> bad = session.ImportMemfd(fd, false, 0);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client::ReasonOf(bad.status()), "BAD_FD");
  EXPECT_TRUE(
      absl::StrContains(bad.status().message(), "not an open file descriptor"))
      << bad.status();
  EXPECT_TRUE(session.Ping().ok());
  absl::StatusOr<Buffer> good = Buffer::Create(session, 4096);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(List(session).buffers_size(), 1);
}

TEST_F(ClientLibTest,
       FdImportErrorsComeBackWithDetailAndTheSessionStaysUsable) {
  Session session = OpenFdSession();
  int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 4096), 0);
  absl::StatusOr<Buffer> refused = session.ImportMemfd(unsealed, true, 4096);
  ::close(unsealed);
  ExpectError(refused.status(), absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "NOT_SEALED");

  absl::StatusOr<client::MappedMemfd> memfd =
      client::MappedMemfd::Create(8192, "mismatch");
  ASSERT_TRUE(memfd.ok()) << memfd.status();
  absl::StatusOr<Buffer> mismatch =
      session.ImportMemfd(memfd->fd(), true, 4096);
  ExpectError(mismatch.status(), absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "SIZE_MISMATCH");

  EXPECT_TRUE(session.Ping().ok());
  EXPECT_EQ(List(session).buffers_size(), 0);
  // The same memfd with the right size goes in; the caller keeps its fd.
  absl::StatusOr<Buffer> ok = session.ImportMemfd(memfd->fd(), true, 8192);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->size(), 8192u);
  EXPECT_EQ(ok->data(), nullptr);  // not created here: no local mapping
  EXPECT_GE(::fcntl(memfd->fd(), F_GETFD), 0);
}

TEST_F(ClientLibTest, ReadOnlyImportCannotBeRegisteredForWrite) {
  Session session = OpenFdSession();
  absl::StatusOr<Buffer> ro = Buffer::Create(session, 4096, "ro", false);
  ASSERT_TRUE(ro.ok()) << ro.status();
  EXPECT_FALSE(ro->writable());
  // Local read only: fine on a read-only import.
  absl::StatusOr<Registration> read =
      Registration::Register(session, Range(*ro, 0, 64));
  EXPECT_TRUE(read.ok()) << read.status();
  absl::StatusOr<Registration> write =
      Registration::Register(session, Range(*ro, 0, 64, kRemoteWrite));
  EXPECT_FALSE(write.ok());
  EXPECT_NE(client::SeedStatusOf(write.status()),
            ::mrd::SEED_STATUS_UNSPECIFIED)
      << write.status();
  EXPECT_TRUE(session.Ping().ok());
}

TEST_F(ClientLibTest, MissingFdSocketIsUnavailable) {
  absl::StatusOr<Session> session =
      Session::OpenFd(*client_, mrd_->runtime_dir() + "/none.sock");
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnavailable)
      << session.status();
}

TEST_F(ClientLibTest, ConcurrentImportsOnOneFdSession) {
  Session session = OpenFdSession();
  absl::Mutex mu;
  std::vector<Buffer> buffers;
  std::vector<absl::Status> errors;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 4; ++i) {
        const uint64_t size = 4096 * (i + 1);
        absl::StatusOr<Buffer> b = Buffer::Create(session, size);
        absl::MutexLock l(&mu);
        if (!b.ok()) {
          errors.push_back(b.status());
        } else if (b->size() != size) {
          errors.push_back(absl::InternalError(
              absl::StrCat("size ", b->size(), " instead of ", size)));
        } else {
          buffers.push_back(*std::move(b));
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(errors.empty()) << errors.front();
  ASSERT_EQ(buffers.size(), 32u);
  v1::ListRegistrationsResponse list = List(session);
  ASSERT_EQ(list.buffers_size(), 32);
  uint64_t total = 0;
  for (const v1::BufferInfo& b : list.buffers()) total += b.size();
  EXPECT_EQ(total, 8u * 4096u * (1 + 2 + 3 + 4));
  buffers.clear();
  EXPECT_EQ(List(session).buffers_size(), 0);
}

TEST_F(ClientLibTest, FdSessionEndsWithTheObjectAndItsHandlesBecomeInert) {
  std::optional<Buffer> buffer;
  std::optional<Registration> reg;
  std::string token;
  {
    Session session = OpenFdSession();
    token = session.token();
    absl::StatusOr<Buffer> b = Buffer::Create(session, 8192, "end");
    ASSERT_TRUE(b.ok()) << b.status();
    absl::StatusOr<Registration> r =
        Registration::Register(session, Range(*b, 0, 8192, kRemoteRead));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(PinnedBytes(), 8192u);
    buffer.emplace(*std::move(b));
    reg.emplace(*std::move(r));
  }
  // The socket closed: mrd released the session and unpinned its memory.
  EXPECT_TRUE(WaitFor([&] { return SessionGone(token); }));
  EXPECT_TRUE(WaitFor([&] { return PinnedBytes() == 0; }));
  EXPECT_TRUE(WaitFor([&] { return Gauge("mrd_sessions") == 0; }));
  // Nothing left to release: the explicit forms say so without asking mrd.
  absl::StatusOr<uint32_t> left = reg->Deregister();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u);
  EXPECT_TRUE(buffer->Release().ok());
}

TEST_F(ClientLibTest, MrdEndingTheFdSessionMakesHandlesInert) {
  Session session = OpenFdSession();
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, 4096);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  absl::StatusOr<Registration> reg =
      Registration::Register(session, Range(*buffer, 0, 4096));
  ASSERT_TRUE(reg.ok()) << reg.status();
  // mrd shuts down: it ends every session, closes the fd socket, and (Stop
  // checks) leaves nothing pinned.
  absl::Status stopped = mrd_->Stop();
  ASSERT_TRUE(stopped.ok()) << stopped;
  mrd_.reset();
  absl::Status ping = session.Ping();
  EXPECT_EQ(ping.code(), absl::StatusCode::kFailedPrecondition) << ping;
  EXPECT_EQ(client::SeedStatusOf(ping), ::mrd::WSAENOTCONN) << ping;
  absl::StatusOr<uint32_t> left = reg->Deregister();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u);
  EXPECT_TRUE(buffer->Release().ok());
  EXPECT_TRUE(session.Close().ok());
}

// mrd.proto: an fd session "lives exactly as long as that socket
// connection". Ending it by its token from elsewhere (CloseSession, e.g.
// `mrctl --session=<token> lease close`) must therefore end the connection
// too, so that the owner notices (Session::fd_socket() is documented for
// exactly that poll).
TEST_F(ClientLibTest, FdSessionClosedByItsTokenElsewhereHangsUpTheSocket) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4096);
  Registration reg = Register(session, buffer, 0, 4096, kRemoteRead);
  EXPECT_EQ(PinnedBytes(), 4096u);
  ASSERT_TRUE(Session::Attach(*client_, session.token()).Close().ok());
  EXPECT_TRUE(SessionGone(session.token()));
  EXPECT_EQ(PinnedBytes(), 0u);
  // mrd hangs up: the socket turns readable (EOF) or hung up.
  pollfd p{session.fd_socket(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 5000), 1)
      << "mrd ended the fd session but kept its socket connection open";
  absl::Status ping = session.Ping();
  EXPECT_EQ(ping.code(), absl::StatusCode::kFailedPrecondition) << ping;
  EXPECT_EQ(client::SeedStatusOf(ping), ::mrd::WSAENOTCONN) << ping;
  // Everything was released with the session.
  absl::StatusOr<uint32_t> left = reg.Deregister();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u);
  EXPECT_TRUE(buffer.Release().ok());
}

// Every handle documents "a session already ended counts as released": that
// holds when mrd ended it (closed elsewhere, expired), not only when this
// process closed it.
TEST_F(ClientLibTest, LeaseEndedElsewhereMakesItsHandlesInert) {
  ShmFile("f");
  Session session = OpenLease();
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(session, "f", true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  absl::StatusOr<Registration> reg =
      Registration::Register(session, Range(*buffer, 0, 4096, kRemoteRead));
  ASSERT_TRUE(reg.ok()) << reg.status();
  client::BuildLamOptions lo;
  lo.buffer = buffer->id();
  lo.offset = 4096;
  lo.length = 4096;
  absl::StatusOr<Lam> lam = Lam::Build(session, lo);
  ASSERT_TRUE(lam.ok()) << lam.status();
  absl::StatusOr<Mr> mr = Mr::Create(session, false);
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_EQ(PinnedBytes(), 2 * 4096u);
  // Another process (`mrctl lease close`) ends the lease.
  ASSERT_TRUE(Session::Attach(*client_, session.token()).Close().ok());
  EXPECT_EQ(PinnedBytes(), 0u);
  absl::StatusOr<uint32_t> left = reg->Deregister();
  EXPECT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(left.value_or(99), 0u);
  absl::Status lam_released = lam->Release();
  EXPECT_TRUE(lam_released.ok()) << lam_released;
  absl::Status mr_closed = mr->Close();
  EXPECT_TRUE(mr_closed.ok()) << mr_closed;
  absl::StatusOr<v1::ReleaseBufferResponse> released = buffer->Release();
  EXPECT_TRUE(released.ok()) << released.status();
  // Closing the lease object itself finds it ended (OK, or what mrd said)
  // and stays quiet from then on.
  absl::Status closed = session.Close();
  EXPECT_TRUE(closed.ok() || client::SeedStatusOf(closed) == ::mrd::WSAENOTCONN)
      << closed;
  EXPECT_TRUE(session.Close().ok());
}

// ---- Registrations ---------------------------------------------------------

TEST_F(ClientLibTest, CachedRegistrationsCountReferencesAndReleaseEach) {
  ShmFile("f");
  Session session = OpenLease();
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(session, "f", true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->data(), nullptr);
  EXPECT_EQ(buffer->info().source(), "file:f");
  const RegisterOptions o = Range(*buffer, 0, 4096, kRemoteRead);
  absl::StatusOr<Registration> first = Registration::Register(session, o);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->cache_hit());
  EXPECT_EQ(first->references(), 1u);
  EXPECT_EQ(PinnedBytes(), 4096u);
  {
    absl::StatusOr<Registration> second = Registration::Register(session, o);
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_TRUE(second->cache_hit());
    EXPECT_EQ(second->id(), first->id());
    EXPECT_EQ(second->rkey(), first->rkey());
    EXPECT_EQ(second->references(), 2u);
    EXPECT_EQ(second->descriptor().size(), 24u);
    EXPECT_EQ(second->descriptor(), first->descriptor());
    v1::ListRegistrationsResponse list = List(session);
    ASSERT_EQ(list.registrations_size(), 1);
    EXPECT_EQ(list.registrations(0).references(), 2u);
    EXPECT_EQ(PinnedBytes(), 4096u);
  }
  // The second handle gave back exactly its reference.
  v1::ListRegistrationsResponse list = List(session);
  ASSERT_EQ(list.registrations_size(), 1);
  EXPECT_EQ(list.registrations(0).references(), 1u);
  EXPECT_EQ(PinnedBytes(), 4096u);

  Registration moved = *std::move(first);
  // Deliberately reads the moved-from object.
  EXPECT_FALSE(first->valid());  // NOLINT(bugprone-use-after-move)
  EXPECT_TRUE(moved.valid());
  absl::StatusOr<uint32_t> left = moved.Deregister();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u);
  EXPECT_FALSE(moved.valid());
  EXPECT_EQ(List(session).registrations_size(), 0);
  EXPECT_EQ(PinnedBytes(), 0u);
  // A second explicit deregistration is refused locally.
  EXPECT_EQ(moved.Deregister().status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientLibTest, ErrorDetailsSurviveTheChannel) {
  ShmFile("f");
  Session session = OpenLease();
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(session, "f", false);
  ASSERT_TRUE(buffer.ok()) << buffer.status();

  absl::StatusOr<Registration> zero =
      Registration::Register(session, Range(*buffer, 0, 0));
  ExpectError(zero.status(), absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "ZERO_LENGTH");

  RegisterOptions small = Range(*buffer, 0, 64);
  small.descriptor_capacity = 8;
  absl::StatusOr<Registration> too_small =
      Registration::Register(session, small);
  ExpectError(too_small.status(), absl::StatusCode::kOutOfRange,
              ::mrd::WSAEFAULT, "");
  EXPECT_EQ(client::RequiredSizeOf(too_small.status()), 24u);

  client::BuildLamOptions lam_options;
  lam_options.buffer = buffer->id();
  lam_options.length = 8192;
  lam_options.capacity = 16;
  absl::StatusOr<Lam> lam = Lam::Build(session, lam_options);
  ExpectError(lam.status(), absl::StatusCode::kOutOfRange,
              ::mrd::STATUS_BUFFER_TOO_SMALL, "LAM_SPACE_TOO_SMALL");
  EXPECT_EQ(client::RequiredSizeOf(lam.status()), 24u);

  absl::StatusOr<Buffer> missing = Buffer::ImportFile(session, "missing", true);
  ExpectError(missing.status(), absl::StatusCode::kNotFound,
              ::mrd::SEED_STATUS_UNSPECIFIED, "NO_SUCH_FILE");

  Session stale = Session::Attach(*client_, "no-such-session");
  absl::Status info = stale.Info().status();
  EXPECT_EQ(info.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client::SeedStatusOf(info), ::mrd::WSAENOTCONN);
  // None of these left anything behind.
  EXPECT_EQ(List(session).registrations_size(), 0);
  EXPECT_EQ(List(session).lams_size(), 0);
  EXPECT_EQ(List(session).buffers_size(), 1);
}

TEST_F(ClientLibTest, ManyAsyncRegistrationsInFlightAtOnce) {
  Session session = OpenFdSession();
  constexpr int kCount = 32;
  absl::StatusOr<Buffer> buffer =
      Buffer::Create(session, kCount * 4096, "async");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  absl::Mutex mu;
  std::vector<Registration> done;
  std::vector<absl::Status> failures;
  absl::BlockingCounter pending(kCount);
  // No callback finishes before every registration has been issued: if
  // RegisterAsync waited for its reply, the first callback would wait here
  // in vain and record the failure.
  absl::Notification all_issued;
  std::atomic<int> gate_timeouts{0};
  for (int i = 0; i < kCount; ++i) {
    Registration::RegisterAsync(
        session, Range(*buffer, static_cast<uint64_t>(i) * 4096, 4096),
        [&](absl::StatusOr<Registration> r) {
          if (!all_issued.WaitForNotificationWithTimeout(absl::Seconds(10))) {
            ++gate_timeouts;
          }
          {
            absl::MutexLock l(&mu);
            if (r.ok()) {
              done.push_back(*std::move(r));
            } else {
              failures.push_back(r.status());
            }
          }
          pending.DecrementCount();
        });
  }
  all_issued.Notify();
  pending.Wait();
  EXPECT_EQ(gate_timeouts.load(), 0);
  EXPECT_TRUE(failures.empty()) << failures.front();
  ASSERT_EQ(done.size(), static_cast<size_t>(kCount));
  v1::ListRegistrationsResponse list = List(session);
  EXPECT_EQ(list.registrations_size(), kCount);
  EXPECT_EQ(PinnedBytes(), kCount * 4096u);
  done.clear();
  EXPECT_EQ(List(session).registrations_size(), 0);
  EXPECT_EQ(PinnedBytes(), 0u);
}

TEST_F(ClientLibTest, RegisterFutureDeliversTheRegistration) {
  ShmFile("f");
  Session session = OpenLease();
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(session, "f", true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto ok = Registration::RegisterFuture(session, Range(*buffer, 0, 100));
  auto bad = Registration::RegisterFuture(session, Range(*buffer, 0, 0));
  absl::StatusOr<Registration> r = ok.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->length(), 100u);
  EXPECT_EQ(List(session).registrations_size(), 1);
  ExpectError(bad.get().status(), absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "ZERO_LENGTH");
}

TEST_F(ClientLibTest, RegistrationMoveAssignmentReleasesTheOldReference) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 3 * 4096);
  Registration a = Register(session, buffer, 0, 4096, kRemoteRead);
  Registration b = Register(session, buffer, 4096, 4096, kRemoteRead);
  const uint64_t b_id = b.id();
  EXPECT_EQ(List(session).registrations_size(), 2);
  EXPECT_EQ(PinnedBytes(), 2 * 4096u);
  a = std::move(b);  // a's registration is deregistered
  // Deliberately reads the moved-from object.
  EXPECT_FALSE(b.valid());  // NOLINT(bugprone-use-after-move)
  EXPECT_TRUE(a.valid());
  EXPECT_EQ(a.id(), b_id);
  v1::ListRegistrationsResponse list = List(session);
  ASSERT_EQ(list.registrations_size(), 1);
  EXPECT_EQ(list.registrations(0).registration(), b_id);
  EXPECT_EQ(PinnedBytes(), 4096u);
  // Detach gives up the reference without deregistering; Adopt takes it back.
  v1::RegisterMrResponse detached = a.Detach();
  EXPECT_FALSE(a.valid());
  EXPECT_EQ(List(session).registrations_size(), 1);
  {
    Registration adopted = Registration::Adopt(session, detached);
    EXPECT_EQ(adopted.id(), b_id);
  }
  EXPECT_EQ(List(session).registrations_size(), 0);
  EXPECT_EQ(PinnedBytes(), 0u);
}

TEST_F(ClientLibTest, BufferMoveReleaseAndDetach) {
  Session session = OpenFdSession();
  Buffer a = NewBuffer(session, 4096, "a");
  Buffer b = NewBuffer(session, 8192, "b");
  const uint64_t b_id = b.id();
  void* b_data = b.data();
  EXPECT_EQ(List(session).buffers_size(), 2);
  a = std::move(b);  // a's buffer is released
  // Deliberately reads the moved-from object.
  EXPECT_FALSE(b.valid());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(a.id(), b_id);
  EXPECT_EQ(a.data(), b_data);  // the mapping moved along
  EXPECT_EQ(static_cast<char*>(a.data())[0], 'b');
  v1::ListRegistrationsResponse list = List(session);
  ASSERT_EQ(list.buffers_size(), 1);
  EXPECT_EQ(list.buffers(0).buffer(), b_id);

  // Releasing a buffer invalidates the registrations still on it (W11); the
  // registration's own deregistration then finds nothing.
  Registration reg = Register(session, a, 0, 4096, kRemoteRead);
  EXPECT_EQ(PinnedBytes(), 4096u);
  absl::StatusOr<v1::ReleaseBufferResponse> released = a.Release();
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(released->invalidated_registrations(), 1u);
  EXPECT_FALSE(a.valid());
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(PinnedBytes(), 0u);
  EXPECT_EQ(reg.Deregister().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a.Release().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(List(session).buffers_size(), 0);
}

TEST_F(ClientLibTest, DetachedBufferStaysUntilAdoptedAndReleased) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4096, "detach");
  v1::BufferInfo detached = buffer.Detach();
  EXPECT_FALSE(buffer.valid());
  EXPECT_EQ(buffer.data(), nullptr);  // the local mapping went
  EXPECT_EQ(detached.size(), 4096u);
  // Still in mrd until released by id.
  EXPECT_EQ(List(session).buffers_size(), 1);
  {
    Buffer adopted = Buffer::Adopt(session, detached);
    EXPECT_TRUE(adopted.valid());
    EXPECT_EQ(adopted.id(), detached.buffer());
    EXPECT_EQ(adopted.data(), nullptr);
    EXPECT_EQ(List(session).buffers_size(), 1);
  }
  EXPECT_EQ(List(session).buffers_size(), 0);
}

// ---- Sessions --------------------------------------------------------------

TEST_F(ClientLibTest, LeaseSessionClosesOnDestructionAttachDoesNot) {
  std::string token;
  {
    absl::StatusOr<Session> lease =
        Session::OpenLease(*client_, absl::Minutes(5));
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->kind(), Session::Kind::kLease);
    token = lease->token();
    absl::StatusOr<v1::SessionInfo> info = lease->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->kind(), "lease");
    EXPECT_EQ(info->ttl_seconds(), 300u);
    {
      Session attached = Session::Attach(*client_, token);
      EXPECT_EQ(attached.kind(), Session::Kind::kAttached);
      EXPECT_EQ(attached.token(), token);
      EXPECT_TRUE(attached.Info().ok());
    }
    // The attached handle left the lease open.
    EXPECT_FALSE(SessionGone(token));
    EXPECT_EQ(Gauge("mrd_lease_sessions"), 1);
    Session moved = *std::move(lease);
    EXPECT_EQ(moved.token(), token);
    EXPECT_FALSE(SessionGone(token));
  }
  // The lease's own destructor closed it.
  EXPECT_TRUE(SessionGone(token));
  EXPECT_EQ(Gauge("mrd_lease_sessions"), 0);
}

TEST_F(ClientLibTest, ExplicitCloseOfALeaseAndOfAnAttachedSession) {
  Session lease = OpenLease();
  const std::string token = lease.token();
  Session attached = Session::Attach(*client_, token);
  EXPECT_TRUE(attached.Close().ok());
  EXPECT_TRUE(SessionGone(token));
  // mrd already ended it: closing the lease says WSAENOTCONN and marks it
  // ended, so the destructor stays quiet.
  absl::Status again = lease.Close();
  EXPECT_EQ(client::SeedStatusOf(again), ::mrd::WSAENOTCONN) << again;
  EXPECT_TRUE(lease.Close().ok());
  EXPECT_EQ(Gauge("mrd_sessions"), 0);
}

TEST_F(ClientLibTest, HandlesOutlivingTheirSessionAreQuiet) {
  ShmFile("f");
  std::optional<Buffer> buffer;
  std::optional<Registration> reg;
  std::optional<Lam> lam;
  std::optional<Mr> mr;
  std::string token;
  {
    Session session = OpenLease();
    token = session.token();
    absl::StatusOr<Buffer> b = Buffer::ImportFile(session, "f", true);
    ASSERT_TRUE(b.ok()) << b.status();
    absl::StatusOr<Registration> r =
        Registration::Register(session, Range(*b, 0, 10));
    ASSERT_TRUE(r.ok()) << r.status();
    client::BuildLamOptions lo;
    lo.buffer = b->id();
    lo.length = 4096;
    absl::StatusOr<Lam> l = Lam::Build(session, lo);
    ASSERT_TRUE(l.ok()) << l.status();
    absl::StatusOr<Mr> m = Mr::Create(session, true, true);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_GT(PinnedBytes(), 0u);
    buffer.emplace(*std::move(b));
    reg.emplace(*std::move(r));
    lam.emplace(*std::move(l));
    mr.emplace(*std::move(m));
  }
  // The session closed; mrd released everything; the handles know.
  EXPECT_TRUE(SessionGone(token));
  EXPECT_EQ(PinnedBytes(), 0u);
  EXPECT_EQ(Gauge("mrd_sessions"), 0);
  EXPECT_EQ(*reg->Deregister(), 0u);
  EXPECT_TRUE(lam->Release().ok());
  EXPECT_TRUE(mr->Close().ok());
  EXPECT_TRUE(buffer->Release().ok());
}

// ---- MR objects, LAMs, completions ---------------------------------------

TEST_F(ClientLibTest, MrLamFastRegisterAndCompletions) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 3 * 4096, "fast");
  std::memcpy(static_cast<char*>(buffer.data()) + 100, "fast bytes", 10);
  CompletionStream stream = CompletionStream::Open(session);
  EXPECT_EQ(stream.Next(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);

  absl::StatusOr<Mr> mr = Mr::Create(session, true, true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_TRUE(mr->fast_register());
  EXPECT_TRUE(mr->allow_remote_access());
  EXPECT_EQ(mr->info().state(), "free");
  client::BuildLamOptions lo;
  lo.buffer = buffer.id();
  lo.offset = 100;
  lo.length = 5000;
  absl::StatusOr<Lam> lam = Lam::Build(session, lo);
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_EQ(lam->pages().size(), 2u);
  EXPECT_EQ(lam->fbo(), 100u);
  EXPECT_EQ(lam->length(), 5000u);
  EXPECT_EQ(lam->lam_size(), 8u + 8u * 2u);
  EXPECT_EQ(List(session).lams_size(), 1);

  // The stream stayed usable after the timeout: a peer's connection event.
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  v1::Completion connected = NextOfKind(stream, v1::Completion::PEER_CONNECTED);
  EXPECT_EQ(connected.connection(), peer->connection_id());

  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  EXPECT_EQ(fr.pages.size(), 2u);
  EXPECT_EQ(fr.fbo, 100u);
  fr.connection = peer->connection_id();
  fr.request_context = 77;
  fr.base_address = 0x10000000 + fr.fbo;
  fr.flags = kOpRemoteRead;
  absl::StatusOr<uint64_t> wr = mr->FastRegister(fr);
  ASSERT_TRUE(wr.ok()) << wr.status();
  v1::Completion c = NextOfKind(stream, v1::Completion::FAST_REGISTER);
  EXPECT_EQ(c.status(), ::mrd::STATUS_SUCCESS) << c.message();
  EXPECT_EQ(c.request_context(), 77u);
  EXPECT_EQ(c.work_request(), *wr);
  absl::StatusOr<std::string> read = peer->Read(c.rkey(), fr.base_address, 10);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "fast bytes");

  // The LAM cannot go while a fast registration uses its pages.
  Lam second_handle = Lam::Adopt(session, lam->response());
  EXPECT_EQ(second_handle.Release().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(second_handle.valid());
  absl::StatusOr<uint64_t> inv = mr->Invalidate(peer->connection_id(), 99);
  ASSERT_TRUE(inv.ok()) << inv.status();
  v1::Completion ic = NextOfKind(stream, v1::Completion::INVALIDATE);
  EXPECT_EQ(ic.request_context(), 99u);
  EXPECT_EQ(ic.work_request(), *inv);
  EXPECT_TRUE(lam->Release().ok());
  EXPECT_FALSE(lam->valid());
  EXPECT_EQ(List(session).lams_size(), 0);

  // Registering through a normal MR object deregisters by MR.
  absl::StatusOr<Mr> normal = Mr::Create(session, false);
  ASSERT_TRUE(normal.ok()) << normal.status();
  EXPECT_FALSE(normal->fast_register());
  {
    absl::StatusOr<Registration> r =
        normal->Register(Range(buffer, 0, 64, kRemoteRead));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->mr(), normal->id());
    EXPECT_EQ(List(session).registrations_size(), 1);
  }
  EXPECT_EQ(List(session).registrations_size(), 0);
  EXPECT_EQ(List(session).mrs_size(), 2);
  EXPECT_EQ(Gauge("mrd_mr_objects"), 2);

  // Mr moves: the moved-to handle closes it; Close() reports the status.
  Mr moved = *std::move(normal);
  // Deliberately reads the moved-from object.
  EXPECT_FALSE(normal->valid());  // NOLINT(bugprone-use-after-move)
  EXPECT_TRUE(moved.valid());
  EXPECT_TRUE(moved.Close().ok());
  EXPECT_FALSE(moved.valid());
  EXPECT_EQ(List(session).mrs_size(), 1);
  EXPECT_EQ(Gauge("mrd_mr_objects"), 1);
}

TEST_F(ClientLibTest, LamMoveAndDestructorRelease) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4 * 4096);
  client::BuildLamOptions lo;
  lo.buffer = buffer.id();
  lo.length = 4096;
  absl::StatusOr<Lam> a = Lam::Build(session, lo);
  ASSERT_TRUE(a.ok()) << a.status();
  lo.offset = 2 * 4096;
  absl::StatusOr<Lam> b = Lam::Build(session, lo);
  ASSERT_TRUE(b.ok()) << b.status();
  const uint64_t b_id = b->id();
  EXPECT_EQ(List(session).lams_size(), 2);
  EXPECT_EQ(PinnedBytes(), 2 * 4096u);
  *a = *std::move(b);  // a's LAM is released
  // Deliberately reads the moved-from object.
  EXPECT_FALSE(b->valid());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(a->id(), b_id);
  v1::ListRegistrationsResponse list = List(session);
  ASSERT_EQ(list.lams_size(), 1);
  EXPECT_EQ(list.lams(0).lam(), b_id);
  EXPECT_EQ(PinnedBytes(), 4096u);
  { Lam last = *std::move(a); }
  EXPECT_EQ(List(session).lams_size(), 0);
  EXPECT_EQ(PinnedBytes(), 0u);
}

TEST_F(ClientLibTest, CompletionStreamEndsWithTheSession) {
  Session session = OpenLease();
  CompletionStream stream = CompletionStream::Open(session);
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<v1::Completion> got = stream.Next(absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->kind(), v1::Completion::PEER_CONNECTED);
  EXPECT_EQ(got->connection(), peer->connection_id());
  ASSERT_TRUE(session.Close().ok());
  absl::StatusOr<v1::Completion> end;
  do {
    end = stream.Next(absl::Seconds(10));  // peer events may come first
  } while (end.ok());
  EXPECT_EQ(end.status().code(), absl::StatusCode::kOutOfRange) << end.status();
}

TEST_F(ClientLibTest, CompletionStreamOfAnFdSessionEndsWhenTheSocketCloses) {
  Session session = OpenFdSession();
  CompletionStream stream = CompletionStream::Open(session);
  EXPECT_EQ(stream.Next(absl::Milliseconds(20)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // Open does not wait for mrd to subscribe the stream; a completion coming
  // through shows it has (a session closed before that is one the stream
  // never had: FAILED_PRECONDITION, as a slow TSan-built mrd showed).
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<v1::Completion> got = stream.Next(absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->kind(), v1::Completion::PEER_CONNECTED);
  ASSERT_TRUE(session.Close().ok());
  absl::StatusOr<v1::Completion> end;
  do {
    end = stream.Next(absl::Seconds(10));  // peer events may come first
  } while (end.ok());
  EXPECT_EQ(end.status().code(), absl::StatusCode::kOutOfRange) << end.status();
}

TEST_F(ClientLibTest, CompletionStreamCancelsInItsDestructorAndOnCancel) {
  Session session = OpenLease();
  const double before = FinishedStreams();
  {
    CompletionStream stream = CompletionStream::Open(session);
    // The stream is open at mrd: a peer's connection event arrives on it.
    auto peer = ConnectPeer(session);
    ASSERT_NE(peer, nullptr);
    ASSERT_TRUE(stream.Next(absl::Seconds(10)).ok());
    EXPECT_EQ(FinishedStreams(), before);
  }
  // The destructor cancelled it and mrd saw the stream end.
  EXPECT_TRUE(WaitFor([&] { return FinishedStreams() == before + 1; }))
      << FinishedStreams();

  // After Cancel, Next() returns what was buffered (e.g. the event of the
  // peer that just left), then CANCELLED.
  CompletionStream cancelled = CompletionStream::Open(session);
  cancelled.Cancel();
  absl::StatusOr<v1::Completion> next;
  for (int i = 0; i < 16; ++i) {
    next = cancelled.Next(absl::Seconds(10));
    if (!next.ok()) break;
  }
  EXPECT_EQ(next.status().code(), absl::StatusCode::kCancelled)
      << next.status();
  cancelled.Cancel();  // idempotent
  EXPECT_EQ(cancelled.Next(absl::Seconds(1)).status().code(),
            absl::StatusCode::kCancelled);

  // A moved stream keeps working. (Another session: mrd serves one stream
  // per session, and the cancelled one may not have ended there yet.)
  Session other = OpenLease();
  CompletionStream first = CompletionStream::Open(other);
  CompletionStream moved = std::move(first);
  auto peer = ConnectPeer(other);
  ASSERT_NE(peer, nullptr);
  v1::Completion c = NextOfKind(moved, v1::Completion::PEER_CONNECTED);
  EXPECT_EQ(c.connection(), peer->connection_id());
}

TEST_F(ClientLibTest, CompletionStreamOfUnknownSessionFails) {
  Session stale = Session::Attach(*client_, "nope");
  CompletionStream stream = CompletionStream::Open(stale);
  absl::StatusOr<v1::Completion> c = stream.Next(absl::Seconds(10));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client::SeedStatusOf(c.status()), ::mrd::WSAENOTCONN);
}

// ---- Peer tickets ----------------------------------------------------------

TEST_F(ClientLibTest, PeerTicketConnectsPeersOfThisSessionOnly) {
  Session session = OpenLease();
  absl::StatusOr<PeerTicket> ticket = PeerTicket::Create(session);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_FALSE(ticket->ticket().empty());
  absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(ticket->peer_address(), info->peer_address());
  EXPECT_EQ(ticket->proto().ticket(), ticket->ticket());
  auto peer = peer::SoftPeer::Connect(ticket->peer_address(), ticket->ticket());
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_TRUE(WaitFor([&] { return List(session).connections_size() == 1; }));

  auto forged =
      peer::SoftPeer::Connect(ticket->peer_address(), ticket->ticket() + "x");
  EXPECT_EQ(forged.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(client::ReasonOf(forged.status()), "BAD_TICKET");

  // Tickets die with their session.
  const std::string dead = ticket->ticket();
  ASSERT_TRUE(session.Close().ok());
  auto late = peer::SoftPeer::Connect(info->peer_address(), dead);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnauthenticated)
      << late.status();
}

// Same as MrdTest but with an fd socket that admits only another uid.
class RestrictedFdSocketTest : public ClientLibTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o = ClientLibTest::ServerOptions();
    o.extra_flags.push_back(absl::StrCat("--allowed_uids=", ::getuid() + 1));
    return o;
  }
};

TEST_F(RestrictedFdSocketTest, FdRefusalIsReported) {
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  EXPECT_EQ(session.status().code(), absl::StatusCode::kPermissionDenied)
      << session.status();
  EXPECT_EQ(client::ReasonOf(session.status()), "PEER_NOT_ALLOWED");
  EXPECT_EQ(Gauge("mrd_sessions"), 0);
}

// RegisterMrBatch and DeregisterMrBatch through the library, against the
// real mrd: every token of a batch works on the wire, a failed item is only
// that item's, another session's registrations are untouched, and the
// batch's deregistration kills each token before it returns.
TEST_F(ClientLibTest, BatchesRegisterAndDeregisterManyInOneCall) {
  Session bystander = OpenFdSession();
  absl::StatusOr<Buffer> other = Buffer::Create(bystander, 4096, "bystander");
  ASSERT_TRUE(other.ok()) << other.status();
  absl::StatusOr<Registration> kept =
      Registration::Register(bystander, Range(*other, 0, 4096, kRemoteRead));
  ASSERT_TRUE(kept.ok()) << kept.status();

  Session session = OpenFdSession();
  constexpr int kItems = 64;
  absl::StatusOr<Buffer> buffer =
      Buffer::Create(session, kItems * 4096, "batch");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::vector<RegisterOptions> options;
  for (int i = 0; i < kItems; ++i) {
    std::snprintf(static_cast<char*>(buffer->data()) + i * 4096, 16, "page %d",
                  i);
    options.push_back(Range(*buffer, i * 4096, 4096, kRemoteRead));
  }
  options.push_back(Range(*buffer, kItems * 4096, 4096, kRemoteRead));  // past
  absl::StatusOr<std::vector<absl::StatusOr<Registration>>> regs =
      Registration::RegisterBatch(session, options);
  ASSERT_TRUE(regs.ok()) << regs.status();
  ASSERT_EQ(regs->size(), options.size());
  EXPECT_EQ(regs->back().status().code(), absl::StatusCode::kInvalidArgument)
      << regs->back().status();
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  for (int i = 0; i < kItems; ++i) {
    ASSERT_TRUE((*regs)[i].ok()) << i << " " << (*regs)[i].status();
    absl::StatusOr<std::string> read =
        peer->Read((*regs)[i]->rkey(), (*regs)[i]->base_address(), 16);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(std::string(read->c_str()), absl::StrCat("page ", i));
  }
  EXPECT_EQ(List(session).registrations_size(), kItems);
  EXPECT_EQ(PinnedBytes(), (kItems + 1) * 4096u);

  std::vector<Registration> owned;
  std::vector<std::pair<uint32_t, uint64_t>> tokens;
  for (int i = 0; i < kItems; ++i) {
    tokens.emplace_back((*regs)[i]->rkey(), (*regs)[i]->base_address());
    owned.push_back(*std::move((*regs)[i]));
  }
  absl::StatusOr<std::vector<absl::StatusOr<uint32_t>>> left =
      Registration::DeregisterBatch(owned);
  ASSERT_TRUE(left.ok()) << left.status();
  ASSERT_EQ(left->size(), owned.size());
  for (const auto& l : *left) {
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(*l, 0u);
  }
  for (const Registration& r : owned) EXPECT_FALSE(r.valid());
  // A refused access ends the peer's connection (as an RC queue pair goes
  // to error): one fresh peer per dead token.
  for (const auto& [rkey, base] : tokens) {
    auto fresh = ConnectPeer(session);
    ASSERT_NE(fresh, nullptr);
    ExpectRemoteAccessError(fresh->Read(rkey, base, 1).status());
  }
  EXPECT_EQ(List(session).registrations_size(), 0);
  // The bystander's registration is as it was.
  auto bystander_peer = ConnectPeer(bystander);
  ASSERT_NE(bystander_peer, nullptr);
  EXPECT_TRUE(bystander_peer->Read(kept->rkey(), kept->base_address(), 1).ok());
  EXPECT_EQ(PinnedBytes(), 4096u);
}

class BatchLimitTest : public ClientLibTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o = ClientLibTest::ServerOptions();
    o.extra_flags.push_back("--max_batch_items=4");
    return o;
  }
};

TEST_F(BatchLimitTest, ABatchOverTheLimitIsRefusedWholeNamingIt) {
  Session session = OpenFdSession();
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, 8 * 4096, "limit");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::vector<RegisterOptions> options;
  for (int i = 0; i < 5; ++i) {
    options.push_back(Range(*buffer, i * 4096, 4096, kRemoteRead));
  }
  absl::StatusOr<std::vector<absl::StatusOr<Registration>>> regs =
      Registration::RegisterBatch(session, options);
  EXPECT_EQ(regs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client::ReasonOf(regs.status()), "BATCH_TOO_LARGE");
  EXPECT_TRUE(absl::StrContains(regs.status().message(), "at most 4"))
      << regs.status();
  EXPECT_EQ(List(session).registrations_size(), 0);
  options.pop_back();
  regs = Registration::RegisterBatch(session, options);
  ASSERT_TRUE(regs.ok()) << regs.status();
  for (const auto& r : *regs) EXPECT_TRUE(r.ok()) << r.status();
}

// A RegisterMr that is a cache hit, and a DeregisterMr that leaves
// references, are answered on the gRPC thread: with the one worker held
// still (ptrace, tests/support/frozen_thread.h) behind a queue of cold
// registrations, they return while none of the queue is done (hopped to the
// worker they would wait for it to go on).
class QuickPathTest : public ClientLibTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o = ClientLibTest::ServerOptions();
    o.extra_flags.push_back("--worker_threads=1");
    o.extra_flags.push_back("--spare_worker_threads=0");
    o.extra_flags.push_back("--warm_pin_bytes_total=0");
    return o;
  }
};

TEST_F(QuickPathTest, HitsAndNonLastDeregistrationsDoNotWaitForTheWorkers) {
  Session session = OpenFdSession();
  constexpr int kQueued = 12;
  // Past what mrd registers on the gRPC thread itself (64 KiB): the
  // worker's.
  constexpr uint64_t kQueuedBytes = 68 << 10;
  absl::StatusOr<Buffer> big =
      Buffer::Create(session, kQueued * kQueuedBytes + 4096, "queue");
  ASSERT_TRUE(big.ok()) << big.status();
  absl::StatusOr<Registration> first = Registration::Register(
      session, Range(*big, kQueued * kQueuedBytes, 4096, kRemoteRead));
  ASSERT_TRUE(first.ok()) << first.status();

  // Every worker thread (the one worker's slot and the threads yielders
  // use) held still: the first registration queued is handed to one of
  // them, the rest wait for the worker's slot.
  absl::StatusOr<std::vector<std::unique_ptr<FrozenThread>>> workers =
      FrozenThread::FreezeAllIdle(mrd_->pid(), "mrd-worker");
  ASSERT_TRUE(workers.ok()) << workers.status();
  const auto thaw = [&] {
    for (auto& w : *workers) w->Thaw();
  };
  std::vector<std::future<absl::StatusOr<Registration>>> queued;
  for (int i = 0; i < kQueued; ++i) {
    queued.push_back(Registration::RegisterFuture(
        session, Range(*big, i * kQueuedBytes, kQueuedBytes, kRemoteRead)));
  }
  const auto done = [&] {
    int n = 0;
    for (auto& f : queued) {
      if (f.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
        ++n;
      }
    }
    return n;
  };
  // The same range again: a hit, answered while the worker cannot move.
  std::future<absl::StatusOr<Registration>> hit_future =
      Registration::RegisterFuture(
          session, Range(*big, kQueued * kQueuedBytes, 4096, kRemoteRead));
  const bool hit_answered = hit_future.wait_for(std::chrono::seconds(20)) ==
                            std::future_status::ready;
  EXPECT_TRUE(hit_answered) << "the hit waited for the held worker";
  if (!hit_answered) thaw();
  absl::StatusOr<Registration> hit = hit_future.get();
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_TRUE(hit->cache_hit());
  EXPECT_EQ(hit->references(), 2u);
  EXPECT_EQ(done(), 0);
  // Its deregistration leaves the first's reference: no device call either.
  std::future<absl::StatusOr<uint32_t>> left_future =
      std::async(std::launch::async, [&] { return hit->Deregister(); });
  const bool deregister_answered =
      left_future.wait_for(std::chrono::seconds(20)) ==
      std::future_status::ready;
  EXPECT_TRUE(deregister_answered)
      << "the deregistration waited for the held worker";
  EXPECT_EQ(done(), 0);
  thaw();
  absl::StatusOr<uint32_t> left = left_future.get();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 1u);
  // Let go, the worker does the whole queue.
  for (auto& f : queued) {
    absl::StatusOr<Registration> r = f.get();
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) {
      EXPECT_FALSE(r->cache_hit());
    }
  }
  // The token of the remaining reference still works.
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  EXPECT_TRUE(peer->Read(first->rkey(), first->base_address(), 1).ok());
}

}  // namespace
}  // namespace mrd::testing
