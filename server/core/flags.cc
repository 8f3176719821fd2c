#include "server/core/flags.h"

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/device/device.h"

namespace mrd::core {
namespace {

// NDK_MR_FLAG_* (R3).
constexpr uint32_t kMrLocalWrite = 0x1;
constexpr uint32_t kMrRemoteRead = 0x2;
constexpr uint32_t kMrRemoteWriteBit = 0x4;  // part of REMOTE_WRITE (0x5)
constexpr uint32_t kMrReadSink = 0x8;
constexpr uint32_t kMrKnown = 0xF;

// MEM_* (W6).
constexpr uint32_t kMemRead = 0x1;
constexpr uint32_t kMemWrite = 0x2;

// NDK_OP_FLAG_* (F3).
constexpr uint32_t kOpSilentSuccess = 0x1;
constexpr uint32_t kOpReadFence = 0x2;
constexpr uint32_t kOpRemoteRead = 0x8;
constexpr uint32_t kOpLocalWrite = 0x10;
constexpr uint32_t kOpRemoteWriteBit = 0x20;  // part of REMOTE_WRITE (0x30)
constexpr uint32_t kOpReadSink = 0x40;
constexpr uint32_t kOpDefer = 0x200;
constexpr uint32_t kOpKnown = kOpSilentSuccess | kOpReadFence | kOpRemoteRead |
                              kOpLocalWrite | kOpRemoteWriteBit | kOpReadSink |
                              kOpDefer;

}  // namespace

absl::StatusOr<uint32_t> RegistrationAccess(uint32_t ndk_flags,
                                            uint32_t mem_flags) {
  if (ndk_flags != 0 && mem_flags != 0) {
    return SeedError(WSAEINVAL, "BOTH_FLAG_FORMS",
                     "give either flags (NDK_MR_FLAG_*) or mem_flags (MEM_*), "
                     "not both");
  }
  if (mem_flags != 0) {
    if (mem_flags & ~(kMemRead | kMemWrite)) {
      return SeedError(WSAEINVAL, "UNKNOWN_MEM_FLAGS",
                       absl::StrCat("mem_flags 0x", absl::Hex(mem_flags),
                                    " is not MEM_READ (0x1), MEM_WRITE (0x2) "
                                    "or MEM_READWRITE (0x3)"));
    }
    uint32_t access = 0;
    if (mem_flags & kMemRead) access |= device::kAccessRemoteRead;
    if (mem_flags & kMemWrite) {
      access |= device::kAccessRemoteWrite | device::kAccessLocalWrite;
    }
    return access;
  }
  if (ndk_flags & ~kMrKnown) {
    return SeedError(STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS",
                     absl::StrCat("flags 0x", absl::Hex(ndk_flags),
                                  " has bits no NDK_MR_FLAG_* defines: 0x",
                                  absl::Hex(ndk_flags & ~kMrKnown)));
  }
  if ((ndk_flags & kMrRemoteWriteBit) && !(ndk_flags & kMrLocalWrite)) {
    return SeedError(STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS",
                     absl::StrCat("flags 0x", absl::Hex(ndk_flags),
                                  ": bit 0x4 only exists inside "
                                  "NDK_MR_FLAG_ALLOW_REMOTE_WRITE (0x5)"));
  }
  uint32_t access = 0;
  if (ndk_flags & kMrLocalWrite) access |= device::kAccessLocalWrite;
  if (ndk_flags & kMrRemoteRead) access |= device::kAccessRemoteRead;
  if (ndk_flags & kMrRemoteWriteBit) access |= device::kAccessRemoteWrite;
  if (ndk_flags & kMrReadSink) access |= device::kAccessReadSink;
  return access;
}

uint32_t FlagsFromAccess(uint32_t access) {
  uint32_t flags = 0;
  if (access & device::kAccessLocalWrite) flags |= kMrLocalWrite;
  if (access & device::kAccessRemoteRead) flags |= kMrRemoteRead;
  if (access & device::kAccessRemoteWrite) flags |= kMrRemoteWriteBit;
  if (access & device::kAccessReadSink) flags |= kMrReadSink;
  return flags;
}

absl::StatusOr<uint32_t> FastRegisterAccess(uint32_t op_flags) {
  if (op_flags & ~kOpKnown) {
    return SeedError(STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS",
                     absl::StrCat("flags 0x", absl::Hex(op_flags),
                                  " has bits no NDK_OP_FLAG_* defines for "
                                  "FastRegister: 0x",
                                  absl::Hex(op_flags & ~kOpKnown)));
  }
  if ((op_flags & kOpRemoteWriteBit) && !(op_flags & kOpLocalWrite)) {
    return SeedError(STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS",
                     absl::StrCat("flags 0x", absl::Hex(op_flags),
                                  ": bit 0x20 only exists inside "
                                  "NDK_OP_FLAG_ALLOW_REMOTE_WRITE (0x30)"));
  }
  uint32_t access = 0;
  if (op_flags & kOpRemoteRead) access |= device::kAccessRemoteRead;
  if (op_flags & kOpLocalWrite) access |= device::kAccessLocalWrite;
  if (op_flags & kOpRemoteWriteBit) access |= device::kAccessRemoteWrite;
  if (op_flags & kOpReadSink) access |= device::kAccessReadSink;
  return access;
}

}  // namespace mrd::core
