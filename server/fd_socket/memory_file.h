// MappedFile: a client buffer as mrd holds it. It owns a file descriptor and a
// MAP_SHARED mapping of the whole file, and hands out MemorySpans (address,
// length, fd, file offset) that the device pins and registers.
//
// Two ways in, both validating before anything is mapped (and a third for
// files another mrd process validated, MapHandedOver):
//   * MapMemfd: a memfd received over the fd socket (SCM_RIGHTS). It must be
//     sealed with F_SEAL_SHRINK, so the file can never become shorter than the
//     mapping: pinned pages stay backed and no access through the mapping can
//     raise SIGBUS.
//   * OpenSharedFile: a file under the server's shared-memory directory, for
//     lease sessions that have no fd to pass. Only memfds can be sealed, so
//     such a file CAN be truncated by its owner while mapped. This is safe for
//     mrd because nothing in mrd dereferences the mapping: the device pins the
//     pages through the address (pinned pages stay allocated even if the file
//     shrinks) and the software device moves data with pread/pwrite on
//     (fd, file offset), where a truncated file gives a short read or an
//     error, never SIGBUS. Code that reads through address() (tests, debug
//     tools) must only do so for memfds.
//
// Ownership: a MappedFile owns its fd and mapping; the destructor unmaps and
// closes. Every MemorySpan obtained from Span() points into the mapping and
// must not be used after the MappedFile is destroyed: whoever registers a span
// with the device keeps the MappedFile alive until it is deregistered.
//
// Thread safety: a MappedFile is immutable after construction; every const
// method may be called from any thread concurrently. The factories are
// thread-safe (they touch only their arguments).
#ifndef MRD_SERVER_FD_SOCKET_MEMORY_FILE_H_
#define MRD_SERVER_FD_SOCKET_MEMORY_FILE_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mrd/unique_fd.h"
#include "server/device/device.h"

namespace mrd::fd_socket {

struct MemfdImportOptions;
struct SharedFileOptions;
class MappedFile;

// Validates `fd` as an importable memfd and maps it (see ImportMemfd in
// fd.proto). Takes ownership of `fd` in every case: on error it is closed.
// Checks, in order, each with its own status (code, reason in ErrorDetail):
//   INVALID_ARGUMENT (STATUS_INVALID_PARAMETER):
//     BAD_FD            fstat fails (closed or invalid fd) or an O_PATH fd
//     NOT_REGULAR_FILE  a pipe, socket, directory, device ...
//     NOT_SHMEM         not on tmpfs/hugetlbfs (a disk file cannot be pinned
//                       for writing long-term)
//     NOT_SEALED        no F_SEAL_SHRINK (memfd_create(MFD_ALLOW_SEALING) and
//                       fcntl(F_ADD_SEALS, F_SEAL_SHRINK))
//     EMPTY_FILE        size 0
//     SIZE_MISMATCH     expected_size set and different
//     FD_NOT_READABLE   an O_WRONLY fd (cannot be mapped)
//     FD_NOT_WRITABLE   writable asked, fd not O_RDWR
//     WRITE_SEALED      writable asked, F_SEAL_WRITE or F_SEAL_FUTURE_WRITE
//   RESOURCE_EXHAUSTED (STATUS_INSUFFICIENT_RESOURCES):
//     LIMIT_BUFFER_SIZE size > max_size
//   mmap failure: ErrnoError(errno, "mmap", "MMAP_FAILED").
absl::StatusOr<std::unique_ptr<MappedFile>> MapMemfd(
    UniqueFd fd, const MemfdImportOptions& options);

// Opens `relative_path` beneath the directory `dir_fd` (not owned; must stay
// open for the call only) and maps it. The path is resolved with openat2
// RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
// RESOLVE_NO_XDEV, so no symlink (final or intermediate), no "..", no escape
// from the directory and no crossing into another mount is possible. The open
// is non-blocking, so a FIFO planted in the directory cannot stall the caller.
// A hard link is refused (HARD_LINKED): a second name can be made for a file
// that lives elsewhere on the same filesystem, and mrd (which may run with
// more privilege than the client) must not be the way to reach it.
// Errors:
//   INVALID_ARGUMENT (STATUS_INVALID_PARAMETER):
//     BAD_PATH          empty, absolute, NUL byte, ".." component, too long,
//                       a symlink anywhere, an escape, another mount, a
//                       non-directory used as a directory
//     NOT_REGULAR_FILE, NOT_SHMEM, EMPTY_FILE  as MapMemfd
//   NOT_FOUND: NO_SUCH_FILE
//   PERMISSION_DENIED:
//     ACCESS_DENIED       the open itself was refused (EACCES/EPERM)
//     OWNER_NOT_ALLOWED   allowed_owner_uids set and the owner is not in it
//     MODE_DENIES_ACCESS  the mode lacks S_IRUSR, or S_IWUSR when writable
//     HARD_LINKED         the file has more than one name
//   RESOURCE_EXHAUSTED (STATUS_INSUFFICIENT_RESOURCES): LIMIT_BUFFER_SIZE
//   FAILED_PRECONDITION: OPENAT2_UNSUPPORTED (kernel older than 5.6)
//   other open/mmap failures: ErrnoError.
absl::StatusOr<std::unique_ptr<MappedFile>> OpenSharedFile(
    int dir_fd, absl::string_view relative_path,
    const SharedFileOptions& options);

// Maps a file another mrd process validated and mapped (MapMemfd or
// OpenSharedFile there), handed over with its buffer in a live handover
// (issue 11): fstat for its size, device and inode, then Map with `writable`
// and `source` as they were (MappedFile::writable() and source() there). The
// validation is not repeated: the file passed it when the client handed it
// over, and a memfd's seals cannot have been removed since. Takes ownership
// of `fd` in every case: on error it is closed. Errors, INVALID_ARGUMENT
// (STATUS_INVALID_PARAMETER): BAD_FD (fstat fails: closed or invalid fd),
// EMPTY_FILE (size 0); or mmap's: ErrnoError(errno, "mmap", "MMAP_FAILED")
// (e.g. EACCES: `writable` with an fd not open O_RDWR).
absl::StatusOr<std::unique_ptr<MappedFile>> MapHandedOver(UniqueFd fd,
                                                          bool writable,
                                                          std::string source);

struct MemfdImportOptions {
  // Map PROT_READ|PROT_WRITE (needed for any write access by the device).
  bool writable = false;
  // If non-zero, the file must be exactly this many bytes.
  uint64_t expected_size = 0;
  // Largest accepted file, bytes.
  uint64_t max_size = std::numeric_limits<uint64_t>::max();
};

struct SharedFileOptions {
  bool writable = false;
  uint64_t max_size = std::numeric_limits<uint64_t>::max();
  // Owners (st_uid) whose files may be imported; empty = any owner.
  std::vector<uint32_t> allowed_owner_uids;
};

class MappedFile final {
 public:
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // The owned descriptor (valid for the object's lifetime; do not close).
  int fd() const { return fd_.get(); }
  // Start of the mapping (page-aligned), covering size() bytes.
  void* address() const { return address_; }
  uint64_t size() const { return size_; }
  bool writable() const { return writable_; }
  // st_dev and st_ino of the file.
  uint64_t device() const { return device_; }
  uint64_t inode() const { return inode_; }
  // "memfd" or "file:<relative path>".
  const std::string& source() const { return source_; }

  // The span [offset, offset + length) of the file. Errors, all
  // INVALID_ARGUMENT (STATUS_INVALID_PARAMETER), checked in this order:
  // ZERO_LENGTH, OFFSET_PAST_END (offset >= size), LENGTH_OVERFLOW
  // (offset + length wraps), LENGTH_PAST_BUFFER (offset + length > size).
  absl::StatusOr<device::MemorySpan> Span(uint64_t offset,
                                          uint64_t length) const;

  // Fills this mapping's page tables for [offset, offset + length) (a range
  // Span accepted) before it is pinned (server/common/prefault.h), unless
  // earlier calls filled all of it: the mapping remembers the 2 MiB chunks
  // it prefaulted, so registering the same memory again costs no second
  // walk of its pages. With `progress`: adds the bytes filled (all of them
  // when they were filled before) and stops early once the caller gave up.
  // A range below kPrefaultMinBytes of a file sealed against shrinking is
  // filled by reading a byte of each page on the calling thread instead:
  // those faults take only the mapping's own lock, not the address space's,
  // so the pin that follows (which finds the pages mapped and needs no lock
  // either) does not wait for another tenant's maps and unmaps of big
  // buffers (docs/PERFORMANCE.md, "Noisy neighbours"). Thread-safe.
  void Prefault(uint64_t offset, uint64_t length,
                WorkProgress* progress = nullptr) const;

 private:
  friend absl::StatusOr<std::unique_ptr<MappedFile>> MapMemfd(
      UniqueFd fd, const MemfdImportOptions& options);
  friend absl::StatusOr<std::unique_ptr<MappedFile>> OpenSharedFile(
      int dir_fd, absl::string_view relative_path,
      const SharedFileOptions& options);
  friend absl::StatusOr<std::unique_ptr<MappedFile>> MapHandedOver(
      UniqueFd fd, bool writable, std::string source);

  // Maps a validated file. `size` must be > 0.
  // Reads a byte of every page of [offset, offset + length) when the file
  // is sealed against shrinking; does nothing otherwise.
  void TouchPages(uint64_t offset, uint64_t length) const;

  static absl::StatusOr<std::unique_ptr<MappedFile>> Map(
      UniqueFd fd, uint64_t size, bool writable, uint64_t device,
      uint64_t inode, std::string source);

  MappedFile(UniqueFd fd, void* address, uint64_t size, bool writable,
             uint64_t device, uint64_t inode, std::string source);

  UniqueFd fd_;
  void* address_;
  uint64_t size_;
  bool writable_;
  uint64_t device_;
  uint64_t inode_;
  std::string source_;
  bool shrink_sealed_ = false;  // set by Map, never changed after
  bool huge_pages_ = false;     // on hugetlbfs; set by Map likewise
  // One bit per 2 MiB chunk of the mapping that Prefault filled.
  std::unique_ptr<std::atomic<uint64_t>[]> prefaulted_;
};

}  // namespace mrd::fd_socket

#endif  // MRD_SERVER_FD_SOCKET_MEMORY_FILE_H_
