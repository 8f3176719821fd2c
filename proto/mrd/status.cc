#include "mrd/status.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace mrd {

absl::StatusCode CodeForSeed(SeedStatus seed) {
  using v1::SeedStatus;
  switch (seed) {
    case v1::STATUS_SUCCESS:
    case v1::STATUS_PENDING:
      return absl::StatusCode::kOk;
    case v1::STATUS_INVALID_PARAMETER:
    case v1::WSAEINVAL:
      return absl::StatusCode::kInvalidArgument;
    case v1::STATUS_INSUFFICIENT_RESOURCES:
    case v1::WSANOBUFS:
      return absl::StatusCode::kResourceExhausted;
    case v1::STATUS_BUFFER_TOO_SMALL:
    case v1::WSAEFAULT:
      return absl::StatusCode::kOutOfRange;
    case v1::STATUS_CONNECTION_INVALID:
    case v1::WSAENOTCONN:
      return absl::StatusCode::kFailedPrecondition;
    case v1::STATUS_ACCESS_VIOLATION:
      return absl::StatusCode::kPermissionDenied;
    case v1::SEED_STATUS_UNSPECIFIED:
    default:
      return absl::StatusCode::kUnknown;
  }
}

namespace {

absl::Status WithDetail(absl::StatusCode code, SeedStatus seed,
                        absl::string_view reason, absl::string_view message,
                        uint64_t required_size) {
  absl::Status status(code, message);
  v1::ErrorDetail detail;
  detail.set_seed_status(seed);
  detail.set_reason(std::string(reason));
  detail.set_required_size(required_size);
  status.SetPayload(kErrorDetailUrl, absl::Cord(detail.SerializeAsString()));
  return status;
}

}  // namespace

absl::Status SeedError(SeedStatus seed, absl::string_view reason,
                       absl::string_view message, uint64_t required_size) {
  return WithDetail(CodeForSeed(seed), seed, reason, message, required_size);
}

absl::Status MrdError(absl::StatusCode code, absl::string_view reason,
                      absl::string_view message) {
  return WithDetail(code, v1::SEED_STATUS_UNSPECIFIED, reason, message, 0);
}

absl::Status ErrnoError(int err, absl::string_view call,
                        absl::string_view reason) {
  std::string message = absl::StrCat(call, ": ", std::strerror(err));
  if (err == ENOMEM || err == EAGAIN || err == ENOSPC || err == EMFILE ||
      err == ENFILE) {
    return SeedError(v1::STATUS_INSUFFICIENT_RESOURCES, reason, message);
  }
  absl::Status base = absl::ErrnoToStatus(err, call);
  return MrdError(base.code(), reason, message);
}

v1::ErrorDetail GetErrorDetail(const absl::Status& status) {
  v1::ErrorDetail detail;
  if (auto payload = status.GetPayload(kErrorDetailUrl); payload.has_value()) {
    detail.ParseFromString(std::string(*payload));
  }
  return detail;
}

}  // namespace mrd
