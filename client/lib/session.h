// mrd::client::Session: one mrd session, the owner of everything a client
// registers (see mrd.proto, "Sessions").
//
//   * Session::OpenFd connects the fd socket; the session lives exactly as
//     long as this object (the destructor closes the socket, and mrd then
//     releases everything in it). Buffers are handed over as memfds.
//   * Session::OpenLease opens a lease session; the destructor calls
//     CloseSession.
//   * Session::Attach names a lease session opened elsewhere (e.g. by
//     `mrctl lease open`); the destructor leaves it open.
//
// The handles made in a session (Buffer, Registration, Lam, Mr,
// CompletionStream) share its state: they stay valid after the Session
// object moves. Destroy them before the Session to release them one by one;
// if the session ends first, mrd has already released everything and their
// destructors do nothing.
//
// Movable, not copyable. Thread-safe: all const methods may be called
// concurrently (ImportMemfd exchanges one datagram pair at a time under a
// mutex). A moved-from Session may only be destroyed or assigned to.
#ifndef MRD_CLIENT_LIB_SESSION_H_
#define MRD_CLIENT_LIB_SESSION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/lib/client.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

namespace internal {
struct SessionCore;
}  // namespace internal

class Buffer;

class Session {
 public:
  enum class Kind { kFd, kLease, kAttached };

  // Connects the fd socket at `fd_socket_path` (empty:
  // FdSocketPathFor(client.options())) and reads the welcome. Errors:
  // UNAVAILABLE (nothing listening), PERMISSION_DENIED (socket not accessible
  // or the caller's uid not allowed), DEADLINE_EXCEEDED (no welcome within
  // rpc_timeout).
  static absl::StatusOr<Session> OpenFd(const Client& client,
                                        absl::string_view fd_socket_path = "");
  // OpenLeaseSession with `ttl` (zero: the server's default; whole seconds).
  // When the fd socket lets the caller in, a short-lived fd session vouches
  // for the lease, which then carries the caller's uid (its tenant, and the
  // files it may import); otherwise the lease is anonymous.
  // Errors: INVALID_ARGUMENT (ttl out of range), RESOURCE_EXHAUSTED.
  static absl::StatusOr<Session> OpenLease(
      const Client& client, absl::Duration ttl = absl::ZeroDuration());
  // A lease session opened elsewhere; nothing is checked here (Info() does).
  static Session Attach(const Client& client, std::string token);

  Session(Session&& other) noexcept;
  Session& operator=(Session&& other) noexcept;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session();

  const std::string& token() const;
  Kind kind() const;
  const Client& client() const;
  // The fd welcome's peer uid/pid (fd sessions); zero otherwise.
  uint32_t peer_uid() const;
  uint32_t peer_pid() const;

  // GetSession: describes the session and renews a lease.
  absl::StatusOr<v1::SessionInfo> Info() const;
  // ListRegistrations: everything the session holds.
  absl::StatusOr<v1::ListRegistrationsResponse> List() const;
  // Fd sessions: a Ping round trip on the fd socket. Others: Info().
  absl::Status Ping() const;

  // Imports `fd` (a memfd sealed with F_SEAL_SHRINK) over the fd socket
  // (sendmsg with SCM_RIGHTS; the caller keeps its fd). Fd sessions only
  // (FAILED_PRECONDITION otherwise). A closed fd gives INVALID_ARGUMENT
  // (EBADF at sendmsg) and the session stays usable; mrd's refusals come
  // back with its codes (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...).
  absl::StatusOr<Buffer> ImportMemfd(int fd, bool writable,
                                     uint64_t expected_size) const;

  // Ends the session now: CloseSession (mrd releases everything the session
  // holds before it answers), then, for an fd session, its socket closes
  // (if mrd cannot be asked, the socket's hang-up ends the session on mrd's
  // own time). Idempotent for fd sessions. After it the handles made in
  // this session are inert.
  absl::Status Close();

  // The fd socket, for poll(2) only: readable or hung up means mrd ended the
  // session. -1 for lease sessions and once closed.
  int fd_socket() const;

  // For the handle types of this library.
  const std::shared_ptr<internal::SessionCore>& core() const { return core_; }

 private:
  explicit Session(std::shared_ptr<internal::SessionCore> core)
      : core_(std::move(core)) {}
  void EndOnDestruction();

  std::shared_ptr<internal::SessionCore> core_;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_SESSION_H_
