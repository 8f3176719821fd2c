// PeerListener: the TCP front door of the software device's peer path. It
// owns the listening socket, ONE reactor thread (epoll: accept, non-blocking
// reads that assemble frames byte by byte, non-blocking writes of queued
// responses, deadlines) and a small fixed pool of workers that run the
// owner's frame handler. It knows the framing (mrd/peer_frame.h) but not
// the messages.
//
// Per connection, frames are handled strictly one at a time, in order (RC
// queue-pair semantics): while a frame is being handled or its response is
// being written, the connection is not read (backpressure). No thread is
// created per connection, so the number of threads is fixed at Start.
//
// Defences against hostile peers (docs/RELIABILITY.md, "Peer path"):
// * a connection that has not authenticated (the handler says so) within
//   hello_timeout is closed; one that stalls inside a frame (or a response
//   write) for stall_timeout is closed;
// * at most max_unauthenticated connections before hello: a new one sheds
//   the OLDEST unauthenticated connection, so a fresh peer with a ticket
//   always gets in; at most max_connections in all (a new one sheds the
//   oldest unauthenticated one, else is refused);
// * frame memory is committed as bytes arrive (the buffer grows in chunks,
//   never sized from the header), one frame per connection (hello_frame_bytes
//   before authentication, max_frame_bytes after), and at most buffer_bytes
//   across connections: when that is reached, frame bodies wait unread until
//   memory frees.
//
// Lifecycle: Bind (socket bound and listening, address known) -> Start
// (threads run) -> Stop (closes the listener, then every connection, waiting
// for frames being handled; joins every thread). The destructor stops.
//
// Handover (a new mrd process takes over the peer path): StopAccepting
// stops watching the listening socket (connections already accepted are
// served as before; new ones wait in the socket's backlog) and returns a
// duplicate of it for the new process, whose listener is made FromSocket
// and accepts from the same backlog. Stop then only closes this process's
// fd, never shutdown(2), so the other process's listener keeps working.
// ResumeAccepting undoes StopAccepting (the handover was called off).
//
// Established connections move too: FreezeConnections stops reading and
// writing every connection once no frame is being handled and returns
// duplicates of their sockets with what is in flight on each (a frame read
// in part, a response sent in part); the new process's listener, frozen
// itself, AdoptConnection-s them and ThawConnections at commit, going on
// exactly where this one stopped. Here, ThawConnections serves them again
// (the handover was called off) or DropConnections closes this process's
// fds, never with shutdown(2) (the connections are the other process's).
//
// Thread safety: all public methods are thread-safe. The handler's open and
// close run on the reactor thread (or Stop's caller after the reactor ended),
// frame on a worker.
#ifndef MRD_SERVER_DEVICE_SOFTWARE_PEER_LISTENER_H_
#define MRD_SERVER_DEVICE_SOFTWARE_PEER_LISTENER_H_

#include <sys/epoll.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "server/common/thread.h"
#include "server/device/fault_points.h"

namespace mrd::device {

struct PeerListenerOptions {
  uint32_t max_connections = 4096;
  uint32_t max_unauthenticated = 256;
  absl::Duration hello_timeout = absl::Seconds(5);
  absl::Duration stall_timeout = absl::Seconds(30);
  // Frame buffers (and unsent responses) of all connections together.
  uint64_t buffer_bytes = uint64_t{256} << 20;
  uint32_t workers = 4;
  uint32_t hello_frame_bytes = 4096;              // body limit before auth
  uint32_t max_frame_bytes = (16u << 20) + 1024;  // body limit after auth
  // Tests only: "thread.create" before each thread Start creates.
  FaultPoints* fault_points = nullptr;
};

// Counters and gauges of the peer path, for metrics and tests.
struct PeerListenerStats {
  uint64_t connections = 0;      // open now
  uint64_t unauthenticated = 0;  // open now, hello not done
  uint64_t buffered_bytes = 0;   // frame and response memory charged now
  uint64_t threads = 0;          // reactor + workers
  uint64_t accepted = 0;         // totals from here on
  uint64_t refused = 0;          // max_connections, nobody to shed
  uint64_t shed = 0;             // closed to make room for a new connection
  uint64_t hello_timeouts = 0;
  uint64_t stall_timeouts = 0;
  uint64_t memory_waits = 0;  // reads deferred: buffer_bytes reached
  // The limits in force.
  uint64_t max_connections = 0;
  uint64_t max_unauthenticated = 0;
  uint64_t max_buffer_bytes = 0;
};

class PeerListener {
 public:
  // What the handler decided about the connection after one frame.
  struct Verdict {
    bool keep_open = true;       // false: close once the response is sent
    bool authenticated = false;  // hello succeeded (sticky)
  };
  struct Handler {
    // A new connection (fd is non-blocking; the listener owns it). Returns
    // the owner's context for it, or nullptr to refuse it.
    std::function<std::shared_ptr<void>(int fd, const std::string& remote)>
        open;
    // One frame: its body, or why it cannot be read (INVALID_ARGUMENT
    // "FRAME_TOO_LARGE"; the stream is then out of sync). Appends the
    // encoded response frame(s) to `response`.
    std::function<Verdict(const std::shared_ptr<void>& context,
                          absl::StatusOr<std::string> body,
                          std::string* response)>
        frame;
    // The connection ends; its fd is closed right after this returns.
    std::function<void(const std::shared_ptr<void>& context)> close;
  };

  // Binds `address` (numeric host:port; port 0 picks one). Errors:
  // INVALID_ARGUMENT "BAD_HOST_PORT" / "BAD_OPTION", errors of bind/listen
  // ("PEER_LISTEN_FAILED").
  static absl::StatusOr<std::unique_ptr<PeerListener>> Bind(
      absl::string_view address, const PeerListenerOptions& options);
  // Takes `listen_fd`, a TCP socket already bound and listening (another
  // process's, from its StopAccepting), instead of binding one; address()
  // is its bound address. Errors: INVALID_ARGUMENT "BAD_OPTION",
  // INVALID_ARGUMENT "BAD_PEER_LISTENER" (not a listening TCP socket).
  static absl::StatusOr<std::unique_ptr<PeerListener>> FromSocket(
      UniqueFd listen_fd, const PeerListenerOptions& options);
  ~PeerListener();
  PeerListener(const PeerListener&) = delete;
  PeerListener& operator=(const PeerListener&) = delete;

  // The bound address, host:port, with the real port.
  const std::string& address() const { return address_; }

  // Starts the workers and the reactor. Errors: FAILED_PRECONDITION
  // "ALREADY_STARTED", or "THREAD_FAILED" (then nothing runs and the
  // listener is stopped).
  absl::Status Start(Handler handler);
  // Closes the listening socket and every connection (the handler's close
  // runs for each), joins every thread. Idempotent.
  void Stop();

  // Stops accepting new connections and returns a duplicate of the
  // listening socket (close-on-exec) for another process. Returns once the
  // reactor will accept no more (connections it accepted before are served
  // as before; later ones wait in the backlog). Before Start, the reactor
  // starts without accepting. Errors: FAILED_PRECONDITION
  // "PEER_LISTENER_STOPPED" (after Stop: no socket left), the errno of the
  // duplication ("PEER_LISTENER_DUP_FAILED"; then nothing changed).
  absl::StatusOr<UniqueFd> StopAccepting();
  // Accepts again after StopAccepting (returns once the reactor watches the
  // listening socket again). No-op when accepting or stopped.
  void ResumeAccepting();
  // A duplicate of the listening socket (close-on-exec) while this
  // listener goes on accepting on it. Errors as StopAccepting's.
  absl::StatusOr<UniqueFd> DuplicateSocket();

  // A connection as it stands, for another process to serve on.
  struct HeldConnection {
    UniqueFd fd;  // a duplicate (close-on-exec)
    std::string remote;
    std::shared_ptr<void> context;  // the handler's; null in AdoptConnection
    bool authenticated = false;
    // A frame read in part: its header bytes, then its body bytes so far.
    std::string received;
    // The rest of a response the socket has not taken yet.
    std::string unsent;
  };
  // Stops reading and writing every connection and waits, up to `timeout`,
  // until no frame is being handled; returns each connection (its socket
  // duplicated). They stay open here, untouched, until ThawConnections or
  // DropConnections; connections adopted meanwhile stay frozen too. Errors:
  // UNAVAILABLE "HANDOVER_BUSY" (a frame was still being handled; nothing
  // stays frozen), FAILED_PRECONDITION "PEER_LISTENER_STOPPED",
  // "PEER_LISTENER_DUP_FAILED" (nothing stays frozen).
  absl::StatusOr<std::vector<HeldConnection>> FreezeConnections(
      absl::Duration timeout);
  // Serves every connection again, from where each stopped. No-op when not
  // frozen.
  void ThawConnections();
  // Forgets every connection: the handler's close runs for each and this
  // process's fd closes (without shutdown(2)). For after a handover.
  void DropConnections();
  // Takes a connection another process froze, with `context` for the
  // handler; it stays frozen until ThawConnections (the listener must be
  // frozen: FreezeConnections first). Errors: FAILED_PRECONDITION
  // "PEER_LISTENER_NOT_FROZEN" / "PEER_LISTENER_STOPPED", INVALID_ARGUMENT
  // "BAD_PEER_CONNECTION" (no socket, or bytes no frame can start with).
  absl::Status AdoptConnection(HeldConnection held,
                               std::shared_ptr<void> context);

  PeerListenerStats Stats() const;

 private:
  struct Conn;
  // A frame handed to a worker.
  struct Job {
    uint64_t id = 0;
    int fd = -1;
    std::shared_ptr<void> context;
    absl::StatusOr<std::string> body;
  };
  // A worker's result, back to the reactor.
  struct Done {
    uint64_t id = 0;
    Verdict verdict;
    std::string unsent;  // response bytes the socket did not take at once
    bool broken = false;
  };

  PeerListener(UniqueFd listen_fd, UniqueFd epoll_fd, UniqueFd wake_fd,
               std::string address, const PeerListenerOptions& options);
  // INVALID_ARGUMENT "BAD_OPTION" for options no listener can run with.
  static absl::Status CheckOptions(const PeerListenerOptions& options);
  // A listener on `listen_fd` (bound and listening): its reactor's epoll
  // set, wake fd and address.
  static absl::StatusOr<std::unique_ptr<PeerListener>> Wrap(
      UniqueFd listen_fd, const PeerListenerOptions& options);
  // Sets accept_wanted_ and, once started, waits until the reactor acts on
  // it (accepting_).
  void SetAcceptingLocked(bool accept) ABSL_EXCLUSIVE_LOCKS_REQUIRED(start_mu_);
  absl::StatusOr<UniqueFd> DuplicateSocketLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(start_mu_);
  // Runs `call` on the reactor thread (or here, before Start: no reactor
  // runs yet) and returns once it ran. False after Stop (it did not run).
  bool OnReactor(absl::AnyInvocable<void()> call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(start_mu_);
  // Reactor: runs the calls OnReactor queued.
  void RunCalls();
  // Reactor: frozen once no frame is being handled; publishes the held
  // connections for FreezeConnections.
  void TryCompleteFreeze();
  HeldConnection Hold(const Conn& conn) const;
  void Thaw();

  // Reactor thread.
  void ReactorLoop();
  void AcceptBatch();
  bool MakeRoom(bool for_total);
  // Closes the oldest connection before hello that is not busy and, when
  // `eligible` is given, passes it. False when there is none.
  bool ShedOne(bool for_total, bool (*eligible)(const Conn& conn));
  void ReadSome(Conn& conn);
  // Reactor steps: (re-)adds the listener to the epoll set (false: failed,
  // errno set); takes up accept_wanted_, arming or disarming the listener,
  // and returns whether to accept this round; handles `n` ready events
  // (accepting only when `accept`); at Stop, closes the listener and every
  // connection.
  bool ArmListener();
  bool ApplyAccepting(bool stopping);
  void HandleEvents(const epoll_event* events, int n, bool stopping,
                    bool accept);
  void CloseEverything();
  // ReadSome's steps: go on reading, or stop (the connection is closed,
  // armed again, parked or its frame dispatched).
  enum class Step { kMore, kStop };
  // After a recv that returned `n` <= 0 (errno still set): EOF closes with
  // `end_why`, EINTR reads on, EAGAIN re-arms.
  Step AfterRecv(Conn& conn, ssize_t n, const char* end_why);
  Step ReadHeader(Conn& conn);
  // Grows the frame buffer within the memory budget; false = parked.
  bool GrowBody(Conn& conn);
  void WriteSome(Conn& conn);
  void Dispatch(Conn& conn, absl::StatusOr<std::string> body);
  void Finish(Done done);
  void Arm(Conn& conn, uint32_t events);
  void CloseConn(uint64_t id, const char* why);
  void Release(Conn& conn);
  void ResumeParked();
  static uint64_t NextCap(const Conn& conn);
  bool CanGrow(const Conn& conn, uint64_t delta) const;
  void CheckDeadlines(absl::Time now);
  void LogShed(const char* what, const std::string& remote);
  void Publish();
  void Wake();

  // Workers.
  void WorkerLoop();
  bool WorkerHasJob() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PeerListenerOptions options_;
  // The reactor's; closed by it on stop. Other threads read it only under
  // start_mu_ before Stop (StopAccepting), when the reactor leaves it be.
  UniqueFd listen_fd_;
  const UniqueFd epoll_fd_;
  const UniqueFd wake_fd_;  // eventfd: stop requests and finished jobs
  const std::string address_;
  Handler handler_;  // set by Start before any thread reads it

  // Reactor-only state (no lock: one thread).
  absl::flat_hash_map<uint64_t, std::unique_ptr<Conn>> conns_;
  std::set<uint64_t> unauthenticated_;  // ids, oldest (smallest) first
  std::deque<uint64_t> parked_;         // waiting for buffer memory
  uint64_t next_id_ = 2;                // 0: listener, 1: wake fd
  uint64_t charged_ = 0;                // bytes of buffer_bytes in use
  absl::Time accept_paused_until_ = absl::InfinitePast();
  bool listen_armed_ = false;
  absl::Time last_shed_log_ = absl::InfinitePast();
  uint64_t shed_since_log_ = 0;
  PeerListenerStats local_;  // counters; Publish copies them to stats_
  // Handover: no connection is read or written (FreezeConnections); frozen
  // once none is busy either.
  bool freezing_ = false;
  bool frozen_ = false;

  absl::Mutex start_mu_;  // serializes Start and Stop
  bool started_ ABSL_GUARDED_BY(start_mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(start_mu_) = false;
  Thread reactor_ ABSL_GUARDED_BY(start_mu_);
  std::vector<Thread> workers_ ABSL_GUARDED_BY(start_mu_);

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool workers_stop_ ABSL_GUARDED_BY(mu_) = false;
  // StopAccepting / ResumeAccepting ask (wanted); the reactor acknowledges
  // what it acts on from its next round (accepting).
  bool accept_wanted_ ABSL_GUARDED_BY(mu_) = true;
  bool accepting_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<Done> done_ ABSL_GUARDED_BY(mu_);
  // OnReactor's calls, and how many have run.
  std::vector<absl::AnyInvocable<void()>> calls_ ABSL_GUARDED_BY(mu_);
  uint64_t calls_queued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t calls_run_ ABSL_GUARDED_BY(mu_) = 0;
  bool reactor_gone_ ABSL_GUARDED_BY(mu_) = false;
  // FreezeConnections' result, set by the reactor once frozen.
  std::optional<absl::StatusOr<std::vector<HeldConnection>>> held_
      ABSL_GUARDED_BY(mu_);
  PeerListenerStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_PEER_LISTENER_H_
