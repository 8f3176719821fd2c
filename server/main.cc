// mrd: the node-local memory-registration service. Wires the device, the
// core, the fd socket, the gRPC server (with health and reflection) and the
// metrics exposer together, then waits for SIGTERM/SIGINT and shuts down in
// order: NOT_SERVING first, then every session is released (nothing stays
// pinned), then the servers and the device stop. SIGHUP is a reload: mrd
// starts its successor (its own binary, its arguments and --takeover), which
// takes over everything through the live handover.
//
// Every flag can also come from a flag file: mrd --flagfile=/etc/mrd/mrd.flags
// (one --name=value per line; see docs/CONFIG.md).

#include <fcntl.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <pwd.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.pb.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "mrd_revision.h"
#include "server/common/cgroup_identity.h"
#include "server/common/fair_scheduler.h"
#include "server/common/fd_budget.h"
#include "server/common/log.h"
#include "server/common/path_trust.h"
#include "server/common/prefault.h"
#include "server/common/sd_notify.h"
#include "server/common/thread.h"
#include "server/core/core.h"
#include "server/core/handover_participant.h"
#include "server/device/software/software_device.h"
#include "server/device/verbs/verbs_device.h"
#include "server/fd_socket/fd_server.h"
#include "server/fd_socket/handover_participant.h"
#include "server/handover/participant.h"
#include "server/handover/process_handover.h"
#include "server/handover/status_file.h"
#include "server/metrics/handover_participant.h"
#include "server/metrics/metrics.h"
#include "server/service/grpc_acceptor.h"
#include "server/service/handover_participants.h"
#include "server/service/service.h"

ABSL_FLAG(std::string, runtime_dir, "",
          "Directory for the sockets. Default: /run/mrd as root, else "
          "$XDG_RUNTIME_DIR/mrd, else /tmp/mrd-<uid>.");
ABSL_FLAG(std::string, grpc_socket, "",
          "gRPC Unix socket path. Default: <runtime_dir>/mrd.sock.");
ABSL_FLAG(std::string, fd_socket, "",
          "fd-passing (SOCK_SEQPACKET) socket path. Default: "
          "<runtime_dir>/fd.sock.");
ABSL_FLAG(std::string, socket_mode, "0660",
          "Permission bits (octal) of both sockets.");
ABSL_FLAG(std::string, debug_tcp_address, "",
          "Also serve gRPC on this TCP address (debugging, e.g. "
          "127.0.0.1:50051). Loopback addresses only. Empty = off.");
ABSL_FLAG(std::string, device, "auto",
          "RDMA device: software, verbs or auto (verbs where a device exists, "
          "else software).");
ABSL_FLAG(std::string, peer_address, "127.0.0.1:7471",
          "Where remote peers connect (numeric host:port; port 0 = any free "
          "port). Software device: the TCP listener. Verbs device: the "
          "rdma_cm listener, an address of the RDMA device's interface "
          "(e.g. 10.77.0.1:0).");
ABSL_FLAG(std::string, pin_method, "auto",
          "Software device: how pages are pinned. io_uring (fixed buffers: no "
          "memory map per pin), mlock (splits a memory map per pinned "
          "range), or auto (io_uring where the kernel allows it, mlock for "
          "read-only buffers and when io_uring is unavailable).");
ABSL_FLAG(uint64_t, pin_max_map_splits, 0,
          "Software device: memory maps (VMAs) mlock pinning may split, "
          "beyond which pins are refused with LIMIT_MEMORY_MAPS. 0 = half of "
          "what vm.max_map_count leaves at start.");
ABSL_FLAG(uint32_t, peer_max_connections, 4096,
          "Software device: peer TCP connections open at once; past it a new "
          "one sheds the oldest connection that has not said hello, or is "
          "refused.");
ABSL_FLAG(uint32_t, peer_max_unauthenticated, 256,
          "Software device: peer connections before hello; past it the oldest "
          "such connection is closed to admit the new one.");
ABSL_FLAG(uint32_t, peer_max_session_connections, 1024,
          "Software device: peer connections bound to one session; past it "
          "hello gets LIMIT_PEER_CONNECTIONS.");
ABSL_FLAG(absl::Duration, peer_hello_timeout, absl::Seconds(5),
          "Software device: a peer connection without a successful hello by "
          "then is closed.");
ABSL_FLAG(absl::Duration, peer_stall_timeout, absl::Seconds(30),
          "Software device: a peer connection making no progress inside a "
          "frame (or a response) for this long is closed.");
ABSL_FLAG(uint64_t, peer_buffer_bytes, uint64_t{256} << 20,
          "Software device: memory for peer frames of all connections "
          "together; when reached, frame bodies wait unread.");
ABSL_FLAG(uint32_t, peer_workers, 4,
          "Software device: threads handling peer requests (fixed; no thread "
          "per connection).");
ABSL_FLAG(std::string, verbs_device, "",
          "Verbs device: the RDMA device to use (e.g. mlx5_0, rxe0); empty = "
          "the one --peer_address belongs to. When set, --peer_address must "
          "be on it.");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9464",
          "Serve Prometheus metrics at http://<address>/metrics. Empty = off.");
ABSL_FLAG(std::string, shm_dir, "/dev/shm/mrd",
          "Shared-memory directory for ImportFile (lease sessions). Empty = "
          "off.");
ABSL_FLAG(std::vector<std::string>, allowed_uids, {},
          "Peer uids allowed on the fd socket and as owners of ImportFile "
          "files. Default: mrd's own effective uid.");
ABSL_FLAG(std::vector<std::string>, allowed_gids, {},
          "Peer gids allowed on the fd socket.");
ABSL_FLAG(bool, allow_any_peer, false,
          "Allow any local uid on the fd socket (the socket mode still "
          "applies).");
ABSL_FLAG(uint64_t, max_sessions, 1024, "Open sessions at most.");
ABSL_FLAG(uint64_t, fd_reserve, 0,
          "File descriptors no client can make mrd use (kept for gRPC, "
          "peers, metrics, logs, the device). 0 = max(256, limit/8), at most "
          "3/4 of the open-file limit (RLIMIT_NOFILE, raised to the hard "
          "limit at start).");
ABSL_FLAG(uint64_t, grpc_max_connections, 0,
          "gRPC connections (on --grpc_socket) mrd holds at most; more are "
          "refused with an HTTP/2 GOAWAY naming LIMIT_GRPC_CONNECTIONS. 0 = "
          "half the fd reserve.");
ABSL_FLAG(uint64_t, grpc_max_connections_per_tenant, 0,
          "gRPC connections one client tenant (its pod, container or uid, as "
          "--tenant_key says) may hold; more are refused "
          "(LIMIT_TENANT_GRPC_CONNECTIONS). 0 = --tenant_default_percent of "
          "--grpc_max_connections.");
ABSL_FLAG(uint64_t, max_session_fds, 0,
          "File descriptors (imported buffers) one session may make mrd "
          "hold. 0 = min(4096, budget/4), budget = limit - fd_reserve.");
ABSL_FLAG(uint64_t, max_buffer_size, uint64_t{1} << 40,
          "Largest buffer (bytes) a session may import.");
ABSL_FLAG(uint64_t, max_session_pinned_bytes, uint64_t{4} << 30,
          "Bytes one session may have pinned.");
ABSL_FLAG(uint64_t, max_total_pinned_bytes, uint64_t{16} << 30,
          "Bytes all sessions together may have pinned.");
ABSL_FLAG(uint64_t, max_session_registrations, 65536,
          "Registrations one session may hold.");
ABSL_FLAG(uint64_t, max_total_registrations, uint64_t{1} << 20,
          "Registrations all sessions together may hold.");
ABSL_FLAG(uint64_t, max_total_buffers, 32768,
          "Buffers all sessions together may hold (each holds an fd and a "
          "memory map).");
ABSL_FLAG(uint64_t, max_total_lams, 262144,
          "LAMs all sessions together may hold (each holds a device key).");
ABSL_FLAG(uint64_t, max_total_mrs, 262144,
          "MR objects all sessions together may hold (each holds a device "
          "key).");
ABSL_FLAG(uint64_t, max_batch_items, 4096,
          "Items one RegisterMrBatch or DeregisterMrBatch may carry.");
ABSL_FLAG(std::string, tenants_file, "",
          "Named tenants and their quotas, one per line: tenant <name> "
          "uids=<uid>[,...] [sessions=N] [buffers=N] [registrations=N] "
          "[pinned_bytes=N[K|M|G|T]] [lams=N] [mrs=N] [peer_connections=N]. "
          "Other uids are tenants of their own (uid:<uid>); lease sessions "
          "nobody vouched for are the tenant 'anonymous'. Empty = none named.");
ABSL_FLAG(uint32_t, tenant_default_percent, 25,
          "A tenant's default quota of each resource, in percent of the "
          "server's total of it (1-100).");
ABSL_FLAG(uint64_t, warm_pin_bytes_per_session, uint64_t{256} << 20,
          "Bytes of released registrations one session may keep pinned "
          "(without any key) so that registering them again is cheap; they "
          "count towards the pinned-bytes limits and give way to new pins. "
          "0 = off.");
ABSL_FLAG(uint64_t, warm_pin_bytes_total, uint64_t{1} << 30,
          "Bytes of warm pins all sessions together may keep. 0 = off.");
ABSL_FLAG(absl::Duration, lease_ttl, absl::Seconds(60),
          "Default lease TTL of OpenLeaseSession.");
ABSL_FLAG(absl::Duration, max_lease_ttl, absl::Hours(24),
          "Longest lease TTL a client may ask for.");
ABSL_FLAG(int, worker_threads, 4,
          "Threads that run registration work off the gRPC threads, shared "
          "fairly between tenants (each tenant's requests wait in a queue of "
          "its own, served by deficit round robin weighted by the tenant's "
          "weight; a tenant holds at most its share while others wait).");
ABSL_FLAG(int, spare_worker_threads, -1,
          "Threads beyond --worker_threads that start only a request of a "
          "tenant holding less than its share while every worker is busy "
          "with other tenants' work. -1 = as many as --worker_threads.");
ABSL_FLAG(bool, fair_scheduling, true,
          "Share the workers fairly between tenants. false: one queue, first "
          "come first served, no spare threads (for comparison only).");
ABSL_FLAG(std::string, tenant_key, "pod",
          "What a client's tenant is keyed by: pod (its Kubernetes pod, from "
          "the cgroup of its process; a container outside Kubernetes is its "
          "container, a process in none its uid), container, or uid.");
ABSL_FLAG(std::string, kubelet_pod_logs_dir, "/var/log/pods",
          "The kubelet's pod log directory (<namespace>_<name>_<uid> per "
          "pod), where a client pod's namespace and name are read when the "
          "tenants file names pods as <namespace>/<name>.");
ABSL_FLAG(std::string, admin_socket, "",
          "The administrative gRPC socket (mrd.v1.TenantAdmin), mode 0600, "
          "for root and mrd's own uid only. Default: <runtime_dir>/admin.sock; "
          "'none' = no administrative socket.");
ABSL_FLAG(uint32_t, prefault_threads, mrd::kDefaultPrefaultThreads,
          "Threads (at most the online CPUs) that fill mrd's page tables "
          "before a registration or LAM of 32 MiB or more is pinned; 0 = "
          "off (the pin faults the pages in itself).");
ABSL_FLAG(absl::Duration, progress_after, absl::Seconds(1),
          "A registration of 32 MiB or more still pinning after this long "
          "reports its progress (REGISTRATION_PROGRESS) on its session's "
          "completion stream...");
ABSL_FLAG(absl::Duration, progress_interval, absl::Seconds(1),
          "...and again every this long until it answers (at least 1ms).");
ABSL_FLAG(bool, takeover, false,
          "Take over from the mrd serving this runtime directory (live "
          "handover: every session, buffer and registration goes on with "
          "its keys; docs/ARCHITECTURE.md). When none serves, start fresh. A "
          "takeover that fails leaves the running mrd serving, and this one "
          "exits 1 saying why.");
ABSL_FLAG(std::string, handover_socket, "",
          "Where this mrd listens for a new mrd taking over, and where "
          "--takeover looks for the running one. Default: "
          "<runtime_dir>/handover.sock (mode 0600, own uid only).");
ABSL_FLAG(absl::Duration, handover_drain_timeout, absl::Seconds(10),
          "Handing over: how long requests in flight may take to finish "
          "before the handover is refused (HANDOVER_BUSY) and this mrd "
          "serves on.");
ABSL_FLAG(absl::Duration, handover_timeout, absl::Seconds(60),
          "Handing over: how long each side waits for each answer of the "
          "other, and how long --takeover keeps asking a running mrd that "
          "says it is busy (HANDOVER_BUSY).");
ABSL_FLAG(std::string, after_handover, "exit",
          "What this mrd does once it has handed over: exit (exit 0 at "
          "once; the kernel drops this process's own pins and mappings) "
          "or wait (release everything, hold nothing, NOT_SERVING, until "
          "SIGTERM or SIGINT, then exit 0; for Kubernetes, where an exited "
          "container would be restarted and take over back).");
ABSL_FLAG(std::string, handover_status_file, "",
          "Write this mrd's handover state to this file, one word: "
          "taking-over, serving, handing-over, handed-over, stopping or "
          "stopped (Kubernetes probes and --await_handover read it; a file "
          "of this mrd alone, e.g. in a per-pod emptyDir). Empty = none.");
ABSL_FLAG(absl::Duration, await_handover, absl::ZeroDuration(),
          "Do not serve: wait at most this long until the mrd writing "
          "--handover_status_file is not in the middle of a handover "
          "(neither taking-over nor handing-over), then exit 0; exit 1 "
          "when it still is (a Kubernetes preStop hook). 0 = off.");
ABSL_FLAG(std::string, handover_test_fault, "",
          "Tests only: fail the handover at this step (server/handover/"
          "handover.h lists them).");
ABSL_FLAG(bool, verbose, false, "Log debug lines.");

namespace mrd {
namespace {

// Readiness: the health service name that follows the device ("" is
// liveness: the process serves).
constexpr char kServiceName[] = "mrd.v1.MemoryRegistration";
// How often tenants that hold nothing and have no session are forgotten.
constexpr absl::Duration kTenantPruneInterval = absl::Seconds(30);

// Whether this process may lock memory beyond RLIMIT_MEMLOCK: CAP_IPC_LOCK
// (bit 14) in its effective set (/proc/self/status, CapEff).
bool HasIpcLock() {
  const int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[4096];
  const ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return false;
  for (absl::string_view line :
       absl::StrSplit(absl::string_view(buf, static_cast<size_t>(n)), '\n')) {
    uint64_t caps = 0;
    if (absl::ConsumePrefix(&line, "CapEff:") &&
        absl::SimpleHexAtoi(absl::StripAsciiWhitespace(line), &caps)) {
      return (caps & (uint64_t{1} << 14)) != 0;
    }
  }
  return false;
}

// Warns, naming the fix, when mrd will not be able to pin what its limits
// allow: without CAP_IPC_LOCK the kernel charges every pinned page (mlock
// and io_uring fixed buffers alike) to RLIMIT_MEMLOCK, and registrations
// past it fail with PIN_FAILED.
void WarnIfMemlockTooLow(uint64_t max_total_pinned_bytes) {
  rlimit memlock{};
  if (getrlimit(RLIMIT_MEMLOCK, &memlock) != 0) return;
  if (memlock.rlim_cur == RLIM_INFINITY || HasIpcLock()) return;
  if (memlock.rlim_cur >= max_total_pinned_bytes) return;
  LogWarning("RLIMIT_MEMLOCK is ", memlock.rlim_cur,
             " bytes and mrd lacks CAP_IPC_LOCK, so it can pin only that much, "
             "less than --max_total_pinned_bytes=",
             max_total_pinned_bytes,
             ": registrations beyond it will fail with PIN_FAILED. Run mrd as "
             "root, or give it CAP_IPC_LOCK (Kubernetes: capabilities add "
             "IPC_LOCK; systemd: AmbientCapabilities=CAP_IPC_LOCK; by hand: "
             "setcap cap_ipc_lock+ep mrd), or raise the limit (ulimit -l "
             "unlimited; systemd: LimitMEMLOCK=infinity), or lower "
             "--max_total_pinned_bytes.");
}

std::string DefaultRuntimeDir() {
  if (geteuid() == 0) return "/run/mrd";
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg && *xdg) {
    return absl::StrCat(xdg, "/mrd");
  }
  return absl::StrCat("/tmp/mrd-", geteuid());
}

absl::StatusOr<std::vector<uint32_t>> ParseIds(
    const std::vector<std::string>& values, absl::string_view flag) {
  std::vector<uint32_t> ids;
  for (const std::string& v : values) {
    if (v.empty()) continue;
    uint32_t id;
    if (!absl::SimpleAtoi(v, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", v, "' is not a numeric id"));
    }
    ids.push_back(id);
  }
  return ids;
}

// A configuration file of at most 1 MiB.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return absl::NotFoundError(std::strerror(errno));
  std::string text;
  char chunk[4096];
  for (;;) {
    ssize_t n = ::read(fd.get(), chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::UnavailableError(std::strerror(errno));
    if (n == 0) break;
    text.append(chunk, static_cast<size_t>(n));
    if (text.size() > (size_t{1} << 20)) {
      return absl::InvalidArgumentError("larger than 1 MiB");
    }
  }
  return text;
}

// Software-device key slots that cover the core's global limits.
uint64_t SoftwareKeySlots(uint64_t registrations, uint64_t lams, uint64_t mrs) {
  constexpr uint64_t kHuge = uint64_t{1} << 40;  // no overflow below
  if (registrations > kHuge || lams > kHuge || mrs > kHuge) return kHuge;
  return registrations + lams + mrs;
}

bool IsLoopback(const std::string& address) {
  return absl::StartsWith(address, "127.") ||
         absl::StartsWith(address, "[::1]:") ||
         absl::StartsWith(address, "localhost:");
}

// Everything mrd runs, in the order it starts (and, reversed, the order the
// members are destroyed in when a start fails part-way). Each step returns
// the error to log, with the text that names the flag or path at fault.
// A live handover is the process handover's (server/handover); the daemon
// hands it the pieces that take part, and takes part itself with the gRPC
// server, health and admin socket it runs (Retire).
class Daemon final : public handover::Participant {
 public:
  // How this mrd was started, for the successor a reload starts.
  struct Invocation {
    std::string binary;      // absolute; empty when it could not be resolved...
    std::string unresolved;  // ...and why
    std::vector<std::string> args;  // argv[1..]
  };
  explicit Daemon(Invocation invocation)
      : status_(absl::GetFlag(FLAGS_handover_status_file)),
        invocation_(std::move(invocation)) {}
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  absl::Status Start();
  // Serves until SIGINT or SIGTERM, then shuts down in order. SIGHUP starts
  // a successor (Reload), SIGCHLD tells that it ended. All four are blocked
  // in every thread and taken here (`signals`).
  void ServeUntil(const sigset_t& signals);
  // Writes `state` to --handover_status_file (if set): taking-over,
  // serving, handing-over, handed-over, stopping, stopped.
  void WriteStatus(absl::string_view state) { status_.Write(state); }

 private:
  absl::Status PrepareFdBudget();
  absl::Status PreparePaths();
  absl::Status PreparePeers();
  absl::Status ChooseDevice();
  // --takeover: asks the running mrd to hand over (the device opens on
  // its peer listener meanwhile).
  absl::Status BeginTakeover();
  // SIGHUP: starts the successor, mrd --takeover with this mrd's binary and
  // arguments; it takes over through the handover socket like any other.
  void Reload();
  // SIGCHLD: reaps the successor once it ended (it could not take over:
  // this mrd serves on, and says so).
  void ReapSuccessor();

  // Committed: clients' channels hear GOAWAY, the server and the health
  // watch stop, the admin socket closes (its path is the new process's).
  void Retire() override;

  // `peer_listener`: taking over, the running mrd's.
  absl::Status OpenDevice(UniqueFd peer_listener = UniqueFd());
  absl::Status OpenVerbsDevice(const std::string& device_flag);
  absl::Status OpenSoftwareDevice(UniqueFd peer_listener);
  absl::Status StartCore();
  void SetCoreLimits();
  absl::Status SetTenants();
  absl::Status StartFdSocket();
  absl::Status ListenGrpc();
  absl::Status StartMetrics();
  void SetMetricsSources();
  absl::Status StartGrpc();
  absl::Status StartAdmin();
  // `handed_over`: the new process serves the admin socket's path (or is
  // about to bind it), so the socket file is left alone.
  void StopAdmin(bool handed_over = false);
  absl::Status StartHealthWatch();
  void WatchHealth();

  std::unique_ptr<FdBudget> fd_budget_;
  std::string runtime_dir_;
  std::string grpc_socket_;
  std::string fd_socket_;
  std::string shm_dir_;
  mode_t socket_mode_ = 0;
  std::vector<uint32_t> uids_;
  std::vector<uint32_t> gids_;
  std::string debug_tcp_;
  device::PinMethod pin_method_{};
  std::unique_ptr<device::Device> device_;
  device::SoftwareDevice* software_device_ = nullptr;  // owned by device_
  bool use_verbs_ = false;
  bool device_fallback_ = false;  // auto: RDMA devices, software device
  core::CoreOptions core_options_;
  std::unique_ptr<core::Core> core_;
  // Replaced only by a handover that failed (the fd socket's Thaw).
  std::unique_ptr<fd_socket::FdServer> fd_server_;
  service::GrpcAcceptorOptions acceptor_options_;
  // The gRPC socket's acceptor, replaced only by a handover that failed.
  service::GrpcAcceptorParticipant acceptor_;
  // Readiness's view of the device (the health watch keeps it; the metrics
  // read it, so it outlives them).
  std::atomic<bool> device_healthy_{true};
  std::unique_ptr<metrics::Metrics> metrics_;
  std::unique_ptr<FairScheduler> workers_;
  std::unique_ptr<service::MrdService> service_;
  std::unique_ptr<grpc::Server> server_;
  // The administrative service (tenants' quotas and weights) on a server
  // and socket of its own.
  std::string admin_socket_;
  std::unique_ptr<service::AdminService> admin_service_;
  std::unique_ptr<grpc::Server> admin_server_;
  std::unique_ptr<service::GrpcAcceptor> admin_acceptor_;
  grpc::HealthCheckServiceInterface* health_ = nullptr;
  absl::Notification stop_health_;
  Thread health_watch_;

  // Live handover: the pieces that take part, in the order they freeze
  // (server/handover/participant.h), and the handover that runs them.
  std::string handover_socket_;
  handover::StatusFile status_;  // --handover_status_file
  service::CallGateParticipant gate_handover_{
      absl::GetFlag(FLAGS_handover_drain_timeout)};
  fd_socket::FdSocketParticipant fd_handover_;
  core::CoreParticipant core_handover_{
      absl::GetFlag(FLAGS_handover_drain_timeout)};
  metrics::MetricsParticipant metrics_handover_;
  std::unique_ptr<handover::ProcessHandover> handover_;

  // Reload (main thread only): the successor while it runs, or 0.
  const Invocation invocation_;
  pid_t successor_ = 0;
};

absl::Status Fail(absl::string_view message) {
  return absl::InternalError(message);
}

absl::Status Daemon::Start() {
  const std::string after = absl::GetFlag(FLAGS_after_handover);
  if (after != "exit" && after != "wait") {
    return Fail(absl::StrCat("--after_handover must be exit or wait, not '",
                             after, "'"));
  }
  if (absl::GetFlag(FLAGS_takeover)) WriteStatus("taking-over");
  MRD_RETURN_IF_ERROR(PrepareFdBudget());
  MRD_RETURN_IF_ERROR(PreparePaths());
  MRD_RETURN_IF_ERROR(PreparePeers());
  ConfigurePrefault(absl::GetFlag(FLAGS_prefault_threads));
  MRD_RETURN_IF_ERROR(ChooseDevice());
  handover::ProcessHandoverOptions options;
  options.socket = handover_socket_;
  options.mrd_version = MRD_VERSION;
  options.timeout = absl::GetFlag(FLAGS_handover_timeout);
  options.fault = absl::GetFlag(FLAGS_handover_test_fault);
  options.stay = after == "wait";
  options.status = &status_;
  options.pinned_bytes = [this] { return device_->PinnedBytes(); };
  handover_ = std::make_unique<handover::ProcessHandover>(
      std::move(options), std::vector<handover::Participant*>{
                              &gate_handover_, &fd_handover_, &acceptor_,
                              &core_handover_, &metrics_handover_, this});
  if (absl::GetFlag(FLAGS_takeover)) MRD_RETURN_IF_ERROR(BeginTakeover());
  // Taking over, the device opened before the old process paused.
  if (device_ == nullptr) MRD_RETURN_IF_ERROR(OpenDevice());
  MRD_RETURN_IF_ERROR(StartCore());
  const bool taking_over = handover_->taking_over();
  if (taking_over) MRD_RETURN_IF_ERROR(handover_->AdoptAndCommit());
  MRD_RETURN_IF_ERROR(StartFdSocket());
  MRD_RETURN_IF_ERROR(ListenGrpc());
  MRD_RETURN_IF_ERROR(StartMetrics());
  MRD_RETURN_IF_ERROR(StartGrpc());
  MRD_RETURN_IF_ERROR(StartHealthWatch());
  handover_->Listen();
  handover_->EndTakeover();
  WriteStatus("serving");
  // systemd (Type=notify): serving now; after a takeover, this is the main
  // process (the old one says so too, at commit, before it exits).
  absl::Status notified =
      SdNotify(taking_over ? absl::StrCat("MAINPID=", getpid(), "\nREADY=1")
                           : "READY=1");
  if (!notified.ok()) LogWarning("sd_notify: ", notified.ToString());
  return absl::OkStatus();
}

// File descriptors (docs/RELIABILITY.md): the highest open-file limit we may
// have, and a budget for clients that leaves a reserve for mrd itself.
absl::Status Daemon::PrepareFdBudget() {
  absl::StatusOr<NofileLimits> nofile = RaiseNofileLimit();
  if (!nofile.ok()) {
    return Fail(absl::StrCat("open-file limit: ", nofile.status().ToString()));
  }
  FdBudgetOptions options;
  options.limit = nofile->soft;
  options.reserve = absl::GetFlag(FLAGS_fd_reserve);
  options.per_owner = absl::GetFlag(FLAGS_max_session_fds);
  options.per_owner_cap = core::CoreOptions().max_buffers_per_session;
  absl::StatusOr<std::unique_ptr<FdBudget>> budget = FdBudget::Create(options);
  if (!budget.ok()) {
    return Fail(absl::StrCat("--fd_reserve: ", budget.status().message()));
  }
  fd_budget_ = std::move(*budget);
  return absl::OkStatus();
}

// Directories someone else could change are refused (docs/RELIABILITY.md,
// "Runtime directory and shm_dir"): whoever can rename our sockets can
// listen in their place and be handed our clients' memory.
absl::Status Daemon::PreparePaths() {
  runtime_dir_ = absl::GetFlag(FLAGS_runtime_dir);
  if (runtime_dir_.empty()) runtime_dir_ = DefaultRuntimeDir();
  absl::StatusOr<std::string> trusted =
      PrepareRuntimeDir(runtime_dir_, geteuid());
  if (!trusted.ok()) {
    return Fail(absl::StrCat("refusing to start: runtime dir ", runtime_dir_,
                             ": ", trusted.status().message()));
  }
  runtime_dir_ = *std::move(trusted);
  grpc_socket_ = absl::GetFlag(FLAGS_grpc_socket);
  fd_socket_ = absl::GetFlag(FLAGS_fd_socket);
  handover_socket_ = absl::GetFlag(FLAGS_handover_socket);
  for (std::string* socket : {&grpc_socket_, &fd_socket_, &handover_socket_}) {
    if (socket->empty()) continue;
    absl::StatusOr<std::string> checked = CheckSocketPath(*socket, geteuid());
    if (!checked.ok()) {
      return Fail(absl::StrCat("refusing to start: socket ", *socket, ": ",
                               checked.status().message()));
    }
    *socket = *std::move(checked);
  }
  if (handover_socket_.empty()) {
    handover_socket_ = runtime_dir_ + "/handover.sock";
  }
  if (grpc_socket_.empty()) grpc_socket_ = runtime_dir_ + "/mrd.sock";
  admin_socket_ = absl::GetFlag(FLAGS_admin_socket);
  if (admin_socket_.empty()) admin_socket_ = runtime_dir_ + "/admin.sock";
  if (admin_socket_ == "none") admin_socket_.clear();
  if (fd_socket_.empty()) fd_socket_ = runtime_dir_ + "/fd.sock";
  shm_dir_ = absl::GetFlag(FLAGS_shm_dir);
  if (!shm_dir_.empty()) {
    // Created if missing (sticky and world-writable, like /dev/shm), so that
    // `make run` works on a fresh machine; refused off tmpfs/hugetlbfs.
    absl::StatusOr<std::string> shm = PrepareShmDir(shm_dir_, geteuid());
    if (!shm.ok()) {
      return Fail(absl::StrCat("refusing to start: --shm_dir ", shm_dir_, ": ",
                               shm.status().message()));
    }
    shm_dir_ = *std::move(shm);
  }
  socket_mode_ = static_cast<mode_t>(
      std::strtoul(absl::GetFlag(FLAGS_socket_mode).c_str(), nullptr, 8));
  return absl::OkStatus();
}

// Who may use the sockets.
absl::Status Daemon::PreparePeers() {
  absl::StatusOr<std::vector<uint32_t>> uids =
      ParseIds(absl::GetFlag(FLAGS_allowed_uids), "allowed_uids");
  absl::StatusOr<std::vector<uint32_t>> gids =
      ParseIds(absl::GetFlag(FLAGS_allowed_gids), "allowed_gids");
  if (!uids.ok() || !gids.ok()) {
    return Fail(!uids.ok() ? uids.status().message() : gids.status().message());
  }
  uids_ = *std::move(uids);
  gids_ = *std::move(gids);
  if (uids_.empty() && gids_.empty() && !absl::GetFlag(FLAGS_allow_any_peer)) {
    uids_.push_back(geteuid());
  }
  debug_tcp_ = absl::GetFlag(FLAGS_debug_tcp_address);
  if (!debug_tcp_.empty() && !IsLoopback(debug_tcp_)) {
    return Fail(absl::StrCat(
        "--debug_tcp_address=", debug_tcp_,
        " is not a loopback address; the debug listener has no "
        "authentication and may only listen on 127.0.0.0/8 or [::1]"));
  }
  return absl::OkStatus();
}

absl::Status Daemon::ChooseDevice() {
  const std::string device_flag = absl::GetFlag(FLAGS_device);
  if (device_flag != "software" && device_flag != "auto" &&
      device_flag != "verbs") {
    return Fail(absl::StrCat("--device must be software, verbs or auto, not '",
                             device_flag, "'"));
  }
  absl::StatusOr<device::PinMethod> pin_method =
      device::ParsePinMethod(absl::GetFlag(FLAGS_pin_method));
  if (!pin_method.ok()) {
    return Fail(absl::StrCat("--pin_method: ", pin_method.status().message()));
  }
  pin_method_ = *pin_method;
  use_verbs_ = device_flag == "verbs";
  if (device_flag == "auto") {
    std::vector<std::string> verbs_devices = device::ListVerbsDevices();
    use_verbs_ = !verbs_devices.empty();
    LogInfo("device auto: ",
            use_verbs_ ? absl::StrCat("RDMA device(s) ",
                                      absl::StrJoin(verbs_devices, ", "),
                                      " found; using the verbs device")
                       : "no RDMA device found; using the software device");
  }
  return absl::OkStatus();
}

absl::Status Daemon::OpenDevice(UniqueFd peer_listener) {
  const std::string device_flag = absl::GetFlag(FLAGS_device);
  if (use_verbs_) MRD_RETURN_IF_ERROR(OpenVerbsDevice(device_flag));
  if (!use_verbs_) {
    MRD_RETURN_IF_ERROR(OpenSoftwareDevice(std::move(peer_listener)));
  }
  core_handover_.SetDevice(device_.get());
  if (handover_->taking_over()) {
    // Taking over: no peer is accepted before commit, when every ticket
    // and key is this process's (AdoptSnapshot resumes accepting).
    (void)device_->StopPeerAccepting();
  }
  const std::string kind = device_->Attributes().kind;
  if (absl::Status s = device_->Start(); !s.ok()) {
    return Fail(absl::StrCat(kind, " device start: ", s.ToString()));
  }
  LogInfo("device: ", kind, " (", device_->Attributes().name,
          "), peers connect to ", device_->Attributes().peer_address);
  return absl::OkStatus();
}

// The verbs device; under --device=auto a failure falls back to the
// software device (use_verbs_ false), loudly.
absl::Status Daemon::OpenVerbsDevice(const std::string& device_flag) {
  device::VerbsDeviceOptions options;
  options.device_name = absl::GetFlag(FLAGS_verbs_device);
  options.peer_address = absl::GetFlag(FLAGS_peer_address);
  absl::StatusOr<std::unique_ptr<device::VerbsDevice>> verbs =
      device::VerbsDevice::Create(options);
  if (verbs.ok()) {
    device_ = std::move(*verbs);
    return absl::OkStatus();
  }
  if (device_flag == "verbs") {
    return Fail(absl::StrCat("verbs device: ", verbs.status().ToString()));
  }
  // Loud: remote peers that use RDMA cannot reach this node's memory now
  // (mrd_device_fallback says so to alerts).
  LogError(
      "device auto: this node has RDMA devices but the verbs device "
      "failed (",
      verbs.status().ToString(),
      "); FALLING BACK TO THE SOFTWARE DEVICE: RDMA peers cannot "
      "reach registrations. Fix the device or run --device=verbs "
      "to fail instead.");
  use_verbs_ = false;
  device_fallback_ = true;
  return absl::OkStatus();
}

absl::Status Daemon::OpenSoftwareDevice(UniqueFd peer_listener) {
  device::SoftwareDeviceOptions options;
  options.peer_listen_address = absl::GetFlag(FLAGS_peer_address);
  options.pin_options.method = pin_method_;
  options.pin_options.max_map_splits = absl::GetFlag(FLAGS_pin_max_map_splits);
  // The key space covers everything the core's global limits allow, so no
  // session can exhaust it (docs/RELIABILITY.md, "Key space"); the table
  // grows only as keys are taken.
  const uint64_t key_slots = SoftwareKeySlots(
      absl::GetFlag(FLAGS_max_total_registrations),
      absl::GetFlag(FLAGS_max_total_lams), absl::GetFlag(FLAGS_max_total_mrs));
  if (key_slots > device::KeyTable::kMaxSlots) {
    return Fail(absl::StrCat(
        "refusing to start: --max_total_registrations plus LAMs and "
        "fast-register MRs (",
        key_slots, ") exceeds the software device's ",
        device::KeyTable::kMaxSlots, " memory keys"));
  }
  options.max_keys = static_cast<uint32_t>(key_slots);
  options.max_connections = absl::GetFlag(FLAGS_peer_max_connections);
  options.max_unauthenticated_connections =
      absl::GetFlag(FLAGS_peer_max_unauthenticated);
  options.max_session_connections =
      absl::GetFlag(FLAGS_peer_max_session_connections);
  options.peer_hello_timeout = absl::GetFlag(FLAGS_peer_hello_timeout);
  options.peer_stall_timeout = absl::GetFlag(FLAGS_peer_stall_timeout);
  options.peer_buffer_bytes = absl::GetFlag(FLAGS_peer_buffer_bytes);
  options.peer_workers = absl::GetFlag(FLAGS_peer_workers);
  // Taking over: the running mrd's peer listener, on the same port (the
  // device keeps a duplicate).
  if (handover_->taking_over()) {
    options.inherited_peer_listener = peer_listener.get();
  }
  absl::StatusOr<std::unique_ptr<device::SoftwareDevice>> software =
      device::SoftwareDevice::Create(options);
  if (!software.ok()) {
    return Fail(
        absl::StrCat("software device: ", software.status().ToString()));
  }
  software_device_ = software->get();
  device_ = std::move(*software);
  return absl::OkStatus();
}

absl::Status Daemon::StartCore() {
  SetCoreLimits();
  MRD_RETURN_IF_ERROR(SetTenants());
  // Who can reach the gRPC socket is who an anonymous lease session may be:
  // ImportFile opens for it only what such a caller could open itself.
  if (!debug_tcp_.empty() || (socket_mode_ & S_IWOTH) != 0) {
    core_options_.anonymous_reach = core::CoreOptions::Reach::kAnyone;
  } else if ((socket_mode_ & S_IWGRP) != 0) {
    core_options_.anonymous_reach = core::CoreOptions::Reach::kGroupMember;
    core_options_.anonymous_id = getegid();
  } else {
    core_options_.anonymous_reach = core::CoreOptions::Reach::kUser;
    core_options_.anonymous_id = geteuid();
  }
  WarnIfMemlockTooLow(core_options_.max_total_pinned_bytes);
  core_ = std::make_unique<core::Core>(device_.get(), RealClock::Get(),
                                       core_options_);
  core_handover_.SetCore(core_.get());
  if (absl::Status s = core_->Start(); !s.ok()) {
    return Fail(absl::StrCat("core: ", s.ToString()));
  }
  return absl::OkStatus();
}

void Daemon::SetCoreLimits() {
  core::CoreOptions& o = core_options_;
  o.shm_dir = shm_dir_;
  o.allowed_uids = uids_;
  o.default_lease_ttl = absl::GetFlag(FLAGS_lease_ttl);
  o.max_lease_ttl = absl::GetFlag(FLAGS_max_lease_ttl);
  o.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  o.max_buffer_size = absl::GetFlag(FLAGS_max_buffer_size);
  o.max_session_pinned_bytes = absl::GetFlag(FLAGS_max_session_pinned_bytes);
  o.max_total_pinned_bytes = absl::GetFlag(FLAGS_max_total_pinned_bytes);
  o.max_session_registrations = absl::GetFlag(FLAGS_max_session_registrations);
  o.max_total_registrations = absl::GetFlag(FLAGS_max_total_registrations);
  o.warm_pin_bytes_per_session =
      absl::GetFlag(FLAGS_warm_pin_bytes_per_session);
  o.warm_pin_bytes_total = absl::GetFlag(FLAGS_warm_pin_bytes_total);
  o.fd_budget = fd_budget_.get();
  if (!device_->Attributes().shares_pins && o.warm_pin_bytes_total != 0) {
    // Measured (docs/PERFORMANCE.md): on a device that pins per registration
    // a warm pin is one more registration and makes re-registering slower.
    LogInfo("device ", device_->Attributes().name,
            " pins per registration: warm pins are off");
    o.warm_pin_bytes_per_session = 0;
    o.warm_pin_bytes_total = 0;
  }
  o.max_total_buffers = absl::GetFlag(FLAGS_max_total_buffers);
  o.max_total_lams = absl::GetFlag(FLAGS_max_total_lams);
  o.max_total_mrs = absl::GetFlag(FLAGS_max_total_mrs);
  o.max_batch_items = absl::GetFlag(FLAGS_max_batch_items);
  o.progress.after = absl::GetFlag(FLAGS_progress_after);
  o.progress.interval = absl::GetFlag(FLAGS_progress_interval);
}

// Tenants: quotas are shares of the totals unless the file names them.
absl::Status Daemon::SetTenants() {
  core::TenantTableOptions options;
  options.default_percent = absl::GetFlag(FLAGS_tenant_default_percent);
  auto total = [&](core::TenantResource r) -> uint64_t& {
    return options.totals[static_cast<int>(r)];
  };
  total(core::TenantResource::kSessions) = core_options_.max_sessions;
  total(core::TenantResource::kBuffers) = core_options_.max_total_buffers;
  total(core::TenantResource::kRegistrations) =
      core_options_.max_total_registrations;
  total(core::TenantResource::kPinnedBytes) =
      core_options_.max_total_pinned_bytes;
  total(core::TenantResource::kLams) = core_options_.max_total_lams;
  total(core::TenantResource::kMrs) = core_options_.max_total_mrs;
  total(core::TenantResource::kPeerConnections) =
      absl::GetFlag(FLAGS_peer_max_connections);
  // The device's budget of memory maps (0: its pins cost none).
  total(core::TenantResource::kMemoryMaps) =
      device_->Attributes().max_map_splits;
  std::string text;
  const std::string path = absl::GetFlag(FLAGS_tenants_file);
  if (!path.empty()) {
    absl::StatusOr<std::string> read = ReadSmallFile(path);
    if (!read.ok()) {
      return Fail(
          absl::StrCat("--tenants_file=", path, ": ", read.status().message()));
    }
    text = std::move(*read);
  }
  absl::StatusOr<std::unique_ptr<core::TenantTable>> tenants =
      core::TenantTable::Create(options, text);
  if (!tenants.ok()) {
    return Fail(absl::StrCat("--tenants_file=", path, ": ",
                             tenants.status().message()));
  }
  core_options_.tenants = std::move(*tenants);
  absl::StatusOr<TenantKeyKind> key =
      ParseTenantKeyKind(absl::GetFlag(FLAGS_tenant_key));
  if (!key.ok()) {
    return Fail(absl::StrCat("--tenant_key: ", key.status().message()));
  }
  core_options_.tenant_key = *key;
  core_options_.kubelet_pod_logs_dir =
      absl::GetFlag(FLAGS_kubelet_pod_logs_dir);
  return absl::OkStatus();
}

absl::Status Daemon::StartFdSocket() {
  fd_socket::FdServerOptions options;
  options.read_cgroup = core_options_.tenant_key != TenantKeyKind::kUid;
  options.path = fd_socket_;
  options.mode = socket_mode_;
  options.allowed_uids = uids_;
  options.allowed_gids = gids_;
  options.fd_budget = fd_budget_.get();
  absl::StatusOr<std::unique_ptr<fd_socket::FdServer>> server =
      handover_->taking_over()
          // Taking over: the listener and every session's connection,
          // which their clients keep using as if nothing happened.
          ? fd_socket::FdServer::Adopt(
                options, core_.get(),
                fd_socket::DetachedFromSnapshot(handover_->snapshot(),
                                                handover_->snapshot_fds()))
          : fd_socket::FdServer::Start(options, core_.get());
  if (!server.ok()) {
    return Fail(absl::StrCat("fd socket: ", server.status().ToString()));
  }
  fd_server_ = std::move(*server);
  // The core hangs up a session's connection through the server serving
  // it (a handover that fails makes a new one).
  auto served = [core = core_.get()](fd_socket::FdServer* serving) {
    core->SetFdHangup(
        [serving](const std::string& token) { serving->Hangup(token); });
  };
  served(fd_server_.get());
  fd_handover_.Attach(&fd_server_, options, core_.get(), served);
  return absl::OkStatus();
}

// mrd accepts on its gRPC socket itself and hands each connection to gRPC
// (server/service/grpc_acceptor.h): connections are capped, in total and per
// uid, and running out of fds never stops the server accepting. Made before
// the metrics, which read it until they are destroyed.
absl::Status Daemon::ListenGrpc() {
  acceptor_options_.socket_path = grpc_socket_;
  acceptor_options_.socket_mode = socket_mode_;
  acceptor_options_.max_connections = absl::GetFlag(FLAGS_grpc_max_connections);
  if (acceptor_options_.max_connections == 0) {
    acceptor_options_.max_connections =
        std::max<uint64_t>(1, fd_budget_->Stats().reserve / 2);
  }
  acceptor_options_.max_connections_per_tenant =
      absl::GetFlag(FLAGS_grpc_max_connections_per_tenant);
  if (acceptor_options_.tenant_of == nullptr &&
      core_options_.tenant_key != TenantKeyKind::kUid) {
    acceptor_options_.tenant_of = [kind = core_options_.tenant_key](int socket,
                                                                    uid_t uid) {
      absl::StatusOr<CgroupIdentity> cgroup = ReadPeerCgroup(socket);
      if (!cgroup.ok() || cgroup->delegated) {
        return TenantKeyFor({}, TenantKeyKind::kUid, uid);
      }
      return TenantKeyFor(*cgroup, kind, uid);
    };
  }
  if (acceptor_options_.max_connections_per_tenant == 0) {
    acceptor_options_.max_connections_per_tenant = std::max<uint64_t>(
        1, acceptor_options_.max_connections *
               std::min<uint32_t>(100,
                                  absl::GetFlag(FLAGS_tenant_default_percent)) /
               100);
  }
  absl::StatusOr<std::unique_ptr<service::GrpcAcceptor>> acceptor =
      handover_->taking_over()
          ? service::GrpcAcceptor::Adopt(
                acceptor_options_,
                handover::TakeFd(handover_->snapshot_fds(),
                                 handover_->snapshot().grpc_listener()))
          : service::GrpcAcceptor::Listen(acceptor_options_);
  if (!acceptor.ok()) {
    return Fail(absl::StrCat("gRPC socket: ", acceptor.status().ToString()));
  }
  acceptor_.Set(acceptor_options_, *std::move(acceptor));
  return absl::OkStatus();
}

metrics::PeerPathGauges PeerPathGaugesOf(const device::SoftwareDevice& device) {
  const device::SoftwareDevice::PeerPathStats s = device.PeerStats();
  metrics::PeerPathGauges g;
  g.connections = s.listener.connections;
  g.unauthenticated = s.listener.unauthenticated;
  g.buffered_bytes = s.listener.buffered_bytes;
  g.threads = s.listener.threads;
  g.accepted_total = s.listener.accepted;
  g.refused_total = s.listener.refused;
  g.shed_total = s.listener.shed;
  g.hello_timeouts_total = s.listener.hello_timeouts;
  g.stall_timeouts_total = s.listener.stall_timeouts;
  g.session_limit_refusals_total = s.session_limit_refusals;
  g.max_connections = s.listener.max_connections;
  g.max_unauthenticated = s.listener.max_unauthenticated;
  g.max_buffer_bytes = s.listener.max_buffer_bytes;
  g.max_session_connections = s.max_session_connections;
  return g;
}

absl::Status Daemon::StartMetrics() {
  metrics_ = std::make_unique<metrics::Metrics>(core_.get(), fd_budget_.get());
  SetMetricsSources();
  const core::CoreOptions& o = core_options_;
  auto d = [](uint64_t v) { return static_cast<double>(v); };
  metrics_->SetLimits({
      {"max_sessions", d(o.max_sessions)},
      {"max_buffer_size", d(o.max_buffer_size)},
      {"max_session_pinned_bytes", d(o.max_session_pinned_bytes)},
      {"max_total_pinned_bytes", d(o.max_total_pinned_bytes)},
      {"max_session_registrations", d(o.max_session_registrations)},
      {"max_total_registrations", d(o.max_total_registrations)},
      {"max_total_buffers", d(o.max_total_buffers)},
      {"max_total_lams", d(o.max_total_lams)},
      {"max_total_mrs", d(o.max_total_mrs)},
      {"max_batch_items", d(o.max_batch_items)},
      {"warm_pin_bytes_per_session", d(o.warm_pin_bytes_per_session)},
      {"warm_pin_bytes_total", d(o.warm_pin_bytes_total)},
      {"max_lease_ttl_seconds", absl::ToDoubleSeconds(o.max_lease_ttl)},
  });
  const std::string address = absl::GetFlag(FLAGS_metrics_address);
  metrics_handover_.Set(metrics_.get(), address);
  if (address.empty()) return absl::OkStatus();
  absl::Status served = absl::UnknownError("not served yet");
  const bool taking_over = handover_->taking_over();
  if (taking_over && handover_->snapshot().has_metrics_listener()) {
    // Taking over: the running mrd's metrics socket, with the scrapes
    // waiting in its backlog.
    served = metrics_->ServeOn(handover::TakeFd(
        handover_->snapshot_fds(), handover_->snapshot().metrics_listener()));
    if (!served.ok()) {
      LogWarning("metrics: the socket handed over cannot be served (",
                 served.ToString(), "); binding ", address, " instead");
    }
  }
  if (!served.ok()) served = metrics_->Serve(address);
  // Taking over without it: the running mrd let go of the port just
  // before commit.
  for (int i = 0; !served.ok() && taking_over && i < 50; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    served = metrics_->Serve(address);
  }
  if (!served.ok()) {
    return Fail(absl::StrCat("metrics: ", served.ToString()));
  }
  LogInfo("metrics at http://", address, "/metrics");
  return absl::OkStatus();
}

void Daemon::SetMetricsSources() {
  if (software_device_ != nullptr) {
    metrics_->SetPeerPathSource(
        [device = software_device_] { return PeerPathGaugesOf(*device); });
  }
  // A handover that fails replaces the acceptor (Resume).
  metrics_->SetGrpcConnectionsSource([this] { return acceptor_.Stats(); });
  metrics::ServerInfo info;
  info.version = MRD_VERSION;
  info.revision = MRD_REVISION;
  info.device = use_verbs_ ? "verbs" : "software";
  info.device_fallback = device_fallback_;
  metrics_->SetServerInfo(info);
  metrics_->SetDeviceHealthSource(
      [this] { return device_healthy_.load(std::memory_order_relaxed); });
  metrics_->SetHandoverSource(
      [this] { return metrics::GaugesOf(handover_->counts()); });
}

absl::Status Daemon::StartGrpc() {
  workers_ = std::make_unique<FairScheduler>();
  FairSchedulerOptions scheduling;
  scheduling.workers = absl::GetFlag(FLAGS_worker_threads);
  scheduling.spare_workers = absl::GetFlag(FLAGS_fair_scheduling)
                                 ? absl::GetFlag(FLAGS_spare_worker_threads)
                                 : 0;
  if (absl::Status s = workers_->Start(scheduling); !s.ok()) {
    return Fail(absl::StrCat("--worker_threads: ", s.ToString()));
  }
  metrics_->SetSchedulerSource(
      [workers = workers_.get()] { return workers->Stats(); });
  service_ = std::make_unique<service::MrdService>(
      core_.get(), workers_.get(), metrics_.get(),
      absl::GetFlag(FLAGS_fair_scheduling));
  gate_handover_.SetGate(&service_->gate());
  // Made before any gRPC thread exists (the servers below start them): its
  // handlers are then made before every thread that calls them.
  if (!admin_socket_.empty()) {
    admin_service_ = std::make_unique<service::AdminService>(
        core_.get(), service_.get(), workers_.get());
  }
  grpc::EnableDefaultHealthCheckService(true);
  // gRPC's health service does not link the descriptors of its messages;
  // referring to one puts health.proto in the generated pool, so reflection
  // (grpcurl) can describe and call grpc.health.v1.Health.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int debug_port = 0;
  if (!debug_tcp_.empty()) {
    builder.AddListeningPort(debug_tcp_, grpc::InsecureServerCredentials(),
                             &debug_port);
  }
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return Fail(absl::StrCat("cannot start the gRPC server",
                             debug_tcp_.empty() ? "" : " on ", debug_tcp_));
  }
  if (absl::Status s = acceptor_.Start(server_.get()); !s.ok()) {
    server_->Shutdown();
    return Fail(absl::StrCat("gRPC acceptor: ", s.ToString()));
  }
  LogInfo("gRPC connections: at most ", acceptor_options_.max_connections, ", ",
          acceptor_options_.max_connections_per_tenant, " per tenant");
  MRD_RETURN_IF_ERROR(StartAdmin());
  health_ = server_->GetHealthCheckService();
  // "" (the server) and mrd's service name: Kubernetes gRPC probes and
  // grpc_health_probe ask for a service by name.
  health_->SetServingStatus(true);
  health_->SetServingStatus(kServiceName, true);
  LogInfo("mrd serving: grpc unix:", grpc_socket_, ", fd socket ", fd_socket_,
          debug_tcp_.empty() ? ""
                             : absl::StrCat(", debug tcp ", debug_tcp_,
                                            " (port ", debug_port, ")"));
  return absl::OkStatus();
}

// The administrative service on a gRPC server and socket of its own, which
// only root and mrd's own uid may connect to (SO_PEERCRED at accept, and
// mode 0600). Taking over, this runs after commit: until then the old
// process's admin socket answers, and a handover that fails leaves it so.
absl::Status Daemon::StartAdmin() {
  if (admin_service_ == nullptr) return absl::OkStatus();
  grpc::ServerBuilder builder;
  builder.RegisterService(admin_service_.get());
  admin_server_ = builder.BuildAndStart();
  if (admin_server_ == nullptr) {
    server_->Shutdown();
    return Fail("cannot start the administrative gRPC server");
  }
  service::GrpcAcceptorOptions options;
  options.socket_path = admin_socket_;
  options.socket_mode = 0600;
  options.max_connections = 16;
  options.max_connections_per_tenant = 16;
  options.allowed_uids = {0, ::geteuid()};
  absl::StatusOr<std::unique_ptr<service::GrpcAcceptor>> acceptor =
      service::GrpcAcceptor::Listen(options);
  absl::Status started = acceptor.ok() ? (*acceptor)->Start(admin_server_.get())
                                       : acceptor.status();
  if (!started.ok()) {
    admin_server_->Shutdown();
    server_->Shutdown();
    return Fail(
        absl::StrCat("admin socket ", admin_socket_, ": ", started.ToString()));
  }
  admin_acceptor_ = *std::move(acceptor);
  LogInfo("admin socket ", admin_socket_, " (root and uid ", ::geteuid(),
          " only)");
  return absl::OkStatus();
}

// Stops the administrative service (a stop, or a handover's old process).
void Daemon::StopAdmin(bool handed_over) {
  if (admin_acceptor_ != nullptr) {
    if (handed_over) {
      // Closed without looking at the path, which the new process binds.
      (void)admin_acceptor_->Detach();
    }
    admin_acceptor_->Shutdown();
  }
  if (admin_server_ != nullptr) {
    admin_server_->Shutdown(std::chrono::system_clock::now() +
                            std::chrono::milliseconds(200));
    // Gone whole, its threads joined (a handed-over process exits next).
    if (handed_over) admin_server_.reset();
  }
}

// Liveness is "" (the server): SERVING from here until shutdown, whatever the
// device does, so that a port flap never gets mrd restarted (which would end
// every session on the node). Readiness is kServiceName: it follows the
// device, NOT_SERVING while the device reports itself unhealthy (device
// lost, port down), SERVING again when it recovers. GetDeviceInfo carries
// the device's own message. The same thread samples the open fds once a
// second (loud log when the fd reserve is being eaten).
absl::Status Daemon::StartHealthWatch() {
  absl::StatusOr<Thread> watch =
      Thread::Start("mrd-health", [this] { WatchHealth(); });
  if (!watch.ok()) {
    acceptor_.Shutdown();
    server_->Shutdown();
    fd_server_->Shutdown();
    core_->Shutdown();
    device_->Shutdown();
    return Fail(absl::StrCat("health watch: ", watch.status().ToString()));
  }
  health_watch_ = std::move(*watch);
  return absl::OkStatus();
}

void Daemon::WatchHealth() {
  bool serving = true;
  absl::Time pruned = absl::Now();
  while (
      !stop_health_.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
    fd_budget_->Sample(absl::Seconds(1));
    // Tenants that are gone (a pod that ended) leave the table, the
    // workers' queues and the metrics.
    if (absl::Now() - pruned >= kTenantPruneInterval) {
      pruned = absl::Now();
      for (const std::string& tenant : core_->PruneTenants()) {
        workers_->Forget(tenant);
      }
    }
    device::DeviceHealth now = device_->Health();
    if (now.healthy == serving) continue;
    serving = now.healthy;
    health_->SetServingStatus(kServiceName, serving);
    device_healthy_.store(serving, std::memory_order_relaxed);
    if (serving) {
      LogInfo("device healthy again: readiness SERVING");
    } else {
      LogError("device unhealthy (", now.message,
               "): readiness NOT_SERVING (liveness stays SERVING)");
    }
  }
}

// --- live handover -----------------------------------------------------------

absl::Status Daemon::BeginTakeover() {
  v1::HandoverHello hello;
  hello.set_device_kind(use_verbs_ ? "verbs" : "software");
  hello.set_device_name(use_verbs_ ? absl::GetFlag(FLAGS_verbs_device)
                                   : "software");
  return handover_->BeginTakeover(
      std::move(hello), [this](UniqueFd peer_listener) -> absl::Status {
        if (device_ != nullptr) return absl::OkStatus();
        return OpenDevice(std::move(peer_listener));
      });
}

void Daemon::Retire() {
  health_->SetServingStatus(false);
  health_->SetServingStatus(kServiceName, false);
  // Clients' channels hear GOAWAY and reconnect, to the new process.
  StopAdmin(/*handed_over=*/true);
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(500));
  // The health watch uses the server's health service: stopped first. The
  // server goes whole, its threads joined.
  stop_health_.Notify();
  health_watch_.Join();
  server_.reset();
}

// Starts `binary` with `args` (argv[0] = binary) as a process of its own
// that inherits nothing mrd set up for itself: an empty signal mask (mrd
// blocks SIGINT, SIGTERM, SIGHUP and SIGCHLD in every thread; a mask
// survives exec) and every signal at its default (SIGPIPE is ignored here,
// which exec keeps too), and no fd but 0, 1 and 2 (mrd's own are
// close-on-exec; this does not depend on it). posix_spawn: fork and exec
// without running anything of this multi-threaded process in the child.
absl::StatusOr<pid_t> Spawn(const std::string& binary,
                            const std::vector<std::string>& args) {
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args)
    argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawnattr_t attr;
  posix_spawn_file_actions_t actions;
  if (int e = posix_spawnattr_init(&attr); e != 0) {
    return ErrnoError(e, "posix_spawnattr_init", "RELOAD_FAILED");
  }
  if (int e = posix_spawn_file_actions_init(&actions); e != 0) {
    posix_spawnattr_destroy(&attr);
    return ErrnoError(e, "posix_spawn_file_actions_init", "RELOAD_FAILED");
  }
  sigset_t none;
  sigemptyset(&none);
  sigset_t defaults;
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGCHLD}) {
    sigaddset(&defaults, sig);
  }
  int e = posix_spawnattr_setsigmask(&attr, &none);
  if (e == 0) e = posix_spawnattr_setsigdefault(&attr, &defaults);
  if (e == 0) {
    e = posix_spawnattr_setflags(
        &attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  }
  if (e == 0) e = posix_spawn_file_actions_addclosefrom_np(&actions, 3);
  pid_t pid = -1;
  if (e == 0) {
    e = posix_spawn(&pid, binary.c_str(), &actions, &attr, argv.data(),
                    environ);
  }
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (e != 0) return ErrnoError(e, "posix_spawn", "RELOAD_FAILED");
  return pid;
}

void Daemon::Reload() {
  if (handover_->committed()) {
    LogInfo("SIGHUP: this mrd has handed over; nothing to reload");
    return;
  }
  if (successor_ != 0) {
    LogWarning("SIGHUP: a reload is in progress (pid ", successor_,
               " is taking over); ignored");
    return;
  }
  if (invocation_.binary.empty()) {
    LogError("SIGHUP: cannot reload, mrd's binary is unknown: ",
             invocation_.unresolved);
    return;
  }
  if (!handover_->listening()) {
    LogError("SIGHUP: cannot reload, this mrd does not listen on ",
             handover_socket_, " (see the error at start)");
    return;
  }
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  (void)SdNotify(absl::StrCat(
      "RELOADING=1\nMONOTONIC_USEC=",
      static_cast<uint64_t>(now.tv_sec) * 1000000 + now.tv_nsec / 1000));
  std::vector<std::string> args = invocation_.args;
  args.push_back("--takeover");
  absl::StatusOr<pid_t> child = Spawn(invocation_.binary, args);
  if (!child.ok()) {
    LogError("SIGHUP: cannot start ", invocation_.binary, ": ",
             child.status().ToString(), "; this mrd serves on");
    (void)SdNotify("READY=1");
    return;
  }
  successor_ = *child;
  LogInfo("SIGHUP: reloading, pid ", successor_, " (", invocation_.binary,
          " --takeover) takes over");
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status));
  }
  return absl::StrCat("ended (status ", status, ")");
}

void Daemon::ReapSuccessor() {
  if (successor_ == 0) return;
  int status = 0;
  const pid_t reaped = waitpid(successor_, &status, WNOHANG);
  if (reaped == 0 || (reaped < 0 && errno == EINTR)) return;  // still runs
  const pid_t pid = successor_;
  successor_ = 0;
  if (handover_->committed()) {
    LogInfo("pid ", pid, ", which took over from this mrd, ",
            DescribeExit(status));
    return;
  }
  LogError("reload failed: pid ", pid, " ", DescribeExit(status),
           " without taking over (its log says why); this mrd serves on");
  (void)SdNotify("READY=1");
}

void Daemon::ServeUntil(const sigset_t& signals) {
  int sig = 0;
  for (;;) {
    if (sigwait(&signals, &sig) != 0) continue;
    if (sig == SIGHUP) {
      Reload();
    } else if (sig == SIGCHLD) {
      ReapSuccessor();
    } else {
      break;
    }
  }
  LogInfo("signal ", sig, ": shutting down");
  // A handover that commits (or committed, --after_handover=wait) ends the
  // process in Finish, once everything is released: Shutdown below waits
  // for it.
  handover_->RequestExit();
  if (!handover_->committed()) {
    (void)SdNotify("STOPPING=1");
    WriteStatus("stopping");
  }
  // A reload in progress ends with this mrd (which it would take over from).
  if (successor_ != 0) kill(successor_, SIGTERM);
  handover_->Shutdown();
  stop_health_.Notify();
  health_watch_.Join();
  health_->SetServingStatus(false);
  health_->SetServingStatus(kServiceName, false);
  acceptor_.Shutdown();
  StopAdmin();
  fd_server_->Shutdown();
  core_->Shutdown();
  // Every session is released by now; what remains are idle client channels
  // and open streams, which gRPC would otherwise wait on until the deadline.
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(500));
  device_->Shutdown();
  unlink(grpc_socket_.c_str());
  WriteStatus("stopped");
  LogInfo("mrd stopped; device pinned bytes: ", device_->PinnedBytes());
}

// --await_handover: the state --handover_status_file says, every 100 ms,
// until it is neither taking-over nor handing-over (or there is no such
// file: no mrd wrote one).
int AwaitHandover(const std::string& path, absl::Duration timeout) {
  if (path.empty()) {
    LogError("--await_handover needs --handover_status_file");
    return 1;
  }
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    absl::StatusOr<std::string> read = ReadSmallFile(path);
    const std::string state =
        read.ok() ? std::string(absl::StripAsciiWhitespace(*read)) : "";
    if (state != "taking-over" && state != "handing-over") {
      LogInfo("--await_handover: ", path,
              read.ok() ? absl::StrCat(" says ", state)
                        : absl::StrCat(": ", read.status().message()),
              "; no handover in progress");
      return 0;
    }
    if (absl::Now() >= deadline) {
      LogError("--await_handover: ", path, " still says ", state, " after ",
               absl::FormatDuration(timeout));
      return 1;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

int Run(Daemon::Invocation invocation) {
  if (absl::GetFlag(FLAGS_await_handover) > absl::ZeroDuration()) {
    return AwaitHandover(absl::GetFlag(FLAGS_handover_status_file),
                         absl::GetFlag(FLAGS_await_handover));
  }
  // Signals are taken synchronously by this thread; every thread started
  // below inherits the blocked mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  sigaddset(&signals, SIGCHLD);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  if (absl::GetFlag(FLAGS_verbose)) SetMinLogLevel(LogLevel::kDebug);
  Daemon daemon(std::move(invocation));
  if (absl::Status s = daemon.Start(); !s.ok()) {
    LogError(s.message());
    daemon.WriteStatus("stopped");
    return 1;
  }
  daemon.ServeUntil(signals);
  return 0;
}

// The absolute path mrd was started from, for the successor of a reload:
// argv[0] made absolute, or found in $PATH as the shell found it. Neither
// /proc/self/exe (after an upgrade it names the old, deleted binary) nor
// symlinks resolved (a link that an upgrade points elsewhere is what must
// be followed again).
absl::StatusOr<std::string> ResolveBinary(absl::string_view argv0) {
  auto absolute = [](absl::string_view path) -> absl::StatusOr<std::string> {
    if (absl::StartsWith(path, "/")) return std::string(path);
    char cwd[4096];
    if (getcwd(cwd, sizeof(cwd)) == nullptr) {
      return ErrnoError(errno, "getcwd", "RELOAD_FAILED");
    }
    return absl::StrCat(cwd, "/", path);
  };
  if (absl::StrContains(argv0, '/')) return absolute(argv0);
  const char* path = std::getenv("PATH");
  for (absl::string_view dir :
       absl::StrSplit(path != nullptr ? path : "", ':')) {
    const std::string candidate =
        absl::StrCat(dir.empty() ? "." : dir, "/", argv0);
    struct stat st {};
    if (access(candidate.c_str(), X_OK) == 0 &&
        stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      return absolute(candidate);
    }
  }
  return MrdError(absl::StatusCode::kNotFound, "RELOAD_FAILED",
                  absl::StrCat("'", argv0, "' is not in PATH"));
}

}  // namespace

// Every flag of mrd (those of server/) with its default and help, sorted by
// name, after `usage`.
void PrintHelp(absl::string_view usage) {
  std::cout << usage << "\n\nFlags (docs/CONFIG.md):\n";
  std::map<std::string, const absl::CommandLineFlag*> ours;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "server/")) {
      ours.emplace(std::string(name), flag);
    }
  }
  for (const auto& [name, flag] : ours) {
    std::cout << "  --" << name << " (default: \"" << flag->DefaultValue()
              << "\")\n      " << flag->Help() << "\n";
  }
  std::cout << "  --flagfile=<file>\n      Read flags, one per line, from "
               "<file>.\n  --help, --version\n";
}

}  // namespace mrd

int main(int argc, char** argv) {
  constexpr char kUsage[] =
      "mrd: node-local RDMA memory-registration service.\n"
      "  mrd [--flagfile=/etc/mrd/mrd.flags] [--flags...]";
  // --help, --helpfull and --version are answered here, with exit code 0:
  // Abseil's own exit 1 and list only flags of a file named after the
  // program.
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-help" || arg == "--helpfull" ||
        arg == "-h") {
      mrd::PrintHelp(kUsage);
      return 0;
    }
    if (arg == "--version") {
      std::cout << "mrd " << MRD_VERSION << "\n";
      return 0;
    }
  }
  // Before the flags are parsed (and PATH or the directory could change).
  mrd::Daemon::Invocation invocation;
  absl::StatusOr<std::string> binary = mrd::ResolveBinary(argv[0]);
  if (binary.ok()) {
    invocation.binary = *std::move(binary);
  } else {
    invocation.unresolved = binary.status().ToString();
  }
  invocation.args.assign(argv + 1, argv + argc);
  absl::SetProgramUsageMessage(kUsage);
  absl::ParseCommandLine(argc, argv);
#ifdef NDEBUG
  // Debian's Abseil is built with mutex deadlock detection on, which walks a
  // lock graph on every Lock/Unlock and doubles the cost of a registration
  // cache hit (bench/cache_bench). Debug builds and the unit tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  return mrd::Run(std::move(invocation));
}
