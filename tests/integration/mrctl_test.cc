// The real mrctl binary (fork+exec, stdout, stderr and exit code captured)
// against the real mrd: what every command prints in key=value and --json
// form, the error line, the exit-code table, `hold` on the fd socket, and the
// README's round trip exactly as documented.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/lib/mrd_client.h"
#include "client/peer/soft_peer.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tests/integration/test_env.h"

#ifndef MRCTL_BINARY
#error "MRCTL_BINARY must name the mrctl executable"
#endif

extern char** environ;

namespace mrd::testing {
namespace {

// mrctl's documented exit codes (docs/CLI.md).
constexpr int kExitOk = 0;
constexpr int kExitUsage = 1;
constexpr int kExitFailed = 2;
constexpr int kExitNotFound = 3;
constexpr int kExitDenied = 4;
constexpr int kExitExhausted = 5;
constexpr int kExitUnavailable = 6;
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
    size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      ADD_FAILURE() << "not a key=value line: " << line;
      continue;
    }
    m[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  return m;
}

// One line of JSON as a message of type M (fails on unknown fields: the
// output must be exactly the proto's JSON mapping).
template <typename M>
M FromJson(absl::string_view json) {
  M m;
  auto status = google::protobuf::util::JsonStringToMessage(
      std::string(absl::StripSuffix(json, "\n")), &m);
  EXPECT_TRUE(status.ok()) << status.ToString() << " in " << json;
  return m;
}

// A JSON object field of `s` as message M.
template <typename M>
M Member(const google::protobuf::Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  if (it == s.fields().end()) {
    ADD_FAILURE() << "no member " << key;
    return M();
  }
  std::string json;
  EXPECT_TRUE(
      google::protobuf::util::MessageToJsonString(it->second, &json).ok());
  return FromJson<M>(json);
}

uint64_t ToU64(const std::string& s) {
  uint64_t v = 0;
  EXPECT_TRUE(absl::SimpleAtoi(s, &v)) << "not a number: \"" << s << "\"";
  return v;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// An mrctl child process. stdout and stdin are pipes; stderr goes to a file
// (read once the child is gone).
class Child {
 public:
  // Starts `argv` with `env` (NAME=value strings). With `keep_stdin`, the
  // child's stdin is a pipe this object holds open until CloseStdin();
  // otherwise it is /dev/null.
  static std::unique_ptr<Child> Start(const std::vector<std::string>& argv,
                                      const std::vector<std::string>& env,
                                      const std::string& err_path,
                                      bool keep_stdin) {
    auto child = std::unique_ptr<Child>(new Child());
    child->err_path_ = err_path;
    int in[2] = {-1, -1};
    int out[2];
    if (keep_stdin && ::pipe2(in, O_CLOEXEC) != 0) return nullptr;
    if (::pipe2(out, O_CLOEXEC) != 0) return nullptr;
    int err = ::open(err_path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC,
                     0600);
    int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (err < 0 || devnull < 0) return nullptr;
    // Everything the child needs is built before fork: after it, only
    // async-signal-safe calls (this process has gRPC threads).
    std::vector<std::string> args = argv;
    std::vector<std::string> envs = env;
    std::vector<char*> argp;
    for (std::string& a : args) argp.push_back(a.data());
    argp.push_back(nullptr);
    std::vector<char*> envp;
    for (std::string& e : envs) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = ::fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      ::dup2(keep_stdin ? in[0] : devnull, STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err, STDERR_FILENO);
      ::execve(argp[0], argp.data(), envp.data());
      ::_exit(127);
    }
    child->pid_ = pid;
    ::close(out[1]);
    ::close(err);
    ::close(devnull);
    child->out_ = out[0];
    if (keep_stdin) {
      ::close(in[0]);
      child->in_ = in[1];
    }
    return child;
  }

  ~Child() {
    CloseStdin();
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) ::close(out_);
  }

  pid_t pid() const { return pid_; }

  void CloseStdin() {
    if (in_ >= 0) ::close(in_);
    in_ = -1;
  }

  // Reads stdout until a newline (returned without it) or `timeout`.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      size_t nl = buffered_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffered_.substr(0, nl);
        buffered_.erase(0, nl + 1);
        return line;
      }
      absl::StatusOr<bool> more = ReadSome(deadline);
      if (!more.ok()) return more.status();
      if (!*more) {
        return absl::OutOfRangeError("mrctl closed stdout; stderr: " +
                                     ReadFile(err_path_));
      }
    }
  }

  // Waits for the child to exit and for stdout to end; kills it after
  // `timeout`.
  Result Finish(absl::Duration timeout = absl::Seconds(60)) {
    const absl::Time deadline = absl::Now() + timeout;
    Result r;
    while (true) {
      absl::StatusOr<bool> more = ReadSome(deadline);
      if (!more.ok()) {
        ADD_FAILURE() << "mrctl did not finish: " << more.status();
        ::kill(pid_, SIGKILL);
        break;
      }
      if (!*more) break;
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.out = std::move(buffered_);
    r.err = ReadFile(err_path_);
    return r;
  }

 private:
  Child() = default;

  // One read of stdout into buffered_: true if bytes came, false at EOF.
  absl::StatusOr<bool> ReadSome(absl::Time deadline) {
    while (true) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError("timed out reading mrctl's stdout");
      }
      pollfd p{out_, POLLIN, 0};
      int ready = ::poll(&p, 1,
                         static_cast<int>(absl::ToInt64Milliseconds(
                             std::min(left, absl::Seconds(1)))) +
                             1);
      if (ready < 0 && errno != EINTR) {
        return absl::ErrnoToStatus(errno, "poll");
      }
      if (ready <= 0) continue;
      char buf[4096];
      ssize_t n = ::read(out_, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return absl::ErrnoToStatus(errno, "read");
      if (n == 0) return false;
      buffered_.append(buf, static_cast<size_t>(n));
      return true;
    }
  }

  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string buffered_;
  std::string err_path_;
};

class MrctlTest : public MrdTest {
 protected:
  void TearDown() override {
    if (mrd_ != nullptr) {
      // Whatever a test left open is mrd's to release at shutdown; what must
      // not happen is memory still pinned by a command that has exited.
      EXPECT_TRUE(WaitForPinned(0)) << PinnedBytes();
    }
    MrdTest::TearDown();
  }

  // The child's environment: ours without MRD_SESSION/MRD_RUNTIME_DIR, then
  // MRD_RUNTIME_DIR=<mrd's> (unless `runtime_dir_env` is false) and
  // MRD_SESSION=session_ when set.
  std::vector<std::string> ChildEnv(bool runtime_dir_env = true) const {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (absl::StartsWith(*e, "MRD_SESSION=") ||
          absl::StartsWith(*e, "MRD_RUNTIME_DIR=")) {
        continue;
      }
      env.push_back(*e);
    }
    if (runtime_dir_env)
      env.push_back("MRD_RUNTIME_DIR=" + mrd_->runtime_dir());
    if (!session_.empty()) env.push_back("MRD_SESSION=" + session_);
    return env;
  }

  std::string ErrPath() {
    return absl::StrCat(mrd_->runtime_dir(), "/mrctl-", ++children_, ".err");
  }

  Result Mrctl(std::vector<std::string> args, bool runtime_dir_env = true) {
    args.insert(args.begin(), MRCTL_BINARY);
    std::unique_ptr<Child> child =
        Child::Start(args, ChildEnv(runtime_dir_env), ErrPath(), false);
    if (child == nullptr) {
      ADD_FAILURE() << "cannot start mrctl: " << std::strerror(errno);
      return {};
    }
    return child->Finish();
  }

  // A long-running mrctl (hold, completions) with its stdin held open.
  std::unique_ptr<Child> Spawn(std::vector<std::string> args) {
    args.insert(args.begin(), MRCTL_BINARY);
    std::unique_ptr<Child> child =
        Child::Start(args, ChildEnv(), ErrPath(), true);
    EXPECT_NE(child, nullptr) << std::strerror(errno);
    return child;
  }

  // `mrctl lease open -q`; its token becomes MRD_SESSION of later commands.
  void OpenLease(const std::string& ttl = "") {
    std::vector<std::string> args = {"lease", "open", "-q"};
    if (!ttl.empty()) args.push_back("--ttl=" + ttl);
    Result r = Mrctl(args);
    ASSERT_EQ(r.code, kExitOk) << r;
    ASSERT_TRUE(absl::EndsWith(r.out, "\n")) << r;
    session_ = std::string(absl::StripSuffix(r.out, "\n"));
    ASSERT_FALSE(session_.empty());
    ASSERT_EQ(session_.find('\n'), std::string::npos) << r;
    ASSERT_EQ(session_.find('='), std::string::npos) << r;
  }

  void CloseLease() {
    Result r = Mrctl({"lease", "close"});
    EXPECT_EQ(r.code, kExitOk) << r;
    session_.clear();
  }

  uint64_t PinnedBytes() {
    absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->pinned_bytes() : ~uint64_t{0};
  }

  // Bounded polling for mrd's asynchronous fd-session teardown.
  bool WaitForPinned(uint64_t bytes) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      if (PinnedBytes() == bytes) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return PinnedBytes() == bytes;
  }

  // What mrd says the session `token` holds.
  v1::ListRegistrationsResponse ListOf(const std::string& token) {
    absl::StatusOr<v1::ListRegistrationsResponse> list =
        client::Session::Attach(*client_, token).List();
    EXPECT_TRUE(list.ok()) << list.status();
    return list.ok() ? *list : v1::ListRegistrationsResponse();
  }

  std::string ShmPath(const std::string& name) const {
    return mrd_->shm_dir() + "/" + name;
  }

  std::string session_;
  int children_ = 0;
};

// ---- Device, health, help --------------------------------------------------

TEST_F(MrctlTest, InfoAndHealthInBothForms) {
  absl::StatusOr<v1::DeviceInfo> expected = client_->GetDeviceInfo();
  ASSERT_TRUE(expected.ok()) << expected.status();

  Result human = Mrctl({"info"});
  ASSERT_EQ(human.code, kExitOk) << human;
  EXPECT_EQ(human.err, "");
  auto f = Fields(human.out);
  EXPECT_EQ(f["name"], expected->name());
  EXPECT_EQ(f["kind"], "software");
  EXPECT_EQ(f["page_size"], "4096");
  EXPECT_EQ(f["peer_address"], expected->peer_address());
  EXPECT_EQ(f["healthy"], "true");
  EXPECT_EQ(f["pinned_bytes"], "0");

  Result json = Mrctl({"info", "--json"});
  ASSERT_EQ(json.code, kExitOk) << json;
  ASSERT_TRUE(absl::EndsWith(json.out, "}\n")) << json;
  EXPECT_EQ(json.out.find('\n'), json.out.size() - 1) << "one line";
  EXPECT_TRUE(absl::StrContains(json.out, "\"pageSize\":\"4096\"")) << json;
  v1::DeviceInfo parsed = FromJson<v1::DeviceInfo>(json.out);
  EXPECT_EQ(parsed.peer_address(), expected->peer_address());
  EXPECT_EQ(parsed.name(), expected->name());

  Result health = Mrctl({"health"});
  EXPECT_EQ(health.code, kExitOk) << health;
  EXPECT_EQ(health.out, "status=SERVING\n");
  Result health_json = Mrctl({"health", "--json"});
  EXPECT_EQ(health_json.code, kExitOk) << health_json;
  EXPECT_EQ(health_json.out, "{\"status\":\"SERVING\"}\n");
  Result unknown = Mrctl({"health", "--service=no.such.Service"});
  EXPECT_EQ(unknown.code, kExitNotFound) << unknown;
  EXPECT_TRUE(absl::StartsWith(unknown.err, "mrctl: NOT_FOUND ")) << unknown;
}

TEST_F(MrctlTest, HelpAndUsage) {
  Result help = Mrctl({"help"});
  EXPECT_EQ(help.code, kExitOk) << help;
  EXPECT_TRUE(absl::StrContains(help.out, "lease open")) << help;
  EXPECT_TRUE(absl::StrContains(help.out, "hold")) << help;
  Result hold_help = Mrctl({"hold", "--help"});
  EXPECT_EQ(hold_help.code, kExitOk) << hold_help;
  EXPECT_TRUE(absl::StrContains(hold_help.out, "--size")) << hold_help;
  Result none = Mrctl({});
  EXPECT_EQ(none.code, kExitUsage) << none;
  EXPECT_EQ(none.out, "");
  EXPECT_FALSE(none.err.empty());
}

// ---- Lease sessions, buffers, registrations --------------------------------

TEST_F(MrctlTest, LeaseOpenSessionAndClose) {
  Result open = Mrctl({"lease", "open", "--ttl=90s", "--json"});
  ASSERT_EQ(open.code, kExitOk) << open;
  v1::SessionInfo opened = FromJson<v1::SessionInfo>(open.out);
  EXPECT_TRUE(absl::StrContains(open.out, "\"ttlSeconds\":90")) << open;
  EXPECT_EQ(opened.kind(), "lease");
  ASSERT_FALSE(opened.session().empty());
  session_ = opened.session();

  Result info = Mrctl({"session"});
  ASSERT_EQ(info.code, kExitOk) << info;
  auto f = Fields(info.out);
  EXPECT_EQ(f["session"], session_);
  EXPECT_EQ(f["kind"], "lease");
  EXPECT_EQ(f["ttl_seconds"], "90");
  EXPECT_EQ(f["registrations"], "0");
  EXPECT_GT(ToU64(f["expires_unix_ms"]), 0u);
  Result info_json = Mrctl({"session", "--json"});
  ASSERT_EQ(info_json.code, kExitOk) << info_json;
  v1::SessionInfo described = FromJson<v1::SessionInfo>(info_json.out);
  EXPECT_EQ(described.session(), session_);
  EXPECT_EQ(described.ttl_seconds(), 90u);

  Result human_open = Mrctl({"lease", "open"});
  ASSERT_EQ(human_open.code, kExitOk) << human_open;
  auto hf = Fields(human_open.out);
  EXPECT_EQ(hf["kind"], "lease");
  EXPECT_EQ(hf["ttl_seconds"], "60");  // the server's default
  Result close_other =
      Mrctl({"lease", "close", "--json", "--session=" + hf["session"]});
  EXPECT_EQ(close_other.code, kExitOk) << close_other;
  EXPECT_EQ(close_other.out, "{}\n");

  Result closed = Mrctl({"lease", "close"});
  EXPECT_EQ(closed.code, kExitOk) << closed;
  EXPECT_EQ(closed.out, "");
  EXPECT_EQ(closed.err, "mrctl: session closed\n");
  Result quiet = Mrctl({"lease", "close", "-q"});  // already closed
  EXPECT_EQ(quiet.code, kExitPrecondition) << quiet;

  Result gone = Mrctl({"session"});
  EXPECT_EQ(gone.code, kExitPrecondition) << gone;
  EXPECT_EQ(gone.out, "");
  EXPECT_EQ(gone.err,
            "mrctl: FAILED_PRECONDITION WSAENOTCONN SESSION_NOT_CONNECTED: "
            "unknown, closed or expired session\n");
  session_.clear();
}

TEST_F(MrctlTest, LeaseImportRegisterListDeregisterRelease) {
  OpenLease();
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "data", "data", 16384).ok());
  Result imported = Mrctl({"import-file", "data", "--writable"});
  ASSERT_EQ(imported.code, kExitOk) << imported;
  auto bf = Fields(imported.out);
  const std::string buffer = bf["buffer"];
  ASSERT_FALSE(buffer.empty());
  EXPECT_EQ(bf["size"], "16384");
  EXPECT_EQ(bf["writable"], "true");
  EXPECT_EQ(bf["source"], "file:data");
  Result imported_json = Mrctl({"import-file", "data", "--json"});
  ASSERT_EQ(imported_json.code, kExitOk) << imported_json;
  v1::BufferInfo second = FromJson<v1::BufferInfo>(imported_json.out);
  EXPECT_FALSE(second.writable());
  EXPECT_NE(absl::StrCat(second.buffer()), buffer);

  Result reg = Mrctl({"register", "--buffer=" + buffer, "--length=4096",
                      "--flags=remote_read,remote_write"});
  ASSERT_EQ(reg.code, kExitOk) << reg;
  auto f = Fields(reg.out);
  EXPECT_EQ(f["references"], "1");
  EXPECT_EQ(f["cache_hit"], "false");
  EXPECT_EQ(f["length"], "4096");
  EXPECT_EQ(f["base_address"], bf["address"]);
  EXPECT_NE(ToU64(f["rkey"]), 0u);
  EXPECT_EQ(f["rdma_descriptor"].size(), 48u);  // 24 bytes in hex
  EXPECT_EQ(PinnedBytes(), 4096u);

  // The same range again (0x7 = remote_read|remote_write): a cache hit.
  Result again = Mrctl({"register", "--json", "--buffer=" + buffer,
                        "--length=4096", "--flags=0x7"});
  ASSERT_EQ(again.code, kExitOk) << again;
  EXPECT_TRUE(absl::StrContains(again.out, "\"cacheHit\":true")) << again;
  EXPECT_TRUE(absl::StrContains(again.out, "\"references\":2")) << again;
  v1::RegisterMrResponse hit = FromJson<v1::RegisterMrResponse>(again.out);
  EXPECT_EQ(absl::StrCat(hit.registration()), f["registration"]);
  EXPECT_EQ(absl::StrCat(hit.rkey()), f["rkey"]);

  // The peer path on it: --hex in, --json out; -q keeps stderr quiet.
  const std::string ticket = Fields(Mrctl({"peer-ticket"}).out)["ticket"];
  ASSERT_FALSE(ticket.empty());
  const std::vector<std::string> at = {
      "--ticket=" + ticket, "--rkey=" + f["rkey"], "--va=" + f["base_address"]};
  std::vector<std::string> write = {"peer", "write", "--json",
                                    "--hex=48656c6c6f"};
  write.insert(write.end(), at.begin(), at.end());
  Result written = Mrctl(write);
  ASSERT_EQ(written.code, kExitOk) << written;
  EXPECT_EQ(written.out, "{\"written\":\"5\"}\n");
  EXPECT_EQ(written.err, "");
  std::vector<std::string> quiet = {"peer", "write", "-q", "--data=!"};
  quiet.insert(quiet.end(), at.begin(), at.end());
  quiet.back() = absl::StrCat("--va=", ToU64(f["base_address"]) + 5);
  Result quiet_write = Mrctl(quiet);
  EXPECT_EQ(quiet_write.code, kExitOk) << quiet_write;
  EXPECT_EQ(quiet_write.out, "");
  EXPECT_EQ(quiet_write.err, "");
  std::vector<std::string> read = {"peer", "read", "--length=6"};
  read.insert(read.end(), at.begin(), at.end());
  Result read_back = Mrctl(read);
  ASSERT_EQ(read_back.code, kExitOk) << read_back;
  EXPECT_EQ(read_back.out, "Hello!");
  EXPECT_EQ(ReadFile(ShmPath("data")).substr(0, 8), "Hello!ta");

  Result list = Mrctl({"list"});
  ASSERT_EQ(list.code, kExitOk) << list;
  auto lf = Fields(list.out);
  EXPECT_EQ(lf["session.session"], session_);
  EXPECT_EQ(lf["registrations[0].references"], "2");
  EXPECT_EQ(lf["registrations[0].rkey"], f["rkey"]);
  EXPECT_EQ(lf["buffers[0].buffer"], buffer);
  EXPECT_EQ(lf.count("registrations[1].references"), 0u);
  Result list_json = Mrctl({"list", "--json"});
  ASSERT_EQ(list_json.code, kExitOk) << list_json;
  v1::ListRegistrationsResponse listed =
      FromJson<v1::ListRegistrationsResponse>(list_json.out);
  EXPECT_EQ(listed.buffers_size(), 2);
  ASSERT_EQ(listed.registrations_size(), 1);
  EXPECT_EQ(listed.registrations(0).references(), 2u);

  Result dereg = Mrctl({"deregister", "--registration=" + f["registration"]});
  ASSERT_EQ(dereg.code, kExitOk) << dereg;
  EXPECT_EQ(dereg.out, "references=1\n");
  EXPECT_EQ(ListOf(session_).registrations(0).references(), 1u);
  // Take the reference again, and give it back with --json.
  ASSERT_EQ(
      Mrctl({"register", "--buffer=" + buffer, "--length=4096", "--flags=0x7"})
          .code,
      kExitOk);
  Result dereg_json =
      Mrctl({"deregister", "--json", "--registration=" + f["registration"]});
  ASSERT_EQ(dereg_json.code, kExitOk) << dereg_json;
  EXPECT_EQ(dereg_json.out, "{\"references\":1}\n");

  Result released = Mrctl({"release-buffer", buffer});
  ASSERT_EQ(released.code, kExitOk) << released;
  auto rf = Fields(released.out);
  EXPECT_EQ(rf["invalidated_registrations"], "1");
  EXPECT_EQ(rf["released_lams"], "0");
  EXPECT_EQ(ListOf(session_).registrations_size(), 0);
  EXPECT_EQ(ListOf(session_).buffers_size(), 1);
  EXPECT_EQ(PinnedBytes(), 0u);
  Result released_json =
      Mrctl({"release-buffer", absl::StrCat(second.buffer()), "--json"});
  ASSERT_EQ(released_json.code, kExitOk) << released_json;
  EXPECT_EQ(released_json.out,
            "{\"invalidatedRegistrations\":0,\"releasedLams\":0}\n");
  CloseLease();
}

TEST_F(MrctlTest, RegisterBatchAndDeregisterBatch) {
  OpenLease();
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "batch", "b", 8 * 4096).ok());
  Result imported = Mrctl({"import-file", "batch"});
  ASSERT_EQ(imported.code, kExitOk) << imported;
  const std::string buffer = Fields(imported.out)["buffer"];

  Result reg =
      Mrctl({"register-batch", "--json", "--buffer=" + buffer, "--length=4K",
             "--count=4", "--stride=8K", "--flags=remote_read"});
  ASSERT_EQ(reg.code, kExitOk) << reg;
  v1::RegisterMrBatchResponse batch =
      FromJson<v1::RegisterMrBatchResponse>(reg.out);
  ASSERT_EQ(batch.items_size(), 4);
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(batch.items(i).status().code(), 0);
    EXPECT_EQ(batch.items(i).registration().length(), 4096u);
    ids.push_back(absl::StrCat(batch.items(i).registration().registration()));
  }
  EXPECT_EQ(ListOf(session_).registrations_size(), 4);
  EXPECT_EQ(PinnedBytes(), 4 * 4096u);

  // The fourth range runs past the buffer: its item fails, the exit status
  // is that failure's, and the three before it are registered.
  Result partly = Mrctl({"register-batch", "--buffer=" + buffer, "--offset=4K",
                         "--length=8K", "--count=4", "--stride=8K"});
  EXPECT_EQ(partly.code, kExitFailed) << partly;
  EXPECT_TRUE(absl::StrContains(partly.err, "item 3:")) << partly;
  EXPECT_EQ(ListOf(session_).registrations_size(), 7);

  Result dereg =
      Mrctl({"deregister-batch", "--json",
             "--registrations=" + absl::StrJoin(ids, ",") + ",999999"});
  EXPECT_EQ(dereg.code, kExitNotFound) << dereg;
  v1::DeregisterMrBatchResponse left =
      FromJson<v1::DeregisterMrBatchResponse>(dereg.out);
  ASSERT_EQ(left.items_size(), 5);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(left.items(i).status().code(), 0);
    EXPECT_EQ(left.items(i).references(), 0u);
  }
  EXPECT_EQ(left.items(4).status().detail().reason(), "UNKNOWN_REGISTRATION");
  EXPECT_EQ(ListOf(session_).registrations_size(), 3);
  CloseLease();
  EXPECT_EQ(PinnedBytes(), 0u);
}

TEST_F(MrctlTest, SizesTakeUnits) {
  OpenLease();
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "units", "units", 16384).ok());
  Result imported = Mrctl({"import-file", "units", "--writable"});
  ASSERT_EQ(imported.code, kExitOk) << imported;
  const std::string buffer = Fields(imported.out)["buffer"];
  Result reg =
      Mrctl({"register", "--buffer=" + buffer, "--offset=4K", "--length=8KiB"});
  ASSERT_EQ(reg.code, kExitOk) << reg;
  auto f = Fields(reg.out);
  EXPECT_EQ(f["length"], "8192");
  EXPECT_EQ(ToU64(f["base_address"]),
            ToU64(Fields(imported.out)["address"]) + 4096);
  Result bad = Mrctl({"register", "--buffer=" + buffer, "--length=8Q"});
  EXPECT_EQ(bad.code, kExitUsage) << bad;
  EXPECT_TRUE(absl::StrContains(bad.err, "--length: '8Q' is not a size"))
      << bad;
  CloseLease();
}

TEST_F(MrctlTest, ErrorsPrintCodeSeedReasonAndRequiredSize) {
  OpenLease();
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "data", "x", 8192).ok());
  Result imported = Mrctl({"import-file", "data"});
  ASSERT_EQ(imported.code, kExitOk) << imported;
  const std::string buffer = Fields(imported.out)["buffer"];

  Result zero = Mrctl({"register", "--buffer=" + buffer, "--length=0"});
  EXPECT_EQ(zero.code, kExitFailed) << zero;
  EXPECT_EQ(zero.out, "");
  EXPECT_EQ(zero.err,
            "mrctl: INVALID_ARGUMENT STATUS_INVALID_PARAMETER ZERO_LENGTH: "
            "length is 0 (offset 0)\n");

  Result small =
      Mrctl({"register", "--buffer=" + buffer, "--length=8", "--capacity=8"});
  EXPECT_EQ(small.code, kExitFailed) << small;
  EXPECT_EQ(small.out, "");
  EXPECT_TRUE(absl::StartsWith(
      small.err, "mrctl: OUT_OF_RANGE WSAEFAULT DESCRIPTOR_SPACE_TOO_SMALL: "))
      << small;
  EXPECT_TRUE(absl::EndsWith(small.err, " (required_size=24)\n")) << small;

  Result lam = Mrctl(
      {"build-lam", "--buffer=" + buffer, "--length=8192", "--capacity=8"});
  EXPECT_EQ(lam.code, kExitFailed) << lam;
  EXPECT_TRUE(absl::StartsWith(
      lam.err,
      "mrctl: OUT_OF_RANGE STATUS_BUFFER_TOO_SMALL LAM_SPACE_TOO_SMALL: "))
      << lam;
  EXPECT_TRUE(absl::EndsWith(lam.err, " (required_size=24)\n")) << lam;

  // Numeric flags pass through unchecked: the server refuses unknown NDK
  // bits (R3), and unknown MEM bits or both forms with WSAEINVAL (W3, W6).
  Result bits =
      Mrctl({"register", "--buffer=" + buffer, "--length=8", "--flags=0x100"});
  EXPECT_EQ(bits.code, kExitFailed) << bits;
  EXPECT_TRUE(absl::StartsWith(
      bits.err,
      "mrctl: INVALID_ARGUMENT STATUS_INVALID_PARAMETER UNKNOWN_FLAGS: "))
      << bits;
  Result mem =
      Mrctl({"register", "--buffer=" + buffer, "--length=8", "--mem=0x100"});
  EXPECT_EQ(mem.code, kExitFailed) << mem;
  EXPECT_TRUE(absl::StartsWith(
      mem.err, "mrctl: INVALID_ARGUMENT WSAEINVAL UNKNOWN_MEM_FLAGS: "))
      << mem;
  Result both = Mrctl({"register", "--buffer=" + buffer, "--length=8",
                       "--flags=remote_read", "--mem=read"});
  EXPECT_EQ(both.code, kExitFailed) << both;
  EXPECT_TRUE(absl::StartsWith(
      both.err, "mrctl: INVALID_ARGUMENT WSAEINVAL BOTH_FLAG_FORMS: "))
      << both;
  // Nothing was left registered by the failures.
  EXPECT_EQ(ListOf(session_).registrations_size(), 0);
  CloseLease();
}

// One provoked failure per exit code of the table.
TEST_F(MrctlTest, ExitCodeTable) {
  // 1: mrctl's own command line.
  Result unknown = Mrctl({"frobnicate"});
  EXPECT_EQ(unknown.code, kExitUsage) << unknown;
  EXPECT_TRUE(absl::StartsWith(unknown.err, "mrctl: ")) << unknown;
  Result no_session = Mrctl({"session"});
  EXPECT_EQ(no_session.code, kExitUsage) << no_session;
  EXPECT_TRUE(
      absl::StartsWith(no_session.err, "mrctl: 'session' needs a session"))
      << no_session;
  OpenLease();
  Result both = Mrctl({"deregister", "--registration=1", "--mr=2"});
  EXPECT_EQ(both.code, kExitUsage) << both;
  EXPECT_EQ(both.err,
            "mrctl: give exactly one of --registration and --mr\n"
            "(see mrctl help deregister)\n");
  Result neither = Mrctl({"publish", "weights.0"});
  EXPECT_EQ(neither.code, kExitUsage) << neither;
  EXPECT_EQ(neither.err,
            "mrctl: give exactly one of --registration and --mr\n"
            "(see mrctl help publish)\n");
  EXPECT_EQ(Mrctl({"release-buffer", "x"}).code, kExitUsage);
  EXPECT_EQ(Mrctl({"register", "--length=1"}).code, kExitUsage);
  EXPECT_EQ(
      Mrctl({"register", "--buffer=1", "--length=1", "--flags=nope"}).code,
      kExitUsage);

  // 2: the RPC failed (INVALID_ARGUMENT).
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "data", "x", 4096).ok());
  const std::string buffer =
      Fields(Mrctl({"import-file", "data"}).out)["buffer"];
  EXPECT_EQ(Mrctl({"register", "--buffer=" + buffer, "--length=0"}).code,
            kExitFailed);
  Result bad_path = Mrctl({"import-file", "../etc/passwd"});
  EXPECT_EQ(bad_path.code, kExitFailed) << bad_path;
  EXPECT_TRUE(absl::StartsWith(
      bad_path.err,
      "mrctl: INVALID_ARGUMENT STATUS_INVALID_PARAMETER BAD_PATH"))
      << bad_path;

  // 3: NOT_FOUND.
  Result missing = Mrctl({"release-buffer", "999"});
  EXPECT_EQ(missing.code, kExitNotFound) << missing;
  EXPECT_TRUE(absl::StartsWith(
      missing.err, "mrctl: NOT_FOUND SEED_STATUS_UNSPECIFIED UNKNOWN_BUFFER: "))
      << missing;
  Result no_file = Mrctl({"import-file", "nope"});
  EXPECT_EQ(no_file.code, kExitNotFound) << no_file;
  EXPECT_TRUE(absl::StartsWith(
      no_file.err, "mrctl: NOT_FOUND SEED_STATUS_UNSPECIFIED NO_SUCH_FILE: "))
      << no_file;

  // 6: DEADLINE_EXCEEDED (before any peer connects: no completion yet).
  Result late = Mrctl({"completions", "--count=1", "--timeout=200ms"});
  EXPECT_EQ(late.code, kExitUnavailable) << late;
  EXPECT_EQ(late.err,
            "mrctl: DEADLINE_EXCEEDED SEED_STATUS_UNSPECIFIED -: got 0 of 1 "
            "completions before the timeout\n");

  // 4: the peer path refuses (UNAUTHENTICATED, PERMISSION_DENIED).
  Result bad_ticket = Mrctl(
      {"peer", "read", "--ticket=bad", "--rkey=1", "--va=1", "--length=1"});
  EXPECT_EQ(bad_ticket.code, kExitDenied) << bad_ticket;
  EXPECT_TRUE(absl::StartsWith(
      bad_ticket.err,
      "mrctl: UNAUTHENTICATED SEED_STATUS_UNSPECIFIED BAD_TICKET: "))
      << bad_ticket;
  Result bad_kind = Mrctl({"peer", "read", "--kind=ethernet", "--ticket=t",
                           "--rkey=1", "--va=1", "--length=1"});
  EXPECT_EQ(bad_kind.code, kExitUsage) << bad_kind;
  EXPECT_NE(bad_kind.err.find("--kind must be software or verbs, not "
                              "'ethernet'"),
            std::string::npos)
      << bad_kind;
  const std::string ticket = Fields(Mrctl({"peer-ticket"}).out)["ticket"];
  Result bad_key = Mrctl({"peer", "read", "--ticket=" + ticket, "--rkey=1",
                          "--va=1", "--length=1"});
  EXPECT_EQ(bad_key.code, kExitDenied) << bad_key;
  EXPECT_TRUE(
      absl::StartsWith(bad_key.err,
                       "mrctl: PERMISSION_DENIED SEED_STATUS_UNSPECIFIED "
                       "REMOTE_ACCESS_ERROR: "))
      << bad_key;

  // 6: UNAVAILABLE (nobody listens).
  Result down = Mrctl({"info", "--socket=" + mrd_->runtime_dir() + "/x.sock"});
  EXPECT_EQ(down.code, kExitUnavailable) << down;
  EXPECT_TRUE(absl::StartsWith(
      down.err, "mrctl: UNAVAILABLE SEED_STATUS_UNSPECIFIED CANNOT_CONNECT: "))
      << down;

  // 7: FAILED_PRECONDITION (an unknown session).
  Result stale = Mrctl({"session", "--session=gone"});
  EXPECT_EQ(stale.code, kExitPrecondition) << stale;
  EXPECT_TRUE(
      absl::StartsWith(stale.err, "mrctl: FAILED_PRECONDITION WSAENOTCONN "))
      << stale;
  CloseLease();
}

// 5: RESOURCE_EXHAUSTED needs a server limit.
class MrctlLimitsTest : public MrctlTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {"--max_session_registrations=1"};
    return o;
  }
};

TEST_F(MrctlLimitsTest, ALimitExitsFive) {
  OpenLease();
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "data", "x", 8192).ok());
  const std::string buffer =
      Fields(Mrctl({"import-file", "data"}).out)["buffer"];
  Result first = Mrctl({"register", "--buffer=" + buffer, "--length=4096"});
  ASSERT_EQ(first.code, kExitOk) << first;
  Result second = Mrctl(
      {"register", "--buffer=" + buffer, "--offset=4096", "--length=4096"});
  EXPECT_EQ(second.code, kExitExhausted) << second;
  EXPECT_EQ(second.out, "");
  EXPECT_TRUE(absl::StartsWith(second.err, "mrctl: RESOURCE_EXHAUSTED "))
      << second;
  CloseLease();
}

// ---- MR objects, LAMs, fast registration, completions ---------------------

TEST_F(MrctlTest, FastRegisterInvalidateAndCompletions) {
  OpenLease();
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "d", "0123456789", 3 * 4096).ok());
  const std::string buffer = Fields(Mrctl({"import-file", "d"}).out)["buffer"];
  ASSERT_FALSE(buffer.empty());

  // A peer that stays connected gives the connection (queue pair) id.
  Result ticket = Mrctl({"peer-ticket", "--json"});
  ASSERT_EQ(ticket.code, kExitOk) << ticket;
  v1::PeerTicket t = FromJson<v1::PeerTicket>(ticket.out);
  auto peer = peer::SoftPeer::Connect(t.peer_address(), t.ticket());
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::string connection = absl::StrCat((*peer)->connection_id());
  Result connected = Mrctl({"completions", "--count=1", "--timeout=10s"});
  ASSERT_EQ(connected.code, kExitOk) << connected;
  auto cf = Fields(connected.out);
  EXPECT_EQ(cf["kind"], "PEER_CONNECTED");
  EXPECT_EQ(cf["connection"], connection);

  Result mr = Mrctl({"create-mr", "--fast-register", "--allow-remote"});
  ASSERT_EQ(mr.code, kExitOk) << mr;
  auto mf = Fields(mr.out);
  const std::string mr_id = mf["mr"];
  EXPECT_EQ(mf["fast_register"], "true");
  EXPECT_EQ(mf["allow_remote_access"], "true");
  EXPECT_EQ(mf["state"], "free");

  Result mr_json = Mrctl({"create-mr", "--json"});
  ASSERT_EQ(mr_json.code, kExitOk) << mr_json;
  v1::MrInfo normal = FromJson<v1::MrInfo>(mr_json.out);
  EXPECT_FALSE(normal.fast_register());
  EXPECT_EQ(normal.state(), "free");
  Result closed_normal = Mrctl({"close-mr", absl::StrCat(normal.mr())});
  EXPECT_EQ(closed_normal.code, kExitOk) << closed_normal;
  EXPECT_EQ(closed_normal.out, "");

  Result lam_json =
      Mrctl({"build-lam", "--json", "--buffer=" + buffer, "--length=100"});
  ASSERT_EQ(lam_json.code, kExitOk) << lam_json;
  v1::BuildLamResponse one_page = FromJson<v1::BuildLamResponse>(lam_json.out);
  EXPECT_EQ(one_page.pages_size(), 1);
  EXPECT_EQ(one_page.lam_size(), 16u);
  Result released_lam =
      Mrctl({"release-lam", absl::StrCat(one_page.lam()), "--json"});
  EXPECT_EQ(released_lam.code, kExitOk) << released_lam;
  EXPECT_EQ(released_lam.out, "{}\n");

  Result lam = Mrctl(
      {"build-lam", "--buffer=" + buffer, "--offset=10", "--length=8192"});
  ASSERT_EQ(lam.code, kExitOk) << lam;
  auto lf = Fields(lam.out);
  EXPECT_EQ(lf["fbo"], "10");
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(lf["pages"], ',')).size(),
            3u);
  EXPECT_EQ(lf["lam_size"], "32");

  Result fr = Mrctl({"fast-register", "--json", "--connection=" + connection,
                     "--mr=" + mr_id, "--pages=" + lf["pages"], "--fbo=10",
                     "--length=8192", "--base=0x10000000a",
                     "--flags=remote_read", "--context=42"});
  ASSERT_EQ(fr.code, kExitOk) << fr;
  const std::string work_request =
      absl::StrCat(FromJson<v1::FastRegisterResponse>(fr.out).work_request());
  EXPECT_NE(work_request, "0");

  Result done = Mrctl({"completions", "--count=1", "--json", "--timeout=10s"});
  ASSERT_EQ(done.code, kExitOk) << done;
  EXPECT_TRUE(absl::StrContains(done.out, "\"kind\":\"FAST_REGISTER\""))
      << done;
  EXPECT_TRUE(absl::StrContains(done.out, "\"requestContext\":\"42\"")) << done;
  v1::Completion c = FromJson<v1::Completion>(done.out);
  EXPECT_EQ(c.status(), ::mrd::STATUS_SUCCESS) << c.message();
  EXPECT_EQ(absl::StrCat(c.work_request()), work_request);
  ASSERT_NE(c.rkey(), 0u);
  // The new token reads the buffer from offset 10 on.
  absl::StatusOr<std::string> read = (*peer)->Read(c.rkey(), 0x10000000a, 5);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "01234");

  Result inv = Mrctl({"invalidate", "--connection=" + connection,
                      "--mr=" + mr_id, "--context=43"});
  ASSERT_EQ(inv.code, kExitOk) << inv;
  EXPECT_NE(ToU64(Fields(inv.out)["work_request"]), 0u);
  Result invalidated = Mrctl({"completions", "--count=1", "--timeout=10s"});
  ASSERT_EQ(invalidated.code, kExitOk) << invalidated;
  auto inf = Fields(invalidated.out);
  EXPECT_EQ(inf["kind"], "INVALIDATE");
  EXPECT_EQ(inf["request_context"], "43");
  EXPECT_EQ(inf["status"], "STATUS_SUCCESS");

  // Nothing pending: --count not reached is exit 6; a plain wait is exit 0.
  Result none = Mrctl({"completions", "--count=1", "--timeout=200ms"});
  EXPECT_EQ(none.code, kExitUnavailable) << none;
  Result idle = Mrctl({"completions", "--timeout=100ms"});
  EXPECT_EQ(idle.code, kExitOk) << idle;
  EXPECT_EQ(idle.out, "");

  // Replies without content print nothing, or {} with --json.
  Result rl = Mrctl({"release-lam", lf["lam"]});
  EXPECT_EQ(rl.code, kExitOk) << rl;
  EXPECT_EQ(rl.out, "");
  Result cm = Mrctl({"close-mr", mr_id, "--json"});
  EXPECT_EQ(cm.code, kExitOk) << cm;
  EXPECT_EQ(cm.out, "{}\n");
  v1::ListRegistrationsResponse list = ListOf(session_);
  EXPECT_EQ(list.mrs_size(), 0);
  EXPECT_EQ(list.lams_size(), 0);
  EXPECT_EQ(Mrctl({"close-mr", mr_id}).code, kExitNotFound);
  CloseLease();
}

TEST_F(MrctlTest, CompletionsInKeyValueFormAreSeparatedByABlankLine) {
  OpenLease();
  Result ticket = Mrctl({"peer-ticket"});
  ASSERT_EQ(ticket.code, kExitOk) << ticket;
  auto tf = Fields(ticket.out);
  auto first = peer::SoftPeer::Connect(tf["peer_address"], tf["ticket"]);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = peer::SoftPeer::Connect(tf["peer_address"], tf["ticket"]);
  ASSERT_TRUE(second.ok()) << second.status();
  Result two = Mrctl({"completions", "--count=2", "--timeout=10s"});
  ASSERT_EQ(two.code, kExitOk) << two;
  std::vector<std::string> blocks = absl::StrSplit(two.out, "\n\n");
  ASSERT_EQ(blocks.size(), 2u) << two;
  EXPECT_EQ(Fields(blocks[0])["kind"], "PEER_CONNECTED");
  EXPECT_EQ(Fields(blocks[0])["connection"],
            absl::StrCat((*first)->connection_id()));
  EXPECT_EQ(Fields(blocks[1])["connection"],
            absl::StrCat((*second)->connection_id()));
  CloseLease();
}

TEST_F(MrctlTest, CompletionsEndWithTheSession) {
  OpenLease();
  std::unique_ptr<Child> waiting =
      Spawn({"completions", "--count=2", "--json"});
  ASSERT_NE(waiting, nullptr);
  // Once it printed the first completion its stream is surely open.
  Result ticket = Mrctl({"peer-ticket"});
  ASSERT_EQ(ticket.code, kExitOk) << ticket;
  auto tf = Fields(ticket.out);
  auto peer = peer::SoftPeer::Connect(tf["peer_address"], tf["ticket"]);
  ASSERT_TRUE(peer.ok()) << peer.status();
  absl::StatusOr<std::string> first = waiting->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(FromJson<v1::Completion>(*first).kind(),
            v1::Completion::PEER_CONNECTED);
  // The session ends before --count is reached: exit 7.
  CloseLease();
  Result r = waiting->Finish();
  EXPECT_EQ(r.code, kExitPrecondition) << r;
  EXPECT_EQ(r.err,
            "mrctl: FAILED_PRECONDITION SEED_STATUS_UNSPECIFIED -: the session "
            "ended after 1 of 2 completions\n");
}

// ---- hold: the fd-session path -------------------------------------------

TEST_F(MrctlTest, HoldRegistersAMemfdUntilStdinCloses) {
  std::unique_ptr<Child> hold = Spawn({"hold", "--size=65536", "--fill=hello",
                                       "--flags=remote_read", "--json"});
  ASSERT_NE(hold, nullptr);
  absl::StatusOr<std::string> line = hold->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  google::protobuf::Struct held = FromJson<google::protobuf::Struct>(*line);
  v1::SessionInfo session = Member<v1::SessionInfo>(held, "session");
  v1::BufferInfo buffer = Member<v1::BufferInfo>(held, "buffer");
  v1::RegisterMrResponse reg =
      Member<v1::RegisterMrResponse>(held, "registration");
  EXPECT_EQ(held.fields_size(), 3);
  EXPECT_EQ(session.kind(), "fd");
  EXPECT_EQ(session.peer_uid(), ::getuid());
  EXPECT_EQ(session.peer_pid(), static_cast<uint32_t>(hold->pid()));
  EXPECT_EQ(buffer.source(), "memfd");
  EXPECT_EQ(buffer.size(), 65536u);
  EXPECT_FALSE(buffer.writable());  // remote_read needs no write access
  EXPECT_EQ(reg.length(), 65536u);
  EXPECT_EQ(reg.references(), 1u);
  EXPECT_EQ(reg.base_address(), buffer.address());
  ASSERT_FALSE(session.session().empty());

  // While hold runs: pinned in mrd, listed in its session.
  EXPECT_EQ(PinnedBytes(), 65536u);
  v1::ListRegistrationsResponse list = ListOf(session.session());
  ASSERT_EQ(list.registrations_size(), 1);
  EXPECT_EQ(list.registrations(0).rkey(), reg.rkey());
  ASSERT_EQ(list.buffers_size(), 1);
  EXPECT_EQ(list.buffers(0).source(), "memfd");

  // A peer reads the fill through the fd session's ticket.
  Result ticket = Mrctl({"--session=" + session.session(), "peer-ticket"});
  ASSERT_EQ(ticket.code, kExitOk) << ticket;
  const std::string t = Fields(ticket.out)["ticket"];
  Result read = Mrctl(
      {"peer", "read", "--ticket=" + t, absl::StrCat("--rkey=", reg.rkey()),
       absl::StrCat("--va=", reg.base_address()), "--length=5"});
  ASSERT_EQ(read.code, kExitOk) << read;
  EXPECT_EQ(read.out, "hello");
  // Only the start was filled (no --repeat).
  Result tail = Mrctl(
      {"peer", "read", "--ticket=" + t, absl::StrCat("--rkey=", reg.rkey()),
       absl::StrCat("--va=", reg.base_address() + 5), "--length=3", "--hex"});
  ASSERT_EQ(tail.code, kExitOk) << tail;
  EXPECT_EQ(tail.out, "000000\n");
  Result read_json =
      Mrctl({"peer", "read", "--json", "--ticket=" + t,
             absl::StrCat("--rkey=", reg.rkey()),
             absl::StrCat("--va=", reg.base_address()), "--length=5"});
  ASSERT_EQ(read_json.code, kExitOk) << read_json;
  EXPECT_EQ(read_json.out, "{\"data\":\"aGVsbG8=\",\"length\":\"5\"}\n");
  // Registered for remote read only: a write is refused.
  Result write = Mrctl({"peer", "write", "--ticket=" + t,
                        absl::StrCat("--rkey=", reg.rkey()),
                        absl::StrCat("--va=", reg.base_address()), "--data=x"});
  EXPECT_EQ(write.code, kExitDenied) << write;

  hold->CloseStdin();
  Result r = hold->Finish();
  EXPECT_EQ(r.code, kExitOk) << r;
  EXPECT_EQ(r.out, "");  // the JSON line was read above
  EXPECT_TRUE(absl::StrContains(r.err, "mrctl: holding rkey=")) << r;
  EXPECT_TRUE(absl::StrContains(r.err, "stdin closed, releasing")) << r;
  EXPECT_TRUE(WaitForPinned(0)) << PinnedBytes();
  Result after = Mrctl({"--session=" + session.session(), "session"});
  EXPECT_EQ(after.code, kExitPrecondition) << after;
}

// --until-written: the hold ends when a peer's WRITE lands, and says what
// it saw (the workload's side of a remote write).
TEST_F(MrctlTest, HoldUntilWrittenEndsWhenAPeerWrites) {
  std::unique_ptr<Child> hold =
      Spawn({"hold", "--size=4096", "--fill=empty",
             "--flags=remote_read,remote_write", "--until-written=PEER!"});
  ASSERT_NE(hold, nullptr);
  std::map<std::string, std::string> f;
  while (f.count("registration.base_address") == 0) {
    absl::StatusOr<std::string> line = hold->ReadLine(absl::Seconds(30));
    ASSERT_TRUE(line.ok()) << line.status();
    auto more = Fields(*line + "\n");
    f.insert(more.begin(), more.end());
  }
  Result ticket = Mrctl({"--session=" + f["session.session"], "peer-ticket"});
  ASSERT_EQ(ticket.code, kExitOk) << ticket;
  Result wrote =
      Mrctl({"peer", "write", "--ticket=" + Fields(ticket.out)["ticket"],
             "--rkey=" + f["registration.rkey"],
             "--va=" + f["registration.base_address"], "--data=PEER!"});
  ASSERT_EQ(wrote.code, kExitOk) << wrote;
  Result r = hold->Finish();
  EXPECT_EQ(r.code, kExitOk) << r;
  EXPECT_TRUE(absl::StrContains(r.out, "written=PEER!\n")) << r;
  EXPECT_TRUE(WaitForPinned(0)) << PinnedBytes();
}

TEST_F(MrctlTest, HoldInKeyValueFormReleasesAfterItsDuration) {
  std::unique_ptr<Child> hold =
      Spawn({"hold", "--size=8192", "--fill=ab", "--repeat",
             "--flags=remote_read,remote_write", "--duration=300ms"});
  ASSERT_NE(hold, nullptr);
  // stdin stays open: only --duration ends it.
  Result r = hold->Finish();
  EXPECT_EQ(r.code, kExitOk) << r;
  auto f = Fields(r.out);
  EXPECT_EQ(f["session.kind"], "fd");
  EXPECT_EQ(f["buffer.source"], "memfd");
  EXPECT_EQ(f["buffer.size"], "8192");
  EXPECT_EQ(f["buffer.writable"], "true");  // remote_write needs it
  EXPECT_EQ(f["registration.references"], "1");
  EXPECT_EQ(f["registration.length"], "8192");
  EXPECT_TRUE(absl::StrContains(r.err, "--duration passed, releasing")) << r;
  EXPECT_TRUE(WaitForPinned(0)) << PinnedBytes();
}

// --progress (issue 9, part 3): mrd reports early and often here, and one
// thread prefaults, so a 1 GiB registration reports many times.
class MrctlProgressTest : public MrctlTest {
 protected:
  MrdProcessOptions ServerOptions() override { return EagerProgressOptions(); }
};

TEST_F(MrctlProgressTest, RegisterAndBuildLamShowProgressOnStderr) {
  OpenLease();
  ASSERT_TRUE(
      WriteShmFile(mrd_->shm_dir(), "big", "x", uint64_t{1} << 30).ok());
  const std::string buffer =
      Fields(Mrctl({"import-file", "big"}).out)["buffer"];
  Result r = Mrctl({"register", "--buffer=" + buffer, "--length=1G",
                    "--flags=remote_read", "--progress"});
  ASSERT_EQ(r.code, kExitOk) << r;
  EXPECT_EQ(Fields(r.out)["length"], "1073741824");
  EXPECT_TRUE(
      absl::StrContains(r.err, absl::StrCat("mrctl: buffer ", buffer, " +0: ")))
      << r;
  EXPECT_TRUE(absl::StrContains(r.err, " MiB of 1024.0 MiB pinned, ")) << r;
  // build-lam the same way.
  Result lam =
      Mrctl({"build-lam", "--buffer=" + buffer, "--length=1G", "--progress"});
  ASSERT_EQ(lam.code, kExitOk) << lam;
  EXPECT_TRUE(absl::StrContains(lam.err, " MiB of 1024.0 MiB pinned, ")) << lam;
  CloseLease();
}

// A deadline that passes while mrd pins cancels the registration: mrctl
// fails with DEADLINE_EXCEEDED and nothing stays pinned.
TEST_F(MrctlProgressTest, HoldWhoseDeadlinePassesWhilePinningLeavesNothing) {
  Result r = Mrctl({"--timeout=300ms", "hold", "--size=1G",
                    "--flags=remote_read", "--progress", "--duration=0s"});
  EXPECT_NE(r.code, kExitOk) << r;
  EXPECT_TRUE(absl::StrContains(r.err, "DEADLINE_EXCEEDED")) << r;
  EXPECT_TRUE(absl::StrContains(r.err, " MiB of 1024.0 MiB pinned, ")) << r;
  EXPECT_TRUE(WaitForPinned(0)) << PinnedBytes();
}

TEST_F(MrctlTest, HoldReleasesOnSigterm) {
  std::unique_ptr<Child> hold =
      Spawn({"hold", "--size=4096", "--flags=remote_read", "--json", "-q"});
  ASSERT_NE(hold, nullptr);
  absl::StatusOr<std::string> line = hold->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(PinnedBytes(), 4096u);
  ASSERT_EQ(::kill(hold->pid(), SIGTERM), 0);
  Result r = hold->Finish();
  EXPECT_EQ(r.code, kExitOk) << r;
  EXPECT_TRUE(absl::StrContains(r.err, "terminated, releasing")) << r;
  EXPECT_FALSE(absl::StrContains(r.err, "holding rkey")) << r;  // -q
  EXPECT_TRUE(WaitForPinned(0)) << PinnedBytes();
}

TEST_F(MrctlTest, HoldWithStdinAtEndOfFileReturnsAtOnce) {
  // Mrctl() gives the child /dev/null as stdin.
  Result r = Mrctl({"hold", "--size=4096", "--fill=x"});
  EXPECT_EQ(r.code, kExitOk) << r;
  EXPECT_EQ(Fields(r.out)["registration.references"], "1");
  EXPECT_TRUE(absl::StrContains(r.err, "stdin closed, releasing")) << r;
  EXPECT_TRUE(WaitForPinned(0)) << PinnedBytes();
}

TEST_F(MrctlTest, HoldExitsSevenWhenMrdEndsTheSession) {
  std::unique_ptr<Child> hold =
      Spawn({"hold", "--size=4096", "--flags=remote_read", "--json"});
  ASSERT_NE(hold, nullptr);
  absl::StatusOr<std::string> line = hold->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  // mrd shuts down (and Stop checks it left nothing pinned). Our own idle
  // channel goes first: mrd's shutdown would wait out its grace for it.
  client_.reset();
  absl::Status stopped = mrd_->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped;
  Result r = hold->Finish();
  EXPECT_EQ(r.code, kExitPrecondition) << r;
  EXPECT_TRUE(absl::StrContains(r.err,
                                "mrctl: FAILED_PRECONDITION WSAENOTCONN "
                                "SESSION_ENDED: mrd ended the fd session\n"))
      << r;
  mrd_.reset();
}

// mrd.proto: an fd session lives exactly as long as its socket connection,
// and hold exits 7 when mrd ends its session. Ending it by its token from
// another mrctl must therefore reach hold.
TEST_F(MrctlTest, HoldExitsSevenWhenItsSessionIsClosedElsewhere) {
  std::unique_ptr<Child> hold =
      Spawn({"hold", "--size=4096", "--flags=remote_read", "--json"});
  ASSERT_NE(hold, nullptr);
  absl::StatusOr<std::string> line = hold->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  const std::string token =
      Member<v1::SessionInfo>(FromJson<google::protobuf::Struct>(*line),
                              "session")
          .session();
  Result closed = Mrctl({"--session=" + token, "lease", "close"});
  ASSERT_EQ(closed.code, kExitOk) << closed;
  EXPECT_TRUE(WaitForPinned(0)) << PinnedBytes();
  // stdin stays open: only the session's end can stop hold.
  Result r = hold->Finish(absl::Seconds(10));
  EXPECT_EQ(r.code, kExitPrecondition) << r;
  EXPECT_TRUE(absl::StrContains(r.err, "SESSION_ENDED")) << r;
}

// ---- Several devices -------------------------------------------------------

// mrd on two software devices (software, software1): mrctl registers on
// both and prints a token per device, a peer reads through each token with
// a ticket of its device, and unknown names are refused by name.
class MrctlTwoDevicesTest : public MrctlTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions options;
    options.extra_flags = {"--software_devices=2"};
    return options;
  }
  void SetUp() override {
    if (TestDeviceKind() != "software") {
      GTEST_SKIP() << "software devices only";
    }
    MrctlTest::SetUp();
  }

  // A lease (MRD_SESSION of later commands) and a file of `size` bytes
  // starting with `text`, imported: the buffer's id.
  std::string ImportedBuffer(const std::string& text, uint64_t size) {
    OpenLease();
    EXPECT_TRUE(WriteShmFile(mrd_->shm_dir(), "two", text, size).ok());
    Result imported = Mrctl({"import-file", "two"});
    EXPECT_EQ(imported.code, kExitOk) << imported;
    return Fields(imported.out)["buffer"];
  }

  // `peer read` of `length` bytes at `va` through `token`, with a ticket
  // of the token's device from `peer-ticket --device`.
  Result ReadThrough(const v1::DeviceToken& token, uint64_t va,
                     uint64_t length) {
    Result ticket = Mrctl({"peer-ticket", "--device=" + token.device()});
    EXPECT_EQ(ticket.code, kExitOk) << ticket;
    auto tf = Fields(ticket.out);
    EXPECT_EQ(tf["device"], token.device());
    EXPECT_EQ(tf["peer_address"], token.peer_address());
    return Mrctl(
        {"peer", "read", "--device=" + token.device(),
         "--ticket=" + tf["ticket"], absl::StrCat("--rkey=", token.rkey()),
         absl::StrCat("--va=", va), absl::StrCat("--length=", length)});
  }
};

TEST_F(MrctlTwoDevicesTest, InfoShowsEveryDevice) {
  absl::StatusOr<v1::DeviceInfo> expected = client_->GetDeviceInfo();
  ASSERT_TRUE(expected.ok()) << expected.status();
  ASSERT_EQ(expected->devices_size(), 2);
  Result human = Mrctl({"info"});
  ASSERT_EQ(human.code, kExitOk) << human;
  auto f = Fields(human.out);
  EXPECT_EQ(f["name"], "software");  // the first device's, as before
  EXPECT_EQ(f["devices[0].name"], "software");
  EXPECT_EQ(f["devices[1].name"], "software1");
  EXPECT_EQ(f["devices[1].kind"], "software");
  EXPECT_EQ(f["devices[0].peer_address"], expected->devices(0).peer_address());
  EXPECT_EQ(f["devices[1].peer_address"], expected->devices(1).peer_address());
  EXPECT_NE(f["devices[0].peer_address"], f["devices[1].peer_address"]);
  EXPECT_EQ(f.count("devices[2].name"), 0u);
  Result json = Mrctl({"info", "--json"});
  ASSERT_EQ(json.code, kExitOk) << json;
  v1::DeviceInfo parsed = FromJson<v1::DeviceInfo>(json.out);
  ASSERT_EQ(parsed.devices_size(), 2);
  EXPECT_EQ(parsed.devices(1).name(), "software1");
  EXPECT_EQ(parsed.devices(1).peer_address(),
            expected->devices(1).peer_address());
}

TEST_F(MrctlTwoDevicesTest, RegisterOnBothAndReadThroughEachDevicesToken) {
  const std::string buffer = ImportedBuffer("two devices", 8192);
  ASSERT_FALSE(buffer.empty());
  absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->devices_size(), 2);

  Result reg = Mrctl({"register", "--buffer=" + buffer, "--length=8192",
                      "--flags=remote_read", "--devices=all"});
  ASSERT_EQ(reg.code, kExitOk) << reg;
  auto f = Fields(reg.out);
  EXPECT_EQ(f["references"], "1");
  for (int i = 0; i < 2; ++i) {
    const std::string key = absl::StrCat("tokens[", i, "].");
    EXPECT_EQ(f[key + "device"], info->devices(i).name());
    EXPECT_NE(ToU64(f[key + "rkey"]), 0u) << key;
    EXPECT_EQ(f[key + "peer_address"], info->devices(i).peer_address());
  }
  EXPECT_EQ(f["rkey"], f["tokens[0].rkey"]);
  EXPECT_EQ(f.count("tokens[2].device"), 0u);
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{8192, 8192}));

  // The same devices by name: the same registration, in JSON.
  Result named =
      Mrctl({"register", "--json", "--buffer=" + buffer, "--length=8192",
             "--flags=remote_read", "--devices=software,software1"});
  ASSERT_EQ(named.code, kExitOk) << named;
  v1::RegisterMrResponse hit = FromJson<v1::RegisterMrResponse>(named.out);
  EXPECT_TRUE(hit.cache_hit());
  EXPECT_EQ(absl::StrCat(hit.registration()), f["registration"]);
  ASSERT_EQ(hit.tokens_size(), 2);
  for (int i = 0; i < 2; ++i) {
    const std::string key = absl::StrCat("tokens[", i, "].");
    EXPECT_EQ(hit.tokens(i).device(), f[key + "device"]);
    EXPECT_EQ(absl::StrCat(hit.tokens(i).rkey()), f[key + "rkey"]);
    EXPECT_EQ(absl::StrCat(hit.tokens(i).lkey()), f[key + "lkey"]);
    EXPECT_EQ(hit.tokens(i).peer_address(), f[key + "peer_address"]);
  }

  // A peer of each device reads through that device's token.
  const uint64_t base = hit.base_address();
  for (const v1::DeviceToken& token : hit.tokens()) {
    Result read = ReadThrough(token, base, 11);
    EXPECT_EQ(read.code, kExitOk) << token.device() << ": " << read;
    EXPECT_EQ(read.out, "two devices") << token.device();
  }

  // list shows the tokens too.
  auto lf = Fields(Mrctl({"list"}).out);
  EXPECT_EQ(lf["registrations[0].tokens[1].device"], "software1");
  EXPECT_EQ(lf["registrations[0].tokens[1].rkey"], f["tokens[1].rkey"]);

  // Both references given back: neither token reads any more.
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(Mrctl({"deregister", "--registration=" + f["registration"]}).code,
              kExitOk);
  }
  for (const v1::DeviceToken& token : hit.tokens()) {
    Result dead = ReadThrough(token, base, 11);
    EXPECT_EQ(dead.code, kExitDenied) << token.device() << ": " << dead;
  }
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{0, 0}));

  // The second device alone: one token, of that device.
  Result second =
      Mrctl({"register", "--json", "--buffer=" + buffer, "--length=4096",
             "--flags=remote_read", "--devices=software1"});
  ASSERT_EQ(second.code, kExitOk) << second;
  v1::RegisterMrResponse on_second =
      FromJson<v1::RegisterMrResponse>(second.out);
  ASSERT_EQ(on_second.tokens_size(), 1);
  EXPECT_EQ(on_second.tokens(0).device(), "software1");
  EXPECT_EQ(on_second.rkey(), on_second.tokens(0).rkey());
  Result read = ReadThrough(on_second.tokens(0), on_second.base_address(), 3);
  EXPECT_EQ(read.code, kExitOk) << read;
  EXPECT_EQ(read.out, "two");
  // mrd's software devices share their pins: both show the page.
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{4096, 4096}));
  CloseLease();
}

TEST_F(MrctlTwoDevicesTest, BatchAndHoldRegisterOnTheDevicesGiven) {
  const std::string buffer = ImportedBuffer("batch", 4 * 4096);
  ASSERT_FALSE(buffer.empty());
  Result batch = Mrctl({"register-batch", "--json", "--buffer=" + buffer,
                        "--length=4K", "--count=2", "--stride=8K",
                        "--flags=remote_read", "--devices=all"});
  ASSERT_EQ(batch.code, kExitOk) << batch;
  v1::RegisterMrBatchResponse items =
      FromJson<v1::RegisterMrBatchResponse>(batch.out);
  ASSERT_EQ(items.items_size(), 2);
  for (const auto& item : items.items()) {
    ASSERT_EQ(item.registration().tokens_size(), 2);
    EXPECT_EQ(item.registration().tokens(0).device(), "software");
    EXPECT_EQ(item.registration().tokens(1).device(), "software1");
  }
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{8192, 8192}));
  Result read = ReadThrough(items.items(0).registration().tokens(1),
                            items.items(0).registration().base_address(), 5);
  EXPECT_EQ(read.code, kExitOk) << read;
  EXPECT_EQ(read.out, "batch");
  CloseLease();

  std::unique_ptr<Child> hold =
      Spawn({"hold", "--size=4096", "--fill=held", "--flags=remote_read",
             "--devices=software1", "--json"});
  ASSERT_NE(hold, nullptr);
  absl::StatusOr<std::string> line = hold->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  auto held = FromJson<google::protobuf::Struct>(*line);
  v1::RegisterMrResponse reg =
      Member<v1::RegisterMrResponse>(held, "registration");
  ASSERT_EQ(reg.tokens_size(), 1);
  EXPECT_EQ(reg.tokens(0).device(), "software1");
  // mrd's software devices share their pins: both show the page.
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{4096, 4096}));
  session_ = Member<v1::SessionInfo>(held, "session").session();
  Result held_read = ReadThrough(reg.tokens(0), reg.base_address(), 4);
  EXPECT_EQ(held_read.code, kExitOk) << held_read;
  EXPECT_EQ(held_read.out, "held");
  session_.clear();
  hold->CloseStdin();
  Result r = hold->Finish();
  EXPECT_EQ(r.code, kExitOk) << r;
}

TEST_F(MrctlTwoDevicesTest, UnknownDevicesAreRefusedByName) {
  const std::string buffer = ImportedBuffer("x", 4096);
  ASSERT_FALSE(buffer.empty());
  const std::string refused =
      "mrctl: INVALID_ARGUMENT SEED_STATUS_UNSPECIFIED UNKNOWN_DEVICE: no "
      "device 'mlx5_7': mrd serves software, software1\n";
  Result reg = Mrctl({"register", "--buffer=" + buffer, "--length=4096",
                      "--devices=software1,mlx5_7"});
  EXPECT_EQ(reg.code, kExitFailed) << reg;
  EXPECT_EQ(reg.out, "");
  EXPECT_EQ(reg.err, refused);
  EXPECT_EQ(ListOf(session_).registrations_size(), 0);
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{0, 0}));

  Result batch = Mrctl({"register-batch", "--buffer=" + buffer, "--length=4096",
                        "--count=1", "--devices=mlx5_7"});
  EXPECT_EQ(batch.code, kExitFailed) << batch;
  EXPECT_TRUE(absl::StrContains(batch.err,
                                "UNKNOWN_DEVICE: item 0: no "
                                "device 'mlx5_7'"))
      << batch;

  Result ticket = Mrctl({"peer-ticket", "--device=mlx5_7"});
  EXPECT_EQ(ticket.code, kExitFailed) << ticket;
  EXPECT_EQ(ticket.out, "");
  EXPECT_EQ(ticket.err, refused);

  Result read = Mrctl({"peer", "read", "--device=mlx5_7", "--ticket=t",
                       "--rkey=1", "--va=1", "--length=1"});
  EXPECT_EQ(read.code, kExitFailed) << read;
  EXPECT_EQ(read.err, refused);

  // `all` stands alone: mrctl's own usage error.
  Result mixed = Mrctl({"register", "--buffer=" + buffer, "--length=4096",
                        "--devices=all,software"});
  EXPECT_EQ(mixed.code, kExitUsage) << mixed;
  EXPECT_TRUE(absl::StartsWith(mixed.err,
                               "mrctl: --devices: give device names, all or "
                               "nearest, one of them"))
      << mixed;
  CloseLease();
}

TEST_F(MrctlTwoDevicesTest, CreateMrAndBuildLamOnTheDeviceGiven) {
  const std::string buffer = ImportedBuffer("lam", 8192);
  ASSERT_FALSE(buffer.empty());
  Result first = Mrctl({"create-mr", "--fast-register", "--allow-remote"});
  ASSERT_EQ(first.code, kExitOk) << first;
  EXPECT_EQ(Fields(first.out)["device"], "software");
  Result second = Mrctl(
      {"create-mr", "--fast-register", "--allow-remote", "--device=software1"});
  ASSERT_EQ(second.code, kExitOk) << second;
  EXPECT_EQ(Fields(second.out)["device"], "software1");
  Result lam = Mrctl({"build-lam", "--json", "--buffer=" + buffer,
                      "--length=4096", "--device=software1"});
  ASSERT_EQ(lam.code, kExitOk) << lam;
  v1::BuildLamResponse mapped = FromJson<v1::BuildLamResponse>(lam.out);
  EXPECT_EQ(mapped.device(), "software1");
  EXPECT_EQ(mapped.pages_size(), 1);
  auto lf = Fields(Mrctl({"list"}).out);
  EXPECT_EQ(lf["mrs[0].device"], "software");
  EXPECT_EQ(lf["mrs[1].device"], "software1");
  EXPECT_EQ(lf["lams[0].device"], "software1");

  const std::string refused =
      "mrctl: INVALID_ARGUMENT SEED_STATUS_UNSPECIFIED UNKNOWN_DEVICE: no "
      "device 'mlx5_7': mrd serves software, software1\n";
  Result mr = Mrctl({"create-mr", "--device=mlx5_7"});
  EXPECT_EQ(mr.code, kExitFailed) << mr;
  EXPECT_EQ(mr.err, refused);
  Result unknown = Mrctl(
      {"build-lam", "--buffer=" + buffer, "--length=4096", "--device=mlx5_7"});
  EXPECT_EQ(unknown.code, kExitFailed) << unknown;
  EXPECT_EQ(unknown.err, refused);
  EXPECT_EQ(Mrctl({"release-lam", absl::StrCat(mapped.lam())}).code, kExitOk);
  EXPECT_EQ(DevicePinnedBytes(), (std::vector<uint64_t>{0, 0}));
  CloseLease();
}

// ---- Finding mrd -----------------------------------------------------------

TEST_F(MrctlTest, GlobalFlagsFindMrdWithoutTheEnvironment) {
  // No MRD_RUNTIME_DIR: the default runtime dir has no mrd.
  const std::string socket = "--socket=" + mrd_->grpc_socket();
  Result by_socket = Mrctl({socket, "health"}, /*runtime_dir_env=*/false);
  EXPECT_EQ(by_socket.code, kExitOk) << by_socket;
  Result by_target =
      Mrctl({"health", "--target=" + mrd_->grpc_target()}, false);
  EXPECT_EQ(by_target.code, kExitOk) << by_target;
  Result by_dir =
      Mrctl({"--runtime-dir=" + mrd_->runtime_dir(), "info"}, false);
  EXPECT_EQ(by_dir.code, kExitOk) << by_dir;
  EXPECT_EQ(Fields(by_dir.out)["kind"], "software");
  // hold needs the fd socket too.
  Result held = Mrctl({socket, "--fd-socket=" + mrd_->fd_socket(), "hold",
                       "--size=4096", "--json"},
                      false);
  EXPECT_EQ(held.code, kExitOk) << held;
  EXPECT_TRUE(absl::StrContains(held.out, "\"kind\":\"fd\"")) << held;
  Result wrong_fd =
      Mrctl({socket, "--fd-socket=" + mrd_->runtime_dir() + "/none.sock",
             "hold", "--size=4096"},
            false);
  EXPECT_EQ(wrong_fd.code, kExitUnavailable) << wrong_fd;
}

}  // namespace
}  // namespace mrd::testing
