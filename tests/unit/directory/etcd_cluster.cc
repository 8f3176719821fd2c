#include "tests/unit/directory/etcd_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/directory/etcd_client.h"

#ifndef MRD_ETCD_BINARY
#error "MRD_ETCD_BINARY must name the etcd executable"
#endif

namespace mrd::testing {

namespace {

// `count` distinct free loopback ports: all bound at once (so none repeats),
// then released for etcd to take.
absl::StatusOr<std::vector<int>> FreePorts(int count) {
  std::vector<int> fds;
  std::vector<int> ports;
  absl::Status error;
  for (int i = 0; i < count && error.ok(); ++i) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      error = absl::ErrnoToStatus(errno, "socket");
      break;
    }
    fds.push_back(fd);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      error = absl::ErrnoToStatus(errno, "bind 127.0.0.1:0");
      break;
    }
    ports.push_back(ntohs(addr.sin_port));
  }
  for (int fd : fds) close(fd);
  if (!error.ok()) return error;
  return ports;
}

std::string Url(int port) { return absl::StrCat("http://127.0.0.1:", port); }

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(
    int members, absl::Duration timeout) {
  // The ports are free when picked, but another process (another test run
  // in parallel) may bind one before etcd does: such a start is tried again
  // on other ports. The race is the harness's, not what is tested.
  const absl::Time deadline = absl::Now() + timeout;
  for (int attempt = 1;; ++attempt) {
    bool port_taken = false;
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
        StartOnce(members, deadline, &port_taken);
    if (cluster.ok() || !port_taken || attempt == 3) return cluster;
  }
}

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::StartOnce(
    int members, absl::Time deadline, bool* port_taken) {
  std::unique_ptr<EtcdCluster> cluster(new EtcdCluster());
  const char* tmp = std::getenv("TMPDIR");
  std::string dir_template = absl::StrCat(
      tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/mrd-etcd-test.XXXXXX");
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::ErrnoToStatus(errno, "mkdtemp");
  }
  cluster->dir_ = dir_template;
  cluster->token_ =
      absl::StrCat("mrd-test-", getpid(), "-",
                   cluster->dir_.substr(cluster->dir_.size() - 6));
  absl::StatusOr<std::vector<int>> ports = FreePorts(2 * members);
  if (!ports.ok()) return ports.status();
  std::vector<std::string> peers;
  for (int i = 0; i < members; ++i) {
    Member member;
    member.name = absl::StrCat("m", i);
    member.client_port = (*ports)[static_cast<size_t>(2 * i)];
    member.peer_port = (*ports)[static_cast<size_t>(2 * i + 1)];
    peers.push_back(absl::StrCat(member.name, "=", Url(member.peer_port)));
    cluster->endpoints_.push_back(
        absl::StrCat("127.0.0.1:", member.client_port));
    cluster->members_.push_back(std::move(member));
  }
  cluster->initial_cluster_ = absl::StrJoin(peers, ",");
  for (int i = 0; i < members; ++i) {
    absl::Status spawned = cluster->Spawn(i);
    if (!spawned.ok()) return spawned;
  }
  for (int i = 0; i < members; ++i) {
    absl::Status ready = cluster->WaitReady(i, deadline - absl::Now());
    if (!ready.ok()) {
      for (int j = 0; j < members; ++j) {
        if (absl::StrContains(cluster->Log(j), "address already in use")) {
          *port_taken = true;
        }
      }
      return absl::Status(
          ready.code(),
          absl::StrCat(ready.message(), "\netcd ", cluster->members_[i].name,
                       " log:\n", cluster->Log(i)));
    }
  }
  return cluster;
}

EtcdCluster::~EtcdCluster() {
  for (int i = 0; i < size(); ++i) Kill(i);
  if (!dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
}

std::vector<std::string> EtcdCluster::endpoints() const { return endpoints_; }

const std::string& EtcdCluster::endpoint(int member) const {
  return endpoints_[static_cast<size_t>(member)];
}

absl::Status EtcdCluster::Spawn(int index) {
  Member& member = members_[static_cast<size_t>(index)];
  const std::string client = Url(member.client_port);
  const std::string peer = Url(member.peer_port);
  std::vector<std::string> args = {
      MRD_ETCD_BINARY,
      "--name=" + member.name,
      absl::StrCat("--data-dir=", dir_, "/", member.name),
      "--listen-client-urls=" + client,
      "--advertise-client-urls=" + client,
      "--listen-peer-urls=" + peer,
      "--initial-advertise-peer-urls=" + peer,
      "--initial-cluster=" + initial_cluster_,
      // A restarted member reads its membership from its data and ignores
      // these two.
      "--initial-cluster-state=new",
      "--initial-cluster-token=" + token_,
      "--heartbeat-interval=50",
      "--election-timeout=500",
  };
  const std::string log = absl::StrCat(dir_, "/", member.name, ".log");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return absl::ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    // Only async-signal-safe calls: the test process has other threads.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the test died already
    int fd = open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  member.pid = pid;
  return absl::OkStatus();
}

void EtcdCluster::Kill(int index) {
  Member& member = members_[static_cast<size_t>(index)];
  if (member.pid <= 0) return;
  kill(member.pid, SIGKILL);
  int status = 0;
  while (waitpid(member.pid, &status, 0) < 0 && errno == EINTR) {
  }
  member.pid = -1;
}

absl::Status EtcdCluster::Restart(int index) {
  if (running(index)) return absl::OkStatus();
  return Spawn(index);
}

absl::Status EtcdCluster::WaitReady(int member, absl::Duration timeout) {
  directory::EtcdClientOptions options;
  options.endpoints = {endpoint(member)};
  options.call_timeout = absl::Milliseconds(500);
  options.attempt_timeout = absl::Milliseconds(500);
  options.reconnect_backoff_max = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<directory::EtcdClient>> client =
      directory::EtcdClient::Create(options);
  if (!client.ok()) return client.status();
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last;
  // Each failed read waits out its own backoff inside the client: no spin.
  while (absl::Now() < deadline) {
    last = (*client)->Get("/mrd-etcd-test/ready").status();
    if (last.ok()) return last;
    int status = 0;
    Member& m = members_[static_cast<size_t>(member)];
    if (m.pid > 0 && waitpid(m.pid, &status, WNOHANG) == m.pid) {
      m.pid = -1;
      return absl::InternalError(absl::StrCat("etcd ", m.name, " exited"));
    }
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "etcd ", members_[static_cast<size_t>(member)].name, " not ready within ",
      absl::FormatDuration(timeout), ": ", last.message()));
}

std::string EtcdCluster::Log(int member) const {
  std::ifstream in(absl::StrCat(
      dir_, "/", members_[static_cast<size_t>(member)].name, ".log"));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace mrd::testing
