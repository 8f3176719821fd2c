#include "server/device/fast_register_rules.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::device {
namespace {

absl::Status Invalid(absl::string_view reason, absl::string_view message) {
  return SeedError(STATUS_INVALID_PARAMETER, reason, message);
}

}  // namespace

absl::Status ValidatePageArray(uint64_t page_size, uint32_t max_pages,
                               absl::Span<const uint64_t> pages, uint32_t fbo,
                               uint64_t length, uint64_t base_address) {
  const uint64_t count = pages.size();
  if (count == 0) return Invalid("EMPTY_PAGE_ARRAY", "the page array is empty");
  if (count > max_pages) {
    return Invalid("PAGE_ARRAY_TOO_LONG",
                   absl::StrCat(count, " pages exceed the limit of ", max_pages,
                                " pages"));
  }
  for (size_t i = 0; i < pages.size(); ++i) {
    if (pages[i] % page_size != 0) {
      return Invalid("MISALIGNED_PAGE",
                     absl::StrCat("page ", i, " (0x", absl::Hex(pages[i]),
                                  ") is not aligned to PAGE_SIZE ", page_size));
    }
  }
  if (fbo >= page_size) {
    return Invalid(
        "FBO_TOO_LARGE",
        absl::StrCat("fbo ", fbo, " must be below PAGE_SIZE ", page_size));
  }
  if (length == 0) return Invalid("ZERO_LENGTH", "length is 0");
  // count <= 2^32 and page_size <= 2^32: the product fits in 64 bits.
  const uint64_t capacity = count * page_size - fbo;
  if (length > capacity) {
    return Invalid(
        "LENGTH_EXCEEDS_PAGES",
        absl::StrCat("length ", length, " exceeds ", count, " pages * ",
                     page_size, " - fbo ", fbo, " = ", capacity));
  }
  if (base_address == 0) {
    return Invalid("ZERO_BASED_ADDRESS",
                   "base_address 0: zero-based virtual addressing is not "
                   "supported (F6)");
  }
  if (base_address % page_size != fbo) {
    return Invalid(
        "BASE_NOT_AT_FBO",
        absl::StrCat("base_address 0x", absl::Hex(base_address),
                     " must equal fbo (", fbo, ") + n * PAGE_SIZE (F2)"));
  }
  if (base_address > UINT64_MAX - length) {
    return Invalid("BASE_ADDRESS_OVERFLOW",
                   "base_address + length overflows the address space");
  }
  return absl::OkStatus();
}

}  // namespace mrd::device
