// The fast-register page-array rules (F2, F6), in one place: the core checks
// a FastRegister request with them before it names any device object, and
// every device checks a posted fast registration with them again (a device
// is used by more than the core: tests, fuzzers), so the two can never
// disagree on what a valid page array is or on what a refusal is called.
//
// Thread-safe: a pure function.
#ifndef MRD_SERVER_DEVICE_FAST_REGISTER_RULES_H_
#define MRD_SERVER_DEVICE_FAST_REGISTER_RULES_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace mrd::device {

// F2/F6: 1..max_pages entries, each page_size-aligned; fbo < page_size;
// 0 < length <= count * page_size - fbo; base_address != 0, base_address %
// page_size == fbo, and base_address + length does not wrap. The first
// broken rule is the error: STATUS_INVALID_PARAMETER with one of the reasons
// EMPTY_PAGE_ARRAY, PAGE_ARRAY_TOO_LONG, MISALIGNED_PAGE, FBO_TOO_LARGE,
// ZERO_LENGTH, LENGTH_EXCEEDS_PAGES, ZERO_BASED_ADDRESS, BASE_NOT_AT_FBO,
// BASE_ADDRESS_OVERFLOW. `page_size` must be a non-zero power of two no
// larger than 2^32 (a host page size).
absl::Status ValidatePageArray(uint64_t page_size, uint32_t max_pages,
                               absl::Span<const uint64_t> pages, uint32_t fbo,
                               uint64_t length, uint64_t base_address);

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_FAST_REGISTER_RULES_H_
