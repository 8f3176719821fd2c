#include "mrd/status_proto.h"

#include <cstdint>
#include <string>

namespace mrd {
namespace {

// The two enums must stay the same, value for value and name for name.
#define MRD_SAME_SEED(name) \
  static_assert(static_cast<int>(name) == static_cast<int>(v1::name), #name)
MRD_SAME_SEED(SEED_STATUS_UNSPECIFIED);
MRD_SAME_SEED(STATUS_SUCCESS);
MRD_SAME_SEED(STATUS_PENDING);
MRD_SAME_SEED(STATUS_INVALID_PARAMETER);
MRD_SAME_SEED(STATUS_INSUFFICIENT_RESOURCES);
MRD_SAME_SEED(STATUS_BUFFER_TOO_SMALL);
MRD_SAME_SEED(STATUS_CONNECTION_INVALID);
MRD_SAME_SEED(STATUS_ACCESS_VIOLATION);
MRD_SAME_SEED(WSAEFAULT);
MRD_SAME_SEED(WSAEINVAL);
MRD_SAME_SEED(WSANOBUFS);
MRD_SAME_SEED(WSAENOTCONN);
#undef MRD_SAME_SEED
static_assert(static_cast<int>(kMaxSeedStatus) ==
              static_cast<int>(v1::SeedStatus_MAX));

}  // namespace

v1::SeedStatus SeedStatusToProto(SeedStatus seed) {
  return static_cast<v1::SeedStatus>(seed);
}

SeedStatus SeedStatusFromProto(v1::SeedStatus seed) {
  if (seed < 0 || static_cast<int>(seed) > static_cast<int>(kMaxSeedStatus)) {
    return SEED_STATUS_UNSPECIFIED;
  }
  return static_cast<SeedStatus>(seed);
}

v1::ErrorDetail ErrorDetailToProto(const ErrorDetail& detail) {
  v1::ErrorDetail proto;
  proto.set_seed_status(SeedStatusToProto(detail.seed_status()));
  proto.set_reason(detail.reason());
  proto.set_required_size(detail.required_size());
  return proto;
}

ErrorDetail ErrorDetailFromProto(const v1::ErrorDetail& proto) {
  ErrorDetail detail;
  detail.set_seed_status(SeedStatusFromProto(proto.seed_status()));
  detail.set_reason(proto.reason());
  detail.set_required_size(proto.required_size());
  return detail;
}

v1::ItemStatus ItemStatusToProto(const absl::Status& status) {
  v1::ItemStatus item;
  item.set_code(static_cast<int32_t>(status.code()));
  if (status.ok()) return item;
  item.set_message(std::string(status.message()));
  *item.mutable_detail() = ErrorDetailToProto(GetErrorDetail(status));
  return item;
}

absl::Status ItemStatusFromProto(const v1::ItemStatus& item) {
  if (item.code() == 0) return absl::OkStatus();
  // absl's codes are gRPC's, 1 to 16.
  const absl::StatusCode code = item.code() > 0 && item.code() <= 16
                                    ? static_cast<absl::StatusCode>(item.code())
                                    : absl::StatusCode::kUnknown;
  absl::Status status(code, item.message());
  if (item.has_detail()) {
    SetErrorDetail(&status, ErrorDetailFromProto(item.detail()));
  }
  return status;
}

}  // namespace mrd
