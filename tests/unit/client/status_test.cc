#include "client/lib/status.h"

#include <map>
#include <string>

#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"

namespace mrd::client {
namespace {

// Trailing metadata as gRPC hands it over; the strings must outlive it.
class Trailers {
 public:
  void Add(std::string key, std::string value) {
    storage_.emplace_back(std::move(key), std::move(value));
  }
  TrailingMetadata Get() const {
    TrailingMetadata out;
    for (const auto& [k, v] : storage_) {
      out.emplace(grpc::string_ref(k.data(), k.size()),
                  grpc::string_ref(v.data(), v.size()));
    }
    return out;
  }

 private:
  std::vector<std::pair<std::string, std::string>> storage_;
};

std::string DetailBytes(::mrd::SeedStatus seed, const std::string& reason,
                        uint64_t size) {
  v1::ErrorDetail d;  // as it travels in mrd-error-bin
  d.set_seed_status(::mrd::SeedStatusToProto(seed));
  d.set_reason(reason);
  d.set_required_size(size);
  return d.SerializeAsString();
}

TEST(StatusFromGrpcTest, OkStaysOkWithoutPayload) {
  Trailers t;
  t.Add("mrd-reason", "IGNORED");
  absl::Status s = StatusFromGrpc(grpc::Status::OK, t.Get());
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(SeedStatusOf(s), ::mrd::STATUS_SUCCESS);
}

TEST(StatusFromGrpcTest, ErrorBinRoundTripsThroughGetErrorDetail) {
  // What the server attaches: SeedError() -> metadata -> client status.
  absl::Status server = SeedError(::mrd::STATUS_BUFFER_TOO_SMALL,
                                  "LAM_CAPACITY", "need more room", 4104);
  ::mrd::ErrorDetail sent = GetErrorDetail(server);
  Trailers t;
  t.Add("mrd-error-bin", ::mrd::ErrorDetailToProto(sent).SerializeAsString());
  t.Add("mrd-seed-status", "STATUS_BUFFER_TOO_SMALL");
  t.Add("mrd-reason", "LAM_CAPACITY");
  t.Add("mrd-required-size", "4104");
  grpc::Status wire(static_cast<grpc::StatusCode>(server.code()),
                    std::string(server.message()));

  absl::Status s = StatusFromGrpc(wire, t.Get());
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(s.message(), "need more room");
  ::mrd::ErrorDetail got = GetErrorDetail(s);
  EXPECT_EQ(got.seed_status(), ::mrd::STATUS_BUFFER_TOO_SMALL);
  EXPECT_EQ(got.reason(), "LAM_CAPACITY");
  EXPECT_EQ(got.required_size(), 4104u);
  EXPECT_EQ(SeedStatusOf(s), ::mrd::STATUS_BUFFER_TOO_SMALL);
  EXPECT_EQ(ReasonOf(s), "LAM_CAPACITY");
  EXPECT_EQ(RequiredSizeOf(s), 4104u);
  EXPECT_TRUE(s.GetPayload(kErrorDetailUrl).has_value());
}

TEST(StatusFromGrpcTest, TextKeysAloneAreEnough) {
  Trailers t;
  t.Add("mrd-seed-status", "WSAEFAULT");
  t.Add("mrd-reason", "DESCRIPTOR_CAPACITY");
  t.Add("mrd-required-size", "24");
  absl::Status s = StatusFromGrpc(
      grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "too small"), t.Get());
  EXPECT_EQ(SeedStatusOf(s), ::mrd::WSAEFAULT);
  EXPECT_EQ(ReasonOf(s), "DESCRIPTOR_CAPACITY");
  EXPECT_EQ(RequiredSizeOf(s), 24u);
}

TEST(StatusFromGrpcTest, ErrorBinWinsOverTextKeys) {
  Trailers t;
  t.Add("mrd-error-bin", DetailBytes(::mrd::WSAENOTCONN, "SESSION_EXPIRED", 0));
  t.Add("mrd-seed-status", "WSAEINVAL");
  t.Add("mrd-reason", "OTHER");
  absl::Status s = StatusFromGrpc(
      grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "gone"), t.Get());
  EXPECT_EQ(SeedStatusOf(s), ::mrd::WSAENOTCONN);
  EXPECT_EQ(ReasonOf(s), "SESSION_EXPIRED");
  EXPECT_EQ(RequiredSizeOf(s), std::nullopt);
}

TEST(StatusFromGrpcTest, TextKeysFillWhatErrorBinLacks) {
  Trailers t;
  t.Add("mrd-error-bin", DetailBytes(::mrd::STATUS_BUFFER_TOO_SMALL, "", 0));
  t.Add("mrd-reason", "LAM_CAPACITY");
  t.Add("mrd-required-size", "72");
  absl::Status s = StatusFromGrpc(
      grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "x"), t.Get());
  EXPECT_EQ(SeedStatusOf(s), ::mrd::STATUS_BUFFER_TOO_SMALL);
  EXPECT_EQ(ReasonOf(s), "LAM_CAPACITY");
  EXPECT_EQ(RequiredSizeOf(s), 72u);
}

TEST(StatusFromGrpcTest, NoMrdMetadataMeansNoPayload) {
  absl::Status s = StatusFromGrpc(
      grpc::Status(grpc::StatusCode::UNAVAILABLE, "connect failed"),
      TrailingMetadata());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(s.GetPayload(kErrorDetailUrl).has_value());
  EXPECT_EQ(SeedStatusOf(s), ::mrd::SEED_STATUS_UNSPECIFIED);
  EXPECT_EQ(ReasonOf(s), "");
}

TEST(StatusFromGrpcTest, GarbageMetadataDoesNotBreakConversion) {
  Trailers t;
  t.Add("mrd-error-bin", std::string("\xff\xff\xff", 3));
  t.Add("mrd-seed-status", "NOT_A_SEED");
  t.Add("mrd-required-size", "lots");
  absl::Status s =
      StatusFromGrpc(grpc::Status(grpc::StatusCode::INTERNAL, "odd"), t.Get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(SeedStatusOf(s), ::mrd::SEED_STATUS_UNSPECIFIED);
  EXPECT_EQ(RequiredSizeOf(s), std::nullopt);
}

TEST(StatusFromGrpcTest, EveryCanonicalCodeIsKept) {
  for (int code = 1; code <= 16; ++code) {
    absl::Status s =
        StatusFromGrpc(grpc::Status(static_cast<grpc::StatusCode>(code), "m"),
                       TrailingMetadata());
    EXPECT_EQ(static_cast<int>(s.code()), code);
  }
}

TEST(StatusFromFdErrorTest, CarriesCodeMessageAndDetail) {
  v1::FdError e;
  e.set_code(static_cast<int>(absl::StatusCode::kInvalidArgument));
  e.set_message("not sealed");
  e.mutable_detail()->set_seed_status(v1::STATUS_INVALID_PARAMETER);
  e.mutable_detail()->set_reason("MEMFD_NOT_SEALED");
  absl::Status s = StatusFromFdError(e);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "not sealed");
  EXPECT_EQ(SeedStatusOf(s), ::mrd::STATUS_INVALID_PARAMETER);
  EXPECT_EQ(ReasonOf(s), "MEMFD_NOT_SEALED");
}

TEST(StatusFromFdErrorTest, ZeroCodeIsStillAnError) {
  v1::FdError e;
  e.set_message("?");
  EXPECT_EQ(StatusFromFdError(e).code(), absl::StatusCode::kUnknown);
}

TEST(FormatStatusTest, NamesCodeSeedReasonAndSize) {
  absl::Status s = SeedError(::mrd::WSAEFAULT, "DESCRIPTOR_CAPACITY",
                             "descriptor needs 24", 24);
  EXPECT_EQ(FormatStatus(s),
            "OUT_OF_RANGE WSAEFAULT DESCRIPTOR_CAPACITY: descriptor needs 24 "
            "(required_size=24)");
  EXPECT_EQ(FormatStatus(absl::UnavailableError("down")),
            "UNAVAILABLE SEED_STATUS_UNSPECIFIED -: down");
  EXPECT_EQ(FormatStatus(absl::OkStatus()), "OK");
}

}  // namespace
}  // namespace mrd::client
