#include "client/lib/memfd.h"

#include <fcntl.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::client {

static_assert(kBufferSeals == (F_SEAL_SHRINK | F_SEAL_GROW));

absl::StatusOr<MappedMemfd> MappedMemfd::Create(uint64_t size,
                                                absl::string_view name,
                                                bool huge_pages) {
  if (size == 0) {
    return SeedError(STATUS_INVALID_PARAMETER, "EMPTY_BUFFER",
                     "a buffer needs a non-zero size");
  }
  if (size > static_cast<uint64_t>(INT64_MAX)) {
    return SeedError(STATUS_INVALID_PARAMETER, "BUFFER_TOO_LARGE",
                     "buffer size does not fit off_t");
  }
  if (huge_pages && size % kHugePageSize != 0) {
    return SeedError(STATUS_INVALID_PARAMETER, "HUGE_PAGE_MULTIPLE",
                     absl::StrCat("a huge-page buffer's size must be a "
                                  "multiple of 2 MiB; ",
                                  size, " is not"));
  }
  MappedMemfd result;
  std::string label(name.empty() ? absl::string_view("mrd-buffer") : name);
  const unsigned huge = huge_pages ? MFD_HUGETLB | MFD_HUGE_2MB : 0;
  result.fd_.Reset(
      ::memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING | huge));
  if (!result.fd_.valid()) {
    return ErrnoError(errno, "memfd_create", "MEMFD_CREATE");
  }
  if (::ftruncate(result.fd_.get(), static_cast<off_t>(size)) != 0) {
    return ErrnoError(errno, "ftruncate", "MEMFD_TRUNCATE");
  }
  if (::fcntl(result.fd_.get(), F_ADD_SEALS, kBufferSeals) != 0) {
    return ErrnoError(errno, "fcntl(F_ADD_SEALS)", "MEMFD_SEAL");
  }
  void* data = ::mmap(nullptr, static_cast<size_t>(size),
                      PROT_READ | PROT_WRITE, MAP_SHARED, result.fd_.get(), 0);
  if (data == MAP_FAILED && huge_pages && errno == ENOMEM) {
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES, "NO_HUGE_PAGES",
        absl::StrCat("the kernel's pool has fewer than ", size / kHugePageSize,
                     " free 2 MiB pages (raise vm.nr_hugepages)"));
  }
  if (data == MAP_FAILED) return ErrnoError(errno, "mmap", "MEMFD_MMAP");
  result.data_ = data;
  result.size_ = size;
  return result;
}

MappedMemfd::MappedMemfd(MappedMemfd&& other) noexcept
    : fd_(std::move(other.fd_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedMemfd& MappedMemfd::operator=(MappedMemfd&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = std::move(other.fd_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedMemfd::~MappedMemfd() { Reset(); }

void MappedMemfd::Reset() {
  if (data_ != nullptr) ::munmap(data_, static_cast<size_t>(size_));
  data_ = nullptr;
  size_ = 0;
  fd_.Reset();
}

}  // namespace mrd::client
