#include "server/service/grpc_status.h"

#include <string>

#include "mrd/status.h"
#include "mrd/status_proto.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::service {

grpc::Status ToGrpcStatus(const absl::Status& status,
                          grpc::ServerContextBase* ctx) {
  if (status.ok()) return grpc::Status::OK;
  const ErrorDetail detail = GetErrorDetail(status);
  if (ctx != nullptr) {
    ctx->AddTrailingMetadata(kSeedStatusKey,
                             std::string(SeedStatusName(detail.seed_status())));
    if (!detail.reason().empty()) {
      ctx->AddTrailingMetadata(kReasonKey, detail.reason());
    }
    if (detail.required_size() != 0) {
      ctx->AddTrailingMetadata(kRequiredSizeKey,
                               std::to_string(detail.required_size()));
    }
    ctx->AddTrailingMetadata(kErrorDetailKey,
                             ErrorDetailToProto(detail).SerializeAsString());
    // Clients retry UNAVAILABLE (their retry policy) for a handover; any
    // other UNAVAILABLE answer is final: a negative pushback says so.
    if (status.code() == absl::StatusCode::kUnavailable &&
        detail.reason() != "HANDED_OVER") {
      ctx->AddTrailingMetadata("grpc-retry-pushback-ms", "-1");
    }
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

}  // namespace mrd::service
