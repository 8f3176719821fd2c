// Tenants against the real mrd: one principal (a uid, or every anonymous
// lease together) can never take a resource from the others, and a lease
// session reaches only files its proven owner could open itself.
//
// Some tests run mrctl as uid 65534 (nobody) in a child process, so they
// need root; they skip otherwise.
#include <fcntl.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "tests/integration/test_env.h"

#ifndef MRCTL_BINARY
#error "MRCTL_BINARY must name the mrctl executable"
#endif

namespace mrd::testing {
namespace {

constexpr uint32_t kNobody = 65534;

struct ChildResult {
  int code = -1;
  std::string out;
  std::string err;
};

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

// Runs mrctl as `uid` with MRD_RUNTIME_DIR (and MRD_SESSION when set).
ChildResult MrctlAs(uint32_t uid, const std::string& runtime_dir,
                    const std::string& session,
                    const std::vector<std::string>& args,
                    const std::string& scratch) {
  const std::string out_path = scratch + "/child.out";
  const std::string err_path = scratch + "/child.err";
  std::vector<std::string> env = {"MRD_RUNTIME_DIR=" + runtime_dir,
                                  "PATH=/usr/bin:/bin"};
  if (!session.empty()) env.push_back("MRD_SESSION=" + session);
  std::vector<std::string> argv = {MRCTL_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv, cenv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  for (auto& e : env) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int in = ::open("/dev/null", O_RDONLY);
    if (out < 0 || err < 0 || in < 0) _exit(126);
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
    if (uid != getuid()) {
      if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0) {
        _exit(125);
      }
    }
    execve(cargv[0], cargv.data(), cenv.data());
    _exit(127);
  }
  ChildResult result;
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return result;
  result.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  result.out = Slurp(out_path);
  result.err = Slurp(err_path);
  return result;
}

std::ostream& operator<<(std::ostream& os, const ChildResult& r) {
  return os << "exit " << r.code << "\nstdout: " << r.out
            << "\nstderr: " << r.err;
}

void WriteFile(const std::string& path, const std::string& content,
               mode_t mode) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, mode);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  std::string padded = content;
  padded.resize(4096, '\0');
  ASSERT_EQ(::write(fd, padded.data(), padded.size()),
            static_cast<ssize_t>(padded.size()));
  ::close(fd);
  ASSERT_EQ(::chmod(path.c_str(), mode), 0);
}

absl::StatusOr<v1::SessionInfo> OpenLease(const client::Client& c,
                                          const std::string& vouching = "",
                                          uint32_t ttl_seconds = 3600) {
  v1::OpenLeaseSessionRequest request;
  request.set_ttl_seconds(ttl_seconds);
  request.set_vouching_session(vouching);
  return c.OpenLeaseSession(request);
}

absl::StatusOr<v1::BufferInfo> Import(const client::Client& c,
                                      const std::string& session,
                                      const std::string& path, bool writable) {
  v1::ImportFileRequest request;
  request.set_session(session);
  request.set_path(path);
  request.set_writable(writable);
  return c.ImportFile(request);
}

// Issue 8, item 6: 1,023 anonymous 24-hour leases used to take every
// session slot; now they fill only the anonymous tenant's share.
class AnonymousLeaseTest : public MrdTest {};

TEST_F(AnonymousLeaseTest, AnonymousLeasesCannotLockOthersOut) {
  int opened = 0;
  absl::Status refused;
  for (int i = 0; i < 1023; ++i) {
    absl::StatusOr<v1::SessionInfo> lease = OpenLease(*client_, "", 86400);
    if (!lease.ok()) {
      refused = lease.status();
      break;
    }
    EXPECT_EQ(lease->tenant(), "anonymous");
    EXPECT_FALSE(lease->verified());
    ++opened;
  }
  // 25 % of --max_sessions=1024 by default.
  EXPECT_EQ(opened, 256);
  ExpectError(refused, absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TENANT_SESSIONS");
  EXPECT_TRUE(absl::StrContains(refused.message(), "tenant anonymous"))
      << refused;

  // Every other workload still gets in: an fd session, and a lease it
  // vouches for, both of the caller's own tenant.
  client::Session fd = OpenFdSession();
  absl::StatusOr<v1::SessionInfo> vouched = OpenLease(*client_, fd.token());
  ASSERT_TRUE(vouched.ok()) << vouched.status();
  EXPECT_EQ(vouched->tenant(), absl::StrCat("uid:", getuid()));
  EXPECT_TRUE(vouched->verified());
  client::Buffer buffer = NewBuffer(fd, 4096);
  client::Registration reg = Register(fd, buffer, 0, 4096, kRemoteRead);
  EXPECT_NE(reg.rkey(), 0u);
}

TEST_F(AnonymousLeaseTest, VouchingNeedsALiveVerifiedSession) {
  absl::StatusOr<v1::SessionInfo> anonymous = OpenLease(*client_);
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  // An anonymous lease cannot vouch for another (it proves nothing).
  ExpectError(OpenLease(*client_, anonymous->session()).status(),
              absl::StatusCode::kPermissionDenied,
              ::mrd::SEED_STATUS_UNSPECIFIED, "BAD_VOUCHING_SESSION");
  ExpectError(OpenLease(*client_, "no-such-session").status(),
              absl::StatusCode::kPermissionDenied,
              ::mrd::SEED_STATUS_UNSPECIFIED, "BAD_VOUCHING_SESSION");
  // A vouched lease outlives its voucher, keeping the identity.
  std::string token;
  {
    client::Session fd = OpenFdSession();
    absl::StatusOr<v1::SessionInfo> vouched = OpenLease(*client_, fd.token());
    ASSERT_TRUE(vouched.ok()) << vouched.status();
    token = vouched->session();
  }
  v1::GetSessionRequest get;
  get.set_session(token);
  absl::StatusOr<v1::SessionInfo> later = client_->GetSession(get);
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_TRUE(later->verified());
  EXPECT_EQ(later->peer_uid(), getuid());
}

// A real mrd whose sockets nobody (uid 65534) can reach, and a scratch
// directory for nobody's mrctl output.
class NobodyTest : public MrdTest {
 protected:
  void SetUp() override {
    if (getuid() != 0) GTEST_SKIP() << "needs root to run a child as nobody";
    MrdTest::SetUp();
    // The test's runtime dir is 0700.
    ASSERT_EQ(::chmod(mrd_->runtime_dir().c_str(), 0755), 0);
    scratch_ = mrd_->runtime_dir() + "/scratch";
    ASSERT_EQ(::mkdir(scratch_.c_str(), 0777), 0);
    ASSERT_EQ(::chmod(scratch_.c_str(), 0777), 0);
  }
  std::string scratch_;
};

// Issue 8, item 7: with a world-accessible gRPC socket, uid 65534 (refused
// on the fd socket) opened a lease, imported a root-owned 0600 file from
// --shm_dir and read it through the peer path.
class ConfusedDeputyTest : public NobodyTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {"--socket_mode=0666"};
    return o;
  }
  void SetUp() override {
    NobodyTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    WriteFile(mrd_->shm_dir() + "/secret", "root's secret", 0600);
    WriteFile(mrd_->shm_dir() + "/public", "anyone may read", 0644);
  }
};

TEST_F(ConfusedDeputyTest, NobodyCannotImportRootsPrivateFile) {
  ChildResult lease = MrctlAs(kNobody, mrd_->runtime_dir(), "",
                              {"lease", "open", "-q"}, scratch_);
  ASSERT_EQ(lease.code, 0) << lease;
  // The fd socket refused nobody (not an allowed uid): the lease is
  // anonymous.
  std::string token(absl::StripSuffix(lease.out, "\n"));
  ChildResult import = MrctlAs(kNobody, mrd_->runtime_dir(), token,
                               {"import-file", "secret"}, scratch_);
  EXPECT_NE(import.code, 0) << import;
  EXPECT_TRUE(absl::StrContains(import.err, "IDENTITY_DENIES_ACCESS"))
      << import;
  EXPECT_TRUE(absl::StrContains(import.err, "mode 0600")) << import;
  // What nobody may open itself, it may import through mrd.
  ChildResult open_public = MrctlAs(kNobody, mrd_->runtime_dir(), token,
                                    {"import-file", "public"}, scratch_);
  EXPECT_EQ(open_public.code, 0) << open_public;
  ChildResult write_public =
      MrctlAs(kNobody, mrd_->runtime_dir(), token,
              {"import-file", "public", "--writable"}, scratch_);
  EXPECT_NE(write_public.code, 0) << write_public;
  EXPECT_TRUE(absl::StrContains(write_public.err, "IDENTITY_DENIES_ACCESS"))
      << write_public;
}

// mrctl vouches through the fd socket unless told --anonymous.
TEST_F(ConfusedDeputyTest, MrctlLeaseOpenVouchesUnlessAnonymous) {
  for (bool anonymous : {false, true}) {
    std::vector<std::string> args = {"lease", "open", "-q"};
    if (anonymous) args.push_back("--anonymous");
    ChildResult open =
        MrctlAs(getuid(), mrd_->runtime_dir(), "", args, scratch_);
    ASSERT_EQ(open.code, 0) << open;
    v1::GetSessionRequest get;
    get.set_session(std::string(absl::StripSuffix(open.out, "\n")));
    absl::StatusOr<v1::SessionInfo> info = client_->GetSession(get);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->verified(), !anonymous);
    EXPECT_EQ(info->tenant(),
              anonymous ? "anonymous" : absl::StrCat("uid:", getuid()));
  }
}

TEST_F(ConfusedDeputyTest, AnonymousLeaseIsAnyoneVouchedLeaseIsItsOwner) {
  absl::StatusOr<v1::SessionInfo> anonymous = OpenLease(*client_);
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  ExpectError(Import(*client_, anonymous->session(), "secret", false).status(),
              absl::StatusCode::kPermissionDenied,
              ::mrd::SEED_STATUS_UNSPECIFIED, "IDENTITY_DENIES_ACCESS");
  EXPECT_TRUE(Import(*client_, anonymous->session(), "public", false).ok());

  client::Session fd = OpenFdSession();
  absl::StatusOr<v1::SessionInfo> vouched = OpenLease(*client_, fd.token());
  ASSERT_TRUE(vouched.ok()) << vouched.status();
  absl::StatusOr<v1::BufferInfo> mine =
      Import(*client_, vouched->session(), "secret", true);
  EXPECT_TRUE(mine.ok()) << mine.status();
}

// Quotas per tenant: one uid's sessions together hold at most its share of
// the pinned bytes, and another uid still registers.
class TenantQuotaTest : public NobodyTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    // 64 pages in total; a tenant may pin 25 %: 16 pages.
    o.extra_flags = {absl::StrCat("--max_total_pinned_bytes=", 64 * 4096),
                     "--allowed_uids=0,65534", "--socket_mode=0666",
                     "--warm_pin_bytes_total=0"};
    return o;
  }
};

TEST_F(TenantQuotaTest, OneUidsSessionsShareItsQuota) {
  client::Session a = OpenFdSession();
  client::Session b = OpenFdSession();
  client::Buffer buffer_a = NewBuffer(a, 8 * 4096);
  client::Buffer buffer_b = NewBuffer(b, 9 * 4096);
  client::Registration ra = Register(a, buffer_a, 0, 8 * 4096, kRemoteRead);
  client::Registration rb = Register(b, buffer_b, 0, 8 * 4096, kRemoteRead);
  client::RegisterOptions o;
  o.buffer = buffer_b.id();
  o.offset = 8 * 4096;
  o.length = 4096;
  o.flags = kRemoteRead;
  absl::StatusOr<client::Registration> over =
      client::Registration::Register(b, o);
  ExpectError(over.status(), absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES,
              "LIMIT_TENANT_PINNED_BYTES");
  EXPECT_TRUE(absl::StrContains(over.status().message(),
                                absl::StrCat("tenant uid:", getuid())))
      << over.status();
  // Another uid is another tenant: it registers as much as its own share.
  ChildResult nobody =
      MrctlAs(kNobody, mrd_->runtime_dir(), "",
              {"hold", "--size=65536", "--flags=remote_read"}, scratch_);
  EXPECT_EQ(nobody.code, 0) << nobody;
  EXPECT_TRUE(absl::StrContains(nobody.out, "rkey=")) << nobody;
}

class TenantsFileTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    path_ = ::testing::TempDir() + "/tenants-" + std::to_string(getpid());
    std::ofstream(path_) << "# test tenants\n"
                         << "tenant batch uids=" << getuid()
                         << " sessions=3 pinned_bytes=64K\n";
    MrdProcessOptions o;
    o.extra_flags = {"--tenants_file=" + path_};
    return o;
  }
  void TearDown() override {
    MrdTest::TearDown();
    std::remove(path_.c_str());
  }
  std::string path_;
};

TEST_F(TenantsFileTest, NamedTenantGetsItsQuota) {
  client::Session a = OpenFdSession();
  client::Session b = OpenFdSession();
  absl::StatusOr<v1::SessionInfo> lease = OpenLease(*client_, a.token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->tenant(), "batch");
  absl::StatusOr<client::Session> fourth = client::Session::OpenFd(*client_);
  ASSERT_FALSE(fourth.ok());
  EXPECT_EQ(GetErrorDetail(fourth.status()).reason(), "LIMIT_TENANT_SESSIONS")
      << fourth.status();
  EXPECT_TRUE(absl::StrContains(fourth.status().message(), "tenant batch"))
      << fourth.status();
  // Anonymous leases are another tenant, unaffected.
  EXPECT_TRUE(OpenLease(*client_).ok());
}

// Peer connections count against the tenant of the session they are bound
// to: one uid's sessions together hold at most its share.
class TenantPeerTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    // 16 peer connections in all; a tenant may hold 25 %: 4.
    o.extra_flags = {"--peer_max_connections=16"};
    return o;
  }
};

TEST_F(TenantPeerTest, PeerConnectionsCountAgainstTheTenant) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software device only";
  client::Session a = OpenFdSession();
  client::Session b = OpenFdSession();
  std::vector<std::unique_ptr<peer::Peer>> peers;
  for (int i = 0; i < 2; ++i) peers.push_back(ConnectPeer(a));
  for (int i = 0; i < 2; ++i) peers.push_back(ConnectPeer(b));
  auto ticket = client::PeerTicket::Create(b);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  absl::StatusOr<std::unique_ptr<peer::Peer>> fifth =
      TryConnectPeer(ticket->peer_address(), ticket->ticket());
  ASSERT_FALSE(fifth.ok());
  EXPECT_EQ(fifth.status().code(), absl::StatusCode::kResourceExhausted)
      << fifth.status();
  EXPECT_TRUE(absl::StrContains(fifth.status().message(),
                                "LIMIT_TENANT_PEER_CONNECTIONS"))
      << fifth.status();
  // A disconnect gives the slot back.
  peers.pop_back();
  absl::StatusOr<std::unique_ptr<peer::Peer>> again;
  for (int i = 0; i < 50; ++i) {
    again = TryConnectPeer(ticket->peer_address(), ticket->ticket());
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST(TenantsFileErrorTest, BadFileRefusesToStart) {
  std::string path =
      ::testing::TempDir() + "/bad-tenants-" + std::to_string(getpid());
  std::ofstream(path) << "tenant x uids=0\ntenant y uids=0\n";
  MrdProcessOptions o;
  o.extra_flags = {"--tenants_file=" + path};
  absl::StatusOr<std::unique_ptr<MrdProcess>> mrd = MrdProcess::Start(o);
  EXPECT_FALSE(mrd.ok());
  std::remove(path.c_str());
}

}  // namespace
}  // namespace mrd::testing
