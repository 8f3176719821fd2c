// GrpcAcceptor: mrd's gRPC socket, accepted by mrd rather than by gRPC, so
// that connections are capped and fd exhaustion never stops the server.
//
// gRPC 1.51 accepts its own listening sockets without any connection limit,
// and once accept4 fails with EMFILE it never accepts again. Instead, mrd
// binds and listens on the Unix socket itself; one thread accepts, learns
// the client's uid (SO_PEERCRED), and either hands the connection to gRPC
// (grpc::AddInsecureChannelFromFd) or refuses it: the client then reads an
// HTTP/2 GOAWAY (ENHANCE_YOUR_CALM) whose debug text names the limit, and
// the connection is closed. Limits: connections in total, and per tenant
// (its pod, container or uid, so that one tenant's connections cannot lock
// out another's). When mrd is out
// of fds, a spare fd is given up to accept and close the connection, and the
// listening socket stays alive.
//
// gRPC closes a connection's fd itself; the acceptor learns which of the
// connections it handed over are gone by looking for their socket inodes in
// /proc/self/fd: once a second, and before refusing (at most every 50 ms).
//
// Live handover (issue 11): Detach gives up the listening socket, open and
// still listening, for another acceptor (in another process, or in this one
// after a failed handover) to Adopt; clients connecting meanwhile wait in the
// backlog. Connections already handed to gRPC stay with this process's
// grpc::Server, and an adopting acceptor does not count them against its
// limits (it counts only what it accepts itself).
//
// Thread safety: Stats() may be called from any thread; Start, Detach and
// Shutdown from one.
#ifndef MRD_SERVER_SERVICE_GRPC_ACCEPTOR_H_
#define MRD_SERVER_SERVICE_GRPC_ACCEPTOR_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "server/common/thread.h"
#include "server/common/unix_socket.h"
#include "server/metrics/rpc_observer.h"

namespace grpc {
class Server;
class ServerBuilder;
}  // namespace grpc

namespace mrd::service {

struct GrpcAcceptorOptions {
  std::string socket_path;
  mode_t socket_mode = 0660;
  uint64_t max_connections = 512;             // in total
  uint64_t max_connections_per_tenant = 128;  // per client tenant
  // The tenant key of a connection's client (its pod, container or uid:
  // server/common/cgroup_identity.h), from its socket and SO_PEERCRED uid;
  // empty: "uid:<uid>".
  std::function<std::string(int socket, uid_t uid)> tenant_of;
  // Non-empty: only these uids may connect (the admin socket: root and
  // mrd's own uid); any other is refused with PEER_NOT_ALLOWED.
  std::vector<uid_t> allowed_uids;
};

using GrpcAcceptorStats = metrics::GrpcConnectionStats;

class GrpcAcceptor {
 public:
  // Binds and listens on options.socket_path (replacing a stale socket
  // there) with options.socket_mode. INVALID_ARGUMENT BAD_GRPC_LIMITS when a
  // limit is 0; UNAVAILABLE GRPC_SOCKET when the socket cannot be made.
  static absl::StatusOr<std::unique_ptr<GrpcAcceptor>> Listen(
      const GrpcAcceptorOptions& options);
  // An acceptor over a listening Unix socket another acceptor detached (same
  // options; nothing is bound, chmoded or unlinked at start). Shutdown
  // removes the socket file if it is the file `listener` is bound to
  // (BoundSocketFile in server/common/unix_socket.h). Errors:
  // INVALID_ARGUMENT BAD_GRPC_LIMITS as Listen, BAD_LISTENER (not a
  // listening Unix SOCK_STREAM socket; it is closed); UNAVAILABLE
  // GRPC_SOCKET (eventfd or spare fd).
  static absl::StatusOr<std::unique_ptr<GrpcAcceptor>> Adopt(
      const GrpcAcceptorOptions& options, UniqueFd listener);
  ~GrpcAcceptor();
  GrpcAcceptor(const GrpcAcceptor&) = delete;
  GrpcAcceptor& operator=(const GrpcAcceptor&) = delete;

  // Starts accepting for `server` (which must outlive Shutdown). Once only:
  // FAILED_PRECONDITION ACCEPTOR_STARTED on a second call,
  // ACCEPTOR_DETACHED after Detach (Adopt the detached socket into a new
  // acceptor instead, which may Start with the same server).
  absl::Status Start(grpc::Server* server);
  // Stops accepting and returns the listening socket without closing it or
  // unlinking its path (another process's acceptor carries on with it).
  // Connections already handed to gRPC stay with this process's gRPC
  // server. After it, Shutdown only closes what is left. Start may not be
  // called again; Adopt (of the returned socket, into a new acceptor) may.
  // FAILED_PRECONDITION NOT_LISTENING after Shutdown or Detach.
  absl::StatusOr<UniqueFd> Detach();
  // Stops accepting, closes the listening socket and removes the socket
  // file if it is still this acceptor's (connections already handed over
  // stay gRPC's). Idempotent.
  void Shutdown();

  GrpcAcceptorStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit GrpcAcceptor(const GrpcAcceptorOptions& options);
  // The eventfd and the spare fd (Listen and Adopt).
  absl::Status OpenHelperFds();
  // Wakes the thread and joins it, if it runs.
  void StopThread();
  void Run(grpc::Server* server);
  void AcceptAll(grpc::Server* server);
  // accept4 failed for lack of fds: the spare fd takes the connection and
  // refuses it (LIMIT_OPEN_FILES).
  void RefuseForLackOfFds(int err);
  // Counts a connection of `tenant` (socket inode `inode`) against the
  // total and per-tenant caps: an empty string, or the refusal to send.
  std::string Admit(const std::string& tenant, uint64_t inode)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the connections whose fds gRPC has closed (at most every
  // `min_interval`).
  void Refresh(absl::Duration min_interval) ABSL_LOCKS_EXCLUDED(mu_);

  const GrpcAcceptorOptions options_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;   // eventfd: Shutdown wakes the thread
  UniqueFd spare_fd_;  // given up to accept and refuse when out of fds
  // The socket file Shutdown may remove (the one listen_fd_ is bound to);
  // unset: none.
  std::optional<SocketFileId> socket_file_;
  std::optional<Thread> thread_;
  bool detached_ = false;  // Detach gave the listening socket away

  mutable absl::Mutex mu_;
  // Socket inode -> client tenant of each connection handed to gRPC.
  std::map<ino_t, std::string> live_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> per_tenant_ ABSL_GUARDED_BY(mu_);
  absl::Time last_refresh_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  GrpcAcceptorStats stats_ ABSL_GUARDED_BY(mu_);
};

// Bounds each connection's open calls at `streams` (0: no bound), advertised
// as HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: the client holds its further
// calls until one ends. Every connection's requests wait in gRPC's own queue,
// which no tenant share reaches, so the bound keeps one client's backlog out
// of it: a tenant then has at most `streams` x its connections calls there.
void BoundOpenCallsPerConnection(grpc::ServerBuilder& builder,
                                 uint32_t streams);

}  // namespace mrd::service

#endif  // MRD_SERVER_SERVICE_GRPC_ACCEPTOR_H_
