#include "tests/integration/mrd_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"

#ifndef MRD_BINARY
#error "MRD_BINARY must name the mrd executable"
#endif

namespace mrd::testing {

int PickFreePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

absl::Status WriteShmFile(const std::string& dir, const std::string& name,
                          const std::string& content, size_t size) {
  std::string path = dir + "/" + name;
  int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) return absl::ErrnoToStatus(errno, "open " + path);
  std::string data;
  while (data.size() < size)
    data += content.empty() ? std::string(1, '\0') : content;
  data.resize(size);
  ssize_t n = write(fd, data.data(), data.size());
  close(fd);
  if (n != static_cast<ssize_t>(size))
    return absl::InternalError("short write");
  return absl::OkStatus();
}

std::string TestDeviceKind() {
  const char* kind = std::getenv("MRD_TEST_DEVICE");
  return kind == nullptr || *kind == '\0' ? "software" : kind;
}

std::vector<std::string> DeviceFlags() {
  if (TestDeviceKind() != "verbs") {
    return {"--device=software", "--peer_address=127.0.0.1:0"};
  }
  // Inside the Soft-RoCE VM (tests/vm/run.sh sets these).
  const char* name = std::getenv("MRD_VERBS_DEVICE");
  const char* address = std::getenv("MRD_VERBS_ADDRESS");
  return {"--device=verbs",
          absl::StrCat("--verbs_device=", name == nullptr ? "" : name),
          absl::StrCat("--peer_address=",
                       address == nullptr ? "127.0.0.1" : address, ":0")};
}

absl::StatusOr<std::unique_ptr<MrdProcess>> MrdProcess::Launch(
    const MrdProcessOptions& options) {
  std::unique_ptr<MrdProcess> p(new MrdProcess());
  if (options.runtime_dir.empty()) {
    char run_template[] = "/tmp/mrd-test-run-XXXXXX";
    if (mkdtemp(run_template) == nullptr) {
      return absl::ErrnoToStatus(errno, "mkdtemp");
    }
    p->runtime_dir_ = run_template;
    p->owns_runtime_dir_ = true;
    p->log_path_ = p->runtime_dir_ + "/mrd.log";
  } else {
    p->runtime_dir_ = options.runtime_dir;
    char log_template[] = "/tmp/mrd-test-log-XXXXXX";
    int log = mkstemp(log_template);
    if (log < 0) return absl::ErrnoToStatus(errno, "mkstemp");
    close(log);
    p->log_path_ = log_template;
    p->owns_log_ = true;
  }
  if (options.shm_dir.empty()) {
    char shm_template[] = "/dev/shm/mrd-test-shm-XXXXXX";
    if (mkdtemp(shm_template) == nullptr) {
      return absl::ErrnoToStatus(errno, "mkdtemp");
    }
    p->shm_dir_ = shm_template;
    p->owns_shm_dir_ = true;
  } else {
    p->shm_dir_ = options.shm_dir;
  }

  std::vector<std::string> args;
  if (!options.nofile.empty()) {
    args = {"/usr/bin/prlimit", "--nofile=" + options.nofile, "--"};
  }
  std::vector<std::string> mrd_args = {
      MRD_BINARY,
      "--runtime_dir=" + p->runtime_dir_,
      "--shm_dir=" + p->shm_dir_,
  };
  for (std::string& a : mrd_args) args.push_back(std::move(a));
  for (std::string& flag : DeviceFlags()) args.push_back(std::move(flag));
  if (options.metrics) {
    p->metrics_address_ = absl::StrCat("127.0.0.1:", PickFreePort());
    args.push_back("--metrics_address=" + p->metrics_address_);
  } else {
    args.push_back("--metrics_address=");
  }
  // Warm pins off unless a test turns them on: the tests watch pinned bytes
  // go to zero when a registration is deregistered. (Later flags win.)
  args.push_back("--warm_pin_bytes_per_session=0");
  args.push_back("--warm_pin_bytes_total=0");
  for (const auto& f : options.extra_flags) args.push_back(f);

  pid_t pid = fork();
  if (pid < 0) return absl::ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    int log = open(p->log_path_.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
    dup2(log, STDERR_FILENO);
    dup2(log, STDOUT_FILENO);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  p->pid_ = pid;
  return p;
}

absl::StatusOr<std::unique_ptr<MrdProcess>> MrdProcess::Start(
    const MrdProcessOptions& options) {
  absl::StatusOr<std::unique_ptr<MrdProcess>> launched = Launch(options);
  if (!launched.ok()) return launched.status();
  std::unique_ptr<MrdProcess> p = std::move(*launched);
  absl::Status ready = p->WaitServing();
  if (!ready.ok()) {
    return absl::Status(
        ready.code(), absl::StrCat(ready.message(), "\nmrd log:\n", p->Log()));
  }
  return p;
}

absl::StatusOr<MrdExit> MrdProcess::RunToExit(const MrdProcessOptions& options,
                                              int timeout_ms) {
  absl::StatusOr<std::unique_ptr<MrdProcess>> launched = Launch(options);
  if (!launched.ok()) return launched.status();
  MrdProcess& p = **launched;
  auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(p.pid_, &status, WNOHANG) == p.pid_) {
      p.pid_ = -1;
      return MrdExit{status, p.Log()};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("mrd was expected to exit but still runs after ", timeout_ms,
                   " ms\nlog:\n", p.Log()));  // the destructor kills it
}

absl::Status MrdProcess::WaitServing() {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(
          absl::StrCat("mrd exited during start-up, status ", status));
    }
    struct stat st;
    if (stat(grpc_socket().c_str(), &st) == 0) {
      auto channel = grpc::CreateChannel(grpc_target(),
                                         grpc::InsecureChannelCredentials());
      auto stub = grpc::health::v1::Health::NewStub(channel);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(1));
      grpc::health::v1::HealthCheckRequest req;
      grpc::health::v1::HealthCheckResponse resp;
      if (stub->Check(&ctx, req, &resp).ok() &&
          resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        return absl::OkStatus();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError("mrd did not become SERVING in 20 s");
}

absl::Status MrdProcess::Stop() {
  if (pid_ < 0) return absl::FailedPreconditionError("mrd is not running");
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat("mrd did not exit cleanly (status ",
                                            status, ")\nlog:\n", Log()));
  }
  if (!absl::StrContains(Log(), "device pinned bytes: 0")) {
    return absl::InternalError("mrd left memory pinned at exit:\n" + Log());
  }
  return absl::OkStatus();
}

std::string MrdProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

MrdProcess::~MrdProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  std::error_code ec;
  if (owns_runtime_dir_) std::filesystem::remove_all(runtime_dir_, ec);
  if (owns_shm_dir_) std::filesystem::remove_all(shm_dir_, ec);
  if (owns_log_) std::filesystem::remove(log_path_, ec);
}

}  // namespace mrd::testing
