// mrd: the node-local memory-registration service. Wires the device, the
// core, the fd socket, the gRPC server (with health and reflection) and the
// metrics exposer together, then waits for SIGTERM/SIGINT and shuts down in
// order: NOT_SERVING first, then every session is released (nothing stays
// pinned), then the servers and the device stop. SIGHUP is a reload: mrd
// starts its successor (its own binary, its arguments and --takeover), which
// takes over everything through the live handover.
//
// The flags, what is read from them before anything is made, and the
// successor of a reload are server/daemon's; the live handover itself is
// server/handover's (ProcessHandover), which reaches each piece wired here
// through the participant it serves. Every flag can also come from a flag
// file: mrd --flagfile=/etc/mrd/mrd.flags (one --name=value per line; see
// docs/CONFIG.md).

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
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
#include "server/common/prefault.h"
#include "server/common/sd_notify.h"
#include "server/common/thread.h"
#include "server/common/tsan.h"
#include "server/core/core.h"
#include "server/core/handover_participant.h"
#include "server/daemon/config.h"
#include "server/daemon/directory.h"
#include "server/daemon/flags.h"
#include "server/daemon/process.h"
#include "server/device/device.h"
#include "server/device/device_handover.h"
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

namespace mrd {
namespace {

// Readiness's health service ("" is liveness: the process serves).
constexpr char kServiceName[] = "mrd.v1.MemoryRegistration";
// How often tenants that hold nothing and have no session are forgotten.
constexpr absl::Duration kTenantPruneInterval = absl::Seconds(30);

// Everything mrd runs, in the order it starts (and, reversed, the order the
// members are destroyed in when a start fails part-way). Each step returns
// the error to log, with the text that names the flag or path at fault.
// A live handover is the process handover's (server/handover); the daemon
// hands it the pieces that take part, and takes part itself with the gRPC
// server, health and admin socket it runs (Retire).
class Daemon final : public handover::Participant {
 public:
  explicit Daemon(daemon::Invocation invocation)
      : status_(absl::GetFlag(FLAGS_handover_status_file)),
        reloader_(std::move(invocation)) {}
  // The workers go before the core: no teardown may be left on them.
  ~Daemon() override {
    if (core_ != nullptr) core_->SetTeardownRunner(nullptr);
  }
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
  // --takeover: asks the running mrd to hand over (the devices open on
  // its peer listeners meanwhile).
  absl::Status BeginTakeover();

  // Committed: clients' channels hear GOAWAY, the server and the health
  // watch stop, the admin socket closes (its path is the new process's).
  void Retire() override;

  // `peer_listeners`: taking over, the running mrd's, by device.
  absl::Status OpenDevice(std::vector<UniqueFd> peer_listeners = {});
  absl::Status StartCore();
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
  // Readiness: each device's (kServiceName/<device>), the directory's
  // (kServiceName/directory) and the whole's (SERVING while a device is).
  void UpdateReadiness();

  std::unique_ptr<FdBudget> fd_budget_;
  daemon::Config config_;  // paths, peers, the device chosen
  std::unique_ptr<device::Device> device_;
  // --software_devices, --verbs_devices: the devices after the first.
  std::vector<std::unique_ptr<device::Device>> more_devices_;
  core::CoreOptions core_options_;
  // The directory (--etcd_endpoints), outliving the core that publishes.
  daemon::DirectoryParticipant directory_;
  std::unique_ptr<core::Core> core_;
  // Replaced only by a handover that failed (the fd socket's Thaw).
  std::unique_ptr<fd_socket::FdServer> fd_server_;
  service::GrpcAcceptorOptions acceptor_options_;
  // The gRPC socket's acceptor, replaced only by a handover that failed.
  service::GrpcAcceptorParticipant acceptor_;
  std::unique_ptr<metrics::Metrics> metrics_;
  bool ready_ = false;  // readiness as last set (UpdateReadiness)
  std::unique_ptr<FairScheduler> workers_;
  int bulk_nice_ = 0;  // steps below mrd's threads (daemon::ApplyNice)
  std::unique_ptr<service::MrdService> service_;
  std::unique_ptr<grpc::Server> server_;
  // The administrative service (tenants' quotas, weights): its own server.
  std::unique_ptr<service::AdminService> admin_service_;
  std::unique_ptr<grpc::Server> admin_server_;
  std::unique_ptr<service::GrpcAcceptor> admin_acceptor_;
  grpc::HealthCheckServiceInterface* health_ = nullptr;
  absl::Notification stop_health_;
  Thread health_watch_;

  // Live handover: the pieces that take part, in the order they freeze
  // (server/handover/participant.h), and the handover that runs them.
  handover::StatusFile status_;  // --handover_status_file
  service::CallGateParticipant gate_handover_{
      absl::GetFlag(FLAGS_handover_drain_timeout)};
  fd_socket::FdSocketParticipant fd_handover_;
  core::CoreParticipant core_handover_{
      absl::GetFlag(FLAGS_handover_drain_timeout)};
  metrics::MetricsParticipant metrics_handover_;
  std::unique_ptr<handover::ProcessHandover> handover_;

  // SIGHUP's successor (main thread only).
  daemon::Reloader reloader_;
};

absl::Status Daemon::Start() {
  const std::string after = absl::GetFlag(FLAGS_after_handover);
  if (after != "exit" && after != "wait") {
    return daemon::Fail(absl::StrCat(
        "--after_handover must be exit or wait, not '", after, "'"));
  }
  if (absl::GetFlag(FLAGS_takeover)) WriteStatus("taking-over");
  MRD_ASSIGN_OR_RETURN(fd_budget_, daemon::PrepareFdBudget());
  MRD_ASSIGN_OR_RETURN(bulk_nice_, daemon::ApplyNice());
  MRD_RETURN_IF_ERROR(daemon::PreparePaths(&config_));
  MRD_RETURN_IF_ERROR(daemon::PreparePeers(&config_));
  ConfigurePrefault(absl::GetFlag(FLAGS_prefault_threads));
  MRD_RETURN_IF_ERROR(daemon::ChooseDevice(&config_));
  handover::ProcessHandoverOptions options;
  options.socket = config_.handover_socket;
  options.mrd_version = MRD_VERSION;
  options.timeout = absl::GetFlag(FLAGS_handover_timeout);
  options.fault = absl::GetFlag(FLAGS_handover_test_fault);
  options.stay = after == "wait";
  options.status = &status_;
  options.pinned_bytes = [this] { return device_->PinnedBytes(); };
  handover_ = std::make_unique<handover::ProcessHandover>(
      std::move(options),
      std::vector<handover::Participant*>{
          &gate_handover_, &fd_handover_, &acceptor_, &core_handover_,
          &directory_, &metrics_handover_, this});
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

absl::Status Daemon::OpenDevice(std::vector<UniqueFd> peer_listeners) {
  MRD_RETURN_IF_ERROR(daemon::OpenDevices(
      &config_, absl::GetFlag(FLAGS_device), handover_->taking_over(),
      peer_listeners, &device_, &more_devices_));
  core_handover_.SetDevices(daemon::AllDevices(device_.get(), more_devices_));
  return absl::OkStatus();
}

absl::Status Daemon::StartCore() {
  MRD_RETURN_IF_ERROR(daemon::MakeCoreOptions(
      config_, *device_, fd_budget_.get(), &core_options_));
  core_ = std::make_unique<core::Core>(
      daemon::AllDevices(device_.get(), more_devices_), RealClock::Get(),
      core_options_);
  core_handover_.SetCore(core_.get());
  if (absl::Status s = core_->Start(); !s.ok()) {
    return daemon::Fail(absl::StrCat("core: ", s.ToString()));
  }
  return directory_.Start(core_.get(), handover_->taking_over());
}

absl::Status Daemon::StartFdSocket() {
  fd_socket::FdServerOptions options;
  options.read_cgroup = core_options_.tenant_key != TenantKeyKind::kUid;
  options.path = config_.fd_socket;
  options.mode = config_.socket_mode;
  options.allowed_uids = config_.uids;
  options.allowed_gids = config_.gids;
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
    return daemon::Fail(
        absl::StrCat("fd socket: ", server.status().ToString()));
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
  acceptor_options_.socket_path = config_.grpc_socket;
  acceptor_options_.socket_mode = config_.socket_mode;
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
    return daemon::Fail(
        absl::StrCat("gRPC socket: ", acceptor.status().ToString()));
  }
  acceptor_.Set(acceptor_options_, *std::move(acceptor));
  return absl::OkStatus();
}

absl::Status Daemon::StartMetrics() {
  metrics_ = std::make_unique<metrics::Metrics>(core_.get(), fd_budget_.get());
  SetMetricsSources();
  metrics_->SetLimits(daemon::LimitsOf(core_options_));
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
    return daemon::Fail(absl::StrCat("metrics: ", served.ToString()));
  }
  LogInfo("metrics at http://", address, "/metrics");
  return absl::OkStatus();
}

void Daemon::SetMetricsSources() {
  if (device_->PeerPath().has_value()) {
    // A device that keeps its peer path's gauges (the software device).
    metrics_->SetPeerPathSource([device = device_.get()] {
      return daemon::PeerPathGaugesOf(
          device->PeerPath().value_or(device::PeerPathCounts()));
    });
  }
  // A handover that fails replaces the acceptor (Resume).
  metrics_->SetGrpcConnectionsSource([this] { return acceptor_.Stats(); });
  metrics::ServerInfo info;
  info.version = MRD_VERSION;
  info.revision = MRD_REVISION;
  info.device = config_.use_verbs ? "verbs" : "software";
  info.device_fallback = config_.device_fallback;
  metrics_->SetServerInfo(info);
  metrics_->SetHandoverSource(
      [this] { return metrics::GaugesOf(handover_->counts()); });
}

absl::Status Daemon::StartGrpc() {
  workers_ = std::make_unique<FairScheduler>();
  FairSchedulerOptions scheduling;
  scheduling.workers = absl::GetFlag(FLAGS_worker_threads);
  const bool fair = absl::GetFlag(FLAGS_fair_scheduling);
  scheduling.spare_workers =
      fair ? absl::GetFlag(FLAGS_spare_worker_threads) : 0;
  scheduling.bulk_nice = fair ? bulk_nice_ : 0;
  scheduling.bulk_cost = absl::GetFlag(FLAGS_bulk_work_pages);
  scheduling.bulk_slots = fair ? absl::GetFlag(FLAGS_bulk_workers) : 0;
  if (absl::Status s = workers_->Start(scheduling); !s.ok()) {
    return daemon::Fail(absl::StrCat(
        "--worker_threads, --bulk_nice, --bulk_workers: ", s.ToString()));
  }
  metrics_->SetSchedulerSource(
      [workers = workers_.get()] { return workers->Stats(); });
  // Sessions that end by a hang-up are released on the workers, not on the
  // fd socket's thread, which every tenant's imports wait for.
  core_->SetTeardownRunner(service::TeardownsOnWorkers(workers_.get(), fair));
  service_ = std::make_unique<service::MrdService>(core_.get(), workers_.get(),
                                                   metrics_.get(), fair);
  gate_handover_.SetGate(&service_->gate());
  // Made before any gRPC thread exists (the servers below start them): its
  // handlers are then made before every thread that calls them.
  if (!config_.admin_socket.empty()) {
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
  if (!config_.debug_tcp.empty()) {
    builder.AddListeningPort(config_.debug_tcp,
                             grpc::InsecureServerCredentials(), &debug_port);
  }
  builder.RegisterService(service_.get());
  // docs/RELIABILITY.md, "A connection's open calls are bounded".
  service::BoundOpenCallsPerConnection(
      builder, absl::GetFlag(FLAGS_grpc_max_streams_per_connection));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return daemon::Fail(absl::StrCat("cannot start the gRPC server",
                                     config_.debug_tcp.empty() ? "" : " on ",
                                     config_.debug_tcp));
  }
  // gRPC's health service answers SERVING from the start: readiness waits
  // until everything below serves too (the admin socket among it).
  health_ = server_->GetHealthCheckService();
  health_->SetServingStatus(false);
  health_->SetServingStatus(kServiceName, false);
  if (absl::Status s = acceptor_.Start(server_.get()); !s.ok()) {
    server_->Shutdown();
    return daemon::Fail(absl::StrCat("gRPC acceptor: ", s.ToString()));
  }
  LogInfo("gRPC connections: at most ", acceptor_options_.max_connections, ", ",
          acceptor_options_.max_connections_per_tenant, " per tenant, ",
          absl::GetFlag(FLAGS_grpc_max_streams_per_connection),
          " open calls each (0: no limit)");
  MRD_RETURN_IF_ERROR(StartAdmin());
  // "" (the server) and mrd's service name: Kubernetes gRPC probes and
  // grpc_health_probe ask for a service by name.
  health_->SetServingStatus(true);
  UpdateReadiness();
  LogInfo("mrd serving: grpc unix:", config_.grpc_socket, ", fd socket ",
          config_.fd_socket,
          config_.debug_tcp.empty()
              ? ""
              : absl::StrCat(", debug tcp ", config_.debug_tcp, " (port ",
                             debug_port, ")"));
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
    return daemon::Fail("cannot start the administrative gRPC server");
  }
  service::GrpcAcceptorOptions options;
  options.socket_path = config_.admin_socket;
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
    return daemon::Fail(absl::StrCat("admin socket ", config_.admin_socket,
                                     ": ", started.ToString()));
  }
  admin_acceptor_ = *std::move(acceptor);
  LogInfo("admin socket ", config_.admin_socket, " (root and uid ", ::geteuid(),
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

// Liveness is "" (the server): SERVING until shutdown, whatever the devices
// do, so that a port flap never gets mrd restarted (ending every session).
// Readiness follows the devices (UpdateReadiness). The same thread samples
// the open fds once a second (loud log when the fd reserve is being eaten).
absl::Status Daemon::StartHealthWatch() {
  absl::StatusOr<Thread> watch =
      Thread::Start("mrd-health", [this] { WatchHealth(); });
  if (!watch.ok()) {
    acceptor_.Shutdown();
    server_->Shutdown();
    fd_server_->Shutdown();
    core_->Shutdown();
    daemon::ShutdownDevices(device_.get(), more_devices_);
    return daemon::Fail(
        absl::StrCat("health watch: ", watch.status().ToString()));
  }
  health_watch_ = std::move(*watch);
  return absl::OkStatus();
}

void Daemon::WatchHealth() {
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
    UpdateReadiness();
  }
}

void Daemon::UpdateReadiness() {
  for (const core::DeviceState& d : core_->TakeDeviceHealthChanges()) {
    health_->SetServingStatus(absl::StrCat(kServiceName, "/", d.name),
                              d.healthy);
  }
  if (std::optional<bool> serving = directory_.TakeServingChange()) {
    health_->SetServingStatus(absl::StrCat(kServiceName, "/directory"),
                              *serving);
  }
  bool any = false;
  for (const core::DeviceState& d : core_->DeviceStates()) any |= d.healthy;
  if (any == ready_) return;
  ready_ = any;
  health_->SetServingStatus(kServiceName, any);
  LogLine(any ? LogLevel::kInfo : LogLevel::kError,
          any ? "a device is healthy: readiness SERVING"
              : "no device is healthy: readiness NOT_SERVING (liveness stays "
                "SERVING)");
}

// --- live handover -----------------------------------------------------------

absl::Status Daemon::BeginTakeover() {
  v1::HandoverHello hello;
  hello.set_device_kind(config_.use_verbs ? "verbs" : "software");
  hello.set_device_name(config_.use_verbs ? absl::GetFlag(FLAGS_verbs_device)
                                          : "software");
  hello.set_device_count(
      config_.use_verbs ? 1 : absl::GetFlag(FLAGS_software_devices));
  return handover_->BeginTakeover(std::move(hello),
                                  [this](std::vector<UniqueFd> listeners) {
                                    if (device_ != nullptr)
                                      return absl::OkStatus();
                                    return OpenDevice(std::move(listeners));
                                  });
}

void Daemon::Retire() {
  health_->SetServingStatus(false);
  health_->SetServingStatus(kServiceName, false);
  // Clients' channels hear GOAWAY and reconnect, to the new process.
  StopAdmin(/*handed_over=*/true);
  ShutdownUnrecorded(*server_, std::chrono::milliseconds(500));
  // The health watch uses the server's health service: stopped first. The
  // server goes whole, its threads joined.
  stop_health_.Notify();
  health_watch_.Join();
  server_.reset();
}

void Daemon::ServeUntil(const sigset_t& signals) {
  int sig = 0;
  for (;;) {
    if (sigwait(&signals, &sig) != 0) continue;
    if (sig == SIGHUP) {
      reloader_.Reload(handover_->committed(), handover_->listening(),
                       config_.handover_socket);
    } else if (sig == SIGCHLD) {
      reloader_.Reap(handover_->committed());
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
  reloader_.Stop();
  handover_->Shutdown();
  stop_health_.Notify();
  health_watch_.Join();
  health_->SetServingStatus(false);
  health_->SetServingStatus(kServiceName, false);
  acceptor_.Shutdown();
  StopAdmin();
  fd_server_->Shutdown();
  core_->Shutdown();
  // The lease goes, and every entry with it, unless they were handed over.
  directory_.Stop(handover_->committed());
  // Every session is released by now; what remains are idle client channels
  // and open streams, which gRPC would otherwise wait on until the deadline.
  ShutdownUnrecorded(*server_, std::chrono::milliseconds(500));
  // Calls still running on the workers end before what they use goes.
  if (!workers_->Drain(absl::Seconds(10))) LogWarning("workers still busy");
  TsanTakeOverFromGrpc();  // and after what gRPC's callbacks did
  daemon::ShutdownDevices(device_.get(), more_devices_);
  unlink(config_.grpc_socket.c_str());
  WriteStatus("stopped");
  LogInfo("mrd stopped; device pinned bytes: ", device_->PinnedBytes());
}

int Run(daemon::Invocation invocation) {
  if (absl::GetFlag(FLAGS_await_handover) > absl::ZeroDuration()) {
    return daemon::AwaitHandover(absl::GetFlag(FLAGS_handover_status_file),
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

}  // namespace

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
      mrd::daemon::PrintHelp(kUsage);
      return 0;
    }
    if (arg == "--version") {
      std::cout << "mrd " << MRD_VERSION << "\n";
      return 0;
    }
  }
  // Before the flags are parsed (and PATH or the directory could change).
  mrd::daemon::Invocation invocation = mrd::daemon::InvocationOf(argc, argv);
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
