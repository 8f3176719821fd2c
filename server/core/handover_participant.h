// The core's and the device's part in a live handover
// (server/handover/participant.h). They go together: the core exports the
// peer connections the device froze, adopts its state onto the device, and
// the device, which speaks no wire messages, hands over through the core.
#ifndef MRD_SERVER_CORE_HANDOVER_PARTICIPANT_H_
#define MRD_SERVER_CORE_HANDOVER_PARTICIPANT_H_

#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"
#include "server/core/core.h"
#include "server/device/device.h"
#include "server/device/device_handover.h"
#include "server/handover/participant.h"

namespace mrd::core {

// The devices and the core are set as they are made (a new process opens
// its devices on the prepare frame, and makes its core after it); both
// before the handover thread starts. Every device hands over: each one's
// peer listener, frozen peer connections and watermarks go in the
// snapshot, device 0's in its own fields, the others' in other_devices.
class CoreParticipant final : public handover::Participant {
 public:
  // `drain`: how long the peer operations in flight may take to end when
  // the peer connections freeze (--handover_drain_timeout).
  explicit CoreParticipant(absl::Duration drain) : drain_(drain) {}
  // The core's devices, in its order (device 0 first).
  void SetDevices(std::vector<device::Device*> devices) {
    devices_ = std::move(devices);
  }
  void SetCore(Core* core) { core_ = core; }

  // The old process.
  absl::Status Check(const v1::HandoverHello& hello) override;
  absl::Status Prepare(v1::HandoverSnapshot* prepare,
                       std::vector<UniqueFd>* fds) override;
  absl::Status Freeze() override;
  absl::Status Export(v1::HandoverSnapshot* snapshot,
                      std::vector<UniqueFd>* fds) override;
  absl::Status Release() override;
  void Thaw() override;
  void Retire() override;
  void Discard() override;

  // The new process.
  void Preload(const v1::HandoverSnapshot& prepare,
               std::vector<UniqueFd>& fds) override;
  void Unload() override;
  void StartFresh() override;
  absl::Status Adopt(const v1::HandoverSnapshot& snapshot,
                     std::vector<UniqueFd>& fds) override;
  void Count(handover::AdoptedCounts* counts) const override;
  void Abandon() override;
  void Commit() override;

 private:
  // Every device's listening socket into `fds`, named by `snapshot`
  // (peer_listener, other_devices[].peer_listener): `listeners` (by device)
  // duplicated.
  static absl::Status AddPeerListeners(const std::vector<UniqueFd>& listeners,
                                       v1::HandoverSnapshot* snapshot,
                                       std::vector<UniqueFd>* fds);

  const absl::Duration drain_;
  std::vector<device::Device*> devices_;
  Core* core_ = nullptr;
  // The new process: the buffers the prepare frame named, mapped and
  // pinned ahead.
  PreparedBuffers prepared_;
  // The old process: what Freeze, Export and Release did, for Thaw. The
  // peer listeners, not accepting, by device (as many as stopped).
  std::vector<UniqueFd> detached_peers_;
  bool streams_held_ = false;
  size_t peers_frozen_ = 0;  // devices whose peers froze, from the first
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_HANDOVER_PARTICIPANT_H_
