// The one conversion from absl::Status to grpc::Status. absl status codes are
// gRPC status codes, so the code carries over unchanged; the mrd ErrorDetail
// payload (seed outcome name, reason, required size) is copied into trailing
// metadata as documented at the top of mrd.proto.
#ifndef MRD_SERVER_SERVICE_GRPC_STATUS_H_
#define MRD_SERVER_SERVICE_GRPC_STATUS_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace mrd::service {

inline constexpr char kSeedStatusKey[] = "mrd-seed-status";
inline constexpr char kReasonKey[] = "mrd-reason";
inline constexpr char kRequiredSizeKey[] = "mrd-required-size";
inline constexpr char kErrorDetailKey[] = "mrd-error-bin";

// Converts `status`; when it is an error and `ctx` is non-null, adds the
// trailing metadata. Call before Finish, from the thread that finishes.
grpc::Status ToGrpcStatus(const absl::Status& status,
                          grpc::ServerContextBase* ctx);

}  // namespace mrd::service

#endif  // MRD_SERVER_SERVICE_GRPC_STATUS_H_
