// The directory on etcd (docs/DIRECTORY.md) as mrd's flags configure it,
// and its part in a live handover.
//
// --etcd_endpoints turns it on: a Publisher keeps mrd's lease and writes
// its entries, and the core publishes through it. A live handover passes
// the lease on, so that no entry disappears during an upgrade: the old
// process exports the lease and its epoch, stops writing at Release (its
// keeper renews the lease until it exits), and the new process, at Commit,
// adopts the lease, takes the epoch one further and writes every adopted
// session's names again under it. A handover that fails after Release
// leaves the old process writing again, on the same lease.
#ifndef MRD_SERVER_DAEMON_DIRECTORY_H_
#define MRD_SERVER_DAEMON_DIRECTORY_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"
#include "server/core/core.h"
#include "server/directory/publisher.h"
#include "server/handover/participant.h"

namespace mrd::daemon {

class DirectoryParticipant final : public handover::Participant {
 public:
  DirectoryParticipant() = default;
  DirectoryParticipant(const DirectoryParticipant&) = delete;
  DirectoryParticipant& operator=(const DirectoryParticipant&) = delete;

  // Reads the flags. Without --etcd_endpoints: nothing (the core's
  // directory calls answer DIRECTORY_OFF). Otherwise, unless
  // `taking_over` (then Commit starts it on the lease handed over), starts
  // the Publisher (it does not wait for etcd) and gives it to `core`.
  // Errors: a bad flag, the text to log.
  absl::Status Start(core::Core* core, bool taking_over);
  // Shutting down: revokes the lease (every entry goes at once), unless
  // this process handed over (the entries are the new process's now).
  void Stop(bool handed_over);

  // For readiness (the health service "mrd.v1.MemoryRegistration/directory"):
  // whether the directory is serving (etcd reached, the last write through),
  // when that changed since the last call (the first call: the state now).
  // nullopt while the directory is off, from a handover's Release until
  // Thaw or Commit, or when nothing changed. A change after the first is
  // logged. Thread-safe: the health watch calls it.
  std::optional<bool> TakeServingChange();

  // The old process.
  absl::Status Export(v1::HandoverSnapshot* snapshot,
                      std::vector<UniqueFd>* fds) override;
  absl::Status Release() override;
  void Thaw() override;
  // The new process.
  absl::Status Adopt(const v1::HandoverSnapshot& snapshot,
                     std::vector<UniqueFd>& fds) override;
  void Commit() override;
  void Abandon() override;

 private:
  // Starts a publisher (on `lease`, when not 0) and gives it to the core;
  // with `republish`, the sessions' names are written again.
  absl::Status StartPublisher(int64_t lease, bool republish);

  core::Core* core_ = nullptr;
  bool enabled_ = false;
  core::DirectoryOptions options_;
  directory::PublisherOptions publisher_options_;
  std::unique_ptr<directory::Publisher> publisher_;
  // TakeServingChange's view of publisher_: set when a publisher starts,
  // cleared at Release and Stop (before the publisher stops writing).
  absl::Mutex health_mu_;
  directory::Publisher* watched_ ABSL_GUARDED_BY(health_mu_) = nullptr;
  std::optional<bool> last_serving_ ABSL_GUARDED_BY(health_mu_);
  int64_t exported_lease_ = 0;  // the old process, from Export on
  bool released_ = false;       // the old process stopped writing
  int64_t adopted_lease_ = 0;   // the new process, from Adopt on
  uint64_t adopted_epoch_ = 0;
};

}  // namespace mrd::daemon

#endif  // MRD_SERVER_DAEMON_DIRECTORY_H_
