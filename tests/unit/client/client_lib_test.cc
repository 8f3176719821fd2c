// The client library against FakeMrd: RAII release on every path, the fd
// socket, async registration, completion streams, and status details through
// a real gRPC channel.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "client/lib/mrd_client.h"
#include "gtest/gtest.h"
#include "tests/unit/client/fake_mrd.h"

namespace mrd::client {
namespace {

bool WaitFor(const std::function<bool()>& condition,
             absl::Duration timeout = absl::Seconds(5)) {
  absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return condition();
}

class ClientLibTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.socket_path = fake_.grpc_socket();
    options_.fd_socket_path = fake_.fd_socket();
    options_.rpc_timeout = absl::Seconds(10);
    absl::StatusOr<Client> c = Client::Connect(options_);
    ASSERT_TRUE(c.ok()) << c.status();
    client_.emplace(*std::move(c));
  }

  // Every test must leave nothing behind in mrd.
  void TearDown() override {
    EXPECT_TRUE(WaitFor([&] {
      return fake_.sessions() == 0 && fake_.buffers() == 0 &&
             fake_.registration_references() == 0 && fake_.mrs() == 0 &&
             fake_.lams() == 0 && fake_.streams_open() == 0;
    })) << "sessions="
        << fake_.sessions() << " buffers=" << fake_.buffers()
        << " refs=" << fake_.registration_references() << " mrs=" << fake_.mrs()
        << " lams=" << fake_.lams() << " streams=" << fake_.streams_open();
  }

  Client& client() { return *client_; }

  testing::FakeMrd fake_;
  ClientOptions options_;
  std::optional<Client> client_;
};

TEST_F(ClientLibTest, ConnectToMissingSocketIsUnavailableAtOnce) {
  ClientOptions o;
  o.socket_path = fake_.dir() + "/nothing.sock";
  absl::Time start = absl::Now();
  absl::StatusOr<Client> c = Client::Connect(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ReasonOf(c.status()), "CANNOT_CONNECT");
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST_F(ClientLibTest, DeviceInfoAndHealth) {
  absl::StatusOr<v1::DeviceInfo> info = client().GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->name(), "fake");
  absl::StatusOr<ServingStatus> health = client().Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, ServingStatus::kServing);
  EXPECT_EQ(client().Health("no.such.Service").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ClientLibTest, BufferCreateHandsOverASealedMemfd) {
  absl::StatusOr<Session> session = Session::OpenFd(client());
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(session->kind(), Session::Kind::kFd);
  EXPECT_FALSE(session->token().empty());
  EXPECT_EQ(session->peer_uid(), ::getuid());
  {
    absl::StatusOr<Buffer> buffer = Buffer::Create(*session, 8192, "t");
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_EQ(buffer->size(), 8192u);
    EXPECT_NE(buffer->id(), 0u);
    ASSERT_NE(buffer->data(), nullptr);
    std::memset(buffer->data(), 0x5a, 8192);
    int seals = fake_.last_import_seals();
    EXPECT_TRUE(seals & F_SEAL_SHRINK);
    EXPECT_TRUE(seals & F_SEAL_GROW);
    EXPECT_EQ(fake_.last_import_size(), 8192u);
    EXPECT_EQ(fake_.buffers(), 1);
  }
  // The destructor released it while the session lives on.
  EXPECT_EQ(fake_.buffers(), 0);
  EXPECT_EQ(fake_.sessions(), 1);
  EXPECT_TRUE(session->Ping().ok());
}

TEST_F(ClientLibTest, ClosedFdIsInvalidArgumentAndSessionStaysUsable) {
  absl::StatusOr<Session> session = Session::OpenFd(client());
  ASSERT_TRUE(session.ok()) << session.status();
  int fd = ::memfd_create("closed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ::close(fd);
  absl::StatusOr<Buffer> bad = session->ImportMemfd(fd, false, 0);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReasonOf(bad.status()), "BAD_FD");
  EXPECT_NE(bad.status().message().find("not an open file descriptor"),
            absl::string_view::npos);
  EXPECT_TRUE(session->Ping().ok());
  absl::StatusOr<Buffer> good = Buffer::Create(*session, 4096);
  EXPECT_TRUE(good.ok()) << good.status();
}

TEST_F(ClientLibTest, FdImportErrorsComeBackWithDetail) {
  absl::StatusOr<Session> session = Session::OpenFd(client());
  ASSERT_TRUE(session.ok());
  int fd = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  absl::StatusOr<Buffer> refused = session->ImportMemfd(fd, true, 4096);
  ::close(fd);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SeedStatusOf(refused.status()), v1::STATUS_INVALID_PARAMETER);
  EXPECT_EQ(ReasonOf(refused.status()), "MEMFD_NOT_SEALED");
}

TEST_F(ClientLibTest, FdRefusalIsReported) {
  fake_.RefuseNextFdConnection(absl::StatusCode::kPermissionDenied,
                               "uid not allowed");
  absl::StatusOr<Session> session = Session::OpenFd(client());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ReasonOf(session.status()), "UID_NOT_ALLOWED");
}

TEST_F(ClientLibTest, MissingFdSocketIsUnavailable) {
  absl::StatusOr<Session> session =
      Session::OpenFd(client(), fake_.dir() + "/none.sock");
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(ClientLibTest, ConcurrentImportsOnOneFdSession) {
  absl::StatusOr<Session> session = Session::OpenFd(client());
  ASSERT_TRUE(session.ok());
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 4; ++i) {
        absl::StatusOr<Buffer> b = Buffer::Create(*session, 4096 * (i + 1));
        if (b.ok() && b->size() == 4096u * (i + 1)) ++ok;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok.load(), 32);
}

TEST_F(ClientLibTest, MrdEndingTheFdSessionMakesHandlesInert) {
  absl::StatusOr<Session> session = Session::OpenFd(client());
  ASSERT_TRUE(session.ok());
  absl::StatusOr<Buffer> buffer = Buffer::Create(*session, 4096);
  ASSERT_TRUE(buffer.ok());
  absl::StatusOr<Registration> reg = Registration::Register(
      *session, {.buffer = buffer->id(), .length = 4096});
  ASSERT_TRUE(reg.ok()) << reg.status();
  fake_.DropFdConnections();
  ASSERT_TRUE(WaitFor([&] { return fake_.sessions() == 0; }));
  absl::Status ping = session->Ping();
  EXPECT_EQ(ping.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SeedStatusOf(ping), v1::WSAENOTCONN);
  // Nothing left to release: the explicit forms say OK.
  EXPECT_EQ(*reg->Deregister(), 0u);
  EXPECT_TRUE(buffer->Release().ok());
}

TEST_F(ClientLibTest, CachedRegistrationsCountReferencesAndReleaseEach) {
  absl::StatusOr<Session> session = Session::OpenLease(client());
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(*session, "f", true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->data(), nullptr);
  RegisterOptions o{.buffer = buffer->id(), .length = 4096, .flags = 0x2};
  absl::StatusOr<Registration> first = Registration::Register(*session, o);
  ASSERT_TRUE(first.ok()) << first.status();
  {
    absl::StatusOr<Registration> second = Registration::Register(*session, o);
    ASSERT_TRUE(second.ok());
    EXPECT_TRUE(second->cache_hit());
    EXPECT_EQ(second->id(), first->id());
    EXPECT_EQ(second->rkey(), first->rkey());
    EXPECT_EQ(second->references(), 2u);
    EXPECT_EQ(second->descriptor().size(), 24u);
    EXPECT_EQ(fake_.registration_references(), 2);
  }
  EXPECT_EQ(fake_.registration_references(), 1);
  Registration moved = *std::move(first);
  EXPECT_FALSE(first->valid());
  EXPECT_EQ(*moved.Deregister(), 0u);
  EXPECT_FALSE(moved.valid());
  EXPECT_EQ(fake_.registration_references(), 0);
}

TEST_F(ClientLibTest, ErrorDetailsSurviveTheChannel) {
  absl::StatusOr<Session> session = Session::OpenLease(client());
  ASSERT_TRUE(session.ok());
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(*session, "f", false);
  ASSERT_TRUE(buffer.ok());

  absl::StatusOr<Registration> zero =
      Registration::Register(*session, {.buffer = buffer->id(), .length = 0});
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SeedStatusOf(zero.status()), v1::STATUS_INVALID_PARAMETER);
  EXPECT_EQ(ReasonOf(zero.status()), "ZERO_LENGTH");

  absl::StatusOr<Registration> small = Registration::Register(
      *session,
      {.buffer = buffer->id(), .length = 64, .descriptor_capacity = 8});
  EXPECT_EQ(small.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(SeedStatusOf(small.status()), v1::WSAEFAULT);
  EXPECT_EQ(RequiredSizeOf(small.status()), 24u);

  absl::StatusOr<Lam> lam = Lam::Build(
      *session, {.buffer = buffer->id(), .length = 8192, .capacity = 16});
  EXPECT_EQ(SeedStatusOf(lam.status()), v1::STATUS_BUFFER_TOO_SMALL);
  EXPECT_EQ(RequiredSizeOf(lam.status()), 24u);

  absl::StatusOr<Buffer> missing =
      Buffer::ImportFile(*session, "missing", true);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ReasonOf(missing.status()), "UNKNOWN_FILE");

  Session stale = Session::Attach(client(), "no-such-session");
  absl::Status info = stale.Info().status();
  EXPECT_EQ(info.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SeedStatusOf(info), v1::WSAENOTCONN);
}

TEST_F(ClientLibTest, ManyAsyncRegistrationsInFlightAtOnce) {
  absl::StatusOr<Session> session = Session::OpenLease(client());
  ASSERT_TRUE(session.ok());
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(*session, "f", true);
  ASSERT_TRUE(buffer.ok());
  fake_.set_register_delay(absl::Milliseconds(300));
  constexpr int kCount = 16;
  absl::Mutex mu;
  std::vector<Registration> done;
  int failures = 0;
  absl::BlockingCounter pending(kCount);
  absl::Time start = absl::Now();
  for (int i = 0; i < kCount; ++i) {
    Registration::RegisterAsync(*session,
                                {.buffer = buffer->id(),
                                 .offset = static_cast<uint64_t>(i) * 64,
                                 .length = 64},
                                [&](absl::StatusOr<Registration> r) {
                                  {
                                    absl::MutexLock l(&mu);
                                    if (r.ok()) {
                                      done.push_back(*std::move(r));
                                    } else {
                                      ++failures;
                                    }
                                  }
                                  pending.DecrementCount();
                                });
  }
  pending.Wait();
  absl::Duration took = absl::Now() - start;
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(done.size(), static_cast<size_t>(kCount));
  EXPECT_GT(fake_.max_concurrent_registers(), 1);
  EXPECT_LT(took, absl::Milliseconds(300) * kCount / 2);
  EXPECT_EQ(fake_.registration_references(), kCount);
  done.clear();
  EXPECT_EQ(fake_.registration_references(), 0);
}

TEST_F(ClientLibTest, RegisterFutureDeliversTheRegistration) {
  absl::StatusOr<Session> session = Session::OpenLease(client());
  ASSERT_TRUE(session.ok());
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(*session, "f", true);
  ASSERT_TRUE(buffer.ok());
  auto ok = Registration::RegisterFuture(
      *session, {.buffer = buffer->id(), .length = 100});
  auto bad = Registration::RegisterFuture(
      *session, {.buffer = buffer->id(), .length = 0});
  absl::StatusOr<Registration> r = ok.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->length(), 100u);
  EXPECT_EQ(SeedStatusOf(bad.get().status()), v1::STATUS_INVALID_PARAMETER);
}

TEST_F(ClientLibTest, LeaseSessionClosesOnDestructionAttachDoesNot) {
  std::string token;
  {
    absl::StatusOr<Session> lease =
        Session::OpenLease(client(), absl::Minutes(5));
    ASSERT_TRUE(lease.ok());
    token = lease->token();
    {
      Session attached = Session::Attach(client(), token);
      EXPECT_EQ(attached.kind(), Session::Kind::kAttached);
      EXPECT_TRUE(attached.Info().ok());
    }
    EXPECT_EQ(fake_.sessions(), 1);
    Session moved = *std::move(lease);
    EXPECT_EQ(moved.token(), token);
    EXPECT_EQ(fake_.sessions(), 1);
  }
  EXPECT_EQ(fake_.sessions(), 0);
}

TEST_F(ClientLibTest, HandlesOutlivingTheirSessionAreQuiet) {
  std::optional<Buffer> buffer;
  std::optional<Registration> reg;
  {
    absl::StatusOr<Session> session = Session::OpenLease(client());
    ASSERT_TRUE(session.ok());
    absl::StatusOr<Buffer> b = Buffer::ImportFile(*session, "f", true);
    ASSERT_TRUE(b.ok());
    absl::StatusOr<Registration> r =
        Registration::Register(*session, {.buffer = b->id(), .length = 10});
    ASSERT_TRUE(r.ok());
    buffer.emplace(*std::move(b));
    reg.emplace(*std::move(r));
  }
  // The session closed; mrd released everything; the handles know.
  EXPECT_EQ(fake_.sessions(), 0);
  EXPECT_EQ(*reg->Deregister(), 0u);
  EXPECT_TRUE(buffer->Release().ok());
}

TEST_F(ClientLibTest, MrLamFastRegisterAndCompletions) {
  absl::StatusOr<Session> session = Session::OpenLease(client());
  ASSERT_TRUE(session.ok());
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(*session, "f", true);
  ASSERT_TRUE(buffer.ok());
  CompletionStream stream = CompletionStream::Open(*session);
  EXPECT_EQ(stream.Next(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);

  absl::StatusOr<Mr> mr = Mr::Create(*session, true, true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_TRUE(mr->fast_register());
  absl::StatusOr<Lam> lam = Lam::Build(
      *session, {.buffer = buffer->id(), .offset = 100, .length = 5000});
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_EQ(lam->pages().size(), 2u);
  EXPECT_EQ(lam->fbo(), 100u);
  FastRegisterOptions fr = FastRegisterOptions::FromLam(*lam);
  fr.connection = 1;
  fr.request_context = 77;
  fr.base_address = 100;
  fr.flags = v1::NDK_OP_FLAG_ALLOW_REMOTE_READ;
  absl::StatusOr<uint64_t> wr = mr->FastRegister(fr);
  ASSERT_TRUE(wr.ok()) << wr.status();

  absl::StatusOr<v1::Completion> c = stream.Next(absl::Seconds(5));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kind(), v1::Completion::FAST_REGISTER);
  EXPECT_EQ(c->request_context(), 77u);
  EXPECT_EQ(c->work_request(), *wr);

  // Registering through a normal MR object deregisters by MR.
  absl::StatusOr<Mr> normal = Mr::Create(*session, false);
  ASSERT_TRUE(normal.ok());
  {
    absl::StatusOr<Registration> r =
        normal->Register({.buffer = buffer->id(), .length = 64});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(fake_.registration_references(), 1);
  }
  EXPECT_EQ(fake_.registration_references(), 0);
  EXPECT_EQ(fake_.mrs(), 2);
  EXPECT_TRUE(normal->Close().ok());
  EXPECT_EQ(fake_.mrs(), 1);
}

TEST_F(ClientLibTest, CompletionStreamEndsWithTheSession) {
  absl::StatusOr<Session> session = Session::OpenLease(client());
  ASSERT_TRUE(session.ok());
  CompletionStream stream = CompletionStream::Open(*session);
  v1::Completion c;
  c.set_kind(v1::Completion::PEER_CONNECTED);
  c.set_connection(5);
  fake_.QueueCompletion(session->token(), c);
  absl::StatusOr<v1::Completion> got = stream.Next(absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->connection(), 5u);
  ASSERT_TRUE(session->Close().ok());
  EXPECT_EQ(stream.Next(absl::Seconds(5)).status().code(),
            absl::StatusCode::kOutOfRange);
}

TEST_F(ClientLibTest, CompletionStreamCancelsInItsDestructor) {
  absl::StatusOr<Session> session = Session::OpenLease(client());
  ASSERT_TRUE(session.ok());
  {
    CompletionStream stream = CompletionStream::Open(*session);
    ASSERT_TRUE(WaitFor([&] { return fake_.streams_open() == 1; }));
  }
  EXPECT_TRUE(WaitFor([&] { return fake_.streams_open() == 0; }));
  CompletionStream cancelled = CompletionStream::Open(*session);
  cancelled.Cancel();
  EXPECT_EQ(cancelled.Next(absl::Seconds(5)).status().code(),
            absl::StatusCode::kCancelled);
}

TEST_F(ClientLibTest, CompletionStreamOfUnknownSessionFails) {
  Session stale = Session::Attach(client(), "nope");
  CompletionStream stream = CompletionStream::Open(stale);
  absl::StatusOr<v1::Completion> c = stream.Next(absl::Seconds(5));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SeedStatusOf(c.status()), v1::WSAENOTCONN);
}

TEST_F(ClientLibTest, PeerTicketAndList) {
  absl::StatusOr<Session> session = Session::OpenLease(client());
  ASSERT_TRUE(session.ok());
  absl::StatusOr<PeerTicket> ticket = PeerTicket::Create(*session);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(ticket->ticket(), "ticket-" + session->token());
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(*session, "f", true);
  ASSERT_TRUE(buffer.ok());
  absl::StatusOr<v1::ListRegistrationsResponse> list = session->List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->buffers_size(), 1);
  v1::BufferInfo detached = buffer->Detach();
  EXPECT_FALSE(buffer->valid());
  // Detached: still in mrd until released by id.
  Buffer adopted = Buffer::Adopt(*session, detached);
  EXPECT_EQ(fake_.buffers(), 1);
}

}  // namespace
}  // namespace mrd::client
