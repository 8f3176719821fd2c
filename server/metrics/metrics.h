// Prometheus metrics: per-RPC counters and latency histograms (as the
// service's RpcObserver), plus a collector that reads the core's and the
// device's state at scrape time (sessions, registrations, pinned bytes, cache
// hits/misses). Served over HTTP by prometheus-cpp's civetweb exposer.
//
// Thread-safe. The exposer runs its own threads.
#ifndef MRD_SERVER_METRICS_METRICS_H_
#define MRD_SERVER_METRICS_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/common/fd_budget.h"
#include "server/core/core.h"
#include "server/service/service.h"

namespace mrd::metrics {

class Metrics final : public service::RpcObserver {
 public:
  // `core` (and `fd_budget`, if given) must outlive this object.
  explicit Metrics(const core::Core* core, FdBudget* fd_budget = nullptr);
  ~Metrics() override;

  // Serves /metrics on `address` (host:port). Errors: UNAVAILABLE when the
  // port cannot be bound.
  absl::Status Serve(const std::string& address);

  void OnRpcDone(absl::string_view method, grpc::StatusCode code,
                 absl::Duration elapsed) override;

  // The text exposition, as a scrape would return it (for tests and logs).
  std::string Render() const;

 private:
  class CoreCollector;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<CoreCollector> collector_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Histogram>& latency_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace mrd::metrics

#endif  // MRD_SERVER_METRICS_METRICS_H_
