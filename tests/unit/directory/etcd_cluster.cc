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
#ifndef MRD_ETCDCTL_BINARY
#error "MRD_ETCDCTL_BINARY must name the etcdctl executable"
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

std::string PeerUrl(int port) {
  return absl::StrCat("http://127.0.0.1:", port);
}

// Runs `args` (args[0] an absolute path), its output appended to `log`, and
// waits for it: its exit status, or -1.
int RunTool(std::vector<std::string> args, const std::string& log) {
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    // Only async-signal-safe calls: the test process has other threads.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A CA, another CA that signed nothing here, a server certificate for
// 127.0.0.1 (for clients and peers alike) and a client certificate, each
// with an EC P-256 key. All PEM, valid for two days.
constexpr char kMakeCertificates[] = R"(set -e
cd "$1"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1.key"; }
ca() { key "$1"; openssl req -x509 -new -key "$1.key" -subj "/CN=$2" -days 2 -out "$1.crt"; }
leaf() {
  key "$1"
  printf '%s
' "$4" > "$1.ext"
  openssl req -new -key "$1.key" -subj "/CN=$2" |
    openssl x509 -req -CA "$3.crt" -CAkey "$3.key" -set_serial "$5" -days 2 -extfile "$1.ext" -out "$1.crt"
}
ca ca mrd-test-ca
ca other-ca mrd-test-other-ca
leaf server 127.0.0.1 ca 'subjectAltName=IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth' 2
leaf client mrd-test-client ca extendedKeyUsage=clientAuth 3
)";

}  // namespace

std::string EtcdCluster::Url(int port) const {
  return absl::StrCat(options_.tls ? "https" : "http", "://127.0.0.1:", port);
}

absl::Status EtcdCluster::MakeCertificates() {
  const std::string log = dir_ + "/openssl.log";
  if (RunTool({"/bin/sh", "-c", kMakeCertificates, "sh", dir_}, log) != 0) {
    return absl::InternalError(
        absl::StrCat("making the test certificates failed:\n", ReadAll(log)));
  }
  return absl::OkStatus();
}

absl::Status EtcdCluster::Etcdctl(int member,
                                  const std::vector<std::string>& args) {
  std::vector<std::string> argv = {
      MRD_ETCDCTL_BINARY,
      "--endpoints=" + Url(members_[static_cast<size_t>(member)].client_port),
      "--dial-timeout=5s", "--command-timeout=10s"};
  if (options_.tls) argv.push_back("--cacert=" + ca_file());
  if (options_.client_cert_auth) {
    argv.push_back("--cert=" + client_cert_file());
    argv.push_back("--key=" + client_key_file());
  }
  for (const std::string& arg : args) argv.push_back(arg);
  const std::string log = dir_ + "/etcdctl.log";
  if (RunTool(argv, log) != 0) {
    return absl::InternalError(absl::StrCat(
        "etcdctl ", absl::StrJoin(args, " "), " failed:\n", ReadAll(log)));
  }
  return absl::OkStatus();
}

directory::EtcdClientOptions EtcdCluster::ClientOptions() const {
  directory::EtcdClientOptions options;
  options.endpoints = endpoints_;
  if (options_.tls) options.ca_file = ca_file();
  if (options_.client_cert_auth) {
    options.cert_file = client_cert_file();
    options.key_file = client_key_file();
  }
  if (options_.auth) {
    options.user = kUser;
    options.password_file = password_file();
  }
  return options;
}

directory::EtcdClientOptions EtcdCluster::ClientOptions(int member) const {
  directory::EtcdClientOptions options = ClientOptions();
  options.endpoints = {endpoint(member)};
  return options;
}

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(
    int members, absl::Duration timeout) {
  return Start(members, EtcdClusterOptions(), timeout);
}

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(
    int members, const EtcdClusterOptions& options, absl::Duration timeout) {
  // The ports are free when picked, but another process (another test run
  // in parallel) may bind one before etcd does: such a start is tried again
  // on other ports. The race is the harness's, not what is tested.
  const absl::Time deadline = absl::Now() + timeout;
  for (int attempt = 1;; ++attempt) {
    bool port_taken = false;
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
        StartOnce(members, options, deadline, &port_taken);
    if (cluster.ok() || !port_taken || attempt == 3) return cluster;
  }
}

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::StartOnce(
    int members, const EtcdClusterOptions& options, absl::Time deadline,
    bool* port_taken) {
  std::unique_ptr<EtcdCluster> cluster(new EtcdCluster());
  cluster->options_ = options;
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
  if (options.tls) {
    absl::Status made = cluster->MakeCertificates();
    if (!made.ok()) return made;
  }
  if (options.auth) {
    // Unlike any other text of a test: a log that holds it is easy to see.
    cluster->password_ =
        absl::StrCat("pw-", cluster->dir_.substr(cluster->dir_.size() - 6), "-",
                     getpid(), "-secret");
    std::ofstream out(cluster->password_file());
    out << cluster->password_ << "\n";
    out.close();
    if (!out) return absl::InternalError("cannot write the password file");
  }
  absl::StatusOr<std::vector<int>> ports = FreePorts(2 * members);
  if (!ports.ok()) return ports.status();
  std::vector<std::string> peers;
  for (int i = 0; i < members; ++i) {
    Member member;
    member.name = absl::StrCat("m", i);
    member.client_port = (*ports)[static_cast<size_t>(2 * i)];
    member.peer_port = (*ports)[static_cast<size_t>(2 * i + 1)];
    peers.push_back(absl::StrCat(member.name, "=", PeerUrl(member.peer_port)));
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
  if (options.auth) {
    // Through one member, replicated to all; etcd wants root before auth.
    absl::Status done =
        cluster->Etcdctl(0, {"user", "add", kUser, "--interactive=false",
                             "--new-user-password=" + cluster->password_});
    if (done.ok()) done = cluster->Etcdctl(0, {"auth", "enable"});
    if (!done.ok()) return done;
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
  const std::string peer = PeerUrl(member.peer_port);
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
  if (options_.tls) {
    args.push_back("--cert-file=" + dir_ + "/server.crt");
    args.push_back("--key-file=" + dir_ + "/server.key");
    if (options_.client_cert_auth) {
      args.push_back("--client-cert-auth");
      args.push_back("--trusted-ca-file=" + ca_file());
    }
  }
  if (options_.auth_token_ttl_seconds > 0) {
    args.push_back(
        absl::StrCat("--auth-token-ttl=", options_.auth_token_ttl_seconds));
  }
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
  directory::EtcdClientOptions options = ClientOptions(member);
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
  return ReadAll(absl::StrCat(
      dir_, "/", members_[static_cast<size_t>(member)].name, ".log"));
}

}  // namespace mrd::testing
