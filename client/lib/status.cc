#include "client/lib/status.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "mrd/status_proto.h"

namespace mrd::client {
namespace {

std::optional<std::string> FindTrailer(const TrailingMetadata& trailers,
                                       absl::string_view key) {
  for (const auto& [name, value] : trailers) {
    if (absl::string_view(name.data(), name.size()) == key) {
      return std::string(value.data(), value.size());
    }
  }
  return std::nullopt;
}

absl::StatusCode CodeFromInt(int code) {
  // gRPC and absl share the canonical codes 0..16.
  if (code < 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::StatusCode::kUnknown;
  }
  return static_cast<absl::StatusCode>(code);
}

}  // namespace

absl::Status StatusFromGrpc(const grpc::Status& status,
                            const TrailingMetadata& trailers) {
  if (status.ok()) return absl::OkStatus();
  absl::Status result(CodeFromInt(static_cast<int>(status.error_code())),
                      status.error_message());
  ErrorDetail detail;
  bool have_detail = false;
  if (auto bin = FindTrailer(trailers, kErrorBinKey); bin.has_value()) {
    v1::ErrorDetail proto;
    have_detail = proto.ParseFromString(*bin);
    if (have_detail) detail = ErrorDetailFromProto(proto);
  }
  if (auto seed = FindTrailer(trailers, kSeedStatusKey); seed.has_value()) {
    SeedStatus parsed;
    if (detail.seed_status() == SEED_STATUS_UNSPECIFIED &&
        ParseSeedStatus(*seed, &parsed)) {
      detail.set_seed_status(parsed);
    }
    have_detail = true;
  }
  if (auto reason = FindTrailer(trailers, kReasonKey); reason.has_value()) {
    if (detail.reason().empty()) detail.set_reason(*reason);
    have_detail = true;
  }
  if (auto size = FindTrailer(trailers, kRequiredSizeKey); size.has_value()) {
    uint64_t parsed = 0;
    if (detail.required_size() == 0 && absl::SimpleAtoi(*size, &parsed)) {
      detail.set_required_size(parsed);
    }
    have_detail = true;
  }
  if (have_detail) SetErrorDetail(&result, detail);
  return result;
}

absl::Status StatusFromGrpc(const grpc::Status& status,
                            const grpc::ClientContext& context) {
  if (status.ok()) return absl::OkStatus();
  return StatusFromGrpc(status, context.GetServerTrailingMetadata());
}

absl::Status StatusFromFdError(const v1::FdError& error) {
  absl::StatusCode code = CodeFromInt(error.code());
  if (code == absl::StatusCode::kOk) code = absl::StatusCode::kUnknown;
  absl::Status result(code, error.message());
  if (error.has_detail()) {
    SetErrorDetail(&result, ErrorDetailFromProto(error.detail()));
  }
  return result;
}

SeedStatus SeedStatusOf(const absl::Status& status) {
  if (status.ok()) return STATUS_SUCCESS;
  return GetErrorDetail(status).seed_status();
}

std::string ReasonOf(const absl::Status& status) {
  return GetErrorDetail(status).reason();
}

std::optional<uint64_t> RequiredSizeOf(const absl::Status& status) {
  uint64_t size = GetErrorDetail(status).required_size();
  if (size == 0) return std::nullopt;
  return size;
}

std::string FormatStatus(const absl::Status& status) {
  if (status.ok()) return "OK";
  const ErrorDetail detail = GetErrorDetail(status);
  std::string out = absl::StrCat(
      absl::StatusCodeToString(status.code()), " ",
      SeedStatusName(detail.seed_status()), " ",
      detail.reason().empty() ? "-" : detail.reason(), ": ", status.message());
  if (detail.required_size() != 0) {
    absl::StrAppend(&out, " (required_size=", detail.required_size(), ")");
  }
  return out;
}

}  // namespace mrd::client
