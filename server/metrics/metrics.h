// Prometheus metrics: per-RPC counters and latency histograms (as the
// service's RpcObserver), plus a collector that reads the core's and the
// device's state at scrape time (sessions, registrations, pinned bytes, cache
// hits/misses). Served over HTTP by prometheus-cpp's civetweb exposer.
//
// Thread-safe. The exposer runs its own threads.
#ifndef MRD_SERVER_METRICS_METRICS_H_
#define MRD_SERVER_METRICS_METRICS_H_

#include <functional>
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
#include "server/service/grpc_acceptor.h"
#include "server/service/service.h"

namespace mrd::metrics {

// The software device's peer path (its TCP port), read at scrape time.
struct PeerPathGauges {
  uint64_t connections = 0;      // open now
  uint64_t unauthenticated = 0;  // open now, no hello yet
  uint64_t buffered_bytes = 0;   // frame and response memory now
  uint64_t threads = 0;          // reactor and workers (fixed)
  uint64_t accepted_total = 0;
  uint64_t refused_total = 0;  // at the total cap with nobody to shed
  uint64_t shed_total = 0;     // strangers closed to admit newcomers
  uint64_t hello_timeouts_total = 0;
  uint64_t stall_timeouts_total = 0;
  uint64_t session_limit_refusals_total = 0;
  uint64_t max_connections = 0;
  uint64_t max_unauthenticated = 0;
  uint64_t max_buffer_bytes = 0;
  uint64_t max_session_connections = 0;
};

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

  // Adds the peer path's gauges to every scrape. Call before Serve; the
  // source must be thread-safe and outlive this object.
  void SetPeerPathSource(std::function<PeerPathGauges()> source);

  // Adds the gRPC socket's connection gauges (server/service/grpc_acceptor.h)
  // to every scrape. Same rules as SetPeerPathSource.
  void SetGrpcConnectionsSource(
      std::function<service::GrpcAcceptorStats()> source);

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
