// PeerListener: the TCP front door of the software device's peer path. It
// owns the listening socket, one acceptor thread, and one thread per
// accepted connection on which it runs the device's serve function; it knows
// nothing of the protocol.
//
// Lifecycle: Bind (socket bound and listening, address known) -> Start
// (acceptor runs) -> StopAccepting -> JoinConnections. The owner must make
// every running serve call return (shutdown(2) of its socket) between the
// last two. The destructor does both stop steps.
//
// Thread safety: all methods are thread-safe; the serve function is called
// concurrently from connection threads.
#ifndef MRD_SERVER_DEVICE_SOFTWARE_PEER_LISTENER_H_
#define MRD_SERVER_DEVICE_SOFTWARE_PEER_LISTENER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/common/fd.h"

namespace mrd::device {

class PeerListener {
 public:
  // Runs one connection to its end; owns `socket`. `remote` is host:port.
  using ServeFn = std::function<void(UniqueFd socket, std::string remote)>;

  // Binds `address` (numeric host:port; port 0 picks one). At most
  // `max_connections` connections are served at once; more are closed on
  // accept. Errors: INVALID_ARGUMENT "BAD_HOST_PORT", errors of
  // bind/listen ("PEER_LISTEN_FAILED").
  static absl::StatusOr<std::unique_ptr<PeerListener>> Bind(
      absl::string_view address, uint32_t max_connections);
  ~PeerListener();
  PeerListener(const PeerListener&) = delete;
  PeerListener& operator=(const PeerListener&) = delete;

  // The bound address, host:port, with the real port.
  const std::string& address() const { return address_; }

  // Starts the acceptor. Errors: FAILED_PRECONDITION "ALREADY_STARTED"
  // (started or stopped before), or the errno of thread creation.
  absl::Status Start(ServeFn serve);
  // Stops accepting, joins the acceptor and closes the listening socket, so
  // that later connection attempts are refused instead of left unanswered
  // in the backlog. Idempotent.
  void StopAccepting();
  // Joins every connection thread. Idempotent.
  void JoinConnections();

 private:
  PeerListener(UniqueFd listen_fd, UniqueFd wake_fd, std::string address,
               uint32_t max_connections);
  void AcceptLoop();
  // Hands one accepted socket to a new connection thread, or drops it.
  void Spawn(UniqueFd socket);
  // Joins the threads whose serve call has returned.
  void ReapFinished();
  void Wake();

  UniqueFd listen_fd_;      // reset by StopAccepting once the acceptor is gone
  const UniqueFd wake_fd_;  // eventfd: stop requests and finished threads
  const std::string address_;
  const uint32_t max_connections_;
  ServeFn serve_;  // set by Start before any thread reads it
  std::thread acceptor_;

  absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_thread_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> finished_ ABSL_GUARDED_BY(mu_);
  uint32_t live_ ABSL_GUARDED_BY(mu_) = 0;  // serve calls not yet returned
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_PEER_LISTENER_H_
