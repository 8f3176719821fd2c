#include "mrd/status.h"

#include <cerrno>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace mrd {

absl::StatusCode CodeForSeed(SeedStatus seed) {
  switch (seed) {
    case STATUS_SUCCESS:
    case STATUS_PENDING:
      return absl::StatusCode::kOk;
    case STATUS_INVALID_PARAMETER:
    case WSAEINVAL:
      return absl::StatusCode::kInvalidArgument;
    case STATUS_INSUFFICIENT_RESOURCES:
    case WSANOBUFS:
      return absl::StatusCode::kResourceExhausted;
    case STATUS_BUFFER_TOO_SMALL:
    case WSAEFAULT:
      return absl::StatusCode::kOutOfRange;
    case STATUS_CONNECTION_INVALID:
    case WSAENOTCONN:
      return absl::StatusCode::kFailedPrecondition;
    case STATUS_ACCESS_VIOLATION:
      return absl::StatusCode::kPermissionDenied;
    case SEED_STATUS_UNSPECIFIED:
    default:
      return absl::StatusCode::kUnknown;
  }
}

namespace {

constexpr absl::string_view kSeedNames[] = {
    "SEED_STATUS_UNSPECIFIED",
    "STATUS_SUCCESS",
    "STATUS_PENDING",
    "STATUS_INVALID_PARAMETER",
    "STATUS_INSUFFICIENT_RESOURCES",
    "STATUS_BUFFER_TOO_SMALL",
    "STATUS_CONNECTION_INVALID",
    "STATUS_ACCESS_VIOLATION",
    "WSAEFAULT",
    "WSAEINVAL",
    "WSANOBUFS",
    "WSAENOTCONN",
};
static_assert(std::size(kSeedNames) == kMaxSeedStatus + 1);

// The payload: 4 bytes of seed status and 8 of required size, both
// little-endian, then the reason's bytes.
constexpr size_t kFixedBytes = 12;

void PutLittleEndian(uint64_t value, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) {
    out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
}

uint64_t GetLittleEndian(absl::string_view in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) {
    value |= uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  }
  return value;
}

absl::Status WithDetail(absl::StatusCode code, SeedStatus seed,
                        absl::string_view reason, absl::string_view message,
                        uint64_t required_size) {
  absl::Status status(code, message);
  ErrorDetail detail;
  detail.set_seed_status(seed);
  detail.set_reason(std::string(reason));
  detail.set_required_size(required_size);
  SetErrorDetail(&status, detail);
  return status;
}

}  // namespace

absl::string_view SeedStatusName(SeedStatus seed) {
  if (seed < 0 || seed > kMaxSeedStatus) return kSeedNames[0];
  return kSeedNames[seed];
}

bool ParseSeedStatus(absl::string_view name, SeedStatus* seed) {
  for (int i = 0; i <= kMaxSeedStatus; ++i) {
    if (kSeedNames[i] == name) {
      *seed = static_cast<SeedStatus>(i);
      return true;
    }
  }
  return false;
}

std::string ErrorDetail::DebugString() const {
  return absl::StrCat("seed_status: ", SeedStatusName(seed_status_),
                      " reason: \"", absl::CEscape(reason_),
                      "\" required_size: ", required_size_);
}

void SetErrorDetail(absl::Status* status, const ErrorDetail& detail) {
  if (status->ok()) return;
  std::string payload;
  payload.reserve(kFixedBytes + detail.reason().size());
  PutLittleEndian(static_cast<uint32_t>(detail.seed_status()), 4, &payload);
  PutLittleEndian(detail.required_size(), 8, &payload);
  payload += detail.reason();
  status->SetPayload(kErrorDetailUrl, absl::Cord(std::move(payload)));
}

absl::Status SeedError(SeedStatus seed, absl::string_view reason,
                       absl::string_view message, uint64_t required_size) {
  return WithDetail(CodeForSeed(seed), seed, reason, message, required_size);
}

absl::Status MrdError(absl::StatusCode code, absl::string_view reason,
                      absl::string_view message) {
  return WithDetail(code, SEED_STATUS_UNSPECIFIED, reason, message, 0);
}

absl::Status ErrnoError(int err, absl::string_view call,
                        absl::string_view reason) {
  std::string message = absl::StrCat(call, ": ", std::strerror(err));
  if (err == ENOMEM || err == EAGAIN || err == ENOSPC || err == EMFILE ||
      err == ENFILE) {
    return SeedError(STATUS_INSUFFICIENT_RESOURCES, reason, message);
  }
  absl::Status base = absl::ErrnoToStatus(err, call);
  return MrdError(base.code(), reason, message);
}

ErrorDetail GetErrorDetail(const absl::Status& status) {
  ErrorDetail detail;
  absl::optional<absl::Cord> payload = status.GetPayload(kErrorDetailUrl);
  if (!payload.has_value() || payload->size() < kFixedBytes) return detail;
  const std::string bytes(*payload);
  const uint64_t seed = GetLittleEndian(bytes, 4);
  if (seed <= kMaxSeedStatus) {
    detail.set_seed_status(static_cast<SeedStatus>(seed));
  }
  detail.set_required_size(
      GetLittleEndian(absl::string_view(bytes).substr(4), 8));
  detail.set_reason(bytes.substr(kFixedBytes));
  return detail;
}

}  // namespace mrd
