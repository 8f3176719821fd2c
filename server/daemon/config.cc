#include "server/daemon/config.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "mrd/net.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "server/common/cgroup_identity.h"
#include "server/common/log.h"
#include "server/common/path_trust.h"
#include "server/common/thread.h"
#include "server/core/core.h"
#include "server/daemon/flags.h"
#include "server/device/verbs/verbs_device.h"
#include "server/device/verbs/verbs_sysfs.h"

namespace mrd::daemon {
namespace {

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

void SetCoreLimits(const Config& config, const device::Device& device,
                   FdBudget* fd_budget, core::CoreOptions* options) {
  core::CoreOptions& o = *options;
  o.shm_dir = config.shm_dir;
  o.allowed_uids = config.uids;
  o.default_lease_ttl = absl::GetFlag(FLAGS_lease_ttl);
  o.max_lease_ttl = absl::GetFlag(FLAGS_max_lease_ttl);
  o.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  o.max_buffer_size = absl::GetFlag(FLAGS_max_buffer_size).bytes;
  o.max_session_pinned_bytes =
      absl::GetFlag(FLAGS_max_session_pinned_bytes).bytes;
  o.max_total_pinned_bytes = absl::GetFlag(FLAGS_max_total_pinned_bytes).bytes;
  o.max_session_registrations = absl::GetFlag(FLAGS_max_session_registrations);
  o.max_total_registrations = absl::GetFlag(FLAGS_max_total_registrations);
  o.warm_pin_bytes_per_session =
      absl::GetFlag(FLAGS_warm_pin_bytes_per_session).bytes;
  o.warm_pin_bytes_total = absl::GetFlag(FLAGS_warm_pin_bytes_total).bytes;
  o.fd_budget = fd_budget;
  if (!device.Attributes().shares_pins && o.warm_pin_bytes_total != 0) {
    // Measured (docs/PERFORMANCE.md): on a device that pins per registration
    // a warm pin is one more registration and makes re-registering slower.
    LogInfo("device ", device.Attributes().name,
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
absl::Status SetTenants(const device::Device& device,
                        core::CoreOptions* options) {
  core::TenantTableOptions tenant_options;
  tenant_options.default_percent = absl::GetFlag(FLAGS_tenant_default_percent);
  auto total = [&](core::TenantResource r) -> uint64_t& {
    return tenant_options.totals[static_cast<int>(r)];
  };
  total(core::TenantResource::kSessions) = options->max_sessions;
  total(core::TenantResource::kBuffers) = options->max_total_buffers;
  total(core::TenantResource::kRegistrations) =
      options->max_total_registrations;
  total(core::TenantResource::kPinnedBytes) = options->max_total_pinned_bytes;
  total(core::TenantResource::kLams) = options->max_total_lams;
  total(core::TenantResource::kMrs) = options->max_total_mrs;
  total(core::TenantResource::kPeerConnections) =
      absl::GetFlag(FLAGS_peer_max_connections);
  // The device's budget of memory maps (0: its pins cost none).
  total(core::TenantResource::kMemoryMaps) = device.Attributes().max_map_splits;
  total(core::TenantResource::kPublished) =
      absl::GetFlag(FLAGS_directory_max_entries);
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
      core::TenantTable::Create(tenant_options, text);
  if (!tenants.ok()) {
    return Fail(absl::StrCat("--tenants_file=", path, ": ",
                             tenants.status().message()));
  }
  options->tenants = std::move(*tenants);
  absl::StatusOr<TenantKeyKind> key =
      ParseTenantKeyKind(absl::GetFlag(FLAGS_tenant_key));
  if (!key.ok()) {
    return Fail(absl::StrCat("--tenant_key: ", key.status().message()));
  }
  options->tenant_key = *key;
  options->kubelet_pod_logs_dir = absl::GetFlag(FLAGS_kubelet_pod_logs_dir);
  return absl::OkStatus();
}
}  // namespace

absl::Status Fail(absl::string_view message) {
  return absl::InternalError(message);
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

/// File descriptors (docs/RELIABILITY.md): the highest open-file limit we may
// have, and a budget for clients that leaves a reserve for mrd itself.
absl::StatusOr<std::unique_ptr<FdBudget>> PrepareFdBudget() {
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
  return std::move(*budget);
}

absl::StatusOr<int> ApplyNice() {
  errno = 0;
  const int started = ::getpriority(PRIO_PROCESS, 0);
  if (errno != 0) return Fail("getpriority failed");
  const int nice = absl::GetFlag(FLAGS_nice);
  const int bulk = absl::GetFlag(FLAGS_bulk_nice);
  absl::Status s = SetProcessNice(nice);
  if (s.ok()) {
    LogInfo("mrd's threads run at nice ", nice, " (--nice)");
    // Bulk work stays behind processes at the nice mrd started with.
    if (bulk <= 0 || bulk > 19) return bulk;  // off, or refused by name
    return std::min({19, 19 - nice, started - nice + bulk});
  }
  if (GetErrorDetail(s).reason() != "NICE_NOT_PERMITTED") {
    return Fail(absl::StrCat("--nice: ", s.message()));
  }
  LogWarning("mrd's threads stay at nice ", started, ", not --nice=", nice,
             ": ", s.message(),
             "; a busy client on mrd's CPUs can delay its answers");
  return bulk;
}

// Directories someone else could change are refused (docs/RELIABILITY.md,
// "Runtime directory and shm_dir"): whoever can rename our sockets can
// listen in their place and be handed our clients' memory.
absl::Status PreparePaths(Config* config) {
  config->runtime_dir = absl::GetFlag(FLAGS_runtime_dir);
  if (config->runtime_dir.empty()) config->runtime_dir = DefaultRuntimeDir();
  absl::StatusOr<std::string> trusted =
      PrepareRuntimeDir(config->runtime_dir, geteuid());
  if (!trusted.ok()) {
    return Fail(absl::StrCat("refusing to start: runtime dir ",
                             config->runtime_dir, ": ",
                             trusted.status().message()));
  }
  config->runtime_dir = *std::move(trusted);
  config->grpc_socket = absl::GetFlag(FLAGS_grpc_socket);
  config->fd_socket = absl::GetFlag(FLAGS_fd_socket);
  config->handover_socket = absl::GetFlag(FLAGS_handover_socket);
  for (std::string* socket :
       {&config->grpc_socket, &config->fd_socket, &config->handover_socket}) {
    if (socket->empty()) continue;
    absl::StatusOr<std::string> checked = CheckSocketPath(*socket, geteuid());
    if (!checked.ok()) {
      return Fail(absl::StrCat("refusing to start: socket ", *socket, ": ",
                               checked.status().message()));
    }
    *socket = *std::move(checked);
  }
  if (config->handover_socket.empty()) {
    config->handover_socket = config->runtime_dir + "/handover.sock";
  }
  if (config->grpc_socket.empty())
    config->grpc_socket = config->runtime_dir + "/mrd.sock";
  config->admin_socket = absl::GetFlag(FLAGS_admin_socket);
  if (config->admin_socket.empty())
    config->admin_socket = config->runtime_dir + "/admin.sock";
  if (config->admin_socket == "none") config->admin_socket.clear();
  if (config->fd_socket.empty())
    config->fd_socket = config->runtime_dir + "/fd.sock";
  config->shm_dir = absl::GetFlag(FLAGS_shm_dir);
  if (!config->shm_dir.empty()) {
    // Created if missing (sticky and world-writable, like /dev/shm), so that
    // `make run` works on a fresh machine; refused off tmpfs/hugetlbfs.
    absl::StatusOr<std::string> shm = PrepareShmDir(config->shm_dir, geteuid());
    if (!shm.ok()) {
      return Fail(absl::StrCat("refusing to start: --shm_dir ", config->shm_dir,
                               ": ", shm.status().message()));
    }
    config->shm_dir = *std::move(shm);
  }
  config->socket_mode = static_cast<mode_t>(
      std::strtoul(absl::GetFlag(FLAGS_socket_mode).c_str(), nullptr, 8));
  return absl::OkStatus();
}

// Who may use the sockets.
absl::Status PreparePeers(Config* config) {
  absl::StatusOr<std::vector<uint32_t>> uids =
      ParseIds(absl::GetFlag(FLAGS_allowed_uids), "allowed_uids");
  absl::StatusOr<std::vector<uint32_t>> gids =
      ParseIds(absl::GetFlag(FLAGS_allowed_gids), "allowed_gids");
  if (!uids.ok() || !gids.ok()) {
    return Fail(!uids.ok() ? uids.status().message() : gids.status().message());
  }
  config->uids = *std::move(uids);
  config->gids = *std::move(gids);
  if (config->uids.empty() && config->gids.empty() &&
      !absl::GetFlag(FLAGS_allow_any_peer)) {
    config->uids.push_back(geteuid());
  }
  config->debug_tcp = absl::GetFlag(FLAGS_debug_tcp_address);
  if (!config->debug_tcp.empty() && !IsLoopback(config->debug_tcp)) {
    return Fail(absl::StrCat(
        "--debug_tcp_address=", config->debug_tcp,
        " is not a loopback address; the debug listener has no "
        "authentication and may only listen on 127.0.0.0/8 or [::1]"));
  }
  return absl::OkStatus();
}

absl::Status ChooseDevice(Config* config) {
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
  config->pin_method = *pin_method;
  config->use_verbs = device_flag == "verbs";
  if (device_flag == "auto") {
    std::vector<std::string> verbs_devices = device::ListVerbsDevices();
    config->use_verbs = !verbs_devices.empty();
    LogInfo("device auto: ",
            config->use_verbs
                ? absl::StrCat("RDMA device(s) ",
                               absl::StrJoin(verbs_devices, ", "),
                               " found; using the verbs device")
                : "no RDMA device found; using the software device");
  }
  return absl::OkStatus();
}

// The verbs device; under --device=auto a failure falls back to the
// software device (config->use_verbs false), loudly.
absl::Status OpenVerbsDevice(Config* config, const std::string& device_flag,
                             std::unique_ptr<device::Device>* device) {
  device::VerbsDeviceOptions options;
  options.device_name = absl::GetFlag(FLAGS_verbs_device);
  options.peer_address = absl::GetFlag(FLAGS_peer_address);
  absl::StatusOr<std::unique_ptr<device::VerbsDevice>> verbs =
      device::VerbsDevice::Create(options);
  if (verbs.ok()) {
    *device = std::move(*verbs);
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
  config->use_verbs = false;
  config->device_fallback = true;
  return absl::OkStatus();
}

namespace {

absl::Status OpenSoftwareDeviceNumber(const Config& config, int peer_listener,
                                      uint32_t index,
                                      const device::SoftwareDevice* first,
                                      std::unique_ptr<device::Device>* device);

}  // namespace

absl::Status OpenSoftwareDevice(const Config& config, int peer_listener,
                                std::unique_ptr<device::Device>* device) {
  return OpenSoftwareDeviceNumber(config, peer_listener, 0, nullptr, device);
}

absl::Status OpenMoreSoftwareDevices(
    const Config& config, const device::Device& first,
    const std::vector<UniqueFd>& peer_listeners,
    std::vector<std::unique_ptr<device::Device>>* more) {
  const uint32_t count = absl::GetFlag(FLAGS_software_devices);
  if (count < 1 || count > core::kMaxDevices) {
    return Fail(absl::StrCat("refusing to start: --software_devices=", count,
                             " must be 1 to ", core::kMaxDevices));
  }
  if (count > 1 && config.use_verbs) {
    return Fail(absl::StrCat(
        "refusing to start: --software_devices=", count,
        " needs the software device, and mrd runs the verbs device"));
  }
  // Not the verbs device: the first is the software device, whose pins the
  // others share (a page registered on several is pinned once).
  const auto* software = static_cast<const device::SoftwareDevice*>(&first);
  for (uint32_t i = 1; i < count; ++i) {
    const int listener =
        i < peer_listeners.size() ? peer_listeners[i].get() : -1;
    std::unique_ptr<device::Device> device;
    MRD_RETURN_IF_ERROR(
        OpenSoftwareDeviceNumber(config, listener, i, software, &device));
    // Taking over: no peer is accepted before commit, when every ticket and
    // key is this process's.
    if (listener >= 0) (void)device->handover().StopPeerAccepting();
    if (absl::Status s = device->Start(); !s.ok()) {
      return Fail(absl::StrCat(device->Attributes().name,
                               " device start: ", s.ToString()));
    }
    LogInfo("device: ", device->Attributes().name, ", peers connect to ",
            device->Attributes().peer_address);
    more->push_back(std::move(device));
  }
  return absl::OkStatus();
}

namespace {

// The devices --verbs_devices names beside `first`, checked: each exists,
// none twice, not `first`.
absl::StatusOr<std::vector<std::string>> MoreVerbsDeviceNames(
    const std::string& flag, const std::string& first) {
  const std::vector<std::string> existing = device::ListVerbsDevices();
  std::vector<std::string> names;
  if (flag == "all") {
    for (const std::string& name : existing) {
      if (name != first) names.push_back(name);
    }
    return names;
  }
  for (absl::string_view part : absl::StrSplit(flag, ',')) {
    const std::string name(absl::StripAsciiWhitespace(part));
    if (name.empty()) {
      return Fail(
          absl::StrCat("--verbs_devices=", flag, " has an empty device name"));
    }
    if (name == first) {
      return Fail(absl::StrCat("--verbs_devices names ", name,
                               ", which is already mrd's first device "
                               "(--verbs_device, --peer_address)"));
    }
    if (std::find(names.begin(), names.end(), name) != names.end()) {
      return Fail(absl::StrCat("--verbs_devices names ", name, " twice"));
    }
    if (std::find(existing.begin(), existing.end(), name) == existing.end()) {
      return Fail(absl::StrCat("--verbs_devices: no RDMA device named '", name,
                               "'; devices: ", absl::StrJoin(existing, ", ")));
    }
    names.push_back(name);
  }
  return names;
}

}  // namespace

absl::Status OpenMoreVerbsDevices(
    const Config& config, const device::Device& first,
    std::vector<std::unique_ptr<device::Device>>* more) {
  const std::string flag = absl::GetFlag(FLAGS_verbs_devices);
  if (flag.empty()) return absl::OkStatus();
  if (!config.use_verbs) {
    return Fail(absl::StrCat("refusing to start: --verbs_devices=", flag,
                             " needs the verbs device, and mrd runs the "
                             "software device"));
  }
  MRD_ASSIGN_OR_RETURN(const std::vector<std::string> names,
                       MoreVerbsDeviceNames(flag, first.Attributes().name));
  if (1 + more->size() + names.size() > core::kMaxDevices) {
    return Fail(absl::StrCat("refusing to start: --verbs_devices=", flag,
                             " makes ", 1 + more->size() + names.size(),
                             " devices; mrd serves at most ",
                             core::kMaxDevices));
  }
  const std::string peer_address = absl::GetFlag(FLAGS_peer_address);
  absl::StatusOr<std::pair<std::string, std::string>> host_port =
      peer::SplitHostPort(peer_address);
  if (!host_port.ok()) {
    return Fail(absl::StrCat("--peer_address ", peer_address, ": ",
                             host_port.status().message()));
  }
  for (const std::string& name : names) {
    // Each device's peers connect to its own interface's address.
    absl::StatusOr<std::string> address = device::VerbsDeviceIpv4Address(name);
    if (!address.ok()) {
      return Fail(
          absl::StrCat("--verbs_devices: ", address.status().message()));
    }
    device::VerbsDeviceOptions options;
    options.device_name = name;
    // The core's device 1 + more->size(): its connection ids say so.
    options.connection_id_base = (uint64_t{1} + more->size())
                                 << core::Session::kDeviceShift;
    options.peer_address = absl::StrCat(*address, ":", host_port->second);
    absl::StatusOr<std::unique_ptr<device::VerbsDevice>> verbs =
        device::VerbsDevice::Create(options);
    if (!verbs.ok()) {
      return Fail(absl::StrCat("--verbs_devices: verbs device ", name, ": ",
                               verbs.status().ToString()));
    }
    if (absl::Status s = (*verbs)->Start(); !s.ok()) {
      return Fail(
          absl::StrCat("verbs device ", name, " start: ", s.ToString()));
    }
    LogInfo("device: verbs (", name, "), peers connect to ",
            (*verbs)->Attributes().peer_address);
    more->push_back(*std::move(verbs));
  }
  return absl::OkStatus();
}

absl::Status OpenMoreDevices(
    const Config& config, const device::Device& first,
    const std::vector<UniqueFd>& peer_listeners,
    std::vector<std::unique_ptr<device::Device>>* more) {
  MRD_RETURN_IF_ERROR(
      OpenMoreSoftwareDevices(config, first, peer_listeners, more));
  return OpenMoreVerbsDevices(config, first, more);
}

absl::Status OpenDevices(Config* config, const std::string& device_flag,
                         bool taking_over,
                         const std::vector<UniqueFd>& peer_listeners,
                         std::unique_ptr<device::Device>* first,
                         std::vector<std::unique_ptr<device::Device>>* more) {
  if (config->use_verbs) {
    MRD_RETURN_IF_ERROR(OpenVerbsDevice(config, device_flag, first));
  }
  if (!config->use_verbs) {
    MRD_RETURN_IF_ERROR(OpenSoftwareDevice(
        *config, peer_listeners.empty() ? -1 : peer_listeners[0].get(), first));
  }
  device::Device& device = **first;
  if (taking_over) {
    // Taking over: no peer is accepted before commit, when every ticket
    // and key is this process's (the handover's commit resumes accepting).
    (void)device.handover().StopPeerAccepting();
  }
  const std::string kind = device.Attributes().kind;
  if (absl::Status s = device.Start(); !s.ok()) {
    return Fail(absl::StrCat(kind, " device start: ", s.ToString()));
  }
  LogInfo("device: ", kind, " (", device.Attributes().name,
          "), peers connect to ", device.Attributes().peer_address);
  return OpenMoreDevices(*config, device, peer_listeners, more);
}

void ShutdownDevices(device::Device* first,
                     const std::vector<std::unique_ptr<device::Device>>& more) {
  first->Shutdown();
  for (const std::unique_ptr<device::Device>& device : more) {
    device->Shutdown();
  }
}

std::vector<device::Device*> AllDevices(
    device::Device* first,
    const std::vector<std::unique_ptr<device::Device>>& more) {
  std::vector<device::Device*> devices = {first};
  for (const std::unique_ptr<device::Device>& device : more) {
    devices.push_back(device.get());
  }
  return devices;
}

namespace {

absl::Status OpenSoftwareDeviceNumber(const Config& config, int peer_listener,
                                      uint32_t index,
                                      const device::SoftwareDevice* first,
                                      std::unique_ptr<device::Device>* device) {
  device::SoftwareDeviceOptions options;
  options.share_pins_with = first;
  options.peer_listen_address = absl::GetFlag(FLAGS_peer_address);
  options.connection_id_base = uint64_t{index} << core::Session::kDeviceShift;
  if (index > 0) {
    options.name = absl::StrCat("software", index);
    // Device i's peers on the port after device i - 1's (any free one when
    // the first's is).
    absl::StatusOr<std::pair<std::string, std::string>> host_port =
        peer::SplitHostPort(options.peer_listen_address);
    uint32_t port = 0;
    if (!host_port.ok() || !absl::SimpleAtoi(host_port->second, &port) ||
        port > 65535 - index) {
      return Fail(absl::StrCat("--peer_address ", options.peer_listen_address,
                               " leaves no port for software device ", index));
    }
    options.peer_listen_address =
        absl::StrCat(host_port->first.find(':') != std::string::npos
                         ? absl::StrCat("[", host_port->first, "]")
                         : host_port->first,
                     ":", port == 0 ? 0 : port + index);
  }
  options.pin_options.method = config.pin_method;
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
  options.peer_buffer_bytes = absl::GetFlag(FLAGS_peer_buffer_bytes).bytes;
  options.peer_workers = absl::GetFlag(FLAGS_peer_workers);
  // Taking over: the running mrd's peer listener, on the same port (the
  // device keeps a duplicate).
  options.inherited_peer_listener = peer_listener;
  absl::StatusOr<std::unique_ptr<device::SoftwareDevice>> software =
      device::SoftwareDevice::Create(options);
  if (!software.ok()) {
    return Fail(
        absl::StrCat("software device: ", software.status().ToString()));
  }
  *device = std::move(*software);
  return absl::OkStatus();
}

}  // namespace

absl::Status MakeCoreOptions(const Config& config, const device::Device& device,
                             FdBudget* fd_budget, core::CoreOptions* options) {
  SetCoreLimits(config, device, fd_budget, options);
  MRD_RETURN_IF_ERROR(SetTenants(device, options));
  // Who can reach the gRPC socket is who an anonymous lease session may be:
  // ImportFile opens for it only what such a caller could open itself.
  if (!config.debug_tcp.empty() || (config.socket_mode & S_IWOTH) != 0) {
    options->anonymous_reach = core::CoreOptions::Reach::kAnyone;
  } else if ((config.socket_mode & S_IWGRP) != 0) {
    options->anonymous_reach = core::CoreOptions::Reach::kGroupMember;
    options->anonymous_id = getegid();
  } else {
    options->anonymous_reach = core::CoreOptions::Reach::kUser;
    options->anonymous_id = geteuid();
  }
  WarnIfMemlockTooLow(options->max_total_pinned_bytes);
  return absl::OkStatus();
}

std::vector<std::pair<std::string, double>> LimitsOf(
    const core::CoreOptions& options) {
  const core::CoreOptions& o = options;
  auto d = [](uint64_t v) { return static_cast<double>(v); };
  return {
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
  };
}

metrics::PeerPathGauges PeerPathGaugesOf(const device::PeerPathCounts& c) {
  metrics::PeerPathGauges g;
  g.connections = c.connections;
  g.unauthenticated = c.unauthenticated;
  g.buffered_bytes = c.buffered_bytes;
  g.threads = c.threads;
  g.accepted_total = c.accepted;
  g.refused_total = c.refused;
  g.shed_total = c.shed;
  g.hello_timeouts_total = c.hello_timeouts;
  g.stall_timeouts_total = c.stall_timeouts;
  g.session_limit_refusals_total = c.session_limit_refusals;
  g.max_connections = c.max_connections;
  g.max_unauthenticated = c.max_unauthenticated;
  g.max_buffer_bytes = c.max_buffer_bytes;
  g.max_session_connections = c.max_session_connections;
  return g;
}

}  // namespace mrd::daemon
