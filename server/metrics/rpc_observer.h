// What the gRPC edge (server/service) reports to the metrics, declared here
// so that metrics depend on no part of the service: the service calls an
// RpcObserver for every RPC, and the gRPC socket's acceptor fills a
// GrpcConnectionStats that main.cc hands to Metrics::AddGrpcConnectionGauges.
//
// Thread safety: an RpcObserver must be thread-safe; the struct is a value.
#ifndef MRD_SERVER_METRICS_RPC_OBSERVER_H_
#define MRD_SERVER_METRICS_RPC_OBSERVER_H_

#include <grpcpp/support/status.h>

#include <cstdint>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace mrd::metrics {

// Told about every RPC of the service as it starts and as it ends, and about
// every successful registration. `method` is the method's name in
// mrd.v1.MemoryRegistration ("RegisterMr").
class RpcObserver {
 public:
  virtual ~RpcObserver() = default;
  virtual void OnRpcStart(absl::string_view method) = 0;
  virtual void OnRpcDone(absl::string_view method, grpc::StatusCode code,
                         absl::Duration elapsed) = 0;
  // A RegisterMr, BuildLam or FastRegister of `bytes` bytes succeeded.
  virtual void OnRegistered(absl::string_view method, uint64_t bytes) = 0;
};

// The gRPC socket's connections (server/service/grpc_acceptor.h).
struct GrpcConnectionStats {
  uint64_t connections = 0;  // handed to gRPC and still open
  uint64_t accepted_total = 0;
  uint64_t refused_total_limit = 0;   // LIMIT_GRPC_CONNECTIONS
  uint64_t refused_tenant_limit = 0;  // LIMIT_TENANT_GRPC_CONNECTIONS
  uint64_t refused_no_fd = 0;         // accepted and closed: no fd left
  uint64_t max_connections = 0;
  uint64_t max_connections_per_tenant = 0;
};

}  // namespace mrd::metrics

#endif  // MRD_SERVER_METRICS_RPC_OBSERVER_H_
