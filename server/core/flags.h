// The seed rules that need no device: flag decoding (R3, W6, F3) and the
// fast-register page-array checks (F2, F6). Pure functions, thread-safe.
#ifndef MRD_SERVER_CORE_FLAGS_H_
#define MRD_SERVER_CORE_FLAGS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/repeated_field.h"

namespace mrd::core {

// NDK_MR_FLAG_* (R3) or MEM_* (W6) -> device::AccessBits. At most one form may
// be used. Unknown NDK bits: STATUS_INVALID_PARAMETER "UNKNOWN_FLAGS"; unknown
// MEM bits or both forms: WSAEINVAL.
absl::StatusOr<uint32_t> RegistrationAccess(uint32_t ndk_flags,
                                            uint32_t mem_flags);

// device::AccessBits -> NDK_MR_FLAG_* (for display).
uint32_t FlagsFromAccess(uint32_t access);

// NDK_OP_FLAG_* (F3) -> device::AccessBits. Unknown bits:
// STATUS_INVALID_PARAMETER "UNKNOWN_FLAGS".
absl::StatusOr<uint32_t> FastRegisterAccess(uint32_t op_flags);

// F2/F6: each page PAGE_SIZE-aligned; 1..max_pages entries; fbo < page_size;
// 0 < length <= count*page_size - fbo; base != 0 and base % page_size == fbo.
absl::Status ValidatePageArray(
    uint64_t page_size, uint32_t max_pages,
    const google::protobuf::RepeatedField<uint64_t>& pages, uint32_t fbo,
    uint64_t length, uint64_t base_address);

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_FLAGS_H_
