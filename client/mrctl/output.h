// How mrctl prints: results on stdout as key=value lines (nested fields as
// "a.b=", repeated messages as "a[0].b=", repeated scalars comma-joined,
// enums by name, bytes in hex, every field shown) or, with --json, in
// protobuf's JSON mapping (lowerCamelCase names as grpcurl prints them,
// default values included, 64-bit integers as strings), one object per line.
// Errors go to stderr as "mrctl: <CODE> <SEED_STATUS> <REASON>: <message>".
//
// Thread-safe: pure functions.
#ifndef MRD_CLIENT_MRCTL_OUTPUT_H_
#define MRD_CLIENT_MRCTL_OUTPUT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace mrd::mrctl {

// The documented exit codes.
enum ExitCode : int {
  kExitOk = 0,
  kExitUsage = 1,         // mrctl's own command line
  kExitFailed = 2,        // INVALID_ARGUMENT, OUT_OF_RANGE, and the rest
  kExitNotFound = 3,      // NOT_FOUND
  kExitDenied = 4,        // PERMISSION_DENIED, UNAUTHENTICATED
  kExitExhausted = 5,     // RESOURCE_EXHAUSTED
  kExitUnavailable = 6,   // UNAVAILABLE, DEADLINE_EXCEEDED
  kExitPrecondition = 7,  // FAILED_PRECONDITION
};

// The table above; usage errors (IsUsageError) give kExitUsage.
int ExitCodeFor(const absl::Status& status);

// Key=value lines, each key prefixed with `prefix`; ends with a newline
// unless the message prints nothing.
std::string HumanForm(const google::protobuf::Message& message,
                      absl::string_view prefix = "");

// One line of JSON, no trailing newline.
absl::StatusOr<std::string> JsonForm(const google::protobuf::Message& message);

// "mrctl: ..." for stderr, without newline. Usage errors: "mrctl: <message>".
std::string ErrorLine(const absl::Status& status);

}  // namespace mrd::mrctl

#endif  // MRD_CLIENT_MRCTL_OUTPUT_H_
