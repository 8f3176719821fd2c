// Error vocabulary of mrd, shared by the server and the client library (so
// it lives beside the API it belongs to): absl::Status everywhere, with the
// seed documents' outcome name (SeedStatus), a stable reason and an optional
// required size attached as a payload. The one table from SeedStatus to
// status code lives in status.cc; the one conversion to gRPC lives in
// server/service, the one conversion back in client/lib/status.h.
//
// Thread-safe: all functions are pure.
#ifndef MRD_PROTO_MRD_STATUS_H_
#define MRD_PROTO_MRD_STATUS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd {

using SeedStatus = ::mrd::v1::SeedStatus;

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
::mrd::v1::ErrorDetail GetErrorDetail(const absl::Status& status);

// Payload type URL under which the detail is stored.
inline constexpr absl::string_view kErrorDetailUrl =
    "type.googleapis.com/mrd.v1.ErrorDetail";

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
