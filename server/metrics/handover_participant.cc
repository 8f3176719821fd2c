#include "server/metrics/handover_participant.h"

#include <utility>

#include "server/common/log.h"

namespace mrd::metrics {

HandoverGauges GaugesOf(const handover::HandoverCounts& counts) {
  HandoverGauges g;
  g.takeover_seconds = counts.takeover_seconds;
  g.sessions = counts.adopted.sessions;
  g.buffers = counts.adopted.buffers;
  g.registrations = counts.adopted.registrations;
  g.lams = counts.adopted.lams;
  g.mr_objects = counts.adopted.mr_objects;
  g.warm_pins = counts.adopted.warm_pins;
  g.fd_connections = counts.fd_connections;
  g.peer_connections = counts.peer_connections;
  g.pinned_bytes = counts.adopted.pinned_bytes;
  g.attempts_total = counts.attempts;
  g.refusals_total = counts.refusals;
  return g;
}

absl::Status MetricsParticipant::Export(v1::HandoverSnapshot* snapshot,
                                        std::vector<UniqueFd>* fds) {
  if (!serves()) return absl::OkStatus();
  absl::StatusOr<UniqueFd> listener = metrics_->DuplicateListener();
  if (listener.ok()) {
    fds->push_back(std::move(*listener));
    snapshot->set_metrics_listener(static_cast<int32_t>(fds->size() - 1));
  } else {
    // The new process binds the port itself once this one let go.
    LogWarning("handover: the metrics listener stays here: ",
               listener.status().ToString());
  }
  return absl::OkStatus();
}

absl::Status MetricsParticipant::Release() {
  if (!serves()) return absl::OkStatus();
  // The socket lives on in the new process (its copy); this one keeps a
  // duplicate to serve again should the handover still fail.
  absl::StatusOr<UniqueFd> kept = metrics_->DuplicateListener();
  if (kept.ok()) kept_ = std::move(*kept);
  metrics_->StopServing();
  stopped_ = true;
  return absl::OkStatus();
}

void MetricsParticipant::Thaw() {
  if (!stopped_) return;
  absl::Status s = kept_.valid() ? metrics_->ServeOn(std::move(kept_))
                                 : metrics_->Serve(address_);
  if (!s.ok()) {
    LogError("handover failed, metrics not served again: ", s.ToString());
  }
  kept_.Reset();
  stopped_ = false;
}

}  // namespace mrd::metrics
