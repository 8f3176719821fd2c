#include "server/core/errors.h"

#include <cctype>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "mrd/status.h"

namespace mrd::core {

absl::Status NotConnected(absl::string_view why) {
  return SeedError(WSAENOTCONN, "SESSION_NOT_CONNECTED", why);
}

absl::Status UnknownHandle(absl::string_view what, uint64_t id) {
  std::string reason = absl::StrCat("UNKNOWN_", what);
  for (char& c : reason) c = static_cast<char>(std::toupper(c));
  return MrdError(absl::StatusCode::kNotFound, reason,
                  absl::StrCat("this session has no ", what, " ", id));
}

absl::Status SessionAwareError(Session& session, absl::Status status,
                               absl::string_view call) {
  absl::MutexLock lock(&session.mu);
  // The session ended while the device worked: its PD is gone, and the
  // device's "unknown PD" would only leak an internal id.
  if (session.closing) {
    return NotConnected(absl::StrCat("the session ended during ", call));
  }
  return status;
}

absl::Status OnDevice(const absl::Status& status, absl::string_view device) {
  absl::Status out(status.code(),
                   absl::StrCat("on device ", device, ": ", status.message()));
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  return out;
}

}  // namespace mrd::core
