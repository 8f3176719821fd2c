// mrd: the node-local memory-registration service. Wires the device, the
// core, the fd socket, the gRPC server (with health and reflection) and the
// metrics exposer together, then waits for SIGTERM/SIGINT and shuts down in
// order: NOT_SERVING first, then every session is released (nothing stays
// pinned), then the servers and the device stop.
//
// Every flag can also come from a flag file: mrd --flagfile=/etc/mrd/mrd.flags
// (one --name=value per line; see docs/CONFIG.md).

#include <fcntl.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <pwd.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
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
#include "mrd/unique_fd.h"
#include "mrd_revision.h"
#include "server/common/fd_budget.h"
#include "server/common/log.h"
#include "server/common/path_trust.h"
#include "server/common/thread.h"
#include "server/common/thread_pool.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"
#include "server/device/verbs/verbs_device.h"
#include "server/fd_socket/fd_server.h"
#include "server/metrics/metrics.h"
#include "server/service/grpc_acceptor.h"
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
ABSL_FLAG(uint64_t, grpc_max_connections_per_uid, 0,
          "gRPC connections one client uid may hold; more are refused "
          "(LIMIT_UID_GRPC_CONNECTIONS). 0 = --tenant_default_percent of "
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
          "Threads that run registration work off the gRPC threads.");
ABSL_FLAG(bool, verbose, false, "Log debug lines.");

namespace mrd {
namespace {

// Readiness: the health service name that follows the device ("" is
// liveness: the process serves).
constexpr char kServiceName[] = "mrd.v1.MemoryRegistration";

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

int Run() {
  // Signals are taken synchronously by this thread; every thread started
  // below inherits the blocked mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  if (absl::GetFlag(FLAGS_verbose)) SetMinLogLevel(LogLevel::kDebug);

  // File descriptors (docs/RELIABILITY.md): the highest open-file limit we
  // may have, and a budget for clients that leaves a reserve for mrd itself.
  absl::StatusOr<NofileLimits> nofile = RaiseNofileLimit();
  if (!nofile.ok()) {
    LogError("open-file limit: ", nofile.status().ToString());
    return 1;
  }
  FdBudgetOptions fd_budget_options;
  fd_budget_options.limit = nofile->soft;
  fd_budget_options.reserve = absl::GetFlag(FLAGS_fd_reserve);
  fd_budget_options.per_owner = absl::GetFlag(FLAGS_max_session_fds);
  fd_budget_options.per_owner_cap = core::CoreOptions().max_buffers_per_session;
  absl::StatusOr<std::unique_ptr<FdBudget>> fd_budget =
      FdBudget::Create(fd_budget_options);
  if (!fd_budget.ok()) {
    LogError("--fd_reserve: ", fd_budget.status().message());
    return 1;
  }

  // Directories someone else could change are refused (docs/RELIABILITY.md,
  // "Runtime directory and shm_dir"): whoever can rename our sockets can
  // listen in their place and be handed our clients' memory.
  std::string runtime_dir = absl::GetFlag(FLAGS_runtime_dir);
  if (runtime_dir.empty()) runtime_dir = DefaultRuntimeDir();
  if (absl::StatusOr<std::string> trusted =
          PrepareRuntimeDir(runtime_dir, geteuid());
      trusted.ok()) {
    runtime_dir = *std::move(trusted);
  } else {
    LogError("refusing to start: runtime dir ", runtime_dir, ": ",
             trusted.status().message());
    return 1;
  }
  std::string grpc_socket = absl::GetFlag(FLAGS_grpc_socket);
  std::string fd_socket = absl::GetFlag(FLAGS_fd_socket);
  for (std::string* socket : {&grpc_socket, &fd_socket}) {
    if (socket->empty()) continue;
    absl::StatusOr<std::string> trusted = CheckSocketPath(*socket, geteuid());
    if (!trusted.ok()) {
      LogError("refusing to start: socket ", *socket, ": ",
               trusted.status().message());
      return 1;
    }
    *socket = *std::move(trusted);
  }
  if (grpc_socket.empty()) grpc_socket = runtime_dir + "/mrd.sock";
  if (fd_socket.empty()) fd_socket = runtime_dir + "/fd.sock";
  std::string shm_dir = absl::GetFlag(FLAGS_shm_dir);
  if (!shm_dir.empty()) {
    // Created if missing (sticky and world-writable, like /dev/shm), so that
    // `make run` works on a fresh machine; refused off tmpfs/hugetlbfs.
    absl::StatusOr<std::string> trusted = PrepareShmDir(shm_dir, geteuid());
    if (!trusted.ok()) {
      LogError("refusing to start: --shm_dir ", shm_dir, ": ",
               trusted.status().message());
      return 1;
    }
    shm_dir = *std::move(trusted);
  }
  mode_t socket_mode = static_cast<mode_t>(
      std::strtoul(absl::GetFlag(FLAGS_socket_mode).c_str(), nullptr, 8));

  absl::StatusOr<std::vector<uint32_t>> uids =
      ParseIds(absl::GetFlag(FLAGS_allowed_uids), "allowed_uids");
  absl::StatusOr<std::vector<uint32_t>> gids =
      ParseIds(absl::GetFlag(FLAGS_allowed_gids), "allowed_gids");
  if (!uids.ok() || !gids.ok()) {
    LogError(!uids.ok() ? uids.status().message() : gids.status().message());
    return 1;
  }
  if (uids->empty() && gids->empty() && !absl::GetFlag(FLAGS_allow_any_peer)) {
    uids->push_back(geteuid());
  }

  const std::string debug_tcp = absl::GetFlag(FLAGS_debug_tcp_address);
  if (!debug_tcp.empty() && !IsLoopback(debug_tcp)) {
    LogError("--debug_tcp_address=", debug_tcp,
             " is not a loopback address; the debug listener has no "
             "authentication and may only listen on 127.0.0.0/8 or [::1]");
    return 1;
  }

  // The device.
  const std::string device_flag = absl::GetFlag(FLAGS_device);
  if (device_flag != "software" && device_flag != "auto" &&
      device_flag != "verbs") {
    LogError("--device must be software, verbs or auto, not '", device_flag,
             "'");
    return 1;
  }
  absl::StatusOr<device::PinMethod> pin_method =
      device::ParsePinMethod(absl::GetFlag(FLAGS_pin_method));
  if (!pin_method.ok()) {
    LogError("--pin_method: ", pin_method.status().message());
    return 1;
  }
  bool use_verbs = device_flag == "verbs";
  bool device_fallback = false;  // auto: RDMA devices, software device
  if (device_flag == "auto") {
    std::vector<std::string> verbs_devices = device::ListVerbsDevices();
    use_verbs = !verbs_devices.empty();
    LogInfo("device auto: ",
            use_verbs ? absl::StrCat("RDMA device(s) ",
                                     absl::StrJoin(verbs_devices, ", "),
                                     " found; using the verbs device")
                      : "no RDMA device found; using the software device");
  }
  absl::StatusOr<std::unique_ptr<device::Device>> device =
      absl::InternalError("no device");
  if (use_verbs) {
    device::VerbsDeviceOptions verbs_options;
    verbs_options.device_name = absl::GetFlag(FLAGS_verbs_device);
    verbs_options.peer_address = absl::GetFlag(FLAGS_peer_address);
    absl::StatusOr<std::unique_ptr<device::VerbsDevice>> verbs =
        device::VerbsDevice::Create(verbs_options);
    if (verbs.ok()) {
      device = std::unique_ptr<device::Device>(std::move(*verbs));
    } else if (device_flag == "verbs") {
      LogError("verbs device: ", verbs.status().ToString());
      return 1;
    } else {
      // Loud: remote peers that use RDMA cannot reach this node's memory
      // now (mrd_device_fallback says so to alerts).
      LogError(
          "device auto: this node has RDMA devices but the verbs device "
          "failed (",
          verbs.status().ToString(),
          "); FALLING BACK TO THE SOFTWARE DEVICE: RDMA peers cannot "
          "reach registrations. Fix the device or run --device=verbs "
          "to fail instead.");
      use_verbs = false;
      device_fallback = true;
    }
  }
  device::SoftwareDevice* software_device = nullptr;  // owned by `device`
  if (!use_verbs) {
    device::SoftwareDeviceOptions device_options;
    device_options.peer_listen_address = absl::GetFlag(FLAGS_peer_address);
    device_options.pin_options.method = *pin_method;
    device_options.pin_options.max_map_splits =
        absl::GetFlag(FLAGS_pin_max_map_splits);
    // The key space covers everything the core's global limits allow, so
    // no session can exhaust it (docs/RELIABILITY.md, "Key space"); the
    // table grows only as keys are taken.
    const uint64_t key_slots =
        SoftwareKeySlots(absl::GetFlag(FLAGS_max_total_registrations),
                         absl::GetFlag(FLAGS_max_total_lams),
                         absl::GetFlag(FLAGS_max_total_mrs));
    if (key_slots > device::KeyTable::kMaxSlots) {
      LogError(
          "refusing to start: --max_total_registrations plus LAMs and "
          "fast-register MRs (",
          key_slots, ") exceeds the software device's ",
          device::KeyTable::kMaxSlots, " memory keys");
      return 1;
    }
    device_options.max_keys = static_cast<uint32_t>(key_slots);
    device_options.max_connections = absl::GetFlag(FLAGS_peer_max_connections);
    device_options.max_unauthenticated_connections =
        absl::GetFlag(FLAGS_peer_max_unauthenticated);
    device_options.max_session_connections =
        absl::GetFlag(FLAGS_peer_max_session_connections);
    device_options.peer_hello_timeout = absl::GetFlag(FLAGS_peer_hello_timeout);
    device_options.peer_stall_timeout = absl::GetFlag(FLAGS_peer_stall_timeout);
    device_options.peer_buffer_bytes = absl::GetFlag(FLAGS_peer_buffer_bytes);
    device_options.peer_workers = absl::GetFlag(FLAGS_peer_workers);
    absl::StatusOr<std::unique_ptr<device::SoftwareDevice>> software =
        device::SoftwareDevice::Create(device_options);
    if (!software.ok()) {
      LogError("software device: ", software.status().ToString());
      return 1;
    }
    software_device = software->get();
    device = std::unique_ptr<device::Device>(std::move(*software));
  }
  const std::string device_kind = (*device)->Attributes().kind;
  if (absl::Status s = (*device)->Start(); !s.ok()) {
    LogError(device_kind, " device start: ", s.ToString());
    return 1;
  }
  LogInfo("device: ", device_kind, " (", (*device)->Attributes().name,
          "), peers connect to ", (*device)->Attributes().peer_address);

  // The core.
  core::CoreOptions core_options;
  core_options.shm_dir = shm_dir;
  core_options.allowed_uids = *uids;
  core_options.default_lease_ttl = absl::GetFlag(FLAGS_lease_ttl);
  core_options.max_lease_ttl = absl::GetFlag(FLAGS_max_lease_ttl);
  core_options.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  core_options.max_buffer_size = absl::GetFlag(FLAGS_max_buffer_size);
  core_options.max_session_pinned_bytes =
      absl::GetFlag(FLAGS_max_session_pinned_bytes);
  core_options.max_total_pinned_bytes =
      absl::GetFlag(FLAGS_max_total_pinned_bytes);
  core_options.max_session_registrations =
      absl::GetFlag(FLAGS_max_session_registrations);
  core_options.max_total_registrations =
      absl::GetFlag(FLAGS_max_total_registrations);
  core_options.warm_pin_bytes_per_session =
      absl::GetFlag(FLAGS_warm_pin_bytes_per_session);
  core_options.warm_pin_bytes_total = absl::GetFlag(FLAGS_warm_pin_bytes_total);
  core_options.fd_budget = fd_budget->get();
  if (!(*device)->Attributes().shares_pins &&
      core_options.warm_pin_bytes_total != 0) {
    // Measured (docs/PERFORMANCE.md): on a device that pins per registration
    // a warm pin is one more registration and makes re-registering slower.
    LogInfo("device ", (*device)->Attributes().name,
            " pins per registration: warm pins are off");
    core_options.warm_pin_bytes_per_session = 0;
    core_options.warm_pin_bytes_total = 0;
  }
  core_options.max_total_buffers = absl::GetFlag(FLAGS_max_total_buffers);
  core_options.max_total_lams = absl::GetFlag(FLAGS_max_total_lams);
  core_options.max_total_mrs = absl::GetFlag(FLAGS_max_total_mrs);
  {
    // Tenants: quotas are shares of these totals unless the file names them.
    core::TenantTableOptions tenant_options;
    tenant_options.default_percent =
        absl::GetFlag(FLAGS_tenant_default_percent);
    auto total = [&](core::TenantResource r) -> uint64_t& {
      return tenant_options.totals[static_cast<int>(r)];
    };
    total(core::TenantResource::kSessions) = core_options.max_sessions;
    total(core::TenantResource::kBuffers) = core_options.max_total_buffers;
    total(core::TenantResource::kRegistrations) =
        core_options.max_total_registrations;
    total(core::TenantResource::kPinnedBytes) =
        core_options.max_total_pinned_bytes;
    total(core::TenantResource::kLams) = core_options.max_total_lams;
    total(core::TenantResource::kMrs) = core_options.max_total_mrs;
    total(core::TenantResource::kPeerConnections) =
        absl::GetFlag(FLAGS_peer_max_connections);
    std::string text;
    const std::string path = absl::GetFlag(FLAGS_tenants_file);
    if (!path.empty()) {
      absl::StatusOr<std::string> read = ReadSmallFile(path);
      if (!read.ok()) {
        LogError("--tenants_file=", path, ": ", read.status().message());
        return 1;
      }
      text = std::move(*read);
    }
    absl::StatusOr<std::unique_ptr<core::TenantTable>> tenants =
        core::TenantTable::Create(tenant_options, text);
    if (!tenants.ok()) {
      LogError("--tenants_file=", path, ": ", tenants.status().message());
      return 1;
    }
    core_options.tenants = std::move(*tenants);
  }
  // Who can reach the gRPC socket is who an anonymous lease session may be:
  // ImportFile opens for it only what such a caller could open itself.
  if (!debug_tcp.empty() || (socket_mode & S_IWOTH) != 0) {
    core_options.anonymous_reach = core::CoreOptions::Reach::kAnyone;
  } else if ((socket_mode & S_IWGRP) != 0) {
    core_options.anonymous_reach = core::CoreOptions::Reach::kGroupMember;
    core_options.anonymous_id = getegid();
  } else {
    core_options.anonymous_reach = core::CoreOptions::Reach::kUser;
    core_options.anonymous_id = geteuid();
  }
  WarnIfMemlockTooLow(core_options.max_total_pinned_bytes);
  core::Core core(device->get(), RealClock::Get(), core_options);
  if (absl::Status s = core.Start(); !s.ok()) {
    LogError("core: ", s.ToString());
    return 1;
  }

  // The fd socket.
  fd_socket::FdServerOptions fd_options;
  fd_options.path = fd_socket;
  fd_options.mode = socket_mode;
  fd_options.allowed_uids = *uids;
  fd_options.allowed_gids = *gids;
  fd_options.fd_budget = fd_budget->get();
  absl::StatusOr<std::unique_ptr<fd_socket::FdServer>> fd_server =
      fd_socket::FdServer::Start(fd_options, &core);
  if (!fd_server.ok()) {
    LogError("fd socket: ", fd_server.status().ToString());
    return 1;
  }
  fd_socket::FdServer* fd_server_ptr = fd_server->get();
  core.SetFdHangup([fd_server_ptr](const std::string& token) {
    fd_server_ptr->Hangup(token);
  });

  // Metrics.
  // mrd accepts on its gRPC socket itself and hands each connection to gRPC
  // (server/service/grpc_acceptor.h): connections are capped, in total and
  // per uid, and running out of fds never stops the server accepting. Made
  // before the metrics, which read it until they are destroyed.
  service::GrpcAcceptorOptions acceptor_options;
  acceptor_options.socket_path = grpc_socket;
  acceptor_options.socket_mode = socket_mode;
  acceptor_options.max_connections = absl::GetFlag(FLAGS_grpc_max_connections);
  if (acceptor_options.max_connections == 0) {
    acceptor_options.max_connections =
        std::max<uint64_t>(1, (*fd_budget)->Stats().reserve / 2);
  }
  acceptor_options.max_connections_per_uid =
      absl::GetFlag(FLAGS_grpc_max_connections_per_uid);
  if (acceptor_options.max_connections_per_uid == 0) {
    acceptor_options.max_connections_per_uid = std::max<uint64_t>(
        1, acceptor_options.max_connections *
               std::min<uint32_t>(100,
                                  absl::GetFlag(FLAGS_tenant_default_percent)) /
               100);
  }
  absl::StatusOr<std::unique_ptr<service::GrpcAcceptor>> acceptor =
      service::GrpcAcceptor::Listen(acceptor_options);
  if (!acceptor.ok()) {
    LogError("gRPC socket: ", acceptor.status().ToString());
    return 1;
  }
  // Readiness's view of the device (the health watch below keeps it; the
  // metrics read it, so it outlives them).
  std::atomic<bool> device_healthy{true};
  metrics::Metrics metrics(&core, fd_budget->get());
  if (software_device != nullptr) {
    metrics.SetPeerPathSource([software_device] {
      const device::SoftwareDevice::PeerPathStats s =
          software_device->PeerStats();
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
    });
  }
  metrics.SetGrpcConnectionsSource(
      [a = acceptor->get()] { return a->Stats(); });
  metrics::ServerInfo server_info;
  server_info.version = MRD_VERSION;
  server_info.revision = MRD_REVISION;
  server_info.device = use_verbs ? "verbs" : "software";
  server_info.device_fallback = device_fallback;
  metrics.SetServerInfo(server_info);
  metrics.SetDeviceHealthSource([&device_healthy] {
    return device_healthy.load(std::memory_order_relaxed);
  });
  {
    auto d = [](uint64_t v) { return static_cast<double>(v); };
    metrics.SetLimits({
        {"max_sessions", d(core_options.max_sessions)},
        {"max_buffer_size", d(core_options.max_buffer_size)},
        {"max_session_pinned_bytes", d(core_options.max_session_pinned_bytes)},
        {"max_total_pinned_bytes", d(core_options.max_total_pinned_bytes)},
        {"max_session_registrations",
         d(core_options.max_session_registrations)},
        {"max_total_registrations", d(core_options.max_total_registrations)},
        {"max_total_buffers", d(core_options.max_total_buffers)},
        {"max_total_lams", d(core_options.max_total_lams)},
        {"max_total_mrs", d(core_options.max_total_mrs)},
        {"warm_pin_bytes_per_session",
         d(core_options.warm_pin_bytes_per_session)},
        {"warm_pin_bytes_total", d(core_options.warm_pin_bytes_total)},
        {"max_lease_ttl_seconds",
         absl::ToDoubleSeconds(core_options.max_lease_ttl)},
    });
  }
  const std::string metrics_address = absl::GetFlag(FLAGS_metrics_address);
  if (!metrics_address.empty()) {
    if (absl::Status s = metrics.Serve(metrics_address); !s.ok()) {
      LogError("metrics: ", s.ToString());
      return 1;
    }
    LogInfo("metrics at http://", metrics_address, "/metrics");
  }

  // gRPC.
  ThreadPool pool;
  if (absl::Status s = pool.Start(absl::GetFlag(FLAGS_worker_threads));
      !s.ok()) {
    LogError("--worker_threads: ", s.ToString());
    return 1;
  }
  service::MrdService service(&core, &pool, &metrics);
  grpc::EnableDefaultHealthCheckService(true);
  // gRPC's health service does not link the descriptors of its messages;
  // referring to one puts health.proto in the generated pool, so reflection
  // (grpcurl) can describe and call grpc.health.v1.Health.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int debug_port = 0;
  if (!debug_tcp.empty()) {
    builder.AddListeningPort(debug_tcp, grpc::InsecureServerCredentials(),
                             &debug_port);
  }
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    LogError("cannot start the gRPC server", debug_tcp.empty() ? "" : " on ",
             debug_tcp);
    return 1;
  }
  if (absl::Status started = (*acceptor)->Start(server.get()); !started.ok()) {
    LogError("gRPC acceptor: ", started.ToString());
    server->Shutdown();
    return 1;
  }
  LogInfo("gRPC connections: at most ", acceptor_options.max_connections, ", ",
          acceptor_options.max_connections_per_uid, " per uid");
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  // "" (the server) and mrd's service name: Kubernetes gRPC probes and
  // grpc_health_probe ask for a service by name.
  health->SetServingStatus(true);
  health->SetServingStatus(kServiceName, true);
  LogInfo("mrd serving: grpc unix:", grpc_socket, ", fd socket ", fd_socket,
          debug_tcp.empty() ? ""
                            : absl::StrCat(", debug tcp ", debug_tcp, " (port ",
                                           debug_port, ")"));

  // Liveness is "" (the server): SERVING from here until shutdown, whatever
  // the device does, so that a port flap never gets mrd restarted (which
  // would end every session on the node). Readiness is kServiceName: it
  // follows the device, NOT_SERVING while the device reports itself
  // unhealthy (device lost, port down), SERVING again when it recovers.
  // GetDeviceInfo carries the device's own message.
  // The same thread samples the open fds once a second (loud log when the
  // fd reserve is being eaten).
  absl::Notification stop_health;
  FdBudget* const budget = fd_budget->get();
  absl::StatusOr<Thread> health_watch = Thread::Start("mrd-health", [&] {
    bool serving = true;
    while (
        !stop_health.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      budget->Sample(absl::Seconds(1));
      device::DeviceHealth now = (*device)->Health();
      if (now.healthy != serving) {
        serving = now.healthy;
        health->SetServingStatus(kServiceName, serving);
        device_healthy.store(serving, std::memory_order_relaxed);
        if (serving) {
          LogInfo("device healthy again: readiness SERVING");
        } else {
          LogError("device unhealthy (", now.message,
                   "): readiness NOT_SERVING (liveness stays SERVING)");
        }
      }
    }
  });
  if (!health_watch.ok()) {
    LogError("health watch: ", health_watch.status().ToString());
    (*acceptor)->Shutdown();
    server->Shutdown();
    (*fd_server)->Shutdown();
    core.Shutdown();
    (*device)->Shutdown();
    return 1;
  }

  int sig = 0;
  sigwait(&signals, &sig);
  LogInfo("signal ", sig, ": shutting down");
  stop_health.Notify();
  health_watch->Join();
  health->SetServingStatus(false);
  health->SetServingStatus(kServiceName, false);
  (*acceptor)->Shutdown();
  (*fd_server)->Shutdown();
  core.Shutdown();
  // Every session is released by now; what remains are idle client channels
  // and open streams, which gRPC would otherwise wait on until the deadline.
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(500));
  (*device)->Shutdown();
  unlink(grpc_socket.c_str());
  LogInfo("mrd stopped; device pinned bytes: ", (*device)->PinnedBytes());
  return 0;
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
  absl::SetProgramUsageMessage(kUsage);
  absl::ParseCommandLine(argc, argv);
#ifdef NDEBUG
  // Debian's Abseil is built with mutex deadlock detection on, which walks a
  // lock graph on every Lock/Unlock and doubles the cost of a registration
  // cache hit (bench/cache_bench). Debug builds and the unit tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  return mrd::Run();
}
