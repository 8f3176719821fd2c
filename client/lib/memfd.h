// MappedMemfd: an anonymous memory file (memfd_create) of a fixed size,
// sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW, which
// mrd requires before it will pin the pages), and mapped read-write here.
// Owns the fd and the mapping; both go on destruction.
//
// Thread-compatible: the object is not synchronized; the memory is plain
// shared memory.
#ifndef MRD_CLIENT_LIB_MEMFD_H_
#define MRD_CLIENT_LIB_MEMFD_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mrd/unique_fd.h"

namespace mrd::client {

// The page size of huge-page memfds (MappedMemfd::Create's huge_pages).
inline constexpr uint64_t kHugePageSize = uint64_t{2} << 20;

// The seals Create() sets.
inline constexpr int kBufferSeals =
    0x0002 | 0x0004;  // F_SEAL_SHRINK|F_SEAL_GROW

class MappedMemfd {
 public:
  // memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING), ftruncate(size),
  // F_ADD_SEALS(kBufferSeals), mmap(PROT_READ|PROT_WRITE, MAP_SHARED).
  // With `huge_pages` the memfd is on hugetlbfs (MFD_HUGETLB |
  // MFD_HUGE_2MB): its memory comes from the kernel's pool of 2 MiB pages
  // (vm.nr_hugepages), reserved whole at the mmap. INVALID_ARGUMENT for
  // size 0 and, with `huge_pages`, for a size that is not a multiple of
  // 2 MiB (HUGE_PAGE_MULTIPLE); RESOURCE_EXHAUSTED when memory or fds run
  // out, and NO_HUGE_PAGES when the pool has too few free pages; the
  // errno's code otherwise.
  static absl::StatusOr<MappedMemfd> Create(uint64_t size,
                                            absl::string_view name,
                                            bool huge_pages = false);

  MappedMemfd() = default;
  MappedMemfd(MappedMemfd&& other) noexcept;
  MappedMemfd& operator=(MappedMemfd&& other) noexcept;
  MappedMemfd(const MappedMemfd&) = delete;
  MappedMemfd& operator=(const MappedMemfd&) = delete;
  ~MappedMemfd();

  int fd() const { return fd_.get(); }
  void* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  void Reset();

  UniqueFd fd_;
  void* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_MEMFD_H_
