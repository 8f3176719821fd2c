#include "server/metrics/metrics.h"

#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "google/protobuf/descriptor.h"
#include "mrd/status.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "prometheus/text_serializer.h"
#include "server/common/thread.h"

namespace mrd::metrics {
namespace {

// grpc_code as go-grpc-prometheus spells it (Go's codes.Code names), so that
// existing dashboards' selectors (grpc_code="Unavailable") match.
const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "Canceled";
    case grpc::StatusCode::UNKNOWN:
      return "Unknown";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "InvalidArgument";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DeadlineExceeded";
    case grpc::StatusCode::NOT_FOUND:
      return "NotFound";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "AlreadyExists";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PermissionDenied";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "ResourceExhausted";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FailedPrecondition";
    case grpc::StatusCode::ABORTED:
      return "Aborted";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OutOfRange";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "Unimplemented";
    case grpc::StatusCode::INTERNAL:
      return "Internal";
    case grpc::StatusCode::UNAVAILABLE:
      return "Unavailable";
    case grpc::StatusCode::DATA_LOSS:
      return "DataLoss";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "Unauthenticated";
    default:
      return "Unknown";
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

// Whether `fd` is a listening TCP socket, and its port.
bool ListeningTcpPort(int fd, int* port) {
  int listening = 0;
  int type = 0;
  socklen_t length = sizeof(listening);
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) != 0 ||
      listening == 0) {
    return false;
  }
  length = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &length) != 0 ||
      type != SOCK_STREAM) {
    return false;
  }
  sockaddr_storage address{};
  length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return false;
  }
  if (address.ss_family == AF_INET) {
    *port = ntohs(reinterpret_cast<const sockaddr_in*>(&address)->sin_port);
    return true;
  }
  if (address.ss_family == AF_INET6) {
    *port = ntohs(reinterpret_cast<const sockaddr_in6*>(&address)->sin6_port);
    return true;
  }
  return false;
}

// This process's listening TCP socket on `port` (the metrics server's:
// nothing else of mrd listens on TCP but the peer path, on another port),
// or -1.
int FindListener(int port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (dirent* entry = readdir(dir)) {
    int fd = -1;
    if (!absl::SimpleAtoi(entry->d_name, &fd) || fd == dirfd(dir)) continue;
    int bound = 0;
    if (ListeningTcpPort(fd, &bound) && bound == port) {
      found = fd;
      break;
    }
  }
  closedir(dir);
  return found;
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

// go-grpc-prometheus's grpc_type of a method.
const char* GrpcType(const google::protobuf::MethodDescriptor& method) {
  if (method.client_streaming() && method.server_streaming()) {
    return "bidi_stream";
  }
  if (method.client_streaming()) return "client_stream";
  if (method.server_streaming()) return "server_stream";
  return "unary";
}

// Handling time: from 100 us (a cache hit) to 5 min (registrations of tens
// of GiB pin page by page; 3 GiB took 17 s on the verbs device).
const prometheus::Histogram::BucketBoundaries& HandlingBuckets() {
  static const auto* const kBuckets =
      new prometheus::Histogram::BucketBoundaries{
          0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
          0.025,  0.05,    0.1,    0.25,  0.5,    1,     2.5,
          5,      10,      30,     60,    120,    300};
  return *kBuckets;
}

// Registration sizes: 4 KiB to 1 TiB in powers of 4.
const prometheus::Histogram::BucketBoundaries& SizeBuckets() {
  static const auto* const kBuckets = [] {
    auto* b = new prometheus::Histogram::BucketBoundaries;
    for (double v = 4096; v <= 1099511627776.0; v *= 4) b->push_back(v);
    return b;
  }();
  return *kBuckets;
}

// Reads a small /proc file whole; empty when it cannot.
std::string ReadProcFile(const char* path) {
  std::string out;
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) {
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

// The boot time (seconds since the epoch), for process_start_time_seconds.
double BootTime() {
  for (absl::string_view line :
       absl::StrSplit(ReadProcFile("/proc/stat"), '\n')) {
    double t = 0;
    if (absl::ConsumePrefix(&line, "btime ") && absl::SimpleAtod(line, &t)) {
      return t;
    }
  }
  return 0;
}

}  // namespace

// The process's own resources, as Prometheus' client libraries name them
// (process_*), read from /proc/self at scrape time.
class Metrics::ProcessCollector final : public prometheus::Collectable {
 public:
  explicit ProcessCollector(FdBudget* fd_budget)
      : fd_budget_(fd_budget),
        ticks_(static_cast<double>(sysconf(_SC_CLK_TCK))),
        page_size_(static_cast<double>(sysconf(_SC_PAGESIZE))),
        boot_time_(BootTime()) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    // /proc/self/stat: the fields after the command's closing parenthesis
    // start at field 3 (state); utime 14, stime 15, num_threads 20,
    // starttime 22, vsize 23, rss 24 (proc(5)).
    const std::string stat = ReadProcFile("/proc/self/stat");
    const size_t paren = stat.rfind(')');
    std::vector<absl::string_view> f;
    if (paren != std::string::npos && paren + 2 < stat.size()) {
      f = absl::StrSplit(absl::string_view(stat).substr(paren + 2), ' ');
    }
    auto field = [&f](size_t n) {
      double v = 0;
      return n - 3 < f.size() && absl::SimpleAtod(f[n - 3], &v) ? v : -1.0;
    };
    const double utime = field(14), stime = field(15), threads = field(20),
                 start = field(22), vsize = field(23), rss = field(24);
    if (utime >= 0 && stime >= 0 && threads >= 0 && start >= 0 && vsize >= 0 &&
        rss >= 0) {
      out.push_back(Counter("process_cpu_seconds_total",
                            "User and system CPU time spent, in seconds.",
                            (utime + stime) / ticks_));
      out.push_back(Gauge("process_resident_memory_bytes",
                          "Resident memory size in bytes.", rss * page_size_));
      out.push_back(Gauge("process_virtual_memory_bytes",
                          "Virtual memory size in bytes.", vsize));
      out.push_back(Gauge("process_start_time_seconds",
                          "Start time of the process since the Unix epoch, in "
                          "seconds.",
                          boot_time_ + start / ticks_));
      out.push_back(
          Gauge("process_threads", "Threads of the process.", threads));
    }
    rlimit nofile{};
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0) {
      out.push_back(Gauge("process_max_fds",
                          "The open-file limit (RLIMIT_NOFILE, soft).",
                          static_cast<double>(nofile.rlim_cur)));
    }
    const double fds = OpenFds();
    if (fds >= 0) {
      out.push_back(Gauge("process_open_fds", "Open file descriptors.", fds));
    }
    return out;
  }

 private:
  // The fd budget's sample (taken at most once a second) when mrd has one,
  // else a count of /proc/self/fd.
  double OpenFds() const {
    if (fd_budget_ != nullptr) {
      fd_budget_->Sample(absl::Seconds(1));
      return static_cast<double>(fd_budget_->Stats().open_fds);
    }
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return -1;
    double n = 0;
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(dir);
    return n - 1;  // the directory's own fd
  }

  FdBudget* const fd_budget_;
  const double ticks_;
  const double page_size_;
  const double boot_time_;
};

// Reads the core at scrape time: no background polling, always current.
class Metrics::CoreCollector final : public prometheus::Collectable {
 public:
  CoreCollector(const core::Core* core, FdBudget* fd_budget)
      : core_(core), fd_budget_(fd_budget) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    const Sources src = Snapshot();
    const auto& [peer_path, handover, grpc_connections, scheduler, server_info,
                 limits] = src;
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
    {
      prometheus::MetricFamily build =
          Gauge("mrd_build_info",
                "Always 1: mrd's version, source revision and the device it "
                "serves (software or verbs).",
                1);
      build.metric[0].label = {
          prometheus::ClientMetric::Label{"version", server_info.version},
          prometheus::ClientMetric::Label{"revision", server_info.revision},
          prometheus::ClientMetric::Label{"device", server_info.device}};
      out.push_back(std::move(build));
    }
    out.push_back(Gauge("mrd_device_fallback",
                        "1 when --device=auto found RDMA devices but mrd "
                        "serves the software device (the verbs device "
                        "failed); 0 otherwise.",
                        server_info.device_fallback ? 1 : 0));
    if (std::optional<directory::PublisherStats> dir =
            core_->publications().Stats()) {
      prometheus::MetricFamily state =
          Gauge("mrd_directory_state",
                "1 for the directory's state now (connecting: no lease "
                "yet; serving; unavailable: etcd unreachable, writes "
                "queued and retried), 0 for the others. Absent without "
                "--etcd_endpoints.",
                0);
      state.metric.clear();
      for (directory::DirectoryState one :
           {directory::DirectoryState::kConnecting,
            directory::DirectoryState::kServing,
            directory::DirectoryState::kUnavailable}) {
        prometheus::ClientMetric metric;
        metric.label.push_back(prometheus::ClientMetric::Label{
            "state", std::string(directory::DirectoryStateName(one))});
        metric.gauge.value = dir->state == one ? 1 : 0;
        state.metric.push_back(std::move(metric));
      }
      out.push_back(std::move(state));
      prometheus::MetricFamily entries =
          Gauge("mrd_directory_entries",
                "Published names by their state on etcd: published, "
                "pending (puts and deletes not yet done), conflict "
                "(another mrd's lease holds the name).",
                0);
      entries.metric.clear();
      for (const auto& [label, value] :
           {std::pair<const char*, size_t>{"published", dir->published},
            {"pending", dir->pending},
            {"conflict", dir->conflicts}}) {
        prometheus::ClientMetric metric;
        metric.label.push_back(prometheus::ClientMetric::Label{"state", label});
        metric.gauge.value = static_cast<double>(value);
        entries.metric.push_back(std::move(metric));
      }
      out.push_back(std::move(entries));
      out.push_back(Counter("mrd_directory_writes_total",
                            "Puts and deletes etcd acknowledged.",
                            static_cast<double>(dir->writes)));
      out.push_back(Counter("mrd_directory_failed_writes_total",
                            "Attempts to write to etcd that failed (each "
                            "is retried).",
                            static_cast<double>(dir->failed_writes)));
      out.push_back(Counter("mrd_directory_leases_granted_total",
                            "etcd leases mrd was granted (one at the "
                            "start, one more after each lease lost).",
                            static_cast<double>(dir->leases_granted)));
    }
    {
      // Per device: health, and what each has pinned.
      prometheus::MetricFamily healthy =
          Gauge("mrd_device_healthy",
                "1 while the device is healthy, 0 while it is lost or its "
                "port is down (readiness is SERVING while any device is "
                "healthy).",
                0);
      prometheus::MetricFamily pinned = Gauge(
          "mrd_device_pinned_bytes",
          "Bytes the device has pinned (software devices share their pins).",
          0);
      healthy.metric.clear();
      pinned.metric.clear();
      for (const core::DeviceState& device : core_->DeviceStates()) {
        prometheus::ClientMetric metric;
        metric.label.push_back(
            prometheus::ClientMetric::Label{"device", device.name});
        metric.gauge.value = device.healthy ? 1 : 0;
        healthy.metric.push_back(metric);
        metric.gauge.value = d(device.pinned_bytes);
        pinned.metric.push_back(std::move(metric));
      }
      out.push_back(std::move(healthy));
      out.push_back(std::move(pinned));
    }
    {
      prometheus::MetricFamily family =
          Gauge("mrd_limit",
                "Each configured limit, by the name of its flag (bytes or "
                "counts).",
                0);
      family.metric.clear();
      for (const auto& [name, value] : limits) {
        prometheus::ClientMetric metric;
        metric.label.push_back(prometheus::ClientMetric::Label{"limit", name});
        metric.gauge.value = value;
        family.metric.push_back(std::move(metric));
      }
      out.push_back(std::move(family));
    }
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
    if (handover) {
      const HandoverGauges h = handover();
      out.push_back(Gauge("mrd_takeover_seconds",
                          "How long this process took to take over from the "
                          "mrd before it, from its hello until the commit "
                          "(0: it started fresh).",
                          h.takeover_seconds));
      prometheus::MetricFamily objects =
          Gauge("mrd_takeover_objects",
                "What this process took over when it started, by kind "
                "(0: it started fresh).",
                0);
      objects.metric.clear();
      const std::pair<const char*, uint64_t> kinds[] = {
          {"sessions", h.sessions},
          {"buffers", h.buffers},
          {"registrations", h.registrations},
          {"lams", h.lams},
          {"mr_objects", h.mr_objects},
          {"warm_pins", h.warm_pins},
          {"fd_connections", h.fd_connections},
          {"peer_connections", h.peer_connections},
          {"pinned_bytes", h.pinned_bytes}};
      for (const auto& [kind, value] : kinds) {
        prometheus::ClientMetric metric;
        metric.label.push_back(prometheus::ClientMetric::Label{"kind", kind});
        metric.gauge.value = d(value);
        objects.metric.push_back(std::move(metric));
      }
      out.push_back(std::move(objects));
      out.push_back(Counter("mrd_handover_attempts_total",
                            "Takeovers a new mrd asked of this process.",
                            d(h.attempts_total)));
      out.push_back(Counter("mrd_handover_refusals_total",
                            "Takeovers this process refused, or that failed "
                            "before commit: it served on (the reason is "
                            "logged).",
                            d(h.refusals_total)));
    }
    if (scheduler) AddSchedulerFamilies(scheduler(), out);
    if (grpc_connections) {
      const GrpcConnectionStats g = grpc_connections();
      out.push_back(Gauge("mrd_grpc_connections",
                          "gRPC connections open now (on the gRPC socket).",
                          d(g.connections)));
      out.push_back(Gauge("mrd_grpc_max_connections",
                          "gRPC connections allowed at once "
                          "(--grpc_max_connections).",
                          d(g.max_connections)));
      out.push_back(Gauge("mrd_grpc_max_connections_per_tenant",
                          "gRPC connections allowed per client tenant "
                          "(--grpc_max_connections_per_tenant).",
                          d(g.max_connections_per_tenant)));
      out.push_back(Counter("mrd_grpc_connections_accepted_total",
                            "gRPC connections accepted.", d(g.accepted_total)));
      out.push_back(Counter("mrd_grpc_connections_refused_total",
                            "gRPC connections refused at the total limit "
                            "(LIMIT_GRPC_CONNECTIONS).",
                            d(g.refused_total_limit)));
      out.push_back(Counter("mrd_grpc_connections_refused_tenant_total",
                            "gRPC connections refused at the per-tenant "
                            "limit (LIMIT_TENANT_GRPC_CONNECTIONS).",
                            d(g.refused_tenant_limit)));
      out.push_back(Counter("mrd_grpc_connections_refused_no_fd_total",
                            "gRPC connections refused because mrd had no "
                            "file descriptor left.",
                            d(g.refused_no_fd)));
    }
    return out;
  }

 private:
  // Each tenant's queue in front of the workers, one series per tenant.
  static void AddSchedulerFamilies(const std::vector<FairQueueStats>& queues,
                                   std::vector<prometheus::MetricFamily>& out) {
    auto family = [&](const char* name, const char* help,
                      prometheus::MetricType type, auto value) {
      prometheus::MetricFamily f;
      f.name = name;
      f.help = help;
      f.type = type;
      for (const FairQueueStats& q : queues) {
        prometheus::ClientMetric metric;
        metric.label.push_back({"tenant", q.key});
        const double v = value(q);
        if (type == prometheus::MetricType::Counter) {
          metric.counter.value = v;
        } else {
          metric.gauge.value = v;
        }
        f.metric.push_back(std::move(metric));
      }
      out.push_back(std::move(f));
    };
    auto d = [](uint64_t v) { return static_cast<double>(v); };
    family("mrd_tenant_queue_depth",
           "Requests of the tenant waiting for a worker now.",
           prometheus::MetricType::Gauge,
           [&](const FairQueueStats& q) { return d(q.queued); });
    family("mrd_tenant_queue_running",
           "Requests of the tenant on a worker now.",
           prometheus::MetricType::Gauge,
           [&](const FairQueueStats& q) { return d(q.running); });
    family("mrd_tenant_weight",
           "The tenant's weight: its share of the workers relative to the "
           "other tenants' while they compete.",
           prometheus::MetricType::Gauge,
           [&](const FairQueueStats& q) { return d(q.weight); });
    family("mrd_tenant_service_seconds_total",
           "Seconds the tenant's requests spent on a worker.",
           prometheus::MetricType::Counter,
           [](const FairQueueStats& q) { return q.service_seconds_total; });
    family("mrd_tenant_queue_cost_total",
           "The work the tenant's requests stood for, as the fair scheduler "
           "charged it: 4 KiB pages to pin, unpin or unmap and the items of "
           "a batch (1 for the rest).",
           prometheus::MetricType::Counter,
           [&](const FairQueueStats& q) { return d(q.cost_total); });
    family("mrd_tenant_queue_yields_total",
           "Times a long request of the tenant gave its worker up between "
           "steps for another tenant's waiting request.",
           prometheus::MetricType::Counter,
           [&](const FairQueueStats& q) { return d(q.yields_total); });
    prometheus::MetricFamily wait;
    wait.name = "mrd_tenant_queue_wait_seconds";
    wait.help =
        "How long the tenant's requests waited for a worker (a yield's "
        "wait counts as one more).";
    wait.type = prometheus::MetricType::Histogram;
    for (const FairQueueStats& q : queues) {
      prometheus::ClientMetric metric;
      metric.label.push_back({"tenant", q.key});
      uint64_t count = 0;
      for (size_t i = 0; i < q.wait_bucket_counts.size(); ++i) {
        prometheus::ClientMetric::Bucket bucket;
        bucket.cumulative_count = q.wait_bucket_counts[i];
        bucket.upper_bound = i < std::size(kFairWaitBucketsSeconds)
                                 ? kFairWaitBucketsSeconds[i]
                                 : std::numeric_limits<double>::infinity();
        count = q.wait_bucket_counts[i];
        metric.histogram.bucket.push_back(bucket);
      }
      metric.histogram.sample_count = count;
      metric.histogram.sample_sum = q.wait_seconds_total;
      wait.metric.push_back(std::move(metric));
    }
    out.push_back(std::move(wait));
  }

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
  // What the collector reads besides the core. Set while the exposer may
  // already scrape (a source can arrive after the metrics socket is served),
  // so a scrape copies them under the lock and calls them outside it.
  struct Sources {
    std::function<PeerPathGauges()> peer_path;
    std::function<HandoverGauges()> handover;
    std::function<GrpcConnectionStats()> grpc_connections;
    std::function<std::vector<FairQueueStats>()> scheduler;
    ServerInfo server_info;
    std::vector<std::pair<std::string, double>> limits;
  };
  template <typename F>
  void Update(F f) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    f(sources_);
  }

 private:
  Sources Snapshot() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return sources_;
  }

  mutable absl::Mutex mu_;
  Sources sources_ ABSL_GUARDED_BY(mu_);
};

void Metrics::SetServerInfo(const ServerInfo& info) {
  collector_->Update([&](CoreCollector::Sources& s) { s.server_info = info; });
}

void Metrics::SetLimits(std::vector<std::pair<std::string, double>> limits) {
  collector_->Update(
      [&](CoreCollector::Sources& s) { s.limits = std::move(limits); });
}

void Metrics::SetPeerPathSource(std::function<PeerPathGauges()> source) {
  collector_->Update(
      [&](CoreCollector::Sources& s) { s.peer_path = std::move(source); });
}

void Metrics::SetHandoverSource(std::function<HandoverGauges()> source) {
  collector_->Update(
      [&](CoreCollector::Sources& s) { s.handover = std::move(source); });
}

void Metrics::SetSchedulerSource(
    std::function<std::vector<FairQueueStats>()> source) {
  collector_->Update(
      [&](CoreCollector::Sources& s) { s.scheduler = std::move(source); });
}

void Metrics::SetGrpcConnectionsSource(
    std::function<GrpcConnectionStats()> source) {
  collector_->Update([&](CoreCollector::Sources& s) {
    s.grpc_connections = std::move(source);
  });
}

Metrics::Metrics(const core::Core* core, FdBudget* fd_budget)
    : registry_(std::make_shared<prometheus::Registry>()),
      collector_(std::make_shared<CoreCollector>(core, fd_budget)),
      process_(std::make_shared<ProcessCollector>(fd_budget)) {
  auto& started = prometheus::BuildCounter()
                      .Name("grpc_server_started_total")
                      .Help("RPCs started on the server.")
                      .Register(*registry_);
  auto& handled = prometheus::BuildCounter()
                      .Name("grpc_server_handled_total")
                      .Help("RPCs completed on the server, by status code.")
                      .Register(*registry_);
  auto& seconds = prometheus::BuildHistogram()
                      .Name("grpc_server_handling_seconds")
                      .Help(
                          "Time from an RPC's start to its status, in "
                          "seconds (a stream: its whole life).")
                      .Register(*registry_);
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::MemoryRegistration::service_full_name());
  for (int i = 0; service != nullptr && i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor& method = *service->method(i);
    const std::map<std::string, std::string> labels = {
        {"grpc_service", service->full_name()},
        {"grpc_method", method.name()},
        {"grpc_type", GrpcType(method)}};
    MethodSeries series;
    series.started = &started.Add(labels);
    for (size_t code = 0; code < kGrpcCodes; ++code) {
      std::map<std::string, std::string> with_code = labels;
      with_code["grpc_code"] = CodeName(static_cast<grpc::StatusCode>(code));
      series.handled[code] = &handled.Add(with_code);
    }
    series.seconds = &seconds.Add(labels, HandlingBuckets());
    methods_.emplace(method.name(), series);
  }
  auto& sizes = prometheus::BuildHistogram()
                    .Name("mrd_registration_size_bytes")
                    .Help("Bytes of each successful registration, by method.")
                    .Register(*registry_);
  for (const char* method :
       {"RegisterMr", "RegisterMrBatch", "BuildLam", "FastRegister"}) {
    sizes_.emplace(method, &sizes.Add({{"method", method}}, SizeBuckets()));
  }
}

Metrics::~Metrics() { StopServing(); }

namespace {

// The address to connect to for reaching the listening socket `fd` (its
// wildcard address made loopback), or nullopt.
struct SocketAddress {
  sockaddr_storage address{};
  socklen_t length = 0;
};
std::optional<SocketAddress> ConnectableAddressOf(int fd) {
  SocketAddress a;
  a.length = sizeof(a.address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a.address), &a.length) !=
      0) {
    return std::nullopt;
  }
  if (a.address.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&a.address);
    if (in->sin_addr.s_addr == htonl(INADDR_ANY)) {
      in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    }
    return a;
  }
  if (a.address.ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&a.address);
    if (IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr)) {
      in6->sin6_addr = in6addr_loopback;
    }
    return a;
  }
  return std::nullopt;
}

}  // namespace

void Metrics::StopServing() {
  // The server's thread polls its listening socket with a 2 s timeout and
  // stopping waits for that poll to end: up to 2 s at every stop, and
  // inside a handover's pause (Release). A thread of ours connects to the
  // socket every few milliseconds while the server stops, so that the poll
  // wakes soon after the server was told to stop. The socket is not shut
  // down (after a handover it is the new process's too, which takes those
  // connections and sees them closed). Without the thread (none could be
  // started) stopping only takes longer.
  std::optional<SocketAddress> address;
  if (exposer_ != nullptr && listen_fd_ >= 0) {
    address = ConnectableAddressOf(listen_fd_);
  }
  absl::Notification stopped;
  absl::StatusOr<Thread> knocker = absl::UnavailableError("not needed");
  if (address.has_value()) {
    knocker = Thread::Start("mrd-metrics-stop", [&stopped, &address] {
      do {
        UniqueFd knock(::socket(address->address.ss_family,
                                SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (knock.valid()) {
          (void)::connect(knock.get(),
                          reinterpret_cast<const sockaddr*>(&address->address),
                          address->length);
        }
      } while (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(5)));
    });
  }
  exposer_.reset();  // closes listen_fd_ (close(2) only, never shutdown)
  listen_fd_ = -1;
  stopped.Notify();
  if (knocker.ok()) knocker->Join();
}

absl::Status Metrics::ServeOn(UniqueFd listener) {
  int port = 0;
  if (!listener.valid() || !ListeningTcpPort(listener.get(), &port)) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_METRICS_LISTENER",
        absl::StrCat("inherited metrics listener fd ", listener.get(),
                     " is not a listening TCP socket"));
  }
  MRD_RETURN_IF_ERROR(Serve("127.0.0.1:0"));
  if (listen_fd_ < 0) {
    StopServing();
    return MrdError(absl::StatusCode::kInternal, "METRICS_LISTENER_NOT_FOUND",
                    "the metrics server's own listening socket was not found");
  }
  // Atomically in place of the server's own socket (which closes), keeping
  // close-on-exec.
  if (dup3(listener.get(), listen_fd_, O_CLOEXEC) < 0) {
    const int err = errno;
    StopServing();
    return ErrnoError(err, "dup3 of the inherited metrics listener",
                      "METRICS_BIND_FAILED");
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> Metrics::DuplicateListener() const {
  if (listen_fd_ < 0) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "METRICS_NOT_SERVED",
                    "metrics are not served: no listener to hand over");
  }
  UniqueFd copy(fcntl(listen_fd_, F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) {
    return ErrnoError(errno, "dup of the metrics listener", "HANDOVER_FD");
  }
  return copy;
}

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
  exposer_->RegisterCollectable(process_);
  listen_fd_ = FindListener(exposer_->GetListeningPorts().front());
  return absl::OkStatus();
}

void Metrics::OnRpcStart(absl::string_view method) {
  auto it = methods_.find(method);
  if (it != methods_.end()) it->second.started->Increment();
}

void Metrics::OnRpcDone(absl::string_view method, grpc::StatusCode code,
                        absl::Duration elapsed) {
  auto it = methods_.find(method);
  if (it == methods_.end()) return;
  const size_t index = static_cast<size_t>(code) < kGrpcCodes
                           ? static_cast<size_t>(code)
                           : static_cast<size_t>(grpc::StatusCode::UNKNOWN);
  it->second.handled[index]->Increment();
  it->second.seconds->Observe(absl::ToDoubleSeconds(elapsed));
}

void Metrics::OnRegistered(absl::string_view method, uint64_t bytes) {
  auto it = sizes_.find(method);
  if (it != sizes_.end()) it->second->Observe(static_cast<double>(bytes));
}

std::string Metrics::Render() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (const auto& collectable :
       {std::static_pointer_cast<prometheus::Collectable>(collector_),
        std::static_pointer_cast<prometheus::Collectable>(process_)}) {
    std::vector<prometheus::MetricFamily> more = collectable->Collect();
    families.insert(families.end(), more.begin(), more.end());
  }
  prometheus::TextSerializer serializer;
  return serializer.Serialize(families);
}

}  // namespace mrd::metrics
