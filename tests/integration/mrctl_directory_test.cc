// mrctl's directory commands (publish, published, resolve, unpublish, watch)
// as the real binary, against the real mrd with --etcd_endpoints on a real
// three-member etcd cluster on loopback (tests/unit/directory/etcd_cluster.h):
// a lease session imports, registers and publishes; `published` reports the
// entry published; another node's mrd on the same etcd resolves it to the
// right node, address and rkey; unpublish deletes it and resolving it then
// exits 3; `watch` prints the name's events as JSON lines while they happen
// (unpublished, then published with its rkey), stopping after --count or at
// SIGTERM; and without --etcd_endpoints publish exits 7 DIRECTORY_OFF.
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/util/json_util.h"
#include "mrd/v1/mrd.pb.h"
#include "tests/integration/test_env.h"
#include "tests/unit/directory/etcd_cluster.h"

#ifndef MRCTL_BINARY
#error "MRCTL_BINARY must name the mrctl executable"
#endif

extern char** environ;

namespace mrd::testing {
namespace {

// mrctl's documented exit codes (docs/CLI.md).
constexpr int kExitOk = 0;
constexpr int kExitNotFound = 3;
constexpr int kExitPrecondition = 7;

struct Result {
  int code = -1;
  std::string out;
  std::string err;
};

std::ostream& operator<<(std::ostream& os, const Result& r) {
  return os << "exit " << r.code << "\nstdout: " << r.out
            << "\nstderr: " << r.err;
}

// key=value lines into a map.
std::map<std::string, std::string> Fields(const std::string& out) {
  std::map<std::string, std::string> m;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      ADD_FAILURE() << "not a key=value line: " << line;
      continue;
    }
    m[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  return m;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The lines a child writes to a pipe, read as they come.
class PipeLines {
 public:
  explicit PipeLines(int fd) : fd_(fd) {}
  PipeLines(const PipeLines&) = delete;
  PipeLines& operator=(const PipeLines&) = delete;
  ~PipeLines() { ::close(fd_); }

  // The next whole line, without its newline; nullopt at the end of the
  // stream or when none came within `timeout`.
  std::optional<std::string> Next(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      if (const size_t nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return std::nullopt;
      pollfd readable{fd_, POLLIN, 0};
      const int ready = ::poll(
          &readable, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) return std::nullopt;
      char chunk[4096];
      const ssize_t got = ::read(fd_, chunk, sizeof(chunk));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return std::nullopt;
      buffer_.append(chunk, static_cast<size_t>(got));
    }
  }

 private:
  const int fd_;
  std::string buffer_;
};

// A line `mrctl watch` printed, as the NameEvent it holds.
v1::NameEvent EventOf(const std::optional<std::string>& line) {
  v1::NameEvent event;
  if (!line.has_value()) {
    ADD_FAILURE() << "no line from mrctl watch";
    return event;
  }
  const auto parsed =
      google::protobuf::util::JsonStringToMessage(*line, &event);
  EXPECT_TRUE(parsed.ok()) << parsed.ToString() << ": " << *line;
  return event;
}

class MrctlDirectoryTest : public MrdTest {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
        EtcdCluster::Start(3);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  MrdProcessOptions ServerOptions() override {
    // Each test its own cluster name: its keys are its own.
    cluster_name_ = absl::StrCat(
        "c", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    return NodeOptions("node-a");
  }
  MrdProcessOptions NodeOptions(const std::string& node) const {
    MrdProcessOptions options;
    options.extra_flags = {
        absl::StrCat("--etcd_endpoints=",
                     absl::StrJoin(cluster_->endpoints(), ",")),
        absl::StrCat("--directory_cluster=", cluster_name_),
        absl::StrCat("--node_name=", node), "--directory_lease_ttl=5s",
        "--directory_unpublish_wait=5s"};
    return options;
  }

  // A started mrctl, and the files its output goes to.
  struct Child {
    pid_t pid = -1;
    std::string out_path;  // empty: stdout is a descriptor of the caller's
    std::string err_path;
  };

  // Starts mrctl with `args` against the mrd of `runtime_dir` (default: the
  // fixture's), MRD_SESSION=`session` when not empty; stdout goes to
  // `stdout_fd` if it is one, else to a file of the runtime directory, and
  // stderr to a file there. mrctl's own --timeout bounds every call it
  // makes (and the wait of `watch`).
  Child Spawn(std::vector<std::string> args, const std::string& session,
              const std::string& runtime_dir = "", int stdout_fd = -1) {
    const std::string dir =
        runtime_dir.empty() ? mrd_->runtime_dir() : runtime_dir;
    const int n = ++children_;
    Child child;
    if (stdout_fd < 0) child.out_path = absl::StrCat(dir, "/mrctl-", n, ".out");
    child.err_path = absl::StrCat(dir, "/mrctl-", n, ".err");
    args.insert(args.begin(), {MRCTL_BINARY, "--timeout=20s"});
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (absl::StartsWith(*e, "MRD_SESSION=") ||
          absl::StartsWith(*e, "MRD_RUNTIME_DIR=")) {
        continue;
      }
      env.push_back(*e);
    }
    env.push_back("MRD_RUNTIME_DIR=" + dir);
    if (!session.empty()) env.push_back("MRD_SESSION=" + session);
    // Everything the child needs is built before fork: after it, only
    // async-signal-safe calls (this process has gRPC threads).
    std::vector<char*> argp;
    for (std::string& a : args) argp.push_back(a.data());
    argp.push_back(nullptr);
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    const int out =
        stdout_fd >= 0 ? stdout_fd
                       : ::open(child.out_path.c_str(),
                                O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    const int err = ::open(child.err_path.c_str(),
                           O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (out < 0 || err < 0 || devnull < 0) {
      ADD_FAILURE() << "cannot open mrctl's files: " << std::strerror(errno);
      return child;
    }
    child.pid = ::fork();
    if (child.pid == 0) {
      ::dup2(devnull, STDIN_FILENO);
      ::dup2(out, STDOUT_FILENO);
      ::dup2(err, STDERR_FILENO);
      ::execve(argp[0], argp.data(), envp.data());
      ::_exit(127);
    }
    if (out != stdout_fd) ::close(out);
    ::close(err);
    ::close(devnull);
    if (child.pid < 0) {
      ADD_FAILURE() << "cannot start mrctl: " << std::strerror(errno);
    }
    return child;
  }

  // Waits until `child` exited: its exit code and what it wrote to files.
  static Result Reap(const Child& child) {
    Result r;
    if (child.pid < 0) return r;
    int status = 0;
    while (::waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {
    }
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (!child.out_path.empty()) r.out = ReadFile(child.out_path);
    r.err = ReadFile(child.err_path);
    return r;
  }

  // Runs mrctl to its end (Spawn's arguments, stdout to a file).
  Result Mrctl(std::vector<std::string> args, const std::string& session,
               const std::string& runtime_dir = "") {
    return Reap(Spawn(std::move(args), session, runtime_dir));
  }

  // `mrctl lease open -q` on the mrd of `runtime_dir`: the token.
  std::string OpenLease(const std::string& runtime_dir = "") {
    Result r = Mrctl({"lease", "open", "-q"}, "", runtime_dir);
    EXPECT_EQ(r.code, kExitOk) << r;
    return std::string(absl::StripSuffix(r.out, "\n"));
  }

  // A lease session with a 64 KiB file imported and registered
  // remote-readable; its fields as `register` printed them.
  struct Registered {
    std::string session;
    std::map<std::string, std::string> registration;
  };
  Registered ImportAndRegister(const MrdProcess& mrd) {
    Registered reg;
    reg.session = OpenLease(mrd.runtime_dir());
    EXPECT_FALSE(reg.session.empty());
    EXPECT_TRUE(
        WriteShmFile(mrd.shm_dir(), "weights", "weights", 64 << 10).ok());
    Result imported =
        Mrctl({"import-file", "weights"}, reg.session, mrd.runtime_dir());
    EXPECT_EQ(imported.code, kExitOk) << imported;
    const std::string buffer = Fields(imported.out)["buffer"];
    Result registered = Mrctl({"register", "--buffer=" + buffer,
                               "--length=65536", "--flags=remote_read"},
                              reg.session, mrd.runtime_dir());
    EXPECT_EQ(registered.code, kExitOk) << registered;
    reg.registration = Fields(registered.out);
    return reg;
  }

  // `mrctl watch` with `args`, its stdout a pipe read line by line.
  struct Watcher {
    Child child;
    std::unique_ptr<PipeLines> lines;
  };
  Watcher StartWatch(std::vector<std::string> args,
                     const std::string& session) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "pipe2: " << std::strerror(errno);
      return {};
    }
    args.insert(args.begin(), "watch");
    Watcher watcher{Spawn(std::move(args), session, "", fds[1]),
                    std::make_unique<PipeLines>(fds[0])};
    ::close(fds[1]);
    return watcher;
  }

  static EtcdCluster* cluster_;
  std::string cluster_name_;
  int children_ = 0;
};
EtcdCluster* MrctlDirectoryTest::cluster_ = nullptr;

TEST_F(MrctlDirectoryTest, PublishListResolveOnAnotherNodeAndUnpublish) {
  Registered reg = ImportAndRegister(*mrd_);
  ASSERT_FALSE(HasFailure());
  const std::string& session = reg.session;
  Result described = Mrctl({"session"}, session);
  ASSERT_EQ(described.code, kExitOk) << described;
  const std::string tenant = Fields(described.out)["tenant"];
  ASSERT_FALSE(tenant.empty()) << described;

  Result published =
      Mrctl({"publish", "weights.0",
             "--registration=" + reg.registration["registration"]},
            session);
  ASSERT_EQ(published.code, kExitOk) << published;
  std::map<std::string, std::string> entry = Fields(published.out);
  EXPECT_EQ(entry["name"], "weights.0");
  EXPECT_EQ(entry["tenant"], tenant);
  EXPECT_EQ(entry["cluster"], cluster_name_);
  EXPECT_EQ(entry["node"], "node-a");
  EXPECT_EQ(entry["address"], reg.registration["base_address"]);
  EXPECT_EQ(entry["length"], "65536");
  EXPECT_EQ(entry["tokens[0].rkey"], reg.registration["rkey"]);
  EXPECT_EQ(entry["key"], absl::StrCat("/mrd/v1/", cluster_name_, "/tenants/",
                                       tenant, "/names/weights.0"));

  // etcd is written in the background: `published` says when (no event
  // reaches mrctl, so a bounded poll).
  std::map<std::string, std::string> listed;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (true) {
    Result r = Mrctl({"published"}, session);
    ASSERT_EQ(r.code, kExitOk) << r;
    listed = Fields(r.out);
    if (listed["entries[0].state"] == "published" || absl::Now() >= deadline) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(listed["directory_state"], "serving");
  EXPECT_EQ(listed["entries[0].state"], "published");
  EXPECT_EQ(listed["entries[0].name"], "weights.0");
  EXPECT_EQ(listed["entries[0].registration"],
            reg.registration["registration"]);
  EXPECT_EQ(listed.count("entries[1].name"), 0u);

  // Another node's mrd on the same etcd resolves it, in the tenant named
  // and in the session's own (the same uid's).
  absl::StatusOr<std::unique_ptr<MrdProcess>> other =
      MrdProcess::Start(NodeOptions("node-b"));
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string other_dir = (*other)->runtime_dir();
  const std::string other_session = OpenLease(other_dir);
  ASSERT_FALSE(other_session.empty());
  Result info = Mrctl({"info"}, "");
  ASSERT_EQ(info.code, kExitOk) << info;
  const std::string peer_address = Fields(info.out)["peer_address"];
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{
           {"resolve", "weights.0", "--tenant=" + tenant},
           {"resolve", "weights.0"}}) {
    Result resolved = Mrctl(args, other_session, other_dir);
    ASSERT_EQ(resolved.code, kExitOk) << resolved;
    std::map<std::string, std::string> found = Fields(resolved.out);
    EXPECT_EQ(found["name"], "weights.0");
    EXPECT_EQ(found["node"], "node-a");
    EXPECT_EQ(found["tenant"], tenant);
    EXPECT_EQ(found["address"], reg.registration["base_address"]);
    EXPECT_EQ(found["length"], "65536");
    EXPECT_EQ(found["epoch"], "1");
    EXPECT_EQ(found["tokens[0].rkey"], reg.registration["rkey"]);
    EXPECT_EQ(found["tokens[0].peer_address"], peer_address);
    EXPECT_EQ(found.count("tokens[1].rkey"), 0u);
  }

  Result unpublished = Mrctl({"unpublish", "weights.0"}, session);
  ASSERT_EQ(unpublished.code, kExitOk) << unpublished;
  EXPECT_EQ(unpublished.out, "deleted=true\n");
  Result gone = Mrctl({"resolve", "weights.0", "--tenant=" + tenant},
                      other_session, other_dir);
  EXPECT_EQ(gone.code, kExitNotFound) << gone;
  EXPECT_EQ(gone.out, "");
  EXPECT_TRUE(absl::StrContains(gone.err, "NAME_NOT_PUBLISHED")) << gone;
  Result again = Mrctl({"unpublish", "weights.0"}, session);
  EXPECT_EQ(again.code, kExitNotFound) << again;
  EXPECT_TRUE(absl::StrContains(again.err, "NOT_PUBLISHED")) << again;
  Result none = Mrctl({"published"}, session);
  ASSERT_EQ(none.code, kExitOk) << none;
  EXPECT_EQ(Fields(none.out).count("entries[0].name"), 0u) << none;

  EXPECT_EQ(Mrctl({"lease", "close", "-q"}, other_session, other_dir).code,
            kExitOk);
  EXPECT_EQ(Mrctl({"lease", "close", "-q"}, session).code, kExitOk);
  absl::Status stopped = (*other)->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped;
}

TEST_F(MrctlDirectoryTest, WatchPrintsEachEventOfTheNameAsAJsonLine) {
  Registered reg = ImportAndRegister(*mrd_);
  ASSERT_FALSE(HasFailure());
  // One watcher stops after two events, the other runs until SIGTERM.
  Watcher counted = StartWatch({"weights.0", "--count=2"}, reg.session);
  Watcher endless = StartWatch({"weights.0"}, reg.session);
  ASSERT_GT(counted.child.pid, 0);
  ASSERT_GT(endless.child.pid, 0);
  // Each first prints the name's state now: nothing published.
  for (Watcher* w : {&counted, &endless}) {
    std::optional<std::string> line = w->lines->Next(absl::Seconds(20));
    EXPECT_EQ(EventOf(line).kind(), v1::NameEvent::UNPUBLISHED)
        << line.value_or("");
  }

  Result published =
      Mrctl({"publish", "weights.0",
             "--registration=" + reg.registration["registration"]},
            reg.session);
  ASSERT_EQ(published.code, kExitOk) << published;
  for (Watcher* w : {&counted, &endless}) {
    std::optional<std::string> line = w->lines->Next(absl::Seconds(20));
    v1::NameEvent event = EventOf(line);
    EXPECT_EQ(event.kind(), v1::NameEvent::PUBLISHED) << line.value_or("");
    EXPECT_EQ(event.entry().name(), "weights.0");
    EXPECT_EQ(event.entry().node(), "node-a");
    ASSERT_EQ(event.entry().tokens_size(), 1) << line.value_or("");
    EXPECT_EQ(absl::StrCat(event.entry().tokens(0).rkey()),
              reg.registration["rkey"]);
  }

  // --count=2 reached: it ends by itself, with nothing more printed.
  Result counted_end = Reap(counted.child);
  EXPECT_EQ(counted_end.code, kExitOk) << counted_end;
  EXPECT_EQ(counted.lines->Next(absl::Seconds(20)), std::nullopt);
  // SIGTERM interrupts a watch waiting for the next event: success.
  ASSERT_EQ(::kill(endless.child.pid, SIGTERM), 0);
  Result endless_end = Reap(endless.child);
  EXPECT_EQ(endless_end.code, kExitOk) << endless_end;
  EXPECT_EQ(endless.lines->Next(absl::Seconds(20)), std::nullopt);

  EXPECT_EQ(Mrctl({"lease", "close", "-q"}, reg.session).code, kExitOk);
}

TEST_F(MrctlDirectoryTest, WithoutEtcdEndpointsPublishIsDirectoryOff) {
  absl::StatusOr<std::unique_ptr<MrdProcess>> plain = MrdProcess::Start();
  ASSERT_TRUE(plain.ok()) << plain.status();
  Registered reg = ImportAndRegister(**plain);
  ASSERT_FALSE(HasFailure());
  const std::string dir = (*plain)->runtime_dir();
  Result published =
      Mrctl({"publish", "weights.0",
             "--registration=" + reg.registration["registration"]},
            reg.session, dir);
  EXPECT_EQ(published.code, kExitPrecondition) << published;
  EXPECT_EQ(published.out, "");
  EXPECT_TRUE(absl::StartsWith(published.err, "mrctl: FAILED_PRECONDITION "))
      << published;
  EXPECT_TRUE(absl::StrContains(published.err, "DIRECTORY_OFF")) << published;
  Result listed = Mrctl({"published"}, reg.session, dir);
  EXPECT_EQ(listed.code, kExitOk) << listed;
  EXPECT_EQ(listed.out, "directory_state=off\n") << listed;
  Result resolved = Mrctl({"resolve", "weights.0"}, reg.session, dir);
  EXPECT_EQ(resolved.code, kExitPrecondition) << resolved;
  EXPECT_TRUE(absl::StrContains(resolved.err, "DIRECTORY_OFF")) << resolved;

  EXPECT_EQ(Mrctl({"lease", "close", "-q"}, reg.session, dir).code, kExitOk);
  absl::Status stopped = (*plain)->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped;
}

}  // namespace
}  // namespace mrd::testing
