// Internal to mrd_client: the state a Session shares with the handles made
// in it (Buffer, Registration, Lam, Mr, CompletionStream), so that handles
// stay safe to use and destroy after the Session object has moved or gone.
//
// Thread-safe: token/kind/client are immutable; `ended` is atomic; the fd
// channel synchronizes itself.
#ifndef MRD_CLIENT_LIB_SESSION_CORE_H_
#define MRD_CLIENT_LIB_SESSION_CORE_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "client/lib/client.h"
#include "client/lib/fd_channel.h"
#include "mrd/status.h"

namespace mrd::client::internal {

enum class SessionKind { kFd, kLease, kAttached };

struct SessionCore {
  SessionCore(Client c, std::string t, SessionKind k)
      : client(std::move(c)), token(std::move(t)), kind(k) {}

  const Client client;
  const std::string token;
  const SessionKind kind;
  // Set for kFd sessions.
  std::unique_ptr<FdChannel> fd_channel;
  // True once this process ended the session (closed the fd socket or called
  // CloseSession) or saw that it ended: mrd has released everything, so
  // handles skip their release calls.
  std::atomic<bool> ended{false};

  bool Ended() const {
    if (ended.load(std::memory_order_acquire)) return true;
    return fd_channel != nullptr && !fd_channel->is_open();
  }
};

// A release that mrd answers with WSAENOTCONN found the session already
// ended (closed elsewhere, expired), and with it everything it held: the
// release has happened. Marks the session ended and returns true then.
inline bool EndedElsewhere(SessionCore& core, const absl::Status& status) {
  if (status.ok() || GetErrorDetail(status).seed_status() != WSAENOTCONN) {
    return false;
  }
  core.ended.store(true, std::memory_order_release);
  return true;
}

// Logs a failed release from a destructor (never aborts).
void LogReleaseError(absl::string_view what, uint64_t id,
                     const absl::Status& status);

}  // namespace mrd::client::internal

#endif  // MRD_CLIENT_LIB_SESSION_CORE_H_
