// Error vocabulary of mrd, shared by the server and the client library (so
// it lives beside the API it belongs to): absl::Status everywhere, with the
// seed documents' outcome name (SeedStatus), a stable reason and an optional
// required size attached as a payload. The one table from SeedStatus to
// status code lives in status.cc; the one conversion to gRPC lives in
// server/service, the one conversion back in client/lib/status.h.
//
// It needs no generated code: SeedStatus has the values and names of
// mrd.proto's enum, and ErrorDetail the fields of its message, so the
// devices and the server's common code speak it without the wire messages;
// mrd/status_proto.h converts at the edges that put an ErrorDetail on the
// wire (gRPC trailers, fd socket replies, completion events).
//
// Thread-safe: all functions are pure.
#ifndef MRD_PROTO_MRD_STATUS_H_
#define MRD_PROTO_MRD_STATUS_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mrd {

// The seed documents' outcomes: the values and names of mrd.proto's
// SeedStatus (mrd/status_proto.h checks that they agree).
enum SeedStatus : int {
  SEED_STATUS_UNSPECIFIED = 0,
  STATUS_SUCCESS = 1,
  STATUS_PENDING = 2,
  STATUS_INVALID_PARAMETER = 3,
  STATUS_INSUFFICIENT_RESOURCES = 4,
  STATUS_BUFFER_TOO_SMALL = 5,
  STATUS_CONNECTION_INVALID = 6,
  STATUS_ACCESS_VIOLATION = 7,
  WSAEFAULT = 8,
  WSAEINVAL = 9,
  WSANOBUFS = 10,
  WSAENOTCONN = 11,
};
inline constexpr SeedStatus kMaxSeedStatus = WSAENOTCONN;

// "STATUS_INVALID_PARAMETER"; an unknown value gives "SEED_STATUS_UNSPECIFIED".
absl::string_view SeedStatusName(SeedStatus seed);
// The inverse of SeedStatusName; false for a name that is none of them.
bool ParseSeedStatus(absl::string_view name, SeedStatus* seed);

// What an error carries besides its code and message (the accessors are
// those of mrd.proto's ErrorDetail message).
class ErrorDetail {
 public:
  SeedStatus seed_status() const { return seed_status_; }
  const std::string& reason() const { return reason_; }
  uint64_t required_size() const { return required_size_; }
  void set_seed_status(SeedStatus seed) { seed_status_ = seed; }
  void set_reason(std::string reason) { reason_ = std::move(reason); }
  void set_required_size(uint64_t size) { required_size_ = size; }
  // "seed_status: STATUS_INVALID_PARAMETER reason: \"ZERO_LENGTH\"
  // required_size: 0", for messages and test output.
  std::string DebugString() const;
  friend bool operator==(const ErrorDetail&, const ErrorDetail&) = default;

 private:
  SeedStatus seed_status_ = SEED_STATUS_UNSPECIFIED;
  std::string reason_;
  uint64_t required_size_ = 0;
};

// The status code every seed outcome maps to (the table in mrd.proto).
absl::StatusCode CodeForSeed(SeedStatus seed);

// An error for a seed outcome: code from the table, `reason` a stable
// UPPER_SNAKE_CASE word, `message` for humans.
absl::Status SeedError(SeedStatus seed, absl::string_view reason,
                       absl::string_view message, uint64_t required_size = 0);

// An error with no seed counterpart (NOT_FOUND for unknown handles, ...).
absl::Status MrdError(absl::StatusCode code, absl::string_view reason,
                      absl::string_view message);

// An error from errno at a system call, with a reason. ENOMEM/EAGAIN/ENOSPC
// become STATUS_INSUFFICIENT_RESOURCES.
absl::Status ErrnoError(int err, absl::string_view call,
                        absl::string_view reason);

// Reads the detail attached by the functions above. A status without one
// gets SEED_STATUS_UNSPECIFIED and an empty reason.
ErrorDetail GetErrorDetail(const absl::Status& status);

// Attaches `detail` to a non-OK `status` (replacing any detail it had).
void SetErrorDetail(absl::Status* status, const ErrorDetail& detail);

// Payload type URL under which the detail is stored (mrd's own encoding:
// seed status and required size as little-endian integers, then the reason).
inline constexpr absl::string_view kErrorDetailUrl = "mrd/ErrorDetail";

}  // namespace mrd

// Small helpers that absl 20220623 lacks.
#define MRD_STATUS_CONCAT_INNER_(a, b) a##b
#define MRD_STATUS_CONCAT_(a, b) MRD_STATUS_CONCAT_INNER_(a, b)

#define MRD_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status mrd_status_ = (expr);       \
    if (!mrd_status_.ok()) return mrd_status_; \
  } while (0)

#define MRD_ASSIGN_OR_RETURN(lhs, rexpr)                                       \
  MRD_ASSIGN_OR_RETURN_IMPL_(MRD_STATUS_CONCAT_(mrd_statusor_, __LINE__), lhs, \
                             rexpr)

#define MRD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                               \
  if (!statusor.ok()) return statusor.status();          \
  lhs = std::move(statusor).value()

#endif  // MRD_PROTO_MRD_STATUS_H_
