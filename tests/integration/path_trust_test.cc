// Issue 8, item 8: mrd (root) started in a runtime directory owned by another
// uid; that uid renamed fd.sock and listened in its place, and a root client
// handed it a memfd. mrd now refuses to start in a directory (or under one)
// that anyone but itself or root could change, and refuses a --shm_dir off
// tmpfs/hugetlbfs. Each test runs the real mrd binary.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/match.h"
#include "client/lib/mrd_client.h"
#include "tests/integration/mrd_process.h"

namespace mrd::testing {
namespace {

constexpr uid_t kNobody = 65534;

// A fresh directory under `parent` (mode 0700, ours), removed at the end.
class TempDir {
 public:
  explicit TempDir(const std::string& parent) {
    std::string pattern = parent + "/mrd-trust-XXXXXX";
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class PathTrustTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty()) << std::strerror(errno);
    ASSERT_FALSE(shm_.path().empty()) << std::strerror(errno);
  }

  MrdProcessOptions Options(const std::string& runtime_dir,
                            const std::string& shm_dir = "") {
    MrdProcessOptions options;
    options.runtime_dir = runtime_dir;
    options.shm_dir = shm_dir.empty() ? shm_.path() : shm_dir;
    return options;
  }

  // mrd must exit 1 with a log line that contains every one of `words`.
  void ExpectRefused(const MrdProcessOptions& options,
                     std::initializer_list<std::string> words) {
    absl::StatusOr<MrdExit> exit = MrdProcess::RunToExit(options);
    ASSERT_TRUE(exit.ok()) << exit.status();
    EXPECT_TRUE(WIFEXITED(exit->status) && WEXITSTATUS(exit->status) == 1)
        << "status " << exit->status << "\n"
        << exit->log;
    EXPECT_TRUE(absl::StrContains(exit->log, "refusing to start")) << exit->log;
    for (const std::string& word : words) {
      EXPECT_TRUE(absl::StrContains(exit->log, word))
          << "missing '" << word << "' in:\n"
          << exit->log;
    }
  }

  // Starts, serves, a client registers through the fd socket, stops clean.
  void ExpectServes(const MrdProcessOptions& options) {
    absl::StatusOr<std::unique_ptr<MrdProcess>> mrd =
        MrdProcess::Start(options);
    ASSERT_TRUE(mrd.ok()) << mrd.status();
    {
      client::ClientOptions o;
      o.socket_path = (*mrd)->grpc_socket();
      o.fd_socket_path = (*mrd)->fd_socket();
      absl::StatusOr<client::Client> c = client::Client::Connect(o);
      ASSERT_TRUE(c.ok()) << c.status();
      absl::StatusOr<client::Session> session = client::Session::OpenFd(*c);
      ASSERT_TRUE(session.ok()) << session.status();
      absl::StatusOr<client::Buffer> buffer =
          client::Buffer::Create(*session, 4096);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
    }
    absl::Status stopped = (*mrd)->Stop();
    EXPECT_TRUE(stopped.ok()) << stopped;
  }

  TempDir tmp_{"/tmp"};
  TempDir shm_{"/dev/shm"};
};

bool IsRoot() { return geteuid() == 0; }

// The reported attack: a runtime directory owned by uid 65534.
TEST_F(PathTrustTest, RuntimeDirOwnedByAnotherUidIsRefused) {
  if (!IsRoot()) GTEST_SKIP() << "needs root to chown";
  std::string run = tmp_.path() + "/run";
  ASSERT_EQ(mkdir(run.c_str(), 0755), 0);
  ASSERT_EQ(chown(run.c_str(), kNobody, kNobody), 0);
  ExpectRefused(Options(run), {run, "owned by uid 65534"});
  // Nothing was bound there.
  EXPECT_FALSE(std::filesystem::exists(run + "/fd.sock"));
  EXPECT_FALSE(std::filesystem::exists(run + "/mrd.sock"));
}

TEST_F(PathTrustTest, ParentOwnedByAnotherUidIsRefused) {
  if (!IsRoot()) GTEST_SKIP() << "needs root to chown";
  ASSERT_EQ(chown(tmp_.path().c_str(), kNobody, kNobody), 0);
  ExpectRefused(Options(tmp_.path() + "/run"),
                {tmp_.path() + " is owned by uid 65534"});
}

TEST_F(PathTrustTest, GroupWritableParentIsRefused) {
  ASSERT_EQ(chmod(tmp_.path().c_str(), 0770), 0);
  ExpectRefused(Options(tmp_.path() + "/run"),
                {tmp_.path() + " is writable by its group", "0770"});
}

TEST_F(PathTrustTest, WorldWritableRuntimeDirIsRefusedEvenSticky) {
  std::string run = tmp_.path() + "/run";
  ASSERT_EQ(mkdir(run.c_str(), 0755), 0);
  ASSERT_EQ(chmod(run.c_str(), 01777), 0);
  ExpectRefused(Options(run), {run + " is writable by everyone", "1777"});
}

TEST_F(PathTrustTest, SymlinkedRuntimeDirIsRefused) {
  std::string real = tmp_.path() + "/real";
  std::string link = tmp_.path() + "/link";
  ASSERT_EQ(mkdir(real.c_str(), 0755), 0);
  ASSERT_EQ(symlink(real.c_str(), link.c_str()), 0);
  ExpectRefused(Options(link), {link + " is a symbolic link"});
}

// /tmp-style: a sticky world-writable parent with mrd's own private
// subdirectory in it is fine; mrd creates the subdirectory 0755.
TEST_F(PathTrustTest, StickyParentWithPrivateSubdirStarts) {
  ASSERT_EQ(chmod(tmp_.path().c_str(), 01777), 0);
  std::string run = tmp_.path() + "/run";
  ExpectServes(Options(run));
  struct stat st;
  ASSERT_EQ(lstat(run.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_uid, geteuid());
  EXPECT_EQ(st.st_mode & 07777, 0755u);
}

// In a sticky parent, a subdirectory squatted by another uid is refused.
TEST_F(PathTrustTest, SquattedSubdirOfStickyParentIsRefused) {
  if (!IsRoot()) GTEST_SKIP() << "needs root to chown";
  ASSERT_EQ(chmod(tmp_.path().c_str(), 01777), 0);
  std::string run = tmp_.path() + "/run";
  ASSERT_EQ(mkdir(run.c_str(), 0700), 0);
  ASSERT_EQ(chown(run.c_str(), kNobody, kNobody), 0);
  ExpectRefused(Options(run), {run, "owned by uid 65534"});
}

// An explicit --fd_socket in a directory others can write is refused too.
TEST_F(PathTrustTest, ExplicitSocketInUntrustedDirIsRefused) {
  std::string open_dir = tmp_.path() + "/open";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0755), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0777), 0);
  MrdProcessOptions options = Options(tmp_.path() + "/run");
  options.extra_flags.push_back("--fd_socket=" + open_dir + "/fd.sock");
  ExpectRefused(options, {open_dir + " is writable by everyone"});
}

// Today every import fails with a hex filesystem id; now mrd refuses to
// start and names the filesystem.
TEST_F(PathTrustTest, ShmDirOffTmpfsIsRefusedNamingTheFilesystem) {
  // The working directory of ctest: the build tree, on a disk filesystem.
  char cwd[PATH_MAX];
  ASSERT_NE(getcwd(cwd, sizeof(cwd)), nullptr);
  TempDir disk(cwd);
  ASSERT_FALSE(disk.path().empty());
  struct statfs fs;
  ASSERT_EQ(statfs(disk.path().c_str(), &fs), 0);
  if (fs.f_type == 0x01021994 /* tmpfs */) {
    GTEST_SKIP() << "the build tree is on tmpfs";
  }
  std::string shm = disk.path() + "/shm";
  ASSERT_EQ(mkdir(shm.c_str(), 0755), 0);
  std::initializer_list<std::string> words = {
      shm, "not on tmpfs or hugetlbfs",
      fs.f_type == 0xEF53 ? "is on ext2/ext3/ext4" : "is on "};
  ExpectRefused(Options(tmp_.path() + "/run", shm), words);
  EXPECT_FALSE(std::filesystem::exists(tmp_.path() + "/run/fd.sock"));
}

TEST_F(PathTrustTest, ShmDirWritableByOthersWithoutStickyIsRefused) {
  std::string shm = shm_.path() + "/open";
  ASSERT_EQ(mkdir(shm.c_str(), 0755), 0);
  ASSERT_EQ(chmod(shm.c_str(), 0777), 0);
  ExpectRefused(Options(tmp_.path() + "/run", shm),
                {shm + " is writable by everyone", "not sticky"});
}

// mrd creates a missing --shm_dir sticky and world-writable, like /dev/shm,
// and serves.
TEST_F(PathTrustTest, MissingShmDirIsCreatedStickyAndServes) {
  std::string shm = shm_.path() + "/mrd";
  ExpectServes(Options(tmp_.path() + "/run", shm));
  struct stat st;
  ASSERT_EQ(lstat(shm.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 01777u);
  EXPECT_EQ(st.st_uid, geteuid());
}

}  // namespace
}  // namespace mrd::testing
