// mrctl's directory commands (publish, published, resolve, unpublish) as the
// real binary, against the real mrd with --etcd_endpoints on a real
// three-member etcd cluster on loopback (tests/unit/directory/etcd_cluster.h):
// a lease session imports, registers and publishes; `published` reports the
// entry published; another node's mrd on the same etcd resolves it to the
// right node, address and rkey; unpublish deletes it and resolving it then
// exits 3; and without --etcd_endpoints publish exits 7 DIRECTORY_OFF.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
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

  // Runs mrctl with `args` against the mrd of `runtime_dir` (default: the
  // fixture's), MRD_SESSION=`session` when not empty; stdout and stderr go
  // to files of the runtime directory, read once it exited. mrctl's own
  // --timeout bounds every call it makes.
  Result Mrctl(std::vector<std::string> args, const std::string& session,
               const std::string& runtime_dir = "") {
    const std::string dir =
        runtime_dir.empty() ? mrd_->runtime_dir() : runtime_dir;
    const std::string out_path =
        absl::StrCat(dir, "/mrctl-", ++children_, ".out");
    const std::string err_path =
        absl::StrCat(dir, "/mrctl-", children_, ".err");
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
    const int out = ::open(out_path.c_str(),
                           O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    const int err = ::open(err_path.c_str(),
                           O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    Result r;
    if (out < 0 || err < 0 || devnull < 0) {
      ADD_FAILURE() << "cannot open mrctl's files: " << std::strerror(errno);
      return r;
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(devnull, STDIN_FILENO);
      ::dup2(out, STDOUT_FILENO);
      ::dup2(err, STDERR_FILENO);
      ::execve(argp[0], argp.data(), envp.data());
      ::_exit(127);
    }
    ::close(out);
    ::close(err);
    ::close(devnull);
    if (pid < 0) {
      ADD_FAILURE() << "cannot start mrctl: " << std::strerror(errno);
      return r;
    }
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.out = ReadFile(out_path);
    r.err = ReadFile(err_path);
    return r;
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
