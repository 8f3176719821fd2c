// Client-side error vocabulary. The one conversion from a finished gRPC call
// (grpc::Status plus the server's trailing metadata) to absl::Status lives
// here; the result carries the mrd ErrorDetail payload under
// mrd::kErrorDetailUrl, so mrd::GetErrorDetail(status) and the helpers below
// work on the client exactly as on the server.
//
// Thread-safe: all functions are pure.
#ifndef MRD_CLIENT_LIB_STATUS_H_
#define MRD_CLIENT_LIB_STATUS_H_

#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>
#include <grpcpp/support/string_ref.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "mrd/status.h"
#include "mrd/v1/fd.pb.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

// Trailing metadata keys of the error convention (mrd.proto).
inline constexpr absl::string_view kSeedStatusKey = "mrd-seed-status";
inline constexpr absl::string_view kReasonKey = "mrd-reason";
inline constexpr absl::string_view kRequiredSizeKey = "mrd-required-size";
inline constexpr absl::string_view kErrorBinKey = "mrd-error-bin";

using TrailingMetadata = std::multimap<grpc::string_ref, grpc::string_ref>;

// THE conversion. OK stays OK. Otherwise the code and message are kept and
// the ErrorDetail is taken from `mrd-error-bin`; fields it lacks are filled
// from `mrd-seed-status`, `mrd-reason` and `mrd-required-size`. A status
// without any of these keys (e.g. UNAVAILABLE from the channel itself) gets no
// payload, and GetErrorDetail() then reports SEED_STATUS_UNSPECIFIED.
absl::Status StatusFromGrpc(const grpc::Status& status,
                            const TrailingMetadata& trailers);

// The same for a call that has finished on `context`.
absl::Status StatusFromGrpc(const grpc::Status& status,
                            const grpc::ClientContext& context);

// An FdError reply of the fd socket (fd.proto) as absl::Status.
absl::Status StatusFromFdError(const v1::FdError& error);

// The seed outcome of an error (SEED_STATUS_UNSPECIFIED if none; STATUS_SUCCESS
// for OK).
SeedStatus SeedStatusOf(const absl::Status& status);
// The stable reason word, empty if none.
std::string ReasonOf(const absl::Status& status);
// The size the caller must provide, when the server sent one (non-zero).
std::optional<uint64_t> RequiredSizeOf(const absl::Status& status);

// "<CODE> <SEED_STATUS> <REASON>: <message>[ (required_size=N)]"; the reason is
// "-" when there is none. OK gives "OK".
std::string FormatStatus(const absl::Status& status);

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_STATUS_H_
