// Prometheus metrics (docs/METRICS.md lists every one):
// - the gRPC server metrics under go-grpc-prometheus's names
//   (grpc_server_started_total, grpc_server_handled_total,
//   grpc_server_handling_seconds), as the service's RpcObserver, with every
//   method and code present from the start;
// - mrd_build_info, the device in use and its health, every configured
//   limit (mrd_limit), the registration sizes;
// - the process's CPU, memory, fds and threads (process_*);
// - a collector that reads the core's and the device's state at scrape time
//   (sessions, registrations, pinned bytes, cache, tenants, fds, peers).
// Served over HTTP by prometheus-cpp's civetweb exposer.
//
// Thread-safe. The exposer runs its own threads.
#ifndef MRD_SERVER_METRICS_METRICS_H_
#define MRD_SERVER_METRICS_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "mrd/unique_fd.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/common/fair_scheduler.h"
#include "server/common/fd_budget.h"
#include "server/core/core.h"
#include "server/metrics/rpc_observer.h"

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

// Live handover (docs/ARCHITECTURE.md), read at scrape time: what this
// process took over when it started (zeros when it started fresh), and the
// takeovers asked of it.
struct HandoverGauges {
  double takeover_seconds = 0;  // from its hello until the commit
  uint64_t sessions = 0;
  uint64_t buffers = 0;
  uint64_t registrations = 0;
  uint64_t lams = 0;
  uint64_t mr_objects = 0;
  uint64_t warm_pins = 0;
  uint64_t fd_connections = 0;
  uint64_t peer_connections = 0;
  uint64_t pinned_bytes = 0;
  uint64_t attempts_total = 0;  // takeovers asked of this process
  uint64_t refusals_total = 0;  // of those, refused or failed: it serves on
};

// What runs: mrd_build_info's labels and the device gauges.
struct ServerInfo {
  std::string version;
  std::string revision;  // the source's git commit, or "unknown"
  std::string device;    // "software" or "verbs"
  // --device=auto found RDMA devices but serves the software device.
  bool device_fallback = false;
};

class Metrics final : public RpcObserver {
 public:
  // `core` (and `fd_budget`, if given) must outlive this object.
  explicit Metrics(const core::Core* core, FdBudget* fd_budget = nullptr);
  ~Metrics() override;

  // Call these before Serve; sources must be thread-safe and outlive this
  // object.
  void SetServerInfo(const ServerInfo& info);
  // Each configured limit: the flag's name (without --) and its value.
  void SetLimits(std::vector<std::pair<std::string, double>> limits);

  // Serves /metrics on `address` (host:port). Errors: UNAVAILABLE when the
  // port cannot be bound.
  absl::Status Serve(const std::string& address);
  // Serves /metrics on `listener`, a listening TCP socket another mrd
  // served on (a live handover): prometheus-cpp's server cannot take a
  // socket, so it is started on a loopback port of its own and the
  // inherited socket put in place of that one's fd (dup3). Its server
  // polls its listening sockets by fd number, so it accepts from the
  // inherited one from its next poll (within 2 s); connections wait in the
  // socket's backlog meanwhile, none is refused. Errors: INVALID_ARGUMENT
  // "BAD_METRICS_LISTENER" (not a listening TCP socket), Serve's, INTERNAL
  // "METRICS_LISTENER_NOT_FOUND", the errno of dup3.
  absl::Status ServeOn(UniqueFd listener);
  // A duplicate (close-on-exec) of the socket served on, for the next
  // process. Errors: FAILED_PRECONDITION "METRICS_NOT_SERVED", the errno
  // of the duplication.
  absl::StatusOr<UniqueFd> DuplicateListener() const;
  // Stops serving (a live handover: the next process serves the address;
  // only this process's fd of the socket is closed). Serve or ServeOn may
  // be called again.
  void StopServing();

  void OnRpcStart(absl::string_view method) override;
  void OnRpcDone(absl::string_view method, grpc::StatusCode code,
                 absl::Duration elapsed) override;
  void OnRegistered(absl::string_view method, uint64_t bytes) override;

  // The text exposition, as a scrape would return it (for tests and logs).
  std::string Render() const;

  // Adds the peer path's gauges to every scrape.
  void SetPeerPathSource(std::function<PeerPathGauges()> source);
  void SetHandoverSource(std::function<HandoverGauges()> source);

  // Adds the gRPC socket's connection gauges (GrpcConnectionStats)
  // to every scrape.
  void SetGrpcConnectionsSource(std::function<GrpcConnectionStats()> source);
  // Adds each tenant's queue in front of the workers (FairScheduler) to
  // every scrape: depth, running, wait and service time.
  void SetSchedulerSource(std::function<std::vector<FairQueueStats>()> source);

 private:
  static constexpr size_t kGrpcCodes = 17;  // OK .. UNAUTHENTICATED
  class CoreCollector;
  class ProcessCollector;
  // One method's series, made at construction (so that every one is there
  // from the first scrape) and never removed: lookups need no lock.
  struct MethodSeries {
    prometheus::Counter* started = nullptr;
    std::array<prometheus::Counter*, kGrpcCodes> handled{};
    prometheus::Histogram* seconds = nullptr;
  };

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<CoreCollector> collector_;
  std::shared_ptr<ProcessCollector> process_;
  absl::flat_hash_map<std::string, MethodSeries> methods_;
  absl::flat_hash_map<std::string, prometheus::Histogram*> sizes_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  // The server's listening socket (its fd, not owned); -1 when not served.
  int listen_fd_ = -1;
};

}  // namespace mrd::metrics

#endif  // MRD_SERVER_METRICS_METRICS_H_
