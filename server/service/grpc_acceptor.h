// GrpcAcceptor: mrd's gRPC socket, accepted by mrd rather than by gRPC, so
// that connections are capped and fd exhaustion never stops the server.
//
// gRPC 1.51 accepts its own listening sockets without any connection limit,
// and once accept4 fails with EMFILE it never accepts again. Instead, mrd
// binds and listens on the Unix socket itself; one thread accepts, learns
// the client's uid (SO_PEERCRED), and either hands the connection to gRPC
// (grpc::AddInsecureChannelFromFd) or refuses it: the client then reads an
// HTTP/2 GOAWAY (ENHANCE_YOUR_CALM) whose debug text names the limit, and
// the connection is closed. Limits: connections in total, and per uid (so
// that one tenant's connections cannot lock out another's). When mrd is out
// of fds, a spare fd is given up to accept and close the connection, and the
// listening socket stays alive.
//
// gRPC closes a connection's fd itself; the acceptor learns which of the
// connections it handed over are gone by looking for their socket inodes in
// /proc/self/fd: once a second, and before refusing (at most every 50 ms).
//
// Thread safety: Stats() may be called from any thread; Start and Shutdown
// from one.
#ifndef MRD_SERVER_SERVICE_GRPC_ACCEPTOR_H_
#define MRD_SERVER_SERVICE_GRPC_ACCEPTOR_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "server/common/thread.h"
#include "server/metrics/rpc_observer.h"

namespace grpc {
class Server;
}

namespace mrd::service {

struct GrpcAcceptorOptions {
  std::string socket_path;
  mode_t socket_mode = 0660;
  uint64_t max_connections = 512;          // in total
  uint64_t max_connections_per_uid = 128;  // per client uid
};

using GrpcAcceptorStats = metrics::GrpcConnectionStats;

class GrpcAcceptor {
 public:
  // Binds and listens on options.socket_path (replacing a stale socket
  // there) with options.socket_mode. INVALID_ARGUMENT BAD_GRPC_LIMITS when a
  // limit is 0; UNAVAILABLE GRPC_SOCKET when the socket cannot be made.
  static absl::StatusOr<std::unique_ptr<GrpcAcceptor>> Listen(
      const GrpcAcceptorOptions& options);
  ~GrpcAcceptor();
  GrpcAcceptor(const GrpcAcceptor&) = delete;
  GrpcAcceptor& operator=(const GrpcAcceptor&) = delete;

  // Starts accepting for `server` (which must outlive Shutdown).
  absl::Status Start(grpc::Server* server);
  // Stops accepting and closes the listening socket (connections already
  // handed over stay gRPC's). Idempotent.
  void Shutdown();

  GrpcAcceptorStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit GrpcAcceptor(const GrpcAcceptorOptions& options);
  void Run(grpc::Server* server);
  void AcceptAll(grpc::Server* server);
  // accept4 failed for lack of fds: the spare fd takes the connection and
  // refuses it (LIMIT_OPEN_FILES).
  void RefuseForLackOfFds(int err);
  // Counts a connection of `uid` (socket inode `inode`) against the total
  // and per-uid caps: an empty string, or the refusal to send.
  std::string Admit(uint32_t uid, uint64_t inode) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the connections whose fds gRPC has closed (at most every
  // `min_interval`).
  void Refresh(absl::Duration min_interval) ABSL_LOCKS_EXCLUDED(mu_);

  const GrpcAcceptorOptions options_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;   // eventfd: Shutdown wakes the thread
  UniqueFd spare_fd_;  // given up to accept and refuse when out of fds
  std::optional<Thread> thread_;

  mutable absl::Mutex mu_;
  // Socket inode -> client uid of each connection handed to gRPC.
  std::map<ino_t, uid_t> live_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, uint64_t> per_uid_ ABSL_GUARDED_BY(mu_);
  absl::Time last_refresh_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  GrpcAcceptorStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::service

#endif  // MRD_SERVER_SERVICE_GRPC_ACCEPTOR_H_
