#include "server/device/secure_random.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::device {

absl::Status SecureRandomBytes(void* out, size_t size) {
  auto* p = static_cast<uint8_t*>(out);
  while (size > 0) {
    ssize_t n = getrandom(p, size, 0);
    if (n < 0) {
      int err = errno;
      if (err == EINTR) continue;
      return MrdError(absl::StatusCode::kInternal, "RANDOM_FAILED",
                      absl::StrCat("getrandom: ", std::strerror(err)));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SecureRandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  MRD_RETURN_IF_ERROR(SecureRandomBytes(raw.data(), raw.size()));
  return absl::BytesToHexString(raw);
}

absl::Status SecureRandomPool::Take(void* out, size_t size) {
  if (kPoolBytes - used_ < size) {
    MRD_RETURN_IF_ERROR(SecureRandomBytes(pool_, kPoolBytes));
    used_ = 0;
  }
  std::memcpy(out, pool_ + used_, size);
  // Drawn bytes are wiped so that a later memory disclosure cannot replay
  // keys already handed out.
  std::memset(pool_ + used_, 0, size);
  used_ += size;
  return absl::OkStatus();
}

absl::StatusOr<uint8_t> SecureRandomPool::Byte() {
  uint8_t value = 0;
  MRD_RETURN_IF_ERROR(Take(&value, sizeof(value)));
  return value;
}

absl::StatusOr<uint64_t> SecureRandomPool::Uint64() {
  uint64_t value = 0;
  MRD_RETURN_IF_ERROR(Take(&value, sizeof(value)));
  return value;
}

}  // namespace mrd::device
