// FdChannel: the client end of mrd's fd socket (fd.proto): a connected Unix
// SOCK_SEQPACKET socket carrying one FdRequest/FdReply per datagram. Owns the
// socket; closing it ends the fd session on the server.
//
// Thread-safe: Exchange (and so ImportMemfd, Ping) may be called from many
// threads; one request/reply exchange runs at a time, under mu_.
//
// Errors: INVALID_ARGUMENT (the fd to pass is not open: EBADF at sendmsg;
// the channel stays usable), FAILED_PRECONDITION with WSAENOTCONN (mrd closed
// the socket, or Close() was called), DEADLINE_EXCEEDED (no reply in time),
// INTERNAL (malformed reply), and whatever FdError mrd answers with.
#ifndef MRD_CLIENT_LIB_FD_CHANNEL_H_
#define MRD_CLIENT_LIB_FD_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/fd.pb.h"

namespace mrd::client {

class FdChannel {
 public:
  // Connects to the fd socket at `path` and reads the welcome.
  // UNAVAILABLE if nothing listens there; PERMISSION_DENIED if the socket is
  // not accessible or mrd refuses the caller (its FdError is returned).
  static absl::StatusOr<std::unique_ptr<FdChannel>> Connect(
      absl::string_view path, absl::Duration timeout);

  // Takes an already connected socket (tests: one end of a socketpair) and
  // reads the welcome from it.
  static absl::StatusOr<std::unique_ptr<FdChannel>> FromConnectedSocket(
      UniqueFd socket, absl::Duration timeout);

  FdChannel(const FdChannel&) = delete;
  FdChannel& operator=(const FdChannel&) = delete;
  ~FdChannel() = default;

  const v1::FdWelcome& welcome() const { return welcome_; }

  // Sends `request` (its sequence is assigned here) with `fd_to_pass` in an
  // SCM_RIGHTS message when >= 0, and waits for the reply with the same
  // sequence. A reply with sequence 0 and an error is mrd saying it could not
  // parse our datagram, and is taken as the answer too.
  absl::StatusOr<v1::FdReply> Exchange(v1::FdRequest request, int fd_to_pass,
                                       absl::Duration timeout);

  // ImportMemfd: the imported buffer, or the error (FdError converted).
  absl::StatusOr<v1::BufferInfo> ImportMemfd(int fd, bool writable,
                                             uint64_t expected_size,
                                             absl::Duration timeout);
  absl::Status Ping(absl::Duration timeout);

  // Closes the socket (ends the session). Idempotent.
  void Close();
  bool is_open() const;
  // The socket, for poll(2) only (readable or hung up: mrd closed the
  // session). -1 once closed.
  int socket_fd() const;

 private:
  explicit FdChannel(UniqueFd socket) : socket_(std::move(socket)) {}
  absl::Status ReadWelcome(absl::Duration timeout);
  // Receives one datagram into `reply`. Received fds are closed.
  absl::Status ReceiveLocked(absl::Time deadline, v1::FdReply* reply)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  UniqueFd socket_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  v1::FdWelcome welcome_;  // set before the channel is shared
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_FD_CHANNEL_H_
