// GrpcAcceptor's live handover (Detach, Adopt) over a real Unix socket: real
// grpc::Servers, each with only the health service and a service name of its
// own marked SERVING, so that a Check on a new channel tells which server
// took the connection (the other answers NOT_FOUND).
#include "server/service/grpc_acceptor.h"

#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"

namespace mrd::service {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

// A health service that knows one service name: SERVING for it, NOT_FOUND
// for any other, like gRPC's default one (which a server without other
// services does not poll).
class NamedHealth final : public Health::Service {
 public:
  explicit NamedHealth(std::string name) : name_(std::move(name)) {}

  grpc::Status Check(grpc::ServerContext* /*context*/,
                     const HealthCheckRequest* request,
                     HealthCheckResponse* response) override {
    if (request->service() != name_) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service");
    }
    response->set_status(HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }

 private:
  const std::string name_;
};

// A grpc::Server with no port of its own (the acceptor feeds it) whose
// health service knows only `name`.
struct TestServer {
  explicit TestServer(const std::string& name) : health(name) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&health);
    server = builder.BuildAndStart();
  }
  ~TestServer() {
    if (server != nullptr) server->Shutdown(std::chrono::system_clock::now());
  }
  grpc::Server* get() const { return server.get(); }

  NamedHealth health;
  std::unique_ptr<grpc::Server> server;
};

// A channel with a connection of its own: channels to the same target
// otherwise share one (gRPC's global subchannel pool), and a "new" channel
// would reuse a connection the first server already holds.
std::shared_ptr<grpc::Channel> Channel(const std::string& path) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel("unix:" + path,
                                   grpc::InsecureChannelCredentials(), args);
}

// Health/Check of `service` on `channel`: OK if the server that holds the
// connection knows it, NOT_FOUND if not.
grpc::StatusCode Check(const std::shared_ptr<grpc::Channel>& channel,
                       const std::string& service) {
  std::unique_ptr<Health::Stub> stub = Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  return stub->Check(&context, request, &response).error_code();
}

bool SocketFileExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

class GrpcAcceptorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/mrd-acceptor-test-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    options_.socket_path = dir_ + "/grpc.sock";
  }
  void TearDown() override {
    ::unlink(options_.socket_path.c_str());
    ::rmdir(dir_.c_str());
  }

  std::string dir_;
  GrpcAcceptorOptions options_;
};

TEST_F(GrpcAcceptorTest, DetachedSocketIsAdoptedByAnotherAcceptorAndServer) {
  TestServer server_a("a");
  TestServer server_b("b");
  ASSERT_NE(server_a.get(), nullptr);
  ASSERT_NE(server_b.get(), nullptr);
  absl::StatusOr<std::unique_ptr<GrpcAcceptor>> a =
      GrpcAcceptor::Listen(options_);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*a)->Start(server_a.get()).ok());
  std::shared_ptr<grpc::Channel> old_channel = Channel(options_.socket_path);
  ASSERT_EQ(Check(old_channel, "a"), grpc::StatusCode::OK);

  absl::StatusOr<UniqueFd> listener = (*a)->Detach();
  ASSERT_TRUE(listener.ok()) << listener.status();
  ASSERT_TRUE(listener->valid());
  // A client arriving while nobody accepts waits in the backlog.
  grpc::StatusCode waiting = grpc::StatusCode::UNKNOWN;
  std::jthread early([this, &waiting] {  // joined even if an ASSERT returns
    waiting = Check(Channel(options_.socket_path), "b");
  });
  (*a)->Shutdown();
  EXPECT_TRUE(SocketFileExists(options_.socket_path))
      << "the detached acceptor's Shutdown removed the socket file";

  absl::StatusOr<std::unique_ptr<GrpcAcceptor>> b =
      GrpcAcceptor::Adopt(options_, *std::move(listener));
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*b)->Start(server_b.get()).ok());
  early.join();
  EXPECT_EQ(waiting, grpc::StatusCode::OK);
  // A new channel reaches the second server ...
  EXPECT_EQ(Check(Channel(options_.socket_path), "b"), grpc::StatusCode::OK);
  EXPECT_EQ(Check(Channel(options_.socket_path), "a"),
            grpc::StatusCode::NOT_FOUND);
  // ... while the connection gRPC already had stays with the first.
  EXPECT_EQ(Check(old_channel, "a"), grpc::StatusCode::OK);
  EXPECT_GE((*b)->Stats().accepted_total, 2u);

  (*b)->Shutdown();
  EXPECT_FALSE(SocketFileExists(options_.socket_path))
      << "the adopting acceptor left the socket file";
}

// The failed-handover path: the process adopts its own detached socket and
// accepts for the same grpc::Server again.
TEST_F(GrpcAcceptorTest, AdoptingBackIntoTheSameServerKeepsServing) {
  TestServer server("a");
  ASSERT_NE(server.get(), nullptr);
  absl::StatusOr<std::unique_ptr<GrpcAcceptor>> first =
      GrpcAcceptor::Listen(options_);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->Start(server.get()).ok());
  std::shared_ptr<grpc::Channel> old_channel = Channel(options_.socket_path);
  ASSERT_EQ(Check(old_channel, "a"), grpc::StatusCode::OK);

  absl::StatusOr<UniqueFd> listener = (*first)->Detach();
  ASSERT_TRUE(listener.ok()) << listener.status();
  absl::Status again = (*first)->Start(server.get());
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetErrorDetail(again).reason(), "ACCEPTOR_DETACHED");

  absl::StatusOr<std::unique_ptr<GrpcAcceptor>> resumed =
      GrpcAcceptor::Adopt(options_, *std::move(listener));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_TRUE((*resumed)->Start(server.get()).ok());
  first->reset();  // the detached acceptor goes: it closes nothing of ours
  EXPECT_TRUE(SocketFileExists(options_.socket_path));
  EXPECT_EQ(Check(Channel(options_.socket_path), "a"), grpc::StatusCode::OK);
  EXPECT_EQ((*resumed)->Stats().accepted_total, 1u);
  EXPECT_EQ(Check(old_channel, "a"), grpc::StatusCode::OK);

  (*resumed)->Shutdown();
  EXPECT_FALSE(SocketFileExists(options_.socket_path));
}

TEST_F(GrpcAcceptorTest, DetachOnlyOnceAndAdoptOnlyAListeningStreamSocket) {
  absl::StatusOr<std::unique_ptr<GrpcAcceptor>> a =
      GrpcAcceptor::Listen(options_);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<UniqueFd> listener = (*a)->Detach();  // before Start too
  ASSERT_TRUE(listener.ok()) << listener.status();
  absl::StatusOr<UniqueFd> twice = (*a)->Detach();
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetErrorDetail(twice.status()).reason(), "NOT_LISTENING");

  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd keep(pair[1]);
  absl::StatusOr<std::unique_ptr<GrpcAcceptor>> connected =
      GrpcAcceptor::Adopt(options_, UniqueFd(pair[0]));
  EXPECT_EQ(connected.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GetErrorDetail(connected.status()).reason(), "BAD_LISTENER");
  absl::StatusOr<std::unique_ptr<GrpcAcceptor>> none =
      GrpcAcceptor::Adopt(options_, UniqueFd());
  EXPECT_EQ(GetErrorDetail(none.status()).reason(), "BAD_LISTENER");

  GrpcAcceptorOptions zero = options_;
  zero.max_connections = 0;
  absl::StatusOr<std::unique_ptr<GrpcAcceptor>> bad =
      GrpcAcceptor::Adopt(zero, *std::move(listener));
  EXPECT_EQ(GetErrorDetail(bad.status()).reason(), "BAD_GRPC_LIMITS");
}

}  // namespace
}  // namespace mrd::service
