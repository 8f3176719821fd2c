// Live handover: a new mrd process (mrd --takeover) takes over everything
// the node's clients depend on from the running one, without a single
// registration breaking (docs/ARCHITECTURE.md, "Live handover"; the
// protocol: mrd/v1/handover.proto).
//
// Both ends are here, as the protocol's steps; what each step does to mrd
// (pausing the gRPC service, detaching sockets, exporting and adopting the
// core's state) is the process handover's (process_handover.h), through
// HandoverSource on the old side and its own steps on the new side.
//
// Guarantee: until the old process sends commit, any failure — a refusal
// from either side, a closed socket, a timeout, a crash of the new process
// — leaves the old process serving as before (HandoverSource::Resume).
// After commit the new process serves and the old one exits 0.
//
// The test-only fault points (mrd --handover_test_fault=<point>) are the
// process handover's, at the steps they fail (process_handover.h).
#ifndef MRD_SERVER_HANDOVER_HANDOVER_H_
#define MRD_SERVER_HANDOVER_HANDOVER_H_

#include <cstdint>
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
#include "mrd/v1/handover.pb.h"
#include "server/common/thread.h"
#include "server/handover/channel.h"

namespace mrd::handover {

// The snapshot's format. A new process that speaks another version is
// refused (HANDOVER_VERSION) and the old one serves on. Version 2: the
// prepare frame carries the peer listener too (the new process opens its
// device and pins before the pause).
inline constexpr uint32_t kHandoverVersion = 2;

// What the old process does at each step of a handover.
class HandoverSource {
 public:
  virtual ~HandoverSource() = default;
  // May this process hand over to the one that said `hello` (its device,
  // its state)? The refusal's reason goes to the new process.
  virtual absl::Status Check(const v1::HandoverHello& hello) = 0;
  // Before anything pauses: the state as it is (sessions locked one at a
  // time, no request stopped) with the buffers' fds, for the new process
  // to map and fill the page tables of while this one serves.
  virtual absl::Status Prepare(v1::HandoverSnapshot* snapshot,
                               std::vector<UniqueFd>* fds) = 0;
  // Stops taking requests (new ones refused with a retry hint), waits
  // (bounded) for those in flight, and detaches the listening sockets and
  // the fd-session connections. On error nothing stays stopped.
  virtual absl::Status Pause() = 0;
  // The state to hand over, and the fds it names by index.
  virtual absl::Status Export(v1::HandoverSnapshot* snapshot,
                              std::vector<UniqueFd>* fds) = 0;
  // The new process holds everything: let go of what only one process may
  // hold at a time (peer connections, the metrics port). Resume undoes it.
  virtual absl::Status Release() = 0;
  // The handover failed before commit: serve again as before.
  virtual void Resume() = 0;
  // Commit was sent: the new process serves. Answers what waits, then
  // ends this process with exit code 0; does not return.
  virtual void Finish(const v1::HandoverReady& ready,
                      absl::Duration paused) = 0;
};

struct HandoverServerOptions {
  std::string path;  // <runtime_dir>/handover.sock
  std::string mrd_version;
  // How long the new process may take for each of its answers (adopting a
  // snapshot of a million registrations takes seconds).
  absl::Duration timeout = absl::Seconds(60);
};

// The old process's end: listens on `path` (mode 0600; a peer of another
// uid is refused, SO_PEERCRED) and serves one takeover at a time on its
// own thread.
class HandoverServer {
 public:
  // Binds (replacing a stale socket file) and starts the thread; or, with
  // `inherited` (the listener the previous process handed over), serves on
  // that. Errors: FAILED_PRECONDITION HANDOVER_SOCKET_IN_USE (another mrd
  // listens there), the socket's, THREAD_FAILED.
  static absl::StatusOr<std::unique_ptr<HandoverServer>> Start(
      const HandoverServerOptions& options, HandoverSource* source,
      UniqueFd inherited = UniqueFd());
  // A duplicate of the listening socket, for the next process.
  absl::StatusOr<UniqueFd> DuplicateListener() const;
  ~HandoverServer();
  HandoverServer(const HandoverServer&) = delete;
  HandoverServer& operator=(const HandoverServer&) = delete;

  // Stops listening (removing the socket file if it is still ours) and
  // joins the thread. Not from inside a HandoverSource call. Idempotent.
  void Shutdown();

  struct Stats {
    uint64_t attempts = 0;
    uint64_t refusals = 0;  // failed before commit; this process serves on
    std::string last_refusal;
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  HandoverServer(const HandoverServerOptions& options, HandoverSource* source);
  void Run();
  // One takeover on `socket`. Returns when it failed (the source resumed),
  // or never (Finish).
  void Serve(UniqueFd socket);
  absl::Status ServeSteps(HandoverChannel& channel, bool* paused,
                          absl::Time* paused_at);

  const HandoverServerOptions options_;
  HandoverSource* const source_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // eventfd: Shutdown wakes the thread
  uint64_t socket_device_ = 0;
  uint64_t socket_inode_ = 0;
  std::optional<Thread> thread_;
  mutable absl::Mutex mu_;
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

struct TakeoverOptions {
  std::string path;  // the old process's handover socket
  absl::Duration timeout = absl::Seconds(60);
  // The format version said in hello: kHandoverVersion but for a test
  // (fault point new.version).
  uint32_t version = kHandoverVersion;
};

// The new process's end, step by step.
class Takeover {
 public:
  // Connects and says hello. Errors: NOT_FOUND HANDOVER_NOBODY (no mrd
  // listens: nothing to take over), the old process's refusal (its reason
  // and message), or the socket's.
  static absl::StatusOr<std::unique_ptr<Takeover>> Begin(
      const TakeoverOptions& options, v1::HandoverHello hello);

  const v1::HandoverAccept& accepted() const { return accept_; }
  // The prepare frame (the old process still serves): its snapshot and fds.
  absl::StatusOr<HandoverChannel::Received> ReceivePrepare();
  // The prepare frame is taken care of: the old process pauses now.
  absl::Status Prepared();
  // The snapshot with its fds (the old process is paused meanwhile).
  absl::StatusOr<HandoverChannel::Received> ReceiveSnapshot();
  // Everything is adopted: says so and waits for commit. An error means the
  // old process did not commit and serves on: release what was adopted.
  absl::Status Ready(const v1::HandoverReady& ready);
  // Adoption failed: tells the old process why (it serves on).
  void Refuse(const absl::Status& why);

 private:
  Takeover(const TakeoverOptions& options, UniqueFd socket)
      : options_(options), channel_(std::move(socket)) {}

  const TakeoverOptions options_;
  HandoverChannel channel_;
  v1::HandoverAccept accept_;
};

// A refusal frame's status, and a status as a refusal.
absl::Status StatusOfRefusal(const v1::HandoverRefusal& refusal);
v1::HandoverFrame RefusalFrame(const absl::Status& why);

}  // namespace mrd::handover

#endif  // MRD_SERVER_HANDOVER_HANDOVER_H_
