// MapMemfd, OpenSharedFile, MapHandedOver and MappedFile::Span against real
// memfds, pipes, sockets and files in private directories under /dev/shm and
// on disk.
#include "server/fd_socket/memory_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "server/common/prefault.h"
#include "tests/support/huge_pages.h"
#include "tests/support/mapped_pages.h"
#include "tests/unit/fd_socket/fd_socket_test_util.h"

namespace mrd::fd_socket {
namespace {

using ::mrd::fd_socket::testing::CountOpenFds;
using ::mrd::fd_socket::testing::FdIsOpen;
using ::mrd::fd_socket::testing::HasError;
using ::mrd::fd_socket::testing::MakeMemfd;
using ::mrd::fd_socket::testing::MakeSealedMemfd;
using ::mrd::fd_socket::testing::TempDir;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kDenied = absl::StatusCode::kPermissionDenied;

MemfdImportOptions ReadOnly() { return MemfdImportOptions{}; }
MemfdImportOptions Writable() {
  MemfdImportOptions options;
  options.writable = true;
  return options;
}

// The permissions column ("r--s", "rw-s") of the /proc/self/maps line that
// starts at `address`.
std::string MappingPermissions(const void* address) {
  std::ifstream maps("/proc/self/maps");
  const std::string start =
      absl::StrCat(absl::Hex(reinterpret_cast<uintptr_t>(address)), "-");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.rfind(start, 0) == 0) {
      const size_t space = line.find(' ');
      return line.substr(space + 1, 4);
    }
  }
  return "";
}

// Reopens `fd` through /proc with other access flags.
UniqueFd Reopen(int fd, int flags) {
  const std::string path = absl::StrCat("/proc/self/fd/", fd);
  UniqueFd reopened(::open(path.c_str(), flags | O_CLOEXEC));
  EXPECT_TRUE(reopened.valid()) << path << ": " << std::strerror(errno);
  return reopened;
}

// ---------------------------------------------------------------------------
// MapMemfd: accepted

TEST(MapMemfdTest, SealedMemfdIsMappedAndItsBytesAreVisible) {
  const std::string contents = "hello from the client's memfd";
  UniqueFd memfd = MakeMemfd(contents, F_SEAL_SHRINK);
  struct stat st;
  ASSERT_EQ(::fstat(memfd.get(), &st), 0);
  UniqueFd client_copy(::dup(memfd.get()));

  absl::StatusOr<std::unique_ptr<MappedFile>> file =
      MapMemfd(std::move(memfd), ReadOnly());
  ASSERT_TRUE(file.ok()) << file.status();
  const MappedFile& f = **file;
  EXPECT_EQ(f.size(), contents.size());
  EXPECT_FALSE(f.writable());
  EXPECT_EQ(f.source(), "memfd");
  EXPECT_EQ(f.device(), static_cast<uint64_t>(st.st_dev));
  EXPECT_EQ(f.inode(), static_cast<uint64_t>(st.st_ino));
  ASSERT_NE(f.address(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.address()) % 4096, 0u);
  EXPECT_EQ(
      absl::string_view(static_cast<const char*>(f.address()), contents.size()),
      contents);
  // Shared, not a private copy: the client's later writes show through.
  ASSERT_EQ(::pwrite(client_copy.get(), "J", 1, 0), 1);
  EXPECT_EQ(static_cast<const char*>(f.address())[0], 'J');
  EXPECT_EQ(MappingPermissions(f.address()), "r--s");
}

TEST(MapMemfdTest, WritableImportWritesThroughToTheFile) {
  UniqueFd memfd = MakeMemfd("........", F_SEAL_SHRINK | F_SEAL_GROW);
  UniqueFd client_copy(::dup(memfd.get()));
  auto file = MapMemfd(std::move(memfd), Writable());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->writable());
  EXPECT_EQ(MappingPermissions((*file)->address()), "rw-s");
  std::memcpy((*file)->address(), "written", 7);
  char back[8] = {};
  ASSERT_EQ(::pread(client_copy.get(), back, 7, 0), 7);
  EXPECT_STREQ(back, "written");
}

TEST(MapMemfdTest, ExpectedSizeAndMaxSizeAreInclusive) {
  MemfdImportOptions options;
  options.expected_size = 8192;
  options.max_size = 8192;
  auto file = MapMemfd(MakeSealedMemfd(8192), options);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->size(), 8192u);
}

TEST(MapMemfdTest, ReadOnlyFdCanBeImportedReadOnly) {
  UniqueFd memfd = MakeSealedMemfd(4096);
  auto file = MapMemfd(Reopen(memfd.get(), O_RDONLY), ReadOnly());
  ASSERT_TRUE(file.ok()) << file.status();
}

TEST(MapMemfdTest, WriteSealedMemfdCanBeImportedReadOnly) {
  auto file =
      MapMemfd(MakeMemfd("data", F_SEAL_SHRINK | F_SEAL_WRITE), ReadOnly());
  ASSERT_TRUE(file.ok()) << file.status();
}

TEST(MapMemfdTest, DestructorUnmapsAndClosesTheFd) {
  auto file = MapMemfd(MakeSealedMemfd(3 * 4096), ReadOnly());
  ASSERT_TRUE(file.ok()) << file.status();
  const int fd = (*file)->fd();
  void* address = (*file)->address();
  ASSERT_TRUE(FdIsOpen(fd));
  unsigned char pages[3];
  ASSERT_EQ(::mincore(address, 3 * 4096, pages), 0);
  file->reset();
  EXPECT_FALSE(FdIsOpen(fd));
  errno = 0;
  EXPECT_EQ(::mincore(address, 3 * 4096, pages), -1);
  EXPECT_EQ(errno, ENOMEM) << "the range is still mapped";
}

// The destructor drops the page tables a piece at a time before it unmaps:
// a mapping of several pieces and a partial last page goes entirely, and the
// file keeps every byte written through it.
TEST(MapMemfdTest, DestructorUnmapsAMappingOfManyPiecesWhole) {
  constexpr uint64_t kSize = (uint64_t{5} << 20) + 4096 + 100;
  UniqueFd fd = MakeSealedMemfd(kSize);
  UniqueFd kept(::dup(fd.get()));
  ASSERT_TRUE(kept.valid());
  auto file = MapMemfd(std::move(fd), Writable());
  ASSERT_TRUE(file.ok()) << file.status();
  char* address = static_cast<char*>((*file)->address());
  std::memset(address, 'm', kSize);
  file->reset();
  const uint64_t pages = (kSize + 4095) / 4096;
  std::vector<unsigned char> residency(pages);
  for (uint64_t page = 0; page < pages; ++page) {
    errno = 0;
    EXPECT_EQ(::mincore(address + page * 4096, 4096, residency.data()), -1)
        << "page " << page << " is still mapped";
    EXPECT_EQ(errno, ENOMEM);
  }
  std::string back(kSize, '\0');
  ASSERT_EQ(::pread(kept.get(), back.data(), kSize, 0),
            static_cast<ssize_t>(kSize));
  EXPECT_EQ(back, std::string(kSize, 'm'));
}

// ---------------------------------------------------------------------------
// MapMemfd: refused, each for its own reason, and the fd is always closed.

TEST(MapMemfdTest, RefusalClosesTheFd) {
  UniqueFd memfd = MakeMemfd("unsealed", 0);
  const int number = memfd.get();
  const int before = CountOpenFds();
  auto file = MapMemfd(std::move(memfd), ReadOnly());
  EXPECT_FALSE(file.ok());
  EXPECT_FALSE(FdIsOpen(number));
  EXPECT_EQ(CountOpenFds(), before - 1);
}

TEST(MapMemfdTest, ClosedFdNumberIsBadFd) {
  int number;
  {
    UniqueFd memfd = MakeSealedMemfd(4096);
    number = memfd.get();
  }
  ASSERT_FALSE(FdIsOpen(number));
  auto file = MapMemfd(UniqueFd(number), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "BAD_FD"));
  EXPECT_EQ(GetErrorDetail(file.status()).seed_status(),
            ::mrd::STATUS_INVALID_PARAMETER);
  EXPECT_TRUE(
      HasError(MapMemfd(UniqueFd(), ReadOnly()).status(), kInvalid, "BAD_FD"));
}

TEST(MapMemfdTest, OPathFdIsBadFd) {
  UniqueFd memfd = MakeSealedMemfd(4096);
  auto file = MapMemfd(Reopen(memfd.get(), O_PATH), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "BAD_FD"));
}

TEST(MapMemfdTest, PipeIsNotARegularFile) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  UniqueFd write_end(fds[1]);
  auto file = MapMemfd(UniqueFd(fds[0]), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "NOT_REGULAR_FILE"));
  EXPECT_NE(file.status().message().find("pipe"), absl::string_view::npos)
      << file.status();
}

TEST(MapMemfdTest, SocketIsNotARegularFile) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  UniqueFd other(fds[1]);
  auto file = MapMemfd(UniqueFd(fds[0]), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "NOT_REGULAR_FILE"));
}

TEST(MapMemfdTest, DirectoryIsNotARegularFile) {
  auto file = MapMemfd(UniqueFd(::open("/dev/shm", O_RDONLY | O_DIRECTORY)),
                       ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "NOT_REGULAR_FILE"));
}

TEST(MapMemfdTest, FileOnDiskIsNotShmem) {
  // The build directory (or /tmp) must be on a real filesystem for this.
  std::string dir = std::filesystem::current_path().string();
  struct statfs fs;
  ASSERT_EQ(::statfs(dir.c_str(), &fs), 0);
  if (static_cast<uint32_t>(fs.f_type) == TMPFS_MAGIC) {
    dir = "/tmp";
    ASSERT_EQ(::statfs(dir.c_str(), &fs), 0);
    if (static_cast<uint32_t>(fs.f_type) == TMPFS_MAGIC) {
      GTEST_SKIP() << "no disk-backed directory to put a file in";
    }
  }
  TempDir temp(dir);
  temp.WriteFile("on-disk", "bytes on disk");
  UniqueFd fd(::open(temp.Sub("on-disk").c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  auto file = MapMemfd(std::move(fd), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "NOT_SHMEM"));
}

TEST(MapMemfdTest, UnsealedMemfdIsRefusedWithAdvice) {
  auto file = MapMemfd(MakeMemfd("unsealed", 0), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "NOT_SEALED"));
  EXPECT_NE(file.status().message().find("F_SEAL_SHRINK"),
            absl::string_view::npos);
}

TEST(MapMemfdTest, MemfdThatCannotBeSealedIsRefused) {
  // Without MFD_ALLOW_SEALING a memfd carries F_SEAL_SEAL and nothing else.
  UniqueFd memfd(::memfd_create("no-sealing", MFD_CLOEXEC));
  ASSERT_TRUE(memfd.valid());
  ASSERT_EQ(::ftruncate(memfd.get(), 4096), 0);
  auto file = MapMemfd(std::move(memfd), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "NOT_SEALED"));
}

TEST(MapMemfdTest, OtherSealsWithoutShrinkAreRefused) {
  auto file = MapMemfd(MakeMemfd("grow-sealed", F_SEAL_GROW), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "NOT_SEALED"));
}

TEST(MapMemfdTest, TmpfsFilePassedAsFdIsNotSealed) {
  // Files under /dev/shm are tmpfs but can never be sealed.
  TempDir temp("/dev/shm");
  temp.WriteFile("plain", "tmpfs but no seals");
  UniqueFd fd(::open(temp.Sub("plain").c_str(), O_RDWR | O_CLOEXEC));
  auto file = MapMemfd(std::move(fd), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "NOT_SEALED"));
}

TEST(MapMemfdTest, EmptyMemfdIsRefused) {
  auto file = MapMemfd(MakeMemfd("", F_SEAL_SHRINK), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "EMPTY_FILE"));
}

TEST(MapMemfdTest, SizeMismatchNamesBothSizes) {
  MemfdImportOptions options;
  options.expected_size = 8192;
  auto file = MapMemfd(MakeSealedMemfd(4096), options);
  EXPECT_TRUE(HasError(file.status(), kInvalid, "SIZE_MISMATCH"));
  EXPECT_NE(file.status().message().find("4096"), absl::string_view::npos);
  EXPECT_NE(file.status().message().find("8192"), absl::string_view::npos);
}

TEST(MapMemfdTest, TooBigIsALimit) {
  MemfdImportOptions options;
  options.max_size = 4096;
  auto file = MapMemfd(MakeSealedMemfd(4097), options);
  EXPECT_TRUE(HasError(file.status(), absl::StatusCode::kResourceExhausted,
                       "LIMIT_BUFFER_SIZE"));
  EXPECT_EQ(GetErrorDetail(file.status()).seed_status(),
            ::mrd::STATUS_INSUFFICIENT_RESOURCES);
}

TEST(MapMemfdTest, WritableOnReadOnlyFdIsRefused) {
  UniqueFd memfd = MakeSealedMemfd(4096);
  auto file = MapMemfd(Reopen(memfd.get(), O_RDONLY), Writable());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "FD_NOT_WRITABLE"));
}

TEST(MapMemfdTest, WriteOnlyFdIsRefused) {
  UniqueFd memfd = MakeSealedMemfd(4096);
  auto file = MapMemfd(Reopen(memfd.get(), O_WRONLY), ReadOnly());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "FD_NOT_READABLE"));
}

TEST(MapMemfdTest, WritableOnWriteSealedMemfdIsRefused) {
  auto file =
      MapMemfd(MakeMemfd("data", F_SEAL_SHRINK | F_SEAL_WRITE), Writable());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "WRITE_SEALED"));
  EXPECT_NE(file.status().message().find("F_SEAL_WRITE"),
            absl::string_view::npos);
}

TEST(MapMemfdTest, WritableOnFutureWriteSealedMemfdIsRefused) {
  auto file = MapMemfd(MakeMemfd("data", F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE),
                       Writable());
  EXPECT_TRUE(HasError(file.status(), kInvalid, "WRITE_SEALED"));
}

TEST(MapMemfdTest, WritableMappingBlocksALaterWriteSeal) {
  // Why a writable import is safe against F_SEAL_WRITE added afterwards: the
  // kernel refuses the seal while our shared writable mapping exists.
  UniqueFd memfd = MakeSealedMemfd(4096);
  UniqueFd client_copy(::dup(memfd.get()));
  auto file = MapMemfd(std::move(memfd), Writable());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(::fcntl(client_copy.get(), F_ADD_SEALS, F_SEAL_WRITE), -1);
  EXPECT_EQ(errno, EBUSY);
}

// ---------------------------------------------------------------------------
// Span

class SpanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto file = MapMemfd(MakeSealedMemfd(kSize), ReadOnly());
    ASSERT_TRUE(file.ok()) << file.status();
    file_ = *std::move(file);
  }
  static constexpr uint64_t kSize = 3 * 4096;
  std::unique_ptr<MappedFile> file_;
};

TEST_F(SpanTest, SpanPointsIntoTheMappingWithFdAndOffset) {
  auto span = file_->Span(100, 5000);
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(span->host_address, static_cast<char*>(file_->address()) + 100);
  EXPECT_EQ(span->length, 5000u);
  EXPECT_EQ(span->fd, file_->fd());
  EXPECT_EQ(span->file_offset, 100u);
  // A memfd of base pages, known from the mapping (no fstatfs per pin).
  EXPECT_EQ(span->pages, device::SpanPages::kBase);
}

// A memfd in huge pages says so in its spans, found once at import.
TEST(MapMemfdTest, SpansOfAHugePageMemfdSayHugePages) {
  constexpr uint64_t kHuge = uint64_t{2} << 20;
  test_support::HugePagePool pool(1);
  if (!pool.ok()) GTEST_SKIP() << "cannot raise vm.nr_hugepages (not root)";
  UniqueFd fd(::memfd_create(
      "huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB | MFD_HUGE_2MB));
  ASSERT_TRUE(fd.valid()) << std::strerror(errno);
  ASSERT_EQ(::ftruncate(fd.get(), kHuge), 0);
  ASSERT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
  auto file = MapMemfd(std::move(fd), Writable());
  ASSERT_TRUE(file.ok()) << file.status();
  auto span = (*file)->Span(0, kHuge);
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(span->pages, device::SpanPages::kHuge);
}

TEST_F(SpanTest, WholeFileAndLastByteAreValid) {
  EXPECT_TRUE(file_->Span(0, kSize).ok());
  EXPECT_TRUE(file_->Span(kSize - 1, 1).ok());
}

TEST_F(SpanTest, ZeroLength) {
  EXPECT_TRUE(HasError(file_->Span(0, 0).status(), kInvalid, "ZERO_LENGTH"));
}

TEST_F(SpanTest, OffsetPastEndNamesOffsetAndSize) {
  auto span = file_->Span(kSize, 1);
  EXPECT_TRUE(HasError(span.status(), kInvalid, "OFFSET_PAST_END"));
  EXPECT_NE(span.status().message().find(absl::StrCat(kSize)),
            absl::string_view::npos);
  EXPECT_TRUE(
      HasError(file_->Span(std::numeric_limits<uint64_t>::max(), 1).status(),
               kInvalid, "OFFSET_PAST_END"));
}

TEST_F(SpanTest, LengthOverflow) {
  auto span = file_->Span(1, std::numeric_limits<uint64_t>::max());
  EXPECT_TRUE(HasError(span.status(), kInvalid, "LENGTH_OVERFLOW"));
  EXPECT_NE(span.status().message().find("18446744073709551615"),
            absl::string_view::npos);
}

TEST_F(SpanTest, LengthPastBufferNamesTheValues) {
  auto span = file_->Span(4096, kSize);
  EXPECT_TRUE(HasError(span.status(), kInvalid, "LENGTH_PAST_BUFFER"));
  EXPECT_EQ(GetErrorDetail(span.status()).seed_status(),
            ::mrd::STATUS_INVALID_PARAMETER);
  const std::string message(span.status().message());
  EXPECT_NE(message.find("4096"), std::string::npos) << message;
  EXPECT_NE(message.find(absl::StrCat(kSize)), std::string::npos) << message;
  EXPECT_NE(message.find(absl::StrCat(4096 + kSize)), std::string::npos)
      << message;
}

// ---------------------------------------------------------------------------
// OpenSharedFile

class SharedFileTest : public ::testing::Test {
 protected:
  SharedFileTest() : dir_("/dev/shm") {}
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    dir_fd_.Reset(
        ::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    ASSERT_TRUE(dir_fd_.valid());
  }
  absl::StatusOr<std::unique_ptr<MappedFile>> Open(
      absl::string_view path, bool writable = false,
      std::vector<uint32_t> owners = {}) {
    SharedFileOptions options;
    options.writable = writable;
    options.allowed_owner_uids = std::move(owners);
    return OpenSharedFile(dir_fd_.get(), path, options);
  }

  TempDir dir_;
  UniqueFd dir_fd_;
};

TEST_F(SharedFileTest, FileInTheDirectoryIsMapped) {
  dir_.WriteFile("buffer.bin", "shared bytes");
  auto file = Open("buffer.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->size(), 12u);
  EXPECT_EQ((*file)->source(), "file:buffer.bin");
  EXPECT_FALSE((*file)->writable());
  EXPECT_EQ(absl::string_view(static_cast<const char*>((*file)->address()), 12),
            "shared bytes");
  struct stat st;
  ASSERT_EQ(::stat(dir_.Sub("buffer.bin").c_str(), &st), 0);
  EXPECT_EQ((*file)->inode(), static_cast<uint64_t>(st.st_ino));
  EXPECT_EQ((*file)->device(), static_cast<uint64_t>(st.st_dev));
}

TEST_F(SharedFileTest, FileInASubdirectoryIsMapped) {
  ASSERT_EQ(::mkdir(dir_.Sub("jobs").c_str(), 0700), 0);
  dir_.WriteFile("jobs/a.bin", "nested");
  auto file = Open("jobs/a.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->source(), "file:jobs/a.bin");
  EXPECT_TRUE(Open("./jobs/a.bin").ok());
}

TEST_F(SharedFileTest, WritableFileWritesThrough) {
  dir_.WriteFile("rw.bin", "........");
  auto file = Open("rw.bin", /*writable=*/true);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(MappingPermissions((*file)->address()), "rw-s");
  std::memcpy((*file)->address(), "RW", 2);
  std::ifstream in(dir_.Sub("rw.bin"));
  std::string back;
  std::getline(in, back);
  EXPECT_EQ(back, "RW......");
}

TEST_F(SharedFileTest, SymlinkIsRefused) {
  dir_.WriteFile("target.bin", "target");
  ASSERT_EQ(::symlink("target.bin", dir_.Sub("link.bin").c_str()), 0);
  EXPECT_TRUE(HasError(Open("link.bin").status(), kInvalid, "BAD_PATH"));
}

TEST_F(SharedFileTest, SymlinkPointingOutsideIsRefused) {
  TempDir outside("/dev/shm");
  outside.WriteFile("secret", "not yours");
  ASSERT_EQ(
      ::symlink(outside.Sub("secret").c_str(), dir_.Sub("escape").c_str()), 0);
  EXPECT_TRUE(HasError(Open("escape").status(), kInvalid, "BAD_PATH"));
}

TEST_F(SharedFileTest, SymlinkedParentDirectoryIsRefused) {
  ASSERT_EQ(::mkdir(dir_.Sub("real").c_str(), 0700), 0);
  dir_.WriteFile("real/x.bin", "x");
  ASSERT_EQ(::symlink("real", dir_.Sub("alias").c_str()), 0);
  EXPECT_TRUE(Open("real/x.bin").ok());
  EXPECT_TRUE(HasError(Open("alias/x.bin").status(), kInvalid, "BAD_PATH"));
}

TEST_F(SharedFileTest, DotDotIsRefused) {
  dir_.WriteFile("x", "x");
  EXPECT_TRUE(HasError(Open("../x").status(), kInvalid, "BAD_PATH"));
  EXPECT_TRUE(HasError(Open("sub/../x").status(), kInvalid, "BAD_PATH"));
  EXPECT_TRUE(HasError(Open("..").status(), kInvalid, "BAD_PATH"));
}

TEST_F(SharedFileTest, AbsoluteEmptyAndNulPathsAreRefused) {
  dir_.WriteFile("x", "x");
  EXPECT_TRUE(HasError(Open(dir_.Sub("x")).status(), kInvalid, "BAD_PATH"));
  EXPECT_TRUE(HasError(Open("").status(), kInvalid, "BAD_PATH"));
  EXPECT_TRUE(HasError(Open(absl::string_view("x\0y", 3)).status(), kInvalid,
                       "BAD_PATH"));
  EXPECT_TRUE(
      HasError(Open(std::string(5000, 'a')).status(), kInvalid, "BAD_PATH"));
}

TEST_F(SharedFileTest, FileUsedAsDirectoryIsABadPath) {
  dir_.WriteFile("x", "x");
  EXPECT_TRUE(HasError(Open("x/y").status(), kInvalid, "BAD_PATH"));
}

// A hard link gives a file a second name, possibly in this directory for a
// file that lives elsewhere on /dev/shm. Both names are refused while it
// has more than one.
TEST_F(SharedFileTest, HardLinkedFileIsRefusedUnderEitherName) {
  dir_.WriteFile("original", "data");
  ASSERT_TRUE(Open("original").ok());
  ASSERT_EQ(::link(dir_.Sub("original").c_str(), dir_.Sub("second").c_str()),
            0);
  EXPECT_TRUE(HasError(Open("second").status(), kDenied, "HARD_LINKED"));
  EXPECT_TRUE(HasError(Open("original").status(), kDenied, "HARD_LINKED"));
  ASSERT_EQ(::unlink(dir_.Sub("second").c_str()), 0);
  EXPECT_TRUE(Open("original").ok());
}

TEST_F(SharedFileTest, HardLinkToAFileOutsideIsRefused) {
  TempDir outside("/dev/shm");
  outside.WriteFile("secret", "not yours");
  ASSERT_EQ(::link(outside.Sub("secret").c_str(), dir_.Sub("in").c_str()), 0);
  EXPECT_TRUE(HasError(Open("in").status(), kDenied, "HARD_LINKED"));
}

TEST_F(SharedFileTest, MissingFileIsNotFound) {
  auto file = Open("nothing-here");
  EXPECT_TRUE(
      HasError(file.status(), absl::StatusCode::kNotFound, "NO_SUCH_FILE"));
  EXPECT_NE(file.status().message().find("nothing-here"),
            absl::string_view::npos);
}

TEST_F(SharedFileTest, ReadOnlyModeDeniesAWritableImport) {
  dir_.WriteFile("ro.bin", "read only", 0400);
  // Tests run as root, which the open itself would not stop: the mode check
  // is what refuses it.
  EXPECT_TRUE(HasError(Open("ro.bin", /*writable=*/true).status(), kDenied,
                       "MODE_DENIES_ACCESS"));
  EXPECT_TRUE(Open("ro.bin").ok());
}

TEST_F(SharedFileTest, WriteOnlyModeDeniesAnyImport) {
  dir_.WriteFile("wo.bin", "write only", 0200);
  auto file = Open("wo.bin");
  EXPECT_TRUE(HasError(file.status(), kDenied, "MODE_DENIES_ACCESS"));
  EXPECT_NE(file.status().message().find("0200"), absl::string_view::npos)
      << file.status();
}

TEST_F(SharedFileTest, OwnerMustBeAllowed) {
  dir_.WriteFile("mine.bin", "data");
  const uint32_t me = ::geteuid();
  auto file = Open("mine.bin", false, {me + 4242});
  EXPECT_TRUE(HasError(file.status(), kDenied, "OWNER_NOT_ALLOWED"));
  EXPECT_NE(file.status().message().find(absl::StrCat("uid ", me)),
            absl::string_view::npos);
  EXPECT_TRUE(Open("mine.bin", false, {me + 4242, me}).ok());
}

TEST_F(SharedFileTest, FileOfAnotherOwnerIsRefusedWhenOnlyIAmAllowed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  dir_.WriteFile("theirs.bin", "data");
  ASSERT_EQ(::chown(dir_.Sub("theirs.bin").c_str(), 4242, 4242), 0);
  EXPECT_TRUE(HasError(Open("theirs.bin", false, {0}).status(), kDenied,
                       "OWNER_NOT_ALLOWED"));
  EXPECT_TRUE(Open("theirs.bin", false, {4242}).ok());
}

TEST_F(SharedFileTest, DirectoryIsNotARegularFile) {
  ASSERT_EQ(::mkdir(dir_.Sub("d").c_str(), 0700), 0);
  EXPECT_TRUE(HasError(Open("d").status(), kInvalid, "NOT_REGULAR_FILE"));
}

TEST_F(SharedFileTest, FifoIsRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo(dir_.Sub("fifo").c_str(), 0600), 0);
  // Without O_NONBLOCK this open would wait for a writer forever.
  EXPECT_TRUE(HasError(Open("fifo").status(), kInvalid, "NOT_REGULAR_FILE"));
  EXPECT_TRUE(HasError(Open("fifo", /*writable=*/true).status(), kInvalid,
                       "NOT_REGULAR_FILE"));
}

TEST_F(SharedFileTest, EmptyFileIsRefused) {
  dir_.WriteFile("empty", "");
  EXPECT_TRUE(HasError(Open("empty").status(), kInvalid, "EMPTY_FILE"));
}

TEST_F(SharedFileTest, TooBigIsALimit) {
  dir_.WriteFile("big", std::string(4097, 'b'));
  SharedFileOptions options;
  options.max_size = 4096;
  EXPECT_TRUE(HasError(OpenSharedFile(dir_fd_.get(), "big", options).status(),
                       absl::StatusCode::kResourceExhausted,
                       "LIMIT_BUFFER_SIZE"));
}

TEST(SharedFileOnDiskTest, DirectoryOnDiskIsNotShmem) {
  std::string dir = std::filesystem::current_path().string();
  struct statfs fs;
  ASSERT_EQ(::statfs(dir.c_str(), &fs), 0);
  if (static_cast<uint32_t>(fs.f_type) == TMPFS_MAGIC) {
    GTEST_SKIP() << "the build directory is on tmpfs";
  }
  TempDir temp(dir);
  temp.WriteFile("f", "on disk");
  UniqueFd dir_fd(::open(temp.path().c_str(), O_RDONLY | O_DIRECTORY));
  auto file = OpenSharedFile(dir_fd.get(), "f", SharedFileOptions{});
  EXPECT_TRUE(HasError(file.status(), kInvalid, "NOT_SHMEM"));
}

TEST_F(SharedFileTest, NoFdLeaksOnAnyPath) {
  dir_.WriteFile("ok", "ok");
  dir_.WriteFile("ro", "ro", 0400);
  const int before = CountOpenFds();
  {
    auto ok = Open("ok");
    ASSERT_TRUE(ok.ok());
    EXPECT_EQ(CountOpenFds(), before + 1);
  }
  EXPECT_FALSE(Open("ro", true).ok());
  EXPECT_FALSE(Open("missing").ok());
  EXPECT_FALSE(Open("../x").ok());
  EXPECT_EQ(CountOpenFds(), before);
}

// MappedFile::Prefault fills the mapping's page tables once: a second call
// on chunks it filled walks nothing (shown by dropping the page tables in
// between: they stay empty), and a range it did not cover is filled anew.
TEST(MappedFilePrefaultTest, FillsTheRangeOnceAndRemembersIt) {
  constexpr uint64_t kSize = uint64_t{80} << 20;
  ConfigurePrefault(kDefaultPrefaultThreads);
  auto file = MapMemfd(MakeSealedMemfd(kSize), Writable());
  ASSERT_TRUE(file.ok()) << file.status();
  char* base = static_cast<char*>((*file)->address());
  ASSERT_EQ(test_support::MappedBytes(base), 0u);

  (*file)->Prefault(0, kSize / 2);
  EXPECT_EQ(test_support::MappedBytes(base), kSize / 2);
  ASSERT_EQ(madvise(base, kSize, MADV_DONTNEED), 0);  // page tables dropped
  (*file)->Prefault(uint64_t{4} << 20, uint64_t{32} << 20);  // all filled once
  EXPECT_EQ(test_support::MappedBytes(base), 0u);

  (*file)->Prefault(0, kSize);  // the second half was never filled
  EXPECT_EQ(test_support::MappedBytes(base), kSize);
}

// A range below kPrefaultMinBytes of a memfd (sealed against shrinking) is
// filled on the calling thread, by reading a byte of each page: the range's
// pages are mapped in, and little more (the kernel may map a few
// neighbouring pages it already holds along with a fault).
TEST(MappedFilePrefaultTest, SmallRangesOfASealedMemfdAreReadIn) {
  constexpr uint64_t kSize = uint64_t{4} << 20;
  auto file = MapMemfd(MakeSealedMemfd(kSize), Writable());
  ASSERT_TRUE(file.ok()) << file.status();
  char* base = static_cast<char*>((*file)->address());
  ASSERT_EQ(test_support::MappedBytes(base), 0u);
  (*file)->Prefault(uint64_t{1} << 20, 3 * 4096 + 1);  // 4 pages
  const uint64_t mapped = test_support::MappedBytes(base);
  EXPECT_GE(mapped, 4 * 4096u);
  EXPECT_LE(mapped, 4 * 4096u + (uint64_t{128} << 10));
}

// A file that is not sealed may shrink under the mapping, and reading a page
// past its end would raise SIGBUS: its small ranges are left to the pin.
TEST_F(SharedFileTest, SmallRangesOfAFileThatMayShrinkAreLeftToThePin) {
  dir_.WriteFile("shrinks.bin", std::string(3 * 4096, 'x'));
  auto file = Open("shrinks.bin");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(::truncate(dir_.Sub("shrinks.bin").c_str(), 0), 0);
  (*file)->Prefault(0, 3 * 4096);  // would be SIGBUS if it read the pages
  EXPECT_EQ(test_support::MappedBytes((*file)->address()), 0u);
}

TEST(MappedFilePrefaultTest, PrefaultingOffLeavesBigRangesToThePin) {
  constexpr uint64_t kSize = uint64_t{64} << 20;
  auto file = MapMemfd(MakeSealedMemfd(kSize), Writable());
  ASSERT_TRUE(file.ok()) << file.status();
  char* base = static_cast<char*>((*file)->address());
  ConfigurePrefault(0);
  (*file)->Prefault(0, kSize);
  EXPECT_EQ(test_support::MappedBytes(base), 0u);
  ConfigurePrefault(kDefaultPrefaultThreads);
  (*file)->Prefault(0, kSize);  // off did not mark anything as filled
  EXPECT_EQ(test_support::MappedBytes(base), kSize);
}

// ---------------------------------------------------------------------------
// MapHandedOver: a buffer another mrd process mapped, passed on by fd (live
// handover). A dup of the fd stands for the copy SCM_RIGHTS makes.

TEST(MapHandedOverTest, SeesTheSameFileBytesAndSizeAsTheFirstMapping) {
  const std::string contents = "bytes the client wrote before the handover";
  auto first = MapMemfd(MakeMemfd(contents, F_SEAL_SHRINK), ReadOnly());
  ASSERT_TRUE(first.ok()) << first.status();
  UniqueFd passed(::dup((*first)->fd()));
  ASSERT_TRUE(passed.valid());

  auto second = MapHandedOver(std::move(passed), (*first)->writable(),
                              (*first)->source());
  ASSERT_TRUE(second.ok()) << second.status();
  const MappedFile& f = **second;
  EXPECT_EQ(f.size(), contents.size());
  EXPECT_EQ(f.device(), (*first)->device());
  EXPECT_EQ(f.inode(), (*first)->inode());
  EXPECT_EQ(f.source(), "memfd");
  EXPECT_FALSE(f.writable());
  EXPECT_EQ(MappingPermissions(f.address()), "r--s");
  EXPECT_NE(f.address(), (*first)->address());  // a mapping of its own
  EXPECT_EQ(
      absl::string_view(static_cast<const char*>(f.address()), contents.size()),
      contents);
  // The same pages: a write through the file shows in both mappings.
  ASSERT_EQ(::pwrite(f.fd(), "B", 1, 0), 1);
  EXPECT_EQ(static_cast<const char*>(f.address())[0], 'B');
  EXPECT_EQ(static_cast<const char*>((*first)->address())[0], 'B');
  // The first process lets go; the second mapping stands on its own.
  first->reset();
  EXPECT_EQ(static_cast<const char*>(f.address())[1], contents[1]);
}

TEST(MapHandedOverTest, WritableIsHonouredAndWritesReachTheFile) {
  UniqueFd memfd = MakeMemfd("........", F_SEAL_SHRINK | F_SEAL_GROW);
  UniqueFd client_copy(::dup(memfd.get()));
  auto first = MapMemfd(std::move(memfd), Writable());
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MapHandedOver(UniqueFd(::dup((*first)->fd())),
                              /*writable=*/true, (*first)->source());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE((*second)->writable());
  // (ASSERT: writing to a read-only mapping would crash the test.)
  ASSERT_EQ(MappingPermissions((*second)->address()), "rw-s");
  std::memcpy((*second)->address(), "handed", 6);
  char back[8] = {};
  ASSERT_EQ(::pread(client_copy.get(), back, 6, 0), 6);
  EXPECT_STREQ(back, "handed");
  EXPECT_EQ(std::memcmp((*first)->address(), "handed", 6), 0);
}

TEST(MapHandedOverTest, ReadOnlyStaysReadOnlyAndKeepsTheSharedFileSource) {
  TempDir dir("/dev/shm");
  dir.WriteFile("job.bin", "shared file");
  UniqueFd dir_fd(::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY));
  ASSERT_TRUE(dir_fd.valid());
  auto first = OpenSharedFile(dir_fd.get(), "job.bin", SharedFileOptions{});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MapHandedOver(UniqueFd(::dup((*first)->fd())),
                              /*writable=*/false, (*first)->source());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->source(), "file:job.bin");
  EXPECT_FALSE((*second)->writable());
  EXPECT_EQ(MappingPermissions((*second)->address()), "r--s");
  EXPECT_EQ((*second)->size(), 11u);
}

TEST(MapHandedOverTest, WritableOnAReadOnlyFdIsMmapsRefusal) {
  UniqueFd memfd = MakeSealedMemfd(4096);
  auto file =
      MapHandedOver(Reopen(memfd.get(), O_RDONLY), /*writable=*/true, "memfd");
  EXPECT_TRUE(HasError(file.status(), absl::StatusCode::kPermissionDenied,
                       "MMAP_FAILED"))
      << file.status();
}

TEST(MapHandedOverTest, BadAndEmptyFilesAreRefusedAndTheFdClosed) {
  auto bad = MapHandedOver(UniqueFd(), /*writable=*/false, "memfd");
  EXPECT_TRUE(HasError(bad.status(), kInvalid, "BAD_FD")) << bad.status();
  UniqueFd empty = MakeMemfd("", F_SEAL_SHRINK);
  const int number = empty.get();
  auto refused = MapHandedOver(std::move(empty), /*writable=*/false, "memfd");
  EXPECT_TRUE(HasError(refused.status(), kInvalid, "EMPTY_FILE"))
      << refused.status();
  EXPECT_FALSE(FdIsOpen(number));
}

}  // namespace
}  // namespace mrd::fd_socket
