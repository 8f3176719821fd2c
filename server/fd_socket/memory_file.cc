#include "server/fd_socket/memory_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <linux/openat2.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/common/prefault.h"

namespace mrd::fd_socket {
namespace {

absl::Status InvalidParameter(absl::string_view reason,
                              absl::string_view message) {
  return SeedError(STATUS_INVALID_PARAMETER, reason, message);
}

absl::Status PermissionDenied(absl::string_view reason,
                              absl::string_view message) {
  return MrdError(absl::StatusCode::kPermissionDenied, reason, message);
}

absl::string_view FileTypeName(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFIFO:
      return "pipe (FIFO)";
    case S_IFSOCK:
      return "socket";
    case S_IFDIR:
      return "directory";
    case S_IFCHR:
      return "character device";
    case S_IFBLK:
      return "block device";
    case S_IFLNK:
      return "symlink";
    default:
      return "special file";
  }
}

// Shared by both ways in: a regular file on tmpfs or hugetlbfs. `what` names
// the file in messages.
absl::Status CheckFileType(int fd, const struct stat& st,
                           absl::string_view what) {
  if (!S_ISREG(st.st_mode)) {
    return InvalidParameter(
        "NOT_REGULAR_FILE",
        absl::StrCat(what, " is a ", FileTypeName(st.st_mode),
                     ", not a regular file; pass a memfd (or, for a lease "
                     "session, a file on tmpfs/hugetlbfs)"));
  }
  struct statfs fs;
  if (::fstatfs(fd, &fs) != 0) {
    const int err = errno;
    return ErrnoError(err, "fstatfs", "BAD_FD");
  }
  const auto type = static_cast<uint32_t>(fs.f_type);
  if (type != static_cast<uint32_t>(TMPFS_MAGIC) &&
      type != static_cast<uint32_t>(HUGETLBFS_MAGIC)) {
    return InvalidParameter(
        "NOT_SHMEM",
        absl::StrCat(what, " is on a filesystem of type 0x", absl::Hex(type),
                     ", not tmpfs or hugetlbfs: pages of an ordinary file "
                     "cannot be pinned for long-term device access; use a "
                     "memfd"));
  }
  return absl::OkStatus();
}

// Non-empty and within the limit.
absl::Status CheckSize(uint64_t size, uint64_t max_size,
                       absl::string_view what) {
  if (size == 0) {
    return InvalidParameter("EMPTY_FILE",
                            absl::StrCat(what, " is empty (size 0)"));
  }
  if (size > max_size) {
    return SeedError(STATUS_INSUFFICIENT_RESOURCES, "LIMIT_BUFFER_SIZE",
                     absl::StrCat(what, " has ", size,
                                  " bytes, more than the buffer limit of ",
                                  max_size, " bytes"));
  }
  return absl::OkStatus();
}

// A relative path with no NUL, no ".." component and nothing that would make
// openat2 start anywhere but the directory.
absl::Status CheckRelativePath(absl::string_view path) {
  if (path.empty()) return InvalidParameter("BAD_PATH", "the path is empty");
  if (path.size() >= PATH_MAX) {
    return InvalidParameter(
        "BAD_PATH", absl::StrCat("the path has ", path.size(),
                                 " bytes, the limit is ", PATH_MAX - 1));
  }
  if (path.find('\0') != absl::string_view::npos) {
    return InvalidParameter("BAD_PATH", "the path contains a NUL byte");
  }
  if (path.front() == '/') {
    return InvalidParameter(
        "BAD_PATH", absl::StrCat("\"", path,
                                 "\" is absolute; give a path relative to "
                                 "the shared-memory directory"));
  }
  for (absl::string_view component : absl::StrSplit(path, '/')) {
    if (component == "..") {
      return InvalidParameter(
          "BAD_PATH",
          absl::StrCat("\"", path, "\" contains a \"..\" component"));
    }
  }
  return absl::OkStatus();
}

constexpr uint64_t kPrefaultChunk = uint64_t{2} << 20;
constexpr uint64_t kUnmapPiece = uint64_t{2} << 20;

}  // namespace

MappedFile::MappedFile(UniqueFd fd, void* address, uint64_t size, bool writable,
                       uint64_t device, uint64_t inode, std::string source)
    : fd_(std::move(fd)),
      address_(address),
      size_(size),
      writable_(writable),
      device_(device),
      inode_(inode),
      source_(std::move(source)),
      prefaulted_(
          new std::atomic<uint64_t>[(size / kPrefaultChunk + 64) / 64]()) {}

MappedFile::~MappedFile() {
  // The page tables go first, a piece at a time, under the address space's
  // lock taken for reading (MADV_DONTNEED on a shared mapping only drops
  // them: the file keeps its pages); the unmap that follows, which takes
  // the lock for writing, has nothing left to tear down. Unmapped in one
  // call, a 256 MiB mapping held the lock for writing for milliseconds, and
  // every map, prefault and page fault of mrd's other threads (other
  // tenants' included) waited for it.
  // Huge pages have a table entry each, torn down quickly in one unmap.
  for (uint64_t at = 0; !huge_pages_ && at < size_; at += kUnmapPiece) {
    (void)::madvise(static_cast<char*>(address_) + at,
                    std::min(kUnmapPiece, size_ - at), MADV_DONTNEED);
  }
  if (::munmap(address_, size_) != 0) {
    const int err = errno;
    // Only possible if address_/size_ were corrupted.
    LogError("munmap of ", size_, " bytes at 0x",
             absl::Hex(reinterpret_cast<uintptr_t>(address_)),
             " failed: ", std::strerror(err));
  }
}

void MappedFile::Prefault(uint64_t offset, uint64_t length,
                          WorkProgress* progress) const {
  if (length < kPrefaultMinBytes) {
    TouchPages(offset, length);
    return;
  }
  const uint64_t first = offset / kPrefaultChunk;
  const uint64_t last = (offset + length - 1) / kPrefaultChunk;
  auto marked = [this](uint64_t chunk) {
    return (prefaulted_[chunk / 64].load(std::memory_order_relaxed) &
            (uint64_t{1} << (chunk % 64))) != 0;
  };
  bool all = true;
  for (uint64_t c = first; c <= last && all; ++c) all = marked(c);
  if (all) {
    if (progress != nullptr) progress->AddPopulated(length);
    return;
  }
  if (mrd::Prefault(static_cast<char*>(address_) + offset, length,
                    /*max_threads=*/0, progress, huge_pages_) == 0) {
    return;  // prefaulting is off
  }
  if (Cancelled(progress)) return;  // stopped part-way: nothing is marked
  // Chunks only partly in the range stay unmarked: their other part may
  // still be unfilled.
  const uint64_t full_first = (offset + kPrefaultChunk - 1) / kPrefaultChunk;
  const uint64_t end = offset + length;
  const uint64_t full_end =
      end == size_ ? last + 1 : end / kPrefaultChunk;  // the file's tail counts
  for (uint64_t c = full_first; c < full_end; ++c) {
    prefaulted_[c / 64].fetch_or(uint64_t{1} << (c % 64),
                                 std::memory_order_relaxed);
  }
}

void MappedFile::TouchPages(uint64_t offset, uint64_t length) const {
  // A file that may shrink could turn a read into SIGBUS: its pages are left
  // to the pin.
  if (!shrink_sealed_ || length == 0) return;
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t end = offset + length;
  for (uint64_t at = offset & ~(page - 1); at < end; at += page) {
    (void)*static_cast<volatile const char*>(static_cast<char*>(address_) + at);
  }
}

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Map(
    UniqueFd fd, uint64_t size, bool writable, uint64_t device, uint64_t inode,
    std::string source) {
  const int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  void* address = ::mmap(nullptr, size, prot, MAP_SHARED, fd.get(), 0);
  if (address == MAP_FAILED) {
    const int err = errno;
    // EPERM here: F_SEAL_WRITE was added between our check and the mmap.
    return ErrnoError(err, "mmap", "MMAP_FAILED");
  }
  // Sealed against shrinking (every memfd MapMemfd accepts; a handed-over
  // memfd keeps its seals): no page of the mapping can ever lose its backing.
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  const bool shrink_sealed = seals >= 0 && (seals & F_SEAL_SHRINK) != 0;
  // Once per mapping, not at every pin of a span of it.
  struct statfs fs {};
  const bool huge_pages = ::fstatfs(fd.get(), &fs) == 0 &&
                          static_cast<uint32_t>(fs.f_type) ==
                              static_cast<uint32_t>(HUGETLBFS_MAGIC);
  auto file = std::unique_ptr<MappedFile>(
      new MappedFile(std::move(fd), address, size, writable, device, inode,
                     std::move(source)));
  file->shrink_sealed_ = shrink_sealed;
  file->huge_pages_ = huge_pages;
  return file;
}

absl::StatusOr<device::MemorySpan> MappedFile::Span(uint64_t offset,
                                                    uint64_t length) const {
  if (length == 0) {
    return InvalidParameter("ZERO_LENGTH",
                            absl::StrCat("length is 0 (offset ", offset, ")"));
  }
  if (offset >= size_) {
    return InvalidParameter(
        "OFFSET_PAST_END",
        absl::StrCat("offset ", offset, " is not below the buffer size ",
                     size_));
  }
  if (length > std::numeric_limits<uint64_t>::max() - offset) {
    return InvalidParameter(
        "LENGTH_OVERFLOW", absl::StrCat("offset ", offset, " + length ", length,
                                        " overflows 64 bits"));
  }
  if (offset + length > size_) {
    return InvalidParameter(
        "LENGTH_PAST_BUFFER",
        absl::StrCat("offset ", offset, " + length ", length, " = ",
                     offset + length, " is past the buffer size ", size_));
  }
  device::MemorySpan span;
  span.host_address = static_cast<char*>(address_) + offset;
  span.length = length;
  span.fd = fd_.get();
  span.pages =
      huge_pages_ ? device::SpanPages::kHuge : device::SpanPages::kBase;
  span.file_offset = offset;
  return span;
}

absl::StatusOr<std::unique_ptr<MappedFile>> MapMemfd(
    UniqueFd fd, const MemfdImportOptions& options) {
  struct stat st;
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0) {
    const int err = fd.valid() ? errno : EBADF;
    return InvalidParameter(
        "BAD_FD", absl::StrCat("fd ", fd.get(),
                               " cannot be inspected: ", std::strerror(err)));
  }
  const int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl < 0) {
    const int err = errno;
    return InvalidParameter(
        "BAD_FD", absl::StrCat("fcntl(F_GETFL): ", std::strerror(err)));
  }
  if ((fl & O_PATH) != 0) {
    return InvalidParameter("BAD_FD",
                            "an O_PATH descriptor cannot be mapped; pass the "
                            "memfd itself");
  }
  MRD_RETURN_IF_ERROR(CheckFileType(fd.get(), st, "the fd"));

  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return InvalidParameter(
        "NOT_SEALED",
        absl::StrCat(
            "the memfd is not sealed against shrinking (seals 0x",
            absl::Hex(seals < 0 ? 0 : seals),
            "): it could be truncated under a pinned mapping. Create it with "
            "memfd_create(..., MFD_ALLOW_SEALING) and seal it with "
            "fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) before passing it"));
  }
  // Seals are never removed, so from here on the size can only grow. Read it
  // again: the one above may predate the seal.
  if (::fstat(fd.get(), &st) != 0) {
    const int err = errno;
    return ErrnoError(err, "fstat", "BAD_FD");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size == 0) {
    return InvalidParameter("EMPTY_FILE", "the memfd is empty (size 0)");
  }
  if (options.expected_size != 0 && size != options.expected_size) {
    return InvalidParameter(
        "SIZE_MISMATCH",
        absl::StrCat("the memfd has ", size, " bytes, the request expected ",
                     options.expected_size));
  }
  MRD_RETURN_IF_ERROR(CheckSize(size, options.max_size, "the memfd"));

  const int access = fl & O_ACCMODE;
  if (access == O_WRONLY) {
    return InvalidParameter("FD_NOT_READABLE",
                            "the fd is open O_WRONLY and cannot be mapped");
  }
  if (options.writable) {
    if (access != O_RDWR) {
      return InvalidParameter(
          "FD_NOT_WRITABLE",
          "a writable import needs an fd open O_RDWR; this one is read-only");
    }
    if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
      return InvalidParameter(
          "WRITE_SEALED",
          absl::StrCat("a writable import of a memfd sealed with ",
                       (seals & F_SEAL_WRITE) != 0 ? "F_SEAL_WRITE"
                                                   : "F_SEAL_FUTURE_WRITE",
                       " is impossible; import it read-only"));
    }
  }
  return MappedFile::Map(std::move(fd), size, options.writable,
                         static_cast<uint64_t>(st.st_dev),
                         static_cast<uint64_t>(st.st_ino), "memfd");
}

absl::StatusOr<std::unique_ptr<MappedFile>> MapHandedOver(UniqueFd fd,
                                                          bool writable,
                                                          std::string source) {
  struct stat st;
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0) {
    const int err = fd.valid() ? errno : EBADF;
    return InvalidParameter(
        "BAD_FD", absl::StrCat("handed-over fd ", fd.get(),
                               " cannot be inspected: ", std::strerror(err)));
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size == 0) {
    return InvalidParameter(
        "EMPTY_FILE",
        absl::StrCat("the handed-over file (", source, ") is empty (size 0)"));
  }
  return MappedFile::Map(std::move(fd), size, writable,
                         static_cast<uint64_t>(st.st_dev),
                         static_cast<uint64_t>(st.st_ino), std::move(source));
}

namespace {

// openat2 of `path` beneath `dir_fd`: no symlinks, no magic links, no
// crossing into another filesystem; each refusal with its own reason.
absl::StatusOr<UniqueFd> OpenBeneath(int dir_fd, const std::string& path,
                                     bool writable) {
  struct open_how how;
  std::memset(&how, 0, sizeof(how));
  // O_NONBLOCK: opening a FIFO must not wait for a writer. It has no effect
  // on regular files.
  how.flags =
      static_cast<uint64_t>((writable ? O_RDWR : O_RDONLY) | O_NOFOLLOW |
                            O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
                RESOLVE_NO_XDEV;
  long ret;  // NOLINT(runtime/int): the syscall() return type.
  int err = 0;
  // EAGAIN: the kernel could not rule out a race with a concurrent rename;
  // retrying is what openat2(2) recommends.
  for (int attempt = 0; attempt < 8; ++attempt) {
    ret = ::syscall(SYS_openat2, dir_fd, path.c_str(), &how, sizeof(how));
    err = ret < 0 ? errno : 0;
    if (ret >= 0 || (err != EAGAIN && err != EINTR)) break;
  }
  if (ret < 0) {
    switch (err) {
      case ENOENT:
        return MrdError(absl::StatusCode::kNotFound, "NO_SUCH_FILE",
                        absl::StrCat("no file \"", path,
                                     "\" in the shared-memory directory"));
      case ELOOP:
        return InvalidParameter(
            "BAD_PATH", absl::StrCat("\"", path,
                                     "\" goes through a symlink; symlinks "
                                     "are not followed"));
      case EXDEV:
        return InvalidParameter(
            "BAD_PATH",
            absl::StrCat("\"", path,
                         "\" leaves the shared-memory directory or its "
                         "filesystem"));
      case ENOTDIR:
        return InvalidParameter(
            "BAD_PATH",
            absl::StrCat("a component of \"", path, "\" is not a directory"));
      case ENAMETOOLONG:
        return InvalidParameter("BAD_PATH",
                                absl::StrCat("\"", path, "\" is too long"));
      case ENXIO:  // a socket, or a FIFO without a reader
        return InvalidParameter(
            "NOT_REGULAR_FILE",
            absl::StrCat("\"", path, "\" is not a regular file"));
      case EACCES:
      case EPERM:
        return PermissionDenied("ACCESS_DENIED",
                                absl::StrCat("opening \"", path, "\" for ",
                                             writable ? "read/write" : "read",
                                             ": ", std::strerror(err)));
      case ENOSYS:
        return MrdError(absl::StatusCode::kFailedPrecondition,
                        "OPENAT2_UNSUPPORTED",
                        "the kernel has no openat2 (Linux 5.6 or later is "
                        "needed for the shared-memory directory)");
      default:
        return ErrnoError(err, "openat2", "OPEN_FAILED");
    }
  }
  return UniqueFd(static_cast<int>(ret));
}

// The checks of an opened shared file: a regular file with one name, owned
// by an allowed uid, whose mode grants its owner the access asked for.
absl::Status CheckSharedFile(const struct stat& st, const std::string& what,
                             const SharedFileOptions& options) {
  if (st.st_nlink != 1) {
    return PermissionDenied(
        "HARD_LINKED",
        absl::StrCat(what, " has ", st.st_nlink,
                     " names (hard links); only a file with exactly one "
                     "name can be imported"));
  }
  if (!options.allowed_owner_uids.empty()) {
    bool allowed = false;
    for (uint32_t uid : options.allowed_owner_uids) {
      if (uid == st.st_uid) allowed = true;
    }
    if (!allowed) {
      return PermissionDenied("OWNER_NOT_ALLOWED",
                              absl::StrCat(what, " is owned by uid ", st.st_uid,
                                           ", which may not import files"));
    }
  }
  const mode_t needed = S_IRUSR | (options.writable ? S_IWUSR : 0);
  if ((st.st_mode & needed) != needed) {
    return PermissionDenied(
        "MODE_DENIES_ACCESS",
        absl::StrCat(what, " has mode ",
                     absl::StrFormat("%04o", st.st_mode & 07777),
                     ", which does not grant its owner ",
                     options.writable ? "read and write" : "read", " access"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedFile>> OpenSharedFile(
    int dir_fd, absl::string_view relative_path,
    const SharedFileOptions& options) {
  MRD_RETURN_IF_ERROR(CheckRelativePath(relative_path));
  const std::string path(relative_path);
  MRD_ASSIGN_OR_RETURN(UniqueFd fd,
                       OpenBeneath(dir_fd, path, options.writable));
  const std::string what = absl::StrCat("\"", path, "\"");
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    const int stat_err = errno;
    return ErrnoError(stat_err, "fstat", "BAD_FD");
  }
  MRD_RETURN_IF_ERROR(CheckFileType(fd.get(), st, what));
  MRD_RETURN_IF_ERROR(CheckSharedFile(st, what, options));
  MRD_RETURN_IF_ERROR(
      CheckSize(static_cast<uint64_t>(st.st_size), options.max_size, what));
  return MappedFile::Map(std::move(fd), static_cast<uint64_t>(st.st_size),
                         options.writable, static_cast<uint64_t>(st.st_dev),
                         static_cast<uint64_t>(st.st_ino),
                         absl::StrCat("file:", path));
}

}  // namespace mrd::fd_socket
