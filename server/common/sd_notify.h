// The systemd notification protocol (sd_notify(3)) without libsystemd: one
// datagram of "KEY=value" lines to the socket named by $NOTIFY_SOCKET (a
// path, or "@name" for the abstract namespace). mrd says READY=1 once it
// serves, MAINPID=<pid> when it took over from another mrd (so that systemd
// follows the new main process), RELOADING=1 when SIGHUP starts a successor
// and STOPPING=1 at shutdown (deploy/systemd/mrd.service, Type=notify).
//
// Thread safety: SdNotify touches only its arguments, the environment
// (read) and a socket of its own.
#ifndef MRD_SERVER_COMMON_SD_NOTIFY_H_
#define MRD_SERVER_COMMON_SD_NOTIFY_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace mrd {

// Sends `state` (lines of KEY=value, e.g. "READY=1\nMAINPID=42") to
// $NOTIFY_SOCKET. OK without sending when the variable is unset or empty
// (not started by systemd). Errors: INVALID_ARGUMENT BAD_NOTIFY_SOCKET (not
// an absolute path or @name, or too long); the socket calls' (ErrnoError,
// NOTIFY_FAILED).
absl::Status SdNotify(absl::string_view state);

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_SD_NOTIFY_H_
