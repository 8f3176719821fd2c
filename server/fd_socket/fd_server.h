// FdServer: the server side of the fd socket (proto/mrd/v1/fd.proto). It
// listens on a Unix SOCK_SEQPACKET socket, checks each peer's SO_PEERCRED
// against an allow-list, opens one session per connection through an
// FdSessionHandler, and turns each request datagram (with at most one fd in
// SCM_RIGHTS) into exactly one reply. It knows nothing of gRPC, buffers or the
// device: the handler (the service core) decides what a session and an
// import are.
//
// Threading: one thread runs an epoll loop over the listening socket and
// every connection (all non-blocking). All FdSessionHandler calls are made on
// that thread, one at a time, so a slow handler delays every client of the fd
// socket: handlers must not block for long.
//
// Robustness: a malformed datagram, a missing or extra fd, a truncated
// control message or an oversized datagram gets an error reply and the
// connection stays usable. Every received fd is closed before the reply is
// sent unless it was handed to OnImport. A client that does not read its
// replies is not read from until it does (at most one reply is buffered per
// connection), so it cannot make the server buffer without bound. A peer that
// closes its socket loses the requests it had queued: they are dropped (fds
// included) without reaching the handler. A half-closed peer
// (shutdown(SHUT_WR)) gets replies to everything it sent, then the session
// ends; except that an empty datagram without fds sent last before the
// shutdown reads exactly like the end of stream on SOCK_SEQPACKET, and ends
// the session unanswered.
//
// Error replies (FdError.code, detail.reason). Per request, all
// INVALID_ARGUMENT, sequence echoed when the datagram parsed:
//   MESSAGE_TOO_LARGE (over kMaxRequestBytes; sequence 0), CONTROL_TRUNCATED
//   (several fds), UNEXPECTED_CONTROL_MESSAGE, TOO_MANY_FDS,
//   MALFORMED_REQUEST (sequence 0), MISSING_FD, UNEXPECTED_FD,
//   UNKNOWN_OPERATION (empty request, or an op this server does not know);
//   plus whatever OnImport returns.
// On connect, followed by close: PERMISSION_DENIED PEER_NOT_ALLOWED,
//   RESOURCE_EXHAUSTED TOO_MANY_SESSIONS, LIMIT_TOTAL_FDS (the fd budget),
//   LIMIT_OPEN_FILES (accept hit the process's open-file limit: a spare fd,
//   kept for this, is closed to accept the connection and refuse it, so the
//   backlog drains instead of filling), or OnConnect's error.
//
// Live handover (issue 11): Detach stops the thread and gives up the
// listening socket and every session's connection as they are (nothing is
// closed, shut down, unlinked or told to the handler), for another FdServer,
// in this process or another, to Adopt and carry on with. Clients see a
// pause, not a disconnect: what they send meanwhile waits in the sockets.
#ifndef MRD_SERVER_FD_SOCKET_FD_SERVER_H_
#define MRD_SERVER_FD_SOCKET_FD_SERVER_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/fd.pb.h"
#include "mrd/v1/mrd.pb.h"
#include "server/common/cgroup_identity.h"
#include "server/common/fd_budget.h"
#include "server/common/thread.h"
#include "server/common/unix_socket.h"

namespace mrd::fd_socket {

// The peer of a connection as the kernel saw it at connect() (SO_PEERCRED),
// and the cgroup of its process (read race-free at accept: ReadPeerCgroup).
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  // The pod or container the process runs in (empty fields: none); unset
  // when it was not read (FdServerOptions::read_cgroup) or could not be,
  // and then `cgroup_error` says why.
  std::optional<CgroupIdentity> cgroup;
  std::string cgroup_error;
};

// What the rest of mrd does with fd-socket sessions. Implemented by the
// service core. Every method is called on the FdServer thread, never
// concurrently with another; none may call FdServer::Shutdown.
class FdSessionHandler {
 public:
  virtual ~FdSessionHandler() = default;

  // A peer passed the allow-list. Returns the session token sent in the
  // welcome. An error is sent to the peer as FdReply.error and the connection
  // is closed (OnDisconnect is then never called for it).
  virtual absl::StatusOr<std::string> OnConnect(
      const PeerCredentials& creds) = 0;

  // ImportMemfd with exactly one fd, which the handler now owns (it is not
  // yet validated: typically handed to MapMemfd). An error goes back as
  // FdError{code, message, GetErrorDetail(status)}.
  virtual absl::StatusOr<v1::BufferInfo> OnImport(
      const std::string& session, UniqueFd fd,
      const v1::ImportMemfd& request) = 0;

  // The connection of a session that OnConnect opened is gone (EOF, error,
  // or Shutdown). Called exactly once per such session.
  virtual void OnDisconnect(const std::string& session) = 0;
};

// One fd-socket connection with an open session, as handed between
// processes.
struct DetachedConnection {
  UniqueFd socket;
  std::string session;  // the token OnConnect returned
  PeerCredentials creds;
  // Reply bytes not yet sent (a client not reading), if any: one serialized
  // FdReply, which the adopting server sends before reading this
  // connection's next request.
  std::string pending_reply;
};

// A detached FdServer: its listening socket (connections not yet accepted
// wait in its backlog) and every connection with an open session.
struct DetachedFdServer {
  UniqueFd listener;
  std::vector<DetachedConnection> connections;
};

struct FdServerOptions {
  std::string path;    // socket path; a stale socket there is replaced
  mode_t mode = 0660;  // permissions of the socket file
  // A peer may connect if both lists are empty, or its uid is in
  // allowed_uids, or its gid (primary, as SO_PEERCRED reports) is in
  // allowed_gids.
  std::vector<uint32_t> allowed_uids;
  std::vector<uint32_t> allowed_gids;
  // Connections beyond this are refused with TOO_MANY_SESSIONS.
  size_t max_connections = 1024;
  // Read each peer's cgroup at accept (pod and container identity).
  bool read_cgroup = true;
  // Each connection's socket is charged here (shared owner: the total only)
  // and refused with LIMIT_TOTAL_FDS when it does not fit. Not owned; null =
  // no budgeting.
  FdBudget* fd_budget = nullptr;
};

// Thread safety: Start, Adopt, Detach, Shutdown, SetUnlinkOnShutdown,
// ConnectionCount and path may be called from any thread except the FdServer
// thread (i.e. not from handler callbacks).
class FdServer final {
 public:
  // Largest request datagram accepted; larger ones get MESSAGE_TOO_LARGE.
  static constexpr size_t kMaxRequestBytes = 4096;
  // FdWelcome.protocol_version.
  static constexpr uint32_t kProtocolVersion = 1;

  // Binds opts.path, sets its mode, listens and starts the thread.
  // `handler` is not owned and must outlive the FdServer (or Shutdown).
  // Errors:
  //   INVALID_ARGUMENT BAD_SOCKET_PATH (empty or longer than sun_path),
  //     BAD_OPTIONS (max_connections 0);
  //   FAILED_PRECONDITION PATH_NOT_SOCKET (something else exists at the
  //     path; it is left alone), SOCKET_IN_USE (a server accepts connections
  //     there; found by connecting once, so that server sees one short
  //     connection). A socket file nobody listens on is replaced;
  //   socket/bind/chmod/listen/epoll failures: ErrnoError; no thread:
  //   RESOURCE_EXHAUSTED THREAD_FAILED.
  static absl::StatusOr<std::unique_ptr<FdServer>> Start(
      const FdServerOptions& options, FdSessionHandler* handler);

  // Starts serving on what another FdServer detached: the same options
  // (path, mode and limits; the socket file is not re-bound or re-chmoded),
  // its listener and connections; `handler` receives requests for those
  // sessions by their tokens (no OnConnect for them). A connection's pending
  // reply is sent before its next request is read. Each connection is
  // charged to options.fd_budget again (the budget is this process's). The
  // socket file at options.path counts as this server's (Shutdown removes
  // it) if it is the file the listener is bound to (BoundSocketFile in
  // server/common/unix_socket.h). Works on this process's own detached
  // state too: that is how a process resumes after a failed handover.
  // Errors (no handler call is made, and every fd in `detached` is closed):
  //   INVALID_ARGUMENT BAD_SOCKET_PATH, BAD_OPTIONS as Start;
  //     BAD_LISTENER (not a listening Unix SOCK_SEQPACKET socket),
  //     BAD_CONNECTION (a connection that is not a connected Unix
  //     SOCK_SEQPACKET socket);
  //   RESOURCE_EXHAUSTED TOO_MANY_SESSIONS (more connections than
  //     options.max_connections), or the fd budget's refusal
  //     (LIMIT_TOTAL_FDS);
  //   epoll failures: ErrnoError; no thread: RESOURCE_EXHAUSTED
  //     THREAD_FAILED.
  static absl::StatusOr<std::unique_ptr<FdServer>> Adopt(
      const FdServerOptions& options, FdSessionHandler* handler,
      DetachedFdServer detached);

  // Stops the thread and returns the listening socket and every session's
  // connection WITHOUT closing them, shutting them down, unlinking the
  // socket file or calling OnDisconnect: another FdServer (in this or
  // another process) carries on with them. Requests already read are
  // answered first (a reply the client has not made room for comes back as
  // pending_reply); nothing unread is consumed, and connections waiting in
  // the backlog stay there. Sessions Hangup asked to close and the loop had
  // not yet closed are closed first, as usual (OnDisconnect). After Detach
  // the FdServer is inert: Shutdown does nothing, Hangup is ignored, and its
  // fd charges are released. Errors: FAILED_PRECONDITION NOT_SERVING (shut
  // down or detached already). Called from a handler callback it aborts.
  absl::StatusOr<DetachedFdServer> Detach();

  // Stops accepting, closes every connection (OnDisconnect for each session)
  // and joins the thread; removes the socket file if it is still ours.
  // Idempotent; a concurrent second call returns only when the first is
  // done. Called from a handler callback (the FdServer thread) it aborts:
  // that would join its own thread. Does nothing after Detach.
  void Shutdown();

  // Whether Shutdown removes the socket file (only ever if it is still the
  // file this server listens on). True by default; false leaves it for
  // whoever serves on the same socket next (e.g. a process that keeps a dup
  // of the listener). Thread-safe; takes effect at the next Shutdown.
  void SetUnlinkOnShutdown(bool unlink);
  ~FdServer();

  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

  // Closes the connection of `session` (if it is still open), e.g. because
  // the session was ended over gRPC. OnDisconnect follows on the FdServer
  // thread. Thread-safe, never blocks; unknown sessions are ignored.
  void Hangup(const std::string& session);

  const std::string& path() const { return options_.path; }
  // Connections with an open session right now.
  size_t ConnectionCount() const;

 private:
  struct Connection;
  struct Datagram;

  FdServer(const FdServerOptions& options, FdSessionHandler* handler);

  // Start's and Adopt's checks of the options.
  static absl::Status CheckOptions(const FdServerOptions& options);
  // Starts the thread (the last step of Start and Adopt).
  absl::Status StartThread();
  // Wakes the loop (eventfd).
  void Wake();

  // Everything below runs on the FdServer thread only, so the connection
  // table needs no lock.
  void Run();
  void AcceptAll();
  void Accept(UniqueFd sock);
  // The epoll set (listener and wake eventfd) and the spare fd.
  absl::Status SetUpEvents();
  // The allow-list, the connection limit and the fd budget; the fd charge
  // of the connection's socket, or the refusal to send.
  absl::StatusOr<FdCharge> AdmitPeer(const PeerCredentials& creds);
  // accept() failed for lack of fds: uses the spare fd to accept one
  // connection and refuse it. False if that did not work either.
  bool AcceptWithSpareFd();
  void HandleEvent(uint64_t id, uint32_t events);
  void ReadRequests(Connection& conn);
  // One reply per datagram. Every fd received dies with `datagram` (or is
  // handed to OnImport) before this returns, so before the reply is sent.
  v1::FdReply Process(const Connection& conn, Datagram datagram);
  // false: the connection is dead and must be closed.
  bool Send(Connection& conn, const v1::FdReply& reply);
  bool Flush(Connection& conn);
  bool Watch(Connection& conn, bool want_output);
  void Close(uint64_t id);
  // Closes the connections of `sessions` (Hangup).
  void HangUp(const std::vector<std::string>& sessions);
  void CloseAll();
  // Detach's half on the FdServer's side, once the thread is gone: the
  // listener and the connections, moved out.
  DetachedFdServer TakeDetached();
  void PauseAccepting();
  void ResumeAccepting();

  const FdServerOptions options_;
  FdSessionHandler* const handler_;
  UniqueFd listen_fd_;
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;   // eventfd: Shutdown wakes the loop
  UniqueFd spare_fd_;  // given up to accept-and-refuse on EMFILE/ENFILE
  // The socket file this server made (Start) or was handed (Adopt, when it
  // is the listener's), which Shutdown may remove; unset: none.
  std::optional<SocketFileId> socket_file_;

  // FdServer thread only.
  std::map<uint64_t, std::unique_ptr<Connection>> connections_;
  // Sessions to hang up, handed over by Hangup(); closed by the loop.
  std::vector<std::string> hangups_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_;
  bool accept_paused_ = false;
  int64_t resume_accept_at_ms_ = 0;  // steady clock

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Set with stopping_ by Detach: the loop leaves everything open.
  bool detaching_ ABSL_GUARDED_BY(mu_) = false;
  bool unlink_on_shutdown_ ABSL_GUARDED_BY(mu_) = true;
  size_t session_count_ ABSL_GUARDED_BY(mu_) = 0;

  // Held for the whole of Shutdown, so a second caller waits for the first.
  absl::Mutex shutdown_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  Thread thread_ ABSL_GUARDED_BY(shutdown_mu_);
};

}  // namespace mrd::fd_socket

#endif  // MRD_SERVER_FD_SOCKET_FD_SERVER_H_
