// The floor of mrd's benchmarks: a minimal gRPC server (the callback API, on
// a Unix socket of its own) whose mrd RPCs answer at once with a plausible
// reply of the shape mrd gives and do nothing else (no session, no cache,
// no pin). With `hop`, each call is handed to one of two worker threads
// before it is answered. What mrd costs over it is mrd's own.
#ifndef MRD_BENCH_FLOOR_SERVER_H_
#define MRD_BENCH_FLOOR_SERVER_H_

#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "bench/bench_util.h"
#include "client/lib/mrd_client.h"
#include "grpcpp/grpcpp.h"
#include "mrd/v1/mrd.grpc.pb.h"

namespace mrd::bench {

inline constexpr int kFloorWorkers = 2;

class FloorService final : public v1::MemoryRegistration::CallbackService {
 public:
  explicit FloorService(bool hop) {
    if (!hop) return;
    for (int i = 0; i < kFloorWorkers; ++i) {
      workers_.emplace_back([this] { Work(); });
    }
  }
  ~FloorService() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (std::thread& t : workers_) t.join();
  }

  grpc::ServerUnaryReactor* GetDeviceInfo(grpc::CallbackServerContext* context,
                                          const v1::GetDeviceInfoRequest*,
                                          v1::DeviceInfo* reply) override {
    return Answer(context, [reply] {
      reply->set_name("software");
      reply->set_kind("software");
      reply->set_page_size(kPage);
      reply->set_max_mr_size(uint64_t{1} << 40);
      reply->set_peer_address("127.0.0.1:40000");
      reply->set_healthy(true);
    });
  }
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::GetSessionRequest* request,
                                       v1::SessionInfo* reply) override {
    return Answer(context, [request, reply] {
      reply->set_session(request->session());
      reply->set_kind("fd");
      reply->set_peer_uid(1000);
      reply->set_peer_pid(4242);
      reply->set_pinned_bytes(4096);
      reply->set_registrations(1);
      reply->set_tenant("uid:1000");
      reply->set_verified(true);
    });
  }
  grpc::ServerUnaryReactor* RegisterMr(grpc::CallbackServerContext* context,
                                       const v1::RegisterMrRequest* request,
                                       v1::RegisterMrResponse* reply) override {
    return Answer(context, [this, request, reply] { Fill(*request, reply); });
  }
  grpc::ServerUnaryReactor* DeregisterMr(
      grpc::CallbackServerContext* context, const v1::DeregisterMrRequest*,
      v1::DeregisterMrResponse* reply) override {
    return Answer(context, [reply] { reply->set_references(0); });
  }
  grpc::ServerUnaryReactor* RegisterMrBatch(
      grpc::CallbackServerContext* context,
      const v1::RegisterMrBatchRequest* request,
      v1::RegisterMrBatchResponse* reply) override {
    return Answer(context, [this, request, reply] {
      for (const v1::RegisterMrRequest& item : request->items()) {
        // mrd's reply: no status for an item that succeeded.
        Fill(item, reply->add_items()->mutable_registration());
      }
    });
  }
  grpc::ServerUnaryReactor* DeregisterMrBatch(
      grpc::CallbackServerContext* context,
      const v1::DeregisterMrBatchRequest* request,
      v1::DeregisterMrBatchResponse* reply) override {
    return Answer(context, [request, reply] {
      for (int i = 0; i < request->items_size(); ++i) {
        reply->add_items()->set_references(0);
      }
    });
  }

 private:
  struct Call {
    absl::AnyInvocable<void() &&> fill;
    grpc::ServerUnaryReactor* reactor;
  };

  // A reply of the shape mrd gives for a new registration.
  void Fill(const v1::RegisterMrRequest& request,
            v1::RegisterMrResponse* reply) {
    const uint64_t id = next_id_.fetch_add(1, std::memory_order_relaxed);
    const uint64_t base = request.has_base_address()
                              ? request.base_address()
                              : 0x7f0000000000 + request.offset();
    reply->set_registration(id);
    reply->set_lkey(static_cast<uint32_t>(id << 8));
    reply->set_rkey(static_cast<uint32_t>(id << 8) | 0x80);
    reply->set_base_address(base);
    reply->set_length(request.length());
    reply->set_references(1);
    reply->set_cache_hit(false);
    std::string descriptor(24, '\0');
    std::memcpy(descriptor.data(), &id, sizeof(id));
    std::memcpy(descriptor.data() + 8, &base, sizeof(base));
    const uint64_t length = request.length();
    std::memcpy(descriptor.data() + 16, &length, sizeof(length));
    reply->set_rdma_descriptor(std::move(descriptor));
    // One token: mrd's replies carry one per device (issue 26).
    v1::DeviceToken* token = reply->add_tokens();
    token->set_device("software");
    token->set_rkey(reply->rkey());
    token->set_lkey(reply->lkey());
    token->set_peer_address("127.0.0.1:40000");
  }

  template <typename F>
  grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context,
                                   F fill) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (workers_.empty()) {
      fill();
      reactor->Finish(grpc::Status::OK);
      return reactor;
    }
    absl::MutexLock lock(&mu_);
    queue_.push_back(Call{std::move(fill), reactor});
    return reactor;
  }

  void Work() {
    while (true) {
      Call call;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &FloorService::Ready));
        if (queue_.empty()) return;
        call = std::move(queue_.front());
        queue_.pop_front();
      }
      std::move(call.fill)();
      call.reactor->Finish(grpc::Status::OK);
    }
  }

  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queue_.empty();
  }

  std::atomic<uint64_t> next_id_{1};
  std::vector<std::thread> workers_;
  absl::Mutex mu_;
  std::deque<Call> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

// Where the floor server runs. kInProcess: in the benchmark's own process,
// beside its client, which then shares gRPC's pollers and threads with it
// (a thread waiting for its reply may read and answer the request itself,
// with no wake-up of another process). kOwnProcess: in a process of its
// own, as mrd is, so that each call crosses between two processes the way a
// call to mrd does; the process is this benchmark's own binary started again
// (RunFloorChildIfAsked).
enum class FloorPlace { kInProcess, kOwnProcess };

class Floor {
 public:
  // The floor server on a Unix socket in a new temporary directory, and a
  // client of it.
  static absl::StatusOr<std::unique_ptr<Floor>> Start(
      bool hop, FloorPlace place = FloorPlace::kInProcess) {
    auto f = std::unique_ptr<Floor>(new Floor());
    char dir[] = "/tmp/mrd-floor.XXXXXX";
    if (mkdtemp(dir) == nullptr) return absl::InternalError("mkdtemp");
    f->dir_ = dir;
    if (place == FloorPlace::kOwnProcess) {
      if (absl::Status s = f->Spawn(hop); !s.ok()) return s;
    } else {
      f->service_ = std::make_unique<FloorService>(hop);
      grpc::ServerBuilder builder;
      builder.AddListeningPort("unix:" + f->socket(),
                               grpc::InsecureServerCredentials());
      builder.RegisterService(f->service_.get());
      f->server_ = builder.BuildAndStart();
      if (f->server_ == nullptr) {
        return absl::InternalError("floor server did not start");
      }
    }
    client::ClientOptions options;
    options.socket_path = f->socket();
    auto c = client::Client::Connect(options);
    if (!c.ok()) return c.status();
    f->client_ = std::make_unique<client::Client>(*std::move(c));
    return f;
  }
  ~Floor() {
    client_.reset();
    if (server_ != nullptr) server_->Shutdown();
    server_.reset();
    service_.reset();
    if (child_ > 0) {
      ::close(child_stdin_);  // the child's cue to stop
      int status = 0;
      ::waitpid(child_, &status, 0);
    }
    unlink(socket().c_str());
    rmdir(dir_.c_str());
  }

  const client::Client& client() const { return *client_; }

 private:
  Floor() = default;
  std::string socket() const { return dir_ + "/floor.sock"; }

  // Starts this binary again as the floor server (RunFloorChildIfAsked) and
  // waits until its socket accepts connections.
  absl::Status Spawn(bool hop) {
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return absl::InternalError("pipe");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, pipe_fds[0], STDIN_FILENO);
    std::string exe = "/proc/self/exe";
    std::string child_flag = "--floor_child";
    std::string socket_flag = "--floor_socket=" + socket();
    std::string hop_flag = std::string("--floor_hop=") + (hop ? "1" : "0");
    char* args[] = {exe.data(), child_flag.data(), socket_flag.data(),
                    hop_flag.data(), nullptr};
    pid_t pid = 0;
    const int err =
        posix_spawn(&pid, exe.c_str(), &actions, nullptr, args, environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(pipe_fds[0]);
    if (err != 0) {
      ::close(pipe_fds[1]);
      return absl::InternalError("posix_spawn of the floor server");
    }
    child_ = pid;
    child_stdin_ = pipe_fds[1];
    // Until the socket accepts a connection: the file appears at bind,
    // before the child listens (a connect then is refused).
    for (int i = 0; i < 10000; ++i) {
      if (Accepts()) return absl::OkStatus();
      int status = 0;
      if (::waitpid(child_, &status, WNOHANG) == child_) {
        child_ = 0;
        return absl::InternalError("the floor server exited at start");
      }
      ::usleep(1000);
    }
    return absl::DeadlineExceededError("the floor server did not start");
  }

  // Whether a connect to the socket succeeds now.
  bool Accepts() const {
    struct sockaddr_un addr {};
    addr.sun_family = AF_UNIX;
    const std::string path = socket();
    if (path.size() >= sizeof(addr.sun_path)) return false;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    const bool ok =
        ::connect(fd, reinterpret_cast<const struct sockaddr*>(&addr),
                  sizeof(addr)) == 0;
    ::close(fd);
    return ok;
  }

  std::string dir_;
  std::unique_ptr<FloorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<client::Client> client_;
  pid_t child_ = 0;
  int child_stdin_ = -1;
};

// Call first in main: when this process was started as a floor server
// (Floor::Start with FloorPlace::kOwnProcess), serves until its standard
// input closes and returns true (then exit with *exit_code).
inline bool RunFloorChildIfAsked(int argc, char** argv, int* exit_code) {
  bool child = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--floor_child") child = true;
  }
  if (!child) return false;
  *exit_code = 1;
  const std::string socket = StringFlag(argc, argv, "--floor_socket", "");
  FloorService service(Flag(argc, argv, "--floor_hop", 0) != 0);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return true;
  char byte;
  while (::read(STDIN_FILENO, &byte, 1) > 0) {
  }
  server->Shutdown();
  *exit_code = 0;
  return true;
}

}  // namespace mrd::bench

#endif  // MRD_BENCH_FLOOR_SERVER_H_
