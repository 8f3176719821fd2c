// The Mooncake layout of the directory (docs/DIRECTORY.md, issue 27): with
// --directory_mooncake_prefix, each published name is also written as a
// segment of Mooncake's transfer engine, under the key its readers look a
// segment up by, <prefix>ram/<name>, in the JSON they parse (protocol
// "rdma": devices, buffers with one rkey per device, priority matrix).
//
// One name is one segment holding one buffer, the registration's memory.
// The buffer's location is "cpu:0" and the priority matrix lists every
// device for it, so that a reader picks a device (and its rkey) for it.
// lkeys, which only the memory's owner uses, are written as 0, one per
// device, since readers require as many as rkeys. mrd's own fields
// (tenant, node, epoch, peer addresses) go in an "mrd" object, which
// Mooncake's readers skip.
#ifndef MRD_SERVER_CORE_MOONCAKE_LAYOUT_H_
#define MRD_SERVER_CORE_MOONCAKE_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::core {

// A device as a Mooncake segment names it.
struct MooncakeDevice {
  std::string name;
  std::string gid;  // "" (the software device): the null GID is written
  uint32_t lid = 0;
};

// "<prefix>ram/<name>": the key Mooncake's readers look segment <name> up
// by, with <prefix> as "mooncake/" or "mooncake/<cluster id>/".
std::string MooncakeSegmentKey(absl::string_view prefix,
                               absl::string_view name);

// The segment's JSON for `entry` (its name, address, length and tokens;
// a token's device must be in `devices`, whose order is the rkeys').
std::string MooncakeSegmentJson(const v1::PublishedEntry& entry,
                                const std::vector<MooncakeDevice>& devices,
                                absl::Time now);

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_MOONCAKE_LAYOUT_H_
