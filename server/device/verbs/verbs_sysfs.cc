#include "server/device/verbs/verbs_sysfs.h"

#include <infiniband/verbs.h>
#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "mrd/status.h"

namespace mrd::device {
namespace {

// The first line of a small sysfs file, without surrounding blanks; "" when
// it cannot be read.
std::string ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return std::string(absl::StripAsciiWhitespace(line));
}

bool IsHex(absl::string_view s, size_t min_length, size_t max_length) {
  return s.size() >= min_length && s.size() <= max_length &&
         std::all_of(s.begin(), s.end(),
                     [](char c) { return absl::ascii_isxdigit(c); });
}

// domain:bus:device.function, as the kernel names PCI functions
// ("0000:3b:00.1").
bool IsPciAddress(absl::string_view name) {
  std::vector<absl::string_view> parts = absl::StrSplit(name, ':');
  if (parts.size() != 3) return false;
  std::vector<absl::string_view> slot = absl::StrSplit(parts[2], '.');
  return IsHex(parts[0], 4, 8) && IsHex(parts[1], 2, 2) && slot.size() == 2 &&
         IsHex(slot[0], 2, 2) && IsHex(slot[1], 1, 1);
}

// The IPv4 address of a GID as sysfs prints it (eight groups of four hex
// digits) when it is IPv4-mapped and not 0.0.0.0; "" otherwise.
std::string MappedIpv4(absl::string_view gid) {
  std::vector<absl::string_view> groups = absl::StrSplit(gid, ':');
  if (groups.size() != 8) return "";
  std::array<uint32_t, 8> value{};
  for (size_t i = 0; i < groups.size(); ++i) {
    if (!IsHex(groups[i], 4, 4) || !absl::SimpleHexAtoi(groups[i], &value[i])) {
      return "";
    }
  }
  for (size_t i = 0; i < 5; ++i) {
    if (value[i] != 0) return "";
  }
  if (value[5] != 0xffff || (value[6] == 0 && value[7] == 0)) return "";
  return absl::StrCat(value[6] >> 8, ".", value[6] & 0xff, ".", value[7] >> 8,
                      ".", value[7] & 0xff);
}

}  // namespace

int32_t VerbsDeviceNumaNode(const std::string& device,
                            const std::string& sysfs) {
  int32_t node = -1;
  if (!absl::SimpleAtoi(
          ReadLine(absl::StrCat(sysfs, "/", device, "/device/numa_node")),
          &node) ||
      node < -1) {
    return -1;
  }
  return node;
}

std::string VerbsDevicePciAddress(const std::string& device,
                                  const std::string& sysfs) {
  const std::string link = absl::StrCat(sysfs, "/", device, "/device");
  char resolved[PATH_MAX];
  if (realpath(link.c_str(), resolved) == nullptr) return "";
  const std::string name = std::filesystem::path(resolved).filename();
  return IsPciAddress(name) ? name : "";
}

absl::StatusOr<std::string> VerbsDeviceIpv4Address(const std::string& device,
                                                   uint32_t port,
                                                   const std::string& sysfs) {
  const std::string dir =
      absl::StrCat(sysfs, "/", device, "/ports/", port, "/gids");
  // Entries by index: the lowest one with an IPv4 address wins.
  std::vector<std::pair<uint32_t, std::string>> entries;
  std::error_code error;
  for (const std::filesystem::directory_entry& entry :
       std::filesystem::directory_iterator(dir, error)) {
    uint32_t index = 0;
    if (absl::SimpleAtoi(entry.path().filename().string(), &index)) {
      entries.emplace_back(index, entry.path().string());
    }
  }
  std::sort(entries.begin(), entries.end());
  for (const auto& [index, path] : entries) {
    std::string address = MappedIpv4(ReadLine(path));
    if (!address.empty()) return address;
  }
  return MrdError(
      absl::StatusCode::kNotFound, "NO_DEVICE_ADDRESS",
      absl::StrCat("RDMA device ", device, " port ", port,
                   " has no IPv4 address in its GID table (", dir,
                   error ? absl::StrCat(": ", error.message()) : std::string(),
                   "); give its network interface an IPv4 address"));
}

std::string LinkLayerName(uint8_t link_layer) {
  switch (link_layer) {
    case IBV_LINK_LAYER_UNSPECIFIED:
    case IBV_LINK_LAYER_INFINIBAND:
      return "InfiniBand";
    case IBV_LINK_LAYER_ETHERNET:
      return "Ethernet";
    default:
      return "";
  }
}

}  // namespace mrd::device
