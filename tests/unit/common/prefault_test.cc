// server/common/prefault.h: a fresh mapping of a written memfd gets its page
// tables filled (the Rss of that mapping in /proc/self/smaps), by as many
// threads as the configuration and the CPUs allow, and never below the size
// threshold or when turned off.
#include "server/common/prefault.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "server/common/tsan.h"
#include "tests/support/mapped_pages.h"

namespace mrd {
namespace {

constexpr uint64_t kSize = uint64_t{96} << 20;

using test_support::MappedBytes;

// A written memfd and a second, fresh mapping of it.
class PrefaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fd_ = memfd_create("prefault-test", MFD_CLOEXEC);
    ASSERT_GE(fd_, 0);
    ASSERT_EQ(ftruncate(fd_, kSize), 0);
    writer_ = mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    ASSERT_NE(writer_, MAP_FAILED);
    for (uint64_t i = 0; i < kSize; i += 4096)
      static_cast<char*>(writer_)[i] = 1;
    fresh_ = mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    ASSERT_NE(fresh_, MAP_FAILED);
    ASSERT_EQ(MappedBytes(fresh_), 0u);
  }
  void TearDown() override {
    ConfigurePrefault(kDefaultPrefaultThreads);
    munmap(fresh_, kSize);
    munmap(writer_, kSize);
    close(fd_);
  }
  int fd_ = -1;
  void* writer_ = MAP_FAILED;
  void* fresh_ = MAP_FAILED;
};

uint32_t Cpus() {
  return static_cast<uint32_t>(
      std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)));
}

TEST_F(PrefaultTest, FillsTheWholeRangeWithEveryThreadAllowed) {
  ConfigurePrefault(8);
  const uint32_t threads = Prefault(fresh_, kSize);
  EXPECT_EQ(threads, std::min<uint32_t>(8, Cpus()));
  EXPECT_EQ(MappedBytes(fresh_), kSize);
  // The writer's pages are the same pages: nothing was copied.
  EXPECT_EQ(static_cast<char*>(fresh_)[kSize - 4096], 1);
}

TEST_F(PrefaultTest, HelpersGoBackAfterEachCallEvenWhenCallsOverlap) {
  ConfigurePrefault(8);
  std::vector<std::thread> callers;
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([this] { Prefault(fresh_, kSize); });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(MappedBytes(fresh_), kSize);
  // The allowance is whole again: a lone call gets every thread.
  EXPECT_EQ(Prefault(fresh_, kSize), std::min<uint32_t>(8, Cpus()));
}

TEST_F(PrefaultTest, OneThreadStillFillsItAlone) {
  ConfigurePrefault(1);
  EXPECT_EQ(Prefault(fresh_, kSize), 1u);
  EXPECT_EQ(MappedBytes(fresh_), kSize);
}

TEST_F(PrefaultTest, OffOrBelowTheThresholdLeavesTheMappingToThePin) {
  ConfigurePrefault(0);
  EXPECT_EQ(Prefault(fresh_, kSize), 0u);
  EXPECT_EQ(MappedBytes(fresh_), 0u);
  ConfigurePrefault(8);
  EXPECT_EQ(Prefault(fresh_, kPrefaultMinBytes - 4096), 0u);
  EXPECT_EQ(MappedBytes(fresh_), 0u);
}

// A helper thread that cannot be started (here: the process limit of its
// user is reached) only means fewer helpers: the caller fills the range
// alone, and the allowance is whole again afterwards. In a child process,
// which gives up root (root is not held to RLIMIT_NPROC) and lowers it.
TEST_F(PrefaultTest, AHelperThatCannotStartLeavesTheWorkToTheCaller) {
  if (Cpus() < 2) GTEST_SKIP() << "one CPU: prefaulting starts no helper";
#ifdef MRD_TSAN
  GTEST_SKIP() << "TSan ends a forked child that starts a thread (its own "
                  "runtime thread makes the parent multi-threaded)";
#endif
  ConfigurePrefault(8);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) {
      _exit(10);
    }
    rlimit limit{};
    if (getrlimit(RLIMIT_NPROC, &limit) != 0) _exit(11);
    const rlimit tight{1, limit.rlim_max};  // this process is one already
    if (setrlimit(RLIMIT_NPROC, &tight) != 0) _exit(12);
    if (Prefault(fresh_, kSize) != 1) _exit(13);  // the caller alone
    if (MappedBytes(fresh_) != kSize) _exit(14);  // all of it
    if (setrlimit(RLIMIT_NPROC, &limit) != 0) _exit(15);
    // The helper that did not start went back to the allowance.
    if (Prefault(fresh_, kSize) != std::min<uint32_t>(8, Cpus())) _exit(16);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10-12: setup, 13: a helper started, 14: range not filled, "
         "16: allowance not whole";
}

TEST_F(PrefaultTest, ARangePastTheEndOfTheFileIsNotAnError) {
  // The mapping is larger than the file: the tail would SIGBUS on access.
  void* big =
      mmap(nullptr, 2 * kSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  ASSERT_NE(big, MAP_FAILED);
  ConfigurePrefault(8);
  EXPECT_GE(Prefault(big, 2 * kSize), 1u);  // no crash, no signal
  EXPECT_EQ(MappedBytes(big) % 4096, 0u);
  munmap(big, 2 * kSize);
}

}  // namespace
}  // namespace mrd
