#include "client/lib/memfd.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "gtest/gtest.h"
#include "mrd/status.h"

namespace mrd::client {
namespace {

TEST(MappedMemfdTest, CreateSealsAgainstShrinkAndGrow) {
  absl::StatusOr<MappedMemfd> m = MappedMemfd::Create(8192, "seal-test");
  ASSERT_TRUE(m.ok()) << m.status();
  int seals = ::fcntl(m->fd(), F_GET_SEALS);
  ASSERT_GE(seals, 0);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_GROW);
  // Writable: mrd needs no F_SEAL_WRITE for writable imports.
  EXPECT_FALSE(seals & F_SEAL_WRITE);
  EXPECT_FALSE(seals & F_SEAL_SEAL);  // more seals may still be added
  EXPECT_EQ(::ftruncate(m->fd(), 4096), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::ftruncate(m->fd(), 16384), -1);
  EXPECT_EQ(errno, EPERM);
}

TEST(MappedMemfdTest, CreateSizesMapsAndIsCloseOnExec) {
  absl::StatusOr<MappedMemfd> m = MappedMemfd::Create(10000, "size-test");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->size(), 10000u);
  struct stat st;
  ASSERT_EQ(::fstat(m->fd(), &st), 0);
  EXPECT_EQ(st.st_size, 10000);
  EXPECT_TRUE(::fcntl(m->fd(), F_GETFD) & FD_CLOEXEC);
  // The mapping and the file are the same memory.
  std::memcpy(m->data(), "hello", 5);
  char back[5];
  ASSERT_EQ(::pread(m->fd(), back, 5, 0), 5);
  EXPECT_EQ(std::memcmp(back, "hello", 5), 0);
}

TEST(MappedMemfdTest, ZeroSizeIsInvalidParameter) {
  absl::StatusOr<MappedMemfd> m = MappedMemfd::Create(0, "zero");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GetErrorDetail(m.status()).seed_status(),
            ::mrd::STATUS_INVALID_PARAMETER);
}

TEST(MappedMemfdTest, DestructionClosesTheFd) {
  int fd = -1;
  {
    absl::StatusOr<MappedMemfd> m = MappedMemfd::Create(4096, "close");
    ASSERT_TRUE(m.ok());
    MappedMemfd moved = *std::move(m);
    fd = moved.fd();
    // Deliberately reads the moved-from object.
    EXPECT_EQ(m->fd(), -1);  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(m->data(), nullptr);
  }
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);
  EXPECT_EQ(errno, EBADF);
}

}  // namespace
}  // namespace mrd::client
