// The core's errors that every resource shares: a session that is gone, a
// handle the session does not hold, and a device error seen by a session
// that ended while the device worked.
#ifndef MRD_SERVER_CORE_ERRORS_H_
#define MRD_SERVER_CORE_ERRORS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/core/session.h"

namespace mrd::core {

// WSAENOTCONN, SESSION_NOT_CONNECTED.
absl::Status NotConnected(absl::string_view why);
// NOT_FOUND, UNKNOWN_<WHAT>: "this session has no <what> <id>".
absl::Status UnknownHandle(absl::string_view what, uint64_t id);
// A device error of a call for `session`, or WSAENOTCONN when the session
// ended meanwhile (the device then names a PD that no longer exists).
absl::Status SessionAwareError(Session& session, absl::Status status,
                               absl::string_view call)
    ABSL_LOCKS_EXCLUDED(session.mu);
// `status` with its message saying which device gave it (its code and
// error detail unchanged): a call on several devices names the one that
// refused.
absl::Status OnDevice(const absl::Status& status, absl::string_view device);

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_ERRORS_H_
