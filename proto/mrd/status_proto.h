// The error vocabulary of mrd/status.h on the wire: conversions between
// mrd::ErrorDetail / mrd::SeedStatus and mrd.proto's ErrorDetail message and
// SeedStatus enum, for the code that puts errors on the wire (the gRPC edge,
// the fd socket, completion events) and the client that reads them back.
//
// Thread-safe: all functions are pure.
#ifndef MRD_PROTO_MRD_STATUS_PROTO_H_
#define MRD_PROTO_MRD_STATUS_PROTO_H_

#include "mrd/status.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd {

v1::SeedStatus SeedStatusToProto(SeedStatus seed);
// A value mrd does not know becomes SEED_STATUS_UNSPECIFIED.
SeedStatus SeedStatusFromProto(v1::SeedStatus seed);

v1::ErrorDetail ErrorDetailToProto(const ErrorDetail& detail);
ErrorDetail ErrorDetailFromProto(const v1::ErrorDetail& detail);

// One item of a batch call: its status, code, message and detail.
v1::ItemStatus ItemStatusToProto(const absl::Status& status);
// The inverse; a code outside absl's becomes UNKNOWN.
absl::Status ItemStatusFromProto(const v1::ItemStatus& item);

}  // namespace mrd

#endif  // MRD_PROTO_MRD_STATUS_PROTO_H_
