// The live handover of this process, as one state machine: what the old
// process does when a new one takes over from it, and what the new one
// does to take over (docs/ARCHITECTURE.md, "Live handover", has its state
// diagram). The protocol's two ends (handover.h) carry the frames; this
// class decides, at each of their steps, what every piece of mrd does,
// through one interface (participant.h), and undoes it when a step fails.
//
// The old process, one handover at a time on the handover thread (each
// step: what the participants do, the test fault point that fails it, and
// what a failure undoes):
//
//   serving   --hello------> Check each (fault old.hello)      fail: serving
//             --prepare----> Prepare each: the state while it serves
//   prepared  --prepared---> Freeze each in order (old.pause; status
//                            handing-over)  fail: Thaw the frozen ones in
//                            reverse; none frozen: status serving
//   frozen    --snapshot---> Export each (old.export)  fail: Thaw all
//   exported  --ready------> Release each (old.commit)  fail: Thaw all
//   released  --commit-----> Retire each (status handed-over), then exit 0,
//                            or (--after_handover=wait) Discard each and
//                            wait for RequestExit
//
// Thaw is Resume: every participant that froze thaws, in reverse order,
// and the status file says serving again.
//
// The new process, on the main thread while mrd starts:
//
//   BeginTakeover:  hello (fault new.version: a version nobody speaks);
//                   none listens: StartFresh each; the prepare frame: the
//                   devices open on the old peer listeners, Preload each;
//                   (new.prepare: the process dies here); the snapshot.
//                   HANDOVER_BUSY: Unload each and ask again, backing off.
//   AdoptAndCommit: Adopt each (new.adopt fails it; new.crash: the process
//                   dies here); ready, Count each; no commit: Abandon each
//                   in reverse, exit 1; commit: Commit each.
//   EndTakeover:    the wiring served on the snapshot's sockets; log.
#ifndef MRD_SERVER_HANDOVER_PROCESS_HANDOVER_H_
#define MRD_SERVER_HANDOVER_PROCESS_HANDOVER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"
#include "server/handover/handover.h"
#include "server/handover/participant.h"
#include "server/handover/status_file.h"

namespace mrd::handover {

struct ProcessHandoverOptions {
  std::string socket;  // --handover_socket
  std::string mrd_version;
  absl::Duration timeout = absl::Seconds(60);  // --handover_timeout
  std::string fault;                           // --handover_test_fault
  // --after_handover=wait: once handed over, release everything and stay
  // until SIGTERM or SIGINT (RequestExit).
  bool stay = false;
  StatusFile* status = nullptr;  // not owned
  // The device's pinned bytes, for the log lines.
  std::function<uint64_t()> pinned_bytes;
};

class ProcessHandover final : private HandoverSource {
 public:
  // `participants` in the order they freeze (and thaw in reverse); none is
  // owned, and each outlives this object.
  ProcessHandover(ProcessHandoverOptions options,
                  std::vector<Participant*> participants);
  ~ProcessHandover() override;
  ProcessHandover(const ProcessHandover&) = delete;
  ProcessHandover& operator=(const ProcessHandover&) = delete;

  // --- the new process ------------------------------------------------------
  // Asks the running mrd to hand over, receives the prepare frame (calling
  // `open_device` with the old process's peer listeners, one per device in
  // its order (an empty UniqueFd for a device without one), then every
  // participant's Preload) and the snapshot. A running mrd that is busy
  // (HANDOVER_BUSY) is asked again, backing off, until the timeout. OK
  // without a takeover (taking_over() false) when no mrd runs.
  absl::Status BeginTakeover(
      v1::HandoverHello hello,
      const std::function<absl::Status(std::vector<UniqueFd> peer_listeners)>&
          open_device);
  bool taking_over() const { return takeover_ != nullptr; }
  // The snapshot received (taking_over() only).
  const v1::HandoverSnapshot& snapshot() const {
    return snapshot_->frame.snapshot();
  }
  // The snapshot's fds, which participants and the wiring take out by index.
  std::vector<UniqueFd>& snapshot_fds() { return snapshot_->fds; }
  // Every participant adopts the snapshot; says ready and waits for commit;
  // then every participant commits. On error every participant abandoned
  // what it adopted and the old process serves on.
  absl::Status AdoptAndCommit();
  // This process serves now: logs what it took over and forgets the
  // snapshot.
  void EndTakeover();

  // --- the old process ------------------------------------------------------
  // Listens for the next takeover (on the listener handed over, if this
  // process took over). A failure is logged: serving matters more than the
  // next upgrade.
  void Listen();
  // Whether Listen succeeded.
  bool listening() const ABSL_LOCKS_EXCLUDED(mu_);
  // Commit was sent: this process serves no more.
  bool committed() const { return committed_; }
  // SIGTERM or SIGINT came: a handover that commits from now on ends the
  // process once it released everything, whatever `stay` says.
  void RequestExit() { exit_requested_.Notify(); }
  // Stops listening and waits for a handover in progress to end.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  HandoverCounts counts() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // --- HandoverSource: the old process's steps ---
  absl::Status Check(const v1::HandoverHello& hello) override;
  absl::Status Prepare(v1::HandoverSnapshot* snapshot,
                       std::vector<UniqueFd>* fds) override;
  absl::Status Pause() override;
  absl::Status Export(v1::HandoverSnapshot* snapshot,
                      std::vector<UniqueFd>* fds) override;
  absl::Status Release() override;
  void Resume() override;
  void Finish(const v1::HandoverReady& ready, absl::Duration paused) override;

  // One attempt of BeginTakeover.
  absl::Status TryTakeover(
      const v1::HandoverHello& hello,
      const std::function<absl::Status(std::vector<UniqueFd> peer_listeners)>&
          open_device);
  void WriteStatus(absl::string_view state);
  // The test fault point `point` (--handover_test_fault) as the error it
  // fails its step with, or OK when another one (or none) is set.
  absl::Status Fault(absl::string_view point) const;

  const ProcessHandoverOptions options_;
  const std::vector<Participant*> participants_;

  // The new process: the takeover in progress and the snapshot it
  // received (fds taken out as they are adopted). Main thread only.
  std::unique_ptr<Takeover> takeover_;
  std::optional<HandoverChannel::Received> snapshot_;
  absl::Time takeover_start_;

  // The old process (the handover thread): how many participants froze,
  // the new process's pid (systemd is told to follow it at commit).
  size_t frozen_ = 0;
  pid_t taker_pid_ = 0;
  std::atomic<bool> committed_{false};
  // Finish has released everything (--after_handover=wait keeps the
  // process until RequestExit).
  absl::Notification handed_over_;
  absl::Notification exit_requested_;

  // Read by the metrics on their threads.
  mutable absl::Mutex mu_;
  std::unique_ptr<HandoverServer> server_ ABSL_GUARDED_BY(mu_);
  HandoverCounts took_over_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::handover

#endif  // MRD_SERVER_HANDOVER_PROCESS_HANDOVER_H_
