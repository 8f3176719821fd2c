#include "server/metrics/metrics.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"
#include "server/common/status.h"

namespace mrd::metrics {
namespace {

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

prometheus::MetricFamily Gauge(const std::string& name, const std::string& help,
                               double value) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = prometheus::MetricType::Gauge;
  prometheus::ClientMetric metric;
  metric.gauge.value = value;
  family.metric.push_back(metric);
  return family;
}

prometheus::MetricFamily Counter(const std::string& name,
                                 const std::string& help, double value) {
  prometheus::MetricFamily family = Gauge(name, help, 0);
  family.type = prometheus::MetricType::Counter;
  family.metric[0].counter.value = value;
  return family;
}

absl::Status ProbeBind(const std::string& address) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_ADDRESS",
        absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  std::string host = address.substr(0, colon);
  std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  addrinfo* info = nullptr;
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(),
                       &hints, &info);
  if (rc != 0) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_ADDRESS",
        absl::StrCat("metrics address '", address, "': ", gai_strerror(rc)));
  }
  int fd = socket(info->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int bound = fd >= 0 ? bind(fd, info->ai_addr, info->ai_addrlen) : -1;
  int err = errno;
  if (fd >= 0) close(fd);
  freeaddrinfo(info);
  if (bound != 0) {
    return MrdError(absl::StatusCode::kUnavailable, "METRICS_BIND_FAILED",
                    absl::StrCat("cannot serve metrics on ", address, ": ",
                                 std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace

// Reads the core at scrape time: no background polling, always current.
class Metrics::CoreCollector final : public prometheus::Collectable {
 public:
  CoreCollector(const core::Core* core, FdBudget* fd_budget)
      : core_(core), fd_budget_(fd_budget) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    core::CoreStats s = core_->Stats();
    auto d = [](uint64_t v) { return static_cast<double>(v); };
    std::vector<prometheus::MetricFamily> out = {
        Gauge("mrd_sessions", "Open sessions (fd and lease).", d(s.sessions)),
        Gauge("mrd_fd_sessions", "Open fd-socket sessions.", d(s.fd_sessions)),
        Gauge("mrd_lease_sessions", "Open lease sessions.",
              d(s.lease_sessions)),
        Gauge("mrd_buffers", "Imported buffers.", d(s.buffers)),
        Gauge("mrd_registrations", "Live registrations (descriptors).",
              d(s.registrations)),
        Gauge("mrd_lams", "Live logical address mappings.", d(s.lams)),
        Gauge("mrd_mr_objects", "Live MR objects.", d(s.mrs)),
        Gauge("mrd_peer_connections", "Connected peers.", d(s.connections)),
        Gauge("mrd_pinned_bytes",
              "Bytes pinned by the device (each page once).",
              d(s.device_pinned_bytes)),
        Gauge("mrd_accounted_pinned_bytes",
              "Bytes counted against the pinning limits.",
              d(s.accounted_pinned_bytes)),
        Counter("mrd_sessions_opened_total", "Sessions opened.",
                d(s.sessions_opened_total)),
        Counter("mrd_sessions_closed_total", "Sessions ended.",
                d(s.sessions_closed_total)),
        Counter("mrd_completions_dropped_total",
                "Completions dropped because a session's queue was full.",
                d(s.completions_dropped_total)),
        Counter("mrd_cache_hits_total", "Registration cache hits.",
                d(s.cache.hits)),
        Counter("mrd_cache_misses_total", "Registration cache misses.",
                d(s.cache.misses)),
        Counter("mrd_cache_releases_total",
                "Registrations released by their last deregistration.",
                d(s.cache.releases)),
        Counter("mrd_cache_invalidations_total",
                "Registrations invalidated because their memory went away.",
                d(s.cache.invalidations)),
        Counter("mrd_cache_warm_hits_total",
                "Registrations served from a warm pin (pages still pinned, "
                "new key).",
                d(s.warm.hits)),
        Counter("mrd_cache_warm_kept_total",
                "Warm pins kept after a registration's last reference.",
                d(s.warm.kept)),
        Counter("mrd_cache_evictions_total",
                "Warm pins evicted, least recently kept first, for a cap or "
                "a pinned-bytes limit.",
                d(s.warm.evictions)),
        Counter("mrd_cache_warm_drops_total",
                "Warm pins dropped because their buffer was released or "
                "their session ended.",
                d(s.warm.drops)),
        Gauge("mrd_cache_warm_pins", "Warm pins kept now.", d(s.warm.pins)),
        Gauge("mrd_cache_warm_bytes",
              "Bytes held by warm pins now (part of the pinned bytes).",
              d(s.warm.bytes)),
        TenantFamily(prometheus::MetricType::Gauge, "mrd_tenant_usage",
                     "What each tenant holds now, by resource.",
                     [](const core::Tenant& t, core::TenantResource r) {
                       return static_cast<double>(t.Used(r));
                     }),
        TenantFamily(prometheus::MetricType::Gauge, "mrd_tenant_limit",
                     "Each tenant's quota, by resource.",
                     [](const core::Tenant& t, core::TenantResource r) {
                       return static_cast<double>(t.quota(r));
                     }),
        TenantFamily(prometheus::MetricType::Counter,
                     "mrd_tenant_refusals_total",
                     "Requests refused because the tenant's quota was "
                     "reached, by resource.",
                     [](const core::Tenant& t, core::TenantResource r) {
                       return static_cast<double>(t.Refused(r));
                     }),
    };
    if (fd_budget_ != nullptr) {
      fd_budget_->Sample(absl::Seconds(1));
      const FdBudgetStats f = fd_budget_->Stats();
      out.push_back(Gauge("mrd_fd_limit",
                          "The open-file limit (RLIMIT_NOFILE) mrd runs with.",
                          d(f.limit)));
      out.push_back(Gauge("mrd_fd_reserve",
                          "fds kept from clients (gRPC, peers, metrics).",
                          d(f.reserve)));
      out.push_back(Gauge("mrd_fd_budget",
                          "fds clients may make mrd hold, all together.",
                          d(f.budget)));
      out.push_back(Gauge("mrd_fd_session_limit",
                          "fds one session may make mrd hold.",
                          d(f.per_owner)));
      out.push_back(Gauge("mrd_fds_charged",
                          "fds clients make mrd hold now (buffers, fd socket "
                          "connections).",
                          d(f.charged)));
      out.push_back(Gauge("mrd_fds_open", "fds mrd has open (sampled).",
                          static_cast<double>(f.open_fds)));
      out.push_back(Counter("mrd_fd_refusals_total",
                            "Imports and connections refused for lack of fd "
                            "budget (LIMIT_SESSION_FDS, LIMIT_TOTAL_FDS).",
                            d(f.refused_owner_total + f.refused_budget_total)));
      out.push_back(Counter("mrd_fd_reserve_low_total",
                            "Samples that found less than half of the fd "
                            "reserve left.",
                            d(f.reserve_low_total)));
    }
    if (peer_path) {
      const PeerPathGauges p = peer_path();
      struct Row {
        const char* name;
        const char* help;
        uint64_t value;
        bool counter;
      };
      const Row rows[] = {
          {"mrd_peer_connections_open",
           "Peer TCP connections open now (software device).", p.connections,
           false},
          {"mrd_peer_connections_unauthenticated",
           "Peer connections that have not said hello yet.", p.unauthenticated,
           false},
          {"mrd_peer_buffered_bytes",
           "Memory held for peer frames and responses now.", p.buffered_bytes,
           false},
          {"mrd_peer_threads", "Threads serving the peer path (a fixed pool).",
           p.threads, false},
          {"mrd_peer_max_connections",
           "Peer connections allowed at once (--peer_max_connections).",
           p.max_connections, false},
          {"mrd_peer_max_unauthenticated",
           "Peer connections allowed before hello "
           "(--peer_max_unauthenticated).",
           p.max_unauthenticated, false},
          {"mrd_peer_max_buffer_bytes",
           "Memory allowed for peer frames (--peer_buffer_bytes).",
           p.max_buffer_bytes, false},
          {"mrd_peer_max_session_connections",
           "Peer connections allowed per session "
           "(--peer_max_session_connections).",
           p.max_session_connections, false},
          {"mrd_peer_accepted_total", "Peer connections accepted.",
           p.accepted_total, true},
          {"mrd_peer_refused_total",
           "Peer connections refused at the total cap with no stranger to "
           "shed.",
           p.refused_total, true},
          {"mrd_peer_shed_total",
           "Peer connections without hello closed to admit newer ones.",
           p.shed_total, true},
          {"mrd_peer_hello_timeouts_total",
           "Peer connections closed for no hello in time.",
           p.hello_timeouts_total, true},
          {"mrd_peer_stall_timeouts_total",
           "Peer connections closed for stalling inside a frame.",
           p.stall_timeouts_total, true},
          {"mrd_peer_session_limit_refusals_total",
           "Hellos refused: the session (or its tenant) is at its "
           "connection limit.",
           p.session_limit_refusals_total, true},
      };
      for (const Row& row : rows) {
        out.push_back(row.counter ? Counter(row.name, row.help, d(row.value))
                                  : Gauge(row.name, row.help, d(row.value)));
      }
    }
    if (grpc_connections) {
      const service::GrpcAcceptorStats g = grpc_connections();
      out.push_back(Gauge("mrd_grpc_connections",
                          "gRPC connections open now (on the gRPC socket).",
                          d(g.connections)));
      out.push_back(Gauge("mrd_grpc_max_connections",
                          "gRPC connections allowed at once "
                          "(--grpc_max_connections).",
                          d(g.max_connections)));
      out.push_back(Gauge("mrd_grpc_max_connections_per_uid",
                          "gRPC connections allowed per client uid "
                          "(--grpc_max_connections_per_uid).",
                          d(g.max_connections_per_uid)));
      out.push_back(Counter("mrd_grpc_connections_accepted_total",
                            "gRPC connections accepted.", d(g.accepted_total)));
      out.push_back(Counter("mrd_grpc_connections_refused_total",
                            "gRPC connections refused at the total limit "
                            "(LIMIT_GRPC_CONNECTIONS).",
                            d(g.refused_total_limit)));
      out.push_back(Counter("mrd_grpc_connections_refused_uid_total",
                            "gRPC connections refused at the per-uid limit "
                            "(LIMIT_UID_GRPC_CONNECTIONS).",
                            d(g.refused_uid_limit)));
      out.push_back(Counter("mrd_grpc_connections_refused_no_fd_total",
                            "gRPC connections refused because mrd had no "
                            "file descriptor left.",
                            d(g.refused_no_fd)));
    }
    return out;
  }

 private:
  // One series per tenant and resource: {tenant="...",resource="..."}.
  template <typename ValueFn>
  prometheus::MetricFamily TenantFamily(prometheus::MetricType type,
                                        const std::string& name,
                                        const std::string& help,
                                        ValueFn value) const {
    prometheus::MetricFamily family;
    family.name = name;
    family.help = help;
    family.type = type;
    for (const std::shared_ptr<core::Tenant>& tenant : core_->Tenants()) {
      for (int i = 0; i < core::kTenantResourceCount; ++i) {
        const auto resource = static_cast<core::TenantResource>(i);
        prometheus::ClientMetric metric;
        metric.label.push_back({"tenant", tenant->name()});
        metric.label.push_back(
            {"resource", std::string(core::TenantResourceName(resource))});
        const double v = value(*tenant, resource);
        if (type == prometheus::MetricType::Counter) {
          metric.counter.value = v;
        } else {
          metric.gauge.value = v;
        }
        family.metric.push_back(std::move(metric));
      }
    }
    return family;
  }

  const core::Core* const core_;
  FdBudget* const fd_budget_;

 public:
  // Set before the exposer starts; read-only afterwards.
  std::function<PeerPathGauges()> peer_path;
  std::function<service::GrpcAcceptorStats()> grpc_connections;
};

void Metrics::SetPeerPathSource(std::function<PeerPathGauges()> source) {
  collector_->peer_path = std::move(source);
}

void Metrics::SetGrpcConnectionsSource(
    std::function<service::GrpcAcceptorStats()> source) {
  collector_->grpc_connections = std::move(source);
}

Metrics::Metrics(const core::Core* core, FdBudget* fd_budget)
    : registry_(std::make_shared<prometheus::Registry>()),
      collector_(std::make_shared<CoreCollector>(core, fd_budget)),
      rpcs_(prometheus::BuildCounter()
                .Name("mrd_rpcs_total")
                .Help("Finished RPCs by method and status code.")
                .Register(*registry_)),
      latency_(prometheus::BuildHistogram()
                   .Name("mrd_rpc_duration_seconds")
                   .Help("RPC latency by method.")
                   .Register(*registry_)) {}

Metrics::~Metrics() = default;

absl::Status Metrics::Serve(const std::string& address) {
  // civetweb reports a bind failure by throwing from its constructor, and
  // mrd is built without exceptions: probe the address first so that a busy
  // port is a status, not an abort.
  MRD_RETURN_IF_ERROR(ProbeBind(address));
  std::vector<std::string> options = {"listening_ports", address, "num_threads",
                                      "2"};
  exposer_ = std::make_unique<prometheus::Exposer>(options);
  if (exposer_->GetListeningPorts().empty()) {
    exposer_.reset();
    return MrdError(absl::StatusCode::kUnavailable, "METRICS_BIND_FAILED",
                    absl::StrCat("cannot serve metrics on ", address));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(collector_);
  return absl::OkStatus();
}

void Metrics::OnRpcDone(absl::string_view method, grpc::StatusCode code,
                        absl::Duration elapsed) {
  std::string m(method);
  rpcs_.Add({{"method", m}, {"code", CodeName(code)}}).Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5};
  latency_.Add({{"method", m}}, kBuckets)
      .Observe(absl::ToDoubleSeconds(elapsed));
}

std::string Metrics::Render() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> core = collector_->Collect();
  families.insert(families.end(), core.begin(), core.end());
  prometheus::TextSerializer serializer;
  return serializer.Serialize(families);
}

}  // namespace mrd::metrics
