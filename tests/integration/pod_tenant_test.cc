// A tenant is a pod (issue 24): processes of one uid in different pods —
// real processes in real cgroups laid out as the kubelet lays out pods
// (tests/support/pod_cgroup.h) — are different tenants of the real mrd, each
// with its own quota; the administrative call sets a pod's quota while mrd
// runs, only for root and mrd's own uid; and the tenant survives into
// GetSession and lease sessions the pod vouches for.
//
// Runs mrctl as uids 1000 and 1001 inside the pods: needs root and
// writable cgroup file systems (skips otherwise, saying which).
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "client/lib/mrd_client.h"
#include "tests/integration/test_env.h"
#include "tests/support/pod_cgroup.h"

#ifndef MRCTL_BINARY
#error "MRCTL_BINARY must name the mrctl executable"
#endif

namespace mrd::testing {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

// mrctl running as `uid` inside `pod` (null: in the test's own cgroup),
// with its stdin a pipe the test holds (so `mrctl hold` holds until
// Release) or /dev/null.
class Mrctl {
 public:
  static std::unique_ptr<Mrctl> Start(uint32_t uid, const PodCgroup* pod,
                                      const std::string& runtime_dir,
                                      const std::string& scratch,
                                      std::vector<std::string> args,
                                      bool hold_stdin = false) {
    static int counter = 0;
    auto m = std::unique_ptr<Mrctl>(new Mrctl());
    const std::string base = absl::StrCat(scratch, "/mrctl-", ++counter);
    m->out_path_ = base + ".out";
    m->err_path_ = base + ".err";
    int in_pipe[2] = {-1, -1};
    if (hold_stdin && ::pipe2(in_pipe, O_CLOEXEC) != 0) return nullptr;
    std::vector<std::string> env = {"MRD_RUNTIME_DIR=" + runtime_dir,
                                    "PATH=/usr/bin:/bin"};
    args.insert(args.begin(), MRCTL_BINARY);
    std::vector<char*> cargv, cenv;
    for (auto& a : args) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    for (auto& e : env) cenv.push_back(e.data());
    cenv.push_back(nullptr);
    const std::vector<std::string> join =
        pod != nullptr ? pod->ProcsFiles() : std::vector<std::string>();
    const pid_t pid = fork();
    if (pid == 0) {
      if (!PodCgroup::JoinSelf(join)) _exit(124);
      int out =
          ::open(m->out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int err =
          ::open(m->err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int in = hold_stdin ? in_pipe[0] : ::open("/dev/null", O_RDONLY);
      if (out < 0 || err < 0 || in < 0) _exit(126);
      dup2(in, 0);
      dup2(out, 1);
      dup2(err, 2);
      if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0) {
        _exit(125);
      }
      execve(cargv[0], cargv.data(), cenv.data());
      _exit(127);
    }
    if (hold_stdin) {
      ::close(in_pipe[0]);
      m->stdin_ = in_pipe[1];
    }
    m->pid_ = pid;
    return m;
  }

  ~Mrctl() {
    Release();
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      Wait();
    }
  }

  // Closes its stdin: `mrctl hold` releases what it holds and exits.
  void Release() {
    if (stdin_ >= 0) ::close(stdin_);
    stdin_ = -1;
  }

  // Waits for it to exit; its exit code (128 + signal if killed).
  int Wait() {
    if (pid_ <= 0) return code_;
    int status = 0;
    if (waitpid(pid_, &status, 0) == pid_) {
      code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    pid_ = -1;
    return code_;
  }

  // Waits until its stdout has a line starting with `prefix` (a hold
  // printed what it holds), or it exited. The line's value, or "".
  std::string WaitForLine(absl::string_view prefix) {
    for (int i = 0; i < 3000; ++i) {
      for (absl::string_view line : absl::StrSplit(Out(), '\n')) {
        if (absl::ConsumePrefix(&line, prefix)) return std::string(line);
      }
      int status = 0;
      if (pid_ > 0 && waitpid(pid_, &status, WNOHANG) == pid_) {
        code_ =
            WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        pid_ = -1;
      }
      if (pid_ <= 0) break;
      ::usleep(10000);
    }
    return "";
  }

  std::string Out() const { return Slurp(out_path_); }
  std::string Err() const { return Slurp(err_path_); }
  std::string Describe() const {
    return absl::StrCat("exit ", code_, "\nstdout: ", Out(),
                        "\nstderr: ", Err());
  }

 private:
  Mrctl() = default;
  pid_t pid_ = -1;
  int stdin_ = -1;
  int code_ = -1;
  std::string out_path_;
  std::string err_path_;
};

// Issue 24, item 1, as reported: three processes each in a pod of its own,
// A and B of uid 1000, C of uid 1001, against mrd with 1 GiB of pinned
// memory (a tenant's default share: 256 MiB).
class PodTenantTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {"--allowed_uids=1000,1001", "--socket_mode=0666",
                     "--max_total_pinned_bytes=1073741824",
                     "--warm_pin_bytes_total=0"};
    return o;
  }

  void SetUp() override {
    if (getuid() != 0) GTEST_SKIP() << "needs root: pods are cgroups";
    for (auto* pod : {&a_, &b_, &c_}) {
      absl::StatusOr<std::unique_ptr<PodCgroup>> made = PodCgroup::Create();
      if (!made.ok()) GTEST_SKIP() << made.status();
      *pod = std::move(*made);
    }
    MrdTest::SetUp();
    ASSERT_EQ(::chmod(mrd_->runtime_dir().c_str(), 0755), 0);
    scratch_ = mrd_->runtime_dir() + "/scratch";
    ASSERT_EQ(::mkdir(scratch_.c_str(), 0777), 0);
    ASSERT_EQ(::chmod(scratch_.c_str(), 0777), 0);
  }

  std::unique_ptr<Mrctl> Hold(uint32_t uid, const PodCgroup* pod,
                              const std::string& size, bool keep) {
    return Mrctl::Start(uid, pod, mrd_->runtime_dir(), scratch_,
                        {"hold", "--size=" + size, "--flags=remote_read"},
                        keep);
  }

  // mrctl as root (the test's own uid), in no pod.
  std::unique_ptr<Mrctl> AsRoot(std::vector<std::string> args) {
    return Mrctl::Start(0, nullptr, mrd_->runtime_dir(), scratch_,
                        std::move(args));
  }

  std::string TenantOf(const std::string& session) {
    v1::GetSessionRequest request;
    request.set_session(session);
    absl::StatusOr<v1::SessionInfo> info = client_->GetSession(request);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->tenant() : "";
  }

  std::unique_ptr<PodCgroup> a_, b_, c_;
  std::string scratch_;
};

TEST_F(PodTenantTest, PodsOfOneUidAreTenantsOfTheirOwn) {
  // Pod A takes its whole share.
  std::unique_ptr<Mrctl> greedy = Hold(1000, a_.get(), "256M", true);
  ASSERT_NE(greedy, nullptr);
  const std::string session = greedy->WaitForLine("session.session=");
  ASSERT_FALSE(session.empty()) << greedy->Describe();
  EXPECT_EQ(TenantOf(session), a_->tenant());

  // More from pod A is refused at its quota, naming the pod.
  std::unique_ptr<Mrctl> more = Hold(1000, a_.get(), "4096", false);
  EXPECT_EQ(more->Wait(), 5) << more->Describe();
  EXPECT_TRUE(absl::StrContains(more->Err(), "LIMIT_TENANT_PINNED_BYTES"))
      << more->Describe();
  EXPECT_TRUE(absl::StrContains(more->Err(), "tenant " + a_->tenant()))
      << more->Describe();

  // Pod B, the same uid in another pod, registers: its own tenant.
  std::unique_ptr<Mrctl> other = Hold(1000, b_.get(), "64M", false);
  EXPECT_EQ(other->Wait(), 0) << other->Describe();
  EXPECT_TRUE(absl::StrContains(other->Out(), "session.tenant=" + b_->tenant()))
      << other->Describe();
  // And pod C, another uid.
  std::unique_ptr<Mrctl> third = Hold(1001, c_.get(), "64M", false);
  EXPECT_EQ(third->Wait(), 0) << third->Describe();
  EXPECT_TRUE(absl::StrContains(third->Out(), "session.tenant=" + c_->tenant()))
      << third->Describe();

  // Pod A's end releases everything it held: it registers its share again.
  greedy->Release();
  EXPECT_EQ(greedy->Wait(), 0) << greedy->Describe();
  std::unique_ptr<Mrctl> again = Hold(1000, a_.get(), "256M", false);
  EXPECT_EQ(again->Wait(), 0) << again->Describe();
}

TEST_F(PodTenantTest, LeasesVouchedForByAPodBelongToIt) {
  std::unique_ptr<Mrctl> holder = Hold(1000, b_.get(), "4096", true);
  const std::string session = holder->WaitForLine("session.session=");
  ASSERT_FALSE(session.empty()) << holder->Describe();
  v1::OpenLeaseSessionRequest request;
  request.set_vouching_session(session);
  request.set_ttl_seconds(60);
  absl::StatusOr<v1::SessionInfo> lease = client_->OpenLeaseSession(request);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->tenant(), b_->tenant());
  EXPECT_TRUE(lease->verified());
  v1::CloseSessionRequest close;
  close.set_session(lease->session());
  EXPECT_TRUE(client_->CloseSession(close).ok());
}

TEST_F(PodTenantTest, AnAdministratorSetsAPodsQuotaWhileMrdRuns) {
  // Before pod B ever connected: its quota is 64 KiB.
  std::unique_ptr<Mrctl> set = AsRoot(
      {"tenant", "set", b_->tenant(), "--pinned-bytes=64K", "--weight=3"});
  ASSERT_EQ(set->Wait(), 0) << set->Describe();
  EXPECT_TRUE(absl::StrContains(set->Out(), "weight=3")) << set->Describe();

  std::unique_ptr<Mrctl> refused = Hold(1000, b_.get(), "128K", false);
  EXPECT_EQ(refused->Wait(), 5) << refused->Describe();
  EXPECT_TRUE(absl::StrContains(refused->Err(), "its quota of 65536"))
      << refused->Describe();
  std::unique_ptr<Mrctl> fits = Hold(1000, b_.get(), "64K", true);
  ASSERT_FALSE(fits->WaitForLine("session.session=").empty())
      << fits->Describe();

  // Lowered below what it holds: nothing is taken away, new work refused.
  std::unique_ptr<Mrctl> lower =
      AsRoot({"tenant", "set", b_->tenant(), "--pinned-bytes=4K"});
  ASSERT_EQ(lower->Wait(), 0) << lower->Describe();
  std::unique_ptr<Mrctl> listed = AsRoot({"--json", "tenant", "list"});
  ASSERT_EQ(listed->Wait(), 0) << listed->Describe();
  EXPECT_TRUE(absl::StrContains(listed->Out(), b_->tenant()))
      << listed->Describe();
  EXPECT_TRUE(absl::StrContains(listed->Out(), "\"used\":\"65536\""))
      << listed->Describe();
  std::unique_ptr<Mrctl> no_more = Hold(1000, b_.get(), "4096", false);
  EXPECT_EQ(no_more->Wait(), 5) << no_more->Describe();

  // Cleared: the default share (256 MiB) again.
  std::unique_ptr<Mrctl> clear = AsRoot({"tenant", "clear", b_->tenant()});
  ASSERT_EQ(clear->Wait(), 0) << clear->Describe();
  std::unique_ptr<Mrctl> room = Hold(1000, b_.get(), "1M", false);
  EXPECT_EQ(room->Wait(), 0) << room->Describe();
  fits->Release();
  EXPECT_EQ(fits->Wait(), 0) << fits->Describe();

  // A workload may not: the socket is root's (mode 0600), and SO_PEERCRED
  // is checked behind it.
  std::unique_ptr<Mrctl> workload =
      Mrctl::Start(1000, b_.get(), mrd_->runtime_dir(), scratch_,
                   {"tenant", "set", b_->tenant(), "--pinned-bytes=1T"});
  EXPECT_NE(workload->Wait(), 0) << workload->Describe();
  std::unique_ptr<Mrctl> unknown = AsRoot({"tenant", "clear", b_->tenant()});
  EXPECT_NE(unknown->Wait(), 0) << unknown->Describe();
  EXPECT_TRUE(absl::StrContains(unknown->Err(), "NO_TENANT_SETTINGS"))
      << unknown->Describe();
}

// Tenants survive a live handover: a pod's session keeps its tenant, and the
// settings an administrator made keep applying in the new process.
class PodTenantHandoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (getuid() != 0) GTEST_SKIP() << "needs root: pods are cgroups";
    absl::StatusOr<std::unique_ptr<PodCgroup>> made = PodCgroup::Create();
    if (!made.ok()) GTEST_SKIP() << made.status();
    pod_ = std::move(*made);
    char dir[] = "/tmp/mrd-pod-handover-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    runtime_dir_ = dir;
    ASSERT_EQ(::chmod(runtime_dir_.c_str(), 0755), 0);
    scratch_ = runtime_dir_ + "/scratch";
    ASSERT_EQ(::mkdir(scratch_.c_str(), 0777), 0);
    ASSERT_EQ(::chmod(scratch_.c_str(), 0777), 0);
  }
  void TearDown() override {
    if (new_ != nullptr) {
      const absl::Status stopped = new_->Stop();
      EXPECT_TRUE(stopped.ok()) << stopped;
    }
    if (old_ != nullptr) {
      const absl::Status stopped = old_->Stop();
      EXPECT_TRUE(stopped.ok()) << stopped;
    }
    if (!runtime_dir_.empty()) {
      std::string rm = "rm -rf " + runtime_dir_;
      EXPECT_EQ(std::system(rm.c_str()), 0);
    }
  }
  MrdProcessOptions Options(bool takeover) {
    MrdProcessOptions o;
    o.runtime_dir = runtime_dir_;
    o.extra_flags = {"--allowed_uids=1000", "--socket_mode=0666",
                     "--warm_pin_bytes_total=0"};
    if (takeover) o.extra_flags.push_back("--takeover");
    return o;
  }
  std::unique_ptr<Mrctl> Run(uint32_t uid, const PodCgroup* pod,
                             std::vector<std::string> args, bool keep = false) {
    return Mrctl::Start(uid, pod, runtime_dir_, scratch_, std::move(args),
                        keep);
  }

  std::unique_ptr<PodCgroup> pod_;
  std::string runtime_dir_;
  std::string scratch_;
  std::unique_ptr<MrdProcess> old_;
  std::unique_ptr<MrdProcess> new_;
};

TEST_F(PodTenantHandoverTest, TenantsAndTheirSettingsSurviveAHandover) {
  auto old = MrdProcess::Start(Options(false));
  ASSERT_TRUE(old.ok()) << old.status();
  old_ = std::move(*old);
  std::unique_ptr<Mrctl> holder = Run(
      1000, pod_.get(), {"hold", "--size=64K", "--flags=remote_read"}, true);
  const std::string session = holder->WaitForLine("session.session=");
  ASSERT_FALSE(session.empty()) << holder->Describe();
  std::unique_ptr<Mrctl> set = Run(
      0, nullptr,
      {"tenant", "set", pod_->tenant(), "--pinned-bytes=128K", "--weight=3"});
  ASSERT_EQ(set->Wait(), 0) << set->Describe();

  auto successor = MrdProcess::Start(Options(true));
  ASSERT_TRUE(successor.ok()) << successor.status();
  new_ = std::move(*successor);
  ASSERT_TRUE(old_->WaitExited(absl::Seconds(30))) << old_->Log();

  // The session goes on in the new process, counted to the same pod.
  client::ClientOptions options;
  options.socket_path = new_->grpc_socket();
  options.fd_socket_path = new_->fd_socket();
  absl::StatusOr<client::Client> client = client::Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  v1::GetSessionRequest request;
  request.set_session(session);
  absl::StatusOr<v1::SessionInfo> info = client->GetSession(request);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tenant(), pod_->tenant());

  // The settings too: the new process lists them, and its quota refuses.
  std::unique_ptr<Mrctl> listed = Run(0, nullptr, {"--json", "tenant", "list"});
  ASSERT_EQ(listed->Wait(), 0) << listed->Describe() << new_->Log();
  const std::string out = listed->Out();
  EXPECT_TRUE(absl::StrContains(out, "\"weight\":3")) << out;
  EXPECT_TRUE(absl::StrContains(out, "\"quota\":\"131072\"")) << out;
  EXPECT_TRUE(absl::StrContains(out, "\"used\":\"65536\"")) << out;
  std::unique_ptr<Mrctl> over =
      Run(1000, pod_.get(), {"hold", "--size=128K", "--flags=remote_read"});
  EXPECT_EQ(over->Wait(), 5) << over->Describe();
  EXPECT_TRUE(absl::StrContains(over->Err(), "tenant " + pod_->tenant()))
      << over->Describe();
  holder->Release();
  EXPECT_EQ(holder->Wait(), 0) << holder->Describe();
}

}  // namespace
}  // namespace mrd::testing
