// What sysfs says about an RDMA device (/sys/class/infiniband/<device>/),
// read without opening it: where its adapter sits (NUMA node, PCI address),
// which IPv4 address its port has (the IPv4-mapped RoCE GIDs of its GID
// table), and the name of a port's link layer.
#ifndef MRD_SERVER_DEVICE_VERBS_VERBS_SYSFS_H_
#define MRD_SERVER_DEVICE_VERBS_VERBS_SYSFS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace mrd::device {

inline constexpr char kInfinibandSysfs[] = "/sys/class/infiniband";

// The NUMA node of `device`'s adapter (<device>/device/numa_node); -1 when
// sysfs does not say (no such file, or a device without a parent).
int32_t VerbsDeviceNumaNode(const std::string& device,
                            const std::string& sysfs = kInfinibandSysfs);

// The PCI address (domain:bus:device.function) that <device>/device
// resolves to; "" when the device has no parent or its parent is not a PCI
// function (Soft-RoCE).
std::string VerbsDevicePciAddress(const std::string& device,
                                  const std::string& sysfs = kInfinibandSysfs);

// The IPv4 address of `device`'s port `port`: the lowest GID table entry
// (<device>/ports/<port>/gids/<i>) that is an IPv4-mapped address
// (::ffff:a.b.c.d), as "a.b.c.d". Errors: NOT_FOUND "NO_DEVICE_ADDRESS",
// naming the device, when the table holds none (no IPv4 address on its
// interface, an InfiniBand port, or no such device).
absl::StatusOr<std::string> VerbsDeviceIpv4Address(
    const std::string& device, uint32_t port = 1,
    const std::string& sysfs = kInfinibandSysfs);

// "InfiniBand" or "Ethernet" for ibv_port_attr::link_layer (unspecified is
// InfiniBand, as ibv_devinfo says), "" for a value verbs does not define.
std::string LinkLayerName(uint8_t link_layer);

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_VERBS_VERBS_SYSFS_H_
