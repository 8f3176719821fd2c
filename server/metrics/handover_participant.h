// The metrics' part in a live handover (server/handover/participant.h):
// the metrics socket moves to the new process, with the scrapes waiting in
// its backlog; this process stops serving it only once the new one is
// ready, and serves it again should the handover still fail.
#ifndef MRD_SERVER_METRICS_HANDOVER_PARTICIPANT_H_
#define MRD_SERVER_METRICS_HANDOVER_PARTICIPANT_H_

#include <string>
#include <vector>

#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"
#include "server/handover/participant.h"
#include "server/metrics/metrics.h"

namespace mrd::metrics {

// The gauges of mrd_handover_*.
HandoverGauges GaugesOf(const handover::HandoverCounts& counts);

class MetricsParticipant final : public handover::Participant {
 public:
  // Before the handover thread starts: `metrics` serves `address`
  // (--metrics_address; empty: no metrics socket, nothing to hand over).
  void Set(Metrics* metrics, const std::string& address) {
    metrics_ = metrics;
    address_ = address;
  }

  absl::Status Export(v1::HandoverSnapshot* snapshot,
                      std::vector<UniqueFd>* fds) override;
  absl::Status Release() override;
  void Thaw() override;

 private:
  bool serves() const { return metrics_ != nullptr && !address_.empty(); }

  Metrics* metrics_ = nullptr;
  std::string address_;
  // Release's duplicate of the listener, served again by Thaw.
  UniqueFd kept_;
  bool stopped_ = false;
};

}  // namespace mrd::metrics

#endif  // MRD_SERVER_METRICS_HANDOVER_PARTICIPANT_H_
