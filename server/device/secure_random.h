// Randomness for keys, tickets and the IOVA layout, from the kernel CSPRNG
// (getrandom(2)). Key bytes and tickets are security boundaries: a peer that
// could predict them could reach memory it was never given (W8).
#ifndef MRD_SERVER_DEVICE_SECURE_RANDOM_H_
#define MRD_SERVER_DEVICE_SECURE_RANDOM_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mrd::device {

// Fills `size` bytes. Errors: INTERNAL "RANDOM_FAILED" when getrandom fails
// (it does not once the kernel pool is initialised). Thread-safe.
absl::Status SecureRandomBytes(void* out, size_t size);

// `bytes` random bytes as lower-case hex. Thread-safe.
absl::StatusOr<std::string> SecureRandomHex(size_t bytes);

// Buffers getrandom output so that per-key draws cost one system call per
// kPoolBytes. Thread-compatible: the owner serializes calls.
class SecureRandomPool {
 public:
  absl::StatusOr<uint8_t> Byte();
  absl::StatusOr<uint64_t> Uint64();

 private:
  static constexpr size_t kPoolBytes = 256;
  absl::Status Take(void* out, size_t size);

  uint8_t pool_[kPoolBytes] = {};
  size_t used_ = kPoolBytes;  // empty until the first draw
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SECURE_RANDOM_H_
