// The live handover of this process, as one state machine: what the old
// process does when a new one takes over from it, and what the new one
// does to take over (docs/ARCHITECTURE.md, "Live handover", has its state
// diagram). The protocol's two ends (handover.h) carry the frames; this
// class decides, at each of their steps, what every piece of mrd does,
// through one interface (participant.h), and undoes it when a step fails.
//
// The old process:
//
//   serving --Check, Prepare--> prepared --Freeze (in order)--> frozen
//     --Export--> exported --Release--> released --commit--> retired
//   and from frozen, exported or released, on any failure: Thaw (in
//   reverse order) --> serving.
//
// A participant whose Freeze fails is not thawed; the ones before it are.
// The fault points of the steps (old.hello, old.pause, old.export,
// old.commit) are the protocol's (handover.cc); new.version too, while
// new.prepare, new.adopt and new.crash are here, in the new process's steps.
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
  // `open_device` with the old process's peer listener, then every
  // participant's Preload) and the snapshot. A running mrd that is busy
  // (HANDOVER_BUSY) is asked again, backing off, until the timeout. OK
  // without a takeover (taking_over() false) when no mrd runs.
  absl::Status BeginTakeover(
      v1::HandoverHello hello,
      const std::function<absl::Status(UniqueFd peer_listener)>& open_device);
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
      const std::function<absl::Status(UniqueFd peer_listener)>& open_device);
  void WriteStatus(absl::string_view state);

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
