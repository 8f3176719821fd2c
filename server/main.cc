// mrd: the node-local memory-registration service. Wires the device, the
// core, the fd socket, the gRPC server (with health and reflection) and the
// metrics exposer together, then waits for SIGTERM/SIGINT and shuts down in
// order: NOT_SERVING first, then every session is released (nothing stays
// pinned), then the servers and the device stop.
//
// Every flag can also come from a flag file: mrd --flagfile=/etc/mrd/mrd.flags
// (one --name=value per line; see docs/CONFIG.md).

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/common/log.h"
#include "server/common/thread_pool.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"
#include "server/device/verbs/verbs_device.h"
#include "server/metrics/metrics.h"
#include "server/service/service.h"
#include "server/session/fd_server.h"

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

  std::string runtime_dir = absl::GetFlag(FLAGS_runtime_dir);
  if (runtime_dir.empty()) runtime_dir = DefaultRuntimeDir();
  if (mkdir(runtime_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    LogError("cannot create runtime dir ", runtime_dir, ": ",
             std::strerror(errno));
    return 1;
  }
  std::string grpc_socket = absl::GetFlag(FLAGS_grpc_socket);
  if (grpc_socket.empty()) grpc_socket = runtime_dir + "/mrd.sock";
  std::string fd_socket = absl::GetFlag(FLAGS_fd_socket);
  if (fd_socket.empty()) fd_socket = runtime_dir + "/fd.sock";
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
  bool use_verbs = device_flag == "verbs";
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
      LogWarning("device auto: the verbs device failed (",
                 verbs.status().ToString(),
                 "); falling back to the software device");
      use_verbs = false;
    }
  }
  if (!use_verbs) {
    device::SoftwareDeviceOptions device_options;
    device_options.peer_listen_address = absl::GetFlag(FLAGS_peer_address);
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
  core_options.shm_dir = absl::GetFlag(FLAGS_shm_dir);
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
  if (!(*device)->Attributes().shares_pins &&
      core_options.warm_pin_bytes_total != 0) {
    // Measured (docs/PERFORMANCE.md): on a device that pins per registration
    // a warm pin is one more registration and makes re-registering slower.
    LogInfo("device ", (*device)->Attributes().name,
            " pins per registration: warm pins are off");
    core_options.warm_pin_bytes_per_session = 0;
    core_options.warm_pin_bytes_total = 0;
  }
  if (!core_options.shm_dir.empty()) {
    // Create it if missing (sticky and world-writable, like /dev/shm), so
    // that `make run` works on a fresh machine.
    if (mkdir(core_options.shm_dir.c_str(), 01777) == 0) {
      chmod(core_options.shm_dir.c_str(), 01777);
    }
  }
  core::Core core(device->get(), RealClock::Get(), core_options);
  if (absl::Status s = core.Start(); !s.ok()) {
    LogError("core: ", s.ToString());
    return 1;
  }

  // The fd socket.
  session::FdServerOptions fd_options;
  fd_options.path = fd_socket;
  fd_options.mode = socket_mode;
  fd_options.allowed_uids = *uids;
  fd_options.allowed_gids = *gids;
  absl::StatusOr<std::unique_ptr<session::FdServer>> fd_server =
      session::FdServer::Start(fd_options, &core);
  if (!fd_server.ok()) {
    LogError("fd socket: ", fd_server.status().ToString());
    return 1;
  }
  session::FdServer* fd_server_ptr = fd_server->get();
  core.SetFdHangup([fd_server_ptr](const std::string& token) {
    fd_server_ptr->Hangup(token);
  });

  // Metrics.
  metrics::Metrics metrics(&core);
  const std::string metrics_address = absl::GetFlag(FLAGS_metrics_address);
  if (!metrics_address.empty()) {
    if (absl::Status s = metrics.Serve(metrics_address); !s.ok()) {
      LogError("metrics: ", s.ToString());
      return 1;
    }
    LogInfo("metrics at http://", metrics_address, "/metrics");
  }

  // gRPC.
  ThreadPool pool(absl::GetFlag(FLAGS_worker_threads));
  service::MrdService service(&core, &pool, &metrics);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  unlink(grpc_socket.c_str());
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + grpc_socket,
                           grpc::InsecureServerCredentials());
  int debug_port = 0;
  if (!debug_tcp.empty()) {
    builder.AddListeningPort(debug_tcp, grpc::InsecureServerCredentials(),
                             &debug_port);
  }
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    LogError("cannot start the gRPC server on unix:", grpc_socket,
             debug_tcp.empty() ? "" : " and ", debug_tcp);
    return 1;
  }
  chmod(grpc_socket.c_str(), socket_mode);
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(true);
  LogInfo("mrd serving: grpc unix:", grpc_socket, ", fd socket ", fd_socket,
          debug_tcp.empty() ? ""
                            : absl::StrCat(", debug tcp ", debug_tcp, " (port ",
                                           debug_port, ")"));

  // grpc.health.v1 follows the device: NOT_SERVING while the device reports
  // itself unhealthy (device lost, port down), SERVING again when it
  // recovers. GetDeviceInfo carries the device's own message.
  absl::Notification stop_health;
  std::thread health_watch([&] {
    bool serving = true;
    while (
        !stop_health.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      device::DeviceHealth now = (*device)->Health();
      if (now.healthy != serving) {
        serving = now.healthy;
        health->SetServingStatus(serving);
        if (serving) {
          LogInfo("device healthy again: serving");
        } else {
          LogError("device unhealthy (", now.message, "): NOT_SERVING");
        }
      }
    }
  });

  int sig = 0;
  sigwait(&signals, &sig);
  LogInfo("signal ", sig, ": shutting down");
  stop_health.Notify();
  health_watch.join();
  health->SetServingStatus(false);
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
}  // namespace mrd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "mrd: node-local RDMA memory-registration service.\n"
      "  mrd [--flagfile=/etc/mrd/mrd.flags] [--flags...]");
  absl::ParseCommandLine(argc, argv);
#ifdef NDEBUG
  // Debian's Abseil is built with mutex deadlock detection on, which walks a
  // lock graph on every Lock/Unlock and doubles the cost of a registration
  // cache hit (bench/cache_bench). Debug builds and the unit tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  return mrd::Run();
}
