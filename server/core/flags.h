// The seed rules that need no device: flag decoding (R3, W6, F3). (The
// fast-register page-array rules, F2 and F6, are the device's:
// server/device/fast_register_rules.h.) Pure functions, thread-safe.
#ifndef MRD_SERVER_CORE_FLAGS_H_
#define MRD_SERVER_CORE_FLAGS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_FLAGS_H_
