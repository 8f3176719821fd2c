// What one piece of mrd does at each step of a live handover. The process
// handover (process_handover.h) calls every participant at each step, in
// the order it was given them, and undoes a failed handover by thawing the
// frozen ones in reverse; each module that holds something a handover
// moves (the core and the device, the fd socket, the call gate and the
// gRPC acceptor, the metrics) serves this interface, or a small adapter
// beside it does.
//
// Only the wire messages of the handover and server/common are named
// here, so that any module may implement it without a cycle. The devices
// speak no wire messages: the device's part is served by the core's
// participant (server/core/handover_participant.h), which owns the device
// calls of a handover together with the core's state they go with.
#ifndef MRD_SERVER_HANDOVER_PARTICIPANT_H_
#define MRD_SERVER_HANDOVER_PARTICIPANT_H_

#include <fcntl.h>

#include <cerrno>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"

namespace mrd::handover {

// What a process took over, for its answer, its log and its metrics.
struct AdoptedCounts {
  uint64_t sessions = 0;
  uint64_t buffers = 0;
  uint64_t registrations = 0;
  uint64_t lams = 0;
  uint64_t mr_objects = 0;
  uint64_t warm_pins = 0;
  uint64_t pinned_bytes = 0;
};

// What the metrics say of handovers (mrd_handover_*).
struct HandoverCounts {
  double takeover_seconds = 0;
  AdoptedCounts adopted;
  uint64_t fd_connections = 0;
  uint64_t peer_connections = 0;
  uint64_t attempts = 0;  // as the old process
  uint64_t refusals = 0;
};

// The fd a snapshot names by `index` out of `fds`, or none (-1, or out of
// range).
inline UniqueFd TakeFd(std::vector<UniqueFd>& fds, int32_t index) {
  if (index < 0 || static_cast<size_t>(index) >= fds.size()) return UniqueFd();
  return std::move(fds[static_cast<size_t>(index)]);
}

// Appends a duplicate of `fd` (close-on-exec) to `fds` and returns its
// index, or -1 for no fd (`fd` negative).
inline absl::StatusOr<int32_t> AddDuplicate(int fd,
                                            std::vector<UniqueFd>* fds) {
  if (fd < 0) return -1;
  const int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) return ErrnoError(errno, "dup", "HANDOVER_FD");
  fds->emplace_back(dup);
  return static_cast<int32_t>(fds->size() - 1);
}

// Every step has a default that does nothing, so that a participant
// implements only the steps it takes part in. Snapshots and fds are the
// ones the protocol sends: a participant appends its fds to `fds` and names
// them in the snapshot by index.
class Participant {
 public:
  virtual ~Participant() = default;

  // --- the old process ------------------------------------------------------
  // May this process hand over to the one that said `hello`? The refusal's
  // reason goes to the new process.
  virtual absl::Status Check(const v1::HandoverHello& /*hello*/) {
    return absl::OkStatus();
  }
  // Before anything freezes: the state as it is, for the new process to
  // map and pin ahead while this one serves.
  virtual absl::Status Prepare(v1::HandoverSnapshot* /*prepare*/,
                               std::vector<UniqueFd>* /*fds*/) {
    return absl::OkStatus();
  }
  // Stops taking work (requests, connections). An error leaves this
  // participant as it was; the ones frozen before it are thawed.
  virtual absl::Status Freeze() { return absl::OkStatus(); }
  // Frozen: what to hand over.
  virtual absl::Status Export(v1::HandoverSnapshot* /*snapshot*/,
                              std::vector<UniqueFd>* /*fds*/) {
    return absl::OkStatus();
  }
  // The new process is ready: lets go of what only one process may hold
  // at a time.
  virtual absl::Status Release() { return absl::OkStatus(); }
  // The handover failed before commit: undoes Freeze, Export and Release,
  // whichever ran, and serves again as before.
  virtual void Thaw() {}
  // Commit was sent: answers what waits here (the new process serves it).
  virtual void Retire() {}
  // After Retire, when this process stays (--after_handover=wait): lets go
  // of its own copies of everything now rather than at exit.
  virtual void Discard() {}

  // --- the new process ------------------------------------------------------
  // The old process's prepare frame: maps and pins ahead what it names.
  virtual void Preload(const v1::HandoverSnapshot& /*prepare*/,
                       std::vector<UniqueFd>& /*fds*/) {}
  // The attempt failed (it is retried): lets go of what Preload took.
  virtual void Unload() {}
  // No mrd runs: nothing to take over, serve as a fresh start.
  virtual void StartFresh() {}
  // Takes the snapshot's state over (fds are taken out of `fds`).
  virtual absl::Status Adopt(const v1::HandoverSnapshot& /*snapshot*/,
                             std::vector<UniqueFd>& /*fds*/) {
    return absl::OkStatus();
  }
  // What Adopt took over, added to `counts`.
  virtual void Count(AdoptedCounts* /*counts*/) const {}
  // The old process did not commit: lets go of what was adopted.
  virtual void Abandon() {}
  // The old process committed: serves what was adopted.
  virtual void Commit() {}
};

}  // namespace mrd::handover

#endif  // MRD_SERVER_HANDOVER_PARTICIPANT_H_
