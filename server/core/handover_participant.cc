#include "server/core/handover_participant.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::core {

absl::Status CoreParticipant::Check(const v1::HandoverHello& hello) {
  for (device::Device* device : devices_) {
    MRD_RETURN_IF_ERROR(device->handover().CanHandOver());
  }
  const std::string& kind = devices_[0]->Attributes().kind;
  if (hello.device_kind() != kind) {
    return MrdError(absl::StatusCode::kFailedPrecondition,
                    "HANDOVER_DEVICE_MISMATCH",
                    absl::StrCat("this mrd runs the ", kind,
                                 " device; the new process would run the ",
                                 hello.device_kind(), " device"));
  }
  // Every device's objects go to the device of the same index there.
  const size_t count = hello.device_count() == 0 ? 1 : hello.device_count();
  if (count != devices_.size()) {
    std::vector<std::string> names;
    for (const device::Device* device : devices_) {
      names.push_back(device->Attributes().name);
    }
    return MrdError(absl::StatusCode::kFailedPrecondition,
                    "HANDOVER_DEVICE_MISMATCH",
                    absl::StrCat("this mrd runs ", devices_.size(),
                                 " devices (", absl::StrJoin(names, ", "),
                                 "); the new process would run ", count,
                                 ": start it with the same device flags"));
  }
  return absl::OkStatus();
}

absl::Status CoreParticipant::AddPeerListeners(
    const std::vector<UniqueFd>& listeners, v1::HandoverSnapshot* snapshot,
    std::vector<UniqueFd>* fds) {
  for (size_t i = 0; i < listeners.size(); ++i) {
    MRD_ASSIGN_OR_RETURN(const int32_t index,
                         handover::AddDuplicate(listeners[i].get(), fds));
    if (i == 0) {
      snapshot->set_peer_listener(index);
    } else if (i - 1 < static_cast<size_t>(snapshot->other_devices_size())) {
      snapshot->mutable_other_devices(static_cast<int>(i - 1))
          ->set_peer_listener(index);
    }
  }
  return absl::OkStatus();
}

absl::Status CoreParticipant::Prepare(v1::HandoverSnapshot* prepare,
                                      std::vector<UniqueFd>* fds) {
  MRD_RETURN_IF_ERROR(core_->ExportState(prepare, fds));
  // The new process opens its devices on these sockets before the pause.
  std::vector<UniqueFd> listeners;
  for (device::Device* device : devices_) {
    absl::StatusOr<UniqueFd> peer = device->handover().DuplicatePeerListener();
    if (!peer.ok()) return peer.status();
    listeners.push_back(std::move(*peer));
  }
  return AddPeerListeners(listeners, prepare, fds);
}

absl::Status CoreParticipant::Freeze() {
  for (device::Device* device : devices_) {
    absl::StatusOr<UniqueFd> peer = device->handover().StopPeerAccepting();
    if (!peer.ok()) {
      // As it was: the devices stopped before this one accept again.
      for (size_t i = detached_peers_.size(); i-- > 0;) {
        devices_[i]->handover().ResumePeerAccepting();
      }
      detached_peers_.clear();
      return peer.status();
    }
    detached_peers_.push_back(std::move(*peer));
  }
  core_->HoldStreams(true);
  streams_held_ = true;
  return absl::OkStatus();
}

absl::Status CoreParticipant::Export(v1::HandoverSnapshot* snapshot,
                                     std::vector<UniqueFd>* fds) {
  // Established peer connections stop first (once no peer operation runs),
  // device by device: nothing is read or written on them here any more
  // unless the handover is called off (Thaw).
  std::vector<std::vector<device::DeviceHandover::HandedOverPeer>> peers;
  // Sessions whose end was noticed before the pause finish releasing first
  // (a session still closing is not handed over either way).
  if (!core_->AwaitTeardowns(drain_)) {
    LogWarning("handover: sessions still releasing after ",
               absl::FormatDuration(drain_), "; they are not handed over");
  }
  for (device::Device* device : devices_) {
    absl::StatusOr<std::vector<device::DeviceHandover::HandedOverPeer>> frozen =
        device->handover().FreezePeers(drain_);
    if (!frozen.ok()) return frozen.status();
    ++peers_frozen_;
    peers.push_back(*std::move(frozen));
  }
  MRD_RETURN_IF_ERROR(core_->ExportState(snapshot, fds));
  MRD_RETURN_IF_ERROR(core_->ExportPeers(std::move(peers), snapshot, fds));
  return AddPeerListeners(detached_peers_, snapshot, fds);
}

absl::Status CoreParticipant::Release() {
  // From commit on, the new process alone answers peers: a key it revokes
  // must not stay reachable here. The frozen connections are the new
  // process's now: this process's fds close, nothing is shut down; any
  // other connection (before hello, or closing) ends here.
  for (size_t i = 0; i < peers_frozen_; ++i) {
    devices_[i]->handover().DropFrozenPeers();
  }
  peers_frozen_ = 0;
  for (device::Device* device : devices_) {
    if (!device->handover().DisconnectPeers(absl::Seconds(5))) {
      return MrdError(
          absl::StatusCode::kUnavailable, "HANDOVER_BUSY",
          absl::StrCat("peer connections of device ", device->Attributes().name,
                       " were still closing after 5s"));
    }
  }
  return absl::OkStatus();
}

void CoreParticipant::Thaw() {
  for (size_t i = peers_frozen_; i-- > 0;) devices_[i]->handover().ThawPeers();
  peers_frozen_ = 0;
  for (size_t i = detached_peers_.size(); i-- > 0;) {
    devices_[i]->handover().ResumePeerAccepting();
  }
  detached_peers_.clear();
  if (streams_held_) {
    core_->HoldStreams(false);
    streams_held_ = false;
  }
}

void CoreParticipant::Retire() {
  core_->MarkHandedOver();  // completion streams end: HANDED_OVER
}

void CoreParticipant::Discard() {
  core_->Shutdown();
  for (device::Device* device : devices_) device->Shutdown();
}

void CoreParticipant::Preload(const v1::HandoverSnapshot& prepare,
                              std::vector<UniqueFd>& fds) {
  // Pinned ahead through the first device (the software devices share its
  // pins; an adoption on another takes its own).
  prepared_ =
      PrepareBuffers(prepare, fds, devices_.empty() ? nullptr : devices_[0]);
}

void CoreParticipant::Unload() {
  // Before the unmap.
  for (device::Device* device : devices_) device->handover().DropPinsAhead();
  prepared_.clear();
}

void CoreParticipant::StartFresh() {
  // An earlier attempt opened the devices on the listeners of an mrd that
  // is gone now: the sockets are this process's alone, and it accepts.
  for (device::Device* device : devices_) {
    device->handover().ResumePeerAccepting();
  }
}

absl::Status CoreParticipant::Adopt(const v1::HandoverSnapshot& snapshot,
                                    std::vector<UniqueFd>& fds) {
  absl::Status adopted = core_->AdoptState(snapshot, fds, &prepared_);
  // What the snapshot no longer names: its pins, then its mappings.
  for (device::Device* device : devices_) device->handover().DropPinsAhead();
  prepared_.clear();
  return adopted;
}

void CoreParticipant::Count(handover::AdoptedCounts* counts) const {
  const CoreStats stats = core_->Stats();
  counts->sessions += stats.sessions;
  counts->buffers += stats.buffers;
  counts->registrations += stats.registrations;
  counts->lams += stats.lams;
  counts->mr_objects += stats.mrs;
  counts->warm_pins += stats.warm.pins;
  // The software devices share the first one's pins.
  counts->pinned_bytes += devices_[0]->PinnedBytes();
}

void CoreParticipant::Abandon() {
  // Lets go of everything adopted; the shared peer listeners are left alone
  // (this process never accepted on them).
  core_->Shutdown();
}

void CoreParticipant::Commit() {
  // The peer connections handed over go on where the old process stopped
  // them, and peers that waited in the listeners' backlogs come in here.
  for (device::Device* device : devices_) {
    device->handover().ThawPeers();
    device->handover().ResumePeerAccepting();
  }
}

}  // namespace mrd::core
