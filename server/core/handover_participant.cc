#include "server/core/handover_participant.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::core {

absl::Status CoreParticipant::Check(const v1::HandoverHello& hello) {
  MRD_RETURN_IF_ERROR(device_->handover().CanHandOver());
  MRD_RETURN_IF_ERROR(core_->CanHandOverDevices());
  if (hello.device_kind() != device_->Attributes().kind) {
    return MrdError(
        absl::StatusCode::kFailedPrecondition, "HANDOVER_DEVICE_MISMATCH",
        absl::StrCat("this mrd runs the ", device_->Attributes().kind,
                     " device; the new process would run the ",
                     hello.device_kind(), " device"));
  }
  return absl::OkStatus();
}

absl::Status CoreParticipant::Prepare(v1::HandoverSnapshot* prepare,
                                      std::vector<UniqueFd>* fds) {
  MRD_RETURN_IF_ERROR(core_->ExportState(prepare, fds));
  // The new process opens its device on this socket before the pause.
  absl::StatusOr<UniqueFd> peer = device_->handover().DuplicatePeerListener();
  if (!peer.ok()) return peer.status();
  prepare->set_peer_listener(-1);
  if (peer->valid()) {
    fds->push_back(std::move(*peer));
    prepare->set_peer_listener(static_cast<int32_t>(fds->size() - 1));
  }
  return absl::OkStatus();
}

absl::Status CoreParticipant::Freeze() {
  absl::StatusOr<UniqueFd> peer = device_->handover().StopPeerAccepting();
  if (!peer.ok()) return peer.status();
  detached_peer_ = std::move(*peer);
  peer_stopped_ = true;
  core_->HoldStreams(true);
  streams_held_ = true;
  return absl::OkStatus();
}

absl::Status CoreParticipant::Export(v1::HandoverSnapshot* snapshot,
                                     std::vector<UniqueFd>* fds) {
  // Established peer connections stop first (once no peer operation runs):
  // nothing is read or written on them here any more unless the handover
  // is called off (Thaw).
  absl::StatusOr<std::vector<device::DeviceHandover::HandedOverPeer>> peers =
      device_->handover().FreezePeers(drain_);
  if (!peers.ok()) return peers.status();
  peers_frozen_ = true;
  MRD_RETURN_IF_ERROR(core_->ExportState(snapshot, fds));
  MRD_RETURN_IF_ERROR(core_->ExportPeers(std::move(*peers), snapshot, fds));
  MRD_ASSIGN_OR_RETURN(const int32_t listener,
                       handover::AddDuplicate(detached_peer_.get(), fds));
  snapshot->set_peer_listener(listener);
  return absl::OkStatus();
}

absl::Status CoreParticipant::Release() {
  // From commit on, the new process alone answers peers: a key it revokes
  // must not stay reachable here. The frozen connections are the new
  // process's now: this process's fds close, nothing is shut down; any
  // other connection (before hello, or closing) ends here.
  if (peers_frozen_) {
    device_->handover().DropFrozenPeers();
    peers_frozen_ = false;
  }
  if (!device_->handover().DisconnectPeers(absl::Seconds(5))) {
    return MrdError(absl::StatusCode::kUnavailable, "HANDOVER_BUSY",
                    "peer connections were still closing after 5s");
  }
  return absl::OkStatus();
}

void CoreParticipant::Thaw() {
  if (peers_frozen_) {
    device_->handover().ThawPeers();
    peers_frozen_ = false;
  }
  if (peer_stopped_) {
    device_->handover().ResumePeerAccepting();
    detached_peer_.Reset();
    peer_stopped_ = false;
  }
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
  device_->Shutdown();
}

void CoreParticipant::Preload(const v1::HandoverSnapshot& prepare,
                              std::vector<UniqueFd>& fds) {
  prepared_ = PrepareBuffers(prepare, fds, device_);
}

void CoreParticipant::Unload() {
  if (device_ != nullptr)
    device_->handover().DropPinsAhead();  // before the unmap
  prepared_.clear();
}

void CoreParticipant::StartFresh() {
  // An earlier attempt opened the device on the listener of an mrd that
  // is gone now: the socket is this process's alone, and it accepts.
  if (device_ != nullptr) device_->handover().ResumePeerAccepting();
}

absl::Status CoreParticipant::Adopt(const v1::HandoverSnapshot& snapshot,
                                    std::vector<UniqueFd>& fds) {
  absl::Status adopted = core_->AdoptState(snapshot, fds, &prepared_);
  // What the snapshot no longer names: its pins, then its mappings.
  device_->handover().DropPinsAhead();
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
  counts->pinned_bytes += device_->PinnedBytes();
}

void CoreParticipant::Abandon() {
  // Lets go of everything adopted; the shared peer listener is left alone
  // (this process never accepted on it).
  core_->Shutdown();
}

void CoreParticipant::Commit() {
  // The peer connections handed over go on where the old process stopped
  // them, and peers that waited in the listener's backlog come in here.
  device_->handover().ThawPeers();
  device_->handover().ResumePeerAccepting();
}

}  // namespace mrd::core
