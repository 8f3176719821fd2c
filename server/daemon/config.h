// What mrd's wiring (server/main.cc) reads from its flags, checked, before
// it makes anything: where its sockets and directories are and who may
// use them, which device it runs and how, the fd budget, and the core's
// limits and tenants; what the metrics say of them. Every error names the
// flag or path at fault.
#ifndef MRD_SERVER_DAEMON_CONFIG_H_
#define MRD_SERVER_DAEMON_CONFIG_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/common/fd_budget.h"
#include "server/core/core.h"
#include "server/device/device.h"
#include "server/device/software/software_device.h"
#include "server/metrics/metrics.h"

namespace mrd::daemon {

struct Config {
  // PreparePaths: trusted directories, and sockets with their defaults in
  // the runtime directory (admin_socket empty: none).
  std::string runtime_dir;
  std::string grpc_socket;
  std::string fd_socket;
  std::string handover_socket;
  std::string admin_socket;
  std::string shm_dir;
  mode_t socket_mode = 0;
  // PreparePeers: who may use the sockets.
  std::vector<uint32_t> uids;
  std::vector<uint32_t> gids;
  std::string debug_tcp;
  // ChooseDevice, and OpenVerbsDevice when it falls back.
  device::PinMethod pin_method{};
  bool use_verbs = false;
  bool device_fallback = false;  // auto: RDMA devices, software device
};

// A start step's error, the text to log.
absl::Status Fail(absl::string_view message);

absl::StatusOr<std::unique_ptr<FdBudget>> PrepareFdBudget();
absl::Status PreparePaths(Config* config);
// Every thread of mrd at --nice (threads started later inherit it). A value
// out of range fails; one mrd may not take is logged and skipped. Returns
// the nice steps below mrd's threads for bulk work: --bulk_nice below the
// nice mrd started with (0 stays 0, no bulk class), at most nice 19.
absl::StatusOr<int> ApplyNice();
absl::Status PreparePeers(Config* config);
absl::Status ChooseDevice(Config* config);
// The verbs device (not started); under --device=auto a failure falls
// back to the software device (config->use_verbs false, *device null),
// loudly.
absl::Status OpenVerbsDevice(Config* config, const std::string& device_flag,
                             std::unique_ptr<device::Device>* device);
// The software device (not started); `peer_listener` (or -1): taking over,
// the running mrd's peer listener, on the same port (the device keeps a
// duplicate).
absl::Status OpenSoftwareDevice(const Config& config, int peer_listener,
                                std::unique_ptr<device::Device>* device);
// The software devices after the first (--software_devices), started:
// device i named "software<i>", its peers on --peer_address's port + i,
// its pins shared with `first` (the software device, unless this refuses).
// Taking over, device i opens on `peer_listeners[i]` (the running mrd's
// device i's; not accepting until the handover commits). Errors:
// --software_devices out of range or with the verbs device,
// OpenSoftwareDevice's, and a device's start.
absl::Status OpenMoreSoftwareDevices(
    const Config& config, const device::Device& first,
    const std::vector<UniqueFd>& peer_listeners,
    std::vector<std::unique_ptr<device::Device>>* more);
// The verbs devices after the first (--verbs_devices: names, or all of the
// node's but `first`), started and appended to `more`: each named by its
// RDMA device, its peers on its port's IPv4 address (its GID table) at
// --peer_address's port. Errors, naming the flag and the device: the
// software device runs, an unknown, duplicate or first device, more than
// core::kMaxDevices in all, a device without an IPv4 address, and a
// device's open or start.
absl::Status OpenMoreVerbsDevices(
    const Config& config, const device::Device& first,
    std::vector<std::unique_ptr<device::Device>>* more);
// Both of the above, started, in `more`.
absl::Status OpenMoreDevices(
    const Config& config, const device::Device& first,
    const std::vector<UniqueFd>& peer_listeners,
    std::vector<std::unique_ptr<device::Device>>* more);
// Every device, started: the first (OpenVerbsDevice or OpenSoftwareDevice),
// then OpenMoreDevices'. `taking_over`: device i opens on
// `peer_listeners[i]`, the running mrd's, and accepts no peer until the
// handover commits.
absl::Status OpenDevices(Config* config, const std::string& device_flag,
                         bool taking_over,
                         const std::vector<UniqueFd>& peer_listeners,
                         std::unique_ptr<device::Device>* first,
                         std::vector<std::unique_ptr<device::Device>>* more);
// Shuts `first`, then `more`, down.
void ShutdownDevices(device::Device* first,
                     const std::vector<std::unique_ptr<device::Device>>& more);
// The core's devices: `first`, then `more`.
std::vector<device::Device*> AllDevices(
    device::Device* first,
    const std::vector<std::unique_ptr<device::Device>>& more);
// The core's options: limits, tenants, who an anonymous lease session may
// be; warns when mrd cannot pin what its limits allow.
absl::Status MakeCoreOptions(const Config& config, const device::Device& device,
                             FdBudget* fd_budget, core::CoreOptions* options);

// Each configured limit, the flag's name (without --) and its value, for
// the metrics.
std::vector<std::pair<std::string, double>> LimitsOf(
    const core::CoreOptions& options);
// A device's peer path gauges, for the metrics.
metrics::PeerPathGauges PeerPathGaugesOf(const device::PeerPathCounts& counts);

// A configuration file of at most 1 MiB.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path);

}  // namespace mrd::daemon

#endif  // MRD_SERVER_DAEMON_CONFIG_H_
